"""The thread count of decode steps and verifies (pipeline/reference/decode_threads.py): measured only where it
cannot change a bit, and then it does not.

The project's kernels compile with OpenMP (cpp_ops.OPENMP), so torch's thread count really splits their work;
a small forward of an int8_sq engine with compiled layers runs on those kernels alone and must give the same
bits on one thread and on two.
"""

import pytest
import torch

from pipeline.reference import compiled, decode_threads
from pipeline.reference.draft_model import DraftModelProposer
from pipeline.reference.engine import LLMEngine, Request
from pipeline.reference.linear import intra_op_threads
from pipeline.reference.model import LlamaModel, SequenceInput
from pipeline.reference.proposers import ProposalInput
from pipeline.serving.reference_adapter import load_serving_engine
from tests.test_int8_kernels import int8_engines  # noqa: F401 - the module's engine builds, a fixture
from tests.test_speculative import prompts


@pytest.fixture
def compiled_model(int8_engines):  # noqa: F811 - the imported fixture
    model = LlamaModel.from_engine_dir(int8_engines["int8_sq"])
    model.compiled_layers = compiled.CompiledLayers(model)
    return model


def test_more_threads_only_where_they_are_clearly_faster():
    assert decode_threads.faster({1: 1.0, 2: 0.90}) == 2
    assert decode_threads.faster({1: 1.0, 2: 0.97}) == 1  # within MIN_GAIN: the other core stays free
    assert decode_threads.faster({1: 1.0, 2: 1.30}) == 1
    assert decode_threads.faster({1: 1.0, 4: 0.70, 8: 0.80}) == 4


def test_kernel_forwards_give_the_same_bits_on_one_and_two_threads(compiled_model):
    model = compiled_model
    kv = model.new_kv_cache(4, 32)
    if not model.thread_count_invariant(kv):
        pytest.skip("the project's kernels do not all run on this CPU")
    ids = (prompts(1)[0] * 8)[:30]
    assert len(ids) == 30
    with intra_op_threads(2):
        model([SequenceInput(ids[:20], 0, [0, 1])], kv)
        logits = {}
        for threads in (1, 2):
            model.decode_threads = threads
            for rows in (1, 6):
                seq = SequenceInput(ids[20:20 + rows], 20, [0, 1], logits_rows=list(range(rows)))
                logits[threads, rows] = model([seq], kv).logits
    assert torch.equal(logits[1, 1], logits[2, 1]) and torch.equal(logits[1, 6], logits[2, 6])


def test_the_engine_measures_where_the_choice_is_free_and_keeps_it(compiled_model, monkeypatch):
    model = compiled_model
    monkeypatch.delenv(decode_threads.ENV, raising=False)
    with intra_op_threads(2):
        kv = model.new_kv_cache(8, 32)
        if not model.thread_count_invariant(kv):
            pytest.skip("the project's kernels do not all run on this CPU")
        chosen = decode_threads.choose(model, kv)
        assert chosen in (1, 2) and model.decode_threads == model.measured_decode_threads == chosen
        model.decode_threads = 7
        assert decode_threads.choose(model, kv) == chosen  # measured once per model
        model.measured_decode_threads = 7  # as if timed while other processes took a core
        assert decode_threads.choose(model, kv, again=True) in (1, 2)  # measured anew
        assert model.decode_threads == model.measured_decode_threads != 7
        monkeypatch.setenv(decode_threads.ENV, "1")  # forced: no measurement
        assert decode_threads.choose(model, kv) == 1 == model.decode_threads
        monkeypatch.setenv(decode_threads.ENV, "two")
        with pytest.raises(ValueError, match="REFERENCE_DECODE_THREADS='two'"):
            decode_threads.choose(model, kv)


def test_models_outside_the_kernels_keep_their_thread_count(int8_engines, monkeypatch):  # noqa: F811
    monkeypatch.delenv(decode_threads.ENV, raising=False)
    with intra_op_threads(2):
        engine = LLMEngine.from_engine_dir(int8_engines["int8_sq"], compiled_layers=False)  # eager layers
        assert not engine.model.thread_count_invariant(engine.kv)
        assert engine.model.decode_threads == 1 and engine.model.measured_decode_threads is None
        quantized_kv = engine.model.new_kv_cache(2, 32, "INT8")
        engine.model.compiled_layers = compiled.CompiledLayers(engine.model)
        assert not engine.model.thread_count_invariant(quantized_kv)  # SDPA over a dequantized cache


def test_a_cache_too_small_to_time_keeps_the_models_setting(compiled_model, monkeypatch):
    monkeypatch.delenv(decode_threads.ENV, raising=False)
    kv = compiled_model.new_kv_cache(1, 32)  # 32 slots: fewer than CONTEXT + VERIFY_ROWS
    with intra_op_threads(2):
        assert decode_threads.choose(compiled_model, kv) == 1 and compiled_model.measured_decode_threads is None


def test_a_draft_model_gets_the_faster_thread_count_where_a_target_would_not(tiny_llama, monkeypatch):
    """A dense float32 model is outside the kernels (its GEMMs of several rows may round differently on two threads):
    as a target it keeps one thread; as a draft (its tokens only proposals) the proposer measures it."""
    monkeypatch.delenv(decode_threads.ENV, raising=False)
    with intra_op_threads(2):
        model = LlamaModel.from_hf(tiny_llama)
        kv = model.new_kv_cache(8, 32)
        assert not model.thread_count_invariant(kv)
        assert decode_threads.choose(model, kv) == 1 and model.measured_decode_threads is None
        proposer = DraftModelProposer(model, max_batch_size=2, max_seq_len=128)
        assert model.measured_decode_threads in (1, 2) and model.decode_threads == model.measured_decode_threads
        assert proposer.propose([ProposalInput("r", prompts(1)[0], 3)])[0].token_ids  # drafts on that count


def test_a_served_engine_chooses_its_threads_again_before_its_first_step(int8_engines, monkeypatch):  # noqa: F811
    """At load the server's other model processes start beside the engine and take a core, so what it timed then
    says little; it times again before its first step, once, and reports the count."""
    monkeypatch.delenv(decode_threads.ENV, raising=False)
    with intra_op_threads(2):
        engine = load_serving_engine(int8_engines["int8_sq"])
        engine.model.compiled_layers = compiled.CompiledLayers(engine.model)  # as `compiled_model`: on the kernels
        if not engine.model.thread_count_invariant(engine.kv):
            pytest.skip("the project's kernels do not all run on this CPU")
        reported = []
        engine.on_decode_threads = reported.append
        engine.model.measured_decode_threads = engine.model.decode_threads = 7  # as if timed under others' load
        engine.add_request(Request("r", prompts(1)[0], 4))
        while engine.has_unfinished():
            engine.step()
        assert len(reported) == 1 and reported[0] in (1, 2)
        assert engine.model.decode_threads == engine.model.measured_decode_threads == reported[0]
