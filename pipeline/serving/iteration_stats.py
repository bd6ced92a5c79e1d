"""TensorRT-LLM iteration statistics (`LLM.get_stats()`, trtllm-serve's `/metrics`) as speculation counts.

Each PyTorch-backend iteration reports `specDecodingStats` = {numDraftTokens, numAcceptedTokens,
numRequestsWithDraftTokens, acceptanceLength, iterLatencyMS, draftOverhead} (the executor fills it with
`enable_iter_perf_stats: true`; sources in pipeline/contracts/llmapi-facts.md). Summed over iterations
they are the BLS's counters: draft tokens proposed, draft tokens accepted, and speculative rounds (one per
request that drafted in an iteration). Imports nothing beyond the standard library.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

STATS_KEY = "specDecodingStats"


@dataclass(frozen=True)
class SpecDecodeCounts:
    """Speculation counted over some iterations."""

    drafted: int = 0
    accepted: int = 0
    rounds: int = 0


def spec_decode_counts(stats: list[dict | str]) -> SpecDecodeCounts:
    """Sum the speculation figures of iteration stats (dicts, or JSON strings as older releases return them;
    iterations without them count nothing); raises ValueError for an iteration that accepts more draft
    tokens than it drafted (not these statistics)."""
    drafted = accepted = rounds = 0
    for stat in stats:
        stat = json.loads(stat) if isinstance(stat, str) else stat
        spec = stat.get(STATS_KEY) or {}
        d, a, r = (int(spec.get(k, 0)) for k in ("numDraftTokens", "numAcceptedTokens", "numRequestsWithDraftTokens"))
        if not 0 <= a <= d or r < 0:
            raise ValueError(f"iteration {stat.get('iter')}: {STATS_KEY} {spec} is not drafted >= accepted >= 0")
        drafted, accepted, rounds = drafted + d, accepted + a, rounds + r
    return SpecDecodeCounts(drafted, accepted, rounds)
