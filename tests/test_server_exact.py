"""Greedy identity through the real Triton server (issue 11): speculative output equals plain output token for
token, at concurrency 1 and with 8 requests in flight, and plain output does not depend on the concurrency.
Prompt lookup runs inside the reference engine (pipeline.toolchains.lookup_in_engine): the BLS forwards K.

The served engine runs batch-invariant (load_serving_engine's default): int8 kernels take all rows at once,
attention runs every token as its own SDPA batch element over aligned keys (pipeline/reference/model.py).
The prompts are the 8 summarize prompts of `make bench` (clients/prompts/summarize.jsonl), on which the
batched attention of earlier builds changed 2 of 8 SmolLM2 answers (docs/benchmarks.md).
"""

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from clients.chat import ChatTemplate
from pipeline.limits import PLAIN_CHUNK_TOKENS
from pipeline.names import ACCEPTED_TOKENS_METRIC, DRAFT_TOKENS_METRIC, ROUNDS_METRIC, TARGET_MODEL
from pipeline.spec import load_spec
from specbuild.toolchains.reference import run_reference
from tests.test_server_faults import LONG, leave_after_three, settled_steps
from tests.test_server_faults import request as fault_request
from tests.test_server_sampling import bls_request, engine_request, output_ids
from tests.test_server_triton import final_value, joined_text, stream_requests
from tests.triton_fixtures import serving, write_spec

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"


def summarize_prompts(tokenizer_dir: Path) -> list[str]:
    """The 8 summarize prompts in the model's chat template, as `make bench` sends them."""
    template = ChatTemplate.from_tokenizer_dir(tokenizer_dir)
    lines = (ROOT / "clients" / "prompts" / "summarize.jsonl").read_text().splitlines()
    return [template.render(json.loads(line)["messages"]) for line in lines if line.strip()]


def ngram_spec(folder: Path, target: Path, draft: Path, **overrides):
    """The default spec's shape (int8_sq target, n-gram K=5) on `target`, speculating at any batch size."""
    return load_spec(write_spec(folder, target, draft, **{
        "models": {"target": {"checkpoint": str(target), "dtype": "float32", "qformat": "int8_sq"}},
        "speculative": {"mode": "ngram", "max_draft_len": 8, "num_draft_tokens": 5, "ngram": {"min_ngram": 1, "max_ngram": 3},
                        "min_acceptance_rate": 0.0, "min_new_tokens_for_speculation": 0, "max_batch_for_speculation": 8},
        "engine": {"max_batch_size": 8, "max_input_len": 1024, "max_seq_len": 2048, "max_num_tokens": 8192},
        **overrides}))


def answers(server, texts: list[str], max_tokens: int, k: int, in_flight: int) -> tuple[list[str], int]:
    """Greedy answers through the ensemble with `in_flight` requests on one stream at a time; drafted tokens in all."""
    results = []
    for start in range(0, len(texts), in_flight):
        batch = [bls_request(t, max_tokens, num_draft_tokens=k, stream=True) for t in texts[start:start + in_flight]]
        results += stream_requests(server.grpc_url, "ensemble", batch, timeout=600)
    return [joined_text(r) for r in results], sum(int(final_value(r, "total_draft_tokens") or 0) for r in results)


def check_greedy_identity(server, texts: list[str], max_tokens: int) -> None:
    """K=5 == K=0 at concurrency 1 and with len(texts) in flight, and K=0 alone == K=0 in flight."""
    plain, drafted = answers(server, texts, max_tokens, 0, 1)
    assert drafted == 0 and sum(map(len, plain)) > 4 * len(texts)
    plain_batched, _ = answers(server, texts, max_tokens, 0, len(texts))
    assert plain_batched == plain
    for in_flight in (1, len(texts)):
        spec, drafted = answers(server, texts, max_tokens, 5, in_flight)
        assert drafted > 0  # the requests did speculate
        assert spec == plain, in_flight


@pytest.fixture(scope="module")
def exact_server(tmp_path_factory, derived_pair):
    """The tiny target as an int8_sq engine behind the default spec's n-gram BLS (K=5), speculating at any batch."""
    spec = ngram_spec(tmp_path_factory.mktemp("exact-spec"), *derived_pair)
    with serving(run_reference(spec)) as (server, _):
        yield server


def test_greedy_speculation_equals_plain_alone_and_with_8_in_flight(exact_server, derived_pair):
    """The 8 summarize prompts, 48 tokens each, through the ensemble."""
    check_greedy_identity(exact_server, summarize_prompts(derived_pair[0]), 48)


def target_spec_metrics(metrics_url: str) -> dict[str, float]:
    """The tensorrt_llm model's spec_decode_* counters (the engine's own prompt lookup)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return {name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(name + "{") and f'model="{TARGET_MODEL}"' in line)
            for name in (DRAFT_TOKENS_METRIC, ACCEPTED_TOKENS_METRIC, ROUNDS_METRIC)}


def test_the_target_exports_its_own_speculation_as_the_responses_count_it(exact_server, derived_pair):
    """The engine drafts, so its model exports spec_decode_* (rounds = its verify steps); the draft tokens it
    counts are the ones the ensemble's responses report."""
    before = target_spec_metrics(exact_server.metrics_url)
    _, drafted = answers(exact_server, summarize_prompts(derived_pair[0])[:2], 32, 5, 1)
    after = target_spec_metrics(exact_server.metrics_url)
    delta = {name: after[name] - before[name] for name in after}
    assert delta[DRAFT_TOKENS_METRIC] == drafted > 0
    assert 0 <= delta[ACCEPTED_TOKENS_METRIC] <= drafted and 0 < delta[ROUNDS_METRIC] <= drafted


