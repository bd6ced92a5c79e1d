"""How many threads an engine's decode steps and verifies run on: measured where the choice cannot change a bit.

Forwards of up to DECODE_ROWS new tokens run on `LlamaModel.decode_threads` threads, 1 by default (docs/engine.md,
"Decode step": on the Intel hosts a second OpenMP thread only added barriers to fbgemm's memory-bound GEMVs).
The project's kernels split their work over torch's threads (cpp_ops.OPENMP), and on the AMD Zen3 hosts one core
streams memory at 11-14 GB/s where two stream 18-22: there a SmolLM2 step took 14.2 ms on two threads against
19.5 on one, a 6-token verify 23.4 against 31.4 (docs/benchmarks.md). Where a small forward runs on the
project's kernels alone (`LlamaModel.thread_count_invariant`), its bits do not depend on the thread count, so
the engine times a step and a verify on one thread and on all of torch's, taking turns, and keeps the faster
(`choose`). REFERENCE_DECODE_THREADS=<n> skips the measurement and runs small forwards on n threads.
"""

from __future__ import annotations

import logging
import os
import statistics
import time

import torch

from pipeline.reference.kv_cache import KVCache
from pipeline.reference.model import LlamaModel, SequenceInput

ENV = "REFERENCE_DECODE_THREADS"  # "<n>": small forwards on n threads, not measured
CONTEXT = 64  # cached tokens the timed forwards attend over
VERIFY_ROWS = 6  # a verify of 5 draft tokens, timed beside a one-token step
ROUNDS = 5  # timed rounds per thread count, interleaved; medians compared
MIN_GAIN = 0.05  # more threads must be this much faster (fewer threads leave the other cores to other processes)

log = logging.getLogger(__name__)


def choose(model: LlamaModel, kv: KVCache, draft: bool = False, again: bool = False) -> int | None:
    """Set and return `model.decode_threads`: REFERENCE_DECODE_THREADS where set; else, where the model's small
    forwards over `kv` are thread-count invariant (or the model is a `draft`) and torch runs more than one thread,
    the faster of one thread and torch's count (a step plus a verify, a draft's one-token step alone: what it runs;
    measured once per model, or `again`; blocks at the start of `kv` serve as scratch, so call it before any request
    runs);
    else (also where `kv` holds fewer than CONTEXT + VERIFY_ROWS slots) the model's own setting (1 by default).
    The tokens are the same whatever the choice; a draft's proposals may differ (its dense GEMMs of several rows
    need not round alike on other thread counts), but they are only proposals the target verifies. SmolLM2's
    4-layer float32 draft stepped in 8.0-8.6 ms on two threads against 9.8-10.4 on one, its one-row GEMVs split
    over both (linear.ONE_ROW_SPLIT_BYTES); the trained pair's 1-layer draft in 0.19-0.28 against 0.18-0.21, and
    in the engine its proposals on two threads made the pair 13% slower.
    again: measure even where this model was measured before; a served engine measures again before its first step
    (pipeline.serving.reference_adapter.MeteredEngine), as the other models' processes start beside it at load."""
    forced = os.environ.get(ENV)
    if forced:
        model.decode_threads = _positive(forced)
        return model.decode_threads
    candidates = sorted({1, torch.get_num_threads()})
    too_small = kv.num_blocks * kv.block_size < CONTEXT + VERIFY_ROWS  # no room for the timed forwards
    if len(candidates) == 1 or too_small or not (draft or model.thread_count_invariant(kv)):
        return model.decode_threads
    if model.measured_decode_threads is None or again:
        seconds = time_small_forwards(model, kv, candidates, verify=not draft)
        model.measured_decode_threads = faster(seconds)
        timed = "a draft step" if draft else f"a step plus a {VERIFY_ROWS}-token verify"
        log.info("small forwards on %d thread(s) (%s: %s)", model.measured_decode_threads, timed,
                 ", ".join(f"{n} thread(s) {s * 1e3:.1f} ms" for n, s in seconds.items()))
    model.decode_threads = model.measured_decode_threads
    return model.decode_threads


def faster(seconds: dict[int, float]) -> int:
    """The thread count to run on from {threads: seconds}: the fewest threads unless more are MIN_GAIN faster."""
    fewest = min(seconds)
    best = min(seconds, key=seconds.get)
    return best if seconds[best] < (1 - MIN_GAIN) * seconds[fewest] else fewest


def time_small_forwards(model: LlamaModel, kv: KVCache, thread_counts: list[int], verify: bool = True) -> dict[int, float]:
    """{threads: median seconds of a one-token step plus (verify) a VERIFY_ROWS-token forward after CONTEXT cached
    tokens}, the thread counts taking turns (a shared machine's load changes within seconds)."""
    blocks = list(range(-(-(CONTEXT + VERIFY_ROWS) // kv.block_size)))  # choose() checked that kv has them
    ids = [(7 * i + 3) % model.vocab_size for i in range(CONTEXT + VERIFY_ROWS)]
    model([SequenceInput(ids[:CONTEXT], 0, blocks)], kv)

    def small_forwards() -> float:
        start = time.perf_counter()
        model([SequenceInput(ids[CONTEXT:CONTEXT + 1], CONTEXT, blocks)], kv)
        if verify:
            model([SequenceInput(ids[CONTEXT:], CONTEXT, blocks, logits_rows=list(range(VERIFY_ROWS)))], kv)
        return time.perf_counter() - start

    before = model.decode_threads
    seconds: dict[int, list[float]] = {n: [] for n in thread_counts}
    try:
        for round_ in range(ROUNDS + 1):  # the first round warms up
            for n in thread_counts:
                model.decode_threads = n
                elapsed = small_forwards()
                if round_:
                    seconds[n].append(elapsed)
    finally:
        model.decode_threads = before
    return {n: statistics.median(s) for n, s in seconds.items()}


def _positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV}={value!r}: set a positive thread count, or unset it to measure")
    return int(value)
