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
  int32 accumulation (fbgemm), then the row scale times the channel scale. Integer sums are exact,
  so a row's result cannot depend on the rest of the batch.
- Float16Weights (the output layer of quantized engines, as TensorRT-LLM keeps it in 16 bits):
  fbgemm's fp16-weight GEMM, fp32 activations and accumulation (batch-invariant, measured).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

INT8_MAX = 127.0
GRID_STEP, GRID_ZERO_POINT = 2 / 255, 127  # Int8PerToken's uint8 grid over [-1, 1]
_fixed_grid_linear = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
# float32 DenseLinear: calls of ONEDNN_ROWS rows (verifies, batched decode steps) run oneDNN's GEMM on weights
# packed for ONEDNN_ROW_HINT rows; one row and prefill-sized calls stay on MKL (closest to transformers' logits)
ONEDNN_ROWS, ONEDNN_ROW_HINT = range(2, 17), 6


def wide_layout(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight [out, in] with out > in as a view over [in, out] storage (else unchanged).

    F.linear on such a view runs x @ W^T as a row-major [in, out] GEMV, which reads memory about
    1.5-2x faster on these CPUs for wide outputs (lm_head, qkv, gate_up); narrow outputs (down)
    are faster in the usual layout, and bf16 / fp16 are 25x SLOWER in the transposed one.
    Measured with torch 2.13 on the 2-core development machines.
    """
    wide = weight.dtype == torch.float32 and weight.shape[0] > weight.shape[1]
    return weight.t().contiguous().t() if wide else weight


class DenseLinear:
    """x @ weight.T (+ bias) on the compute dtype; float32 calls of several rows on oneDNN's prepacked GEMM.

    One row (a decode step, and every row of exact mode's row-by-row calls) runs `F.linear` (MKL) on
    the wide layout; float32 calls of 2-16 rows (ONEDNN_ROWS: verifies, batched decode steps) run
    oneDNN's GEMM on weights packed once for ONEDNN_ROW_HINT rows: 2-2.7x faster than MKL for 4-16
    rows on SmolLM2's shapes, but slower for one row (`make bench-kernels`, docs/engine.md). Prefill
    stays on MKL: oneDNN's sums drift up to 3e-4 from transformers' logits over SmolLM2's 30 layers
    (MKL's stay within the 1e-4 tests/test_model.py asks).
    """

    batch_invariant = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = wide_layout(weight), bias  # [out, in]
        fp32 = weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_ROW_HINT) if fp32 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.shape[0] not in ONEDNN_ROWS:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    @property
    def nbytes(self) -> int:
        """Bytes one call reads."""
        return tensor_bytes([self.weight, self.bias])


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
    (`make bench-kernels`). On CPUs without AVX512-VNNI fbgemm's u8 x s8 pairs may saturate in 16 bits
    (deterministic and per row: results stay batch-invariant, precision drops).
    """

    batch_invariant = True

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 smoother: torch.Tensor | None = None):
        with warnings.catch_warnings():  # torch deprecates quantized tensor creation; fbgemm's prepack still takes one
            warnings.simplefilter("ignore")
            qweight = torch._make_per_channel_quantized_tensor(q.contiguous(), scale.double(),
                                                               torch.zeros(len(scale), dtype=torch.long), 0)
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)
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
        """fbgemm's GEMM [T, out] float32 of rows already divided by their row scale (`scale_rows`), unscaled."""
        return _fixed_grid_linear(x_unit, GRID_STEP, GRID_ZERO_POINT, self.packed)

    @property
    def nbytes(self) -> int:
        """Bytes one call reads."""
        return self.weight_nbytes + tensor_bytes([self.bias, self.inv_smoother])


class Float16Weights:
    """fp16 weights, fp32 activations and accumulation (fbgemm's prepacked fp16 GEMM), output in x's dtype."""

    batch_invariant = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), None)
        self.bias = bias
        self.weight_nbytes = weight.numel() * 2  # fp16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed).to(x.dtype)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        """Bytes one call reads."""
        return self.weight_nbytes + tensor_bytes([self.bias])


def scale_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] float32 divided by each row's max |x| (values in [-1, 1]), and that row scale [T, 1]."""
    row_scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    return x / row_scale, row_scale


def tensor_bytes(tensors: list[torch.Tensor | None]) -> int:
    """Bytes of the given tensors (None skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
