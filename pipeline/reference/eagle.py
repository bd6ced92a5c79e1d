"""EAGLE drafting (SafeAILab/EAGLE formats) from the target's hidden states, as token trees.

EAGLE-1/2: the drafter is one Llama decoder layer over its own sequence of pairs: pair j is
fc(concat(embedding(token j + 1), f_j)) [2H -> H], where f_j is the target's final hidden state at
position j (the lm_head input). Its output is a predicted feature; the TARGET's lm_head turns it into
draft logits (no final norm), and a drafted token with that predicted feature makes the next pair.
Layer 0 has no input norm (EAGLE-1 layout; `pipeline/contracts/head-checkpoint-formats.md` (b)).
EAGLE-3 (Eagle3Net, format (c)): f_j is the concatenation of three target layers' outputs, fused by
fc [3H -> H]; the layer attends over concat(norm(embedding), norm(feature)); its own norm and lm_head
give logits over a draft vocabulary, mapped to target ids by d2t. The tree machinery is the same.

Trees:
- static (EAGLE-1, `eagle_choices`): node (r1, .., rd) is the rd-th most likely draft token after
  its parent node;
- dynamic (EAGLE-2): each level expands the `top_k` nodes with the highest path confidence (the
  product of draft probabilities along the path) by their top_k tokens; the tree sent for
  verification is the num_tokens most confident nodes (ancestors always score at least as high).
Drafts are deterministic top-k choices: the verifier treats q as one-hot, which stays lossless.

The drafter keeps a paged KV cache of committed pairs per request; features arrive with every
propose call (ProposalInput.hidden_states) and are buffered until the request drafts again. Target
rows skipped by a prefix-cache hit have no features: those pairs get zeros (drafts get worse for a
while, outputs stay exact).
Each tree level re-runs the nodes drafted so far with a tree mask, so every node sees exactly its
ancestors (the drafter is one layer: this costs little).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.checkpoints import eagle3_capture_layers
from pipeline.limits import TOKENS_PER_BLOCK
from pipeline.reference.kv_cache import BlockManager, SequenceBlocks
from pipeline.reference.model import ForwardOutput, LlamaModel, SequenceInput, config_from_hf
from pipeline.reference.proposers import Draft, ProposalInput
from pipeline.reference.tree import tree_from_choices


@dataclass
class _EagleSequence:
    """The drafter's state for one request."""

    blocks: SequenceBlocks = field(default_factory=SequenceBlocks)
    num_cached: int = 0  # pairs whose KV is in the drafter cache (positions 0 .. num_cached - 1)
    pending_tokens: list[int] = field(default_factory=list)  # pairs not yet run, from position num_cached on
    pending_features: list[torch.Tensor] = field(default_factory=list)  # [n, H] target features of those pairs
    root_feature: torch.Tensor | None = None  # [H] drafter output at the last committed pair


@dataclass
class _Node:
    """A drafted node: its token, its parent node (-1 = root) and its path log-confidence."""

    token: int
    parent: int
    score: float
    path: tuple[int, ...]  # top-k ranks from the root: the node's place in eagle_choices
    feature: torch.Tensor | None = None  # [H] drafter output after this node, once it has been run

    @property
    def depth(self) -> int:
        return len(self.path)


