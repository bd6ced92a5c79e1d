"""Speculation metrics, per request and aggregated (names follow the tensorrtllm backend and vLLM).

- acceptance_rate = accepted draft tokens / proposed draft tokens (tree drafts: nodes proposed);
- mean_accepted_length = accepted draft tokens per speculative step (EAGLE's tau minus the bonus);
- acceptance_by_position[i] = how often draft position i (depth i + 1) was accepted, over the steps
  whose draft reached that depth;
- tokens_per_forward = generated tokens / target forwards (1.0 for plain decoding).

Pure Python, outside pipeline.reference: the reference engine counts with it, and so do the serving metrics, which
the trtllm repository's BLS imports without torch or the reference engine (tests/test_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters of one request (or, summed, of many)."""

    draft_tokens: int = 0  # proposed draft tokens (tree nodes for trees)
    accepted_tokens: int = 0  # accepted draft tokens
    accepted_by_position: list[int] = field(default_factory=list)  # [depth]: steps whose position i was accepted
    proposed_by_position: list[int] = field(default_factory=list)  # [depth]: steps whose draft reached position i
    target_forwards: int = 0  # target forwards this request took part in (prefill included)
    spec_steps: int = 0  # target forwards that verified a non-empty draft
    generated_tokens: int = 0  # tokens produced (accepted + recovered/bonus + prefill's first)

    def record_step(self, draft_depth: int, num_draft_tokens: int, num_accepted: int, num_new_tokens: int) -> None:
        """Count one target forward: a draft of `num_draft_tokens` nodes and depth `draft_depth`, `num_accepted` taken."""
        self.target_forwards += 1
        self.generated_tokens += num_new_tokens
        if num_draft_tokens == 0:
            return
        self.spec_steps += 1
        self.draft_tokens += num_draft_tokens
        self.accepted_tokens += num_accepted
        _grow(self.proposed_by_position, draft_depth)
        _grow(self.accepted_by_position, draft_depth)
        for i in range(draft_depth):
            self.proposed_by_position[i] += 1
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1

    def add(self, other: "SpecStats") -> None:
        """Sum another request's counters into these (aggregation)."""
        for name in ("draft_tokens", "accepted_tokens", "target_forwards", "spec_steps", "generated_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.accepted_by_position, other.accepted_by_position),
                             (self.proposed_by_position, other.proposed_by_position)):
            _grow(mine, len(theirs))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 when nothing was proposed)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens per speculative step."""
        return self.accepted_tokens / self.spec_steps if self.spec_steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Per draft position: fraction of the steps reaching it in which it was accepted."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_by_position, self.proposed_by_position)]

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens per target forward."""
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    def summary(self) -> dict:
        """The derived numbers, JSON-ready."""
        return {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": round(self.acceptance_rate, 4), "mean_accepted_length": round(self.mean_accepted_length, 4),
                "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
                "tokens_per_forward": round(self.tokens_per_forward, 4), "target_forwards": self.target_forwards}


def aggregate(stats: list[SpecStats]) -> SpecStats:
    """Sum per-request counters into one `SpecStats`."""
    total = SpecStats()
    for s in stats:
        total.add(s)
    return total


def _grow(counts: list[int], length: int) -> None:
    counts.extend([0] * (length - len(counts)))
