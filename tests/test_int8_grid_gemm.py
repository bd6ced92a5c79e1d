"""The project's int8 GEMMs (pipeline/reference/int8_grid_gemm.py) return fbgemm's bits where fbgemm is exact.

Int8PerToken switches to them wherever one runs, so each must give exactly what fbgemm's fixed-grid linear gives
on a VNNI CPU, for every row count and shape (padding to the packed group and columns included), and a row's result
must not depend on the other rows. Each kernel runs where its CPU features are (the AVX2 one on AVX-512 CPUs too);
the others skip. fbgemm itself is exact only with VNNI: on AVX2 its uint8 x int8 pair sums saturate in 16 bits, so
there the comparisons with fbgemm use weights within [-64, 64] (no pair can reach 2^15), and the whole int8 range
is checked against exact integer sums.
"""

import pytest
import torch

from pipeline.reference import cpp_ops, int8_grid_gemm
from pipeline.reference.int8_grid_gemm import AVX2, VNNI
from pipeline.reference.linear import GRID_STEP, GRID_ZERO_POINT, Int8PerToken, fbgemm_prepack, scale_rows

# (kernel, amx_min_rows): AVX2 register blocks, AVX512-VNNI register blocks (AMX never: 0), AMX tiles (from one row)
KERNELS = pytest.mark.parametrize("isa, amx_min_rows", [
    pytest.param(AVX2, 0, marks=pytest.mark.skipif(not AVX2.cpu_supported(), reason="no AVX2 on this CPU")),
    pytest.param(VNNI, 0, marks=pytest.mark.skipif(not VNNI.cpu_supported(), reason="no AVX512-VNNI on this CPU")),
    pytest.param(VNNI, 1, marks=pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="no AMX on this CPU")),
], ids=["avx2", "vnni", "amx"])
# fbgemm's sums are exact over the whole int8 range with VNNI, within [-64, 64] without
FBGEMM_EXACT_LIMIT = 128 if torch.cpu._is_vnni_supported() else 64
needs_a_kernel = pytest.mark.skipif(not AVX2.cpu_supported(), reason="every project kernel needs at least AVX2")


def fbgemm_grid_gemm(x_unit: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fbgemm's fixed-grid linear: the reference the kernels must equal bit for bit (where its sums are exact)."""
    packed = fbgemm_prepack(q, scale)
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x_unit, GRID_STEP, GRID_ZERO_POINT, packed)


def exact_grid_gemm(x_unit: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fbgemm's grid rounding and epilogue around exact int64 sums: what fbgemm returns on a VNNI CPU.

    The grid values are fbgemm's own (its linear over an identity weight, exact since |w| <= 1)."""
    k = x_unit.shape[1]
    centred = torch.round(fbgemm_grid_gemm(x_unit, torch.eye(k, dtype=torch.int8), torch.ones(k)) / GRID_STEP).long()
    sums = centred @ q.long().T  # = sum of grid value x weight - zero point x column sum
    return sums.to(torch.int32).float() * (torch.tensor(GRID_STEP, dtype=torch.float32) * scale.float())


def packed(q: torch.Tensor, scale: torch.Tensor, isa: cpp_ops.Build, amx_min_rows: int) -> int8_grid_gemm.PackedInt8:
    """The kernel over q on the given path."""
    kernel = int8_grid_gemm.PackedInt8(q, scale, GRID_STEP, GRID_ZERO_POINT, isa=isa)
    kernel.amx_min_rows = amx_min_rows
    return kernel


def random_weight(out_features: int, in_features: int, seed: int, limit: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 weights within [-limit, limit) (the whole int8 range, -128 included, by default) and per-channel scales."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-limit, limit, (out_features, in_features), dtype=torch.int8, generator=g)
    return q, torch.rand(out_features, generator=g) * 0.02 + 1e-4


@needs_a_kernel
def test_int8_per_token_runs_on_the_best_kernel_this_cpu_has():
    assert int8_grid_gemm.kernel() is (VNNI if VNNI.cpu_supported() else AVX2)
    q, scale = random_weight(96, 64, seed=0)
    assert Int8PerToken(q, scale).kernel.isa is int8_grid_gemm.kernel()
    assert Int8PerToken(q, scale, project_kernel=False).kernel is None


@KERNELS
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (70, 30), (17, 5), (64, 4), (1, 1)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 17, 40])
def test_kernel_equals_fbgemm_bit_for_bit(shape, rows, isa, amx_min_rows):
    q, scale = random_weight(*shape, seed=shape[0] + shape[1], limit=FBGEMM_EXACT_LIMIT)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    x_unit, _ = scale_rows(x)
    assert torch.equal(packed(q, scale, isa, amx_min_rows)(x_unit), fbgemm_grid_gemm(x_unit, q, scale))


