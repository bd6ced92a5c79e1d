"""An EAGLE-3 spec served by a real Triton server: the reference tensorrt_llm model builds the engine's
EAGLE-3 proposer (heads stored in the engine, target layers from its config) and speculates inside the
target engine, as TensorRT-LLM's PyTorch backend does with `decoding_type: Eagle3`.

The heads are random (near-zero acceptance, reduced draft vocabulary with d2t): greedy output must still
equal plain greedy decoding, and the drafted tokens are counted in the response.
"""

from pathlib import Path

import pytest

from pipeline.fixtures.models import make_random_eagle3
from tests.test_server_medusa import check_in_engine_speculation
from tests.triton_fixtures import serving, write_spec

CHOICES = [[0], [1], [0, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def eagle3_server(tmp_path_factory, derived_pair):
    """ONE server on a tiny target with random EAGLE-3 heads (repository assembled by the real pipeline)."""
    from specbuild.toolchains.reference import run_reference
    from pipeline.spec import load_spec

    folder = tmp_path_factory.mktemp("eagle3-spec")
    target = Path(derived_pair[0])
    heads = make_random_eagle3(target, folder / "eagle3", dtype="float32", draft_vocab_size=256)
    spec = load_spec(write_spec(folder, target, target, models={"target": {"checkpoint": str(target), "dtype": "float32"}},
                                speculative={"mode": "eagle", "max_draft_len": 8, "num_draft_tokens": 4,
                                             "eagle": {"checkpoint": str(heads), "version": 3, "choices": CHOICES,
                                                       "layers_to_capture": [0, 1, 2]}}))
    with serving(run_reference(spec)) as (server, _repo):
        yield server, target


def test_eagle3_engine_speculates_and_matches_greedy(eagle3_server):
    drafted, _accepted = check_in_engine_speculation(*eagle3_server)
    assert drafted >= len(CHOICES)  # every verify step drafted the tree's nodes
