"""`make bench-engine`: the reference engine's plain and speculative throughput, side by side with transformers.

One run measures, for every pair, at batch 1 and with 8 concurrent requests, 128 new tokens each:
our plain decoding, our speculative decoding per K (policy wrapper on: switch-off below
min_acceptance_rate), acceptance (overall and per draft position), each speedup over whole requests and over the
decoding steps alone (after every prompt's first token: `Rates.decode`); for the trained pairs also the
cost-aware switch-off (PolicyConfig.draft_token_costs and one_token_costs, measured per K and at K=1, at batch 1 and
with 8 in flight, through engine steps by pipeline.reference.step_cost: the break-even acceptance, and a step's fixed
cost) and, with 8 in flight, drafts made one request at a time (UnsharedDrafts) against the shared batched draft
step; transformers' generate,
assisted generation with a fixed K (assistant_model + num_assistant_tokens, schedule "constant") or prompt lookup
(prompt_lookup_num_tokens) at batch 1; and the memory roofline (weight bytes / read bandwidth, read right
before each round's plain batch-1 run: the plain decoding's share of it is the median over the rounds of each
plain run's decoding steps against its own read, as the speedups pair runs of one round). Pairs:
- smollm2-draft: SmolLM2-135M-Instruct with its derived 4-layer draft (`make models`), chat prompts;
- smollm2-ngram: SmolLM2-135M-Instruct with prompt lookup on input-grounded prompts (rewrite a
  given text, document a given function); with --served-lookup also "ngram as served": the proposer and policy the
  repository's tensorrt_llm model runs (adaptive K, the cut, the costs `make repo` measured, the batch gate);
- trained: the 6-layer/384 target and 1-layer/128 draft of `make trained-pair`, local-text prompts;
- trained-weak: the same target with an untrained draft of the same shape (acceptance near 0).
Writes docs/bench-engine.json, docs/bench-engine.md and docs/img/bench-engine-speedup.png.

    python -m pipeline.apps.bench_engine [--ks 2,4] [--smollm2-ks 4] [--prompts 2] [--full] [--pairs trained,smollm2-ngram]
        [--repeats 3] [--trained-repeats 9] [--trained-engine out/trained-int8/engines/target]
        [--smollm2-engine out/default/engines/target --served-lookup out/default/model_repo]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from pipeline.reference.draft_model import DraftModelProposer
from pipeline.reference.engine import EngineConfig, LLMEngine, Request
from pipeline.reference.model import LlamaModel, config_from_hf
from pipeline.reference.policy import PolicyConfig, PolicyProposer
from pipeline.reference.proposers import Draft, NgramProposer, ProposalInput
from pipeline.reference.step_cost import in_engine_draft_token_cost
from pipeline.repo.validate import load_config
from pipeline.serving.reference_adapter import lookup_proposer
from pipeline.spec_stats import SpecStats, aggregate
from pipeline.corpus import local_text

NEW_TOKENS = 128
BATCH = 8
SMOLLM2 = Path("models/SmolLM2-135M-Instruct")
SMOLLM2_DRAFT = Path("models/SmolLM2-135M-draft-L4")
TRAINED = Path("models/trained-pair")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Pair:
    """A target, how drafts are made for it, and the prompts it is measured on."""

    name: str
    target: Path
    draft: Path | None  # None: prompt lookup (n-gram)
    prompts: list[list[int]]
    weak: bool = False  # an untrained draft of the trained draft's shape


# ----------------------------------------------------------------------------- prompts


def chat(tokenizer, message: str) -> list[int]:
    """Token ids of one user message in the model's chat template, ready for the answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """Open questions in SmolLM2's chat template."""
    questions = ["Explain how a hash table works and when it is slow.", "Write a short story about a lighthouse keeper.",
                 "What are the main causes of inflation?", "Describe the water cycle to a ten-year-old."]
    return [chat(tokenizer, q) for q in questions[:n]]


def grounded_prompts(tokenizer, n: int) -> list[list[int]]:
    """Input-grounded tasks whose answers copy the input: rewriting a given text, documenting given code."""
    text = local_text(6000)[3000:4200]
    code = inspect.getsource(textwrap.dedent)
    tasks = [f"Rewrite the following text, keeping every sentence and fixing only typos:\n\n{text}",
             f"Add a comment above every line of this Python function and return the whole function:\n\n{code}",
             f"Repeat the following text exactly:\n\n{local_text(9000)[7000:8000]}"]
    return [chat(tokenizer, t) for t in tasks[:n]]


def local_prompts(tokenizer, n: int) -> list[list[int]]:
    """Beginnings of local-text paragraphs (the trained pair's own domain), about 400 characters cut after a whole
    word: a prompt cut mid-word made every request's first draft miss (the pair completes the word differently),
    and with 8 in flight that first step alone is the pooled switch-off's evidence."""
    text = local_text()
    return [tokenizer(text[i * 20_000:i * 20_000 + 400].rsplit(" ", 1)[0])["input_ids"] for i in range(n)]


def make_pairs(names: list[str], n_prompts: int, trained: Path = TRAINED) -> list[Pair]:
    """The requested pairs whose checkpoints exist (a missing one is reported and skipped); trained: the pair's folder."""
    from transformers import AutoTokenizer

    pairs = []
    for name in names:
        needs = {"smollm2-draft": [SMOLLM2, SMOLLM2_DRAFT], "smollm2-ngram": [SMOLLM2],
                 "trained": [trained / "target", trained / "draft"], "trained-weak": [trained / "target"]}[name]
        missing = [str(p) for p in needs if not (p / "config.json").is_file()]
        if missing:
            print(f"skipping {name}: {', '.join(missing)} missing (run `make models` / `make trained-pair`)")
            continue
        tok = AutoTokenizer.from_pretrained(needs[0])
        if name == "smollm2-draft":
            pairs.append(Pair(name, SMOLLM2, SMOLLM2_DRAFT, chat_prompts(tok, n_prompts)))
        elif name == "smollm2-ngram":
            pairs.append(Pair(name, SMOLLM2, None, grounded_prompts(tok, n_prompts)))
        elif name == "trained":
            pairs.append(Pair(name, trained / "target", trained / "draft", local_prompts(tok, n_prompts)))
        else:
            pairs.append(Pair(name, trained / "target", trained / "draft", local_prompts(tok, n_prompts), weak=True))
    return pairs


# ----------------------------------------------------------------------------- measurements


def read_bandwidth_gbs(megabytes: int = 512) -> float:
    """Best-of-5 read bandwidth of a torch sum over `megabytes` (GB/s)."""
    x = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def weak_draft(draft_dir: Path, dtype: str):
    """An untrained draft with the trained draft's shape (seeded random init), as a transformers model."""
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(AutoConfig.from_pretrained(draft_dir)).to(TORCH_DTYPES[dtype]).eval()


class Rates(NamedTuple):
    """One run's generated tokens per second: of wall time, of this process's CPU time (which leaves out the time
    other processes of a shared machine took from this one), and of the wall time after the step that gave the last
    prompt its first token (`decode`: the decoding steps alone, without the prompts' prefill, and the tokens of
    those steps; on the AVX2 hosts a grounded prompt's prefill was 40% of a plain run)."""

    wall: float
    cpu: float
    decode: float


def run_ours(model: LlamaModel, prompts: list[list[int]], proposer=None, **config) -> tuple[Rates, SpecStats]:
    """Generate NEW_TOKENS for every prompt concurrently in one engine -> (its Rates, summed speculation stats);
    config: EngineConfig fields beside the limits (bf16_kv_cache)."""
    config = EngineConfig(max_batch_size=BATCH, max_draft_len=8, max_input_len=1024, max_seq_len=1400,
                          num_blocks=BATCH * 48, **config)  # 1536 tokens per request: the longest prompt + 128 + drafts
    engine = LLMEngine(model, config, proposer)
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", p, NEW_TOKENS))
    stats, generated, prefilling = [], 0, {f"r{i}" for i in range(len(prompts))}
    decode_start = decode_from = None  # when every prompt had its first token, and the tokens generated by then
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        for out in engine.step():
            generated += len(out.new_token_ids)
            if out.new_token_ids:
                prefilling.discard(out.request_id)
            if out.finished:
                stats.append(out.stats)
        if decode_start is None and not prefilling:
            decode_start, decode_from = time.perf_counter(), generated
    end, cpu_seconds = time.perf_counter(), time.process_time() - cpu_start
    rates = Rates(generated / (end - start), generated / cpu_seconds, (generated - decode_from) / (end - decode_start))
    return rates, aggregate(stats)


def run_hf(target, prompts: list[list[int]], assistant=None, k: int = 0, lookup: bool = False) -> float:
    """transformers generate at batch 1, one prompt after another: tokens/s (greedy, no early stop)."""
    generated, seconds = 0, 0.0
    for p in prompts:
        ids = torch.tensor([p])
        kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        if assistant is not None:
            kwargs.update(assistant_model=assistant, num_assistant_tokens=k, num_assistant_tokens_schedule="constant")
        if lookup:
            kwargs.update(prompt_lookup_num_tokens=k, max_matching_ngram_size=3)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        seconds += time.perf_counter() - start
        generated += out.shape[1] - ids.shape[1]
    return generated / seconds


class UnsharedDrafts:
    """A proposer that asks the wrapped one for each request's draft alone (no draft forward shared by requests).

    The baseline of the "shared draft step" measurement: DraftModelProposer batches every request's
    draft step into one forward; this wrapper undoes that, everything else equal.
    """

    def __init__(self, inner):
        self.inner = inner
        self.needs_hidden_states = inner.needs_hidden_states

    def propose(self, inputs: list[ProposalInput]) -> list[Draft]:
        """One wrapped propose call per request."""
        return [self.inner.propose([inp])[0] for inp in inputs]

    def update(self, request_id: str, num_accepted: int, num_proposed: int) -> None:
        """Pass the feedback on."""
        self.inner.update(request_id, num_accepted, num_proposed)

    def release(self, request_id: str) -> None:
        """Pass the release on."""
        self.inner.release(request_id)


def proposer_for(pair: Pair, k: int, draft_model: LlamaModel | None, shared: bool = True,
                 draft_token_costs: tuple[tuple[int, float], ...] = (),
                 one_token_costs: tuple[tuple[int, float], ...] = ()) -> PolicyProposer:
    """The pair's proposer at fixed K inside the policy wrapper (spec defaults: switch-off below 10 %).

    shared=False: a draft model runs one forward per request and draft position (UnsharedDrafts).
    draft_token_costs, one_token_costs: the cost-aware switch-off ((batch, cost of a draft token) points at K and at
    K=1, see PolicyConfig).
    """
    inner = NgramProposer(1, 3) if pair.draft is None else DraftModelProposer(draft_model, max_batch_size=BATCH, max_seq_len=1400)
    config = PolicyConfig(num_draft_tokens=k, max_draft_tokens=k, draft_token_costs=draft_token_costs,
                          one_token_costs=one_token_costs)
    return PolicyProposer(inner if shared else UnsharedDrafts(inner), config)


def bench_pair(pair: Pair, ks: list[int], dtype: str, progress: tqdm, target_engine: Path | None = None,
               repeats: int = 1, served_lookup: dict[str, str] | None = None) -> list[dict]:
    """Every measurement of one pair: rows of the results table.

    repeats: rounds over all of our runs, interleaved; each row keeps its best round (tok/s), and its speedup over
    our plain decoding is the median over the rounds of its run against the same round's plain run (`paired_speedup`),
    for the trained pairs against a plain run made right before it.

    target_engine: an engine folder to run as our target (its qformat and kernels) instead of the
    pair's HF checkpoint in `dtype`; transformers always runs the checkpoint.
    served_lookup: a model repository's tensorrt_llm parameters (`served_lookup_parameters`): a prompt lookup pair
    also runs "ngram as served", the proposer and policy the served engine runs with them (adaptive K up to their
    num_draft_tokens, the cut, the costs `make repo` measured, the batch gate), beside fixed K.
    """
    from transformers import AutoModelForCausalLM

    rows = []
    target = LlamaModel.from_engine_dir(target_engine) if target_engine else LlamaModel.from_hf(pair.target, dtype)
    draft = hf_draft = None
    if pair.draft is not None:
        hf_draft = (weak_draft(pair.draft, dtype) if pair.weak
                    else AutoModelForCausalLM.from_pretrained(pair.draft, dtype=TORCH_DTYPES[dtype]).eval())
        draft = LlamaModel(config_from_hf(json.loads((pair.draft / "config.json").read_text()), dtype), hf_draft.state_dict())
    batch8 = [pair.prompts[i % len(pair.prompts)] for i in range(BATCH)]
    run_ours(target, [pair.prompts[0][:16]])  # warm-up (allocations, kernels)

    def ours(batch, prompts, proposer):
        """(Rates, speculation summary) of one run; batch 1 runs the prompts one after another."""
        if batch == 1:  # each rate: the prompts' harmonic mean (the same tokens each, so tokens over summed time)
            results = [run_ours(target, [p], proposer()) for p in prompts]
            rates = Rates(*(len(results) / sum(1 / rate for rate in each) for each in zip(*(r[0] for r in results))))
            return rates, aggregate([r[1] for r in results]).summary()
        rates, stats = run_ours(target, prompts, proposer())
        return rates, stats.summary()

    trained = pair.draft is not None and pair.name.startswith("trained")
    costs = {}  # a draft token's cost per K (and at K=1, for the step's fixed part), timed in the same rounds:
    # {K: ((1, at batch 1), (BATCH, with BATCH in flight))}, on the runs' own prompts: the first prompt alone, the 8
    # together
    if trained:
        cost_ks = tuple(sorted({1, *ks}))
        by_batch = [(len(on), in_engine_draft_token_cost(
            target, lambda on=on: DraftModelProposer(draft, max_batch_size=len(on), max_seq_len=512), cost_ks, on))
            for on in (pair.prompts[:1], batch8)]
        costs = {k: tuple((batch, at[i]) for batch, at in by_batch) for i, k in enumerate(cost_ks)}
    served_k = None  # the served lookup's K: served requests carry the spec's (the BLS sends num_draft_tokens), ours
    # none, so the same cap goes to the proposer here
    if served_lookup is not None and pair.draft is None and target_engine is not None:
        served_k = min(int(served_lookup["num_draft_tokens"]),
                       json.loads((target_engine / "config.json").read_text())["build_config"]["max_draft_len"])
    jobs = []  # (method, batch, K, prompts, proposer factory)
    for batch, prompts in ((1, pair.prompts), (BATCH, batch8)):
        jobs.append(("plain", batch, 0, prompts, lambda: None))
        if served_k is not None:
            jobs.append(("ngram as served", batch, served_k, prompts, lambda: lookup_proposer(served_lookup, served_k)))
        for k in ks:
            jobs.append(("ngram" if pair.draft is None else "draft", batch, k, prompts, lambda k=k: proposer_for(pair, k, draft)))
            if trained:
                jobs.append(("draft cost-aware", batch, k, prompts,
                             lambda k=k: proposer_for(pair, k, draft, draft_token_costs=costs[k],
                                                      one_token_costs=costs[1])))
            if trained and batch > 1:
                # the "shared draft step" question: the same drafts, one draft forward per request instead of per batch
                jobs.append(("draft-unshared", batch, k, prompts, lambda k=k: proposer_for(pair, k, draft, shared=False)))
    measured = run_rounds(jobs, repeats, ours, plain_before_each=trained, progress=progress)
    for i, ((label, batch, k, _, _), spec) in enumerate(zip(jobs, measured.summaries)):
        runs, plains = measured.runs[i], measured.baselines[i]
        speedup, low, high = paired_speedup([r.wall for r in runs], [p.wall for p in plains])
        decode_speedup, decode_low, decode_high = paired_speedup([r.decode for r in runs], [p.decode for p in plains])
        rows.append({"pair": pair.name, "engine": "ours", "method": label, "batch": batch, "k": k,
                     "tok_s": round(max(r.wall for r in runs), 2), "cpu_tok_s": round(max(r.cpu for r in runs), 2),
                     "speedup_vs_our_plain": round(speedup, 3), "speedup_range": [round(low, 3), round(high, 3)],
                     "cpu_speedup_vs_our_plain": round(paired_speedup([r.cpu for r in runs],
                                                                      [p.cpu for p in plains])[0], 3),
                     "decode_speedup_vs_our_plain": round(decode_speedup, 3),
                     "decode_speedup_range": [round(decode_low, 3), round(decode_high, 3)],
                     **{key: spec[key] for key in ("acceptance_rate", "mean_accepted_length", "tokens_per_forward",
                                                   "acceptance_by_position")},
                     **({"draft_token_cost": round(dict(costs[k])[batch], 3),
                         "one_token_cost": round(dict(costs[1])[batch], 3)} if k in costs else {})})
    hf_target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=TORCH_DTYPES[dtype]).eval()
    hf_target.generation_config.eos_token_id = None  # always NEW_TOKENS tokens, like our runs
    rows.append({"pair": pair.name, "engine": "transformers", "method": "generate", "batch": 1, "k": 0,
                 "tok_s": round(run_hf(hf_target, pair.prompts), 2)})
    progress.update()
    for k in ks:
        method = "prompt_lookup" if pair.draft is None else "assisted"
        tps = run_hf(hf_target, pair.prompts, assistant=hf_draft, k=k, lookup=pair.draft is None)
        rows.append({"pair": pair.name, "engine": "transformers", "method": method, "batch": 1, "k": k, "tok_s": round(tps, 2)})
        progress.update()
    bandwidths = measured.bandwidths
    rooflines = [bandwidth * 1e9 / target.weight_bytes for bandwidth in bandwidths]  # tok/s, one per round
    # jobs[0]: plain at batch 1; its decoding steps, as the roofline is a decoding step's (a prefill reads the
    # weights once for all of a prompt's tokens)
    share, low, high = paired_speedup([r.decode for r in measured.runs[0]], rooflines)
    rows.append({"pair": pair.name, "engine": "roofline", "method": "weights/bandwidth", "batch": 1, "k": 0,
                 "tok_s": round(statistics.median(rooflines), 2), "weight_mb": round(target.weight_bytes / 1e6, 1),
                 "bandwidth_gbs": round(statistics.median(bandwidths), 2),
                 "bandwidth_range": [round(min(bandwidths), 2), round(max(bandwidths), 2)],
                 "load_average": round(statistics.median(measured.loads), 2),
                 "load_range": [round(min(measured.loads), 2), round(max(measured.loads), 2)],
                 "plain_share": round(share, 3), "plain_share_range": [round(low, 3), round(high, 3)]})
    return rows


