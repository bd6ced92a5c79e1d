"""LLMEngine: a step-level in-flight scheduler over the paged-KV Llama model, with speculative decoding.

Every `step()` builds one batch and runs one target forward:
1. running requests (already prefilled) each bring their last token, plus a draft when a proposer
   is set: a chain or a tree, verified in the same forward;
2. waiting requests join while the batch has room (max_batch_size) and the step has token budget
   (max_num_tokens); a prompt longer than the budget is prefilled in chunks over several steps.
   A joining request first takes the cached KV blocks of its longest known prefix (whole blocks, then
   a copy of a cached partial block's matching slots), so it computes only the tokens after it; a
   request with external `draft_tokens` verifies them in its prefill.
Verification goes through `rejection_sampler.verify`: greedy (accepted prefix + the target's token)
or lossless rejection sampling with the draft's q. A row without a draft is plain decoding (an
empty draft verifies to exactly the sampled token). Requests leave as soon as they finish; their
blocks go back to the block manager; full blocks and the valid part of the last one stay cached for
later requests with the prefix.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.limits import EngineLimits
from pipeline.reference import compiled, decode_threads, fused_layers, greedy_tokens, row_attention
from pipeline.reference.kv_cache import BlockManager, OutOfBlocks, SequenceBlocks
from pipeline.reference.linear import argmax_output_layer, draft_output_layer
from pipeline.reference.model import LlamaModel, SequenceInput
from pipeline.reference.proposers import Draft, ProposalInput, Proposer
from pipeline.reference.rejection_sampler import DraftToVerify, verify
from pipeline.reference.sampling import SamplingParams, position_generator, probabilities, process_logits, request_seed
from pipeline.reference.tree import chain_parents, node_depths, path_to
from pipeline.seeds import ROLE_PROPOSER, derive_seed
from pipeline.sequences import find_stop
from pipeline.spec_stats import SpecStats

log = logging.getLogger(__name__)
BF16_KV_CACHE_ENV = "REFERENCE_BF16_KV_CACHE"  # "0": a float32 KV cache (EngineConfig.bf16_kv_cache's default)

__all__ = ["EngineConfig", "EngineInputError", "EngineStats", "LLMEngine", "Request", "RequestOutput",
           "SamplingParams", "SpecStats"]


class EngineInputError(ValueError):
    """A request the engine refuses; names the offending field and how to fix it."""

    def __init__(self, field: str, fix: str):
        self.field, self.fix = field, fix
        super().__init__(f"{field}: {fix}")


@dataclass
class Request:
    """One generation request (the tensorrtllm backend's inputs: pipeline/contracts/triton-trtllm-backend-models.json)."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    draft_tokens: list[int] | None = None  # external draft to verify; the request then finishes after one step
    draft_probs: torch.Tensor | None = None  # [len(draft_tokens), vocab] q of the external draft (lossless)
    num_draft_tokens: int | None = None  # K for the engine's proposer (None: max_draft_len)
    return_generation_logits: bool = False
    return_log_probs: bool = False
    return_context_logits: bool = False  # computes every prompt position: the prompt's cached KV is not reused

    @property
    def argmax_only(self) -> bool:
        """Whether the target's logits serve only their argmax: greedy sampling without penalties or bans, and no
        logits or log-probs returned (the model may screen them: SequenceInput.argmax_only)."""
        return self.sampling.argmax_only and not (self.return_generation_logits or self.return_log_probs
                                                  or self.return_context_logits)


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "end_id" | "cancelled" | "error"
    error: str | None = None
    generation_logits: torch.Tensor | None = None  # [len(new_token_ids), vocab] raw target logits
    log_probs: list[float] | None = None  # log_softmax of those raw logits at each new token
    context_logits: torch.Tensor | None = None  # [prompt_len, vocab] raw logits, on the output that ends the prompt
    stats: SpecStats = field(default_factory=SpecStats)


@dataclass(frozen=True)
class EngineConfig(EngineLimits):
    """Limits of one engine (the build_config of an engine directory) and KV cache sizing."""

    num_blocks: int | None = None  # None: enough for max_batch_size full-length sequences, plus a spare batch for reuse
    kv_cache_quant_algo: str | None = None  # None | "INT8"
    # an unquantized KV cache in bf16 (kv_cache.py; TensorRT-LLM keeps a 16-bit model's in 16 bits), attended on
    # vdpbf16ps (row_attention_bf16) where the CPU has AVX512-BF16, else on its AVX2 build, the same bits (no AVX2:
    # float32, logged): half the bytes a step's attention reads, a SmolLM2 step 4-17% faster after 128-1200 cached
    # tokens; greedy texts move as with any rounding (perplexity: docs/engine.md). On unless REFERENCE_BF16_KV_CACHE=0
    # (the test suite's default).
    bf16_kv_cache: bool = field(default_factory=lambda: os.environ.get(BF16_KV_CACHE_ENV, "1") != "0")
    batch_invariant: bool = False  # bitwise batch-independent math (see model.py); exactness tests turn it on
    # float32 int8_sq engines: forwards on the row attention kernel as one C++ call (fused_layers.py), the others with
    # the ops between the int8 GEMMs compiled by inductor (compiled.py, docs/engine.md "Decode step"; not built where
    # every forward is fused: an INT8 KV cache or a hidden-state proposer keeps some off the fused int8 layers);
    # others ignore it.
    # On unless REFERENCE_COMPILED_LAYERS=0 (the test suite's default).
    compiled_layers: bool = field(default_factory=lambda: os.environ.get(compiled.ENV, "1") != "0")

    @classmethod
    def from_engine_config(cls, config: dict, **overrides) -> "EngineConfig":
        """From an engine directory's config.json dict."""
        quant = config.get("pretrained_config", {}).get("quantization") or {}
        values = EngineLimits.build_config_values(config.get("build_config", {}))
        values["kv_cache_quant_algo"] = quant.get("kv_cache_quant_algo")
        return cls(**{**values, **overrides})

    def blocks_needed(self) -> int:
        """Default KV block count."""
        return 2 * self.max_batch_size * -(-(self.max_seq_len + self.max_draft_len + 1) // self.tokens_per_block)


@dataclass
class EngineStats:
    """Engine-wide counters."""

    steps: int = 0
    computed_tokens: int = 0  # tokens that went through the model (prefix-cache hits excluded)
    cached_prompt_tokens: int = 0  # prompt tokens served from reused KV blocks
    preemptions: int = 0
    proposer_errors: int = 0  # steps whose drafting raised and ran without drafts (LLMEngine._propose)
    spec: SpecStats = field(default_factory=SpecStats)  # summed over finished requests


@dataclass
class _Sequence:
    """Scheduler state of one request."""

    request: Request
    tokens: list[int]  # prompt + committed generated tokens
    seed: int  # the token at sequence index i is drawn from position_generator(seed, i)
    generator: torch.Generator  # the in-engine proposer's stream (derive_seed(seed, ROLE_PROPOSER))
    blocks: SequenceBlocks = field(default_factory=SequenceBlocks)
    num_computed: int = 0  # leading tokens whose KV is in the cache
    prefilled: bool = False  # the prompt is fully computed and at least one token generated
    hidden: list[torch.Tensor] = field(default_factory=list)  # [n, hidden] rows for the proposer (see ProposalInput)
    stats: SpecStats = field(default_factory=SpecStats)
    context_logits: list[torch.Tensor] | None = None  # prompt rows so far, while return_context_logits waits for them

    @property
    def wants_context(self) -> bool:
        """Whether this step's prompt rows still need their logits (return_context_logits, not sent yet)."""
        return self.request.return_context_logits and self.context_logits is not None

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt


@dataclass
class _Scheduled:
    """One sequence's part of this step's forward."""

    seq: _Sequence
    new_tokens: list[int]
    draft: Draft | None = None  # tokens after the root; None for a partial prefill chunk
    draft_probs: torch.Tensor | None = None

    @property
    def completes_prompt(self) -> bool:
        return self.draft is not None


class LLMEngine:
    """In-flight batching engine over one LlamaModel (see the module docstring)."""

    def __init__(self, model: LlamaModel, config: EngineConfig | None = None, proposer: Proposer | None = None):
        self.model = model
        self.config = config or EngineConfig()
        self.proposer = proposer
        model.batch_invariant = self.config.batch_invariant
        kv_dtype = self._choose_kv_dtype()
        if self.config.compiled_layers and model.compiled_layers is None:
            if model.fused_layers is None and compiled.eligible(model) is None:
                model.fused_layers = fused_layers.build(model)  # its forwards on the row attention kernel in one C++ call
            # the regions take the forwards the fused layers do not (3.7 s to load, 17 to compile)
            if not self._fused_layers_run_every_forward(kv_dtype):
                model.compiled_layers = compiled.build(model)  # None, saying why, where the model is not eligible
        if self.config.max_seq_len > model.rope_cos.shape[0]:
            raise ValueError(f"max_seq_len {self.config.max_seq_len} exceeds the model's max_position_embeddings "
                             f"{model.rope_cos.shape[0]}; build the engine with a smaller max_seq_len")
        num_blocks = self.config.num_blocks or self.config.blocks_needed()
        self.kv = model.new_kv_cache(num_blocks, self.config.tokens_per_block, kv_dtype)
        decode_threads.choose(model, self.kv)  # before any request: it times forwards on the first blocks
        greedy_tokens.kernel()  # built (once per machine) or loaded now, not in a request's first step
        self.blocks = BlockManager(num_blocks, self.config.tokens_per_block)
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.stats = EngineStats()
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (cancellations)
        self._proposer_errors_logged: set[type] = set()  # see _propose

    def _choose_kv_dtype(self) -> str | None:
        """The KV cache's kv_dtype: the engine's quantization, else "BF16" where bf16_kv_cache asks for it, its
        attention kernel runs here and no proposer verifies trees (Medusa, EAGLE: their forwards gather the keys for
        SDPA, which a bf16 cache's layout makes dearer), else None (float32)."""
        if self.config.kv_cache_quant_algo is not None or not self.config.bf16_kv_cache:
            return self.config.kv_cache_quant_algo
        if self.proposer is not None and self.proposer.needs_hidden_states:
            return None
        if row_attention.bf16_kernel() is None:
            log.info("%s: the bf16 KV cache needs the bf16 row attention kernel (AVX512-BF16 or AVX2), which does "
                     "not run here: the KV cache stays float32", BF16_KV_CACHE_ENV)
            return None
        return "BF16"

    def _fused_layers_run_every_forward(self, kv_dtype: str | None) -> bool:
        """Whether every forward of this engine runs on the fused layers, so compiled regions would never run: the
        fused int8 layers, or exact mode (every forward on the row attention kernel, model.forward), over an
        unquantized KV cache (`kv_dtype`: the cache's to be, float32 or bf16), with no proposer that reads hidden
        states (Medusa and EAGLE verify trees and capture layers, off that kernel)."""
        fused = self.model.fused_layers
        return (fused is not None and (self.config.batch_invariant or isinstance(fused, fused_layers.FusedInt8Layers))
                and kv_dtype != "INT8"
                and not (self.proposer is not None and self.proposer.needs_hidden_states))

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path, proposer: Proposer | None = None, choices=None,
                        dynamic_top_k: int | None = None, draft: bool = False, **config_overrides) -> "LLMEngine":
        """Load an engine directory (config.json + rank0.safetensors) with its build limits.

        choices / dynamic_top_k: the tree of a Medusa / EAGLE engine (see speculation.engine_proposer);
        given either, the engine speculates with the proposer built from its own stored weights.
        draft: the engine serves a draft model (tensorrt_llm_draft), whose logits only propose: a float32 output layer
        runs in 16 bits where a kernel for them runs (linear.draft_output_layer, as DraftModelProposer's draft does).
        """
        from pipeline.reference.checkpoint import load_engine
        from pipeline.reference.speculation import engine_proposer

        config, state = load_engine(engine_dir, int8_kernels=True)
        engine_config = EngineConfig.from_engine_config(config, **config_overrides)
        pretrained = config.get("pretrained_config", config)
        model = LlamaModel(pretrained, state, batch_invariant=engine_config.batch_invariant)
        head = draft_output_layer(model.lm_head_linear) if draft else model.lm_head_linear
        if head is not model.lm_head_linear:  # and its greedy rows on that layer's int8 screen where it runs
            model.lm_head_linear, model.argmax_layer = head, argmax_output_layer(head, model.dtype)
        if proposer is None and (choices is not None or dynamic_top_k is not None):
            proposer = engine_proposer(pretrained, state, model, choices=choices, dynamic_top_k=dynamic_top_k,
                                       max_batch_size=engine_config.max_batch_size, max_seq_len=engine_config.max_seq_len)
        return cls(model, engine_config, proposer)

    # ------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a request; raises EngineInputError for bad input without touching other requests."""
        if any(s.request.request_id == request.request_id for s in (*self.waiting, *self.running)):
            raise EngineInputError("request_id", f"{request.request_id!r} is already running; use a unique id")
        self.validate(request)
        seed = request_seed(request.sampling)
        self.waiting.append(_Sequence(request=request, tokens=list(request.prompt_ids), seed=seed,
                                      generator=torch.Generator().manual_seed(derive_seed(seed, ROLE_PROPOSER)),
                                      context_logits=[] if request.return_context_logits else None))

    def cancel(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; its final output comes from the next step(). False if unknown."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request.request_id == request_id:
                    queue.remove(seq)
                    self._pending.append(self._finish(seq, [], "cancelled"))
                    return True
        return False

    def has_unfinished(self) -> bool:
        """True while any request waits, runs or has an undelivered output."""
        return bool(self.waiting or self.running or self._pending)

    def abort_running(self, error: str) -> list[RequestOutput]:
        """Finish every running request with `error` (after a failed step: their KV may be partial); waiting ones stay."""
        failed, self.running = self.running, []
        return [self._finish(seq, [], "error", error=error) for seq in failed]

    def validate(self, r: Request) -> None:
        """Raise EngineInputError(field, fix) for the first problem of a request against this engine's limits."""
        cfg, vocab = self.config, self.model.vocab_size
        if not r.prompt_ids:
            raise EngineInputError("prompt_ids", "send at least one token")
        if len(r.prompt_ids) > cfg.max_input_len:
            raise EngineInputError("prompt_ids", f"{len(r.prompt_ids)} tokens exceed max_input_len {cfg.max_input_len}; shorten the prompt")
        if any(not 0 <= t < vocab for t in r.prompt_ids):
            raise EngineInputError("prompt_ids", f"token ids must be in [0, {vocab})")
        if r.max_new_tokens < 1:
            raise EngineInputError("max_new_tokens", "ask for at least one token")
        if len(r.prompt_ids) + r.max_new_tokens > cfg.max_seq_len:
            raise EngineInputError("max_new_tokens", f"prompt + max_new_tokens exceed max_seq_len {cfg.max_seq_len}; ask for at most {cfg.max_seq_len - len(r.prompt_ids)}")
        capacity = self.blocks.num_blocks * cfg.tokens_per_block
        if len(r.prompt_ids) + r.max_new_tokens + cfg.max_draft_len + 1 > capacity:
            raise EngineInputError("max_new_tokens", f"the KV cache holds {capacity} tokens; ask for fewer tokens or give the engine more num_blocks")
        if r.num_draft_tokens is not None and not 0 <= r.num_draft_tokens <= cfg.max_draft_len:
            raise EngineInputError("num_draft_tokens", f"use 0..{cfg.max_draft_len} (the engine's max_draft_len)")
        if r.draft_tokens is not None:
            if len(r.draft_tokens) > cfg.max_draft_len:
                raise EngineInputError("draft_tokens", f"{len(r.draft_tokens)} tokens exceed max_draft_len {cfg.max_draft_len}; send fewer")
            if any(not 0 <= t < vocab for t in r.draft_tokens):
                raise EngineInputError("draft_tokens", f"token ids must be in [0, {vocab})")
        if r.draft_probs is not None:
            want = (len(r.draft_tokens or []), vocab)
            if r.draft_tokens is None or tuple(r.draft_probs.shape) != want:
                raise EngineInputError("draft_probs", f"shape must be [len(draft_tokens), vocab] = {list(want)}, got {list(r.draft_probs.shape)}")
        for name, fix in r.sampling.problems(vocab):
            raise EngineInputError(f"sampling.{name}", fix)

    # ------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule, run one target forward, verify/sample, and return this step's outputs."""
        outputs, self._pending = self._pending, []
        batch = self._schedule()
        if not batch:
            return outputs
        self.stats.steps += 1
        inputs = [self._sequence_input(s) for s in batch]
        want_hidden = self.proposer is not None and getattr(self.proposer, "needs_hidden_states", False)
        capture = getattr(self.proposer, "capture_layers", None) if want_hidden else None
        result = self.model(inputs, self.kv, return_hidden=want_hidden, capture_layers=capture)
        self.stats.computed_tokens += sum(len(s.new_tokens) for s in batch)
        logit_row = hidden_row = 0
        for sched, inp in zip(batch, inputs):
            n_rows = len(inp.logits_rows)
            logits = result.logits[logit_row:logit_row + n_rows]  # [n_rows, vocab]
            hidden = result.hidden_states[hidden_row:hidden_row + len(sched.new_tokens)] if want_hidden else None
            logit_row += n_rows
            hidden_row += len(sched.new_tokens)
            out = self._advance(sched, logits, hidden)
            if out is not None:
                outputs.append(out)
        return outputs

    def _schedule(self) -> list[_Scheduled]:
        """Pick this step's rows: running requests (with drafts), then waiting ones while room and budget last."""
        budget = self.config.max_num_tokens
        batch: list[_Scheduled] = []
        decoding = [s for s in self.running if s.prefilled]
        drafts = dict(zip((s.request.request_id for s in decoding), self._propose(decoding)))
        for seq in list(self.running):
            if seq not in self.running:  # preempted to make room for an earlier request
                continue
            if not seq.prefilled:
                sched = self._prefill_rows(seq, budget)
                if sched is None:
                    continue
                if not self._reserve(seq, len(sched.new_tokens)):
                    self._requeue(seq)  # its committed chunks stay cached for the retry
                    continue
            else:
                draft = drafts[seq.request.request_id]
                sched = _Scheduled(seq, [seq.tokens[-1]] + draft.token_ids, draft, draft.probs)
                if not self._reserve(seq, len(sched.new_tokens)):
                    sched = _Scheduled(seq, [seq.tokens[-1]], Draft(token_ids=[]))  # drop the draft first
                    if not self._reserve(seq, 1) and not self._preempt_for(seq):
                        continue
            batch.append(sched)
            budget -= len(sched.new_tokens)
        while self.waiting and len(batch) < self.config.max_batch_size and budget > 0:
            seq = self.waiting[0]
            seq.blocks = SequenceBlocks() if seq.wants_context else self.blocks.match_prefix(seq.tokens)
            seq.num_computed = seq.blocks.num_cached
            sched = self._prefill_rows(seq, budget)
            if sched is None or not self._reserve(seq, len(sched.new_tokens)):
                self.blocks.free(seq.blocks)  # do not pin cached blocks while waiting
                seq.num_computed = 0
                break
            self._copy_partial_match(seq)
            self.stats.cached_prompt_tokens += seq.num_computed
            self.waiting.popleft()
            self.running.append(seq)
            batch.append(sched)
            budget -= len(sched.new_tokens)
        return batch

    def _prefill_rows(self, seq: _Sequence, budget: int) -> _Scheduled | None:
        """The rest of seq's prompt (plus its external draft, or the proposer's when it drafts from the tokens
        alone) if it fits the budget, else a chunk; None if nothing fits."""
        remaining = seq.tokens[seq.num_computed:]
        external = list(seq.request.draft_tokens or [])
        if len(remaining) + len(external) <= budget:
            if seq.request.draft_tokens is None and getattr(self.proposer, "drafts_at_prefill", False):
                draft = self._propose([seq])[0]  # e.g. prompt lookup: a continued sequence drafts from its first step
                if len(remaining) + len(draft.token_ids) <= budget:
                    return _Scheduled(seq, remaining + draft.token_ids, draft, draft.probs)
            return _Scheduled(seq, remaining + external, Draft(token_ids=external), seq.request.draft_probs)
        chunk = min(budget, len(remaining) - 1)  # the last prompt token waits for the completing step
        return _Scheduled(seq, remaining[:chunk]) if chunk > 0 else None

    def _propose(self, seqs: list[_Sequence]) -> list[Draft]:
        """Drafts for running requests from the proposer (empty drafts when there is none, or where its gate,
        `skips_step` (the policy's), says nobody drafts this step: then no inputs are built).

        Drafting is an optimization: where the proposer (or its gate) raises, this step's requests run without
        drafts (counted in stats.proposer_errors, the first error of each type logged) instead of the step failing
        every request in it. Plain decoding's tokens are what speculation would have produced."""
        if self.proposer is None or not seqs:
            return [Draft(token_ids=[]) for _ in seqs]
        try:
            return self._proposer_drafts(seqs)
        except Exception as exc:
            self.stats.proposer_errors += 1
            if type(exc) not in self._proposer_errors_logged:  # by type: a message may differ every step
                self._proposer_errors_logged.add(type(exc))
                log.warning("the proposer raised %s: %s; this step's requests run without drafts", type(exc).__name__,
                            exc, exc_info=True)
            return [Draft(token_ids=[]) for _ in seqs]

    def _proposer_drafts(self, seqs: list[_Sequence]) -> list[Draft]:
        """`_propose` where a proposer runs: empty drafts where its gate says nobody drafts this step, else its
        drafts."""
        gate = getattr(self.proposer, "skips_step", None)
        if gate is not None and gate([s.request.request_id for s in seqs], [s.num_generated for s in seqs]):
            return [Draft(token_ids=[]) for _ in seqs]
        inputs = []
        for seq in seqs:
            k = seq.request.num_draft_tokens if seq.request.num_draft_tokens is not None else self.config.max_draft_len
            k = min(k, self.config.max_seq_len - len(seq.tokens) - 1)
            hidden = torch.cat(seq.hidden) if seq.hidden else None
            inputs.append(ProposalInput(request_id=seq.request.request_id, token_ids=list(seq.tokens), num_tokens=max(k, 0),
                                        hidden_states=hidden, temperature=seq.request.sampling.temperature,
                                        generator=seq.generator, max_new_tokens=seq.request.max_new_tokens,
                                        num_generated=seq.num_generated))
        drafts = self.proposer.propose(inputs)
        return [_first_nodes(d, inp.num_tokens) for d, inp in zip(drafts, inputs)]

    def _reserve(self, seq: _Sequence, num_new: int) -> bool:
        """Make sure seq's blocks hold num_computed + num_new tokens."""
        try:
            self.blocks.ensure_capacity(seq.blocks, seq.num_computed + num_new)
            return True
        except OutOfBlocks:
            return False

    def _preempt_for(self, seq: _Sequence) -> bool:
        """Requeue requests scheduled after seq (newest first; they recompute from cached blocks later) until seq gets a block."""
        for victim in reversed(self.running[self.running.index(seq) + 1:]):
            self._requeue(victim)
            if self._reserve(seq, 1):
                return True
        self._requeue(seq)
        return False

    def _copy_partial_match(self, seq: _Sequence) -> None:
        """Copy-on-partial-reuse: the matched slots of a cached block into seq's own block (the source stays intact)."""
        if seq.blocks.copy_source is None:
            return
        source, n = seq.blocks.copy_source
        bs = self.config.tokens_per_block
        start = len(seq.blocks.hashes) * bs  # first token after the reused full blocks
        self.kv.copy_slots(torch.arange(source * bs, source * bs + n), self._slots(seq, list(range(start, start + n))))
        self.blocks.release_copy_source(seq.blocks)

    def _requeue(self, seq: _Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.blocks, seq.tokens, seq.num_computed)
        seq.num_computed, seq.prefilled, seq.hidden = 0, False, []
        if seq.wants_context:
            seq.context_logits = []
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _sequence_input(self, sched: _Scheduled) -> SequenceInput:
        seq = sched.seq
        n = len(sched.new_tokens)
        parents = None
        rows: list[int] = []
        if sched.completes_prompt:
            n_draft = len(sched.draft.token_ids)
            root = n - n_draft - 1  # the last committed token
            rows = list(range(root, n))
            if sched.draft.parents is not None:
                parents = list(range(-1, root - 1)) + [root - 1] + [root + 1 + p for p in sched.draft.parents]
        if seq.wants_context:
            rows = list(range(n))  # every prompt row (then the draft's), for context_logits
        return SequenceInput(sched.new_tokens, seq.num_computed, seq.blocks.blocks, parents=parents, logits_rows=rows,
                             argmax_only=seq.request.argmax_only)

    # ------------------------------------------------------------ after the forward
    def _advance(self, sched: _Scheduled, logits: torch.Tensor, hidden: torch.Tensor | None) -> RequestOutput | None:
        """Verify / sample one sequence's rows and commit its tokens; returns its output (None mid-prefill)."""
        seq, req = sched.seq, sched.seq.request
        context = None
        if seq.wants_context:  # logits holds every row: keep the prompt's, verify from the root on
            prompt_rows = len(sched.new_tokens) - (len(sched.draft.token_ids) if sched.completes_prompt else 0)
            seq.context_logits.append(logits[:prompt_rows])
            if sched.completes_prompt:
                context, seq.context_logits = torch.cat(seq.context_logits), None
                logits = logits[prompt_rows - 1:]
        if not sched.completes_prompt:  # a prefill chunk: KV written, nothing to sample yet
            seq.num_computed += len(sched.new_tokens)
            self.blocks.commit(seq.blocks, seq.tokens, seq.num_computed)
            if hidden is not None:
                seq.hidden.append(hidden)
            return None
        draft = sched.draft
        parents = draft.parents if draft.parents is not None else chain_parents(len(draft.token_ids))
        root_index = seq.num_computed + len(sched.new_tokens) - len(draft.token_ids) - 1  # sequence index of the root
        contexts = [seq.tokens[:root_index + 1] + [draft.token_ids[j] for j in path_to(parents, r - 1)]
                    for r in range(len(draft.token_ids) + 1)]  # row r: root (r = 0) or node r - 1
        processed = process_logits(logits, contexts, seq.num_prompt, req.sampling)  # [rows, vocab]
        p = None if req.sampling.greedy else probabilities(processed, req.sampling)
        positions = [len(c) for c in contexts]  # row r samples the token at sequence index positions[r]
        verdict = verify(processed, [DraftToVerify(draft.token_ids, draft.parents, sched.draft_probs, req.sampling.greedy,
                                                    row_generator=lambda r: position_generator(seq.seed, positions[r]))],
                         p)[0]
        # KV: the root and the accepted path are valid; move a tree path next to the root
        path_slots = [root_index + 1 + j for j in verdict.accepted_nodes]
        wanted_slots = list(range(root_index + 1, root_index + 1 + verdict.num_accepted))
        if path_slots != wanted_slots:
            self.kv.copy_slots(self._slots(seq, path_slots), self._slots(seq, wanted_slots))
        first_row = len(sched.new_tokens) - len(draft.token_ids) - 1
        rows = [0] + [j + 1 for j in verdict.accepted_nodes]  # logits rows that produced the new tokens
        if self.proposer is not None and draft.token_ids:
            self.proposer.update(req.request_id, verdict.num_accepted, len(draft.token_ids))
        if hidden is not None:
            own = [first_row + r for r in rows]
            seq.hidden = ([*seq.hidden, hidden[:first_row]] if not seq.prefilled else []) + [hidden[own]]
        seq.prefilled = True
        new = verdict.token_ids[:req.max_new_tokens - seq.num_generated]
        seq.tokens += new
        keep, reason = find_stop(seq.tokens[seq.num_prompt:], len(new), req.sampling.end_id, req.sampling.stop_words)
        if keep < len(new):
            del seq.tokens[len(seq.tokens) - len(new) + keep:]
        new = new[:keep]
        depth = max(node_depths(parents), default=0)
        seq.stats.record_step(depth, len(draft.token_ids), verdict.num_accepted, len(new))
        seq.num_computed = min(root_index + 1 + verdict.num_accepted, len(seq.tokens) - 1)
        self.blocks.commit(seq.blocks, seq.tokens, seq.num_computed)
        outputs = {"generation_logits": logits[rows[:len(new)]] if req.return_generation_logits else None,
                   "log_probs": _log_probs(logits[rows[:len(new)]], new) if req.return_log_probs else None,
                   "context_logits": context}
        if reason is None and (seq.num_generated >= req.max_new_tokens or req.draft_tokens is not None):
            reason = "length"
        if reason is not None:
            self.running.remove(seq)
            return self._finish(seq, new, reason, **outputs)
        return RequestOutput(req.request_id, new, stats=seq.stats, **outputs)

    def _slots(self, seq: _Sequence, positions: list[int]) -> torch.Tensor:
        bs = self.config.tokens_per_block
        return torch.tensor([seq.blocks.blocks[i // bs] * bs + i % bs for i in positions], dtype=torch.long)

    def _finish(self, seq: _Sequence, new: list[int], reason: str, error: str | None = None,
                **outputs) -> RequestOutput:
        # num_computed counts only tokens whose KV came from seq.tokens (not the last sampled token, not
        # rejected draft slots); after a failed step, cache nothing partial
        self.blocks.free(seq.blocks, seq.tokens, 0 if reason == "error" else seq.num_computed)
        if self.proposer is not None:
            self.proposer.release(seq.request.request_id)
        self.stats.spec.add(seq.stats)
        return RequestOutput(seq.request.request_id, new, finished=True, finish_reason=reason, error=error,
                             stats=seq.stats, **outputs)


def _log_probs(logits: torch.Tensor, token_ids: list[int]) -> list[float]:
    """log_softmax(logits[i])[token_ids[i]] for each row: the model's own log-probability of each token."""
    rows = torch.log_softmax(logits.float(), dim=-1)
    return rows[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.long)].tolist()


def _first_nodes(draft: Draft, k: int) -> Draft:
    """The draft cut to its first k nodes (still a valid chain or tree: parents come before children)."""
    if len(draft.token_ids) <= k:
        return draft
    return Draft(token_ids=draft.token_ids[:k], probs=None if draft.probs is None else draft.probs[:k],
                 parents=None if draft.parents is None else draft.parents[:k])
