"""The speculative orchestrator behind tensorrt_llm_bls: propose, verify, stream, repeat.

One `SpeculativeDecoder.generate` call serves one text request as an async generator of token
chunks. Model calls go through an injected `ModelClient` (Triton BLS calls in the server), so
many requests run concurrently and the target/draft engines batch them in flight.

Each round of a speculative request:
1. propose up to K tokens: the draft model (tensorrt_llm_draft, asked for that many tokens, plus its raw
   logits when use_draft_logits) or prompt lookup (sequences.ngram_lookup, in process, no model, its
   draft cut where the context disagrees with it when ngram_min_token_prob > 0). The
   round's draft length adapts (sequences.next_draft_len): it starts at the request's K (num_draft_tokens; 1 under
   the slow start, below), drops by one after a partly rejected draft and grows by two, never past K, after
   a fully accepted one; a lookup miss decodes draft length + 1 tokens plainly;
2. verify: one target call with input_ids = the sequence so far, draft_input_ids = the proposal
   (and draft_logits for lossless rejection sampling), request_output_len = K + 1; the target
   returns the accepted prefix plus its own next token (TensorRT-LLM's draft_tokens_external);
3. apply end_id / stop words / max_tokens over everything generated and emit the new tokens.
Log-probabilities and logits a request asks for (return_log_probs, return_generation_logits,
return_context_logits) come from the target's calls only, so they are the target's whatever proposed
the tokens; context logits come with the request's first target call.
Plain requests (no speculation, or medusa/eagle where the target engine speculates itself)
stream from target calls of PLAIN_CHUNK_TOKENS tokens; with settings.stream_interval N > 1 the request's first token
comes from a call of its own, then calls of N tokens are answered once each, so each later response carries N
tokens (on a 2-core CPU host each streamed response took about 1.5 ms of CPU beside the engine: N=16 served
8-44% faster, docs/benchmarks.md). So do prompt-lookup requests where the target
engine runs the lookup itself (settings.engine_lookup, the reference toolchain, as TensorRT-LLM's
PyTorch backend runs NGram): every call carries the request's K (num_draft_tokens, 0 for a request that
does not speculate), the engine drafts and verifies in its own step loop under the same rules (the cut,
adaptive draft length, the switch-off bar and the batch gate: load_serving_engine), and the BLS only
adds up the acceptance counters the engine returns (the engine's model exports the spec_decode_*
metrics). That saves the BLS round trip of every round (about 3 ms on these CPUs, docs/benchmarks.md),
and a lookup miss costs one plain step instead of K + 1 plain tokens. A draft failure switches that
request to plain decoding, counted and logged. The switch-off (`RoundPolicy`): a request whose acceptance since it
last (re)started drafting is below the switch-off bar (min_acceptance_rate, or the measured break-even
`draft_token_cost` when that is higher: what a draft token costs a round, in plain steps; a draft accepted less often
than that makes the request slower than plain decoding) after ROUNDS_BEFORE_ACCEPTANCE_CHECK rounds, or whose
rounds so far rule out reaching it (pipeline.acceptance's early stop, as the engine's policy stops a hopeless draft),
backs off: it decodes BACK_OFF_TOKENS tokens plainly, twice as many after each further back-off, then drafts
again from one-token drafts and fresh evidence (an answer that stops copying for a while, say a
summary's own opening, may copy again later; a request whose drafts never pay spends ever less on
them: `make bench-lookup` replays both). Where draft tokens have a measured cost, a request also starts from
one-token drafts (the slow start). Where the model instance's recent requests' rounds rule out the bar
(`SpeculativeDecoder.recent`, fading with the tokens the instance generates, as the engine's policy weighs finished
requests' evidence), a request starts with a back-off and backs off further when one ends: a useless draft is probed
by a few requests now and then, not by every request after each back-off, and a request it keeps off pays no draft
prefill before its first token. While more
requests than max_batch_for_speculation are in flight in this model instance (the batch gate, as
TensorRT-LLM's Drafter and vLLM's disable_by_batch_size), speculative requests decode plain chunks.
Requests in flight are counted once, by `admit()`: the caller holds it for the whole request (the
Triton model from admission to its last response), the batch gate and the in-flight gauge read it.
A request whose `stop()` turns true (client gone, server shutting down) ends within one round or
one plain chunk by raising `Stopped`: it never ends with a final response that looks complete.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator, Protocol

import numpy as np

from pipeline.acceptance import ChainEvidence
from pipeline.limits import PLAIN_CHUNK_TOKENS
from pipeline.modes import traits
from pipeline.seeds import ROLE_DRAFT, ROLE_TARGET, role_seed
from pipeline.sequences import common_prefix_len, find_stop, next_draft_len, ngram_lookup
from pipeline.serving.errors import RequestError, Stopped
from pipeline.serving.params import BlsSettings, TextRequest
from pipeline.serving.text import IncrementalDetokenizer

ROUNDS_BEFORE_ACCEPTANCE_CHECK = 8  # rounds a request speculates before the switch-off bar may back it off
BACK_OFF_TOKENS = 16  # the first back-off's plain tokens; each further back-off of the request doubles it
# The recent requests' rounds (SpeculativeDecoder.recent) weigh half as much after the model instance generated this
# many more tokens (the engine's policy fades its finished requests' evidence per step): two one-token probes
# rejected keep a useless draft of K=4 off at a bar of 0.7 for about 100 tokens of traffic, two more for about 300
RECENT_HALF_LIFE_TOKENS = 256


class ModelError(RuntimeError):
    """A model call returned an error."""


class ModelDown(ModelError):
    """The model's stub died: calls to it fail at once from now on (reported once where it is detected)."""


