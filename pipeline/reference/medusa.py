"""Medusa heads (FasterDecoding/Medusa format) and the MedusaProposer that expands them into a token tree.

Head h reads the target's final hidden state of the row that produced the last committed token
(position t) and predicts the token at t + 2 + h: num_layers ResBlocks x <- x + SiLU(W x + b), then
the head's own LM head (Medusa-1) or the target's lm_head (Medusa-2 "version 2" heads have none).
The draft is the tree of `medusa_choices`: a node at depth d with rank r takes the r-th most likely
token of head d - 1, whatever its parent (Medusa heads do not see the path).

Formats (pipeline/contracts/head-checkpoint-formats.md): a FasterDecoding folder (config.json with
medusa_num_heads / medusa_num_layers, weights medusa_lm_head.safetensors or .pt, keys
`{h}.{l}.linear.weight|bias` and `{h}.{L}.weight`), or a reference engine whose rank0.safetensors
holds `medusa_heads.{h}.{l}.linear.weight|bias` and `medusa_heads.{h}.lm_head.weight`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.reference.proposers import Draft, ProposalInput
from pipeline.reference.tree import StaticTree, tree_from_choices


@dataclass
class MedusaHead:
    """One head's weights."""

    resblocks: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (W [H, H], b [H])
    lm_head: torch.Tensor  # [vocab, H]: the head's own, or the target's for version-2 heads

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] from target hidden states [B, H]."""
        x = hidden
        for weight, bias in self.resblocks:
            x = x + F.silu(F.linear(x, weight, bias))
        return F.linear(x, self.lm_head)


def load_medusa_dir(path: str | Path, target_lm_head: torch.Tensor, allow_pickle: bool = False) -> list[MedusaHead]:
    """Heads from a FasterDecoding/Medusa folder; `target_lm_head` [vocab, H] serves heads without their own."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    num_layers = int(config.get("medusa_num_layers", 1))
    if (path / "medusa_lm_head.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(path / "medusa_lm_head.safetensors")
    elif (path / "medusa_lm_head.pt").is_file():
        if not allow_pickle:
            raise ValueError(f"{path}/medusa_lm_head.pt is a pickle; convert it to safetensors or set "
                             "security.allow_pickle_weights: true")
        state = torch.load(path / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{path} has neither medusa_lm_head.safetensors nor medusa_lm_head.pt")
    num_heads = 1 + max(int(k.split(".")[0]) for k in state)  # the file, not config.medusa_num_heads (known to lie)
    heads = []
    for h in range(num_heads):
        blocks = [(state[f"{h}.{l}.linear.weight"].float(), state[f"{h}.{l}.linear.bias"].float()) for l in range(num_layers)]
        own = state.get(f"{h}.{num_layers}.weight")
        heads.append(MedusaHead(blocks, (own if own is not None else target_lm_head).float()))
    return heads


def medusa_heads_from_engine(state: dict[str, torch.Tensor], medusa_config: dict, target_lm_head: torch.Tensor) -> list[MedusaHead]:
    """Heads stored in a reference engine's state dict under `medusa_heads.` (pretrained_config.medusa)."""
    heads = []
    for h in range(medusa_config["num_medusa_heads"]):
        p = f"medusa_heads.{h}."
        blocks = [(state[f"{p}{l}.linear.weight"].float(), state[f"{p}{l}.linear.bias"].float())
                  for l in range(medusa_config["num_medusa_layers"])]
        heads.append(MedusaHead(blocks, state.get(f"{p}lm_head.weight", target_lm_head).float()))
    return heads


class MedusaProposer:
    """Token trees from Medusa heads over the target's last hidden state."""

    needs_hidden_states = True

    def __init__(self, heads: list[MedusaHead], choices):
        self.heads = heads
        self.tree: StaticTree = tree_from_choices(choices)
        if self.tree.max_depth > len(heads):
            raise ValueError(f"medusa_choices reach depth {self.tree.max_depth} but there are only {len(heads)} heads; "
                             "use shorter choice paths")
        self.top_k = max(self.tree.ranks) + 1

    def propose(self, inputs: list[ProposalInput]) -> list[Draft]:
        """The first num_tokens nodes of the tree (breadth-first, so always a tree) per request."""
        active = [inp for inp in inputs if inp.num_tokens > 0]
        drafts = {}
        if active:
            last = torch.stack([inp.hidden_states[-1] for inp in active]).float()  # [B, H]
            depth_used = self.tree.max_depth
            top = torch.stack([head.logits(last).topk(self.top_k, dim=-1).indices
                               for head in self.heads[:depth_used]], dim=1)  # [B, depth, top_k] token ids
            for inp, candidates in zip(active, top.tolist()):
                n = min(inp.num_tokens, len(self.tree.choices))
                tokens = [candidates[len(c) - 1][c[-1]] for c in self.tree.choices[:n]]
                drafts[inp.request_id] = Draft(token_ids=tokens, parents=list(self.tree.parents[:n]))
        return [drafts.get(inp.request_id, Draft(token_ids=[])) for inp in inputs]

    def update(self, request_id: str, num_accepted: int, num_proposed: int) -> None:
        """Static tree: nothing to adapt."""

    def release(self, request_id: str) -> None:
        """Nothing kept per request."""
