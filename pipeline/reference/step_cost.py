"""What one draft token costs a speculative step, measured on this machine: the switch-off's break-even.

A speculative step with K draft tokens per request runs K draft forwards (none for prompt lookup)
and one target forward of K + 1 rows per request instead of a plain step's one row. In a linear
cost model that step costs 1 + K * c plain steps and brings 1 + K * a tokens per request
(a = acceptance), so speculation pays only while a >= c: the cost per draft token is the acceptance
a request must keep (PolicyConfig.draft_token_costs). On a GPU c is near 0; on these CPUs a verify
row costs a large fraction of a step (docs/benchmarks.md), so a fixed 10 % threshold keeps drafts
that lose. c depends on the running batch: with 8 requests a plain step already has 8 rows, and
the 8 K verify rows and the batched draft forwards cost relatively more (or less) than at batch 1,
so it is measured per batch size. A step is not quite linear in K: its calls and the verify's second row cost more
than each further token, so the policy also takes the cost at K=1 and prices a step affinely
(PolicyConfig.step_costs).
Two timings, by where the drafting runs: engines served apart (a draft engine, prompt lookup in the BLS) by their
forwards (`draft_token_cost`), a proposer inside the reference engine (make bench-engine's drafts, the served
engine's prompt lookup) by engine steps (`in_engine_draft_token_cost`); `pipeline repo` writes either
(`engine_draft_token_costs`). Forwards timed back to back left out a third
to a half of what such a draft token costs in the engine, and the switch-off probed a useless draft too long.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from pipeline.limits import TOKENS_PER_BLOCK
from pipeline.reference.model import LlamaModel, SequenceInput
from pipeline.reference.proposers import Draft, ProposalInput, Proposer

# Engine steps before in_engine_draft_token_cost times any (the prompts' prefill, then warm-up)
WARMUP_STEPS = 3
# Steps of one engine in a row in each of in_engine_draft_token_cost's rounds; the first of them is not timed
STEPS_PER_RUN = 4
# Cached tokens of each sequence when engine_draft_token_costs times the engines (the traffic's are unknown then):
# prompt lookup's grounded prompts and their answers (make bench-engine's: 326-570 tokens) run longer than 256, at
# which a plain step's attention was cheaper and every extra row dearer: timed at 256, the served policy with 8 in
# flight drafted 1.2-1.7 tokens a forward and ran 1.07-1.09x plain, timed at 512 1.12-1.25x (2026-12-07 19:49-,
# docs/benchmarks.md)
COST_CONTEXT = 512
# Draft rows a step's cost is timed for past its batch's one row each (`row_costs`), at most: every draft of 8 requests
# in flight at K = 6. Up to 12 rows, the cap before, the mean cost of a row past them was priced from those 12
# (PolicyProposer.fit_rows): at 8 in flight on Zen4 0.063 of a plain step a row where rows 13-40 cost 0.044, so the cut
# kept 2.0 tokens a forward of prompt lookup's K=5 drafts where it keeps 2.9 over the measured rows (8 in flight in
# process, the same table: 1.08x -> 1.14x plain, decoding steps 1.19x -> 1.32x; 2026-12-07 21:34-, docs/benchmarks.md)
MAX_DRAFT_ROWS = 48
# How engine_draft_token_costs times the engines (part of the key of the costs `pipeline repo` keeps)
ENGINE_TIMING = "as served: batch-invariant, compiled layers, measured decode threads"


def engine_code_digest(root: Path = Path(__file__).parent) -> str:
    """A digest of the reference engine's code (pipeline/reference: its Python, its kernels' C++ sources and headers),
    part of the key of the costs `pipeline repo` keeps: a cost timed on other code is measured again. Without it the
    default repository kept costs timed before a faster attention kernel (0.35 of a step per draft token at 4 in
    flight where the new kernel measured 0.19-0.24), and the switch-off stopped code prompts at concurrency 4."""
    digest = hashlib.sha256()
    for path in sorted([*root.glob("*.py"), *root.glob("csrc/*.cpp"), *root.glob("csrc/*.h")]):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def draft_token_cost(target: LlamaModel, draft: LlamaModel | None, ks: tuple[int, ...], batch: int = 1,
                     context: int = COST_CONTEXT, repeats: int = 20,
                     kv_dtypes: tuple[str | None, str | None] = (None, None)) -> tuple[float, ...]:
    """Cost of one draft token as a fraction of a plain step at each K of `ks`, for engines served apart (a draft
    engine's forwards, prompt lookup's verify rows): (verify(K + 1 rows) + K draft forwards - step) / (K * step).

    Measured with `batch` sequences of `context` cached tokens each (every forward runs all of them:
    one row each for a plain step and a draft step, K + 1 rows each for the verify), the plain step and every K's
    verify and drafting interleaved in each of `repeats` rounds: per K the median over the rounds of each round's
    cost, in wall time (what serving pays). A round's forwards run back to back, so a change in the machine's load
    between rounds cancels out, and the Ks are timed in the same rounds: SmolLM2's one-token draft cost 0.02 of a
    step in one process and 0.19 in the next while 5 tokens cost 0.15 and 0.45 (the machine's state, which a cost
    timed minutes apart in another process does not share; docs/benchmarks.md). CPU time would count both OpenMP
    threads' spinning; best rounds of separate forwards need not meet (docs/benchmarks.md has the spread of each).
    draft: the draft engine's model (it decodes step by step: K one-row forwards); None: prompt lookup (no draft
    forwards). A proposer inside the engine is timed by `in_engine_draft_token_cost`. Clipped at 0 (noise can time
    K + 1 rows below one). kv_dtypes: the target's and the draft's KV caches (`KVCache` kv_dtype; a served engine's
    own, `_served_engine`).
    """
    for k in ks:
        _check(k, batch)
    def call(model: LlamaModel, rows: int, kv_dtype: str | None) -> Callable[[], object]:
        return _forward_call(model, [rows] * batch, context, *_prefilled(model, batch, context, rows, kv_dtype))

    step = call(target, 1, kv_dtypes[0])
    verifies = [call(target, k + 1, kv_dtypes[0]) for k in ks]
    draft_step = call(draft, 1, kv_dtypes[1]) if draft is not None else None
    costs = [[] for _ in ks]
    for _ in range(repeats):
        for k, verify, at_k in zip(ks, verifies, costs):  # this round's, back to back
            plain = _seconds(step)
            extra = _seconds(verify) + (_seconds(lambda: [draft_step() for _ in range(k)]) if draft_step else 0.0)
            at_k.append((extra - plain) / (k * plain))
    return tuple(max(statistics.median(at_k), 0.0) for at_k in costs)


def in_engine_draft_token_cost(target: LlamaModel, make_proposer: Callable[[], Proposer], ks: tuple[int, ...],
                               prompts: list[list[int]], repeats: int = 8) -> tuple[float, ...]:
    """Cost of one draft token of a proposer that runs inside the engine (a draft model, EAGLE, Medusa), as a fraction
    of a plain step, at each K of `ks`, timed through engine steps on the traffic's own prompts: (speculative step -
    plain step) / (K * plain step).

    LLMEngines over `target` each run one request per prompt: one plainly, and one per K with its own proposer
    (`make_proposer()`) drafting K tokens every step; once every prompt is in and all have warmed up, each of `repeats`
    rounds runs, for each K, STEPS_PER_RUN plain steps, then as many speculative steps of K, and compares the median
    step of each run but its first (which finds the caches as the other engine left them): per K the median of the
    rounds' costs, in wall time, the Ks timed in the same rounds (so in the same machine state: the costs at K and at 1
    give a step's fixed part, PolicyConfig.step_costs). What forwards timed back to back leave out is in: the engine's
    own work on a speculative step (verify plan, acceptance, KV bookkeeping) and the target and draft evicting each
    other's weights from the caches (the trained pair's 1-layer draft, untrained, timed 0.36-0.48 of a step here where
    back-to-back forwards and proposes timed 0.10-0.34). The trained pair's 8 requests cost 0.87 a draft token in whole
    runs of make bench-engine's prompts; 256 tokens of random ids, one step of each engine in turn, timed 0.46-0.52:
    the context sets attention's share of a plain step (0.63 at 64 tokens in turn), and steps in turn charge both
    engines with the other's evictions (0.83 at 64 tokens in runs of 4; docs/benchmarks.md). make_proposer: a fresh
    proposer sized for len(prompts) requests of the longest prompt + (repeats * STEPS_PER_RUN + WARMUP_STEPS) *
    (max(ks) + 1) tokens. Clipped at 0.
    """
    from pipeline.reference.engine import EngineConfig, LLMEngine, Request

    if not prompts:
        raise ValueError("prompts is empty: give the traffic's prompts, one request each")
    for k in ks:
        _check(k, len(prompts))
    # a speculative step adds at most K + 1 tokens, the plain engine's len(ks) <= max(ks) runs a round 1 each: nobody
    # finishes
    new_tokens = (repeats * STEPS_PER_RUN + WARMUP_STEPS) * (max(ks) + 1)
    longest = max(len(p) for p in prompts)
    config = EngineConfig(max_batch_size=len(prompts), max_draft_len=max(ks), max_input_len=longest,
                          max_seq_len=longest + new_tokens + max(ks) + 1)
    plain = LLMEngine(target, config)
    speculative = [LLMEngine(target, config, make_proposer()) for _ in ks]
    for engine, k in [(plain, 0), *zip(speculative, ks)]:
        for i, prompt in enumerate(prompts):
            engine.add_request(Request(f"cost{i}", list(prompt), new_tokens, num_draft_tokens=k))
        for _ in range(WARMUP_STEPS):  # the first runs every prompt (the draft's at its first propose)
            engine.step()
    costs = [[] for _ in ks]
    for _ in range(repeats):
        for k, engine, at_k in zip(ks, speculative, costs):
            step, speculative_step = (statistics.median([_seconds(e.step) for _ in range(STEPS_PER_RUN)][1:])
                                      for e in (plain, engine))
            at_k.append((speculative_step - step) / (k * step))
    return tuple(max(statistics.median(at_k), 0.0) for at_k in costs)


def row_costs(model: LlamaModel, batch: int, max_rows: int = MAX_DRAFT_ROWS, context: int = COST_CONTEXT,
              repeats: int = 6, kv_dtype: str | None = None) -> tuple[float, ...]:
    """What a step at this running batch size costs with r draft rows, r = 0..max_rows, in plain steps of that batch
    (1.0 at r = 0): `batch` sequences of `context` cached tokens run one row each, and the r draft rows go round-robin
    over them. A step's GEMMs run its rows together, so its cost follows its row count, not whose rows they are; on
    AVX2 the int8 GEMM runs blocks of up to 6 rows, so the cost steps up where a block begins (SmolLM2's int8 engine
    at 4 in flight, 300 cached tokens: 1, 0.97, 1.05, 1.28, 1.41, 1.63 for 0-5 draft rows; docs/benchmarks.md), which
    a cost per draft token does not see (PolicyProposer.fit_rows, which prices rows past max_rows at the measured
    rows' mean).
    Forwards back to back, every r in each of `repeats` rounds (the order reversed every other round); per r the
    median round, made non-decreasing in r (noise can time more rows below fewer). kv_dtype: the KV cache's (`KVCache`
    kv_dtype; a served engine's own, `_served_engine`): a bf16 cache makes a plain step's attention cheaper and so
    every extra row dearer relative to it."""
    _check(1, batch)
    kv, tables = _prefilled(model, batch, context, 1 + max_rows, kv_dtype)
    steps = [_forward_call(model, [1 + r // batch + (i < r % batch) for i in range(batch)], context, kv, tables)
             for r in range(max_rows + 1)]  # r draft rows round-robin
    times = [[] for _ in steps]
    for i in range(repeats):
        for r in (range(max_rows + 1) if i % 2 == 0 else range(max_rows, -1, -1)):
            steps[r]()  # its first call warms what it alone uses
            times[r].append(_seconds(steps[r]))
    plain, costs = statistics.median(times[0]), []
    for at_r in times:
        costs.append(max(statistics.median(at_r) / plain, costs[-1] if costs else 1.0))
    return tuple(costs)


def _check(k: int, batch: int) -> None:
    """Refuse a K or batch that has no cost per draft token."""
    if k < 1:
        raise ValueError(f"k must be >= 1 (got {k}): the cost is per draft token")
    if batch < 1:
        raise ValueError(f"batch must be >= 1 (got {batch}): the sequences each forward runs")


def _prefilled(model: LlamaModel, batch: int, context: int, room: int,
               kv_dtype: str | None) -> tuple[object, list[list[int]]]:
    """(kv, block tables) of `batch` sequences of `context` cached tokens each in a KV cache of `kv_dtype`, prefilled
    now (which also warms the model up), with room for `room` more tokens each."""
    per_sequence = -(-(context + room) // TOKENS_PER_BLOCK)  # KV blocks of one sequence
    kv = model.new_kv_cache(batch * per_sequence, TOKENS_PER_BLOCK, kv_dtype)
    tables = [list(range(i * per_sequence, (i + 1) * per_sequence)) for i in range(batch)]
    model([SequenceInput([1] * context, 0, table) for table in tables], kv)
    return kv, tables


def _forward_call(model: LlamaModel, rows: list[int], context: int, kv,
                  tables: list[list[int]]) -> Callable[[], object]:
    """A call of one forward of rows[i] new tokens (all with logits, argmax only: a greedy request's rows) on the
    sequence of tables[i] after its `context` cached tokens (`_prefilled`)."""
    seqs = [SequenceInput([2] * n, context, table, logits_rows=list(range(n)), argmax_only=True)
            for n, table in zip(rows, tables)]
    return lambda: model(seqs, kv)


def _seconds(call: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


class EveryStepDraft:
    """A stand-in for prompt lookup when its cost is timed through engine steps: K draft tokens for every request at
    every step (copies of one token, which the target rejects almost always). A step's cost depends on how many tokens
    it verifies, not which; real lookups on made-up prompts would draft nothing."""

    needs_hidden_states = False

    def propose(self, inputs: list[ProposalInput]) -> list[Draft]:
        """K copies of token 0 for every request."""
        return [Draft(token_ids=[0] * inp.num_tokens) for inp in inputs]

    def update(self, request_id: str, num_accepted: int, num_proposed: int) -> None:
        """Nothing to adapt."""

    def release(self, request_id: str) -> None:
        """Nothing to forget."""


def engine_draft_token_costs(target_dir: str | Path, draft_dir: str | Path | None, ks: tuple[int, ...],
                             batches: tuple[int, ...] = (1,),
                             lookup_in_engine: bool = False) -> tuple[tuple[tuple[int, float], ...], ...]:
    """Per K of `ks`, ((batch, draft_token_cost), ...) of built engines (their qformats and kernels) at each running
    batch size, rounded to 0.01: the switch-off's break-even and the batch gate (draft_token_cost parameter, written
    when the repository is assembled; and one_token_cost, at K=1). A draft token's cost grows with the batch where
    the verify's rows are compute-bound (the AVX2 int8 GEMM: docs/benchmarks.md), so the engine's policy needs it per
    batch size.

    Each model is timed as a served engine runs it: loaded by LLMEngine with batch-invariant math (the
    serving default), so with its compiled layers and its decode steps on the thread count the engine measured
    (pipeline.reference.decode_threads). draft_dir None: prompt lookup. lookup_in_engine: prompt lookup drafts inside
    the target engine's steps (the reference engine serving mode ngram), so its cost is timed through engine steps
    (`in_engine_draft_token_cost`, with `EveryStepDraft` on `batch` prompts of made-up ids) rather than by forwards
    back to back, which leave out the engine's own work on a speculative step: at 4 in flight on SmolLM2's int8 engine
    forwards timed 0.19-0.33 of a step a draft token of K=5, engine steps 0.31-0.33, and served chat at concurrency 4
    paid about 0.28 (docs/benchmarks.md). Takes a few seconds per batch size for SmolLM2-sized engines.
    """
    target = _served_engine(target_dir)
    if lookup_in_engine:
        if draft_dir is not None:
            raise ValueError("lookup_in_engine times prompt lookup: give no draft engine")
        ids = random.Random(0)
        by_batch = [in_engine_draft_token_cost(target.model, EveryStepDraft, ks, [
            [ids.randrange(target.model.vocab_size) for _ in range(COST_CONTEXT)] for _ in range(batch)])
            for batch in batches]  # [batch][k]
    else:
        draft = _served_engine(draft_dir, draft=True) if draft_dir is not None else None
        kv_dtypes = (target.kv.kv_dtype, draft.kv.kv_dtype if draft is not None else None)
        by_batch = [draft_token_cost(target.model, draft.model if draft is not None else None, ks, batch=batch,
                                     kv_dtypes=kv_dtypes) for batch in batches]  # [batch][k]
    return tuple(tuple((batch, round(costs[i], 2)) for batch, costs in zip(batches, by_batch)) for i in range(len(ks)))


def engine_row_costs(target_dir: str | Path, batches: tuple[int, ...],
                     num_draft_tokens: int) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """((batch, `row_costs` at that batch up to its requests' drafts of num_draft_tokens or MAX_DRAFT_ROWS, rounded to
    0.01), ...) of a built target engine as served (its kernels, batch-invariant math, measured decode threads), for
    the row_cost parameter a target engine that runs prompt lookup gets when the repository is assembled. 47 s for
    SmolLM2's engine at batches 2-8 and K=5 on the Zen4 host (13 s of it at 8 in flight's 40 rows)."""
    target = _served_engine(target_dir)
    return tuple((batch, tuple(round(c, 2) for c in row_costs(target.model, batch,
                                                               min(MAX_DRAFT_ROWS, batch * num_draft_tokens),
                                                               kv_dtype=target.kv.kv_dtype)))
                 for batch in batches)


def _served_engine(engine_dir: str | Path, draft: bool = False):
    """An engine as served (an LLMEngine; its model and its KV cache's kv_dtype are what the costs are timed on):
    batch-invariant math (the serving default), so its compiled or fused layers, its decode steps on the thread count
    it measured and the KV cache it chose (bf16 where that kernel runs); a draft engine in the role the repository
    gives it (`engine_role: draft`: its output layer in 16 bits)."""
    from pipeline.reference.engine import LLMEngine

    return LLMEngine.from_engine_dir(engine_dir, batch_invariant=True, max_batch_size=1, draft=draft)