class DraftError(ModelError):
    """The draft model (or proposer) failed: the request can continue without speculation."""


@dataclass(frozen=True)
class Returns:
    """What a model call returns besides token ids (the tensorrt_llm return_* inputs)."""

    log_probs: bool = False
    generation_logits: bool = False
    context_logits: bool = False


@dataclass
class Generation:
    """What one target or draft call returned."""

    tokens: list[int]
    logits: np.ndarray | None = None  # [n, vocab] raw logits (return_generation_logits)
    log_probs: list[float] | None = None  # [n] (return_log_probs)
    context_logits: np.ndarray | None = None  # [prompt_len, vocab] (return_context_logits)
    # a target that drafts itself (engine_lookup): its draft tokens and accepted ones so far in this call (totals)
    drafted: int = 0
    accepted: int = 0

    def head(self, n: int) -> "Generation":
        """The first n tokens with their per-token outputs."""
        return Generation(self.tokens[:n], None if self.logits is None else self.logits[:n],
                          None if self.log_probs is None else self.log_probs[:n], self.context_logits,
                          self.drafted, self.accepted)


class ModelClient(Protocol):
    """Calls into the tensorrt_llm-interface models (Triton BLS requests in the server). Each call names its chain,
    `req.call_chain(prompt_ids, max_new)` (a request parameter, CHAIN_PARAMETER), by which the engine regathers a
    request's calls (EngineRunner)."""

    async def generate(self, model: str, prompt_ids: list[int], max_new: int, req: TextRequest, seed: int | None,
                       draft_ids: list[int] | None = None, draft_logits: np.ndarray | None = None,
                       returns: Returns = Returns()) -> Generation:
        """One non-streaming call."""
        ...

    def stream(self, model: str, prompt_ids: list[int], max_new: int, req: TextRequest, seed: int | None,
               returns: Returns = Returns(), engine_draft_len: int | None = None,
               streaming: bool = True) -> AsyncIterator[Generation]:
        """One streaming call: yields new tokens (and what `returns` asks for) as the model produces them.
        engine_draft_len: K for a target that drafts itself (engine_io.engine_inputs). streaming=False: the model
        answers the call once, with all of its tokens (one response instead of one a step)."""
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