def test_a_client_that_leaves_stops_the_engines_own_lookup_within_one_call(exact_server, derived_pair):
    """The engine drafts itself, so the BLS streams calls of at most PLAIN_CHUNK_TOKENS tokens: when the client
    leaves, the engine's steps stop within about the call under way (each step emits at least one token), counted
    from idle to idle as in test_server_faults."""
    before = settled_steps(exact_server.metrics_url)
    leave_after_three(exact_server.grpc_url, fault_request(summarize_prompts(derived_pair[0])[0], LONG, 5))
    after = settled_steps(exact_server.metrics_url)
    assert after[TARGET_MODEL] - before[TARGET_MODEL] <= 2 * (PLAIN_CHUNK_TOKENS + 1)


def generation_logits(results: list) -> np.ndarray:
    """[n, vocab] float32 logits of a tensorrt_llm response's generated tokens."""
    arrays = [r.as_numpy("generation_logits") for r in results if r.as_numpy("generation_logits") is not None]
    return np.concatenate([a.reshape(-1, a.shape[-1]) for a in arrays])


def test_verified_tokens_get_plain_decodings_logits_bit_for_bit(exact_server, derived_pair):
    """Bits, not just tokens (a tiny model has no near-ties to flip): the tensorrt_llm model verifying 5 correct
    drafts returns, for the 6 tokens it emits, exactly the logits plain decoding returned for them, alone and
    with 8 requests in flight; plain decoding returns the same logits with 8 in flight as alone."""
    tok = AutoTokenizer.from_pretrained(derived_pair[0])
    prompts = [tok.encode(t, add_special_tokens=False)[:200] for t in summarize_prompts(derived_pair[0])]
    url = exact_server.grpc_url

    def plain(ids: list[int]) -> dict:  # num_draft_tokens 0: the engine's own prompt lookup stays off
        return engine_request(ids, 6, return_generation_logits=True, num_draft_tokens=0)

    def verify(ids: list[int], draft: list[int]) -> dict:
        return {**plain(ids), "draft_input_ids": np.array([draft], dtype=np.int32)}

    alone = [stream_requests(url, "tensorrt_llm", [plain(ids)])[0] for ids in prompts]
    tokens = [output_ids(r) for r in alone]
    logits = [generation_logits(r) for r in alone]
    assert all(len(t) == 6 for t in tokens)
    together = stream_requests(url, "tensorrt_llm", [plain(ids) for ids in prompts])
    assert all(np.array_equal(generation_logits(r), ref) for r, ref in zip(together, logits))
    verified_alone = [stream_requests(url, "tensorrt_llm", [verify(ids, t[:5])])[0] for ids, t in zip(prompts, tokens)]
    verified_together = stream_requests(url, "tensorrt_llm", [verify(ids, t[:5]) for ids, t in zip(prompts, tokens)])
    for results in (verified_alone, verified_together):
        assert [output_ids(r) for r in results] == tokens  # every draft accepted: one forward of 6 rows
        assert all(np.array_equal(generation_logits(r), ref) for r, ref in zip(results, logits))


@pytest.mark.slow
def test_smollm2_greedy_speculation_equals_plain_alone_and_with_8_in_flight(tmp_path_factory):
    """The default spec's engine (SmolLM2-135M-Instruct, int8_sq, n-gram K=5), 128 tokens per summary."""
    if not (SMOLLM2 / "config.json").exists():
        pytest.skip("SmolLM2-135M-Instruct is not downloaded; run `make models`")
    spec = ngram_spec(tmp_path_factory.mktemp("exact-smollm2"), SMOLLM2, SMOLLM2)
    with serving(run_reference(spec)) as (server, _):
        check_greedy_identity(server, summarize_prompts(SMOLLM2), 128)


def test_a_stream_interval_streams_the_same_answer_in_fewer_responses(exact_server, tmp_path_factory, derived_pair):
    """serving.stream_interval 8 on the real server: the first token comes at once, then responses of up to 8 tokens,
    so a 48-token answer comes in at most 1 + ceil(47 / 8) responses that carry tokens (a response holds back a split
    multi-byte character, which only merges two), with the per-step stream's tokens, plain and speculating."""
    spec = ngram_spec(tmp_path_factory.mktemp("interval-spec"), *derived_pair, serving={"stream_interval": 8})
    prompt = summarize_prompts(derived_pair[0])[1]
    with serving(run_reference(spec)) as (server, _):
        for k in (0, 5):
            request = bls_request(prompt, 48, num_draft_tokens=k, stream=True)
            [coalesced] = stream_requests(server.grpc_url, "ensemble", [request], timeout=600)
            [per_step] = stream_requests(exact_server.grpc_url, "ensemble", [request], timeout=600)
            with_tokens = [r for r in coalesced if len(output_ids([r]))]
            assert output_ids(coalesced) == output_ids(per_step) and len(output_ids(coalesced)) == 48
            assert len(output_ids(with_tokens[:1])) == 1 and len(with_tokens) <= 1 + -(-47 // 8)
            assert len([r for r in per_step if len(output_ids([r]))]) > len(with_tokens)
