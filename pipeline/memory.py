"""Memory plan: do the target, the draft (or heads) and their KV caches fit on the spec's GPU?

Weights are counted from the safetensors headers at the bytes per parameter of each qformat
(linear layers quantized, embeddings / norms / lm_head in the compute dtype; TensorRT-LLM keeps a
separate lm_head copy for tied embeddings). KV cache bytes per token = 2 (K and V) x layers x
kv_heads x head_dim x bytes of the KV dtype. Per GPU, weights and KV divide by tp_size x pp_size.

The memory left after weights and an estimated runtime overhead is split between the engines'
KV caches in proportion to their bytes per token (every sequence lives in both caches), keeping 10%
headroom. The recommended `kv_cache_free_gpu_mem_fraction` values are fractions of that free memory.

A checkpoint only the LLM API serves (CheckpointInfo.llmapi_only: DeepSeek-V3 style) counts its weights at
the bytes its safetensors headers store (it is served as published), MTP modules included. Its
multi-head latent attention caches one latent row of kv_lora_rank + qk_rope_head_dim per token and layer
(TensorRT-LLM's SELFKONLY cache with one KV head, pipeline/contracts/llmapi-facts.md), which tensor
parallelism does not split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pipeline.modes import traits
from pipeline.spec import ModelSpec, Spec, SpecError

GIB = 1024 ** 3
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# bytes per element of the safetensors dtypes
STORED_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
                "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
RUNTIME_OVERHEAD = 1 * GIB  # CUDA context, TensorRT runtime and cuBLAS workspaces per engine (estimate)
HEADROOM = 0.9  # TensorRT-LLM's default kv_cache_free_gpu_mem_fraction
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def linear_bytes_per_param(qformat: str, dtype: str) -> float:
    """Bytes per parameter of a quantized linear weight, scales included approximately."""
    if qformat in ("int8_wo", "int8_sq", "fp8"):
        return 1.0
    if qformat in ("int4_wo", "int4_awq"):
        return 0.5
    return DTYPE_BYTES[dtype]


def weight_bytes(info, model: ModelSpec) -> int:
    """Engine weight bytes of one checkpoint at the model's qformat and dtype."""
    dense = DTYPE_BYTES[model.dtype]
    total = 0.0
    for name, (_dtype, shape) in info.tensors.items():
        numel = 1
        for n in shape:
            numel *= n
        if LINEAR.match(name):
            total += numel * linear_bytes_per_param(model.qformat, model.dtype)
            if model.qformat in ("int4_wo", "int4_awq"):
                total += numel / model.group_size * 2  # one fp16 scale per group
            elif model.qformat != "none":
                total += shape[0] * 4  # one fp32 scale per output channel
        else:
            total += numel * dense
    if info.tied:
        total += info.vocab_size * info.hidden_size * dense  # the engine holds lm_head separately
    return int(total)


def stored_weight_bytes(info) -> int:
    """Weight bytes as the checkpoint's safetensors headers store them (a checkpoint served as published)."""
    total = 0
    for dtype, shape in info.tensors.values():
        numel = 1
        for n in shape:
            numel *= n
        total += numel * STORED_BYTES.get(dtype, 2)
    return total


def estimate_weight_bytes(info, model: ModelSpec) -> int:
    """Weight bytes from the config alone (pickle checkpoints whose headers are not read)."""
    H, I, L, V = info.hidden_size, info.config["intermediate_size"], info.num_layers, info.vocab_size
    attn = H * info.num_heads * info.head_dim * 2 + H * info.num_kv_heads * info.head_dim * 2
    linear = L * (attn + 3 * H * I)
    return int(linear * linear_bytes_per_param(model.qformat, model.dtype) + 2 * V * H * DTYPE_BYTES[model.dtype])


def kv_bytes_per_token(info, model: ModelSpec, extra_layers: int = 0) -> int:
    """KV cache bytes for one token of one sequence (all layers, K and V; MLA: one latent row per layer)."""
    elem = 1 if model.kv_cache_dtype in ("fp8", "int8") else DTYPE_BYTES[model.dtype]
    if "kv_lora_rank" in info.config:  # multi-head latent attention (DeepSeek-V3)
        return (info.num_layers + extra_layers) * (info.config["kv_lora_rank"] + info.config["qk_rope_head_dim"]) * elem
    return 2 * (info.num_layers + extra_layers) * info.num_kv_heads * info.head_dim * elem


def head_bytes(spec: Spec, info, heads: dict) -> tuple[int, int]:
    """(weight bytes, extra KV layers) of Medusa heads or EAGLE nets added to the target engine."""
    H, V = info.hidden_size, info.vocab_size
    dense = DTYPE_BYTES[spec.models.target.dtype]
    heads_field = traits(spec.speculative.mode).heads_field
    if heads_field == "medusa":
        per_head = heads["num_layers"] * (H * H + H) + V * H  # resblocks + LM head (copied in when absent)
        return heads["num_heads"] * per_head * dense, 0
    if heads_field == "eagle":
        eh, inter = heads["hidden_size"], heads["intermediate_size"]
        nh, nkv, hd = heads["num_attention_heads"], heads["num_key_value_heads"], heads["head_size"]
        layer = eh * nh * hd * 2 + eh * nkv * hd * 2 + 3 * eh * inter
        net = 2 * H * eh + heads["num_hidden_layers"] * layer + V * eh  # fc + layers + lm_head copy
        copies = spec.speculative.eagle.num_layers  # TensorRT-LLM builds one EagleNet per tree level
        return copies * net * dense, copies * heads["num_hidden_layers"]
    return 0, 0


