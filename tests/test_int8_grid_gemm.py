"""The project's AVX512-VNNI int8 GEMM (pipeline/reference/int8_grid_gemm.py) returns fbgemm's bits.

Int8PerToken switches to it wherever it runs, so it must give exactly what fbgemm's fixed-grid linear
gives, for every row count and shape (padding to 64 channels and 4 columns included), and a row's
result must not depend on the other rows. Where the CPU has no AVX512-VNNI the kernel is not built
and these tests skip (Int8PerToken stays on fbgemm, which tests/test_int8_kernels.py covers).
"""

import pytest
import torch

from pipeline.reference import int8_grid_gemm
from pipeline.reference.linear import GRID_STEP, GRID_ZERO_POINT, Int8PerToken, fbgemm_prepack, scale_rows

needs_kernel = pytest.mark.skipif(not int8_grid_gemm.cpu_has_vnni(), reason="the kernel needs AVX512-VNNI")
# the kernel's two paths: AVX512-VNNI register blocks (AMX never: 0) and AMX tiles (from one row: 1)
paths = pytest.mark.parametrize("amx_min_rows", [0, pytest.param(1, marks=pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(), reason="no AMX on this CPU"))], ids=["vnni", "amx"])


def fbgemm_grid_gemm(x_unit: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fbgemm's fixed-grid linear: the reference the kernel must equal bit for bit."""
    packed = fbgemm_prepack(q, scale)
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x_unit, GRID_STEP, GRID_ZERO_POINT, packed)


def packed(q: torch.Tensor, scale: torch.Tensor, amx_min_rows: int) -> int8_grid_gemm.PackedInt8:
    """The kernel over q on the given path."""
    kernel = int8_grid_gemm.PackedInt8(q, scale, GRID_STEP, GRID_ZERO_POINT)
    kernel.amx_min_rows = amx_min_rows
    return kernel


def random_weight(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 weights over the whole int8 range (-128 included) and per-channel scales."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=g)
    return q, torch.rand(out_features, generator=g) * 0.02 + 1e-4


@needs_kernel
def test_the_kernel_builds_where_the_cpu_has_vnni():
    assert int8_grid_gemm.kernel() is not None
    q, scale = random_weight(96, 64, seed=0)
    assert Int8PerToken(q, scale).vnni is not None
    assert Int8PerToken(q, scale, vnni=False).vnni is None


@needs_kernel
@paths
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (70, 30), (17, 5), (64, 4), (1, 1)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 17, 40])
def test_kernel_equals_fbgemm_bit_for_bit(shape, rows, amx_min_rows):
    q, scale = random_weight(*shape, seed=shape[0] + shape[1])
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    x_unit, _ = scale_rows(x)
    assert torch.equal(packed(q, scale, amx_min_rows)(x_unit), fbgemm_grid_gemm(x_unit, q, scale))


@needs_kernel
@paths
@pytest.mark.parametrize("in_features", [64, 13])  # 13: the last 5 columns are fbgemm's scalar tail
def test_kernel_rounds_near_ties_and_the_range_ends_as_fbgemm_does(in_features, amx_min_rows):
    """Values halfway between grid points and their float neighbours (fbgemm rounds x * (1 / step) + 127 with
    one fma: -0.5450981 is a tie there, -0.0980392 one only after a separate add), -1 and 1, and past the range."""
    q, scale = random_weight(128, in_features, seed=7)
    halfway = (torch.arange(-128, 128, dtype=torch.float32) + 0.5) * GRID_STEP
    near = torch.cat([halfway, torch.nextafter(halfway, halfway + 1), torch.nextafter(halfway, halfway - 1),
                      torch.tensor([-0.545098066329956, -0.09803919494152069, -1.0, 1.0, -1.5, 1.5])])
    rows = -(-near.numel() // in_features)
    x_unit = torch.cat([near, torch.zeros(rows * in_features - near.numel())]).view(rows, in_features)
    x_unit = torch.cat([x_unit, x_unit.roll(1, dims=1)])  # every value in the tail columns too
    assert torch.equal(packed(q, scale, amx_min_rows)(x_unit), fbgemm_grid_gemm(x_unit, q, scale))


@needs_kernel
def test_a_row_alone_equals_the_same_row_in_any_call():
    """Whichever path a call's row count takes (VNNI below AMX_MIN_ROWS, AMX from it where present)."""
    q, scale = random_weight(200, 96, seed=3)
    kernel = Int8PerToken(q, scale)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(9))
    batched = kernel(x)
    for start, stop in ((0, 1), (5, 6), (3, 9), (12, 20), (0, 7), (0, 17), (21, 24)):
        assert torch.equal(kernel(x[start:stop]), batched[start:stop])


@needs_kernel
def test_the_kernel_names_a_bad_input():
    q, scale = random_weight(64, 32, seed=1)
    kernel = int8_grid_gemm.PackedInt8(q, scale, GRID_STEP, GRID_ZERO_POINT)
    with pytest.raises(RuntimeError, match="x has 40 columns, the weight 32"):
        kernel(torch.zeros(2, 40))
    with pytest.raises(RuntimeError, match="x must be float32"):
        kernel(torch.zeros(2, 32, dtype=torch.float64))
