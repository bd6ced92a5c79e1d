"""LLMEngine: greedy parity with transformers, in-flight join/leave, prefix reuse, cancellation,
sampling parameters, external draft verification, proposer hook with trees, bad inputs."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.reference.engine import EngineConfig, EngineInputError, LLMEngine, Request, SamplingParams
from pipeline.reference.model import LlamaModel
from pipeline.reference.proposers import Draft, NgramProposer

VOCAB = 512


@pytest.fixture(scope="module")
def model(tiny_llama):
    return LlamaModel.from_hf(tiny_llama)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_engine(model, proposer=None, **overrides) -> LLMEngine:
    return LLMEngine(model, EngineConfig(**{"tokens_per_block": 16, "batch_invariant": True, **overrides}), proposer)


def run(engine: LLMEngine, joins: dict[int, list[Request]]) -> dict[str, dict]:
    """Step until done, adding joins[step] before each step; returns tokens / finish reason / outputs per request."""
    results: dict[str, dict] = {}
    step = 0
    while step <= max(joins, default=0) or engine.has_unfinished():
        for request in joins.get(step, []):
            engine.add_request(request)
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "outputs": []})
            r["tokens"] += out.new_token_ids
            r["outputs"].append(out)
            if out.finished:
                r["reason"] = out.finish_reason
        step += 1
    return results


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


# ------------------------------------------------------------------ greedy parity and in-flight batching

def test_greedy_batch_1_equals_transformers_generate(model, hf):
    prompt = prompts(1, seed=1)[0]
    res = run(make_engine(model), {0: [Request("a", prompt, max_new_tokens=24)]})
    assert res["a"]["tokens"] == hf_greedy(hf, prompt, 24)
    assert res["a"]["reason"] == "length"
    assert [len(o.new_token_ids) for o in res["a"]["outputs"]] == [1] * 24  # one token per step, streamed


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_eight_requests_joining_at_different_steps_equal_transformers(model, hf, batch_invariant):
    """Also without batch invariance (batched one-token attention, padded and masked): no near-tie flips here."""
    ps = prompts(8, seed=2)
    lengths = [5, 20, 9, 14, 3, 17, 11, 8]
    engine = make_engine(model, max_batch_size=4, batch_invariant=batch_invariant)
    joins = {2 * i: [Request(str(i), p, max_new_tokens=n)] for i, (p, n) in enumerate(zip(ps, lengths))}
    res = run(engine, joins)
    for i, (p, n) in enumerate(zip(ps, lengths)):
        assert res[str(i)]["tokens"] == hf_greedy(hf, p, n), f"request {i}"
    assert engine.blocks.num_free == engine.blocks.num_blocks  # everyone left and gave their blocks back


def test_max_batch_size_and_chunked_prefill(model):
    ps = prompts(5, seed=3, lo=30, hi=60)
    ref = run(make_engine(model), {0: [Request(str(i), p, max_new_tokens=6) for i, p in enumerate(ps)]})
    engine = make_engine(model, max_batch_size=2, max_num_tokens=16)
    seen_batches = []
    original = engine._schedule

    def spy():
        batch = original()
        seen_batches.append(batch)
        return batch

    engine._schedule = spy
    res = run(engine, {0: [Request(str(i), p, max_new_tokens=6) for i, p in enumerate(ps)]})
    assert {k: v["tokens"] for k, v in res.items()} == {k: v["tokens"] for k, v in ref.items()}
    assert max(len(b) for b in seen_batches) == 2
    assert max(sum(len(s.new_tokens) for s in b) for b in seen_batches) <= 16 + 1  # decode rows may top up by one


# ------------------------------------------------------------------ KV reuse, cancellation, preemption

def test_resent_prefix_computes_only_new_tokens(model):
    engine = make_engine(model)
    prompt = prompts(1, seed=4, lo=40, hi=41)[0]
    first = run(engine, {0: [Request("a", prompt, max_new_tokens=4)]})
    sequence = prompt + first["a"]["tokens"]  # 44 tokens; the first 43 have KV: blocks 0-15 and 16-31 full, 32-42 partial
    before = engine.stats.computed_tokens
    second = run(engine, {0: [Request("b", sequence + [7, 8], max_new_tokens=3)]})
    # prefill computes only 46 - 43 = 3 tokens (partial reuse of the mid-block tail), then 2 decode steps of 1 token
    assert engine.stats.computed_tokens - before == 3 + 2
    assert engine.stats.cached_prompt_tokens == 43
    fresh = run(make_engine(model), {0: [Request("b", sequence + [7, 8], max_new_tokens=3)]})
    assert second["b"]["tokens"] == fresh["b"]["tokens"]


def test_bls_like_verify_rounds_compute_only_the_new_tokens(model, hf):
    """Each round re-sends prompt + accepted tokens + the target's token with the next draft (as the BLS does);
    with 32-token blocks, partial reuse makes a round compute exactly its K + 1 new tokens, and the result
    is plain greedy."""
    k, n = 4, 30
    prompt = prompts(1, seed=20, lo=25, hi=26)[0]  # the rounds cross the block boundary at 32 and 64
    plain = hf_greedy(hf, prompt, n + k + 1)
    engine = make_engine(model, tokens_per_block=32, max_draft_len=k)
    sequence, per_round = list(prompt), []
    for i in range(100):
        done = len(sequence) - len(prompt)
        if done >= n:
            break
        draft = plain[done:done + k]
        if i % (k + 1) < k:  # a wrong token at a different position each round; every 5th draft is all right
            draft[i % (k + 1)] = (draft[i % (k + 1)] + 1) % VOCAB
        before = engine.stats.computed_tokens
        res = run(engine, {0: [Request(f"r{i}", sequence, max_new_tokens=k + 1, draft_tokens=draft)]})
        per_round.append(engine.stats.computed_tokens - before)
        sequence += res[f"r{i}"]["tokens"]
    assert sequence[len(prompt):] == plain[:len(sequence) - len(prompt)]
    assert per_round[0] == len(prompt) + k and set(per_round[1:]) == {k + 1}
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_copy_on_partial_reuse_keeps_the_source_block_intact(model):
    engine = make_engine(model)  # 16-token blocks
    a = prompts(1, seed=21, lo=40, hi=41)[0]
    run(engine, {0: [Request("a", a, max_new_tokens=1)]})  # KV of all 40 prompt tokens; tail 32-39 stays cached
    source = engine.blocks.block_tokens.index(tuple(a[32:40]))
    slots = torch.arange(source * 16, source * 16 + 8)
    k_before, v_before = engine.kv.k[:, slots].clone(), engine.kv.v[:, slots].clone()
    before = engine.stats.computed_tokens
    run(engine, {0: [Request("b", a[:36] + [1, 2, 3, 4, 5, 6], max_new_tokens=3)]})  # copies slots 32-35, writes 36+
    assert engine.stats.computed_tokens - before == 6 + 2
    assert torch.equal(engine.kv.k[:, slots], k_before) and torch.equal(engine.kv.v[:, slots], v_before)
    before = engine.stats.computed_tokens
    third = run(engine, {0: [Request("c", a + [7, 8], max_new_tokens=5)]})
    assert engine.stats.computed_tokens - before == 2 + 4  # all 40 tokens of a reused, 8 of them from the source
    assert third["c"]["tokens"] == run(make_engine(model), {0: [Request("c", a + [7, 8], max_new_tokens=5)]})["c"]["tokens"]


def test_eviction_of_a_partially_reused_block_is_safe(model):
    """B copies A's cached tail, then D's prefill evicts that tail while B still decodes: B is unaffected."""
    a = prompts(1, seed=22, lo=20, hi=21)[0]
    d = prompts(1, seed=23, lo=30, hi=31)[0]
    engine = make_engine(model, num_blocks=4)
    a_tokens = run(engine, {0: [Request("a", a, max_new_tokens=2)]})["a"]["tokens"]  # 21 tokens of KV: full block + 5
    tail = tuple((a + a_tokens)[16:21])
    b = (a + a_tokens)[:21] + [9, 8, 7]
    engine.add_request(Request("b", b, max_new_tokens=8))
    b_tokens = [t for out in engine.step() for t in out.new_token_ids]
    assert tail in engine.blocks.block_tokens and engine.stats.cached_prompt_tokens == 21  # one full block + 5 copied slots
    engine.add_request(Request("d", d, max_new_tokens=1))
    b_tokens += [t for out in engine.step() if out.request_id == "b" for t in out.new_token_ids]
    assert tail not in engine.blocks.block_tokens  # evicted for D's prefill, gone from the index
    assert [s.request.request_id for s in engine.running] == ["b"]
    b_tokens += run(engine, {})["b"]["tokens"]
    assert b_tokens == run(make_engine(model), {0: [Request("b", b, max_new_tokens=8)]})["b"]["tokens"]
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_cancel_frees_blocks_and_others_continue(model):
    engine = make_engine(model)
    ps = prompts(2, seed=5)
    engine.add_request(Request("keep", ps[0], max_new_tokens=10))
    engine.add_request(Request("drop", ps[1], max_new_tokens=10))
    engine.step()
    engine.step()
    used = engine.blocks.num_blocks - engine.blocks.num_free
    assert engine.cancel("drop") and not engine.cancel("unknown")
    assert engine.blocks.num_blocks - engine.blocks.num_free < used
    rest = run(engine, {})
    assert rest["drop"]["reason"] == "cancelled" and rest["drop"]["tokens"] == []
    alone = run(make_engine(model), {0: [Request("keep", ps[0], max_new_tokens=10)]})
    assert alone["keep"]["tokens"][2:] == rest["keep"]["tokens"]
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_preemption_when_blocks_run_out_keeps_outputs(model):
    ps = prompts(4, seed=6, lo=20, hi=30)
    joins = {0: [Request(str(i), p, max_new_tokens=20) for i, p in enumerate(ps)]}
    ref = run(make_engine(model), joins)
    tight = make_engine(model, num_blocks=8)  # 4 requests of up to 50 tokens need 16 blocks
    res = run(tight, {0: [Request(str(i), p, max_new_tokens=20) for i, p in enumerate(ps)]})
    assert tight.stats.preemptions > 0
    assert {k: v["tokens"] for k, v in res.items()} == {k: v["tokens"] for k, v in ref.items()}


# ------------------------------------------------------------------ sampling parameters

def generate(model, prompt, n=12, **sampling):
    res = run(make_engine(model), {0: [Request("r", prompt, max_new_tokens=n, sampling=SamplingParams(**sampling))]})
    return res["r"]["tokens"], res["r"]["reason"]


def test_seeded_sampling_is_reproducible_and_batch_independent(model):
    prompt = prompts(1, seed=7)[0]
    a, _ = generate(model, prompt, temperature=1.0, seed=123)
    b, _ = generate(model, prompt, temperature=1.0, seed=123)
    c, _ = generate(model, prompt, temperature=1.0, seed=321)
    assert a == b and a != c
    crowd = [Request(f"x{i}", p, 12, SamplingParams(temperature=1.0, seed=i)) for i, p in enumerate(prompts(3, seed=8))]
    res = run(make_engine(model), {0: crowd, 1: [Request("r", prompt, 12, SamplingParams(temperature=1.0, seed=123))]})
    assert res["r"]["tokens"] == a


def test_top_k_1_equals_greedy(model):
    prompt = prompts(1, seed=9)[0]
    assert generate(model, prompt, temperature=1.5, top_k=1, seed=5)[0] == generate(model, prompt)[0]


def test_top_p_tiny_equals_greedy(model):
    prompt = prompts(1, seed=9)[0]
    assert generate(model, prompt, temperature=1.0, top_p=1e-6, seed=5)[0] == generate(model, prompt)[0]


def test_penalties_change_greedy_output(model):
    prompt = prompts(1, seed=10)[0]
    plain, _ = generate(model, prompt, n=30)
    assert len(set(plain)) < 30  # the random model repeats itself ...
    for penalty in ({"repetition_penalty": 5.0}, {"presence_penalty": 100.0}, {"frequency_penalty": 100.0}):
        penalised, _ = generate(model, prompt, n=30, **penalty)
        assert penalised != plain, penalty
    no_repeats, _ = generate(model, prompt, n=30, presence_penalty=1e4)  # ... and stops once any repeat costs 1e4
    assert len(set(no_repeats)) == 30


def test_stop_words_end_id_min_length_bad_words(model):
    prompt = prompts(1, seed=11)[0]
    plain, _ = generate(model, prompt, n=20)
    stop = plain[5:7]
    tokens, reason = generate(model, prompt, n=20, stop_words=[[1, 2, 3], stop])
    first = next(i for i in range(1, 20) if plain[i - 1:i + 1] == stop)
    assert reason == "stop" and tokens == plain[:first + 1]
    tokens, reason = generate(model, prompt, n=20, end_id=plain[4])
    assert reason == "end_id" and tokens == plain[:plain.index(plain[4])]
    tokens, _ = generate(model, prompt, n=20, end_id=plain[0], min_length=3)
    assert tokens[:3] != plain[:3] and plain[0] not in tokens[:3]
    tokens, _ = generate(model, prompt, n=20, bad_words=[[plain[0]], plain[2:4]])
    assert tokens[0] != plain[0]
    assert all(tokens[i:i + 2] != plain[2:4] for i in range(19))


# ------------------------------------------------------------------ speculative verification through the engine

def test_external_draft_tokens_greedy(model):
    prompt = prompts(1, seed=12)[0]
    plain, _ = generate(model, prompt, n=6)
    engine = make_engine(model, max_draft_len=5)
    good = Request("good", prompt, max_new_tokens=6, draft_tokens=plain[:5], return_generation_logits=True)
    bad = Request("bad", prompt, max_new_tokens=6, draft_tokens=plain[:2] + [(plain[2] + 1) % VOCAB, plain[3]])
    res = run(engine, {0: [good, bad]})
    assert res["good"]["tokens"] == plain[:6] and res["good"]["reason"] == "length"
    assert res["bad"]["tokens"] == plain[:3]  # two accepted, then the target's own token
    assert res["good"]["outputs"][-1].stats.accepted_tokens == 5
    logits = res["good"]["outputs"][-1].generation_logits
    assert logits.shape == (6, VOCAB) and logits.argmax(-1).tolist() == plain[:6]
    assert engine.stats.computed_tokens == 2 * len(prompt) + 5 + 4  # one forward verified both drafts


def test_prompt_lookup_drafts_in_the_step_that_completes_the_prompt(model):
    """A proposer that drafts from the tokens alone (prompt lookup) drafts for the prefill's last step, which
    verifies the draft in the same forward: a sequence continued by a new request (the BLS's next call) speculates
    from its first step. The tokens are plain decoding's."""
    base = prompts(1, seed=21)[0][:12]
    prompt = base + base + base[:4]  # its last tokens occur earlier: the lookup proposes what followed them
    plain = run(make_engine(model), {0: [Request("plain", prompt, max_new_tokens=10)]})["plain"]
    engine = make_engine(model, NgramProposer(1, 3), max_draft_len=5)
    engine.add_request(Request("lookup", prompt, max_new_tokens=10, num_draft_tokens=5))
    (first,) = engine.step()
    assert first.stats.target_forwards == 1 and first.stats.draft_tokens == 5  # drafted before any token existed
    tokens = first.new_token_ids
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == plain["tokens"]


def test_external_draft_with_probs_uses_lossless_sampling(model):
    prompt = prompts(1, seed=13)[0]
    q = torch.full((3, VOCAB), 1.0 / VOCAB)
    req = Request("s", prompt, max_new_tokens=4, sampling=SamplingParams(temperature=1.0, seed=1),
                  draft_tokens=[1, 2, 3], draft_probs=q)
    a = run(make_engine(model, max_draft_len=3), {0: [req]})["s"]
    b = run(make_engine(model, max_draft_len=3), {0: [req]})["s"]
    assert a["tokens"] == b["tokens"] and 1 <= len(a["tokens"]) <= 4


class PathTreeProposer:
    """Test proposer: a wrong first branch, then the n-gram continuation as a chain under a second root child."""

    needs_hidden_states = True

    def __init__(self):
        self.hidden_rows = []

    def propose(self, inputs):
        drafts = []
        for inp in inputs:
            self.hidden_rows.append(inp.hidden_states.shape[0])
            guess = NgramProposer().lookup(inp.token_ids, 3).token_ids
            if not guess or inp.num_tokens < len(guess) + 1:
                drafts.append(Draft([]))
                continue
            drafts.append(Draft([(guess[0] + 1) % VOCAB] + guess, parents=[-1, -1] + list(range(1, len(guess)))))
        return drafts

    def update(self, request_id, num_accepted, num_proposed):
        pass

    def release(self, request_id):
        pass


def test_proposer_tree_drafts_equal_plain_greedy(model):
    """Tree verification (with KV compaction of the accepted path) gives plain greedy tokens, in fewer forwards."""
    ps = [p * 3 for p in prompts(6, seed=14, lo=4, hi=12)]  # repetitive prompts: prompt lookup hits
    joins = {i: [Request(str(i), p, max_new_tokens=25)] for i, p in enumerate(ps)}
    plain = run(make_engine(model), joins)
    proposer = PathTreeProposer()
    engine = make_engine(model, proposer, max_draft_len=5)
    spec = run(engine, {i: [Request(str(i), p, max_new_tokens=25)] for i, p in enumerate(ps)})
    assert {k: v["tokens"] for k, v in spec.items()} == {k: v["tokens"] for k, v in plain.items()}
    assert engine.stats.spec.accepted_tokens > 0 and engine.stats.spec.tokens_per_forward > 1.0
    assert max(proposer.hidden_rows) >= min(len(p) for p in ps)  # after prefill: the prompt rows


class FlakyProposer(NgramProposer):
    """Prompt lookup that raises on every third propose call (a drafting bug; the policy's ZeroDivisionError of
    2026-12-06 failed every request of a served step)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def propose(self, inputs):
        self.calls += 1
        if self.calls % 3 == 0:
            raise ZeroDivisionError("float division by zero")
        return super().propose(inputs)


def test_a_raising_proposer_costs_its_steps_drafts_not_the_requests(model, caplog):
    """Where drafting raises, the step's requests run without drafts: every request finishes with plain greedy's
    tokens, the failures are counted, and the error is logged once (the first of its type)."""
    ps = [p * 3 for p in prompts(4, seed=15, lo=4, hi=12)]  # repetitive prompts: prompt lookup hits
    joins = {i: [Request(str(i), p, max_new_tokens=25)] for i, p in enumerate(ps)}
    plain = run(make_engine(model), joins)
    engine = make_engine(model, FlakyProposer(), max_draft_len=4)
    with caplog.at_level("WARNING", logger="pipeline.reference.engine"):
        spec = run(engine, {i: [Request(str(i), p, max_new_tokens=25)] for i, p in enumerate(ps)})
    assert {k: (v["tokens"], v["reason"]) for k, v in spec.items()} == {k: (v["tokens"], v["reason"])
                                                                        for k, v in plain.items()}
    assert engine.stats.proposer_errors >= 2 and engine.stats.spec.accepted_tokens > 0
    assert [r.getMessage() for r in caplog.records].count(
        "the proposer raised ZeroDivisionError: float division by zero; this step's requests run without drafts") == 1


# ------------------------------------------------------------------ bad inputs

@pytest.mark.parametrize("field, request_kwargs", [
    ("prompt_ids", {"prompt_ids": []}),
    ("prompt_ids", {"prompt_ids": [1] * 65}),
    ("prompt_ids", {"prompt_ids": [1, VOCAB]}),
    ("prompt_ids", {"prompt_ids": [-1, 2]}),
    ("max_new_tokens", {"max_new_tokens": 0}),
    ("max_new_tokens", {"max_new_tokens": 200}),
    ("num_draft_tokens", {"num_draft_tokens": 4}),
    ("draft_tokens", {"draft_tokens": [1, 2, 3, 4]}),
    ("draft_tokens", {"draft_tokens": [VOCAB]}),
    ("draft_probs", {"draft_tokens": [1, 2], "draft_probs": torch.ones(3, VOCAB) / VOCAB}),
    ("sampling.top_p", {"sampling": SamplingParams(top_p=0.0)}),
    ("sampling.temperature", {"sampling": SamplingParams(temperature=-1.0)}),
    ("sampling.stop_words", {"sampling": SamplingParams(stop_words=[[]])}),
])
def test_bad_input_is_refused_and_others_keep_running(model, field, request_kwargs):
    engine = make_engine(model, max_input_len=64, max_seq_len=128, max_draft_len=3)
    good = prompts(1, seed=15)[0]
    engine.add_request(Request("good", good, max_new_tokens=8))
    engine.step()
    with pytest.raises(EngineInputError) as err:
        engine.add_request(Request("bad", **{"prompt_ids": [1, 2, 3], "max_new_tokens": 4, **request_kwargs}))
    assert err.value.field == field and str(err.value).startswith(field + ": ")
    rest = run(engine, {})
    alone = run(make_engine(model), {0: [Request("good", good, max_new_tokens=8)]})
    assert list(rest) == ["good"] and alone["good"]["tokens"][1:] == rest["good"]["tokens"]


def test_duplicate_request_id_is_refused(model):
    engine = make_engine(model)
    engine.add_request(Request("same", [1, 2, 3]))
    with pytest.raises(EngineInputError, match="request_id"):
        engine.add_request(Request("same", [4, 5]))


def test_from_engine_dir_takes_the_build_limits(tiny_llama, tmp_path):
    import json

    from safetensors.torch import load_file

    from pipeline.reference.checkpoint import save_engine
    from pipeline.reference.model import config_from_hf

    pretrained = config_from_hf(json.loads((tiny_llama / "config.json").read_text()))
    pretrained["quantization"]["kv_cache_quant_algo"] = "INT8"
    build = {"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 64, "max_num_tokens": 64, "max_draft_len": 2,
             "plugin_config": {"tokens_per_block": 8}}
    save_engine(tmp_path, {"pretrained_config": pretrained, "build_config": build}, load_file(tiny_llama / "model.safetensors"))
    engine = LLMEngine.from_engine_dir(tmp_path)
    cfg = engine.config
    assert (cfg.max_batch_size, cfg.max_input_len, cfg.max_seq_len, cfg.max_draft_len, cfg.tokens_per_block) == (2, 16, 64, 2, 8)
    assert engine.kv.quantized
    with pytest.raises(EngineInputError, match="max_input_len 16"):
        engine.add_request(Request("long", [1] * 17))
    res = run(engine, {0: [Request("a", [1, 2, 3], max_new_tokens=5, draft_tokens=[4, 5])]})
    assert 1 <= len(res["a"]["tokens"]) <= 3


def test_request_larger_than_the_kv_cache_is_refused(model):
    engine = make_engine(model, num_blocks=2)  # 32 tokens of KV
    with pytest.raises(EngineInputError, match="KV cache holds 32 tokens"):
        engine.add_request(Request("big", [1] * 10, max_new_tokens=30))
    engine.add_request(Request("fits", [1] * 10, max_new_tokens=21))
    assert len(run(engine, {})["fits"]["tokens"]) == 21


def test_max_seq_len_beyond_the_model_positions_is_refused(model):
    with pytest.raises(ValueError, match="max_seq_len 4096 exceeds the model's max_position_embeddings 2048"):
        make_engine(model, max_seq_len=4096)


class GreedyProposer:
    """Proposes more tokens than asked (a sloppy proposer): the engine keeps only the first K."""

    needs_hidden_states = False

    def __init__(self, continuation: list[int], prompt_len: int):
        self.continuation, self.prompt_len = continuation, prompt_len

    def propose(self, inputs):
        return [Draft(self.continuation[len(i.token_ids) - self.prompt_len:] + [0] * 20) for i in inputs]

    def update(self, request_id, num_accepted, num_proposed):
        pass

    def release(self, request_id):
        pass


def test_overlong_drafts_are_cut_to_k(model):
    prompt = prompts(1, seed=16)[0]
    plain, _ = generate(model, prompt, n=20)
    engine = make_engine(model, GreedyProposer(plain, len(prompt)), max_draft_len=3)
    res = run(engine, {0: [Request("r", prompt, max_new_tokens=20)]})
    assert res["r"]["tokens"] == plain
    stats = res["r"]["outputs"][-1].stats
    assert stats.draft_tokens <= 3 * stats.spec_steps and len(stats.proposed_by_position) == 3


# ------------------------------------------------------------------ log-probabilities and context logits

def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax rows for a whole sequence: row i is the distribution of ids[i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("chunked", [False, True])
def test_log_probs_and_context_logits_equal_transformers(model, hf, chunked):
    prompt = prompts(1, seed=21, lo=40, hi=41)[0]
    engine = make_engine(model, **({"max_num_tokens": 16} if chunked else {}))
    run(engine, {0: [Request("warm", prompt, max_new_tokens=2)]})  # the prompt is cached now: must not be skipped
    res = run(engine, {0: [Request("a", prompt, max_new_tokens=5, return_log_probs=True, return_context_logits=True)]})
    tokens, outputs = res["a"]["tokens"], res["a"]["outputs"]
    ref = hf_logprobs(hf, prompt + tokens)
    context = [o.context_logits for o in outputs if o.context_logits is not None]
    assert len(context) == 1 and context[0].shape == (len(prompt), VOCAB)
    torch.testing.assert_close(torch.log_softmax(context[0], -1), ref[:len(prompt)], atol=1e-4, rtol=0)
    log_probs = [v for o in outputs for v in o.log_probs]
    want = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]
    assert len(log_probs) == 5 and log_probs == pytest.approx(want, abs=1e-4)


def test_log_probs_of_a_verified_draft_are_the_targets(model, hf):
    prompt = prompts(1, seed=22)[0]
    plain, _ = generate(model, prompt, n=6)
    draft = plain[:2] + [(plain[2] + 1) % VOCAB]  # two accepted, then the target's own token
    res = run(make_engine(model, max_draft_len=5),
              {0: [Request("d", prompt, max_new_tokens=6, draft_tokens=draft, return_log_probs=True)]})
    (out,) = res["d"]["outputs"]
    ref = hf_logprobs(hf, prompt + plain[:3])
    assert out.new_token_ids == plain[:3]
    assert out.log_probs == pytest.approx([ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(plain[:3])], abs=1e-4)
