"""What one draft token costs a speculative step, measured on this machine: the switch-off's break-even.

A speculative step with K draft tokens runs K draft forwards (none for prompt lookup) and one target
forward of K + 1 rows instead of a plain step's one row. In a linear cost model that step costs
1 + K * c plain steps and brings 1 + K * a tokens (a = acceptance), so speculation pays only while
a >= c: the cost per draft token is the acceptance a request must keep (PolicyConfig.draft_token_cost).
On a GPU c is near 0; on these CPUs a fp32 verify row costs a large fraction of a step
(docs/benchmarks.md), so a fixed 10 % threshold keeps drafts that lose.
"""

from __future__ import annotations

import time

from pipeline.limits import TOKENS_PER_BLOCK
from pipeline.reference.model import LlamaModel, SequenceInput


def draft_token_cost(target: LlamaModel, draft: LlamaModel | None, k: int, context: int = 256, repeats: int = 20) -> float:
    """Cost of one draft token as a fraction of a plain step: (verify(K + 1 rows) + K draft steps - step) / (K * step).

    Measured at batch 1 (one sequence, `context` cached tokens) in CPU time of this process (time
    other processes take from it on a shared machine does not count), the three forwards
    interleaved in each of `repeats` rounds, best round of each.
    draft None: prompt lookup (no draft forwards). Clipped at 0 (noise can time K + 1 rows below one).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1 (got {k}): the cost is per draft token")
    runs = [(target, 1), (target, k + 1)] + ([(draft, 1)] if draft is not None else [])
    caches = []
    for model, rows in runs:
        kv = model.new_kv_cache(-(-(context + rows) // TOKENS_PER_BLOCK), TOKENS_PER_BLOCK)
        blocks = list(range(kv.num_blocks))
        model([SequenceInput([1] * context, 0, blocks)], kv)  # the cached context (and a warm-up)
        caches.append((kv, blocks))
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, ((model, rows), (kv, blocks)) in enumerate(zip(runs, caches)):
            start = time.process_time()
            model([SequenceInput([2] * rows, context, blocks, logits_rows=list(range(rows)))], kv)
            best[i] = min(best[i], time.process_time() - start)
    step, verify = best[0], best[1]
    drafting = k * best[2] if draft is not None else 0.0
    return max((verify + drafting - step) / (k * step), 0.0)
