"""DraftModelProposer: draft tokens from a small LlamaModel with its own paged KV cache.

Each propose call runs the draft model over all requests that want a draft, batched: one forward
brings every request up to date (the committed tokens its cache lacks, at least the last one) and
yields its first draft token; each further forward adds one draft token per request still short. On fused
layers (a dense float32 draft) the greedy requests' forwards run in one C++ call (`FusedDenseLayers.greedy_chains`:
the same layers, output layer and argmax), as a forward's plan and calls from Python cost about as much as a
small draft's arithmetic, a prompt-long feed included. The draft's output layer runs on 16-bit weights where the
CPU has a kernel for them, bf16 or else fp16 (`linear.draft_output_layer`: the proposer sets it on the model it is
given): its logits only propose, and a float32 output layer was about a third of the trained draft's chain.
The draft cache never needs an explicit rollback: it remembers which tokens its KV holds, and the
next call keeps only the prefix that agrees with the committed tokens (rejected drafts fall away).
Greedy requests get argmax drafts; sampled ones (temperature > 0) get tokens sampled from the
draft's q = softmax(logits / T), returned with the draft so verification stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.limits import TOKENS_PER_BLOCK
from pipeline.reference import decode_threads, fused_layers
from pipeline.reference.greedy_tokens import greedy_tokens
from pipeline.reference.kv_cache import BlockManager, SequenceBlocks
from pipeline.reference.linear import draft_output_layer
from pipeline.reference.model import LlamaModel, SequenceInput
from pipeline.reference.proposers import Draft, ProposalInput
from pipeline.reference.sampling import SamplingParams, probabilities
from pipeline.sequences import common_prefix_len


@dataclass
class _DraftSequence:
    """The draft cache's view of one request."""

    blocks: SequenceBlocks = field(default_factory=SequenceBlocks)
    cached: list[int] = field(default_factory=list)  # tokens whose KV is in the draft cache, in order


@dataclass
class _Job:
    """One request's drafting within a propose call."""

    inp: ProposalInput
    state: _DraftSequence
    feed: list[int]  # tokens to run through the draft model next
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # [vocab] q per drafted token (sampled requests)


class DraftModelProposer:
    """A draft model proposing chains of K tokens (see the module docstring)."""

    needs_hidden_states = False

    def __init__(self, model: LlamaModel, max_batch_size: int = 8, max_seq_len: int = 2048,
                 tokens_per_block: int = TOKENS_PER_BLOCK):
        self.model = model
        model.lm_head_linear = draft_output_layer(model.lm_head_linear)  # 16-bit where it runs: the logits only propose
        num_blocks = max_batch_size * -(-(max_seq_len + 1) // tokens_per_block) + max_batch_size
        self.kv = model.new_kv_cache(num_blocks, tokens_per_block)
        if model.fused_layers is None:
            model.fused_layers = fused_layers.build(model)  # its steps as one C++ call each (None: eager)
        fused = model.fused_layers
        self.greedy_chains = isinstance(fused, fused_layers.FusedDenseLayers) and fused.lm_head is not None
        decode_threads.choose(model, self.kv, draft=True)  # its small forwards on the faster thread count
        self.block_manager = BlockManager(num_blocks, tokens_per_block)
        self.sequences: dict[str, _DraftSequence] = {}

    @classmethod
    def from_hf(cls, checkpoint_dir: str | Path, dtype: str = "float32", **kwargs) -> "DraftModelProposer":
        """A proposer over an HF draft checkpoint."""
        return cls(LlamaModel.from_hf(checkpoint_dir, dtype), **kwargs)

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path, **kwargs) -> "DraftModelProposer":
        """A proposer over a reference draft engine directory."""
        return cls(LlamaModel.from_engine_dir(engine_dir), **kwargs)

    def propose(self, inputs: list[ProposalInput]) -> list[Draft]:
        """A chain of num_tokens draft tokens per request (empty when num_tokens is 0)."""
        jobs = {inp.request_id: self._start(inp) for inp in inputs if inp.num_tokens > 0}
        active = list(jobs.values())
        if self.greedy_chains:  # greedy requests draft in one C++ call; sampled ones forward by forward below
            self._greedy_chains([j for j in active if j.inp.temperature <= 0])
            active = [j for j in active if j.inp.temperature > 0]
        while active:
            active = self._forward(active)
        drafts = []
        for inp in inputs:
            job = jobs.get(inp.request_id)
            if job is None:
                drafts.append(Draft(token_ids=[]))
            else:
                drafts.append(Draft(token_ids=job.tokens, probs=torch.stack(job.probs) if job.probs else None))
        return drafts

    def _start(self, inp: ProposalInput) -> _Job:
        """Trim the request's draft cache to the prefix it shares with the committed tokens; reserve blocks."""
        state = self.sequences.setdefault(inp.request_id, _DraftSequence())
        keep = common_prefix_len(state.cached, inp.token_ids[:-1])  # the last committed token is always fed
        del state.cached[keep:]
        self.block_manager.ensure_capacity(state.blocks, len(inp.token_ids) + inp.num_tokens)
        return _Job(inp=inp, state=state, feed=inp.token_ids[keep:])

    def _forward(self, active: list[_Job]) -> list[_Job]:
        """One draft forward of every active job's feed and a draft token each; returns the jobs still short."""
        seqs = [SequenceInput(j.feed, len(j.state.cached), j.state.blocks.blocks) for j in active]
        logits = self.model(seqs, self.kv).logits  # [len(active), vocab]: after each request's last fed token
        for job, row in zip(active, logits):
            job.state.cached += job.feed
            self._pick(job, row)
            job.feed = job.tokens[-1:]
        return [j for j in active if len(j.tokens) < j.inp.num_tokens]

    def _greedy_chains(self, jobs: list[_Job]) -> None:
        """Every greedy job's argmax chain in one call of the fused layers' `greedy_chains` (the same layers, output
        layer and argmax as `_forward`), a prompt-long feed included: a request's first propose (its prompt and one
        token) took 0.80 / 1.40 / 2.89 ms there against 1.32 / 2.06 / 4.00 with the prompt on the prefill path first
        at 60 / 150 / 400 tokens (the trained draft), 20 / 37 / 79 ms against 23 / 39 / 85 (SmolLM2's 4-layer draft;
        docs/benchmarks.md)."""
        if not jobs:
            return
        counts = [j.inp.num_tokens - len(j.tokens) for j in jobs]
        chains = self.model.fused_layers.greedy_chains([j.feed for j in jobs], [len(j.state.cached) for j in jobs],
                                                       counts, [j.state.blocks.blocks for j in jobs], self.kv)
        for job, tokens in zip(jobs, chains):
            job.state.cached += job.feed + tokens[:-1]  # the last draft token is never fed
            job.tokens += tokens

    def _pick(self, job: _Job, logits: torch.Tensor) -> None:
        """Append the next draft token from the draft logits [vocab]: argmax, or a sample of q with its q row."""
        if job.inp.temperature <= 0:
            job.tokens += greedy_tokens(logits[None])
            return
        q = probabilities(logits[None], SamplingParams(temperature=job.inp.temperature))[0]  # [vocab] q
        job.tokens.append(int(torch.multinomial(q, 1, generator=job.inp.generator)))
        job.probs.append(q)

    def update(self, request_id: str, num_accepted: int, num_proposed: int) -> None:
        """Nothing to do: the next propose call trims the cache to the committed tokens."""

    def release(self, request_id: str) -> None:
        """Free the request's draft KV blocks."""
        state = self.sequences.pop(request_id, None)
        if state is not None:
            self.block_manager.free(state.blocks)
