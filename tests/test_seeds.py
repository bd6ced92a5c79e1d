"""Random streams per request, role and position; speculation and call splitting change no token.

The BLS sends the target prompt + generated tokens as input_ids every round (and every 64-token
plain chunk). These tests replay that split on the engine directly: the tokens must equal one plain
call's, for greedy and seeded sampling, with penalties, min_length, bad words and stop words.
"""

from dataclasses import replace

import numpy as np
import pytest

from pipeline.reference.engine import Request, SamplingParams
from pipeline.reference.model import LlamaModel
from pipeline.seeds import ROLE_DRAFT, ROLE_TARGET, derive_seed, role_seed
from pipeline.serving.bls import SpeculativeDecoder
from pipeline.serving.local_client import LocalModelClient
from pipeline.serving.params import BlsSettings
from tests.test_bls_local import Rounds, engines, local_decoder  # noqa: F401 (engines: fixture)
from tests.test_bls_local import run as run_bls
from tests.test_engine import VOCAB, make_engine, prompts, run


@pytest.fixture(scope="module")
def model(tiny_llama):
    return LlamaModel.from_hf(tiny_llama)


def test_streams_of_nearby_seeds_never_overlap():
    """seed + offset schemes made request s round g share a stream with request s + g: here no two
    (seed, role, position) streams coincide, and roles never share a seed."""
    seeds = {derive_seed(role_seed(s, role), "pos", i) for s in range(40) for role in (ROLE_TARGET, ROLE_DRAFT)
             for i in range(40)}
    assert len(seeds) == 40 * 2 * 40
    assert role_seed(5, ROLE_TARGET) == 5 and role_seed(5, ROLE_DRAFT) != 5 and role_seed(None, ROLE_DRAFT) is None
    assert all(0 <= s < 2 ** 63 for s in seeds)


def one_call(model, prompt, n, sampling):
    res = run(make_engine(model), {0: [Request("one", prompt, max_new_tokens=n, sampling=sampling)]})
    return res["one"]["tokens"]


def split_calls(model, prompt, n, sampling, draft_of, k=3):
    """The BLS's way: one engine call per round, input_ids = prompt + generated, an external draft
    (no q) verified by the target, min_length reduced by what was generated; stops and end_id end it."""
    engine = make_engine(model, max_draft_len=k)
    generated: list[int] = []
    for rnd in range(n):
        if len(generated) >= n:
            break
        draft = draft_of(generated, min(k, n - len(generated) - 1))
        params = replace(sampling, min_length=max(0, sampling.min_length - len(generated)))
        req = Request(f"r{rnd}", prompt + generated, max_new_tokens=len(draft) + 1, sampling=params,
                      draft_tokens=draft or None)
        out = run(engine, {0: [req]})[req.request_id]
        generated += out["tokens"]
        if out["reason"] in ("stop", "end_id"):
            break
    return generated


CASES = {
    "greedy": {},
    "greedy penalties": {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 2.0},
    "sampled": {"temperature": 1.3, "seed": 11},
    "sampled top-k top-p penalties": {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": 5,
                                      "frequency_penalty": 1.0, "presence_penalty": 0.3},
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_rounds_give_the_tokens_of_one_call(model, case):
    prompt = prompts(1, seed=21)[0]
    sampling = SamplingParams(**CASES[case])
    reference = one_call(model, prompt, 30, sampling)

    def half_right(generated, k):  # the reference's next tokens, every third one wrong: accepts and rejections
        ahead = reference[len(generated):len(generated) + k]
        return [(t + 1) % VOCAB if i % 3 == 2 else t for i, t in enumerate(ahead)]

    assert split_calls(model, prompt, 30, sampling, half_right) == reference
    assert split_calls(model, prompt, 30, sampling, lambda generated, k: []) == reference  # plain chunks of one


def test_min_length_bad_words_and_stop_words_span_calls(model):
    prompt = prompts(1, seed=22)[0]
    plain = one_call(model, prompt, 24, SamplingParams())
    sampling = SamplingParams(end_id=plain[2], min_length=8, bad_words=[plain[4:6]], stop_words=[plain[14:16]])
    reference = one_call(model, prompt, 24, sampling)
    assert reference != plain  # each rule changed something
    assert split_calls(model, prompt, 24, sampling, lambda generated, k: []) == reference


def test_seeded_sampling_equals_across_batching_and_differs_across_seeds(model):
    prompt = prompts(1, seed=23)[0]
    sampling = SamplingParams(temperature=1.5, seed=7)
    alone = one_call(model, prompt, 16, sampling)
    crowd = [Request(f"x{i}", p, 16, SamplingParams(temperature=1.5, seed=i)) for i, p in enumerate(prompts(4, seed=24))]
    batched = run(make_engine(model), {0: crowd[:2], 2: [Request("r", prompt, 16, sampling)], 3: crowd[2:]})
    assert batched["r"]["tokens"] == alone
    assert one_call(model, prompt, 16, replace(sampling, seed=8)) != alone


def test_bls_gives_each_role_one_seed_for_every_round(engines):
    """The draft call and the verify call of a round never share a seed, and no call's seed depends on the
    round (the engines key each token by its position instead)."""
    runners, tokenizer = engines
    calls: list[tuple[str, int | None]] = []

    class Recording(LocalModelClient):
        async def generate(self, model, prompt_ids, max_new, req, seed, *args, **kwargs):
            calls.append((model, seed))
            return await super().generate(model, prompt_ids, max_new, req, seed, *args, **kwargs)

    settings = BlsSettings(tokenizer_dir="", draft_model="tensorrt_llm_draft", speculative_mode="draft_target",
                           max_draft_len=4, max_input_len=48, max_seq_len=64, verify_input_len=63)
    decoder = SpeculativeDecoder(settings, Recording(runners), Rounds())
    seed = np.array([[42]], dtype=np.uint64)
    run_bls(decoder, tokenizer, settings, "the cat sat on the mat", 20, 3, seed=seed,
            temperature=np.array([[1.0]], dtype=np.float32), top_p=np.array([[1.0]], dtype=np.float32))
    assert {seed for model, seed in calls if model == "tensorrt_llm"} == {42}
    assert {seed for model, seed in calls if model == "tensorrt_llm_draft"} == {role_seed(42, ROLE_DRAFT)}
    assert sum(model == "tensorrt_llm" for model, _ in calls) > 2  # several rounds


@pytest.mark.parametrize("mode", ["draft_target", "ngram"])
def test_bls_seeded_sampling_is_the_same_text_for_every_k(engines, mode):
    """Prompt lookup and draft tokens without logits are verified by token matching: the seeded text of K = 0."""
    runners, tokenizer = engines
    settings, decoder = local_decoder(runners, mode)
    text = "the the the cat sat on the mat and the cat sat on the"

    def sample(k, seed):
        return run_bls(decoder, tokenizer, settings, text, 24, k, seed=np.array([[seed]], dtype=np.uint64),
                       temperature=np.array([[1.2]], dtype=np.float32), top_p=np.array([[0.95]], dtype=np.float32))

    plain, _ = sample(0, 5)
    spec, stats = sample(3, 5)
    assert spec == plain and stats.total_draft_tokens > 0
    assert sample(0, 6)[0] != plain
