"""The reference model's linear-layer kernels on CPU, one per weight format, chosen by measurement.

`make bench-kernels` (pipeline/apps/bench_kernels.py) times the candidates on SmolLM2's shapes for 1-8
rows and checks which are batch-invariant; docs/engine.md has the numbers. Each kernel maps
x [T, in] (the model's compute dtype) to [T, out] in the same dtype and says whether a row's result
is bit-for-bit independent of the other rows (`batch_invariant`): the model then verifies K + 1
tokens in one call instead of row by row, and speculative output still equals plain output.

- DenseLinear: F.linear on the compute dtype (fp32 wide matrices in the transposed layout, see
  `wide_layout`); float32 calls of 2-16 rows on oneDNN's prepacked GEMM. Not batch-invariant:
  MKL's and oneDNN's fp32 GEMMs round differently for different row counts.
- Int8WeightOnly (W8A16, int8_wo): int8 per-channel weights, 16-bit activations as TensorRT-LLM's
  W8A16 computes them: the input is rounded to bfloat16 and torch's `_weight_int8pack_mm` multiplies
  it by the int8 weight, row by row over the input columns in a fixed order (batch-invariant).
- Int8PerToken (W8A8, int8_sq): per-token (per-row) dynamic 8-bit activations times int8 weights with
  int32 accumulation (the project's AVX512-VNNI or AVX2 kernel, else fbgemm), then the row scale
  times the channel scale. Integer sums are exact, so a row's result cannot depend on the rest of the batch.
- Float16Weights (float16 engines' layers; the output layer of 16-bit and quantized engines, as
  TensorRT-LLM keeps it in 16 bits, on CPUs without AMX): fp16 weights, fp32 activations and accumulation,
  on the project's AVX2 kernel (batch-invariant by construction), else fbgemm's fp16 GEMM.
- ScreenedOutputLayer (that output layer on CPUs with AMX): every logit from oneDNN's bf16 GEMM, whose
  cost hardly grows with the rows, and the logits near each row's top recomputed exactly, so that the
  greedy argmax is the exact one. `output_layer_16bit` picks between the two.
- Int8Screen (int8_screen.py; `argmax_output_layer`): where that layer is Float16Weights on the fp16 kernel, or
  ScreenedOutputLayer with AVX-512, the rows that need only their argmax (greedy requests) read an int8 copy, the
  tokens that could be the top recomputed as that layer computes them: the exact argmax for half the bytes.
"""

from __future__ import annotations

import functools
import os
import warnings
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from pipeline.reference import bf16_weight_gemm, cpp_ops, fp16_weight_gemm, int8_grid_gemm, int8_screen
from pipeline.reference.int8_grid_gemm import PackedInt8

INT8_MAX = 127.0
GRID_STEP, GRID_ZERO_POINT = 2 / 255, 127  # Int8PerToken's uint8 grid over [-1, 1]
_fixed_grid_linear = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
# float32 DenseLinear: calls of ONEDNN_ROWS rows (verifies, batched decode steps) run oneDNN's GEMM on weights
# packed for ONEDNN_ROW_HINT rows; one row and prefill-sized calls stay on MKL (closest to transformers' logits)
ONEDNN_ROWS, ONEDNN_ROW_HINT = range(2, 17), 6
# oneDNN's fp32 GEMM runs 2 rows slower than 3 (SmolLM2's 30 layers of qkv, o, gate_up and down on two threads:
# 20.5 ms at 2 rows, 14.9 at 3 and 14.1 at 6; 4.5 against 3.1 ms for its output layer): `onednn_linear` computes a
# 2-row call as 3 rows, the third zero
ONEDNN_PADDED_ROWS = 2
# float32 DenseLinear: a one-row call whose weight has at least this many bytes (past the 1 MB L2) runs MKL's GEMV on
# every thread, the output channels split between them (`dense_linear`, csrc/fused_layers.cpp): MKL runs one row on
# one thread, and a weight streamed from L3 or memory reads about twice as fast on two (docs/benchmarks.md)
ONE_ROW_SPLIT_BYTES = 1 << 20


