"""The speculative orchestrator on real in-process engines (LocalModelClient): no server, same request path."""

import asyncio

import numpy as np
import pytest

from pipeline.limits import PLAIN_CHUNK_TOKENS
from pipeline.reference.engine import EngineInputError, LLMEngine
from pipeline.reference.runner import EngineRunner
from pipeline.serving.bls import BACK_OFF_TOKENS, Returns, SpeculativeDecoder
from pipeline.serving.errors import Stopped
from pipeline.serving.local_client import LocalModelClient
from pipeline.serving.params import BlsSettings, parse_text_request
from pipeline.serving.reference_adapter import engine_request, load_serving_engine
from pipeline.serving.text import load_tokenizer


class Rounds:
    """Collects what the decoder reports per round."""

    def __init__(self):
        self.rounds, self.fallbacks = [], 0

    def round(self, proposed, accepted):
        self.rounds.append((proposed, accepted))

    def fallback(self):
        self.fallbacks += 1


@pytest.fixture(scope="module")
def engines(tiny_spec_engines):
    engines_dir = tiny_spec_engines.spec.out_dir / "engines"
    runners = {name: EngineRunner(LLMEngine.from_engine_dir(engines_dir / role, max_input_len=63))
               for name, role in (("tensorrt_llm", "target"), ("tensorrt_llm_draft", "draft"))}
    yield runners, load_tokenizer(str(tiny_spec_engines.target_dir))
    for r in runners.values():
        r.close()


def run(decoder, tokenizer, settings, text, max_tokens, k, **extra):
    inputs = {"text_input": np.array([[text.encode()]], dtype=object),
              "max_tokens": np.array([[max_tokens]], dtype=np.int32),
              "num_draft_tokens": np.array([[k]], dtype=np.int32), **extra}
    req = parse_text_request(inputs, settings, tokenizer)

    async def collect():
        chunks = [c async for c in decoder.generate(req, lambda: False)]
        return [t for c in chunks for t in c.token_ids], chunks[-1].stats

    return asyncio.run(collect())


@pytest.mark.parametrize("mode", ["draft_target", "ngram"])
def test_speculative_equals_plain_greedy(engines, mode):
    runners, tokenizer = engines
    settings = BlsSettings(tokenizer_dir="", draft_model="tensorrt_llm_draft", speculative_mode=mode, max_draft_len=4,
                           max_input_len=48, max_seq_len=64, verify_input_len=63)
    sink = Rounds()
    decoder = SpeculativeDecoder(settings, LocalModelClient(runners), sink)
    text = "the the the cat sat on the mat and the cat sat on the"
    plain, plain_stats = run(decoder, tokenizer, settings, text, 24, 0)
    spec, stats = run(decoder, tokenizer, settings, text, 24, 3)
    assert spec == plain and len(plain) == 24
    assert plain_stats.total_draft_tokens == 0
    assert stats.total_draft_tokens == sum(p for p, _ in sink.rounds) > 0
    assert stats.total_accepted_draft_tokens == sum(a for _, a in sink.rounds)
    assert all(0 <= a <= p <= 3 for p, a in sink.rounds)


LOOKUP_PARAMETERS = {"speculative_mode": "ngram", "num_draft_tokens": "3", "ngram_min": "1", "ngram_max": "3",
                     "ngram_min_token_prob": "0", "min_acceptance_rate": "0"}


@pytest.fixture(scope="module")
def lookup_runner(tiny_spec_engines):
    """The tiny target as the reference toolchain serves an n-gram spec: it drafts by prompt lookup itself."""
    runner = EngineRunner(load_serving_engine(tiny_spec_engines.spec.out_dir / "engines" / "target", LOOKUP_PARAMETERS))
    yield runner
    runner.close()


