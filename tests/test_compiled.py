"""Compiled layers (pipeline/reference/compiled.py): int8_sq engines with the ops between GEMMs fused by inductor.

The suite runs engines eager (conftest sets REFERENCE_COMPILED_LAYERS=0); these tests turn compiled layers
on explicitly and check that they keep the engine's guarantees: the same greedy tokens as the eager layers,
every row's result independent of the rest of the batch (bit for bit), and so speculative greedy output
equal to plain greedy output at batch 1 and with 8 requests in flight.
"""

import logging

import pytest
import torch

from pipeline.reference import compiled
from pipeline.reference.engine import LLMEngine
from pipeline.reference.model import LlamaModel, SequenceInput
from pipeline.reference.proposers import NgramProposer
from tests.test_int8_kernels import int8_engines  # noqa: F401 - the module's engine builds, a fixture
from tests.test_speculative import drive, prompts


def generate(engine_dir, requests, compiled_layers: bool, proposer=None, stagger=False):
    """({request_id: tokens}, the engine's model) from a fresh engine with batch-invariant math."""
    engine = LLMEngine.from_engine_dir(engine_dir, proposer=proposer, batch_invariant=True, max_batch_size=8,
                                       max_seq_len=256, max_input_len=128, max_draft_len=6,
                                       compiled_layers=compiled_layers)
    return drive(engine, requests, stagger)[0], engine.model


@pytest.fixture(scope="module")
def plain(int8_engines):  # noqa: F811 - the imported fixture
    """{"eager" | "compiled": {request_id: plain greedy tokens}} of the int8_sq engine, each request alone."""
    out = {}
    for mode in ("eager", "compiled"):
        out[mode] = {}
        for i, p in enumerate(prompts()):
            tokens, model = generate(int8_engines["int8_sq"], [(i, p)], compiled_layers=mode == "compiled")
            # exact mode runs every forward on the fused layers (fused_layers.py), so the engine compiles no regions
            assert (model.fused_layers is not None) == (mode == "compiled") and model.compiled_layers is None
            out[mode].update(tokens)
    return out


def test_compiled_layers_give_the_eager_greedy_tokens(plain):
    assert plain["compiled"] == plain["eager"]


def test_compiled_speculative_greedy_equals_compiled_plain_greedy(int8_engines, plain):  # noqa: F811
    cases = list(enumerate(prompts()))
    alone, _ = generate(int8_engines["int8_sq"], cases[:1], True, NgramProposer(1, 3))
    assert alone["r0"] == plain["compiled"]["r0"]
    batched, _ = generate(int8_engines["int8_sq"], cases, True, NgramProposer(1, 3), stagger=True)  # 8 in flight
    assert batched == plain["compiled"]


def assert_rows_do_not_depend_on_the_batch(model):
    """A forward's rows give the same logits bit for bit alone as together, and beside another sequence's rows."""
    kv = model.new_kv_cache(4, 32)
    ids = prompts(1)[0] * 4  # 16 + tokens
    model([SequenceInput(ids[:10], 0, [0, 1])], kv)
    many = model([SequenceInput(ids[10:16], 10, [0, 1], logits_rows=list(range(6)))], kv).logits  # [6, vocab]
    for r in range(6):  # row r alone, after the same prefix (its KV rewritten with the same values)
        alone = model([SequenceInput(ids[10:11 + r], 10, [0, 1], logits_rows=[r])], kv).logits
        assert torch.equal(alone, many[r:r + 1])
    # a second sequence of 9 rows in the same forward (15 rows in all) changes nothing either, nor one of 30 (36 rows:
    # the fused int8 layers' GEMMs split rows, not channels, from 24; csrc/shared_items.h)
    for other in (9, 30):
        pair = model([SequenceInput(ids[10:16], 10, [0, 1], logits_rows=list(range(6))),
                      SequenceInput((ids * 2)[:other], 0, [2, 3])], kv).logits
        assert torch.equal(pair[:6], many)


def test_compiled_rows_do_not_depend_on_the_batch(int8_engines):  # noqa: F811
    model = LlamaModel.from_engine_dir(int8_engines["int8_sq"], batch_invariant=True)
    model.compiled_layers = compiled.CompiledLayers(model)
    assert_rows_do_not_depend_on_the_batch(model)


def test_regions_call_inductors_code_directly_with_the_artifacts_results():
    """Each region is inductor's generated code called without the artifact's wrappers (`_direct`: with torch's
    internals changed it would fall back to the artifact, and this fails), and gives the artifact's results."""
    from torch._inductor.standalone_compile import CompiledArtifact

    def region(x, w):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-5) * 2, x.abs().amax(dim=-1, keepdim=True)

    artifact = compiled._artifact(region, torch.rand(2, 64), torch.rand(64))
    direct = compiled._direct(artifact)
    assert isinstance(artifact, CompiledArtifact) and not isinstance(direct, CompiledArtifact)
    for rows in (1, 3):
        x, w = torch.randn(rows, 64), torch.randn(64)
        got, want = direct(x, w), artifact(x, w)
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[0].shape == (rows, 64)


def test_compiled_layers_capture_the_eager_hidden_states(int8_engines):  # noqa: F811
    model = LlamaModel.from_engine_dir(int8_engines["int8_sq"])
    kv = model.new_kv_cache(2, 32)
    seq = SequenceInput(prompts(1)[0], 0, [0, 1], logits_rows=[0, 3])
    eager = model([seq], kv, return_hidden=True, capture_layers=(0, model.num_layers - 1))
    model.compiled_layers = compiled.CompiledLayers(model)
    fused = model([seq], kv, return_hidden=True, capture_layers=(0, model.num_layers - 1))
    assert fused.hidden_states.shape == eager.hidden_states.shape
    torch.testing.assert_close(fused.hidden_states, eager.hidden_states, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fused.logits, eager.logits, rtol=1e-3, atol=1e-3)


def test_engines_that_cannot_compile_run_eager_and_say_why(int8_engines, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, logger=compiled.__name__)
    engine = LLMEngine.from_engine_dir(int8_engines["int8_wo"], compiled_layers=True)
    assert engine.model.compiled_layers is None
    assert [r.getMessage() for r in caplog.records] == [
        "compiled layers off, running eager: its linears are not int8_sq (Int8PerToken)"]
    with pytest.raises(ValueError, match="not int8_sq"):
        compiled.CompiledLayers(engine.model)