def wide_layout(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight [out, in] with out > in as a view over [in, out] storage (else unchanged).

    F.linear on such a view runs x @ W^T as a row-major [in, out] GEMV, which reads memory about
    1.5-2x faster on these CPUs for wide outputs (lm_head, qkv, gate_up); narrow outputs (down)
    are faster in the usual layout, and bf16 / fp16 are 25x SLOWER in the transposed one.
    Measured with torch 2.13 on the 2-core development machines.
    """
    wide = weight.dtype == torch.float32 and weight.shape[0] > weight.shape[1]
    return weight.t().contiguous().t() if wide else weight


@functools.cache
def dense_linear_op():
    """`torch.ops.specdeploy.dense_linear` (one-row GEMVs on every thread, F.linear's bits on one thread) where the
    fused layers' library builds (csrc/fused_layers.cpp), else None."""
    from pipeline.reference import fused_layers  # it imports this module

    return torch.ops.specdeploy.dense_linear if cpp_ops.loaded(fused_layers.BUILD) else None


class DenseLinear:
    """x @ weight.T (+ bias) on the compute dtype; float32 calls of several rows on oneDNN's prepacked GEMM.

    One row (a decode step, and every row of exact mode's row-by-row calls) runs `F.linear` (MKL) on
    the wide layout, on every thread for a float32 weight of ONE_ROW_SPLIT_BYTES or more (`dense_linear`: one
    thread's bits, whatever the thread count); float32 calls of 2-16 rows (ONEDNN_ROWS: verifies, batched decode
    steps) run oneDNN's GEMM on weights packed once for ONEDNN_ROW_HINT rows: 2-2.7x faster than MKL for 4-16
    rows on SmolLM2's shapes, but slower for one row (`make bench-kernels`, docs/engine.md). Prefill
    stays on MKL: oneDNN's sums drift up to 3e-4 from transformers' logits over SmolLM2's 30 layers
    (MKL's stay within the 1e-4 tests/test_model.py asks).
    """

    batch_invariant = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = wide_layout(weight), bias  # [out, in]
        fp32 = weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_ROW_HINT) if fp32 else None
        self.split_one_row = weight.dtype == torch.float32 and tensor_bytes([weight]) >= ONE_ROW_SPLIT_BYTES

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.packed is not None and rows in ONEDNN_ROWS:
            return onednn_linear(x, self.packed, self.bias)
        if rows == 1 and x.dim() == 2 and self.split_one_row and (split := dense_linear_op()) is not None:
            return split(x, self.weight, self.bias, ONE_ROW_SPLIT_BYTES)
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        """Bytes one call reads."""
        return tensor_bytes([self.weight, self.bias])


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, in] @ W.T (+ bias) -> [R, out] by oneDNN's fp32 GEMM on W prepacked (`_reorder_linear_weight`); a call of
    ONEDNN_PADDED_ROWS rows runs with one more row of zeros, which oneDNN computes faster (the rows do not mix)."""
    if x.shape[0] == ONEDNN_PADDED_ROWS:
        padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
        return torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:ONEDNN_PADDED_ROWS]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class Int8WeightOnly:
    """W8A16: bf16-rounded input times int8 per-channel weights (`_weight_int8pack_mm`), then + bias."""

    batch_invariant = True

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 smoother: torch.Tensor | None = None):
        self.q = q.contiguous()  # int8 [out, in]
        self.scale = scale.to(torch.bfloat16)  # [out]
        self.bias = bias
        self.inv_smoother = None if smoother is None else (1.0 / smoother.float())  # [in]; x / s

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.inv_smoother is not None:
            x = x * self.inv_smoother.to(x.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scale).to(x.dtype)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        """Bytes one call reads."""
        return tensor_bytes([self.q, self.scale, self.bias, self.inv_smoother])


class Int8PerToken:
    """W8A8: per-row dynamic int8 activations x int8 per-channel weights, exact int32 sums (fbgemm).

    fbgemm's dynamic int8 linear (`quantized::linear_dynamic`, torch.ao's dynamic quantization)
    picks ONE activation range for the whole batch, so a row's rounding would depend on the other
    rows. Here every row is first divided by its own max |x| (s_i), so all values lie in [-1, 1], and
    fbgemm's static-input linear (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`) rounds
    them on one fixed 8-bit grid (step 2/255, zero point 127: the grid fbgemm's dynamic linear picks
    for the range [-1, 1]): every row is rounded relative to its own range, per token, the integer
    sums are exact, and the output row times s_i is the per-token W8A8 result whatever else is in
    the batch. (Before, a pinning row holding -1 and 1 was appended to the dynamic linear's input to
    force that range: the same results bit for bit, two more ops and a second row per call.)
    Measured 2-3x faster than `torch._int_mm` or oneDNN's qlinear on SmolLM2's shapes for 1-8 rows
    (`make bench-kernels`). On CPUs with AVX512-VNNI or AVX2 the GEMM runs on the project's own kernel
    (`int8_grid_gemm`): fbgemm's bits on a VNNI CPU, but the weights read once per call whatever the row
    count, so a verify's rows cost little more than one. fbgemm itself (REFERENCE_INT8_KERNEL=0, or
    `project_kernel=False`) is exact only with VNNI: on AVX2 its u8 x s8 pairs saturate in 16 bits
    (deterministic and per row: results stay batch-invariant, precision drops).
    """

    batch_invariant = True

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 smoother: torch.Tensor | None = None, project_kernel: bool = True):
        use_kernel = project_kernel and int8_grid_gemm.kernel() is not None  # False: fbgemm even where one runs
        self.kernel = PackedInt8(q, scale, GRID_STEP, GRID_ZERO_POINT) if use_kernel else None
        self.packed = None if self.kernel else fbgemm_prepack(q, scale)
        self.bias = bias
        self.inv_smoother = None if smoother is None else (1.0 / smoother.float())  # [in]; x / s
        self.weight_nbytes = q.numel() + scale.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.inv_smoother is not None:
            xf = xf * self.inv_smoother
        x_unit, row_scale = scale_rows(xf)
        y = (self.grid_gemm(x_unit) * row_scale).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def grid_gemm(self, x_unit: torch.Tensor) -> torch.Tensor:
        """The GEMM [T, out] float32 of rows already divided by their row scale (`scale_rows`), unscaled.

        The project's kernel where one runs (`int8_grid_gemm`), else fbgemm's: the same bits where fbgemm's
        sums are exact (VNNI).
        """
        if self.kernel is not None:
            return self.kernel(x_unit)
        return _fixed_grid_linear(x_unit, GRID_STEP, GRID_ZERO_POINT, self.packed)

    @property
    def nbytes(self) -> int:
        """Bytes one call reads."""
        return self.weight_nbytes + tensor_bytes([self.bias, self.inv_smoother])


class Float16Weights:
    """fp16 weights, fp32 activations and accumulation, output in x's dtype.

    On CPUs with AVX2 the project's kernel (`fp16_weight_gemm`): one fma chain per output over the input columns
    in order, the weights read once per call. Elsewhere (or `project_kernel=False`) fbgemm's prepacked fp16 GEMM,
    which re-reads the weights per block of rows, and on an AVX2 host (AMD Zen3, torch 2.13) gave a row different
    bits alone and in a call of 6 rows (docs/benchmarks.md): there only the project's kernel is batch-invariant.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, project_kernel: bool = True):
        use_kernel = project_kernel and fp16_weight_gemm.kernel() is not None
        self.kernel = fp16_weight_gemm.PackedFloat16(weight) if use_kernel else None
        self.packed = None if self.kernel else torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), None)
        self.batch_invariant = use_kernel  # fbgemm: the model runs such a layer one row at a time in exact mode
        self.bias = bias
        self.weight_nbytes = weight.numel() * 2  # fp16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            y = self.kernel(x.float()).to(x.dtype)
        else:
            y = torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed).to(x.dtype)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        """Bytes one call reads."""
        return self.weight_nbytes + tensor_bytes([self.bias])