@KERNELS
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (70, 30)])
@pytest.mark.parametrize("rows", [1, 6, 13])
def test_sums_are_exact_over_the_whole_int8_range(shape, rows, isa, amx_min_rows):
    """Grid values of 254 (and 0) times weights of 127 (and -128): pairs past 2^15, where fbgemm's AVX2 path saturates."""
    q, scale = random_weight(*shape, seed=shape[0] * 7 + shape[1])
    q[:, :8] = torch.tensor([127, 127, -128, -128, 127, -128, 127, 127], dtype=torch.int8)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows + 1))
    x[:, :8] = torch.tensor([5.0, 5.0, 5.0, 5.0, -5.0, -5.0, -5.0, 5.0])  # the row's extremes: grid values 254 and 0
    x_unit, _ = scale_rows(x)
    assert torch.equal(packed(q, scale, isa, amx_min_rows)(x_unit), exact_grid_gemm(x_unit, q, scale))


@KERNELS
@pytest.mark.parametrize("in_features", [64, 13])  # 13: the last 5 columns are fbgemm's scalar tail
def test_kernel_rounds_near_ties_and_the_range_ends_as_fbgemm_does(in_features, isa, amx_min_rows):
    """Values halfway between grid points and their float neighbours (fbgemm rounds x * (1 / step) + 127 with
    one fma: -0.5450981 is a tie there, -0.0980392 one only after a separate add), -1 and 1, and past the range."""
    q, scale = random_weight(128, in_features, seed=7, limit=FBGEMM_EXACT_LIMIT)
    halfway = (torch.arange(-128, 128, dtype=torch.float32) + 0.5) * GRID_STEP
    near = torch.cat([halfway, torch.nextafter(halfway, halfway + 1), torch.nextafter(halfway, halfway - 1),
                      torch.tensor([-0.545098066329956, -0.09803919494152069, -1.0, 1.0, -1.5, 1.5])])
    rows = -(-near.numel() // in_features)
    x_unit = torch.cat([near, torch.zeros(rows * in_features - near.numel())]).view(rows, in_features)
    x_unit = torch.cat([x_unit, x_unit.roll(1, dims=1)])  # every value in the tail columns too
    assert torch.equal(packed(q, scale, isa, amx_min_rows)(x_unit), fbgemm_grid_gemm(x_unit, q, scale))


@needs_a_kernel
def test_a_row_alone_equals_the_same_row_in_any_call():
    """Whichever path a call's row count takes (register blocks of up to 6 rows, AMX from AMX_MIN_ROWS where present)."""
    q, scale = random_weight(200, 96, seed=3)
    kernel = Int8PerToken(q, scale)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(9))
    batched = kernel(x)
    for start, stop in ((0, 1), (5, 6), (3, 9), (12, 20), (0, 7), (0, 17), (21, 24)):
        assert torch.equal(kernel(x[start:stop]), batched[start:stop])


@KERNELS
def test_the_kernel_names_a_bad_input(isa, amx_min_rows):
    q, scale = random_weight(64, 32, seed=1)
    kernel = packed(q, scale, isa, amx_min_rows)
    with pytest.raises(RuntimeError, match="x has 40 columns, the weight 32"):
        kernel(torch.zeros(2, 40))
    with pytest.raises(RuntimeError, match="x must be float32"):
        kernel(torch.zeros(2, 32, dtype=torch.float64))