class RoundPolicy:
    """One request's draft length and switch-off over its rounds (see the module docstring), for the BLS and for
    `make bench-lookup`'s replay.

    The draft length starts at K, or at 1 under the slow start (draft tokens have a measured cost, as in the engine's
    policy: a useless draft is found out by one-token probes, each standing for the draft of K it cut in the early
    stop's evidence, until one of them is accepted); adaptive, it then follows `next_draft_len`. The evidence is the
    rounds since drafting last (re)started: a round that drafted nothing (a lookup miss) counts towards
    ROUNDS_BEFORE_ACCEPTANCE_CHECK, and the bar is linear: `bar` accepted tokens per draft token."""

    def __init__(self, k: int, bar: float, slow_start: bool = False, adaptive: bool = True,
                 recent: ChainEvidence | None = None):
        """recent: the chain evidence of recent requests' rounds, which this request's rounds join; where it rules out
        the bar, the request starts with a back-off (`opening_plain` tokens) and backs off further (`resume`)."""
        self.k, self.bar, self.adaptive, self.recent = k, bar, adaptive, recent
        self.back_off = BACK_OFF_TOKENS  # the next back-off's plain tokens
        self._start(probing=slow_start and bar > 0 and k > 1)
        self.opening_plain = self.resume()

    def resume(self) -> int:
        """Before drafting (the request's first round, and the first after each back-off): the plain tokens of a
        (further) back-off where the recent requests' rounds rule out the bar, else 0."""
        return self._back_off() if self.recent is not None and self.bar > 0 and not self._may_pay(self.recent) else 0

    def _start(self, probing: bool) -> None:
        """Fresh evidence; one-token drafts first when probing."""
        self.rounds = self.drafted = self.accepted = 0
        self.chain = ChainEvidence()
        self.probing = probing
        self.draft_len = 1 if probing else self.k

    def _back_off(self) -> int:
        """Start a back-off: its plain tokens (twice as many next time), then fresh evidence."""
        plain, self.back_off = self.back_off, self.back_off * 2
        self._start(probing=self.adaptive)
        return plain

    def record(self, proposed: int, accepted: int) -> int:
        """Count one round that drafted `proposed` tokens (0: a lookup miss), `accepted` of them accepted, and adapt
        the draft length. Returns the plain tokens to decode now before drafting again: 0, or a back-off's."""
        self.rounds += 1
        if proposed:
            self.drafted += proposed
            self.accepted += accepted
            stands_for = self.k if self.probing else 0
            self.chain.add(accepted, proposed, stands_for)
            if self.recent is not None:
                self.recent.add(accepted, proposed, stands_for)
            self.probing = self.probing and accepted == 0
            if self.adaptive:
                self.draft_len = next_draft_len(self.draft_len, accepted, proposed, self.k)
        if self.bar <= 0 or not self.drafted or self._may_pay(self.chain):
            return 0
        return self._back_off()

    def _may_pay(self, chain: ChainEvidence) -> bool:
        """After ROUNDS_BEFORE_ACCEPTANCE_CHECK rounds: whether the acceptance clears the bar; before: whether the
        chain evidence (the rounds', or recent requests') does not rule that out (pipeline.acceptance)."""
        if self.rounds >= ROUNDS_BEFORE_ACCEPTANCE_CHECK:
            return self.accepted >= self.bar * self.drafted
        return chain.optimistic_accepted() >= self.bar * chain.draft_tokens


@dataclass
class Chunk:
    """Tokens to emit (with the target's per-token outputs the request asked for); `final` on the last chunk."""

    token_ids: list[int]
    final: bool = False
    stats: RequestStats = field(default_factory=RequestStats)
    target: Generation | None = None  # token_ids with their log-probs / logits, and the context logits once


class SpecMetricsSink(Protocol):
    """Where rounds are counted (Prometheus families in the server)."""

    def round(self, proposed: int, accepted: int) -> None: ...
    def fallback(self) -> None: ...


