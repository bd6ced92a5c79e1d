"""Sampling fidelity under speculation and NVIDIA's request semantics, against the real Triton server.

Session server (tests/triton_fixtures.py): the tiny derived draft/target pair, draft_target mode.
- Every sampling parameter: the text with K = 0, K = 1 and K = 3, alone or batched, and from one
  direct tensorrt_llm call, is the same (greedy and seeded sampling: token matching verifies exactly
  the tokens plain sampling draws, see pipeline/seeds.py).
- Seeded lossless rejection sampling (use_draft_logits) follows the target's law: chi-square.
- NVIDIA semantics: top_p <= 0 is unset and top_k 0 with top_p 0 is greedy; the `stop` input;
  streamed responses never carry the prompt.
"""

from __future__ import annotations

import queue

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM
from tritonclient.utils import InferenceServerException

from pipeline.spec import load_spec
from specbuild.toolchains.reference import run_reference
from tests.test_rejection_sampler import ALPHA, chi_square_pvalue
from tests.test_server_triton import final_value, grpc_inputs, joined_text, open_stream, prompts, stream_requests
from tests.triton_fixtures import serving, write_spec

MAX_TOKENS = 80  # more than one 64-token plain chunk, and past the draft's 64-token limit (fallback)


def bls_request(prompt: str, max_tokens: int = MAX_TOKENS, **params) -> dict:
    """tensorrt_llm_bls / ensemble inputs with NVIDIA's dtypes."""
    dtypes = {"seed": np.uint64, "top_p": np.float32, "temperature": np.float32, "repetition_penalty": np.float32,
              "presence_penalty": np.float32, "frequency_penalty": np.float32}
    fields = {"text_input": np.array([[prompt.encode()]], dtype=object),
              "max_tokens": np.array([[max_tokens]], dtype=np.int32)}
    for name, value in {"exclude_input_in_output": True, **params}.items():
        if name in ("stop_words", "bad_words"):
            fields[name] = np.array([[w.encode() for w in value]], dtype=object)
        else:
            fields[name] = np.array([[value]], dtype=dtypes.get(name, bool if isinstance(value, bool) else np.int32))
    return fields


ENGINE_NAMES = {"top_k": "runtime_top_k", "top_p": "runtime_top_p"}


def engine_request(ids: list[int], max_new: int, streaming: bool = False, **params) -> dict:
    """tensorrt_llm inputs for the same parameters (NVIDIA's names and dtypes); generated tokens only (the
    engines' configured exclude_input_in_output is false, as NVIDIA's recipe fills it)."""
    fields = {"input_ids": np.array([ids], dtype=np.int32), "input_lengths": np.array([[len(ids)]], dtype=np.int32),
              "request_output_len": np.array([[max_new]], dtype=np.int32),
              "streaming": np.array([[streaming]], dtype=bool),
              "exclude_input_in_output": np.array([[True]], dtype=bool)}
    for name, value in params.items():
        dtype = np.uint64 if name == "seed" else bool if isinstance(value, bool) else np.int32 if isinstance(value, int) else np.float32
        fields[ENGINE_NAMES.get(name, name)] = np.array([[value]], dtype=dtype)
    return fields


def output_ids(results: list) -> list[int]:
    arrays = [r.as_numpy("output_ids") for r in results if r.as_numpy("output_ids") is not None]
    return np.concatenate([a.reshape(-1) for a in arrays]).tolist() if arrays else []


@pytest.fixture(scope="module")
def tok(triton_server):
    return AutoTokenizer.from_pretrained(triton_server.target_dir)


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# ----------------------------------------------------------------------------- K = 0 vs K > 0

