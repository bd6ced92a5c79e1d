"""Fused dense layers (pipeline/reference/fused_layers.py): a draft's float32 layers as one C++ call.

They must compute what the eager layers compute (the same logits within float32 rounding, the same KV written, so
later steps agree too), on Llama and on Qwen2's biased qkv, and a DraftModelProposer running them must propose the
eager draft's tokens. Forwards the row attention kernel does not take (a prefill) keep the eager path.
"""

import pytest
import torch

from pipeline.reference import cpp_ops, fused_layers, row_attention
from pipeline.reference.draft_model import DraftModelProposer
from pipeline.reference.model import LlamaModel, SequenceInput
from pipeline.reference.proposers import ProposalInput
from tests.test_model import qwen2_dir  # noqa: F401 - a fixture

pytestmark = pytest.mark.skipif(row_attention.kernel() is None or not cpp_ops.loaded(fused_layers.BUILD),
                                reason="the row attention or dense layers kernel does not run on this CPU")


def pair_of_models(path):
    """(eager model, fused model) of one checkpoint, each with its own KV cache."""
    eager, fused = LlamaModel.from_hf(path), LlamaModel.from_hf(path)
    caches = eager.new_kv_cache(8, 16), fused.new_kv_cache(8, 16)
    fused.fused_layers = fused_layers.build(fused)
    assert fused.fused_layers is not None
    return (eager, caches[0]), (fused, caches[1])


def run_steps(model, kv, prompt):
    """Prefill the prompt, then a 3-token chain and a 1-token step: the logits of every row of the last two."""
    model([SequenceInput(prompt, 0, list(range(8)))], kv)
    n = len(prompt)
    chain = model([SequenceInput([5, 9, 13], n, list(range(8)), logits_rows=[0, 1, 2])], kv).logits  # [3, vocab]
    step = model([SequenceInput([21], n + 3, list(range(8)))], kv).logits  # [1, vocab]: reads the chain's KV
    return torch.cat([chain, step])


@pytest.mark.parametrize("checkpoint", ["tiny_llama", "qwen2_dir"])
def test_fused_layers_compute_the_eager_layers(checkpoint, request):
    (eager, eager_kv), (fused, fused_kv) = pair_of_models(request.getfixturevalue(checkpoint))
    prompt = list(range(3, 40))  # 37 tokens: a prefill past the decode rows, on the eager path in both
    a, b = run_steps(eager, eager_kv, prompt), run_steps(fused, fused_kv, prompt)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert b.argmax(-1).tolist() == a.argmax(-1).tolist()
    torch.testing.assert_close(fused_kv.k[:, :41], eager_kv.k[:, :41], rtol=1e-5, atol=1e-5)  # 37 + 3 + 1 slots, as written
    torch.testing.assert_close(fused_kv.v[:, :41], eager_kv.v[:, :41], rtol=1e-5, atol=1e-5)


def test_a_prefill_keeps_the_eager_layers(tiny_llama):
    (eager, eager_kv), (fused, fused_kv) = pair_of_models(tiny_llama)
    prompt = list(range(3, 40))
    seq = SequenceInput(prompt, 0, list(range(8)), logits_rows=list(range(len(prompt))))
    assert torch.equal(fused([seq], fused_kv).logits, eager([seq], eager_kv).logits)  # bit for bit: no fused call


def test_the_draft_proposer_runs_fused_layers_and_proposes_the_eager_tokens(tiny_llama, monkeypatch):
    def propose(env):
        monkeypatch.setenv(fused_layers.ENV, env)
        proposer = DraftModelProposer(LlamaModel.from_hf(tiny_llama), max_batch_size=2, max_seq_len=128)
        inputs = [ProposalInput("a", list(range(3, 30)), 5), ProposalInput("b", list(range(40, 52)), 3)]
        first = proposer.propose(inputs)
        inputs[0].token_ids += first[0].token_ids[:2] + [7]  # two accepted, then a correction
        return proposer.model.fused_layers, [d.token_ids for d in first + proposer.propose(inputs[:1])]

    fused, fused_tokens = propose("1")
    eager, eager_tokens = propose("0")
    assert fused is not None and eager is None
    assert fused_tokens == eager_tokens and [len(t) for t in fused_tokens] == [5, 3, 5]


def test_models_it_cannot_run_stay_eager(tiny_llama):
    model = LlamaModel.from_hf(tiny_llama, dtype="bfloat16")
    assert "float32" in fused_layers.eligible(model)
    assert fused_layers.build(model) is None


def test_an_int8_kv_cache_keeps_the_eager_layers(tiny_llama):
    (eager, _), (fused, _) = pair_of_models(tiny_llama)
    caches = [m.new_kv_cache(8, 16, "INT8") for m in (eager, fused)]
    a, b = (run_steps(m, kv, list(range(3, 40))) for m, kv in zip((eager, fused), caches))
    assert torch.equal(b, a)


def test_the_op_names_a_wrong_weight_count(tiny_llama):
    model = LlamaModel.from_hf(tiny_llama)
    kv = model.new_kv_cache(4, 16)
    layers = fused_layers.FusedDenseLayers(model)
    layers.weights = layers.weights[:-1]
    model.fused_layers = layers
    with pytest.raises(RuntimeError, match="7 weights per layer"):
        model([SequenceInput([3], 0, [0])], kv)