class SpeculativeDecoder:
    """Runs text requests against the target (and draft) models; see the module docstring."""

    def __init__(self, settings: BlsSettings, client: ModelClient, metrics: SpecMetricsSink,
                 log_warning: Callable[[str], None] = print, on_in_flight: Callable[[int], None] = lambda n: None):
        self.settings = settings
        self.client = client
        self.metrics = metrics
        self.log_warning = log_warning
        # prompt lookup's settings when the BLS makes the drafts itself (mode ngram, not engine_lookup), else None
        self.ngram = ((settings.ngram_min, settings.ngram_max, settings.ngram_min_token_prob)
                      if traits(settings.speculative_mode).prompt_lookup and not settings.engine_lookup else None)
        # recent requests' rounds (RoundPolicy), fading with RECENT_HALF_LIFE_TOKENS; None where no request runs rounds
        # under a switch-off (no BLS drafts: none, medusa, eagle, or a target that drafts itself; no switch-off bar)
        rounds = traits(settings.speculative_mode).bls_drafts and not settings.engine_lookup
        self.recent = ChainEvidence() if rounds and settings.switch_off_below > 0 else None
        self.in_flight = 0  # requests admitted in this model instance and not finished (see admit())
        self.on_in_flight = on_in_flight  # told every new in_flight count (the server's gauge)

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

    @contextmanager
    def admit(self) -> Iterator[None]:
        """Count one request in flight while the block runs (the batch gate and the in-flight gauge read it)."""
        self._count(+1)
        try:
            yield
        finally:
            self._count(-1)

    def _count(self, delta: int) -> None:
        self.in_flight += delta
        self.on_in_flight(self.in_flight)

    async def generate(self, req: TextRequest, cancelled: Callable[[], bool]) -> AsyncIterator[Chunk]:
        """Yield token chunks for one request; the last has final=True and the request's stats.

        Call it inside `admit()`, so that the batch gate counts the request. Raises Stopped when
        `cancelled()` turned true before the request finished.
        """
        self.check_limits(req)
        async for chunk in self._generate(req, cancelled):
            yield chunk

    def gated(self) -> bool:
        """The batch gate: more requests in flight here than speculative.max_batch_for_speculation decode plainly."""
        return self.in_flight > self.settings.max_batch_for_speculation

    async def _generate(self, req: TextRequest, cancelled: Callable[[], bool]) -> AsyncIterator[Chunk]:
        stats = RequestStats()
        generated: list[int] = []
        speculate = self.speculates(req)
        engine_k = None  # K for a target that drafts itself: every call carries it, 0 keeps the request plain
        if self.settings.engine_lookup:
            engine_k, speculate = (req.num_draft_tokens if speculate else 0), False
        finished = False  # an end_id / stop word / the target stopping; reaching max_tokens is checked below
        policy = RoundPolicy(req.num_draft_tokens, self.settings.switch_off_below,
                             slow_start=self.settings.draft_token_cost > 0, recent=self.recent if speculate else None)
        resume_at = policy.opening_plain  # a back-off's plain tokens run until this many are generated
        while len(generated) < req.max_tokens and not cancelled():
            remaining = req.max_tokens - len(generated)
            gated = speculate and self.gated()
            backed_off = speculate and len(generated) < resume_at
            if not speculate or remaining == 1 or gated or backed_off:
                # plain to the end; or one plain chunk while the gate holds, or the back-off's plain tokens
                # (then the gate and the back-off are asked again)
                pausing = gated or backed_off
                budget = remaining
                if gated:
                    budget = min(PLAIN_CHUNK_TOKENS, remaining)
                elif backed_off:
                    budget = min(resume_at - len(generated), remaining)
                got, reason = 0, None
                async for out in self._plain(req, generated, budget, cancelled, engine_k, stats):
                    got += len(out.tokens)
                    keep, reason = find_stop(generated + out.tokens, len(out.tokens), req.end_id, req.stop_words)
                    generated += out.tokens[:keep]
                    self._generated(keep)
                    if keep or out.context_logits is not None:
                        yield Chunk(out.tokens[:keep], target=out.head(keep))
                    if reason:
                        break
                if pausing and not reason and got == budget and not cancelled():
                    if backed_off and len(generated) >= resume_at:  # the back-off is over: draft, or back off further
                        resume_at = len(generated) + policy.resume()
                    continue
                finished = bool(reason) or not cancelled()  # _plain returns early only when cancelled
                break
            try:
                out, proposed, accepted, stopped = await self._round(req, generated,
                                                                     min(policy.draft_len, remaining - 1))
            except DraftError as exc:
                if not isinstance(exc.__cause__, ModelDown):  # a dead draft is logged once, not per request
                    self.log_warning(f"tensorrt_llm_bls: draft model failed ({exc}); this request continues without speculation")
                self.metrics.fallback()
                stats.fell_back, speculate = True, False
                continue
            stats.rounds += 1
            stats.total_draft_tokens += proposed
            stats.total_accepted_draft_tokens += accepted
            if proposed:
                self.metrics.round(proposed, accepted)
            plain = policy.record(proposed, accepted)
            keep, reason = find_stop(generated + out.tokens, len(out.tokens), req.end_id, req.stop_words)
            generated += out.tokens[:keep]
            self._generated(keep)
            if keep or out.context_logits is not None:
                yield Chunk(out.tokens[:keep], target=out.head(keep))
            if reason or stopped:
                finished = True
                break
            if plain:
                resume_at = len(generated) + plain
        if not finished and len(generated) < req.max_tokens:
            raise Stopped(f"stopped after {len(generated)} of {req.max_tokens} tokens")
        yield Chunk([], final=True, stats=stats)

    def _generated(self, tokens: int) -> None:
        """Count tokens the model instance generated: the recent requests' rounds (if kept) fade with them."""
        if self.recent is not None:
            self.recent.fade(0.5 ** (tokens / RECENT_HALF_LIFE_TOKENS))

    async def _plain(self, req: TextRequest, generated: list[int], max_new: int, cancelled: Callable[[], bool],
                     engine_k: int | None, stats: RequestStats) -> AsyncIterator[Generation]:
        """Target calls of at most PLAIN_CHUNK_TOKENS tokens, streamed; with a stream interval N > 1 the request's
        first token alone (its time to first token unchanged), then calls of N tokens answered once each. engine_k:
        K for a target that drafts itself, whose counters each call adds to `stats` (the engine's model exports them
        as metrics itself)."""
        done, interval = 0, self.settings.stream_interval
        while done < max_new:
            if interval > 1:
                chunk, streaming = (min(interval, max_new - done) if generated else 1), False
            else:
                chunk, streaming = min(PLAIN_CHUNK_TOKENS, max_new - done), True
            got, last = 0, None
            async for out in self.client.stream(self.settings.target_model, req.prompt_ids + generated, chunk, req,
                                                role_seed(req.sampling.seed, ROLE_TARGET), _target_returns(req, generated),
                                                engine_draft_len=engine_k, streaming=streaming):
                got, last = got + len(out.tokens), out
                yield out  # the caller appends its tokens to `generated`
            if last is not None and last.drafted:
                stats.total_draft_tokens += last.drafted
                stats.total_accepted_draft_tokens += last.accepted
            done += got
            if got < chunk or cancelled():  # the target stopped (end_id / stop word), or the client left
                return

    async def _round(self, req: TextRequest, generated: list[int], k: int) -> tuple[Generation, int, int, bool]:
        """One propose + verify round: (the target's new tokens, proposed, accepted, whether it stopped early)."""
        seq = req.prompt_ids + generated
        # One seed per role, never per round: the engines key each token's randomness by its sequence
        # position (pipeline/seeds.py), so rounds never replay a stream and K changes nothing.
        seed = role_seed(req.sampling.seed, ROLE_TARGET)
        draft_logits = None
        if self.ngram is not None:
            draft, _ = ngram_lookup(seq, k, *self.ngram)
        else:
            try:
                proposal = await self.client.generate(self.settings.draft_model, seq, k, req,
                                                      role_seed(req.sampling.seed, ROLE_DRAFT),
                                                      returns=Returns(generation_logits=req.use_draft_logits))
            except Exception as exc:
                raise DraftError(f"draft: {exc}") from exc
            draft, draft_logits = proposal.tokens[:k], proposal.logits
            if draft_logits is not None:
                draft_logits = draft_logits[:len(draft)]
        returns = _target_returns(req, generated)
        if not draft:  # nothing to verify: the target decodes K + 1 tokens plainly
            out = await self.client.generate(self.settings.target_model, seq, k + 1, req, seed, returns=returns)
            return out, 0, 0, len(out.tokens) < k + 1
        out = await self.client.generate(self.settings.target_model, seq, len(draft) + 1, req, seed,
                                         draft_ids=draft, draft_logits=draft_logits if req.use_draft_logits else None,
                                         returns=returns)
        # The target returns the accepted prefix plus one token of its own; fewer means it hit end_id or a stop word.
        accepted = min(common_prefix_len(draft, out.tokens), len(draft))
        return out, len(draft), accepted, len(out.tokens) < accepted + 1