SAMPLING_CASES = {
    "defaults (greedy)": {},
    "NVIDIA client defaults: temperature 1, top_k 0, top_p 0 (greedy)": {"temperature": 1.0, "top_k": 0, "top_p": 0.0},
    "greedy with penalties": {"top_k": 1, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 2.0},
    "seeded sampling": {"temperature": 1.3, "top_p": 1.0, "seed": 3},
    "seeded top_k, top_p and penalties": {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": 9,
                                          "frequency_penalty": 1.0, "presence_penalty": 0.3},
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_every_sampling_parameter_gives_one_text_with_and_without_speculation(triton_server, tok, case):
    """K = 0 (two plain chunks), K = 1 and K = 3 batched on one stream, K = 3 alone, and one direct
    tensorrt_llm call of 80 tokens: the same text."""
    params = SAMPLING_CASES[case]
    prompt = prompts(3)[2]
    batched = stream_requests(triton_server.grpc_url, "tensorrt_llm_bls",
                              [bls_request(prompt, num_draft_tokens=k, **params) for k in (0, 1, 3)])
    (alone,) = stream_requests(triton_server.grpc_url, "ensemble", [bls_request(prompt, num_draft_tokens=3, **params)])
    ids = tok.encode(prompt, add_special_tokens=False)
    (direct,) = stream_requests(triton_server.grpc_url, "tensorrt_llm",
                                [engine_request(ids, MAX_TOKENS, end_id=tok.eos_token_id, **params)])
    texts = [joined_text(r) for r in batched] + [joined_text(alone), decode(tok, output_ids(direct))]
    assert len(set(texts)) == 1, texts
    assert final_value(batched[2], "total_draft_tokens") > 0  # K = 3 did speculate
    if "seed" in params:  # and sampling really sampled: another seed gives another text
        (other,) = stream_requests(triton_server.grpc_url, "tensorrt_llm_bls",
                                   [bls_request(prompt, num_draft_tokens=3, **{**params, "seed": params["seed"] + 1})])
        assert joined_text(other) != texts[0]


def test_min_tokens_bad_words_and_stop_words_across_rounds(triton_server, tok):
    """Rules that look at everything generated so far, checked at token positions beyond the first round."""
    prompt = prompts(4)[3]
    ids = tok.encode(prompt, add_special_tokens=False)
    (plain,) = stream_requests(triton_server.grpc_url, "tensorrt_llm", [engine_request(ids, 40)])
    plain_ids = output_ids(plain)
    rules = {"end_id": plain_ids[5], "min_tokens": 12, "bad_words": [decode(tok, plain_ids[8:10])],
             "stop_words": [decode(tok, plain_ids[20:22])]}
    results = stream_requests(triton_server.grpc_url, "tensorrt_llm_bls",
                              [bls_request(prompt, 40, num_draft_tokens=k, **rules) for k in (0, 3)])
    texts = [joined_text(r) for r in results]
    assert texts[0] == texts[1]
    (unruled,) = stream_requests(triton_server.grpc_url, "tensorrt_llm_bls", [bls_request(prompt, 40)])
    assert texts[0] != joined_text(unruled)


# ----------------------------------------------------------------------------- seeded statistical test

TEMPERATURE = 3.0  # spreads the derived pair's x8-sharpened logits


def text_law(checkpoint: str, tok, prompt_ids: list[int]) -> dict[str, float]:
    """The exact law of the two-token text a model samples after prompt_ids at TEMPERATURE (end_id = eos stops).

    Different token pairs can decode to one text, so every second token of every first token that
    carries the first 99.9% of the mass is summed in; the rest is left out (the test's last cell)."""
    model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt_ids])).logits[0, -1] / TEMPERATURE, -1)  # [vocab]
        order = first.argsort(descending=True)
        keep = int((first[order].cumsum(0) < 0.999).sum()) + 1
        cands = [a for a in order[:keep].tolist() if a != eos]
        second = torch.softmax(model(torch.tensor([prompt_ids + [a] for a in cands])).logits[:, -1] / TEMPERATURE, -1)
    law: dict[str, float] = {}
    for i, a in enumerate(cands):
        for b, pb in enumerate(second[i].tolist()):
            text = decode(tok, [a] if b == eos else [a, b])
            law[text] = law.get(text, 0.0) + float(first[a]) * pb
    return law


