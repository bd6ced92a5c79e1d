"""The project's fp16-weight GEMM (pipeline/reference/fp16_weight_gemm.py): batch-invariant and float32-accurate.

Float16Weights runs on it wherever the CPU has AVX2 (the output layer of int8 engines without AMX, float16 engines'
layers). A row's logits must not depend on the other rows of the call, or greedy speculation would not equal plain
decoding: fbgemm's fp16 GEMM, which it replaces, fails that on an AVX2 host for the output layer's shape.
"""

import pytest
import torch

from pipeline.reference import fp16_weight_gemm
from pipeline.reference.linear import Float16Weights

needs_kernel = pytest.mark.skipif(not torch.cpu._is_avx2_supported(), reason="the kernel needs AVX2")


def weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05


@needs_kernel
@pytest.mark.parametrize("shape", [(49152, 576), (576, 1536), (43, 30), (8, 1), (1, 7)])  # padding: 43 = 5 x 8 + 3
def test_a_row_gets_the_same_bits_in_any_call(shape):
    kernel = Float16Weights(weight(*shape, seed=shape[0]))
    assert kernel.kernel is not None and kernel.batch_invariant
    x = torch.randn(15, shape[1], generator=torch.Generator().manual_seed(1))
    batched = kernel(x)
    for start, stop in ((0, 1), (4, 5), (0, 2), (1, 4), (2, 8), (3, 9), (0, 7), (6, 15)):
        assert torch.equal(kernel(x[start:stop]), batched[start:stop])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 6, 13])
def test_results_are_float32_sums_of_the_fp16_weights(rows):
    w = weight(300, 576, seed=2)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ w.half().double().T
    got = fp16_weight_gemm.PackedFloat16(w)(x)
    # 576 float32 fma roundings at most: |error| <= 576 x 2^-24 x sum |x w|
    bound = 576 * 2**-24 * (x.double().abs() @ w.half().double().abs().T)
    assert got.shape == (rows, 300) and bool(((got.double() - exact).abs() <= bound).all())


@needs_kernel
def test_with_fbgemm_the_layer_is_not_declared_batch_invariant():
    """REFERENCE_FP16_KERNEL=0 or project_kernel=False: fbgemm, whose rows the model then runs one at a time."""
    fallback = Float16Weights(weight(64, 32, seed=3), project_kernel=False)
    assert fallback.kernel is None and not fallback.batch_invariant
    x = torch.randn(3, 32)
    torch.testing.assert_close(fallback(x), Float16Weights(weight(64, 32, seed=3))(x), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_the_kernel_names_a_bad_input():
    kernel = fp16_weight_gemm.PackedFloat16(weight(16, 32, seed=4))
    with pytest.raises(RuntimeError, match="x has 40 columns, the weight 32"):
        kernel(torch.zeros(2, 40))
    with pytest.raises(RuntimeError, match="x must be float32"):
        kernel(torch.zeros(2, 32, dtype=torch.float64))
