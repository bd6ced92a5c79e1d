"""Int8PerToken's GEMM as the project's own kernels: csrc/int8_grid_gemm.cpp where the CPU has AVX512-VNNI,
csrc/int8_grid_gemm_avx2.cpp where it has AVX2 only (AMD Zen3, for one).

Both return the same bits: fbgemm's results on a VNNI CPU (the same grid rounding, exact int32 sums, the same
epilogue; tests/test_int8_grid_gemm.py), and both read the weights once per call whatever the row count, so a
verify's rows cost about what one row does. On VNNI, over SmolLM2's 120 layer matrices (one thread, cold cache):
one row 9.1-9.8 ms against fbgemm's 13.3-13.9, six rows 10.3 against 22.0 (docs/benchmarks.md); calls of
AMX_MIN_ROWS rows or more run on AMX tiles where the CPU has AMX. On AVX2, fbgemm's own path is not even exact
(its 16-bit pair sums saturate); the project's kernel widens both sides to 16 bits and sums pairs in 32.

Each build also registers an `_into` op (`int8_grid_gemm_into`, `int8_grid_gemm_avx2_into`): the same GEMM written
into a given output by the threads of a fused forward's team, each taking channel groups from shared counters
(csrc/shared_items.h; pipeline/reference/fused_layers.py calls it by name).

Each source is compiled once per machine (pipeline.reference.cpp_ops). Where neither can run, or
REFERENCE_INT8_KERNEL=0, `kernel()` is None and Int8PerToken stays on fbgemm.
"""

from __future__ import annotations

import functools
import torch

from pipeline.reference import cpp_ops

ENV = "REFERENCE_INT8_KERNEL"  # "0": Int8PerToken stays on fbgemm even where a kernel can run
# Calls of this many rows or more run on AMX tiles (where the CPU has AMX). Over SmolLM2's layer matrices, AMX /
# VNNI took 1.04 / 1.05 for 1 / 2 rows, 0.91-0.93 for 4-6, 0.70-0.83 for 8-24 on a quiet host (2026-12-02 08:03),
# but 1.21 / 1.15 / 0.99 / 0.73 for 4 / 6 / 8 / 16 rows on one whose memory answered slowly (19:25, AMX with its
# prefetch): VNNI's loads keep more of the memory's latency hidden. Up to 7 rows VNNI loses at most 7%, AMX up to 21%.
AMX_MIN_ROWS = 8


VNNI = cpp_ops.Build("int8_grid_gemm", "int8_grid_gemm", ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                                                         "-mamx-tile", "-mamx-int8"), torch.cpu._is_vnni_supported)
AVX2 = cpp_ops.Build("int8_grid_gemm_avx2", "int8_grid_gemm_avx2", ("-O3", "-mavx2", "-mfma"), torch.cpu._is_avx2_supported)
# each build's packed weight layout: (output channels per group, columns rounded up to); VNNI's: whole AMX tiles
PACKING = {VNNI: (64, 64), AVX2: (8, 4)}


def switched_on() -> bool:
    """Whether the environment allows the kernel (REFERENCE_INT8_KERNEL is not "0")."""
    return cpp_ops.switched_on(ENV)


@functools.cache
def amx_min_rows() -> int:
    """The row count from which VNNI calls run on AMX tiles: AMX_MIN_ROWS where the CPU has AMX, else 0 (never)."""
    return AMX_MIN_ROWS if torch.cpu._is_amx_tile_supported() else 0


@functools.cache
def kernel() -> cpp_ops.Build | None:
    """The build Int8PerToken runs here: VNNI where the CPU has it, else AVX2; None where neither runs
    (REFERENCE_INT8_KERNEL=0, no AVX2, or the build failed: logged once)."""
    return cpp_ops.first_build((VNNI, AVX2), ENV, "int8_sq GEMMs run on fbgemm")


def pack(q: torch.Tensor, group: int, k_align: int) -> torch.Tensor:
    """int8 [N, K] -> [ceil(N / group), Kp / 4, group, 4] with Kp = K rounded up to k_align, zero-padded: each
    (group, k quad) one stretch of group x 4 bytes, a group's k quads one after the other."""
    n, k = q.shape
    n_pad, k_pad = -(-n // group) * group, -(-k // k_align) * k_align
    padded = torch.nn.functional.pad(q, (0, k_pad - k, 0, n_pad - n))
    return padded.view(n_pad // group, group, k_pad // 4, 4).permute(0, 2, 1, 3).contiguous()


class PackedInt8:
    """One int8 weight [out, in] with per-channel scales, packed for one of the kernels (default: `kernel()`)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, step: float, zero_point: int,
                 isa: cpp_ops.Build | None = None):
        self.isa = isa or kernel()
        if self.isa is None or not (self.isa.cpu_supported() and cpp_ops.loaded(self.isa)):
            raise RuntimeError("PackedInt8: no int8 kernel runs on this CPU (Int8PerToken falls back to fbgemm)")
        self.packed = pack(q, *PACKING[self.isa])
        self.offset = (zero_point * q.int().sum(dim=1)).to(torch.int32)  # [out]: zero point x column sums
        self.multiplier = (torch.tensor(step, dtype=torch.float32) * scale.float()).contiguous()  # [out]
        self.in_features, self.step, self.zero_point = q.shape[1], step, zero_point
        self.amx_min_rows = amx_min_rows() if self.isa is VNNI else 0

    def __call__(self, x_unit: torch.Tensor) -> torch.Tensor:
        """x_unit [T, in] float32 in [-1, 1] -> [T, out] float32, unscaled by the row scale."""
        if self.isa is VNNI:
            return torch.ops.specdeploy.int8_grid_gemm(x_unit, self.packed, self.offset, self.multiplier,
                                                       self.in_features, self.step, self.zero_point, self.amx_min_rows)
        return torch.ops.specdeploy.int8_grid_gemm_avx2(x_unit, self.packed, self.offset, self.multiplier,
                                                        self.in_features, self.step, self.zero_point)
