"""The one verifier of speculative decoding: greedy and lossless rejection sampling, chains and trees.

Notation: p is the TARGET model's next-token distribution, q the DRAFT's (proposer's).
A step verifies, for every request of a batch, a draft of N nodes (ragged: N differs per request).
A plain draft is a chain (node j follows node j - 1); Medusa / EAGLE drafts are trees given by
parent indices (see `tree.py`). The target has run one forward over the last committed token (the
root, row 0) and all nodes (row j + 1 = node j), so row r holds p for the token that follows it.

Outcome of verifying one request, always at least one new token:
- accepted tokens: draft tokens the target agrees with, a root-to-node path of the draft;
- recovered token: at the first rejection, a token the target picks instead (greedy: its argmax;
  sampling: a sample of the residual norm(max(p - q, 0)));
- bonus token: when the path reaches a leaf (all K tokens of a chain accepted), the target's token
  after it, from p at that row, for free.
So one target forward yields 1..depth+1 tokens.

Greedy (temperature 0): a node is accepted when its parent is accepted and its token equals the
target's argmax at the parent's row; the longest accepted path wins (first in node order on ties),
then the argmax after its last node. The output equals plain greedy decoding token for token.

Sampling (lossless): walking down from the root, draft token x of a child node is accepted with
probability min(1, p(x) / q(x)); on rejection the next sibling is tried against the residual
p <- norm(max(p - q, 0)); when no child is accepted the recovered token is sampled from the
residual, and at a leaf the bonus token is sampled from p. For a chain this is the speculative
sampling of Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"
(arXiv:2211.17192), and Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling" (arXiv:2302.01318): the output tokens follow p exactly. Tree nodes that
carry q must have been sampled independently from q.
Drafts without q (n-gram, a draft model's tokens sent without logits, Medusa and EAGLE top-k trees)
are deterministic: the target draws its own token t from p, exactly as plain decoding does, and the
child whose token is t is accepted; when there is none, t is the recovered token. That is the
one-hot-q case of the rule above (accept x with p(x), residual p without x: the multi-candidate form
of SpecInfer, Miao et al. 2024) and TensorRT-LLM's token matching for external draft tokens; with
the same random numbers it yields exactly the tokens plain sampling would.

Randomness: each row draws from its own torch.Generator (`DraftToVerify.row_generator`; the engine
keys it by the row's sequence position, see pipeline/seeds.py), so a seeded request gives the same
tokens whatever else is in the batch and however its tokens were split into steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pipeline.reference.greedy_tokens import greedy_tokens
from pipeline.reference.tree import chain_parents, node_depths, path_to


@dataclass
class Verdict:
    """What verification decided for one request."""

    token_ids: list[int]  # accepted draft tokens, then one recovered or bonus token
    accepted_nodes: list[int] = field(default_factory=list)  # draft node indices of the accepted path (root excluded)
    bonus: bool = False  # True when the last token is a bonus (the path reached a leaf)

    @property
    def num_accepted(self) -> int:
        """How many draft tokens were accepted."""
        return len(self.accepted_nodes)

    @property
    def last_row(self) -> int:
        """Target row (0 = root) whose distribution produced the last token."""
        return self.accepted_nodes[-1] + 1 if self.accepted_nodes else 0


@dataclass
class DraftToVerify:
    """One request's draft, as the verifier needs it."""

    token_ids: list[int]  # N draft tokens, one per node
    parents: list[int] | None = None  # N parent indices (-1 = root); None = a chain
    probs: torch.Tensor | None = None  # [N, vocab] q: node j's token was drawn from probs[j]; None = deterministic
    greedy: bool = True  # temperature 0: verify against the target's argmax
    generator: torch.Generator | None = None  # one stream for every row (None: torch's global generator)
    row_generator: Callable[[int], torch.Generator] | None = None  # row (0 = root) -> its own stream; wins

    def node_parents(self) -> list[int]:
        """Parent indices, for chains too."""
        return list(self.parents) if self.parents is not None else chain_parents(len(self.token_ids))

    def rng(self, row: int) -> torch.Generator | None:
        """The random stream of target row `row`."""
        return self.row_generator(row) if self.row_generator is not None else self.generator