class BFloat16Weights:
    """A draft's output layer on the project's bf16 kernel: x and W rounded to bf16, float32 sums (`bf16_weight_gemm`,
    CPUs with AVX512-BF16), float32 logits; each row's bits its own (batch-invariant).

    A draft's logits only choose proposals the target verifies (greedy drafts) or the q they are sampled from, which
    verification receives with them, so rounding changes which tokens it proposes, never what the target emits. The
    trained pair's 1-layer, 128-wide draft spent about 160 us of a 450 us four-token chain in its float32 output
    layer (4096 x 128, 2 MB read per draft token; docs/benchmarks.md); this one reads half the bytes.
    """

    batch_invariant = True

    def __init__(self, weight: torch.Tensor):
        self.kernel = bf16_weight_gemm.PackedBFloat16(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x.bfloat16())

    @property
    def nbytes(self) -> int:
        """Bytes one call reads."""
        return tensor_bytes([self.kernel.packed])


def draft_output_layer(head):
    """The output layer a draft runs over a bias-free float32 `DenseLinear` head: half the bytes where a kernel for them
    runs, `BFloat16Weights` where the bf16 kernel does (REFERENCE_BF16_KERNEL not 0), else `Float16Weights` on the
    project's fp16 kernel (AVX2 hosts such as AMD Zen3: the trained pair's 4096 x 128 head 77 -> 36 us a draft token,
    SmolLM2's 49152 x 576 8.7 -> 2.9 ms, one thread; docs/benchmarks.md); else `head` itself."""
    if not (isinstance(head, DenseLinear) and head.bias is None and head.weight.dtype == torch.float32):
        return head
    if bf16_weight_gemm.kernel() is not None:
        return BFloat16Weights(head.weight)
    if fp16_weight_gemm.kernel() is not None:
        return Float16Weights(head.weight)
    return head


