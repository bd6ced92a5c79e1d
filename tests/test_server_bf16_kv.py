"""Served engines over a bf16 KV cache: the default where AVX512-BF16 runs (EngineConfig.bf16_kv_cache), which the
suite's shared server does not run (tests/conftest.py keeps float32). A server started with REFERENCE_BF16_KV_CACHE=1
must say so in its log (each engine model logs its cache), give the same greedy text with and without speculation,
through the BLS (draft-target rounds, the draft engine over a bf16 cache too) and the ensemble, and the target
engine's greedy ids must start with the in-process engine's over a bf16 cache."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pipeline.reference import row_attention
from pipeline.reference.engine import BF16_KV_CACHE_ENV, LLMEngine, SamplingParams
from tests.test_server_sampling import bls_request, decode, engine_request, output_ids
from tests.test_server_triton import final_value, joined_text, prompts, stream_requests
from tests.test_speculative import MAX_NEW, drive
from tests.triton_fixtures import serving, write_spec

pytestmark = pytest.mark.skipif(row_attention.bf16_kernel() is None,
                                reason="the bf16 KV cache's kernel needs AVX512-BF16 (elsewhere it stays float32)")
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory, derived_pair):
    """ONE server on the tiny draft-target spec, its engines over bf16 KV caches: (server, target engine folder)."""
    from specbuild.toolchains.reference import run_reference
    from pipeline.spec import load_spec

    folder = tmp_path_factory.mktemp("bf16-kv-spec")
    plan = run_reference(load_spec(write_spec(folder, Path(derived_pair[0]), Path(derived_pair[1]))))
    with pytest.MonkeyPatch.context() as env:
        env.setenv(BF16_KV_CACHE_ENV, "1")  # the server's environment is this process's at its start
        with serving(plan) as (server, _repo):
            yield server, plan.spec.out_dir / "engines" / "target"


def test_the_engines_log_their_bf16_caches(bf16_server):
    server, _ = bf16_server
    log = server.log_file.read_text()
    for model in ("tensorrt_llm", "tensorrt_llm_draft"):
        assert f'"{model}: bf16 KV cache, ' in log


def test_speculative_text_equals_plain_text_over_bf16_caches(bf16_server, derived_pair):
    server, engine_dir = bf16_server
    tok = AutoTokenizer.from_pretrained(derived_pair[0])
    for prompt in prompts(3):
        plain, speculative = stream_requests(server.grpc_url, "tensorrt_llm_bls",
                                             [bls_request(prompt, MAX_TOKENS, num_draft_tokens=k) for k in (0, 3)])
        assert joined_text(speculative) == joined_text(plain)
        assert final_value(speculative, "total_draft_tokens") > 0  # K = 3 did speculate
        (through_ensemble,) = stream_requests(server.grpc_url, "ensemble", [bls_request(prompt, MAX_TOKENS)])
        assert joined_text(through_ensemble) == joined_text(plain)
        ids = tok.encode(prompt, add_special_tokens=False)
        (direct,) = stream_requests(server.grpc_url, "tensorrt_llm",
                                    [engine_request(ids, MAX_TOKENS, end_id=tok.eos_token_id)])
        assert decode(tok, output_ids(direct)) == joined_text(plain)
        # the in-process engine over a bf16 cache, batch-invariant as served: the same greedy ids (its first MAX_NEW)
        engine = LLMEngine.from_engine_dir(engine_dir, batch_invariant=True, bf16_kv_cache=True)
        assert engine.kv.kv_dtype == "BF16"
        in_process = drive(engine, [(0, ids)], sampling=SamplingParams(end_id=tok.eos_token_id))[0]["r0"]
        assert output_ids(direct)[:MAX_NEW] == in_process