@pytest.fixture(scope="module")
def speculating_server(tmp_path_factory, derived_pair):
    """A server like the session's whose BLS speculates from the first token (min_new_tokens_for_speculation 0),
    so two-token requests go through one propose + verify round."""
    spec = load_spec(write_spec(tmp_path_factory.mktemp("sampling-spec"), *derived_pair,
                                **{"speculative.min_new_tokens_for_speculation": 0}))
    with serving(run_reference(spec)) as (server, _):
        yield server


def sampled_texts(server, prompt: str, seeds: range, per_stream: int = 250) -> list[str]:
    """One two-token text per seed; at most `per_stream` requests in flight at once."""
    requests = [bls_request(prompt, 2, num_draft_tokens=1, use_draft_logits=True, temperature=TEMPERATURE,
                            top_p=1.0, seed=s) for s in seeds]
    return [joined_text(r) for i in range(0, len(requests), per_stream)
            for r in stream_requests(server.grpc_url, "tensorrt_llm_bls", requests[i:i + per_stream], timeout=600)]


def law_pvalue(texts: list[str], law: dict[str, float]) -> float:
    keys = sorted(law)
    index = {k: i for i, k in enumerate(keys)}
    counts = torch.zeros(len(keys) + 1)  # the last cell: every text outside the law's support, with its mass
    for t in texts:
        counts[index.get(t, len(keys))] += 1
    probs = torch.tensor([law[k] for k in keys] + [max(0.0, 1.0 - sum(law.values()))])
    return chi_square_pvalue(counts, probs)


def check_seeded_lossless_sampling(server, target_dir, draft_dir, n: int):
    """n seeded requests (seeds 0..n-1), each one round: draft 1 token with its logits, the target verifies
    by rejection sampling and adds its own token. The two tokens follow the target's law, not the draft's."""
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompt = prompts(2)[1]
    ids = tok.encode(prompt, add_special_tokens=False)
    texts = sampled_texts(server, prompt, range(n))
    assert law_pvalue(texts, text_law(target_dir, tok, ids)) > ALPHA
    assert law_pvalue(texts, text_law(draft_dir, tok, ids)) < ALPHA
    (stats,) = stream_requests(server.grpc_url, "tensorrt_llm_bls", [bls_request(
        prompt, 2, num_draft_tokens=1, use_draft_logits=True, temperature=TEMPERATURE, top_p=1.0, seed=0)])
    assert final_value(stats, "total_draft_tokens") == 1  # the requests did speculate


def test_seeded_lossless_sampling_follows_the_target_law(speculating_server, derived_pair):
    check_seeded_lossless_sampling(speculating_server, *derived_pair, 1000)


@pytest.mark.slow
def test_seeded_lossless_sampling_follows_the_target_law_full_size(speculating_server, derived_pair):
    check_seeded_lossless_sampling(speculating_server, *derived_pair, 8000)


# ----------------------------------------------------------------------------- NVIDIA semantics


def test_top_p_zero_or_negative_is_unset_and_greedy(triton_server, tok):
    """NVIDIA's inflight_batcher_llm_client defaults (--top-k 1 --top-p 0) and top_k 0 / top_p <= 0 decode greedily."""
    prompt = prompts(1)[0]
    ids = tok.encode(prompt, add_special_tokens=False)
    (greedy,) = stream_requests(triton_server.grpc_url, "tensorrt_llm", [engine_request(ids, 16, temperature=0.0)])
    variants = [{"temperature": 1.0, "top_k": 1, "top_p": 0.0}, {"temperature": 1.0, "top_k": 0, "top_p": 0.0},
                {"temperature": 1.0, "top_p": -1.0}, {"temperature": 1.0}]
    direct = stream_requests(triton_server.grpc_url, "tensorrt_llm", [engine_request(ids, 16, **v) for v in variants])
    assert all(output_ids(r) == output_ids(greedy) for r in direct)
    bls = stream_requests(triton_server.grpc_url, "ensemble", [bls_request(prompt, 16, **v) for v in variants] * 2)
    assert {joined_text(r) for r in bls} == {decode(tok, output_ids(greedy))}


@pytest.mark.parametrize("name,value", [("runtime_top_p_decay", 0.5), ("runtime_top_p_reset_ids", 7),
                                        ("draft_acceptance_threshold", 0.9)])