def gemm_into(kernel: int8_grid_gemm.PackedInt8, x_unit: torch.Tensor, out: torch.Tensor,
              tickets: torch.Tensor) -> None:
    """The kernel's `_into` op as one thread of a fused forward's team calls it (csrc/fused_layers.cpp): the channel
    groups left in phase 0 of `tickets` (csrc/shared_items.h: [next, finished, count]) written into out."""
    args = (x_unit, kernel.packed, kernel.offset, kernel.multiplier, kernel.in_features, kernel.step, kernel.zero_point)
    if kernel.isa is VNNI:
        torch.ops.specdeploy.int8_grid_gemm_into(*args, kernel.amx_min_rows, out, tickets, 0)
    else:
        torch.ops.specdeploy.int8_grid_gemm_avx2_into(*args, out, tickets, 0)


@KERNELS
def test_a_team_thread_computes_the_groups_left_with_the_calls_bits(isa, amx_min_rows):
    """A caller takes the output channel groups that the team's other threads have not taken (here: the first `taken`
    of them, as the counter says), computes them with the call's bits and counts them finished; a caller that finds
    none left writes nothing."""
    q, scale = random_weight(200, 96, seed=5)  # 4 groups of 64 channels on VNNI, 25 of 8 on AVX2
    kernel = packed(q, scale, isa, amx_min_rows)
    x_unit = torch.rand(7, 96, generator=torch.Generator().manual_seed(2)) * 2 - 1
    want = kernel(x_unit)
    width = kernel.packed.shape[2]  # channels per group
    groups = kernel.packed.shape[0]
    for taken in range(groups + 1):
        out, tickets = torch.full_like(want, float("nan")), torch.zeros(1, 8, dtype=torch.long)
        tickets[0, 0] = taken
        gemm_into(kernel, x_unit, out, tickets)
        assert out[:, :taken * width].isnan().all()  # the groups another thread took
        assert torch.equal(out[:, taken * width:], want[:, taken * width:])
        assert tickets[0, 1].item() == groups - taken and tickets[0, 2].item() == groups  # finished, count
        again = torch.full_like(want, float("nan"))
        gemm_into(kernel, x_unit, again, tickets)
        assert again.isnan().all() and tickets[0, 1].item() == groups - taken
    with pytest.raises(RuntimeError, match="tickets must be contiguous int64"):
        gemm_into(kernel, x_unit, torch.empty_like(want), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="out must be contiguous float32"):
        gemm_into(kernel, x_unit, torch.empty(7, 199), torch.zeros(1, 8, dtype=torch.long))


@KERNELS
@pytest.mark.parametrize("rows", [24, 41])
def test_a_team_thread_of_a_call_of_many_rows_computes_the_row_chunks_left_with_the_calls_bits(rows, isa,
                                                                                             amx_min_rows):
    """From 24 rows (csrc/shared_items.h, `splits_rows`; not where AMX tiles run) the team splits a call's rows, not
    its channels: a caller takes the chunks of 12 rows that the other threads have not taken, every channel of them,
    rounding only those rows, with the bits of the whole call."""
    q, scale = random_weight(200, 96, seed=6)
    kernel = packed(q, scale, isa, amx_min_rows)
    x_unit = torch.rand(rows, 96, generator=torch.Generator().manual_seed(3)) * 2 - 1
    want = kernel(x_unit)
    chunks = -(-rows // 12)
    if amx_min_rows:  # AMX tiles keep the channel split
        out, tickets = torch.full_like(want, float("nan")), torch.zeros(1, 8, dtype=torch.long)
        gemm_into(kernel, x_unit, out, tickets)
        assert torch.equal(out, want) and tickets[0, 2].item() == kernel.packed.shape[0]
        return
    for taken in range(chunks + 1):
        out, tickets = torch.full_like(want, float("nan")), torch.zeros(1, 8, dtype=torch.long)
        tickets[0, 0] = taken  # one thread's call: its range is every chunk
        gemm_into(kernel, x_unit, out, tickets)
        assert out[:taken * 12].isnan().all()  # the rows another thread took
        assert torch.equal(out[taken * 12:], want[taken * 12:])
        assert tickets[0, 1].item() == chunks - taken and tickets[0, 2].item() == chunks  # finished, count
