"""An EAGLE-3 spec served by a real Triton server: the reference tensorrt_llm model builds the engine's
EAGLE-3 proposer (heads stored in the engine, target layers from its config) and speculates inside the
target engine, as TensorRT-LLM's PyTorch backend does with `decoding_type: Eagle3`.

The heads are random (near-zero acceptance, reduced draft vocabulary with d2t): greedy output must still
equal plain greedy decoding, and the drafted tokens are counted in the response.
"""

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from specfixtures.models import make_random_eagle3
from tests.test_server_medusa import MAX_TOKENS, _greedy
from tests.test_server_triton import final_value, joined_text, prompts, stream_requests, text_request
from tests.triton_fixtures import serving, write_spec

CHOICES = [[0], [1], [0, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def eagle3_server(tmp_path_factory, derived_pair):
    """ONE server on a tiny target with random EAGLE-3 heads (repository assembled by the real pipeline)."""
    from pipeline.execute import run_reference
    from pipeline.spec import load_spec

    folder = tmp_path_factory.mktemp("eagle3-spec")
    target = Path(derived_pair[0])
    heads = make_random_eagle3(target, folder / "eagle3", dtype="float32", draft_vocab_size=256)
    spec = load_spec(write_spec(folder, target, target, models={"target": {"checkpoint": str(target), "dtype": "float32"}},
                                speculative={"mode": "eagle", "max_draft_len": 8, "num_draft_tokens": 4,
                                             "eagle": {"checkpoint": str(heads), "version": 3, "choices": CHOICES,
                                                       "layers_to_capture": [0, 1, 2]}}))
    run_reference(spec)
    with serving(spec) as (server, _repo):
        yield server, target


def test_eagle3_engine_speculates_and_matches_greedy(eagle3_server):
    server, target = eagle3_server
    tok = AutoTokenizer.from_pretrained(target)
    prompt = prompts(1)[0]
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    expected = _greedy(target, prompt_ids)

    [results] = stream_requests(server.grpc_url, "ensemble", [text_request(prompt, MAX_TOKENS)])
    assert joined_text(results) == tok.decode(expected, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    [results] = stream_requests(server.grpc_url, "tensorrt_llm", [{
        "input_ids": np.array([prompt_ids], dtype=np.int32),
        "input_lengths": np.array([[len(prompt_ids)]], dtype=np.int32),
        "request_output_len": np.array([[MAX_TOKENS]], dtype=np.int32),
        "end_id": np.array([[tok.eos_token_id]], dtype=np.int32),
        "return_perf_metrics": np.array([[True]], dtype=bool)}])
    [ids] = [r.as_numpy("output_ids") for r in results if r.as_numpy("output_ids") is not None]
    assert ids.reshape(-1).tolist() == expected
    drafted, accepted = int(final_value(results, "total_draft_tokens")), int(final_value(results, "total_accepted_draft_tokens"))
    assert drafted >= len(CHOICES) and 0 <= accepted <= drafted  # every verify step drafted the tree's nodes
