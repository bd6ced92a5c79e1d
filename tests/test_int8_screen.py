"""The int8 screen of the output layer (pipeline/reference/int8_screen.py): argmax-only rows read int8 weights, and
every token that could be a row's top gets the exact layer's logit, so greedy decoding picks what the exact layer
(Float16Weights on the fp16 kernel, or ScreenedOutputLayer where the screen's AVX-512 build runs) picks, bit for bit,
whatever else is in the call."""

import pytest
import torch

from pipeline.reference import int8_screen
from pipeline.reference.linear import Float16Weights, ScreenedOutputLayer, argmax_output_layer, screen_gemm

# the exact layers the screen serves: Float16Weights wherever AVX2 runs, ScreenedOutputLayer with AVX-512 VNNI and a
# bf16 GEMM
EXACT_LAYERS = [pytest.param("fp16", marks=pytest.mark.skipif(not torch.cpu._is_avx2_supported(),
                                                              reason="the screen needs AVX2")),
                pytest.param("screened", marks=pytest.mark.skipif(
                    not torch.cpu._is_vnni_supported() or screen_gemm() is None,
                    reason="ScreenedOutputLayer's exact logits need the screen's AVX-512 VNNI build and a bf16 GEMM"))]
needs_kernel = pytest.mark.parametrize("kind", EXACT_LAYERS)


def layers(w: torch.Tensor, kind: str = "fp16") -> tuple[Float16Weights | ScreenedOutputLayer, int8_screen.Int8Screen]:
    exact = Float16Weights(w) if kind == "fp16" else ScreenedOutputLayer(w)
    screen = argmax_output_layer(exact)
    assert isinstance(screen, int8_screen.Int8Screen)
    return exact, screen


def check_screened(out: torch.Tensor, exact: torch.Tensor) -> None:
    """The screened rows' argmax is the exact one; every logit that differs lies strictly below the row's top."""
    assert torch.equal(out.argmax(dim=1), exact.argmax(dim=1))
    top = exact.amax(dim=1, keepdim=True)
    differs = out != exact
    assert bool((exact[differs] < top.expand_as(exact)[differs]).all())
    assert bool((out[differs] < top.expand_as(out)[differs]).all())


@needs_kernel
@pytest.mark.parametrize("vocab, width", [(3000, 64), (49152, 576), (517, 30)])  # 517, 30: padded groups and inputs
def test_the_screen_picks_the_exact_argmax_and_keeps_the_top_exact(kind, vocab, width):
    g = torch.Generator().manual_seed(vocab)
    w = torch.randn(vocab, width, generator=g) * 0.1
    exact_layer, screen = layers(w, kind)
    x = torch.randn(24, width, generator=g) * 3
    out, exact = screen(x), exact_layer(x)
    check_screened(out, exact)
    assert bool((out != exact).any())  # away from the top the logits are int8's: the screen did not just recompute


@needs_kernel
def test_near_ties_and_equal_tokens_resolve_as_the_exact_layer_does(kind):
    """Tokens whose weights differ below int8's resolution (their int8 logits tie, exact ones do not), and two tokens
    with the same weights (an exact tie: the first index wins, as torch.argmax picks it)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(4000, 64, generator=g) * 0.2
    w[3900:3912] = w[3900] + torch.randn(12, 64, generator=g) * 1e-4
    x = torch.randn(200, 64, generator=g) * 4
    x[:100] = w[3900] * 30 + torch.randn(100, 64, generator=g) * 4  # rows whose top is among the near ties
    top = int(layers(w, kind)[0](x[:1]).argmax())
    w[3950] = w[top]  # a later token with the top's weights: row 0's top is an exact tie
    exact_layer, screen = layers(w, kind)
    out, exact = screen(x), exact_layer(x)
    check_screened(out, exact)
    assert int(out[0].argmax()) == top and exact[0, top] == exact[0, 3950]
    tops = exact[:100].argmax(dim=1)
    assert bool(((tops >= 3900) & (tops < 3912)).all()) and len(set(tops.tolist())) > 1  # near ties take turns
    assert bool(((out[:100] == exact[:100]).sum(dim=1) >= 12).all())  # every near tie recomputed


@needs_kernel
def test_a_row_gets_the_same_logits_in_any_call(kind):
    w = torch.randn(2000, 96, generator=torch.Generator().manual_seed(6)) * 0.1
    _exact, screen = layers(w, kind)
    x = torch.randn(25, 96, generator=torch.Generator().manual_seed(7)) * 3
    batched = screen(x)  # register blocks of 8, 8 and 9 rows (AVX-512 build) or 5 of 5 (AVX2)
    for start, stop in ((0, 1), (4, 5), (0, 6), (2, 9), (6, 13), (0, 12), (13, 25)):
        assert torch.equal(screen(x[start:stop]), batched[start:stop])


@needs_kernel
def test_non_finite_and_zero_rows_are_computed_exactly(kind):
    w = torch.randn(700, 32, generator=torch.Generator().manual_seed(8)) * 0.1
    exact_layer, screen = layers(w, kind)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(9))
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3] = 0.0
    out, exact = screen(x), exact_layer(x)
    for r in (1, 2, 3):
        assert torch.equal(out[r].nan_to_num(), exact[r].nan_to_num())
        assert torch.equal(out[r].isnan(), exact[r].isnan())
    assert torch.equal(out.argmax(dim=1), exact.argmax(dim=1))


@pytest.mark.skipif(not torch.cpu._is_avx2_supported(), reason="the screen needs AVX2")
def test_the_grid_keeps_every_int32_sum_exact():
    for inputs in (64, 576, 4096, 16384):
        levels = int8_screen.grid_levels(inputs)
        assert 0 < levels <= 32767 and inputs * levels * 127 < 2**31
    assert int8_screen.grid_levels(576) > 16384  # SmolLM2's width keeps 15 bits a side


@needs_kernel
def test_the_screen_reads_half_the_bytes_and_names_a_bad_input(kind):
    w = torch.randn(256, 64)
    exact_layer, screen = layers(w, kind)
    assert screen.nbytes == exact_layer.nbytes // 2
    with pytest.raises(RuntimeError, match="x must be float32"):
        torch.ops.specdeploy.int8_screen(torch.zeros(2, 64, dtype=torch.float64), screen.packed, screen.scales,
                                         screen.zeros, screen.a, screen.b, screen.exact_weights, screen.levels)
    wrong = (r"exact must be .* contiguous float16 \[256, 64\]" if int8_screen.screens_bf16_layer()
             else r"this build \(AVX2\) takes exact weights from fp16_weight_gemm.pack only")
    with pytest.raises(RuntimeError, match=wrong):
        torch.ops.specdeploy.int8_screen(torch.zeros(2, 64), screen.packed, screen.scales, screen.zeros, screen.a,
                                         screen.b, w.half()[:, :32], screen.levels)
    with pytest.raises(RuntimeError, match="packed must come from int8_grid_gemm.pack for 80 inputs"):
        screen(torch.zeros(2, 80))


def test_layers_without_the_fp16_kernel_get_no_screen():
    """fbgemm's fp16 layer (no packed fp16 weights to recompute from) and a biased layer keep their rows exact."""
    assert argmax_output_layer(Float16Weights(torch.randn(64, 32), project_kernel=False)) is None
    assert argmax_output_layer(Float16Weights(torch.randn(64, 32), torch.randn(64))) is None