@dataclass
class EngineMemory:
    """One engine's share of a GPU."""

    role: str
    weight_bytes: int
    kv_bytes_per_token: int
    overhead_bytes: int
    kv_fraction: float = 0.0
    token_capacity: int = 0


@dataclass
class MemoryPlan:
    """Per-engine weights, KV needs and the recommended KV memory fractions."""

    gpu_name: str
    gpu_bytes: int
    free_bytes: int
    engines: list[EngineMemory] = field(default_factory=list)
    recommended: bool = True  # False: fractions came from the spec

    def render(self) -> str:
        """A small table."""
        lines = [f"memory plan ({self.gpu_name}, {self.gpu_bytes / GIB:.1f} GiB per GPU):"]
        for e in self.engines:
            lines.append(f"  {e.role:7s} weights {e.weight_bytes / GIB:7.3f} GiB   KV {e.kv_bytes_per_token / 1024:8.1f} KiB/token   "
                         f"kv_cache_free_gpu_mem_fraction {e.kv_fraction:.2f} -> {e.token_capacity:,} tokens")
        source = "recommended" if self.recommended else "from the spec"
        lines.append(f"  free for KV after weights and overhead: {self.free_bytes / GIB:.2f} GiB (fractions {source})")
        return "\n".join(lines)


def memory_plan(spec: Spec, infos: dict, heads: dict) -> MemoryPlan:
    """Check that the weights and one max_seq_len sequence per engine fit; recommend the KV memory fractions."""
    e = spec.engine
    shards = e.tp_size * e.pp_size
    gpu_bytes = int(spec.gpu.memory_gib * GIB)
    engines = []
    for role, info in infos.items():
        model = getattr(spec.models, role)
        if info.llmapi_only:
            weights = stored_weight_bytes(info)
        else:
            weights = weight_bytes(info, model) if info.tensors is not None else estimate_weight_bytes(info, model)
        extra_layers = 0
        if role == "target":
            hb, extra_layers = head_bytes(spec, info, heads)
            weights += hb
            if traits(spec.speculative.mode).drafts_in_target:  # MTP modules are decoder layers with a KV cache
                extra_layers += info.mtp_layers
        kv_shards = e.pp_size if "kv_lora_rank" in info.config else shards
        draft_len = spec.speculative.max_draft_len
        activations = e.max_num_tokens * (4 * info.hidden_size + 2 * info.config["intermediate_size"]) * DTYPE_BYTES[model.dtype]
        logits = e.max_batch_size * (draft_len + 1) * info.vocab_size * 4
        engines.append(EngineMemory(role=role, weight_bytes=weights // shards,
                                    kv_bytes_per_token=kv_bytes_per_token(info, model, extra_layers) // kv_shards,
                                    overhead_bytes=RUNTIME_OVERHEAD + activations + logits))
    used = sum(x.weight_bytes + x.overhead_bytes for x in engines)
    free = gpu_bytes - used
    if free <= 0:
        raise SpecError("gpu.memory_gib", f"the engines need {used / GIB:.1f} GiB per GPU before any KV cache, "
                        f"the GPU has {spec.gpu.memory_gib:g} GiB",
                        "use a larger GPU, raise engine.tp_size, or a smaller qformat (e.g. models.target.qformat: int4_awq)")
    fractions = spec.serving.kv_cache_free_gpu_mem_fraction
    given = {"target": fractions.target, "draft": fractions.draft}
    total_kv = sum(x.kv_bytes_per_token for x in engines)
    plan = MemoryPlan(gpu_name=spec.gpu.name, gpu_bytes=gpu_bytes, free_bytes=free,
                      recommended=all(given[x.role] is None for x in engines))
    for x in engines:
        share = given[x.role] if given[x.role] is not None else HEADROOM * x.kv_bytes_per_token / total_kv
        x.kv_fraction = int(share * 100) / 100 if given[x.role] is None else share
        x.token_capacity = int(x.kv_fraction * free // x.kv_bytes_per_token)
        if x.token_capacity < e.max_seq_len:
            path = f"serving.kv_cache_free_gpu_mem_fraction.{x.role}" if given[x.role] is not None else "gpu.memory_gib"
            raise SpecError(path, f"the {x.role} KV cache holds {x.token_capacity} tokens, less than one "
                            f"max_seq_len ({e.max_seq_len}) sequence",
                            "raise the fraction, use a larger GPU, lower engine.max_seq_len or use kv_cache_dtype: fp8")
    plan.engines = engines
    return plan
