"""ScreenedOutputLayer's approximate GEMM as the project's own kernel (csrc/bf16_weight_gemm.cpp) where the CPU has
AVX512-BF16 but no AMX (AMD Zen4, for one).

bf16 rows times bf16 weights, float32 sums in a fixed order per output (vdpbf16ps over the k pairs in order), float32
out: a row's result does not depend on the other rows or threads, and the weights are read once per call. oneDNN's
bf16 GEMM, the screened layer's GEMM on AMX, was slower than the fp16 kernel on such a CPU (docs/benchmarks.md).
The source is compiled once per machine (pipeline.reference.cpp_ops); where it cannot run, or
REFERENCE_BF16_KERNEL=0, `kernel()` is None and the output layer stays on Float16Weights.
"""

from __future__ import annotations

import functools

import torch

from pipeline.reference import cpp_ops

ENV = "REFERENCE_BF16_KERNEL"  # "0": no screened output layer on this kernel (Float16Weights runs)
AVX512_BF16 = cpp_ops.Build("bf16_weight_gemm", "bf16_weight_gemm",
                            ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
                            torch.cpu._is_avx512_bf16_supported)
GROUP = 64  # channels per packed group (4 zmm of float32)


@functools.cache
def kernel() -> cpp_ops.Build | None:
    """The build, or None where it cannot run (no AVX512-BF16, REFERENCE_BF16_KERNEL=0, or the build failed: logged
    once)."""
    return cpp_ops.first_build((AVX512_BF16,), ENV, "the output layer runs on Float16Weights")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> bf16 [ceil(N / 64), ceil(K / 2), 64, 2]: each group of 64 channels one stream of k pairs,
    zero-padded; the values are weight.bfloat16()'s (round to nearest even)."""
    n, k = weight.shape
    n_pad, k_pad = -(-n // GROUP) * GROUP, -(-k // 2) * 2
    padded = torch.nn.functional.pad(weight.bfloat16(), (0, k_pad - k, 0, n_pad - n))
    return padded.view(n_pad // GROUP, GROUP, k_pad // 2, 2).transpose(1, 2).contiguous()


class PackedBFloat16:
    """One weight [out, in] rounded to bf16, packed for `torch.ops.specdeploy.bf16_weight_gemm`."""

    def __init__(self, weight: torch.Tensor):
        if kernel() is None:
            raise RuntimeError("PackedBFloat16: the bf16 kernel does not run on this CPU")
        self.packed, self.out_features = pack(weight), weight.shape[0]

    def __call__(self, xb: torch.Tensor) -> torch.Tensor:
        """xb [T, in] bfloat16 -> [T, out] float32 (float32 sums of the bf16 products)."""
        return torch.ops.specdeploy.bf16_weight_gemm(xb, self.packed, self.out_features)
