"""What verified chain drafts say about a draft's acceptance: the early stop shared by the engine's policy
(pipeline.reference.policy, the running requests pooled) and the BLS's rounds (pipeline.serving.bls, one request).

Speculative decoding's usual model: each draft position the target checks is accepted with the same probability alpha,
independently, so a chain of k draft tokens brings sum(alpha^i, i <= k) accepted tokens on average. A step that
accepted a of its k draft tokens checked a + 1 positions (k if it accepted all) and a of them were accepted: a
rejection ends the chain, so counting its k draft tokens as k samples would be overconfident. alpha's upper bound at
EARLY_STOP_RISK (Chernoff's, in KL form) gives the most the steps could have brought; a draft whose steps could not
have paid even then is stopped early, before its acceptance over a whole window is known. Pure Python (the BLS's
Triton stub has no torch).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

# The early stop's risk of stopping a draft that would have paid (ChainEvidence.optimistic_accepted)
EARLY_STOP_RISK = 0.05


def acceptance_upper_bound(accepted: float, checked: float, risk: float) -> float:
    """The largest acceptance probability p that `accepted` of `checked` independent positions do not rule out at
    `risk`: Chernoff's bound checked * KL(accepted / checked || p) <= ln(1 / risk), found by bisection.

    Faded evidence (`accepted` and `checked` both decayed) can put accepted / checked an ulp off its true value, below
    0 or 1: the observed rate is clamped, and the bisection stops where its midpoint rounds to 1 (the bound is then 1;
    KL at q = 1 divides by zero)."""
    observed, limit = min(max(accepted / checked, 0.0), 1.0), math.log(1 / risk) / checked
    low, high = observed, 1.0
    for _ in range(30):  # to 1e-9
        mid = (low + high) / 2
        if mid >= 1.0:
            break
        if _bernoulli_kl(observed, mid) > limit:
            high = mid
        else:
            low = mid
    return high


def chain_accepted(alpha: float, k: int) -> float:
    """The accepted tokens a chain of k draft tokens brings on average when each position is accepted with alpha."""
    return sum(alpha ** i for i in range(1, k + 1))


def _bernoulli_kl(p: float, q: float) -> float:
    """KL(Bernoulli(p) || Bernoulli(q)) for 0 <= p <= q < 1."""
    return (p * math.log(p / q) if p > 0 else 0.0) + ((1 - p) * math.log((1 - p) / (1 - q)) if p < 1 else 0.0)


@dataclass
class ChainEvidence:
    """Verified chain drafts: the draft positions the target checked, those accepted, and the steps by the draft length
    each stands for (a probe cut short from K stands for the draft of K: a rejection at its first position is the same
    evidence at 1 as at K)."""

    checked: float = 0
    accepted: float = 0
    lengths: Counter = field(default_factory=Counter)

    def add(self, num_accepted: int, num_proposed: int, stands_for: int = 0) -> None:
        """Count one verified chain of num_proposed draft tokens, num_accepted of them accepted."""
        self.checked += num_accepted + (num_accepted < num_proposed)
        self.accepted += num_accepted
        self.lengths[max(num_proposed, stands_for)] += 1

    @classmethod
    def pooled(cls, parts: Iterable["ChainEvidence"]) -> "ChainEvidence":
        """The evidence of several requests together."""
        pool = cls()
        for part in parts:
            pool.checked += part.checked
            pool.accepted += part.accepted
            pool.lengths.update(part.lengths)
        return pool

    def fade(self, factor: float) -> None:
        """Weigh what was counted so far by `factor` (counts become fractional: older evidence says less)."""
        self.checked *= factor
        self.accepted *= factor
        for k in self.lengths:
            self.lengths[k] *= factor

    @property
    def steps(self) -> float:
        """Verified chains counted."""
        return sum(self.lengths.values())

    @property
    def draft_tokens(self) -> float:
        """The draft tokens the steps stand for."""
        return sum(k * n for k, n in self.lengths.items())

    def optimistic_accepted(self, risk: float = EARLY_STOP_RISK) -> float:
        """The accepted tokens the steps (at the lengths they stand for) bring on average if a position is accepted
        with alpha, the largest acceptance the checked positions do not rule out at `risk`; inf before any check."""
        if self.checked == 0:
            return math.inf
        alpha = acceptance_upper_bound(self.accepted, self.checked, risk)
        return sum(n * chain_accepted(alpha, k) for k, n in self.lengths.items())