# oneDNN's bf16 GEMM gives a row the same bits in calls of 1 to 32 rows, on 1 or 2 threads, whatever the packing
# hint (measured with torch 2.13 on AMX); from 33 rows on it blocks differently, so longer calls run in chunks
SCREEN_ROWS = 32
# The screened layer's bf16 GEMM runs on this many threads where the machine has the cores and the rows keep their
# bits there (checked where the layer is built), although the rest of a decode step runs on one: it is one large
# call (SmolLM2's [49152, 576], 56 MB), so a second thread pays for its wake-up. Measured on the default engine
# after 300 tokens: a step 20.4 -> 18.6-19.5 ms, a 6-token verify 27.2-28.4 -> 25.9-26.1 ms, logits unchanged.
# The int8 GEMMs gained nothing from a second thread (120 calls of 0.05-0.1 ms each: the wake-ups eat it).
OUTPUT_LAYER_THREADS = 2
# Argmax-only calls of up to this many rows run on the int8 screen rather than ScreenedOutputLayer (the same argmax):
# SmolLM2's output layer from memory on AMD Zen4, 2 threads, best of 40, three runs: 0.78-0.86 against 1.31-1.74 ms
# at one row, 1.09-1.15 against 1.35-1.79 at six, 1.43-1.46 against 1.74-2.01 at eight, 2.17-2.20 against 2.26-2.42
# at twelve, 2.86-3.06 against 2.86-2.93 at sixteen (the screen's GEMM grows with the rows, 12 at a time in its
# AVX-512 build; the bf16 kernel's hardly)
SCREEN_OVER_BF16_ROWS = 12