def test_sampling_inputs_that_would_change_tokens_unimplemented_are_refused(triton_server, tok, name, value):
    ids = tok.encode(prompts(1)[0], add_special_tokens=False)
    with pytest.raises(InferenceServerException, match=name):
        stream_requests(triton_server.grpc_url, "tensorrt_llm", [engine_request(ids, 4, **{name: value})])


def test_end_id_minus_one_means_no_end_token(triton_server, tok):
    ids = tok.encode(prompts(1)[0], add_special_tokens=False)
    (results,) = stream_requests(triton_server.grpc_url, "tensorrt_llm", [engine_request(ids, 12, end_id=-1)])
    assert len(output_ids(results)) == 12


def test_top_k_with_top_p_zero_samples_and_top_p_above_one_is_refused(triton_server, tok):
    prompt = prompts(1)[0]
    sampled = stream_requests(triton_server.grpc_url, "ensemble",
                              [bls_request(prompt, 16, temperature=2.0, top_k=50, top_p=0.0, seed=s) for s in range(4)])
    assert len({joined_text(r) for r in sampled}) > 1  # top_k 50 with top_p 0 is top-k sampling (top_p 1)
    with pytest.raises(InferenceServerException, match="top_p"):
        stream_requests(triton_server.grpc_url, "ensemble", [bls_request(prompt, 4, top_p=1.5)])


def test_stop_request_ends_a_running_request(triton_server, tok):
    """NVIDIA's stop request: same request id, `stop` true; the stopped request ends early with what it has.

    The stop follows the request on the same stream, so the model sees it after the request started
    (how long the request ran before does not matter; a timed stop would race the tiny model)."""
    ids = tok.encode(prompts(6)[5], add_special_tokens=False)
    max_new = 200
    stop = {"input_ids": np.zeros((1, 1), dtype=np.int32), "input_lengths": np.zeros((1, 1), dtype=np.int32),
            "request_output_len": np.zeros((1, 1), dtype=np.int32), "stop": np.array([[True]], dtype=bool)}
    got: queue.Queue = queue.Queue()
    client = open_stream(triton_server.grpc_url, lambda result, error: got.put(error or result))
    client.async_stream_infer("tensorrt_llm", grpc_inputs(engine_request(ids, max_new, streaming=True)),
                              request_id="long-one")
    client.async_stream_infer("tensorrt_llm", grpc_inputs(stop), request_id="long-one")
    client.stop_stream()  # returns once both requests are complete
    results = []
    while not got.empty():
        results.append(got.get())
    assert not any(isinstance(r, InferenceServerException) for r in results), results
    assert len(output_ids(results)) < max_new
    assert any(r.as_numpy("output_ids") is None for r in results)  # the stop request's empty response
    client = open_stream(triton_server.grpc_url, lambda result, error: got.put(error or result))
    client.async_stream_infer("tensorrt_llm", grpc_inputs(stop))  # no request id: nothing to stop
    client.stop_stream()
    error = got.get(timeout=60)
    assert isinstance(error, InferenceServerException) and "stop" in str(error), error


def test_streamed_responses_never_carry_the_prompt(triton_server, tok):
    """exclude_input_in_output false puts the prompt in a non-streaming response only (TensorRT-LLM's createResult)."""
    prompt = prompts(1)[0]
    ids = tok.encode(prompt, add_special_tokens=False)
    flag = {"exclude_input_in_output": False}
    streamed, unary = stream_requests(triton_server.grpc_url, "tensorrt_llm",
                                      [engine_request(ids, 8, streaming=True, **flag), engine_request(ids, 8, **flag)])
    assert output_ids(unary) == ids + output_ids(streamed) and len(output_ids(streamed)) == 8
    streamed, unary = stream_requests(triton_server.grpc_url, "tensorrt_llm_bls",
                                      [bls_request(prompt, 8, stream=True, **flag), bls_request(prompt, 8, **flag)])
    assert joined_text(unary) == prompt + joined_text(streamed) and not joined_text(streamed).startswith(prompt)
