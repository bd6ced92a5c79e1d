"""Float16Weights' GEMM as the project's own kernel (csrc/fp16_weight_gemm.cpp) where the CPU has AVX2, F16C and FMA.

fp16 weights widened to float32 in registers, float32 fma chains over the input columns in order: a row's result
does not depend on the other rows or threads (batch-invariant), and the weights are read once per call whatever
the row count, where fbgemm's fp16 GEMM re-reads them per block of rows. Measured on SmolLM2's output layer
(docs/benchmarks.md). The source is compiled once per machine (pipeline.reference.cpp_ops); where it cannot run, or
REFERENCE_FP16_KERNEL=0, `kernel()` is None and Float16Weights stays on fbgemm.
"""

from __future__ import annotations

import functools

import torch

from pipeline.reference import cpp_ops

ENV = "REFERENCE_FP16_KERNEL"  # "0": Float16Weights stays on fbgemm even where this kernel can run
AVX2 = cpp_ops.Build("fp16_weight_gemm", "fp16_weight_gemm", ("-O3", "-mavx2", "-mfma", "-mf16c"),
                     torch.cpu._is_avx2_supported)  # every AVX2 CPU has F16C and FMA
GROUP = 8  # channels per packed group (one ymm of float32)


def switched_on() -> bool:
    """Whether the environment allows the kernel (REFERENCE_FP16_KERNEL is not "0")."""
    return cpp_ops.switched_on(ENV)


@functools.cache
def kernel() -> cpp_ops.Build | None:
    """The build Float16Weights runs here, or None where it cannot run (no AVX2, REFERENCE_FP16_KERNEL=0, or the
    build failed: logged once)."""
    return cpp_ops.first_build((AVX2,), ENV, "fp16-weight GEMMs run on fbgemm")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the fp16 bits as int16 [ceil(N / 8), K, 8]: each group of 8 channels one stream over k, zero-padded."""
    n, k = weight.shape
    n_pad = -(-n // GROUP) * GROUP
    padded = torch.nn.functional.pad(weight.half(), (0, 0, 0, n_pad - n))
    return padded.view(n_pad // GROUP, GROUP, k).transpose(1, 2).contiguous().view(torch.int16)


class PackedFloat16:
    """One fp16 weight [out, in], packed for `torch.ops.specdeploy.fp16_weight_gemm`."""

    def __init__(self, weight: torch.Tensor):
        if kernel() is None:
            raise RuntimeError("PackedFloat16: the fp16 kernel does not run on this CPU (Float16Weights uses fbgemm)")
        self.packed, self.out_features = pack(weight), weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] float32 -> [T, out] float32."""
        return torch.ops.specdeploy.fp16_weight_gemm(x, self.packed, self.out_features)
