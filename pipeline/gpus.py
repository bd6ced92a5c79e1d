"""What the GPU of a spec supports: its compute capability, and the trtllm rules that depend on it.

`compute_capability(gpu)` is `gpu.compute_capability` when the spec sets it, else the entry of GPU_TABLE
whose name tokens all appear in `gpu.name` (so the Kubernetes product label "NVIDIA-H100-80GB-HBM3" and
nvidia-smi's "NVIDIA H100 80GB HBM3" both find H100). Values: NVIDIA's CUDA GPUs list
(https://developer.nvidia.com/cuda-gpus). The rules (sources in pipeline/contracts/README.md):
- float32 is not a TensorRT-LLM speculative-decoding precision (the draft-target support matrix is
  FP16/BF16/FP8; float32 attention falls back to unfused MHA): on a GPU toolchain a float32 model runs as
  bfloat16 (float16 below compute capability 8.0, which has no bfloat16), with a notice;
- FP8 weights or KV cache need compute capability 8.9 (Ada) or later;
- Blackwell (10.0 and later) builds no INT8/INT4 weight-only, SmoothQuant, INT4 AWQ or INT8 KV cache;
- an INT8 KV cache turns paged context FMHA off, and with it KV-cache reuse: a BLS verify call (draft
  model or n-gram) would re-prefill the whole sequence every round, and enable_kv_cache_reuse would be a lie.
Imports nothing heavy: `validate` and `plan` run these in a second.
"""

from __future__ import annotations

import re

from pipeline.modes import traits
from pipeline.spec import GpuSpec, ModelSpec, Spec, SpecError

# (name tokens, compute capability); the first entry whose tokens are all in the name wins.
GPU_TABLE: tuple[tuple[tuple[str, ...], float], ...] = (
    (("GB300",), 10.3), (("B300",), 10.3), (("GB200",), 10.0), (("B200",), 10.0),
    (("RTX", "PRO", "6000", "BLACKWELL"), 12.0), (("RTX", "5090"), 12.0),
    (("GH200",), 9.0), (("H200",), 9.0), (("H100",), 9.0), (("H800",), 9.0), (("H20",), 9.0),
    (("L40S",), 8.9), (("L40",), 8.9), (("L4",), 8.9), (("RTX", "6000", "ADA"), 8.9), (("RTX", "4090"), 8.9),
    (("A100",), 8.0), (("A800",), 8.0), (("A30",), 8.0),
    (("A10G",), 8.6), (("A10",), 8.6), (("A40",), 8.6), (("A16",), 8.6), (("A2",), 8.6),
    (("T4",), 7.5),
)
FP8_MIN_CC = 8.9
BF16_MIN_CC = 8.0
BLACKWELL_CC = 10.0
BLACKWELL_REFUSED_QFORMATS = ("int8_wo", "int4_wo", "int8_sq", "int4_awq")


def compute_capability(gpu: GpuSpec) -> float:
    """The GPU's compute capability: gpu.compute_capability, else looked up by gpu.name; SpecError if unknown."""
    if gpu.compute_capability is not None:
        return gpu.compute_capability
    tokens = {t for t in re.split(r"[\s\-_]+", gpu.name.upper()) if t}
    for names, cc in GPU_TABLE:
        if set(names) <= tokens:
            return cc
    raise SpecError("gpu.name", f"{gpu.name!r} is not in the compute capability table",
                    "set gpu.compute_capability (e.g. 9.0 for H100; nvidia-smi --query-gpu=compute_cap --format=csv)")


def engine_dtype(spec: Spec, model: ModelSpec) -> str:
    """The dtype a GPU engine of `model` is built in: float32 becomes bfloat16 (float16 below 8.0)."""
    if model.dtype != "float32":
        return model.dtype
    return "bfloat16" if compute_capability(spec.gpu) >= BF16_MIN_CC else "float16"


def dtype_notices(spec: Spec) -> list[str]:
    """One notice per float32 model that a GPU toolchain builds in another dtype."""
    return [f"notice: models.{role}.dtype float32 -> {engine_dtype(spec, model)} for TensorRT-LLM (its speculative "
            f"decoding supports FP16/BF16/FP8); set models.{role}.dtype to silence this"
            for role, model in spec.engine_models if model.dtype == "float32"]


def check_gpu_rules(spec: Spec) -> None:
    """Refuse what TensorRT-LLM refuses at build time on the spec's GPU, and INT8 KV where it breaks KV reuse."""
    cc = compute_capability(spec.gpu)
    resends = traits(spec.speculative.mode).bls_drafts  # verify calls re-send the whole sequence
    for role, model in spec.engine_models:
        where = f"models.{role}"
        if model.kv_cache_dtype == "int8" and (resends or spec.serving.enable_kv_cache_reuse):
            raise SpecError(f"{where}.kv_cache_dtype", "int8 turns TensorRT-LLM's paged context FMHA off, and with it "
                            "KV-cache reuse: every speculative round would re-prefill the whole sequence",
                            f"use kv_cache_dtype fp8 (compute capability >= {FP8_MIN_CC}) or none")
        if "fp8" in (model.qformat, model.kv_cache_dtype) and cc < FP8_MIN_CC:
            field = "qformat" if model.qformat == "fp8" else "kv_cache_dtype"
            raise SpecError(f"{where}.{field}", f"fp8 needs compute capability >= {FP8_MIN_CC}, {spec.gpu.name} has {cc}",
                            "use int8_wo / int4_wo / int4_awq weights and kv_cache_dtype none, or an Ada/Hopper GPU")
        if cc >= BLACKWELL_CC and model.qformat in BLACKWELL_REFUSED_QFORMATS:
            raise SpecError(f"{where}.qformat", f"{model.qformat} is not built by TensorRT-LLM on Blackwell "
                            f"(compute capability {cc})", "use qformat fp8 or none")
        if cc >= BLACKWELL_CC and model.kv_cache_dtype == "int8":
            raise SpecError(f"{where}.kv_cache_dtype", f"int8 KV cache is not built by TensorRT-LLM on Blackwell "
                            f"(compute capability {cc})", "use kv_cache_dtype fp8 or none")
