"""A/B of the engine's KV cache: float32 against bf16 (EngineConfig.bf16_kv_cache), in one process.

    .venv/bin/python -m pipeline.apps.kv_cache_ab [--engine out/default/engines/target] [--repo out/default/model_repo]
        [--rounds 5]

Runs `make bench-engine`'s smollm2-ngram requests (its two grounded prompts, 128 new tokens each; at batch 1 one
after the other, and 8 in flight) through the engine plain and with prompt lookup as the repository serves it, over
each KV cache in turn within every round. Prints per round the load average, and over the rounds the median and
range of: each cache's lookup speedup over its own plain decoding, and the bf16 cache's time over the float32
cache's for the same run (below 1: bf16 faster). A measurement, not a test (docs/benchmarks.md, "A bf16 KV cache").
"""

import argparse
import os
import statistics
from pathlib import Path

import torch

from pipeline.apps.bench_engine import BATCH, SMOLLM2, grounded_prompts, run_ours, served_lookup_parameters
from pipeline.reference import row_attention
from pipeline.reference.model import LlamaModel
from pipeline.serving.reference_adapter import lookup_proposer

CACHES = {"float32": False, "bf16": True}  # name -> EngineConfig.bf16_kv_cache


def seconds_per_token(model: LlamaModel, batch: int, prompts: list[list[int]], proposer, bf16: bool) -> float:
    """Wall seconds per generated token of one run: at batch 1 the prompts one after another, else together."""
    runs = [[p] for p in prompts] if batch == 1 else [prompts]
    return sum(1 / run_ours(model, run, proposer(), bf16_kv_cache=bf16)[0].wall for run in runs) / len(runs)


def main() -> None:
    """CLI (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=Path, default=Path("out/default/engines/target"))
    parser.add_argument("--repo", type=Path, default=Path("out/default/model_repo"))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if row_attention.bf16_kernel() is None:
        raise SystemExit("the bf16 row attention kernel does not run here (it needs AVX512-BF16 or AVX2)")
    from transformers import AutoTokenizer

    prompts = grounded_prompts(AutoTokenizer.from_pretrained(SMOLLM2), 2)
    served = served_lookup_parameters(args.repo)
    k = min(int(served["num_draft_tokens"]), 8)
    model = LlamaModel.from_engine_dir(args.engine)
    run_ours(model, [prompts[0][:16]])  # warm-up (allocations, kernels)
    jobs = {("plain", 1): lambda: None, ("lookup", 1): lambda: lookup_proposer(served, k),
            ("plain", BATCH): lambda: None, ("lookup", BATCH): lambda: lookup_proposer(served, k)}
    batch8 = [prompts[i % len(prompts)] for i in range(BATCH)]
    times = {(cache, job): [] for cache in CACHES for job in jobs}
    print(f"prompts of {[len(p) for p in prompts]} tokens, {torch.get_num_threads()} threads, lookup K <= {k}")
    for r in range(args.rounds):
        for cache, bf16 in CACHES.items():
            for (method, batch), proposer in jobs.items():
                times[cache, (method, batch)].append(
                    seconds_per_token(model, batch, prompts if batch == 1 else batch8, proposer, bf16))
        print(f"round {r + 1}/{args.rounds}: load average {os.getloadavg()[0]:.2f}", flush=True)

    def spread(ratios: list[float]) -> str:
        ratios = sorted(ratios)
        return f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})"

    print("| batch | method | bf16 KV time / float32 KV time | lookup speedup, float32 KV | lookup speedup, bf16 KV |")
    print("|---|---|---|---|---|")
    for method, batch in jobs:
        ab = spread([b / f for b, f in zip(times["bf16", (method, batch)], times["float32", (method, batch)])])
        gains = [spread([p / s for p, s in zip(times[cache, ("plain", batch)], times[cache, ("lookup", batch)])])
                 if method == "lookup" else "-" for cache in CACHES]
        print(f"| {batch} | {method} | {ab} | {gains[0]} | {gains[1]} |")


if __name__ == "__main__":
    main()
