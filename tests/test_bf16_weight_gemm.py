"""The AVX512-BF16 kernel behind ScreenedOutputLayer on CPUs without AMX (pipeline/reference/bf16_weight_gemm.py).

What the screened layer's bound assumes of it: each output is the float32 sum of exact bf16 products (within
float32 summation error of the float64 sum), a row's bits do not depend on the other rows or the thread count, and
shapes that do not fill a 64-channel group or a k pair are padded, not read past.
"""

import pytest
import torch

from pipeline.reference import bf16_weight_gemm
from pipeline.reference.linear import intra_op_threads

pytestmark = pytest.mark.skipif(bf16_weight_gemm.kernel() is None, reason="no AVX512-BF16 on this CPU")


@pytest.mark.parametrize("out_features, in_features", [(200, 64), (4096, 576), (130, 37)])
def test_sums_of_the_bf16_products_within_float32_rounding(out_features, in_features):
    g = torch.Generator().manual_seed(out_features)
    w = (torch.randn(out_features, in_features, generator=g) * 0.2).half()
    x = torch.randn(9, in_features, generator=g) * 4
    layer = bf16_weight_gemm.PackedBFloat16(w)
    out = layer(x.bfloat16())
    assert out.shape == (9, out_features) and out.dtype == torch.float32
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    exact = xb @ wb.T  # the bf16 products summed in float64
    gamma = in_features * 2**-24 / (1 - in_features * 2**-24)
    assert ((out.double() - exact).abs() <= gamma * (xb.abs() @ wb.abs().T) + 1e-30).all()
    assert not torch.equal(out, (x.bfloat16() @ w.bfloat16().T).float())  # not bf16 logits: float32 sums


def test_a_row_gets_the_same_bits_alone_in_any_call_and_on_any_thread_count():
    g = torch.Generator().manual_seed(3)
    layer = bf16_weight_gemm.PackedBFloat16(torch.randn(1000, 96, generator=g).half())
    x = torch.randn(40, 96, generator=g).bfloat16()
    with intra_op_threads(1):
        alone = torch.cat([layer(x[r:r + 1]) for r in range(len(x))])
    with intra_op_threads(2):
        for n in (2, 6, 7, 13, 40):  # one register block, one and a bit, several
            assert torch.equal(layer(x[:n]), alone[:n]), n


def test_inputs_it_cannot_take_are_refused_by_name():
    layer = bf16_weight_gemm.PackedBFloat16(torch.randn(64, 32).half())
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        layer(torch.randn(2, 32))
    with pytest.raises(RuntimeError, match="x has 30 columns"):
        layer(torch.randn(2, 30).bfloat16())


@pytest.mark.parametrize("vocab, in_features, near_ties", [(3000, 64, True), (4100, 576, False), (2100, 72, True)])
def test_the_screening_op_replaces_what_the_python_screening_replaces(vocab, in_features, near_ties, monkeypatch):
    """ScreenedOutputLayer screens on `screen_logits` where this kernel runs, else in torch ops: the same logits,
    bit for bit (the same candidates, exact logits summed in float64 and rounded once; 72 inputs: the op's exact sums
    take 16 at a time, then the rest one by one)."""
    from pipeline.reference.linear import ScreenedOutputLayer, screen_gemm

    g = torch.Generator().manual_seed(vocab)
    w = torch.randn(vocab, in_features, generator=g) * 0.2
    x = torch.randn(40, in_features, generator=g) * 4
    if near_ties:  # tokens whose bf16 logits tie near the top, past the last whole 256-token block
        w[vocab - 110:vocab - 98] = w[vocab - 110] + torch.randn(12, in_features, generator=g) * 1e-4
        x[:20] = w[vocab - 110] * 30 + torch.randn(20, in_features, generator=g) * 0.1
    layer = ScreenedOutputLayer(w, screen_gemm())
    approx = layer._gemm(x.bfloat16()).float()
    fused = layer(x)
    monkeypatch.setattr(bf16_weight_gemm, "kernel", lambda: None)  # the torch-op screening
    assert torch.equal(fused, layer(x))
    assert (fused != approx).sum(dim=1).min() >= 1  # every row had its top replaced by an exact logit
