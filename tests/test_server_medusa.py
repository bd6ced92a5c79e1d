"""A Medusa spec served by a real Triton server: the reference tensorrt_llm model builds the engine's
Medusa proposer from its `medusa_choices` parameter and speculates inside the target engine.

The heads are random (near-zero acceptance); greedy output must still equal plain greedy decoding.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer, LlamaForCausalLM

from pipeline.fixtures.models import make_random_medusa
from tests.test_server_triton import final_value, joined_text, prompts, stream_requests, text_request
from tests.triton_fixtures import serving, write_spec

MAX_TOKENS = 16
CHOICES = [[0], [0, 0], [1], [0, 1], [0, 0, 0]]


@pytest.fixture(scope="module")
def medusa_server(tmp_path_factory, derived_pair):
    """ONE server on a tiny target with random Medusa heads (repository assembled by the real pipeline)."""
    from specbuild.toolchains.reference import run_reference
    from pipeline.spec import load_spec

    folder = tmp_path_factory.mktemp("medusa-spec")
    target = Path(derived_pair[0])
    heads = make_random_medusa(target, folder / "medusa", num_heads=3, dtype="float32")
    spec = load_spec(write_spec(folder, target, target, models={"target": {"checkpoint": str(target), "dtype": "float32"}},
                                speculative={"mode": "medusa", "max_draft_len": 8, "num_draft_tokens": 5,
                                             "medusa": {"checkpoint": str(heads), "choices": CHOICES}}))
    with serving(run_reference(spec)) as (server, _repo):
        yield server, target


def _greedy(target: Path, prompt_ids: list[int]) -> list[int]:
    """Plain HF greedy continuation of the target (stops before eos)."""
    tok = AutoTokenizer.from_pretrained(target)
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    new = out[0, len(prompt_ids):].tolist()
    return new[:new.index(tok.eos_token_id)] if tok.eos_token_id in new else new


def check_in_engine_speculation(server, target: Path) -> tuple[int, int]:
    """Greedy text through the ensemble and greedy ids from the target engine (which drafts with the heads stored
    in it) both equal plain HF greedy decoding; returns the engine's (drafted, accepted) counters."""
    tok = AutoTokenizer.from_pretrained(target)
    prompt = prompts(1)[0]
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    expected = _greedy(target, prompt_ids)

    # Through the ensemble: plain text in, the target's greedy text out.
    [results] = stream_requests(server.grpc_url, "ensemble", [text_request(prompt, MAX_TOKENS)])
    assert joined_text(results) == tok.decode(expected, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # The target engine itself: it drafted with its heads and reports the acceptance per request.
    [results] = stream_requests(server.grpc_url, "tensorrt_llm", [{
        "input_ids": np.array([prompt_ids], dtype=np.int32),
        "input_lengths": np.array([[len(prompt_ids)]], dtype=np.int32),
        "request_output_len": np.array([[MAX_TOKENS]], dtype=np.int32),
        "end_id": np.array([[tok.eos_token_id]], dtype=np.int32),
        "return_perf_metrics": np.array([[True]], dtype=bool),
        "exclude_input_in_output": np.array([[True]], dtype=bool)}])
    [ids] = [r.as_numpy("output_ids") for r in results if r.as_numpy("output_ids") is not None]
    assert ids.reshape(-1).tolist() == expected
    drafted, accepted = int(final_value(results, "total_draft_tokens")), int(final_value(results, "total_accepted_draft_tokens"))
    assert 0 <= accepted <= drafted
    return drafted, accepted


def test_medusa_engine_speculates_and_matches_greedy(medusa_server):
    drafted, _accepted = check_in_engine_speculation(*medusa_server)
    assert drafted > 0
