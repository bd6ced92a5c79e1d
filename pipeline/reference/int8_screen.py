"""The output layer for rows that only need their argmax, as the project's own kernel (csrc/int8_screen.cpp) where the
CPU has AVX2, FMA and F16C: int8 weights give every logit approximately, with a rigorous bound per token, and every
token that could be the row's top gets its exact logit from the fp16 weights, bit for bit what the exact layer computes:
Float16Weights on the fp16 kernel, or (AVX-512 builds) ScreenedOutputLayer, whose bf16 GEMM reads twice the bytes. So
the row's argmax is the exact layer's, for half the bytes read.

Only rows whose logits serve nothing but their argmax may take it (greedy requests without penalties, bans or returned
logits: `SequenceInput.argmax_only`); every other row keeps the exact layer, so sampled tokens, log-probs and returned
logits are unchanged. On SmolLM2's [49152, 576] output layer (2 threads, from memory): on AMD Zen3, 1.3 against 2.0 ms
(Float16Weights) at one row, 2.8 against 3.8 ms at six; on AMD Zen4 (the AVX-512 build), 0.8-0.9 against 1.3-1.7 ms
(ScreenedOutputLayer) at one row, 1.1 against 1.4-1.8 at six, 1.4-1.5 against 1.7-2.0 at eight (docs/benchmarks.md).
Where the kernel cannot run, or REFERENCE_INT8_SCREEN=0, `kernel()` is None and every row keeps the exact layer.
"""

from __future__ import annotations

import functools

import torch

from pipeline.reference import cpp_ops, fp16_weight_gemm, int8_grid_gemm

ENV = "REFERENCE_INT8_SCREEN"  # "0": argmax-only rows take the exact output layer too
AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c")
# the same source with AVX-512: its exact logits can also be ScreenedOutputLayer's (csrc/exact_logit.h), VNNI's
# vpdpwssd does vpmaddwd's and vpaddd's work in one instruction (6 rows 1.08 against 1.29 ms on Zen4, the same sums),
# and its 32 registers hold blocks of 12 rows (8 rows 1.43-1.62 against 1.80-2.21 ms in blocks of 6)
AVX512 = cpp_ops.Build("int8_screen_avx512", "int8_screen", (*AVX2_FLAGS, "-mavx512f", "-mavx512vl", "-mavx512vnni"),
                       torch.cpu._is_vnni_supported)
AVX2 = cpp_ops.Build("int8_screen", "int8_screen", AVX2_FLAGS, torch.cpu._is_avx2_supported)
INT32_LIMIT = 2**31 - 1
INT8_MAX = 127
FP32_UNIT_ROUNDOFF = 2**-24


def additions_error(n: int) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of n float32 additions in any order (u = 2^-24)."""
    return n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF)


def switched_on() -> bool:
    """Whether the environment allows the screen (REFERENCE_INT8_SCREEN is not "0")."""
    return cpp_ops.switched_on(ENV)


@functools.cache
def kernel() -> cpp_ops.Build | None:
    """The build Int8Screen runs here, or None where it cannot run (no AVX2, REFERENCE_INT8_SCREEN=0, or the build
    failed: logged once)."""
    return cpp_ops.first_build((AVX512, AVX2), ENV, "argmax-only rows take the exact output layer")


def screens_bf16_layer() -> bool:
    """Whether the build here recomputes ScreenedOutputLayer's exact logits (the AVX-512 build)."""
    return kernel() == AVX512


def grid_levels(padded_inputs: int) -> int:
    """The 16-bit input grid's steps a side: as many as int16 holds while every int32 sum of padded_inputs products
    (each at most levels * 127) stays exact."""
    return min(torch.iinfo(torch.int16).max, INT32_LIMIT // (INT8_MAX * padded_inputs))


class Int8Screen:
    """x [R, H] float32 -> logits [R, V] whose argmax is exactly that of the exact layer; the logits of the tokens that
    could be the top are exact_c bit for bit, the others approximate (csrc/int8_screen.cpp derives the bound). A row's
    result depends on nothing but the row: batch-invariant.

    exact: the exact layer's fp16 weights W16 [V, H], as Float16Weights' kernel packs them (a PackedFloat16: its fp16
    chains) or as ScreenedOutputLayer keeps them (a float16 tensor: its float64 sums; `screens_bf16_layer` builds).
    max_rows: calls of more rows cost more here than the exact layer (None: none do); the model sends those to it.
    """

    batch_invariant = True

    def __init__(self, exact: fp16_weight_gemm.PackedFloat16 | torch.Tensor, max_rows: int | None = None,
                 chunk: int = 4096):
        if kernel() is None:
            raise RuntimeError("Int8Screen: the int8 screen does not run on this CPU")
        if isinstance(exact, torch.Tensor):
            if not screens_bf16_layer():
                raise RuntimeError("Int8Screen: ScreenedOutputLayer's exact logits need the AVX-512 build")
            w16 = self.exact_weights = exact.half().contiguous()  # [V, H]
        else:
            self.exact_weights = exact.packed
            h = exact.packed.shape[1]
            w16 = exact.packed.view(torch.float16).transpose(1, 2).reshape(-1, h)[:exact.out_features]  # [V, H] copy
        self.max_rows = max_rows
        v, h = w16.shape
        q, scales, a, b = [], [], [], []
        gamma = additions_error(h)  # the fp16 chain's relative error (the float64 sums' is below it)
        for i in range(0, v, chunk):  # float64 per chunk: the whole layer would be 8x its fp16 bytes
            w = w16[i:i + chunk].double()
            s = (w.abs().amax(dim=1) / INT8_MAX).float().clamp_min(torch.finfo(torch.float32).tiny)  # [chunk]
            qi = torch.round(w / s.double()[:, None]).clamp(-INT8_MAX, INT8_MAX)
            approx = qi * s.double()[:, None]  # w^_c = q_c * s_c as the kernel scales it
            # rounded up to float32 (the kernel's slack covers the rest)
            a.append(((w - approx).norm(dim=1) + gamma * w.norm(dim=1)).float().nextafter(torch.tensor(float("inf"))))
            b.append(approx.norm(dim=1).float().nextafter(torch.tensor(float("inf"))))
            q.append(qi.to(torch.int8))
            scales.append(s)
        self.packed = int8_grid_gemm.pack(torch.cat(q), *int8_grid_gemm.PACKING[int8_grid_gemm.AVX2])
        self.scales, self.a, self.b = torch.cat(scales), torch.cat(a), torch.cat(b)
        self.zeros = torch.zeros(v, dtype=torch.int32)
        self.levels = grid_levels(self.packed.shape[1] * 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, H] -> [R, V] float32 logits, exact at each row's top."""
        return torch.ops.specdeploy.int8_screen(x.float(), self.packed, self.scales, self.zeros, self.a, self.b,
                                                self.exact_weights, self.levels)

    @property
    def nbytes(self) -> int:
        """Bytes one call reads (the int8 weights; the candidates' exact logits read a few fp16 rows more)."""
        return self.packed.numel()