class Eagle1Net:
    """EAGLE-1/2 network: fc(concat(embedding, feature)) [2H -> H] into one Llama layer with no input norm; the
    target's lm_head (no final norm) gives draft logits over the target vocabulary."""

    capture_layers = None  # its features are the target's final hidden states

    def __init__(self, drafter: LlamaModel, fc_weight: torch.Tensor, fc_bias: torch.Tensor | None):
        self.drafter = drafter
        self.fc_weight, self.fc_bias = fc_weight.to(drafter.dtype), None if fc_bias is None else fc_bias.to(drafter.dtype)

    def __call__(self, seqs: list[SequenceInput], kv, tokens: list[int], features: torch.Tensor) -> ForwardOutput:
        """Run pairs (tokens, features [n, H]); logits of the requested rows, drafter features [n, H] of every pair."""
        emb = self.drafter.embed.index_select(0, torch.tensor(tokens, dtype=torch.long))  # [n, H]
        x = F.linear(torch.cat([emb, features.to(emb.dtype)], dim=-1), self.fc_weight, self.fc_bias)  # [n, H]
        return self.drafter(seqs, kv, return_hidden=True, input_embeds=x)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary = target vocabulary."""
        return draft_ids


class Eagle3Net:
    """EAGLE-3 network (SafeAILab `cnets.py` / TensorRT-LLM's Eagle3 drafter, `pipeline/contracts/head-checkpoint-formats.md` (c)).

    A pair's hidden g is fc(concat(low, mid, high)) [3H -> H] for features from the target (its layers
    `capture_layers`, ascending), or a drafter output [H] as is for drafted nodes. The midlayer attends over
    concat(input_layernorm(embedding), hidden_norm(g)) [2H] with g as its residual; its pre-norm output is the
    next feature, and lm_head(norm(output)) gives logits over the draft vocabulary, mapped back to target ids by
    d2t (target_id = draft_id + d2t[draft_id]).
    """

    def __init__(self, drafter: LlamaModel, fc_weight: torch.Tensor, input_norm: torch.Tensor, hidden_norm: torch.Tensor,
                 d2t: torch.Tensor | None, capture_layers: tuple[int, ...]):
        self.drafter = drafter
        self.fc_weight = fc_weight.to(drafter.dtype)
        self.input_norm, self.hidden_norm = input_norm.to(drafter.dtype), hidden_norm.to(drafter.dtype)
        self.d2t = None if d2t is None else d2t.long()
        self.capture_layers = tuple(capture_layers)

    def __call__(self, seqs: list[SequenceInput], kv, tokens: list[int], features: torch.Tensor) -> ForwardOutput:
        """Run pairs (tokens, features [n, 3H] from the target or [n, H] from the drafter); see the class docstring."""
        d = self.drafter
        emb = d.embed.index_select(0, torch.tensor(tokens, dtype=torch.long))  # [n, H]
        hidden = features.to(emb.dtype)
        if hidden.shape[-1] != d.hidden_size:
            hidden = F.linear(hidden, self.fc_weight)  # [n, H]: the target's three layers fused
        attn_input = torch.cat([d.rms_norm(emb, self.input_norm), d.rms_norm(hidden, self.hidden_norm)], dim=-1)  # [n, 2H]
        return d(seqs, kv, return_hidden=True, input_embeds=hidden, capture_layers=(0,), first_layer_input=attn_input)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary ids."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]


def _eagle3_net(state: dict[str, torch.Tensor], hf_config: dict, target: LlamaModel, prefix: str,
                layers_to_capture: tuple[int, ...] | None) -> Eagle3Net:
    """An Eagle3Net from SafeAILab EAGLE-3 tensors (`midlayer.*`, `fc`, `norm`, `lm_head`, optional `d2t`)."""
    layers = eagle3_capture_layers(layers_to_capture, target.num_layers)
    fc = state[f"{prefix}fc.weight"]  # [H, len(layers) * Ht]
    if fc.shape[1] != len(layers) * target.hidden_size:
        raise ValueError(f"EAGLE-3 fc.weight is {list(fc.shape)}: it fuses {fc.shape[1] // target.hidden_size} target layers, "
                         f"but layers_to_capture has {len(layers)} ({layers})")
    lm_head = state[f"{prefix}lm_head.weight"]  # [Vd, H]
    config = config_from_hf({**hf_config, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                             "tie_word_embeddings": False, "vocab_size": lm_head.shape[0]}, target.config["dtype"])
    drafter_state = {"model.embed_tokens.weight": state.get(f"{prefix}embed_tokens.weight", target.embed),
                     "lm_head.weight": lm_head, "model.norm.weight": state[f"{prefix}norm.weight"]}
    mid = f"{prefix}midlayer."
    for key, value in state.items():
        if key.startswith(mid) and not key.startswith((f"{mid}input_layernorm.", f"{mid}hidden_norm.")):
            drafter_state["model.layers.0." + key[len(mid):]] = value  # layer 0 without input norm: see first_layer_input
    d2t = state.get(f"{prefix}d2t") if lm_head.shape[0] != target.vocab_size else None
    return Eagle3Net(LlamaModel(config, drafter_state), fc, state[f"{mid}input_layernorm.weight"],
                     state[f"{mid}hidden_norm.weight"], d2t, layers)


class EagleProposer:
    """EAGLE-1 static trees or EAGLE-2 dynamic trees over the target's features (see module docstring),
    drafted by an EAGLE-1/2 or an EAGLE-3 network."""

    needs_hidden_states = True

    def __init__(self, net: Eagle1Net | Eagle3Net, choices=None, dynamic_top_k: int | None = None, depth: int = 3,
                 max_batch_size: int = 8, max_seq_len: int = 2048, tokens_per_block: int = TOKENS_PER_BLOCK):
        if (choices is None) == (dynamic_top_k is None):
            raise ValueError("give either eagle choices (EAGLE-1 static tree) or dynamic_top_k (EAGLE-2 dynamic tree)")
        self.net = net
        self.capture_layers = net.capture_layers  # the engine returns these target layers' outputs as features
        self.tree = tree_from_choices(choices) if choices is not None else None
        self.top_k = dynamic_top_k
        self.depth = self.tree.max_depth if self.tree is not None else depth
        num_blocks = max_batch_size * (-(-(max_seq_len + 64) // tokens_per_block)) + max_batch_size
        self.kv = net.drafter.new_kv_cache(num_blocks, tokens_per_block)
        self.block_manager = BlockManager(num_blocks, tokens_per_block)
        self.sequences: dict[str, _EagleSequence] = {}

    @classmethod
    def from_eagle_dir(cls, path: str | Path, target: LlamaModel, **kwargs) -> "EagleProposer":
        """Load a SafeAILab EAGLE-1/2 or EAGLE-3 folder (config.json + model.safetensors); what the folder lacks
        (lm_head for EAGLE-1/2, the embedding) comes from the target model."""
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"{path}/model.safetensors is missing (convert pytorch_model.bin to safetensors)")
        state = load_file(path / "model.safetensors")
        hf = json.loads((path / "config.json").read_text())
        return cls.from_state_dict(state, hf, target, **kwargs)

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], hf_config: dict, target: LlamaModel, prefix: str = "",
                        layers_to_capture: tuple[int, ...] | None = None, **kwargs) -> "EagleProposer":
        """From EAGLE tensors under `prefix`: EAGLE-1/2 (`fc.*`, `layers.0.*`) or EAGLE-3 (`midlayer.*`, `fc`, `norm`,
        `lm_head`, `d2t`), optional `embed_tokens.weight`. layers_to_capture: EAGLE-3's target layers (default
        TensorRT-LLM's)."""
        if f"{prefix}midlayer.self_attn.q_proj.weight" in state:
            return cls(_eagle3_net(state, hf_config, target, prefix, layers_to_capture), **kwargs)
        if layers_to_capture is not None:
            raise ValueError("layers_to_capture is for EAGLE-3 weights; these are EAGLE-1/2 (layers.0.*)")
        config = config_from_hf({**hf_config, "num_hidden_layers": 1, "tie_word_embeddings": False}, target.config["dtype"])
        drafter_state = {"model.embed_tokens.weight": state.get(f"{prefix}embed_tokens.weight", target.embed),
                         "lm_head.weight": target.lm_head}
        for key, value in state.items():
            if key.startswith(f"{prefix}layers.0."):
                drafter_state["model." + key[len(prefix):]] = value
        drafter = LlamaModel(config, drafter_state)
        return cls(Eagle1Net(drafter, state[f"{prefix}fc.weight"], state.get(f"{prefix}fc.bias")), **kwargs)

    # ------------------------------------------------------------ proposing
    def propose(self, inputs: list[ProposalInput]) -> list[Draft]:
        """Buffer every request's new features; draft a tree for those with num_tokens > 0."""
        for inp in inputs:
            self._buffer(inp)
        active = [inp for inp in inputs if inp.num_tokens > 0]
        drafts = dict(zip((inp.request_id for inp in active), self._draft(active))) if active else {}
        return [drafts.get(inp.request_id, Draft(token_ids=[])) for inp in inputs]

    def _buffer(self, inp: ProposalInput) -> None:
        """Append the pairs (token_ids[-n:], hidden_states) at positions len - n - 1 ..; drop any stale tail."""
        if inp.hidden_states is None:
            return
        state = self.sequences.setdefault(inp.request_id, _EagleSequence())
        n = inp.hidden_states.shape[0]
        start = len(inp.token_ids) - n - 1  # position of the first new feature
        known = state.num_cached + len(state.pending_tokens)
        if start > known:  # a prefix-cache hit skipped those target rows: pair them with zero features
            missing = start - known
            state.pending_tokens += list(inp.token_ids[known + 1:start + 1])
            state.pending_features += [torch.zeros_like(inp.hidden_states[0])] * missing
        if start < state.num_cached:  # recomputed (e.g. after preemption): rerun from there
            state.num_cached, state.pending_tokens, state.pending_features = start, [], []
        keep = start - state.num_cached
        state.pending_tokens = state.pending_tokens[:keep] + list(inp.token_ids[start + 1:])
        state.pending_features = state.pending_features[:keep] + list(inp.hidden_states)

    def _draft(self, inputs: list[ProposalInput]) -> list[Draft]:
        states = [self.sequences.setdefault(inp.request_id, _EagleSequence()) for inp in inputs]
        root_logits = self._ingest(inputs, states)  # [B, vocab]
        trees: list[list[_Node]] = []
        frontier: list[list[int]] = []  # per request: node indices to expand next
        for logits in root_logits:
            nodes: list[_Node] = []
            trees.append(nodes)
            frontier.append(self._select_frontier(nodes, self._children(logits, nodes, -1)))
        for _ in range(self.depth - 1):
            if not any(frontier):
                break
            logits = self._expand(states, trees, frontier)  # per request [len(frontier), vocab]
            for b in range(len(inputs)):
                added = []
                for node, node_logits in zip(frontier[b], logits[b]):
                    added += self._children(node_logits, trees[b], node)
                frontier[b] = self._select_frontier(trees[b], added)
        return [self._finish(nodes, inp.num_tokens) for nodes, inp in zip(trees, inputs)]

    def _ingest(self, inputs: list[ProposalInput], states: list[_EagleSequence]) -> torch.Tensor:
        """Run the pending pairs of every request into the drafter cache; logits [B, vocab] after the last one."""
        seqs, tokens, features = [], [], []
        for inp, state in zip(inputs, states):
            if not state.pending_tokens:
                raise ValueError(f"EAGLE request {inp.request_id}: no target features to draft from")
            self.block_manager.ensure_capacity(state.blocks, state.num_cached + len(state.pending_tokens))
            seqs.append(SequenceInput(state.pending_tokens, state.num_cached, state.blocks.blocks))
            tokens += state.pending_tokens
            features.append(torch.stack(state.pending_features))
        out = self.net(seqs, self.kv, tokens, torch.cat(features))
        end = 0
        for state in states:
            end += len(state.pending_tokens)
            state.root_feature = out.hidden_states[end - 1]  # [H] drafter feature at the last committed token
            state.num_cached += len(state.pending_tokens)
            state.pending_tokens, state.pending_features = [], []
        return out.logits

    def _children(self, logits: torch.Tensor, nodes: list[_Node], parent: int) -> list[int]:
        """Append parent's children to `nodes` from its draft logits [vocab]; returns their indices."""
        logq = torch.log_softmax(logits.float(), dim=-1)  # [vocab] draft log-probabilities
        path = () if parent < 0 else nodes[parent].path
        base = 0.0 if parent < 0 else nodes[parent].score
        if self.tree is not None:  # static: the choices one level below this path
            ranks = [c[-1] for c in self.tree.choices if c[:-1] == path]
        else:
            ranks = list(range(self.top_k))
        if not ranks:
            return []
        top = logq.topk(max(ranks) + 1)
        ids = self.net.target_ids(top.indices)
        for r in ranks:
            nodes.append(_Node(int(ids[r]), parent, base + float(top.values[r]), path + (r,)))
        return list(range(len(nodes) - len(ranks), len(nodes)))

    def _select_frontier(self, nodes: list[_Node], candidates: list[int]) -> list[int]:
        """Nodes to expand at the next level: static: those with children in the choices; dynamic: top_k by score."""
        if self.tree is not None:
            prefixes = {c[:-1] for c in self.tree.choices}
            return [j for j in candidates if nodes[j].path in prefixes]
        return sorted(candidates, key=lambda j: -nodes[j].score)[: self.top_k]

    def _expand(self, states: list[_EagleSequence], trees: list[list[_Node]], frontier: list[list[int]]) -> list[torch.Tensor]:
        """One drafter forward over each request's expanded nodes (tree mask); logits of its frontier nodes."""
        seqs, tokens, features, fed_of = [], [], [], []
        for state, nodes, front in zip(states, trees, frontier):
            fed = sorted(self._with_ancestors(nodes, front))  # parents come before children
            index = {j: i for i, j in enumerate(fed)}
            parents = [index[nodes[j].parent] if nodes[j].parent >= 0 else -1 for j in fed]
            self.block_manager.ensure_capacity(state.blocks, state.num_cached + len(fed))
            seqs.append(SequenceInput([nodes[j].token for j in fed], state.num_cached, state.blocks.blocks,
                                      parents=parents, logits_rows=[index[j] for j in front]))
            tokens += [nodes[j].token for j in fed]
            features.append(self._parent_features(state, nodes, fed))
            fed_of.append(fed)
        out = self.net(seqs, self.kv, tokens, torch.cat(features))
        logits, row, hid = [], 0, 0
        for state, nodes, front, fed in zip(states, trees, frontier, fed_of):
            logits.append(out.logits[row:row + len(front)])
            for i, j in enumerate(fed):
                nodes[j].feature = out.hidden_states[hid + i]  # [H] drafter feature after node j
            row += len(front)
            hid += len(fed)
        return logits

    def _with_ancestors(self, nodes: list[_Node], front: list[int]) -> set[int]:
        keep = set()
        for j in front:
            while j >= 0 and j not in keep:
                keep.add(j)
                j = nodes[j].parent
        return keep

    def _parent_features(self, state: _EagleSequence, nodes: list[_Node], fed: list[int]) -> torch.Tensor:
        """The feature each fed node pairs with: its parent's drafter feature (the root's for depth 1). [n, H]"""
        return torch.stack([state.root_feature if nodes[j].parent < 0 else nodes[nodes[j].parent].feature for j in fed])

    def _finish(self, nodes: list[_Node], budget: int) -> Draft:
        """The draft sent for verification: breadth-first, at most `budget` nodes (dynamic: the most confident)."""
        if self.tree is not None:
            chosen = sorted(range(len(nodes)), key=lambda j: (nodes[j].depth, nodes[j].path))[:budget]
        else:
            best = sorted(range(len(nodes)), key=lambda j: (-nodes[j].score, nodes[j].depth))[:budget]
            chosen = sorted(self._with_ancestors(nodes, best), key=lambda j: (nodes[j].depth, j))[:budget]
        index = {j: i for i, j in enumerate(chosen)}
        return Draft(token_ids=[nodes[j].token for j in chosen],
                     parents=[index[nodes[j].parent] if nodes[j].parent >= 0 else -1 for j in chosen])

    def update(self, request_id: str, num_accepted: int, num_proposed: int) -> None:
        """Static or confidence-driven trees: nothing to adapt."""

    def release(self, request_id: str) -> None:
        """Free the request's drafter KV blocks."""
        state = self.sequences.pop(request_id, None)
        if state is not None:
            self.block_manager.free(state.blocks)
