"""Int8PerToken's GEMM as the project's own kernel (csrc/int8_grid_gemm.cpp) where the CPU has AVX512-VNNI.

It returns fbgemm's results bit for bit (the same grid rounding, exact int32 sums, the same epilogue;
tests/test_int8_grid_gemm.py) but reads the weights once per call whatever the row count, so a verify's
rows cost about what one row does. Over SmolLM2's 120 layer matrices (one thread, cold cache): one row
9.1-9.8 ms against fbgemm's 13.3-13.9, six rows 10.3 against 22.0, 24 rows 12.7 against 28.5
(docs/benchmarks.md). Calls of AMX_MIN_ROWS rows or more run on AMX tiles where the CPU has AMX
(flat up to 16 rows); fewer rows, or CPUs without AMX, on AVX512-VNNI register blocks.

The source is compiled once per machine (pipeline.reference.cpp_ops). On CPUs without AVX512-VNNI, or where
it cannot be built, `kernel()` is None and Int8PerToken stays on fbgemm.
"""

from __future__ import annotations

import functools

import torch

from pipeline.reference import cpp_ops

ENV = "REFERENCE_INT8_KERNEL"  # "0": Int8PerToken stays on fbgemm even where this kernel can run
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mamx-tile", "-mamx-int8"]
# Calls of this many rows or more run on AMX tiles (where the CPU has AMX). Over SmolLM2's layer matrices, AMX /
# VNNI took 1.04 / 1.05 for 1 / 2 rows, 0.91-0.93 for 4-6, 0.70-0.83 for 8-24 on a quiet host (2026-12-02 08:03),
# but 1.21 / 1.15 / 0.99 / 0.73 for 4 / 6 / 8 / 16 rows on one whose memory answered slowly (19:25, AMX with its
# prefetch): VNNI's loads keep more of the memory's latency hidden. Up to 7 rows VNNI loses at most 7%, AMX up to 21%.
AMX_MIN_ROWS = 8


def cpu_has_vnni() -> bool:
    """Whether this CPU has AVX512-VNNI, which the kernel needs (torch's detector)."""
    return torch.cpu._is_vnni_supported()


def switched_on() -> bool:
    """Whether the environment allows the kernel (REFERENCE_INT8_KERNEL is not "0")."""
    return cpp_ops.switched_on(ENV)


@functools.cache
def amx_min_rows() -> int:
    """The row count from which calls run on AMX tiles: AMX_MIN_ROWS where the CPU has AMX, else 0 (never)."""
    return AMX_MIN_ROWS if torch.cpu._is_amx_tile_supported() else 0


@functools.cache
def kernel():
    """`torch.ops.specdeploy` with `int8_pack` and `int8_grid_gemm` built and loaded, or None where they
    cannot run here (no AVX512-VNNI, REFERENCE_INT8_KERNEL=0, or the build failed: logged once)."""
    return cpp_ops.load("int8_grid_gemm", ENV, cpu_has_vnni, FLAGS, "int8_sq GEMMs run on fbgemm (no AVX512-VNNI)")


class PackedInt8:
    """One int8 weight [out, in] with per-channel scales, packed for `torch.ops.specdeploy.int8_grid_gemm`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, step: float, zero_point: int):
        ext = kernel()
        self.packed = ext.int8_pack(q.contiguous())  # int8 [ceil(out/64), ceil(in/64) * 16, 64, 4]
        self.offset = (zero_point * q.int().sum(dim=1)).to(torch.int32)  # [out]: zero point x column sums
        self.multiplier = (torch.tensor(step, dtype=torch.float32) * scale.float()).contiguous()  # [out]
        self.in_features, self.step, self.zero_point, self.amx_min_rows = q.shape[1], step, zero_point, amx_min_rows()

    def __call__(self, x_unit: torch.Tensor) -> torch.Tensor:
        """x_unit [T, in] float32 in [-1, 1] -> [T, out] float32, unscaled by the row scale."""
        return torch.ops.specdeploy.int8_grid_gemm(x_unit, self.packed, self.offset, self.multiplier, self.in_features,
                                                   self.step, self.zero_point, self.amx_min_rows)
