"""serving.decoupled false: every model answers unary ModelInfer, as NVIDIA's draft-target recipe deploys them.

One more real Triton server (module scope) on the tiny derived pair with decoupled_mode False. The calls
below are the ones NVIDIA's stock tensorrt_llm_bls (`lib/decode.py` `_spec_generate`, tensorrtllm_backend
c2e65b8) and `e2e_grpc_speculative_decoding_client.py` make: unary draft and target calls whose output_ids
carry the prompt (exclude_input_in_output false in the config), a target call verifying draft_input_ids, and
the `stop` request the BLS sends after a stop word. docs/trtllm.md records the run of NVIDIA's own models.
"""

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException
from transformers import AutoTokenizer

from tests.test_server_triton import MAX_TOKENS, grpc_inputs, prompts, text_request
from tests.triton_fixtures import serving, write_spec


@pytest.fixture(scope="module")
def unary_server(tmp_path_factory, derived_pair):
    from pipeline.spec import load_spec
    from specbuild.toolchains.reference import run_reference

    folder = tmp_path_factory.mktemp("unary")
    target, draft = derived_pair
    spec = load_spec(write_spec(folder, target, draft, **{"serving.decoupled": False, "serving.streaming": False}))
    with serving(run_reference(spec)) as (server, _repo):
        yield server, AutoTokenizer.from_pretrained(target)


def http_infer(url: str, model: str, fields: dict):
    """One unary HTTP /infer call (Triton refuses it for decoupled models)."""
    return httpclient.InferenceServerClient(url, network_timeout=240).infer(model, grpc_inputs(fields, httpclient))


def engine_call(url: str, model: str, ids: list[int], n: int, **extra):
    fields = {"input_ids": np.array([ids], dtype=np.int32), "input_lengths": np.array([[len(ids)]], dtype=np.int32),
              "request_output_len": np.array([[n]], dtype=np.int32)}
    fields.update(extra)
    result = grpcclient.InferenceServerClient(url).infer(model, grpc_inputs(fields), client_timeout=240)
    n_out = int(result.as_numpy("sequence_length").reshape(-1)[0])
    return result.as_numpy("output_ids").reshape(-1)[:n_out].tolist(), result


def test_bls_and_ensemble_answer_http_infer_with_exact_greedy_text(unary_server):
    server, _tok = unary_server
    for prompt in prompts(2):
        plain = http_infer(server.http_url, "tensorrt_llm_bls", text_request(prompt, num_draft_tokens=0))
        spec = http_infer(server.http_url, "tensorrt_llm_bls", text_request(prompt, num_draft_tokens=3))
        ensemble = http_infer(server.http_url, "ensemble", text_request(prompt, num_draft_tokens=3))
        text = plain.as_numpy("text_output")[0]
        assert text and spec.as_numpy("text_output")[0] == text and ensemble.as_numpy("text_output")[0] == text
        assert spec.as_numpy("total_draft_tokens").reshape(-1)[0] > 0


def test_nvidia_draft_target_round_on_unary_engines(unary_server):
    """One _spec_generate round: the draft's output_ids start with the prompt; the target keeps the accepted
    draft tokens plus one of its own, so the sequence grows as plain greedy decoding would."""
    server, tok = unary_server
    ids = tok.encode(prompts(1)[0], add_special_tokens=False)
    greedy, _ = engine_call(server.grpc_url, "tensorrt_llm", ids, 8)
    assert greedy[:len(ids)] == ids and len(greedy) == len(ids) + 8  # the prompt comes back first
    draft_out, _ = engine_call(server.grpc_url, "tensorrt_llm_draft", ids, 3, min_tokens=np.array([[3]], dtype=np.int32))
    draft = draft_out[len(ids):]
    assert len(draft) == 3
    target_out, result = engine_call(server.grpc_url, "tensorrt_llm", ids, len(draft) + 1,
                                     draft_input_ids=np.array([draft], dtype=np.int32))
    new = target_out[len(ids):]
    accepted = int(result.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
    assert new == greedy[len(ids):len(ids) + accepted + 1]
    assert new[:accepted] == draft[:accepted]


def test_preprocessing_extras_are_ignored_like_nvidias_backend(unary_server):
    """NVIDIA's preprocessing always sends decoder_input_ids and an empty embedding_bias; a decoder-only engine ignores them."""
    server, tok = unary_server
    ids = tok.encode(prompts(1)[0], add_special_tokens=False)
    plain, _ = engine_call(server.grpc_url, "tensorrt_llm", ids, 4)
    extras, _ = engine_call(server.grpc_url, "tensorrt_llm", ids, 4,
                            decoder_input_ids=np.array([[0]], dtype=np.int32),
                            decoder_input_lengths=np.array([[1]], dtype=np.int32),
                            embedding_bias=np.zeros((1, 0), dtype=np.float32))
    assert extras == plain


def test_stop_request_gets_one_empty_response(unary_server):
    server, _tok = unary_server
    client = grpcclient.InferenceServerClient(server.grpc_url)
    stop = {"input_ids": np.zeros((1, 1), dtype=np.int32), "input_lengths": np.zeros((1, 1), dtype=np.int32),
            "request_output_len": np.zeros((1, 1), dtype=np.int32), "stop": np.array([[True]], dtype=bool)}
    result = client.infer("tensorrt_llm", grpc_inputs(stop), request_id="no-such-request")
    assert result.as_numpy("output_ids") is None
    with pytest.raises(InferenceServerException, match="request id"):
        client.infer("tensorrt_llm", grpc_inputs(stop))


@pytest.mark.parametrize("model, fields", [
    ("tensorrt_llm", {"input_ids": np.array([[5, 6, 7]], dtype=np.int32), "input_lengths": np.array([[3]], dtype=np.int32),
                      "request_output_len": np.array([[2]], dtype=np.int32), "streaming": np.array([[True]], dtype=bool)}),
    ("tensorrt_llm_bls", text_request("hello", MAX_TOKENS, stream=True)),
])
def test_streaming_needs_a_decoupled_model(unary_server, model, fields):
    server, _tok = unary_server
    with pytest.raises(InferenceServerException, match="serving.decoupled"):
        grpcclient.InferenceServerClient(server.grpc_url).infer(model, grpc_inputs(fields), client_timeout=120)