def served_lookup_parameters(repo: Path) -> dict[str, str] | None:
    """The parameters of a model repository's tensorrt_llm model (`make repo`'s) where that model runs prompt lookup
    in the engine (speculative_mode ngram); else None, saying so (a trtllm toolchain's repository, where the BLS looks
    up, or another spec's)."""
    path = repo / "tensorrt_llm" / "config.pbtxt"
    if not path.is_file():
        raise SystemExit(f"--served-lookup {repo}: no {path}; assemble the repository with `make repo`")
    parameters = {key: value.string_value for key, value in load_config(path).parameters.items()}
    if parameters.get("speculative_mode") != "ngram":
        print(f"--served-lookup {repo}: its tensorrt_llm model does not run prompt lookup in the engine "
              f"(speculative_mode {parameters.get('speculative_mode')!r}): the served lookup is not measured",
              file=sys.stderr)
        return None
    return parameters


# ----------------------------------------------------------------------------- report


@dataclass
class Rounds:
    """What `run_rounds` measured, per job (in the jobs' order) and round: the run's Rates, and those of the plain run
    it is paired with (`baselines`; a plain job's own runs); the last run's speculation summary; the bandwidth and the
    load average read before each round's plain batch-1 run."""

    runs: list[list[Rates]]
    baselines: list[list[Rates]]
    summaries: list[dict | None]
    bandwidths: list[float]
    loads: list[float]  # the machine's 1-minute load average, read with each bandwidth