def test_engine_lookup_streams_forwards_k_and_counts_the_engines_drafts(engines, lookup_runner):
    """Where the target engine runs prompt lookup itself (the reference toolchain), the BLS makes no rounds: it
    streams plain calls that carry the request's K (0 keeps the engine plain), adds up the acceptance counters
    the engine returns, and the greedy text equals plain decoding's."""
    _, tokenizer = engines
    settings = BlsSettings(tokenizer_dir="", speculative_mode="ngram", max_draft_len=4, max_input_len=48,
                           max_seq_len=64, verify_input_len=63, engine_lookup=True)
    sink, client = Rounds(), RecordingClient(LocalModelClient({"tensorrt_llm": lookup_runner}))
    decoder = SpeculativeDecoder(settings, client, sink)
    text = "the the the cat sat on the mat and the cat sat on the"
    counted = lookup_runner.engine.stats.spec  # summed over the engine's finished requests
    before = (counted.draft_tokens, counted.accepted_tokens)
    plain, plain_stats = run(decoder, tokenizer, settings, text, 24, 0)
    assert plain_stats.total_draft_tokens == 0 and counted.draft_tokens == before[0]
    spec, stats = run(decoder, tokenizer, settings, text, 24, 3)
    assert spec == plain and len(plain) == 24
    assert not sink.rounds  # no BLS round: the engine drafted and verified in its own steps
    assert stats.total_draft_tokens == counted.draft_tokens - before[0] > 0
    assert stats.total_accepted_draft_tokens == counted.accepted_tokens - before[1]
    calls = -(-24 // PLAIN_CHUNK_TOKENS)
    assert not client.calls and [k for k, _, _ in client.streams] == [0] * calls + [3] * calls


def test_engine_lookup_takes_k_per_request_within_the_engines_limit(tiny_spec_engines):
    """The tensorrt_llm input num_draft_tokens reaches the engine request; more than max_draft_len is refused by name."""
    engine = load_serving_engine(tiny_spec_engines.spec.out_dir / "engines" / "target", LOOKUP_PARAMETERS)
    for k in (0, 2, engine.config.max_draft_len + 1):
        request, _ = engine_request({"input_ids": np.array([[5, 6, 7]], dtype=np.int32),
                                     "request_output_len": np.array([[8]], dtype=np.int32),
                                     "num_draft_tokens": np.array([[k]], dtype=np.int32)}, f"r{k}", True,
                                    engine.model.vocab_size)
        assert request.num_draft_tokens == k
        if k > engine.config.max_draft_len:
            with pytest.raises(EngineInputError) as err:
                engine.add_request(request)
            assert err.value.field == "num_draft_tokens"
        else:
            engine.add_request(request)


@pytest.mark.parametrize("engine_lookup", [False, True])
def test_stop_words_and_max_tokens(engines, lookup_runner, engine_lookup):
    """BLS rounds (a draft model) or the engine's own lookup: a stop word ends the text where plain decoding's
    ends, and max_tokens cuts it."""
    runners, tokenizer = engines
    settings, decoder = (local_decoder({"tensorrt_llm": lookup_runner}, "ngram", engine_lookup=True) if engine_lookup
                         else local_decoder(runners, "draft_target"))
    text = "a b c d e f"
    plain, _ = run(decoder, tokenizer, settings, text, 20, 0)
    stop_text = tokenizer.decode(plain[5:7])
    stop_ids = tokenizer.encode(stop_text, add_special_tokens=False)
    got, _ = run(decoder, tokenizer, settings, text, 20, 3, stop_words=np.array([[stop_text.encode()]], dtype=object))
    # generation ends right after the first occurrence of the stop sequence (kept, as TensorRT-LLM does)
    seq_end = next(i + len(stop_ids) for i in range(len(plain)) if plain[i:i + len(stop_ids)] == stop_ids)
    assert got == plain[:seq_end]
    got, _ = run(decoder, tokenizer, settings, text, 7, 3)
    assert got == plain[:7]


def test_draft_failure_falls_back(engines):
    """A draft call that fails (sequence beyond the draft's limits) switches the request to plain decoding."""
    runners, tokenizer = engines
    settings = BlsSettings(tokenizer_dir="", draft_model="missing_draft", speculative_mode="draft_target",
                           max_draft_len=4, max_input_len=48, max_seq_len=64, verify_input_len=63)
    sink = Rounds()
    warnings = []
    decoder = SpeculativeDecoder(settings, LocalModelClient(runners), sink, log_warning=warnings.append)
    plain, _ = run(decoder, tokenizer, settings, "hello world", 12, 0)
    got, stats = run(decoder, tokenizer, settings, "hello world", 12, 3)
    assert got == plain and stats.fell_back and sink.fallbacks == 1 and "draft model failed" in warnings[0]


def run_chunks(decoder, tokenizer, settings, text, max_tokens, k, **flags):
    inputs = {"text_input": np.array([[text.encode()]], dtype=object), "max_tokens": np.array([[max_tokens]], dtype=np.int32),
              "num_draft_tokens": np.array([[k]], dtype=np.int32),
              **{name: np.array([[True]]) for name, on in flags.items() if on}}
    req = parse_text_request(inputs, settings, tokenizer)

    async def collect():
        return [c async for c in decoder.generate(req, lambda: False)]

    return req, asyncio.run(collect())


def local_decoder(runners, mode: str, engine_lookup: bool = False) -> tuple[BlsSettings, SpeculativeDecoder]:
    """The BLS's decoder over in-process engines: K up to 4, 48-token prompts, 64-token sequences."""
    settings = BlsSettings(tokenizer_dir="", draft_model="tensorrt_llm_draft", speculative_mode=mode, max_draft_len=4,
                           max_input_len=48, max_seq_len=64, verify_input_len=63, engine_lookup=engine_lookup)
    return settings, SpeculativeDecoder(settings, LocalModelClient(runners), Rounds())


@pytest.mark.parametrize("mode", ["draft_target", "ngram", "ngram in the engine"])
def test_log_probs_are_the_targets_with_and_without_speculation(engines, lookup_runner, mode):
    runners, tokenizer = engines
    if mode == "ngram in the engine":
        settings, decoder = local_decoder({"tensorrt_llm": lookup_runner}, "ngram", engine_lookup=True)
    else:
        settings, decoder = local_decoder(runners, mode)
    text = "the the the cat sat on the mat and the cat sat on the"
    results = {}
    for k in (0, 3):
        req, chunks = run_chunks(decoder, tokenizer, settings, text, 12, k, return_log_probs=True,
                                 return_generation_logits=True, return_context_logits=True)
        targets = [c.target for c in chunks if c.target is not None]
        tokens = [t for g in targets for t in g.tokens]
        log_probs = [v for g in targets for v in g.log_probs]
        logits = np.concatenate([g.logits for g in targets if len(g.tokens)])
        contexts = [g.context_logits for g in targets if g.context_logits is not None]
        assert len(tokens) == len(log_probs) == len(logits) == 12 and len(contexts) == 1
        assert contexts[0].shape == (len(req.prompt_ids), logits.shape[1])
        # each token's log-prob is log_softmax of the target's own logits for it (not the draft's)
        rows = logits - logits.max(-1, keepdims=True)
        rows = rows - np.log(np.exp(rows).sum(-1, keepdims=True))
        np.testing.assert_allclose(log_probs, rows[np.arange(12), tokens], atol=1e-5)
        results[k] = tokens, log_probs, contexts[0]
    assert results[3][0] == results[0][0]
    np.testing.assert_allclose(results[3][1], results[0][1], atol=1e-4)
    np.testing.assert_allclose(results[3][2], results[0][2], atol=1e-4)


class RecordingClient:
    """The in-process client, recording the requests in flight (`in_flight`) as each non-streaming call (a round's
    draft or verify) starts, and the K, the tokens asked for and the streaming flag of each streaming call; calls pass
    through to the real engines."""

    def __init__(self, inner: LocalModelClient):
        self.inner, self.calls, self.streams = inner, [], []  # streams: (K, tokens asked for, streaming) a call
        self.in_flight = lambda: 0

    async def generate(self, model, *args, **kwargs):
        self.calls.append((model, self.in_flight()))
        return await self.inner.generate(model, *args, **kwargs)

    def stream(self, model, prompt_ids, max_new, req, seed, returns=Returns(), engine_draft_len=None, streaming=True):
        self.streams.append((engine_draft_len, max_new, streaming))
        return self.inner.stream(model, prompt_ids, max_new, req, seed, returns, engine_draft_len, streaming)

    def round_starts(self, mode: str) -> list[int]:
        """Requests in flight when each round's first call went out (the draft's, or the target's for prompt lookup)."""
        first = "tensorrt_llm_draft" if mode == "draft_target" else "tensorrt_llm"
        return [k for model, k in self.calls if model == first]


@pytest.mark.parametrize("mode", ["draft_target", "ngram"])
def test_batch_gate_decodes_plainly_while_too_many_requests_run(engines, mode):
    """max_batch_for_speculation: every round starts while at most `gate` requests are in flight (3 requests under
    a gate of 1 decode plain chunks, and speculate again only once the others have finished), and the text is
    plain's; a lone request under the same gate, or the 3 under a gate of 3, speculate every round."""
    runners, tokenizer = engines
    text = "the the the cat sat on the mat and the cat sat on the"

    def concurrently(gate, n):
        settings = BlsSettings(tokenizer_dir="", draft_model="tensorrt_llm_draft", speculative_mode=mode,
                               max_draft_len=4, max_input_len=48, max_seq_len=64, verify_input_len=63,
                               max_batch_for_speculation=gate)
        sink, counts = Rounds(), []
        client = RecordingClient(LocalModelClient(runners))
        decoder = SpeculativeDecoder(settings, client, sink, on_in_flight=counts.append)
        client.in_flight = lambda: decoder.in_flight
        inputs = {"text_input": np.array([[text.encode()]], dtype=object),
                  "max_tokens": np.array([[24]], dtype=np.int32), "num_draft_tokens": np.array([[3]], dtype=np.int32)}
        req = parse_text_request(inputs, settings, tokenizer)

        async def one():
            with decoder.admit():
                chunks = [c async for c in decoder.generate(req, lambda: False)]
            return [t for c in chunks for t in c.token_ids], chunks[-1].stats.rounds

        async def all_of_them():
            return await asyncio.gather(*(one() for _ in range(n)))

        outs = asyncio.run(all_of_them())
        assert decoder.in_flight == 0 and counts[-1] == 0 and max(counts) == n  # the gauge saw every request
        first_calls = client.round_starts(mode)  # requests in flight as each round's first call went out
        assert len(first_calls) == sum(rounds for _, rounds in outs) and all(k <= gate for k in first_calls), first_calls
        return [tokens for tokens, _ in outs], len(first_calls)  # speculative rounds of all requests

    plain, _ = run(local_decoder(runners, mode)[1], tokenizer, local_decoder(runners, mode)[0], text, 24, 0)
    gated, gated_rounds = concurrently(1, 3)
    assert gated == [plain] * 3
    alone, rounds = concurrently(1, 1)
    assert alone == [plain] and rounds >= 6  # 24 tokens, at most 4 per round
    ungated, rounds = concurrently(3, 3)
    assert ungated == [plain] * 3 and rounds >= 18
    assert gated_rounds <= rounds / 2  # the gated requests spent most of their tokens in plain chunks


def test_measured_draft_token_cost_slow_starts_backs_off_a_draft_below_break_even_and_keeps_one_above(engines):
    """draft_token_cost (the break-even acceptance measured at assembly) raises the switch-off bar above
    min_acceptance_rate, and a request then starts from one-token drafts until one is accepted (the slow start).
    The same draft backs off when it earns less than it costs (BACK_OFF_TOKENS plain tokens, then one-token drafts
    again), and speculates through the request when it earns more; the text is plain's either way."""
    runners, tokenizer = engines
    text = "the the the cat sat on the mat and the cat sat on the"
    max_tokens = 40

    def decode(cost, k=3):
        settings = BlsSettings(tokenizer_dir="", draft_model="tensorrt_llm_draft", speculative_mode="draft_target",
                               max_draft_len=4, max_input_len=48, max_seq_len=64, verify_input_len=63,
                               min_acceptance_rate=0.05, draft_token_cost=cost)
        sink = Rounds()
        tokens, stats = run(SpeculativeDecoder(settings, LocalModelClient(runners), sink), tokenizer, settings, text,
                            max_tokens, k)
        assert stats.rounds == len(sink.rounds)
        return tokens, sink.rounds

    def from_rounds(rounds):  # tokens the rounds brought: all but the last token when nothing was decoded plainly
        return sum(a + 1 for _, a in rounds)

    plain, _ = decode(0.0, k=0)
    free, rounds = decode(0.0)
    acceptance = sum(a for _, a in rounds) / sum(p for p, _ in rounds)
    assert free == plain and 0.1 < acceptance < 0.9
    assert rounds[0][0] == 3 and from_rounds(rounds) == max_tokens - 1  # no cost: drafts of K from the start
    below, below_rounds = decode(0.95)  # costs more than the draft earns
    assert below == plain and below_rounds[0][0] == 1  # the slow start's probe
    assert from_rounds(below_rounds) <= max_tokens - BACK_OFF_TOKENS  # backed off: plain tokens in between
    assert len(below_rounds) < len(rounds)
    above, above_rounds = decode(0.06)  # earns more than it costs
    assert above == plain and above_rounds[0][0] == 1 and from_rounds(above_rounds) == max_tokens - 1
    assert max(p for p, _ in above_rounds) == 3  # the slow start ended


def test_a_draft_the_last_requests_ruled_out_keeps_the_next_request_plain(engines):
    """A draft that earns less than it costs: the decoder's first request probes it at once (its first call is the
    draft's) and backs off; the next request, with that evidence, starts with a back-off and, the evidence still ruling
    the draft out when it ends, backs off further: it never calls the draft. Both answer plain's text."""
    runners, tokenizer = engines
    text = "the the the cat sat on the mat and the cat sat on the"
    calls = []

    class CallLog(LocalModelClient):
        async def generate(self, model, *args, **kwargs):
            calls.append(model)
            return await super().generate(model, *args, **kwargs)

        def stream(self, model, *args, **kwargs):
            calls.append(model)
            return super().stream(model, *args, **kwargs)

    settings = BlsSettings(tokenizer_dir="", draft_model="tensorrt_llm_draft", speculative_mode="draft_target",
                           max_draft_len=4, max_input_len=48, max_seq_len=64, verify_input_len=63,
                           min_acceptance_rate=0.05, draft_token_cost=0.95)
    plain, _ = run(SpeculativeDecoder(settings, LocalModelClient(runners), Rounds()), tokenizer, settings, text, 40, 0)
    decoder, drafts = SpeculativeDecoder(settings, CallLog(runners), Rounds()), []
    for _ in range(2):
        calls.clear()
        tokens, _ = run(decoder, tokenizer, settings, text, 40, 3)
        assert tokens == plain
        drafts.append(calls.count("tensorrt_llm_draft"))
    assert drafts[0] > 0 and drafts[1] == 0


def test_draft_length_adapts_per_round_within_k(engines):
    """Each round drafts min(draft length, tokens left - 1); the draft length starts at the request's K, drops by one
    after a partly rejected draft and grows by two (never past K) after a fully accepted one."""
    from pipeline.sequences import next_draft_len

    runners, tokenizer = engines
    settings = BlsSettings(tokenizer_dir="", draft_model="tensorrt_llm_draft", speculative_mode="draft_target",
                           max_draft_len=4, max_input_len=48, max_seq_len=64, verify_input_len=63)
    sink, k, max_tokens = Rounds(), 4, 40
    tokens, stats = run(SpeculativeDecoder(settings, LocalModelClient(runners), sink), tokenizer, settings,
                        "the the the cat sat on the mat and the cat sat on the", max_tokens, k)
    assert len(tokens) == max_tokens and stats.rounds == len(sink.rounds)
    draft_len, done = k, 0
    for proposed, accepted in sink.rounds:
        assert proposed == min(draft_len, max_tokens - done - 1)
        draft_len = next_draft_len(draft_len, accepted, proposed, k)
        done += accepted + 1
    assert any(p < min(k, max_tokens - 1) for p, _ in sink.rounds[1:-2])  # it did shrink mid-request


def test_next_draft_len_follows_the_heuristic_schedule():
    from pipeline.sequences import next_draft_len

    assert next_draft_len(4, 4, 4, 8) == 6 and next_draft_len(7, 7, 7, 8) == 8  # full accept: +2, capped
    assert next_draft_len(4, 2, 4, 8) == 3 and next_draft_len(1, 0, 1, 8) == 1  # a rejection: -1, never below 1


def test_a_request_cancelled_after_its_first_round_raises_stopped_and_leaves_nothing_running(engines):
    """A request whose stop() turns true after its first chunk raises Stopped (never a final chunk that looks
    complete); nothing is left running in the engine, and the next request decodes as before."""
    runners, tokenizer = engines
    settings, decoder = local_decoder(runners, "ngram")
    text = "the the the cat sat on the mat and the cat sat on the"
    plain, _ = run(decoder, tokenizer, settings, text, 24, 0)
    req = parse_text_request({"text_input": np.array([[text.encode()]], dtype=object),
                              "max_tokens": np.array([[24]], dtype=np.int32),
                              "num_draft_tokens": np.array([[3]], dtype=np.int32)}, settings, tokenizer)
    chunks = []

    async def collect():
        async for chunk in decoder.generate(req, lambda: len(chunks) >= 1):
            chunks.append(chunk)

    with pytest.raises(Stopped):
        asyncio.run(collect())
    assert len(chunks) == 1 and chunks[0].token_ids == plain[:len(chunks[0].token_ids)]
    assert not runners["tensorrt_llm"].engine.has_unfinished()
    again, _ = run(decoder, tokenizer, settings, text, 24, 3)
    assert again == plain


@pytest.mark.parametrize("engine_lookup", [False, True])
def test_a_stream_interval_sends_the_first_token_alone_then_one_answer_per_call_of_n(engines, lookup_runner,
                                                                                      engine_lookup):
    """serving.stream_interval N: the request's first token comes from a call of its own, every later target call asks
    for at most N tokens without streaming (one answer each), so every chunk after the first carries N tokens but the
    last; the tokens and the engine's speculation counters are N=1's (plain, and prompt lookup in the engine)."""
    runners, tokenizer = engines
    text, max_tokens, k = "the the the cat sat on the mat and the cat sat on the", 30, 3 if engine_lookup else 0
    results = {}
    for interval in (1, 4):
        settings = BlsSettings(tokenizer_dir="", speculative_mode="ngram", max_draft_len=4, max_input_len=48,
                               max_seq_len=64, verify_input_len=63, engine_lookup=engine_lookup,
                               stream_interval=interval)
        client = RecordingClient(LocalModelClient({"tensorrt_llm": lookup_runner} if engine_lookup else runners))
        _, chunks = run_chunks(SpeculativeDecoder(settings, client, Rounds()), tokenizer, settings, text, max_tokens, k)
        sizes = [len(c.token_ids) for c in chunks if c.token_ids]
        calls = [(n, streaming) for _, n, streaming in client.streams]
        results[interval] = [t for c in chunks for t in c.token_ids], chunks[-1].stats, sizes, calls
    tokens, stats, sizes, calls = results[4]
    assert tokens == results[1][0] and len(tokens) == max_tokens
    assert calls[0] == (1, False) and all(n <= 4 and not streaming for n, streaming in calls[1:])
    assert sizes == [1] + [4] * ((max_tokens - 1) // 4) + ([(max_tokens - 1) % 4] if (max_tokens - 1) % 4 else [])
    assert all(streaming for _, streaming in results[1][3]) and len(results[1][2]) > len(sizes)
    if engine_lookup:  # the engine drafted in both, and its counters reached the request's stats
        assert stats.total_draft_tokens > 0 and results[1][1].total_draft_tokens > 0
