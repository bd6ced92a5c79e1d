"""The speculative orchestrator behind tensorrt_llm_bls: propose, verify, stream, repeat.

One `SpeculativeDecoder.generate` call serves one text request as an async generator of token
chunks. Model calls go through an injected `ModelClient` (Triton BLS calls in the server), so
many requests run concurrently and the target/draft engines batch them in flight.

Each round of a speculative request:
1. propose K tokens: the draft model (tensorrt_llm_draft, asked for K tokens, plus its raw logits
   when use_draft_logits) or prompt lookup (sequences.ngram_lookup, in process, no model);
2. verify: one target call with input_ids = the sequence so far, draft_input_ids = the proposal
   (and draft_logits for lossless rejection sampling), request_output_len = K + 1; the target
   returns the accepted prefix plus its own next token (TensorRT-LLM's draft_tokens_external);
3. apply end_id / stop words / max_tokens over everything generated and emit the new tokens.
Plain requests (no speculation, or medusa/eagle where the target engine speculates itself)
stream straight from one target call. A draft failure switches that request to plain decoding,
counted and logged; acceptance below min_acceptance_rate does the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

import numpy as np

from pipeline.modes import traits
from pipeline.seeds import ROLE_DRAFT, ROLE_TARGET, role_seed
from pipeline.sequences import common_prefix_len, find_stop, ngram_lookup
from pipeline.serving.errors import RequestError
from pipeline.serving.params import BlsSettings, TextRequest
from pipeline.serving.text import IncrementalDetokenizer

ROUNDS_BEFORE_ACCEPTANCE_CHECK = 8  # rounds a request speculates before min_acceptance_rate may switch it off
# Plain decoding streams from target calls of at most this many tokens: Triton 2.51 cannot cancel a
# BLS sub-request, so a cancelled request stops within one chunk.
PLAIN_CHUNK_TOKENS = 64


class ModelError(RuntimeError):
    """A model call returned an error."""


class DraftError(ModelError):
    """The draft model (or proposer) failed: the request can continue without speculation."""


@dataclass
class Generation:
    """What one target or draft call returned."""

    tokens: list[int]
    logits: np.ndarray | None = None  # [n, vocab] raw logits (draft calls with return_generation_logits)


class ModelClient(Protocol):
    """Calls into the tensorrt_llm-interface models (Triton BLS requests in the server)."""

    async def generate(self, model: str, prompt_ids: list[int], max_new: int, req: TextRequest, seed: int | None,
                       draft_ids: list[int] | None = None, draft_logits: np.ndarray | None = None,
                       return_logits: bool = False) -> Generation:
        """One non-streaming call."""
        ...

    def stream(self, model: str, prompt_ids: list[int], max_new: int, req: TextRequest, seed: int | None) -> AsyncIterator[list[int]]:
        """One streaming call: yields new tokens as the model produces them."""
        ...


@dataclass
class RequestStats:
    """Per-request speculation counters (the tensorrtllm backend's output names)."""

    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0
    rounds: int = 0
    fell_back: bool = False

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.total_accepted_draft_tokens / self.total_draft_tokens if self.total_draft_tokens else 0.0


@dataclass
class Chunk:
    """Tokens to emit; `final` on the last chunk."""

    token_ids: list[int]
    final: bool = False
    stats: RequestStats = field(default_factory=RequestStats)


class SpecMetricsSink(Protocol):
    """Where rounds are counted (Prometheus families in the server)."""

    def round(self, proposed: int, accepted: int) -> None: ...
    def fallback(self) -> None: ...


class SpeculativeDecoder:
    """Runs text requests against the target (and draft) models; see the module docstring."""

    def __init__(self, settings: BlsSettings, client: ModelClient, metrics: SpecMetricsSink,
                 log_warning: Callable[[str], None] = print, log_info: Callable[[str], None] = print):
        self.settings = settings
        self.client = client
        self.metrics = metrics
        self.log_warning = log_warning
        self.log_info = log_info
        # prompt lookup's n-gram sizes when the BLS makes the drafts itself (mode ngram), else None
        self.ngram = (settings.ngram_min, settings.ngram_max) if traits(settings.speculative_mode).bls_lookup else None

    def check_limits(self, req: TextRequest) -> None:
        """Speculative requests re-send the whole sequence each round: it must fit the target's input limit."""
        if req.num_draft_tokens and len(req.prompt_ids) + req.max_tokens - 1 > self.settings.verify_input_len:
            raise RequestError("max_tokens", f"prompt + max_tokens exceed {self.settings.verify_input_len}, the target "
                               "engine's input limit that bounds speculative requests",
                               f"ask for at most {self.settings.verify_input_len + 1 - len(req.prompt_ids)} tokens, "
                               "or send num_draft_tokens 0")

    def speculates(self, req: TextRequest) -> bool:
        """Whether this request runs speculative rounds (policy: K > 0, long enough output)."""
        return req.num_draft_tokens > 0 and req.max_tokens >= self.settings.min_new_tokens_for_speculation

    async def generate(self, req: TextRequest, cancelled: Callable[[], bool]) -> AsyncIterator[Chunk]:
        """Yield token chunks for one request; the last has final=True and the request's stats."""
        self.check_limits(req)
        stats = RequestStats()
        generated: list[int] = []
        speculate = self.speculates(req)
        while len(generated) < req.max_tokens and not cancelled():
            remaining = req.max_tokens - len(generated)
            if not speculate or remaining == 1:
                async for new in self._plain(req, generated, remaining, cancelled):
                    keep, reason = find_stop(generated + new, len(new), req.end_id, req.stop_words)
                    generated += new[:keep]
                    if new[:keep]:
                        yield Chunk(new[:keep])
                    if reason:
                        break
                break
            try:
                new, proposed, accepted, stopped = await self._round(req, generated, min(req.num_draft_tokens, remaining - 1))
            except DraftError as exc:
                self.log_warning(f"tensorrt_llm_bls: draft model failed ({exc}); this request continues without speculation")
                self.metrics.fallback()
                stats.fell_back, speculate = True, False
                continue
            stats.rounds += 1
            stats.total_draft_tokens += proposed
            stats.total_accepted_draft_tokens += accepted
            if proposed:
                self.metrics.round(proposed, accepted)
            keep, reason = find_stop(generated + new, len(new), req.end_id, req.stop_words)
            generated += new[:keep]
            if new[:keep]:
                yield Chunk(new[:keep])
            if reason or stopped:
                break
            if (stats.rounds >= ROUNDS_BEFORE_ACCEPTANCE_CHECK and stats.total_draft_tokens
                    and stats.acceptance_rate < self.settings.min_acceptance_rate):
                speculate = False
        if cancelled():
            self.log_info(f"tensorrt_llm_bls: request cancelled after {len(generated)} of {req.max_tokens} tokens")
        yield Chunk([], final=True, stats=stats)

    async def _plain(self, req: TextRequest, generated: list[int], max_new: int,
                     cancelled: Callable[[], bool]) -> AsyncIterator[list[int]]:
        done = 0
        while done < max_new:
            chunk = min(PLAIN_CHUNK_TOKENS, max_new - done)
            got = 0
            async for new in self.client.stream(self.settings.target_model, req.prompt_ids + generated, chunk, req,
                                                role_seed(req.sampling.seed, ROLE_TARGET)):
                got += len(new)
                yield new  # the caller appends it to `generated`
            done += got
            if got < chunk or cancelled():  # the target stopped (end_id / stop word), or the client left
                return

    async def _round(self, req: TextRequest, generated: list[int], k: int) -> tuple[list[int], int, int, bool]:
        """One propose + verify round: (new tokens, proposed, accepted, whether the target stopped early)."""
        seq = req.prompt_ids + generated
        # One seed per role, never per round: the engines key each token's randomness by its sequence
        # position (pipeline/seeds.py), so rounds never replay a stream and K changes nothing.
        seed = role_seed(req.sampling.seed, ROLE_TARGET)
        draft_logits = None
        if self.ngram is not None:
            draft = ngram_lookup(seq, k, *self.ngram)
        else:
            try:
                proposal = await self.client.generate(self.settings.draft_model, seq, k, req,
                                                      role_seed(req.sampling.seed, ROLE_DRAFT),
                                                      return_logits=req.use_draft_logits)
            except Exception as exc:
                raise DraftError(f"draft: {exc}") from exc
            draft, draft_logits = proposal.tokens[:k], proposal.logits
            if draft_logits is not None:
                draft_logits = draft_logits[:len(draft)]
        if not draft:  # nothing to verify: the target decodes K + 1 tokens plainly
            out = await self.client.generate(self.settings.target_model, seq, k + 1, req, seed)
            return out.tokens, 0, 0, len(out.tokens) < k + 1
        out = await self.client.generate(self.settings.target_model, seq, len(draft) + 1, req, seed,
                                         draft_ids=draft, draft_logits=draft_logits if req.use_draft_logits else None)
        # The target returns the accepted prefix plus one token of its own; fewer means it hit end_id or a stop word.
        accepted = min(common_prefix_len(draft, out.tokens), len(draft))
        return out.tokens, len(draft), accepted, len(out.tokens) < accepted + 1


class TextResponder:
    """Turns one request's token chunks into response arrays (NVIDIA's BLS output names).

    Streaming requests get a text delta per chunk (never a split multi-byte character) and a final
    response carrying the counters; non-streaming requests get one final response. As in NVIDIA's
    backend, only a non-streaming response starts with the prompt (exclude_input_in_output false):
    streamed responses carry generated text only.
    """

    def __init__(self, req: TextRequest, prompt_text: str, tokenizer, skip_special_tokens: bool):
        self.req = req
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        with_prompt = not req.exclude_input_in_output and not req.stream
        self.pending = prompt_text if with_prompt else ""  # text not sent yet
        self.num_tokens = 0

    def on_chunk(self, chunk: Chunk) -> dict[str, np.ndarray] | None:
        """The arrays to send for this chunk, or None when there is nothing to send yet."""
        self.num_tokens += len(chunk.token_ids)
        self.pending += self.detok.add(chunk.token_ids) if chunk.token_ids else ""
        if chunk.final:
            self.pending += self.detok.flush()
        elif not self.req.stream or not self.pending:
            return None
        text, self.pending = self.pending, ""
        # [batch]: NVIDIA's BLS returns one string per request and its clients read text_output[0]
        arrays = {"text_output": np.array([text.encode("utf-8")], dtype=object)}
        if chunk.final:
            st = chunk.stats
            arrays["acceptance_rate"] = np.array([[st.acceptance_rate]], dtype=np.float32)
            arrays["total_accepted_draft_tokens"] = np.array([[st.total_accepted_draft_tokens]], dtype=np.int32)
            arrays["total_draft_tokens"] = np.array([[st.total_draft_tokens]], dtype=np.int32)
            if self.req.return_num_input_tokens:
                arrays["num_input_tokens"] = np.array([[len(self.req.prompt_ids)]], dtype=np.int32)
            if self.req.return_num_output_tokens:
                arrays["num_output_tokens"] = np.array([[self.num_tokens]], dtype=np.int32)
        return arrays