def verify(target_logits: torch.Tensor, drafts: list[DraftToVerify], target_probs: torch.Tensor | None = None) -> list[Verdict]:
    """Verify a batch of ragged drafts against one target forward.

    target_logits: [sum(N_i + 1), vocab] target logits (after penalties), request by request; each
        request has its root row then one row per node. Greedy requests use their argmax.
    target_probs: [same rows, vocab] p after temperature / top-k / top-p, used by sampled requests
        (rows of greedy requests are ignored); may be None when every request is greedy.
    Returns one `Verdict` per request, in order.
    """
    rows_needed = sum(len(d.token_ids) + 1 for d in drafts)
    if target_logits.shape[0] != rows_needed:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, the drafts need {rows_needed} (N_i + 1 each)")
    if target_probs is None and not all(d.greedy for d in drafts):
        raise ValueError("target_probs is required when a request samples (temperature > 0)")
    argmax = greedy_tokens(target_logits)  # [rows]: the target's greedy token at every row
    verdicts, start = [], 0
    for draft in drafts:
        rows = len(draft.token_ids) + 1
        if draft.greedy:
            verdicts.append(_verify_greedy(draft, argmax[start:start + rows]))
        else:
            verdicts.append(_verify_sampled(draft, target_probs[start:start + rows]))  # p: [N + 1, vocab]
        start += rows
    return verdicts


def _verify_greedy(draft: DraftToVerify, argmax: list[int]) -> Verdict:
    """Longest root-to-node path whose every token is the target's argmax at its parent's row."""
    parents = draft.node_parents()
    depths = node_depths(parents)
    accepted = [False] * len(parents)
    best, best_depth = -1, 0
    for j, parent in enumerate(parents):
        parent_ok = parent < 0 or accepted[parent]
        accepted[j] = parent_ok and draft.token_ids[j] == argmax[parent + 1]
        if accepted[j] and depths[j] > best_depth:
            best, best_depth = j, depths[j]
    path = path_to(parents, best)
    is_leaf = best not in parents  # the root (-1) is a leaf only when the draft is empty
    return Verdict(token_ids=[draft.token_ids[j] for j in path] + [argmax[best + 1]], accepted_nodes=path, bonus=is_leaf)


def _verify_sampled(draft: DraftToVerify, p_rows: torch.Tensor) -> Verdict:
    """Recursive rejection sampling from the root; p_rows: [N + 1, vocab] target probabilities."""
    parents = draft.node_parents()
    children: dict[int, list[int]] = {}
    for j, parent in enumerate(parents):
        children.setdefault(parent, []).append(j)
    node, path = -1, []
    while True:
        gen = draft.rng(node + 1)
        p = p_rows[node + 1].float()  # [vocab] p after the current node (row 0: the root)
        kids = children.get(node, [])
        if draft.probs is None:  # deterministic draft: the target's own sample picks the child
            token = int(torch.multinomial(p, 1, generator=gen))
            accepted = next((c for c in kids if draft.token_ids[c] == token), None)
        else:
            accepted, token = None, None
            for child in kids:
                x, q = draft.token_ids[child], draft.probs[child].float()  # q [vocab]: what x was drawn from
                if float(torch.rand((), generator=gen)) * float(q[x]) < float(p[x]):  # min(1, p(x) / q(x))
                    accepted = child
                    break
                p = _residual(p, q)  # the next sibling is tested against norm(max(p - q, 0))
            if accepted is None:
                token = int(torch.multinomial(p, 1, generator=gen))
        if accepted is None:  # recovered token (from the residual), or bonus token (from p) at a leaf
            return Verdict(token_ids=[draft.token_ids[j] for j in path] + [token], accepted_nodes=path,
                           bonus=not kids)
        node = accepted
        path.append(node)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) for p, q [vocab]."""
    residual = torch.clamp(p - q, min=0.0)
    total = float(residual.sum())
    return residual / total if total > 0 else p  # total 0 only when p == q up to rounding