def _target_returns(req: TextRequest, generated: list[int]) -> Returns:
    """What a target call returns for this request: context logits only with the first call (the prompt alone)."""
    return Returns(log_probs=req.return_log_probs, generation_logits=req.return_generation_logits,
                   context_logits=req.return_context_logits and not generated)


class TextResponder:
    """Turns one request's token chunks into response arrays (NVIDIA's BLS output names).

    Streaming requests get a text delta per chunk (never a split multi-byte character) and a final
    response carrying the counters; non-streaming requests get one final response. Every response
    also carries `output_ids`, the token ids behind its text (our extension: clients align
    log-probabilities with tokens by them), the target's output_log_probs / cum_log_probs /
    generation_logits / context_logits when the request asks for them, and the token counts so far
    when return_num_input_tokens / return_num_output_tokens are set. As in NVIDIA's backend, only a
    non-streaming response starts with the prompt (exclude_input_in_output false): streamed responses
    carry generated text only.
    """

    def __init__(self, req: TextRequest, prompt_text: str, tokenizer, skip_special_tokens: bool):
        self.req = req
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        with_prompt = not req.exclude_input_in_output and not req.stream
        self.pending = prompt_text if with_prompt else ""  # text not sent yet
        self.unsent: list[Chunk] = []  # chunks whose tokens went into `pending`
        self.num_tokens = 0
        self.cum_log_prob = 0.0

    def on_chunk(self, chunk: Chunk) -> dict[str, np.ndarray] | None:
        """The arrays to send for this chunk, or None when there is nothing to send yet."""
        self.num_tokens += len(chunk.token_ids)
        self.unsent.append(chunk)
        self.pending += self.detok.add(chunk.token_ids) if chunk.token_ids else ""
        if chunk.final:
            self.pending += self.detok.flush()
        elif not self.req.stream or not self.pending:
            return None
        text, self.pending = self.pending, ""
        chunks, self.unsent = self.unsent, []
        # [batch]: NVIDIA's BLS returns one string per request and its clients read text_output[0]
        arrays = {"text_output": np.array([text.encode("utf-8")], dtype=object),
                  "output_ids": np.array([[t for c in chunks for t in c.token_ids]], dtype=np.int32)}  # [batch, n]
        arrays.update(self._target_arrays([c.target for c in chunks if c.target is not None]))
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

    def _target_arrays(self, outs: list[Generation]) -> dict[str, np.ndarray]:
        """The target's log-probs and logits for these tokens, in the tensorrt_llm model's shapes."""
        arrays = {}
        if self.req.return_log_probs:
            log_probs = [v for o in outs for v in o.log_probs or []]
            self.cum_log_prob += sum(log_probs)
            arrays["output_log_probs"] = np.array(log_probs, dtype=np.float32).reshape(1, 1, -1)  # [batch, beams, n]
            arrays["cum_log_probs"] = np.array([[self.cum_log_prob]], dtype=np.float32)  # [batch, beams]
        logits = [o.logits for o in outs if o.logits is not None and len(o.logits)]
        if self.req.return_generation_logits and logits:
            gen = np.concatenate(logits).astype(np.float32)  # [n, vocab]
            arrays["generation_logits"] = gen.reshape(1, 1, *gen.shape)  # [batch, beams, n, vocab]
        context = [o.context_logits for o in outs if o.context_logits is not None]
        if self.req.return_context_logits and context:
            arrays["context_logits"] = context[0].astype(np.float32)[None]  # [batch, prompt_len, vocab]
        return arrays
