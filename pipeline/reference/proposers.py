"""Proposers: where draft tokens come from. One small interface, one class per strategy.

The engine calls, every decode step, `proposer.propose(inputs)` with one `ProposalInput` per running
request, verifies the returned drafts in one target forward (`rejection_sampler.verify`), then
calls `proposer.update(request_id, num_accepted, num_proposed)`; `release(request_id)` when a
request leaves. A `Draft` with no tokens means "no speculation for this request this step": the
engine then runs it as a plain decode row (verifying an empty draft is exactly plain decoding). A proposer with a
`skips_step(request_ids, num_generated)` gate (PolicyProposer's) is asked first: where it says True the engine
builds no inputs and every request runs plainly that step.

- NgramProposer: prompt lookup, no model.
- DraftModelProposer (draft_model.py): a small LlamaModel with its own KV cache.
- MedusaProposer (medusa.py), EagleProposer (eagle.py; EAGLE-1/2 and EAGLE-3 networks): heads on the
  target's hidden states, trees.
- PolicyProposer (policy.py): wraps any proposer with adaptive K and the switch-off rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pipeline.sequences import ngram_lookup


@dataclass
class ProposalInput:
    """What a proposer may look at for one request."""

    request_id: str
    token_ids: list[int]  # every committed token: prompt, then generated
    num_tokens: int  # K: the most draft tokens (nodes, for trees) the engine will verify
    # [n, hidden] the target's final hidden states (after the final norm, i.e. the lm_head input) of the
    # n rows that produced token_ids[-n:] in the last target forward: the prompt rows after prefill,
    # the root and accepted-path rows after a verify step. Only for proposers with needs_hidden_states;
    # a proposer with a `capture_layers` tuple (EAGLE-3) gets those target layers' outputs instead, [n, k * hidden].
    hidden_states: torch.Tensor | None = None
    temperature: float = 0.0  # > 0: a draft model samples its tokens and returns q
    generator: torch.Generator | None = None  # the request's randomness, for sampled drafts
    max_new_tokens: int | None = None  # the request's output budget (short-output heuristic)
    num_generated: int = 0  # tokens generated so far


@dataclass
class Draft:
    """Draft tokens for one request: a chain, or a tree when parents is set."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] q each token was sampled from; None = deterministic
    parents: list[int] | None = None  # tree drafts: parent node of each node, -1 = the root (last committed token)
    # prompt lookup: how many of the context's last tokens matched where the draft was copied from
    # (pipeline.sequences.ngram_lookup); None from proposers without a match
    match_length: int | None = None


class Proposer(Protocol):
    """The interface every proposer implements (a proposer with `drafts_at_prefill` True also drafts for the step
    that completes a prompt, with the prompt as its only context: the engine verifies that draft in the same forward)."""

    needs_hidden_states: bool  # the engine must fill ProposalInput.hidden_states

    def propose(self, inputs: list[ProposalInput]) -> list[Draft]:
        """One draft per input, in order (at most input.num_tokens tokens each)."""
        ...

    def update(self, request_id: str, num_accepted: int, num_proposed: int) -> None:
        """Feedback after verification (adaptive strategies)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished or cancelled request."""
        ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens, propose what followed.

    Tries n = max_ngram down to min_ngram and takes the first (longest) n that matches; proposes up
    to K of the tokens that followed that occurrence, cut where fewer than min_token_prob of the
    earlier occurrences agree (pipeline.sequences.ngram_lookup). Pays off when the output copies its
    input (editing code, summarising or rewriting a given text).
    """

    needs_hidden_states = False
    drafts_at_prefill = True  # it needs nothing but the tokens: the step that completes a prompt can verify a draft
    reports_match_length = True  # its drafts carry their match length (the policy's classes where the pool is off)

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3, min_token_prob: float = 0.0):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.min_ngram, self.max_ngram, self.min_token_prob = min_ngram, max_ngram, min_token_prob

    @classmethod
    def from_spec(cls, ngram_spec) -> "NgramProposer":
        """Build from a `pipeline.spec.NgramSpec` (None: defaults)."""
        return cls() if ngram_spec is None else cls(ngram_spec.min_ngram, ngram_spec.max_ngram, ngram_spec.min_token_prob)

    def propose(self, inputs: list[ProposalInput]) -> list[Draft]:
        """A chain of up to K copied tokens per request (empty when nothing matches)."""
        return [self.lookup(inp.token_ids, inp.num_tokens) for inp in inputs]

    def lookup(self, token_ids: list[int], k: int) -> Draft:
        """The up-to-k tokens that followed the latest earlier match of the longest matching suffix, with the length
        of that match."""
        tokens, matched = ngram_lookup(token_ids, k, self.min_ngram, self.max_ngram, self.min_token_prob)
        return Draft(token_ids=tokens, match_length=matched)

    def update(self, request_id: str, num_accepted: int, num_proposed: int) -> None:
        """Nothing to learn."""

    def release(self, request_id: str) -> None:
        """Nothing kept per request."""