class ScreenedOutputLayer:
    """The output layer x [R, H] @ W16^T with fp16 weights W16 [V, H]: bf16 logits, exact near each row's top.

    fbgemm's fp16 GEMM (Float16Weights) grows with the rows: 2.8 / 7.2 / 16.6 ms for 1 / 6 / 16 rows on
    SmolLM2's [49152, 576] (one thread, AMX machine), the part of a verify that grows most. A bf16 GEMM does
    twice the multiply-adds per instruction, but it rounds x and W to bf16. Two such GEMMs (`gemm`):
    "onednn", oneDNN's on AMX tiles (2.6-5 ms for 1 to 32 rows there), which also returns bf16 logits (8
    significant bits: ties in the greedy argmax); "kernel", the project's AVX512-BF16 kernel
    (`bf16_weight_gemm`, CPUs without AMX such as AMD Zen4), which returns the float32 sums. So per row x (all in
    float32 unless said):
      approx_c = bf16(bf16(x) . bf16(W16_c))        every token c, fp32 sums inside (no outer bf16: "kernel")
      exact_c  = fp32(x . W16_c summed in float64)  the products are exact in float64; rounded once
      |approx_c - exact_c| <= bound                 one bound per row, derived in `_bound`
    Every token whose approx lies within 2 * bound of the row's largest approx is a candidate, and its
    logit is replaced by exact_c. Any other token's exact logit lies below the best candidate's, so the
    returned row's argmax is the exact logits' argmax (greedy decoding picks what an exact output layer
    picks), the top of the distribution is exact and the rest is within bound (about 1 on SmolLM2's
    logits, typically 0.1). About 5 candidates per row (median; 20 at p90) on SmolLM2's answers.
    A row's result depends on nothing but the row: batch-invariant.
    """

    batch_invariant = True

    def __init__(self, weight: torch.Tensor, gemm: str | None = None):
        gemm = gemm or screen_gemm()  # default: the one this CPU runs
        if gemm not in ("onednn", "kernel"):
            raise ValueError(f"gemm {gemm!r}: write onednn or kernel (this CPU has neither AMX nor AVX512-BF16)")
        self.weight16 = weight.half().contiguous()  # [V, H]: the exact logits' weights, as Float16Weights reads them
        w16 = self.weight16.float()
        wb = w16.bfloat16()
        # the approximate GEMM: oneDNN's (weights packed for it; the row hint does not change the bits) or the kernel
        self.packed = torch.ops.mkldnn._reorder_linear_weight(wb, 6) if gemm == "onednn" else None
        self.kernel = bf16_weight_gemm.PackedBFloat16(self.weight16) if gemm == "kernel" else None
        self.output_rounding = 2**-8 if gemm == "onednn" else 0.0  # oneDNN rounds the logits to bf16
        wb = wb.float()
        self.max_norm = wb.norm(dim=1).max().item()  # max_c ||bf16(W16_c)||
        self.max_rounding_norm = (w16 - wb).norm(dim=1).max().item()  # max_c ||bf16(W16_c) - W16_c||
        self.gamma = int8_screen.additions_error(weight.shape[1])  # the relative error of H fp32 additions
        self.flushed = weight.shape[1] * 2**-125  # H products flushed to zero by vdpbf16ps, each below 2^-126
        self.threads = 1  # the bf16 GEMM's threads (output_layer_16bit raises it where the bits allow)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if x.shape[0] <= SCREEN_ROWS or self.kernel is not None:
            return self._screened(x)
        return torch.cat([self._screened(x[i:i + SCREEN_ROWS]) for i in range(0, x.shape[0], SCREEN_ROWS)])

    def _screened(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.bfloat16()
        with intra_op_threads(self.threads):
            logits = self._gemm(xb).float()  # [R, V] approx
        if bf16_weight_gemm.kernel() is not None:  # the screening below as one C++ call (bf16_weight_gemm.cpp)
            torch.ops.specdeploy.screen_logits(x.contiguous(), logits, self.weight16, self.max_norm,
                                               self.max_rounding_norm, self.gamma, self.flushed, self.output_rounding)
            return logits
        top = logits.amax(dim=1)  # [R]
        magnitude = torch.maximum(top.abs(), logits.amin(dim=1).abs())  # [R] max_c |approx_c|
        bound = self._bound(x, xb.float(), magnitude)  # [R]
        rows, cols = candidates(logits, (top - 2 * bound).unsqueeze(1))
        logits[rows, cols] = (self.weight16[cols].double() * x.double()[rows]).sum(dim=1).float()
        return logits

    def _bound(self, x: torch.Tensor, xb: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
        """[R] a bound on |approx_c - exact_c| over all tokens c, per row.

        approx_c - true_c = x . dW_c + dx . bf16(W16_c)  (dW, dx: the bf16 rounding of the weights and of x)
                          + the fp32 sums' error          (<= gamma * sum_i |xb_i W_ci|)
                          + oneDNN's bf16 rounding of the sum (<= 2^-8 |sum| <= 2^-8 / (1 - 2^-8) max_c |approx_c|)
                          + products flushed to zero (vdpbf16ps flushes denormals: < 2^-126 each, H of them)
        and exact_c - true_c <= 2^-24 |true_c| (rounded once). Cauchy-Schwarz bounds each dot product by
        the norms, the weights' norms by their maximum over c; the factors carry some slack.
        """
        norm, rounding_norm = x.norm(dim=1), (x - xb).norm(dim=1)  # ||xb|| <= norm + rounding_norm
        weights = (norm * self.max_rounding_norm + rounding_norm * self.max_norm
                   + self.gamma * (norm + rounding_norm) * self.max_norm)
        return weights * 1.01 + magnitude * (self.output_rounding * 1.01 + 2**-22) + self.flushed

    def _gemm(self, xb: torch.Tensor) -> torch.Tensor:
        """xb [R, H] bf16 -> the approximate logits [R, V]: bf16 from oneDNN, float32 from the kernel."""
        return bf16_gemm(xb, self.packed) if self.kernel is None else self.kernel(xb)

    def rows_invariant(self, threads: int = 1) -> bool:
        """Whether the bf16 GEMM on `threads` threads gives rows the same bits alone as in calls of up to
        SCREEN_ROWS rows, and as on one thread, here.

        oneDNN's: measured with torch 2.13 on one AMX machine, so checked again where the layer is built (about
        15 ms); the kernel's by construction (one fixed chain per output), checked the same way.
        """
        x = torch.randn(SCREEN_ROWS, self.weight16.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
        picked = (0, 5, SCREEN_ROWS - 1)
        with intra_op_threads(1):
            single = [self._gemm(x[r:r + 1]) for r in picked]
        with intra_op_threads(threads):
            full = self._gemm(x)
            six = self._gemm(x[:6])
            alone = single if threads == 1 else [self._gemm(x[r:r + 1]) for r in picked]
        rows = [full[r:r + 1] for r in picked]
        return torch.equal(six, full[:6]) and all(map(torch.equal, single + alone, rows + rows))

    @property
    def nbytes(self) -> int:
        """Bytes one call reads (the bf16 weights; the exact logits read a few rows more)."""
        return self.weight16.numel() * 2


def bf16_gemm(xb: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """xb [R, in] bf16 times weights packed by mkldnn's _reorder_linear_weight: [R, out] bf16, fp32 sums inside."""
    return torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], "")


def candidates(logits: torch.Tensor, threshold: torch.Tensor, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) where logits [R, V] (contiguous) >= threshold [R, 1]: few, found block by block.

    A comparison and nonzero over all R x V entries took about 60 us per row on 49152 logits; the
    maxima of 256-wide blocks take 6, and only the blocks whose maximum passes are searched.
    """
    num_rows, vocab = logits.shape
    whole = vocab // block
    blocks = logits.as_strided((num_rows, whole, block), (vocab, block, 1))  # [R, whole, block] view
    block_rows, block_ids = torch.nonzero(blocks.amax(dim=2) >= threshold, as_tuple=True)
    hit, offset = torch.nonzero(blocks[block_rows, block_ids] >= threshold[block_rows], as_tuple=True)
    rows, cols = block_rows[hit], block_ids[hit] * block + offset
    if vocab % block == 0:
        return rows, cols
    tail_rows, tail_cols = torch.nonzero(logits[:, whole * block:] >= threshold, as_tuple=True)
    return torch.cat([rows, tail_rows]), torch.cat([cols, tail_cols + whole * block])


def screen_gemm() -> str | None:
    """The bf16 GEMM ScreenedOutputLayer runs on here: "onednn" where the CPU has AMX, "kernel" where it has
    AVX512-BF16 (and the kernel builds), else None (no screened output layer)."""
    if torch.cpu._is_amx_tile_supported():
        return "onednn"
    return "kernel" if bf16_weight_gemm.kernel() is not None else None


def output_layer_16bit(weight: torch.Tensor):
    """The kernel for an output layer kept in 16 bits: ScreenedOutputLayer on oneDNN's bf16 GEMM with AMX, on the
    project's bf16 kernel with AVX512-BF16 (Zen4: the layer alone 0.4-0.6x the fp16 kernel's time at 1 to 40 rows
    with its weights in cache; in a SmolLM2 step about equal at one row, a 6-token verify 4-26% cheaper;
    docs/benchmarks.md), else Float16Weights.

    Where the screened layer's rows turn out not to be batch-invariant, Float16Weights too (with a warning). Its
    GEMM runs on OUTPUT_LAYER_THREADS threads where the machine has them and the bits stay.
    """
    gemm = screen_gemm()
    if gemm is None:
        return Float16Weights(weight)
    screened = ScreenedOutputLayer(weight, gemm)
    if not screened.rows_invariant():
        warnings.warn(f"the screened output layer's bf16 GEMM ({gemm}) is not batch-invariant on this host; "
                      "the output layer runs the fp16 GEMM")
        return Float16Weights(weight)
    if (os.cpu_count() or 1) >= OUTPUT_LAYER_THREADS and screened.rows_invariant(OUTPUT_LAYER_THREADS):
        screened.threads = OUTPUT_LAYER_THREADS
    return screened


def argmax_output_layer(exact, dtype: torch.dtype = torch.float32) -> int8_screen.Int8Screen | None:
    """The layer for an output layer's argmax-only rows (greedy decoding) of a float32 model: Int8Screen over `exact`'s
    fp16 weights where the screen runs here and `exact` is a Float16Weights on the fp16 kernel (AVX2: the same argmax,
    half the bytes) or a ScreenedOutputLayer (AVX-512: the same argmax for half its bf16 GEMM's bytes, up to
    SCREEN_OVER_BF16_ROWS rows a call), else None (those rows take `exact` too). A float16 model rounds its logits to
    fp16, whose ties could fall to a token the screen left approximate."""
    if dtype != torch.float32:
        return None
    if isinstance(exact, Float16Weights) and exact.kernel is not None and exact.bias is None and int8_screen.kernel():
        return int8_screen.Int8Screen(exact.kernel)
    # the screened layer's exact logits are csrc/exact_logit.h's where its screening runs in C++ (the bf16 kernel's
    # build); torch's float64 sums, its fallback, add in another order
    if (isinstance(exact, ScreenedOutputLayer) and bf16_weight_gemm.kernel() is not None
            and int8_screen.screens_bf16_layer()):
        return int8_screen.Int8Screen(exact.weight16, max_rows=SCREEN_OVER_BF16_ROWS)
    return None


def fbgemm_prepack(q: torch.Tensor, scale: torch.Tensor):
    """fbgemm's packed weight (a TorchScript object) for int8 q [out, in] with per-channel scales."""
    with warnings.catch_warnings():  # torch deprecates quantized tensor creation; fbgemm's prepack still takes one
        warnings.simplefilter("ignore")
        qweight = torch._make_per_channel_quantized_tensor(q.contiguous(), scale.double(),
                                                           torch.zeros(len(scale), dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qweight, None)


def scale_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] float32 divided by each row's max |x| (values in [-1, 1]), and that row scale [T, 1]."""
    row_scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    return x / row_scale, row_scale


@contextmanager
def intra_op_threads(threads: int | None):
    """Run the block on `threads` torch intra-op threads (None: unchanged), then restore the previous count."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tensor_bytes(tensors: list[torch.Tensor | None]) -> int:
    """Bytes of the given tensors (None skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