def run_rounds(jobs: list[tuple], repeats: int, run, plain_before_each: bool, read_bandwidth=read_bandwidth_gbs,
               progress: tqdm | None = None, read_load=lambda: os.getloadavg()[0]) -> Rounds:
    """Every job (method, batch, K, prompts, proposer factory) `repeats` times, in rounds over all of them in order
    (each batch's plain job first, its speculative jobs after it); run(batch, prompts, proposer factory) -> (Rates,
    summary) makes one run. A speculative run's baseline is its round's plain run of its batch, or, with
    plain_before_each, a plain run of its batch made right before it: the trained pairs' runs last a fraction of a
    second, within which this machine's speed moves (15 rounds of K=2: quartiles 0.73-0.88 against 0.66-0.92 paired
    with the round's first plain run, docs/benchmarks.md); the SmolLM2 pairs' runs take seconds each."""
    got = Rounds([[] for _ in jobs], [[] for _ in jobs], [None] * len(jobs), [], [])
    plain_of = {batch: i for i, (label, batch, *_rest) in enumerate(jobs) if label == "plain"}
    for _ in range(repeats):
        for i, (label, batch, _, prompts, proposer) in enumerate(jobs):
            if label == "plain" and batch == 1:
                got.bandwidths.append(read_bandwidth())
                got.loads.append(read_load())
            if plain_before_each and label != "plain":
                got.baselines[i].append(run(batch, prompts, lambda: None)[0])
                if progress is not None:
                    progress.update()
            rates, got.summaries[i] = run(batch, prompts, proposer)
            got.runs[i].append(rates)
            if not plain_before_each or label == "plain":  # the round's plain run of this batch (a plain job: itself)
                got.baselines[i].append(got.runs[plain_of[batch]][-1])
            if progress is not None:
                progress.update()
    return got


