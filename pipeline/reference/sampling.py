"""Per-request sampling parameters and logits processing.

Order: raw logits -> penalties, bad words and min_length bans -> (greedy: argmax) -> temperature
-> top_k -> top_p -> p. Repetition, presence and frequency penalties count every token of the
sequence, prompt included, as TensorRT-LLM's penalty kernel does (cpp/tensorrt_llm/kernels/
penaltyKernels.cu counts the input tokens in the context phase, then each generated token). So a
call whose input_ids are prompt + generated tokens (BLS rounds, plain chunks) penalises exactly as
one long call would. Every row is processed with its own context, so a draft row k tokens ahead is
penalised exactly as plain decoding would penalise it k steps later. (TensorRT-LLM subtracts the
presence / frequency penalties after dividing by the temperature; here they are subtracted before.)
Randomness: the token at sequence position i comes from `position_generator(seed, i)` only (see
pipeline/seeds.py), so a seeded request's tokens do not depend on batching or on how it is split
into calls.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from pipeline.seeds import SEED_BITS, derive_seed


@dataclass
class SamplingParams:
    """How one request picks its tokens (names as in the tensorrtllm backend's inputs)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # over prompt and output tokens: logit / r if > 0 else logit * r
    presence_penalty: float = 0.0  # subtracted once from every token already in the sequence
    frequency_penalty: float = 0.0  # subtracted per occurrence in the sequence
    min_length: int = 0  # end_id is banned until this many tokens are generated
    end_id: int | None = None
    stop_words: list[list[int]] = field(default_factory=list)  # generation stops after any of these sequences
    bad_words: list[list[int]] = field(default_factory=list)  # sequences that are never completed

    @property
    def greedy(self) -> bool:
        """Temperature 0: always the argmax (top_k = 1 at any temperature gives the same tokens)."""
        return self.temperature == 0.0

    @property
    def argmax_only(self) -> bool:
        """Whether a token needs nothing of its raw logits but their argmax: greedy, with no penalties or bans."""
        return self.greedy and not _needs_processing(self)

    def problems(self, vocab_size: int) -> list[tuple[str, str]]:
        """(field, fix) for every invalid parameter; empty when valid."""
        out = []
        if self.temperature < 0:
            out.append(("temperature", "use 0 for greedy or a positive value"))
        if self.top_k < 0:
            out.append(("top_k", "use 0 (no limit) or a positive count"))
        if not 0.0 < self.top_p <= 1.0:
            out.append(("top_p", "use a value in (0, 1]"))
        if self.repetition_penalty <= 0:
            out.append(("repetition_penalty", "use a positive value (1.0 = off)"))
        if self.min_length < 0:
            out.append(("min_length", "use 0 or a positive count"))
        if self.end_id is not None and not 0 <= self.end_id < vocab_size:
            out.append(("end_id", f"use a token id in [0, {vocab_size})"))
        for name in ("stop_words", "bad_words"):
            words = getattr(self, name)
            if any(len(w) == 0 or any(not 0 <= t < vocab_size for t in w) for w in words):
                out.append((name, f"use non-empty lists of token ids in [0, {vocab_size})"))
        return out


def request_seed(params: SamplingParams) -> int:
    """The seed every random stream of a request derives from: params.seed, else a fresh random one."""
    return int(params.seed) if params.seed is not None else random.getrandbits(SEED_BITS)


def position_generator(seed: int, position: int) -> torch.Generator:
    """The random stream that picks the token at sequence index `position` (prompt tokens included)."""
    return torch.Generator().manual_seed(derive_seed(seed, "pos", position))


def process_logits(logits: torch.Tensor, contexts: list[list[int]], num_prompt: int, params: SamplingParams) -> torch.Tensor:
    """Penalties and bans for each row; logits: [R, vocab] float32, contexts[r]: every token before row r's next token."""
    if not _needs_processing(params):
        return logits
    out = logits.clone()
    for r, context in enumerate(contexts):
        row = out[r]  # [vocab]
        generated = context[num_prompt:]
        if params.repetition_penalty != 1.0 and context:
            seen = torch.tensor(sorted(set(context)), dtype=torch.long)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
        if (params.presence_penalty or params.frequency_penalty) and context:
            ids, counts = torch.tensor(context, dtype=torch.long).unique(return_counts=True)
            row[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(row.dtype)
        if params.end_id is not None and len(generated) < params.min_length:
            row[params.end_id] = float("-inf")
        for word in params.bad_words:
            prefix = word[:-1]
            if not prefix or context[len(context) - len(prefix):] == prefix:
                row[word[-1]] = float("-inf")
    return out


def _needs_processing(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or (params.min_length > 0 and params.end_id is not None) or bool(params.bad_words))


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p [R, vocab] after temperature, top_k and top_p, from processed logits [R, vocab]."""
    if params.greedy:  # the distribution greedy decoding samples from: one-hot on the argmax
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(torch.float32)
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]  # [R, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_p = sorted_logits.softmax(dim=-1)
        drop = sorted_p.cumsum(dim=-1) - sorted_p > params.top_p  # keep the smallest prefix reaching top_p
        scaled = scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled.softmax(dim=-1)
