"""Reference engine files and weight quantization (layout: docs/engine-format.md).

An engine (and a converted checkpoint) is a folder with `config.json` and `rank0.safetensors`
holding Hugging Face parameter names. A quantized linear weight `<p>.weight` [out, in] is stored as
- W8A16 (int8_wo):   `<p>.weight` int8 [out, in] + `<p>.weight_scale` f32 [out]; w = q * scale[:, None]
- W4A16 (int4_wo):   `<p>.weight` uint8 [out, in/2], two int4 per byte (low nibble = even column,
                     two's complement in [-8, 7]) + `<p>.weight_scale` f32 [out, in/group_size]
- W4A16_AWQ:         as W4A16 + `<p>.pre_quant_scale` f32 [in]; the layer computes (x * pre_quant_scale) @ w.T
- W8A8_SQ_PER_CHANNEL: as W8A16 + `<p>.smoother` f32 [in]; the layer computes (x / smoother) @ w.T
- FP8:               `<p>.weight` float8_e4m3fn [out, in] + `<p>.weight_scale` f32 [out]
`load_engine` returns dense weights in the compute dtype with the AWQ / SmoothQuant input scales
folded in; with `int8_kernels` it keeps W8A16 / W8A8 weights as stored (int8 + weight_scale [+ smoother])
for the model's int8 kernels (linear.py). int4 and fp8 weights are always dequantized.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

QUANT_ALGO = {"none": None, "int8_wo": "W8A16", "int4_wo": "W4A16", "int4_awq": "W4A16_AWQ",
              "int8_sq": "W8A8_SQ_PER_CHANNEL", "fp8": "FP8"}
INT8_KERNEL_ALGOS = ("W8A16", "W8A8_SQ_PER_CHANNEL")  # run on int8 kernels (linear.py), not dequantized
KV_CACHE_QUANT_ALGO = {"none": None, "int8": "INT8", "fp8": "FP8"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
WEIGHTS_FILE = "rank0.safetensors"
CONFIG_FILE = "config.json"


# ----------------------------------------------------------------------------- int8 / int4 / fp8


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 [out, in], scale f32 [out])."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [out]
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def int4_values(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric grouped int4 values before packing: (q int8 in [-8, 7] [out, in], scale f32 [out, in/group_size])."""
    out_features, in_features = w.shape
    if in_features % group_size or in_features % 2:
        raise ValueError(f"{in_features} input columns are not a multiple of group_size {group_size}")
    groups = w.float().reshape(out_features, in_features // group_size, group_size)  # [out, G, g]
    scale = (groups.abs().amax(dim=2) / 7.0).clamp(min=1e-12)  # [out, G]
    q = torch.round(groups / scale[:, :, None]).clamp(-8, 7).to(torch.int8).reshape(out_features, in_features)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric grouped int4: (packed uint8 [out, in/2], scale f32 [out, in/group_size])."""
    q, scale = int4_values(w, group_size)
    nibbles = (q & 0x0F).to(torch.uint8)  # two's complement low 4 bits
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # low nibble = even column
    return packed, scale


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [out, in], from packed uint8 [out, in/2]."""
    low = (packed & 0x0F).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    q = torch.stack([low, high], dim=2).reshape(packed.shape[0], -1)  # [out, in]
    return torch.where(q > 7, q - 16, q)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel float8_e4m3fn: (q [out, in], scale f32 [out]); w = q * scale[:, None]."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)  # [out]
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_linear(w: torch.Tensor, quant_algo: str, group_size: int, input_scale: torch.Tensor | None = None) -> dict:
    """The stored tensors of one linear weight, by suffix (`weight`, `weight_scale`, ...).

    `input_scale` [in] is the calibrated per-input-channel factor s: the weight is quantized as
    w * s and the input divided by s (stored as AWQ pre_quant_scale = 1/s or SmoothQuant smoother = s).
    """
    w = w.float()
    if input_scale is not None:
        w = w * input_scale[None, :]
    if quant_algo in ("W8A16", "W8A8_SQ_PER_CHANNEL"):
        q, scale = quantize_int8(w)
    elif quant_algo in ("W4A16", "W4A16_AWQ"):
        q, scale = quantize_int4(w, group_size)
    elif quant_algo == "FP8":
        q, scale = quantize_fp8(w)
    else:
        raise ValueError(f"quant_algo {quant_algo!r} has no linear quantization")
    stored = {"weight": q, "weight_scale": scale}
    if quant_algo == "W4A16_AWQ":
        stored["pre_quant_scale"] = (1.0 / input_scale) if input_scale is not None else torch.ones(w.shape[1])
    if quant_algo == "W8A8_SQ_PER_CHANNEL":
        stored["smoother"] = input_scale.clone() if input_scale is not None else torch.ones(w.shape[1])
    return stored


def dequantize_linear(stored: dict, quant_algo: str, group_size: int) -> torch.Tensor:
    """Dense f32 weight [out, in] equivalent to a stored quantized linear (input scales folded in)."""
    q, scale = stored["weight"], stored["weight_scale"]
    if quant_algo in ("W4A16", "W4A16_AWQ"):
        values = unpack_int4(q).float()
        w = (values.reshape(q.shape[0], -1, group_size) * scale[:, :, None]).reshape(q.shape[0], -1)
    else:
        w = q.float() * scale[:, None]
    if "pre_quant_scale" in stored:  # (x * pqs) @ w.T == x @ (w * pqs).T
        w = w * stored["pre_quant_scale"][None, :]
    if "smoother" in stored:  # (x / s) @ w.T == x @ (w / s).T
        w = w / stored["smoother"][None, :]
    return w


def is_quantized_linear(name: str) -> bool:
    """Decoder-layer projection weights are quantized; embeddings, norms, lm_head and heads are not."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


# ----------------------------------------------------------------------------- engine folders


def save_engine(engine_dir: str | os.PathLike, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write config.json and rank0.safetensors (tensors made contiguous)."""
    engine_dir = Path(engine_dir)
    engine_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(engine_dir / WEIGHTS_FILE))
    (engine_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_engine(engine_dir: str | os.PathLike, int8_kernels: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, state dict) of an engine or converted checkpoint: dense tensors in the compute dtype.

    int8_kernels: W8A16 / W8A8 linears stay as stored (int8 weight, f32 weight_scale, smoother).
    """
    engine_dir = Path(engine_dir)
    config = json.loads((engine_dir / CONFIG_FILE).read_text())
    pretrained = config.get("pretrained_config", config)  # a converted checkpoint holds pretrained_config only
    dtype = DTYPES[pretrained["dtype"]]
    quant = pretrained.get("quantization") or {}
    algo, group_size = quant.get("quant_algo"), quant.get("group_size", 128)
    raw = load_file(str(engine_dir / WEIGHTS_FILE))
    if int8_kernels and algo in INT8_KERNEL_ALGOS:
        def as_stored(name: str) -> bool:
            return is_quantized_linear(name) or name.endswith((".weight_scale", ".smoother"))

        return config, {k: v if as_stored(k) or not v.is_floating_point() else v.to(dtype) for k, v in raw.items()}
    state = {}
    for name, tensor in raw.items():
        if name.endswith((".weight_scale", ".pre_quant_scale", ".smoother")):
            continue
        if algo and is_quantized_linear(name):
            prefix = name[: -len("weight")]
            stored = {k: raw[prefix + k] for k in ("weight", "weight_scale", "pre_quant_scale", "smoother") if prefix + k in raw}
            state[name] = dequantize_linear(stored, algo, group_size).to(dtype)
        else:
            state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return config, state