def paired_speedup(runs: list[float], plain_runs: list[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) over the rounds of runs[r] / plain_runs[r]: each ratio compares two runs made
    minutes apart in the same round. On these shared machines the speed moves 1.5x within minutes, so a ratio of
    two best-of-rounds tok/s could pair a quiet minute with a loaded one (a draft with acceptance 0 measured 1.4x
    its plain decoding that way)."""
    ratios = sorted(run / plain for run, plain in zip(runs, plain_runs, strict=True))
    return statistics.median(ratios), ratios[0], ratios[-1]


def speedups(rows: list[dict]) -> None:
    """Add the speedup vs our plain decoding at the same pair and batch to the rows that lack it (transformers, the
    roofline: their best tok/s over our plain's; our own rows carry their paired speedup)."""
    plain = {(r["pair"], r["batch"]): r for r in rows if r["engine"] == "ours" and r["method"] == "plain"}
    for r in rows:
        r.setdefault("speedup_vs_our_plain", round(r["tok_s"] / plain[(r["pair"], r["batch"])]["tok_s"], 3))


def best(rows, pair, engine, method, batch=1, pick=max):
    """The best row of a (pair, engine, method, batch) by its speedup over our plain decoding, or None; pick=min:
    the worst (over K)."""
    cands = [r for r in rows if r["pair"] == pair and r["engine"] == engine and r["method"] == method and r["batch"] == batch]
    return pick(cands, key=lambda r: r["speedup_vs_our_plain"]) if cands else None


def goals(rows: list[dict]) -> list[tuple[str, str, bool | None]]:
    """(goal, measured ratio, met) for each goal of the issue whose rows exist."""
    out = []

    def add(goal, num, den, need):
        if num is None or den is None:
            out.append((goal, "not measured", None))
            return
        paired = den["engine"] == "ours" and den["method"] == "plain" and num["engine"] == "ours"
        ratio = num["speedup_vs_our_plain"] if paired else num["tok_s"] / den["tok_s"]
        text = f"{ratio:.2f}x (K={num['k']})" if num["k"] else f"{ratio:.2f}x"
        if paired and num["speedup_range"][0] != num["speedup_range"][1]:
            text += f", rounds {num['speedup_range'][0]:.2f}-{num['speedup_range'][1]:.2f}"
        if paired:
            text += (f"; CPU time {num['cpu_speedup_vs_our_plain']:.2f}x; "
                     f"decode steps {num['decode_speedup_vs_our_plain']:.2f}x")
        out.append((goal, text, ratio >= need))

    for pair in ("smollm2-draft", "smollm2-ngram", "trained"):
        if best(rows, pair, "ours", "plain"):
            add(f"{pair}: plain >= 1.5x transformers generate", best(rows, pair, "ours", "plain"),
                best(rows, pair, "transformers", "generate"), 1.5)
            roof = best(rows, pair, "roofline", "weights/bandwidth")
            if roof is not None:
                low, high = roof["plain_share_range"]
                out.append((f"{pair}: plain >= 70% of the roofline", f"{roof['plain_share']:.2f}, rounds {low:.2f}-"
                            f"{high:.2f} (each round's plain run, its decoding steps, over the bandwidth read "
                            "just before it)",
                            roof["plain_share"] >= 0.7))
            break
    add("trained: draft-target >= 1.8x our plain", best(rows, "trained", "ours", "draft"), best(rows, "trained", "ours", "plain"), 1.8)
    add("trained: draft-target, cost-aware switch-off >= 1.8x our plain", best(rows, "trained", "ours", "draft cost-aware"),
        best(rows, "trained", "ours", "plain"), 1.8)
    add("trained: draft-target >= 1.3x transformers assisted", best(rows, "trained", "ours", "draft"),
        best(rows, "trained", "transformers", "assisted"), 1.3)
    for method in ("ngram", "ngram as served"):
        name, ngram = method.replace("ngram", "n-gram"), "smollm2-ngram"
        add(f"{ngram}: {name} >= 1.6x our plain", best(rows, ngram, "ours", method), best(rows, ngram, "ours", "plain"),
            1.6)
        add(f"{ngram}: 8 concurrent, {name} >= 1.2x our plain", best(rows, ngram, "ours", method, BATCH),
            best(rows, ngram, "ours", "plain", BATCH), 1.2)
    for method in ("draft", "draft cost-aware"):
        add(f"trained-weak: weak {method} >= 0.95x our plain at every K (worst K)",
            best(rows, "trained-weak", "ours", method, pick=min), best(rows, "trained-weak", "ours", "plain"), 0.95)
    for pair, method in (("smollm2-draft", "draft"), ("smollm2-ngram", "ngram"), ("trained", "draft"),
                         ("trained", "draft cost-aware"), ("trained-weak", "draft cost-aware")):
        add(f"{pair}: 8 concurrent, {method} >= plain", best(rows, pair, "ours", method, BATCH),
            best(rows, pair, "ours", "plain", BATCH), 1.0)
    return out


def _per_pair(rows: list[dict], median: str, spread: str, fmt: str) -> str:
    """"pair median (low-high)" of each pair's roofline row that holds `median` (its range in `spread`), joined."""
    return ", ".join(f"{r['pair']} {r[median]:{fmt}} ({r[spread][0]:{fmt}}-{r[spread][1]:{fmt}})"
                     for r in rows if r["engine"] == "roofline" and median in r)


def render_markdown(result: dict) -> str:
    """The results table and the goals, as markdown."""
    bandwidths = _per_pair(result["rows"], "bandwidth_gbs", "bandwidth_range", ".1f")
    loads = _per_pair(result["rows"], "load_average", "load_range", ".2f")
    lines = [f"Run {result['date']}, dtype {result['dtype']}, {result['threads']} torch thread(s), {NEW_TOKENS} new tokens, "
             f"{result['seconds']:.0f} s wall, read bandwidth GB/s (median and range of the reads before each round's "
             f"plain run): {bandwidths}; the machine's 1-minute load average (median and range, read with them): "
             f"{loads}. "
             f"Command: `{result['command']}` (`make bench-engine` builds the engines, then runs it).", "",
             "| pair | engine | method | batch | K | best tok/s | vs our plain (rounds) | CPU-time tok/s | "
             "vs plain (CPU time) | vs plain (decode steps) | acceptance | by position | break-even (a draft of 1) | "
             "accepted/step | tokens/forward |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def spread(r, key="speedup_range"):  # the rounds' range of a paired speedup, where there were several rounds
        low, high = r.get(key, (0, 0))
        return f" ({low:.2f}-{high:.2f})" if low != high else ""

    def one_token_cost(r):  # the cost of a draft of one token, where it was measured
        return f" ({r['one_token_cost']:.2f})" if "one_token_cost" in r else ""

    for r in result["rows"]:
        fmt = lambda key: f"{r[key]:.2f}" if key in r else "-"  # noqa: E731
        lines.append(f"| {r['pair']} | {r['engine']} | {r['method']} | {r['batch']} | {r['k'] or '-'} | {r['tok_s']:.1f} | "
                     f"{r['speedup_vs_our_plain']:.2f}{spread(r)} | {fmt('cpu_tok_s')} | "
                     f"{fmt('cpu_speedup_vs_our_plain')} | {fmt('decode_speedup_vs_our_plain')}"
                     f"{spread(r, 'decode_speedup_range')} | {fmt('acceptance_rate')} | "
                     f"{' / '.join(f'{a:.2f}' for a in r.get('acceptance_by_position') or []) or '-'} | "
                     f"{fmt('draft_token_cost')}{one_token_cost(r)} | "
                     f"{fmt('mean_accepted_length')} | "
                     f"{fmt('tokens_per_forward')} |")
    lines += ["", "| goal | measured | met |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {'yes' if ok else 'no' if ok is not None else '-'} |" for g, m, ok in result["goals"]]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Speedup vs K per pair, proposer and batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["k"] and r["engine"] != "roofline":
            label = f"{r['pair']} {r['method']}" + (f" b{r['batch']}" if r["engine"] == "ours" else " (transformers)")
            series.setdefault(label, []).append((r["k"], r["speedup_vs_our_plain"]))
    for label, points in sorted(series.items()):
        points.sort()
        ax.plot([k for k, _ in points], [s for _, s in points], marker="o", label=label,
                linestyle="--" if "transformers" in label else "-")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("K (draft tokens per step)")
    ax.set_ylabel("speedup vs our plain decoding")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    """Command line (see the module docstring)."""
    global NEW_TOKENS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="2,4", help="draft lengths to measure (default 2,4)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per pair (default 2)")
    parser.add_argument("--pairs", default="trained,trained-weak,smollm2-ngram,smollm2-draft")
    parser.add_argument("--smollm2-ks", default="4", help="draft lengths for the SmolLM2 pairs (default 4: they are slow)")
    parser.add_argument("--dtype", default="float32", choices=sorted(TORCH_DTYPES),
                        help="float32 (default; bf16 prefill is very slow on these CPUs)")
    parser.add_argument("--smollm2-engine", type=Path, default=None,
                        help="engine folder our SmolLM2 target runs from (e.g. out/default/engines/target, the "
                             "default spec's int8_sq engine); default: the HF checkpoint in --dtype")
    parser.add_argument("--trained-engine", type=Path, default=None,
                        help="engine folder the trained pairs' target runs from (e.g. out/trained-int8/engines/target, "
                             "built by `make bench-engine`); default: the HF checkpoint in --dtype")
    parser.add_argument("--trained-pair", type=Path, default=TRAINED,
                        help=f"folder of the trained pair (target/, draft/; default {TRAINED}, `make trained-pair`)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds over our runs, interleaved: best tok/s kept, speedups the median of each round's "
                             "against the same round's plain run (default 3)")
    parser.add_argument("--trained-repeats", type=int, default=9,
                        help="rounds for the trained pairs (default 9): a run of theirs takes a fraction of a second, "
                             "within which the shared machine's speed moves 10-20%%, so their ratios need more rounds "
                             "(the SmolLM2 pairs' runs take seconds)")
    parser.add_argument("--served-lookup", type=Path, default=None,
                        help="a model repository whose tensorrt_llm model runs prompt lookup (out/default/model_repo, "
                             "`make repo`): the n-gram pair also runs its served proposer and policy")
    parser.add_argument("--full", action="store_true", help="K 1..8 and 3 prompts per pair")
    parser.add_argument("--out", default="docs", help="folder for bench-engine.{json,md} and img/")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="tokens per request (default 128)")
    args = parser.parse_args(argv)
    NEW_TOKENS = args.new_tokens
    ks = list(range(1, 9)) if args.full else [int(k) for k in args.ks.split(",")]
    smollm2_ks = ks if args.full else [int(k) for k in args.smollm2_ks.split(",")]
    n_prompts = 3 if args.full else args.prompts
    pairs = make_pairs(args.pairs.split(","), n_prompts, args.trained_pair)
    started = time.time()
    rows: list[dict] = []
    pair_ks = {p.name: smollm2_ks if p.name.startswith("smollm2") else ks for p in pairs}
    repeats = {p.name: args.trained_repeats if p.name.startswith("trained") else args.repeats for p in pairs}
    # per round: a plain and K draft (n-gram) runs per batch size; the trained pairs add cost-aware runs (both batch
    # sizes) and unshared drafts (8 in flight), and a plain run before each of their speculative runs
    served = served_lookup_parameters(args.served_lookup) if args.served_lookup else None
    total = sum(repeats[name] * (2 * (1 + len(k)) + (8 * len(k) if name.startswith("trained") else 0)
                                 + (2 if served and name == "smollm2-ngram" else 0)) + 1 + len(k)
                for name, k in pair_ks.items())
    with tqdm(total=total, desc="bench-engine", unit="run") as progress:
        for pair in pairs:
            engine = args.smollm2_engine if pair.target == SMOLLM2 else args.trained_engine
            rows += bench_pair(pair, pair_ks[pair.name], args.dtype, progress, engine, repeats[pair.name], served)
    speedups(rows)
    argv = sys.argv[1:] if argv is None else argv
    # what ran, as typed: `make bench-engine` adds its own arguments, which ARGS=... would repeat
    command = " ".join(["python -m pipeline.apps.bench_engine", *argv])
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
              "dtype": args.dtype + (f", SmolLM2 target from {args.smollm2_engine}" if args.smollm2_engine else "")
              + (f", trained target from {args.trained_engine}" if args.trained_engine else ""),
              "threads": torch.get_num_threads(),
              "seconds": round(time.time() - started, 1), "command": command,
              "rows": rows}
    result["goals"] = goals(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-engine.json").write_text(json.dumps(result, indent=1))
    (out / "bench-engine.md").write_text(render_markdown(result))
    plot(rows, out / "img" / "bench-engine-speedup.png")
    print(render_markdown(result))


if __name__ == "__main__":
    main()
