"""Inspect: check the spec's checkpoints before anything is built.

- architecture support (Llama / Mistral / Qwen2 family; for toolchain trtllm-llmapi also the MTP-capable
  architectures of pipeline/contracts/llmapi.json, read config-only: no engine here can run them),
- draft and target tokenizers: same token -> id mapping and special tokens (padded vocab: warning),
- Medusa heads and EAGLE weights: shapes against the target's hidden size and vocab
  (formats in pipeline/contracts/head-checkpoint-formats.md),
- the memory plan (pipeline/memory.py).

Reads config.json, tokenizer files and safetensors headers (8-byte length + JSON) with plain json:
no torch, no transformers, no remote code.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.modes import traits
from pipeline.spec import Spec, SpecError, named_checkpoints
from pipeline.toolchains import TOOLCHAINS, toolchain_traits

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")  # torch.load can run arbitrary code
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


@dataclass
class CheckpointInfo:
    """What inspect knows about one HF checkpoint: its config and tensor shapes (None: pickle, unread)."""

    folder: Path
    config: dict
    tensors: dict[str, tuple[str, tuple[int, ...]]] | None  # name -> (safetensors dtype, shape)
    llmapi_only: bool = False  # an architecture only TensorRT-LLM's PyTorch backend serves here (config-only)
    mtp_layers: int = 0  # MTP modules the checkpoint carries after its decoder layers

    @property
    def architecture(self) -> str:
        return (self.config.get("architectures") or ["?"])[0]

    @property
    def hidden_size(self) -> int:
        return self.config["hidden_size"]

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]

    @property
    def num_heads(self) -> int:
        return self.config["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        return self.config.get("num_key_value_heads") or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.config.get("head_dim") or self.hidden_size // self.num_heads

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))


@dataclass
class Report:
    """The inspect result: facts per model, checks passed, warnings and the memory plan."""

    models: dict[str, CheckpointInfo] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    memory: object = None  # pipeline.memory.MemoryPlan
    heads: dict = field(default_factory=dict)  # the target's Medusa heads / EAGLE net (check_medusa / check_eagle)

    def render(self) -> str:
        """A readable multi-line report."""
        lines = ["models:"]
        for role, info in self.models.items():
            lines.append(f"  {role:7s} {info.architecture}  layers {info.num_layers}  hidden {info.hidden_size}  "
                         f"heads {info.num_heads}/{info.num_kv_heads} kv  vocab {info.vocab_size}  ({info.folder})")
        lines.append("checks:")
        lines += [f"  ok: {c}" for c in self.checks]
        lines += [f"  warning: {w}" for w in self.warnings]
        if self.memory is not None:
            lines.append(self.memory.render())
        return "\n".join(lines)


# ----------------------------------------------------------------------------- files


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from a .safetensors file's header, without reading the tensors."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > 100_000_000:
            raise ValueError(f"{path} has an implausible header length {length}")
        header = json.loads(fh.read(length))
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}


def read_tensors(folder: Path, where: str, names: tuple[str, ...] | None = None) -> dict | None:
    """Shapes of every tensor in the folder's safetensors files (or the given file names); None if only pickle."""
    files = [folder / n for n in names if (folder / n).is_file()] if names else sorted(folder.glob("*.safetensors"))
    files = [f for f in files if f.suffix == ".safetensors"]
    if not files:
        if any(p.suffix in PICKLE_SUFFIXES for p in folder.iterdir()):
            return None  # allowed by security.allow_pickle_weights; shapes are checked at convert time
        raise SpecError(where, f"{folder} has no .safetensors weights", "point it at a checkpoint saved with safetensors")
    tensors = {}
    for f in files:
        try:
            tensors.update(safetensors_header(f))
        except (OSError, ValueError) as exc:
            raise SpecError(where, f"{f.name} is not a readable safetensors file ({exc})", "re-download or re-save it") from None
    return tensors


def read_json(path: Path, where: str) -> dict:
    """A JSON file as a dict, or a SpecError naming the field."""
    if not path.is_file():
        raise SpecError(where, f"{path.parent} has no {path.name}", "point it at a Hugging Face checkpoint folder")
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise SpecError(where, f"{path} is not valid JSON", "repair or re-download the checkpoint") from None


def mtp_architectures() -> dict[str, dict]:
    """Architecture -> {model_type, layers_key, ...}: the MTP-capable targets the LLM API toolchain takes."""
    from pipeline.llmapi import contract

    return contract()["mtp"]["architectures"]


def read_checkpoint(folder: Path, where: str, llmapi: bool = False) -> CheckpointInfo:
    """Config and tensor shapes of a base model checkpoint; refuses unsupported architectures.
    llmapi: also accept the MTP-capable architectures (toolchain trtllm-llmapi), read config-only."""
    config = read_json(folder / "config.json", where)
    info = CheckpointInfo(folder=folder, config=config, tensors=None)
    if info.architecture not in SUPPORTED_ARCHITECTURES:
        if llmapi and info.architecture in mtp_architectures():
            return read_mtp_checkpoint(info, where)
        supported = SUPPORTED_ARCHITECTURES + (tuple(mtp_architectures()) if llmapi else ())
        raise SpecError(where, f"architecture {info.architecture} is not supported", f"use a {', '.join(supported)} checkpoint")
    check_config_keys(config, where)
    if config.get("auto_map"):
        raise SpecError(where, "config.json asks for custom (remote) modelling code via auto_map, which is never run",
                        f"use a checkpoint of a built-in {info.architecture} without auto_map")
    info.tensors = read_tensors(folder, where)
    if info.tensors is not None:
        expect = {"model.embed_tokens.weight": (info.vocab_size, info.hidden_size)}
        if not info.tied:
            expect["lm_head.weight"] = (info.vocab_size, info.hidden_size)
        check_shapes(info.tensors, expect, where)
    return info


def check_config_keys(config: dict, where: str) -> None:
    """The config.json sizes every stage reads are integers."""
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        if not isinstance(config.get(key), int):
            raise SpecError(where, f"config.json lacks an integer {key}", "use a complete Hugging Face config.json")


def read_mtp_checkpoint(info: CheckpointInfo, where: str) -> CheckpointInfo:
    """An MTP-capable checkpoint (DeepSeek-V3 style) for the LLM API: config.json and safetensors headers only
    (a sharded checkpoint's every header), its MTP module count and the MTP modules' fusion tensors.
    Its auto_map (remote modelling code) is never run here; TensorRT-LLM serves it with its own model class."""
    facts = mtp_architectures()[info.architecture]
    check_config_keys(info.config, where)
    layers = info.config.get(facts["layers_key"], 0)
    if not isinstance(layers, int) or layers < 0:
        raise SpecError(where, f"config.json {facts['layers_key']} is {layers!r}, not a count", "use the checkpoint's own config.json")
    info.llmapi_only, info.mtp_layers = True, layers
    info.tensors = read_tensors(info.folder, where)
    if info.tensors is None:
        raise SpecError(where, f"{info.folder} holds pickle weights only; the memory plan reads safetensors headers",
                        "use the checkpoint's safetensors release")
    H, V, L = info.hidden_size, info.vocab_size, info.num_layers
    expect = {"model.embed_tokens.weight": (V, H)}
    if not info.tied:
        expect["lm_head.weight"] = (V, H)
    for i in range(layers):  # the MTP modules follow the decoder layers: model.layers.{L + i}.* (shapes in units of H)
        expect |= {f"model.layers.{L + i}.{name}": tuple(H * n for n in dims) for name, dims in facts["mtp_tensors"].items()}
    check_shapes(info.tensors, expect, where)
    return info


def check_shapes(tensors: dict, expect: dict[str, tuple[int, ...]], where: str, optional: tuple[str, ...] = ()) -> None:
    """Each expected tensor exists (unless optional) with the expected shape."""
    for name, shape in expect.items():
        if name not in tensors:
            if name in optional:
                continue
            raise SpecError(where, f"tensor {name} is missing", "use a checkpoint in the documented format (docs/spec.md)")
        if tuple(tensors[name][1]) != tuple(shape):
            raise SpecError(where, f"tensor {name} has shape {list(tensors[name][1])}, expected {list(shape)}",
                            "use weights trained for this target model")


def check_pickle_policy(spec: Spec) -> None:
    """Refuse pickle weight files (arbitrary code on load) unless security.allow_pickle_weights."""
    if spec.security.allow_pickle_weights:
        return
    for where, folder in named_checkpoints(spec):
        files = [folder] if folder.is_file() else [p for p in folder.iterdir() if p.is_file()]
        pickles = [p.name for p in files if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise SpecError(where, f"{folder} holds pickle weights ({', '.join(sorted(pickles))}), which can run code when loaded",
                            "convert them to safetensors, or set security.allow_pickle_weights: true if you trust the source")


# ----------------------------------------------------------------------------- tokenizers


def tokenizer_facts(folder: Path, where: str) -> tuple[dict[str, int] | None, dict[str, str], str | None]:
    """(token -> id mapping, special tokens by role, digest of tokenizer.model) of a checkpoint's tokenizer."""
    mapping = None
    tj = folder / "tokenizer.json"
    if tj.is_file():
        data = read_json(tj, where)
        vocab = (data.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):  # BPE / WordPiece / WordLevel
            mapping = dict(vocab)
        elif isinstance(vocab, list):  # Unigram: [[piece, score], ...] in id order
            mapping = {piece: i for i, (piece, _score) in enumerate(vocab)}
        else:
            mapping = {}
        for tok in data.get("added_tokens", []):
            mapping[tok["content"]] = tok["id"]
    specials = {}
    tc = folder / "tokenizer_config.json"
    if tc.is_file():
        config = read_json(tc, where)
        for key in SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if value is not None:
                specials[key] = value
    sp_digest = None
    if (folder / "tokenizer.model").is_file():
        sp_digest = hashlib.sha256((folder / "tokenizer.model").read_bytes()).hexdigest()
    if mapping is None and sp_digest is None:
        raise SpecError(where, f"{folder} has no tokenizer.json or tokenizer.model",
                        "save the tokenizer into the checkpoint folder (tokenizer.save_pretrained)")
    return mapping, specials, sp_digest


def check_tokenizers(target: CheckpointInfo, draft: CheckpointInfo) -> list[str]:
    """Raise unless the draft reads token ids exactly as the target does; return warnings (padded vocab)."""
    where = "models.draft.checkpoint"
    t_map, t_special, t_sp = tokenizer_facts(target.folder, "models.target.checkpoint")
    d_map, d_special, d_sp = tokenizer_facts(draft.folder, where)
    fix = "use a draft trained with the target's tokenizer (same family and version)"
    if t_map is not None and d_map is not None:
        if t_map != d_map:
            t_by_id = {i: t for t, i in t_map.items()}
            d_by_id = {i: t for t, i in d_map.items()}
            for i in sorted(set(t_by_id) | set(d_by_id)):
                if t_by_id.get(i) != d_by_id.get(i):
                    raise SpecError(where, f"tokenizer differs from the target's: id {i} is {t_by_id.get(i)!r} in the target "
                                    f"and {d_by_id.get(i)!r} in the draft ({len(t_map)} vs {len(d_map)} tokens)", fix)
    elif t_sp is None or t_sp != d_sp:
        raise SpecError(where, "the tokenizers cannot be shown identical (different files or formats)", fix)
    for key in SPECIAL_TOKEN_KEYS:
        if t_special.get(key) != d_special.get(key):
            raise SpecError(where, f"special token {key} is {d_special.get(key)!r} in the draft and "
                            f"{t_special.get(key)!r} in the target", "use a draft with the target's special tokens")
    warnings = []
    n_tokens = len(t_map) if t_map is not None else 0
    for role, info in (("target", target), ("draft", draft)):
        if info.vocab_size < n_tokens:
            raise SpecError(f"models.{role}.checkpoint", f"vocab_size {info.vocab_size} is smaller than its tokenizer "
                            f"({n_tokens} tokens)", "use a checkpoint whose embedding covers its tokenizer")
    if target.vocab_size != draft.vocab_size:
        warnings.append(f"vocab sizes differ only by padding (target {target.vocab_size}, draft {draft.vocab_size}, "
                        f"{n_tokens} real tokens): padded ids are never proposed by a trained draft")
    return warnings


# ----------------------------------------------------------------------------- speculative heads


def check_medusa(spec: Spec, target: CheckpointInfo) -> tuple[dict, list[str]]:
    """Medusa head shapes against the target; returns ({num_heads, num_layers, has_lm_heads}, warnings)."""
    m = spec.speculative.medusa
    where = "speculative.medusa.checkpoint"
    folder = m.checkpoint
    config = read_json(folder / "config.json", where) if (folder / "config.json").is_file() else {}
    tensors = read_tensors(folder, where, ("medusa_lm_head.safetensors",)) if (folder / "medusa_lm_head.safetensors").is_file() \
        else None
    if tensors is None and not (folder / "medusa_lm_head.pt").is_file():
        raise SpecError(where, f"{folder} has neither medusa_lm_head.safetensors nor medusa_lm_head.pt",
                        "point it at a FasterDecoding/Medusa heads folder")
    warnings = []
    if tensors is None:
        warnings.append("Medusa heads are a pickle file: shapes are checked when they are converted")
        heads = config.get("medusa_num_heads", 4)
        return {"num_heads": heads, "num_layers": config.get("medusa_num_layers", 1), "has_lm_heads": True}, warnings
    heads = sorted({int(k.split(".")[0]) for k in tensors if k.split(".")[0].isdigit()})
    if not heads or heads != list(range(len(heads))):
        raise SpecError(where, "medusa_lm_head.safetensors has no heads named 0.., 1.., ...",
                        "save the heads' state dict ({h}.{l}.linear.weight ...) as medusa_lm_head.safetensors")
    layers = config.get("medusa_num_layers") or len({k.split(".")[1] for k in tensors if ".linear." in k and k.startswith("0.")})
    H, V = target.hidden_size, target.vocab_size
    has_lm_heads = f"0.{layers}.weight" in tensors
    for h in heads:
        expect = {f"{h}.{l}.linear.weight": (H, H) for l in range(layers)}
        expect |= {f"{h}.{l}.linear.bias": (H,) for l in range(layers)}
        if has_lm_heads:
            expect[f"{h}.{layers}.weight"] = (V, H)
        check_shapes(tensors, expect, where)
    if config.get("medusa_num_heads") not in (None, len(heads)):
        warnings.append(f"Medusa config.json says {config['medusa_num_heads']} heads, the weights hold {len(heads)}: "
                        f"using {len(heads)}")
    if not has_lm_heads:
        warnings.append("Medusa heads have no per-head LM head (Medusa-2 format): logits use the target's lm_head; "
                        "TensorRT-LLM 1.2.1's converter needs {h}.{L}.weight, so only the reference toolchain takes them")
    depth = max(len(c) for c in m.choices)
    if depth > len(heads):
        raise SpecError("speculative.medusa.choices", f"a path is {depth} deep but there are only {len(heads)} heads",
                        f"use paths of at most {len(heads)} tokens")
    return {"num_heads": len(heads), "num_layers": layers, "has_lm_heads": has_lm_heads}, warnings


def eagle3_capture_layers(layers: tuple[int, ...] | None, num_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs feed EAGLE-3's fc, ascending: the spec's, or TensorRT-LLM's default
    (1, L // 2 - 1, L - 4), defined for targets of more than 5 layers (pipeline/contracts/llmapi-facts.md)."""
    where = "speculative.eagle.layers_to_capture"
    if layers is None:
        if num_layers <= 5:
            raise SpecError(where, f"the target has {num_layers} layers; the default (1, L//2-1, L-4) needs more than 5",
                            "list the target layers the EAGLE-3 head was trained on, e.g. [0, 1, 2]")
        return 1, num_layers // 2 - 1, num_layers - 4
    if len(set(layers)) != len(layers) or any(i >= num_layers for i in layers):
        raise SpecError(where, f"{list(layers)} must be distinct layer ids below the target's {num_layers} layers",
                        "list the layers the EAGLE-3 head was trained on")
    return tuple(sorted(layers))


def check_eagle(spec: Spec, target: CheckpointInfo) -> tuple[dict, list[str]]:
    """EAGLE weight shapes against the target; returns (the draft layer config, warnings)."""
    e = spec.speculative.eagle
    where = "speculative.eagle.checkpoint"
    folder = e.checkpoint
    config = read_json(folder / "config.json", where)
    if (folder / "model.safetensors").is_file():
        tensors = read_tensors(folder, where, ("model.safetensors",))
    elif (folder / "pytorch_model.bin").is_file():
        tensors = None
    else:
        raise SpecError(where, f"{folder} has neither model.safetensors nor pytorch_model.bin",
                        "point it at a SafeAILab/EAGLE weights folder")
    H, V = target.hidden_size, target.vocab_size
    eh = config.get("hidden_size", H)
    nh = config.get("num_attention_heads", target.num_heads)
    nkv = config.get("num_key_value_heads") or nh
    hd = config.get("head_dim") or eh // nh
    inter = config.get("intermediate_size", target.config["intermediate_size"])
    draft_config = {"hidden_size": eh, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_size": hd,
                    "intermediate_size": inter, "num_hidden_layers": config.get("num_hidden_layers", 1),
                    "norm_epsilon": config.get("rms_norm_eps", target.config.get("rms_norm_eps", 1e-6))}
    warnings = []
    if tensors is None:
        warnings.append("EAGLE weights are a pickle file: shapes are checked when they are converted")
        if e.version == 3:
            draft_config["layers_to_capture"] = list(eagle3_capture_layers(e.layers_to_capture, target.num_layers))
        return draft_config, warnings
    is_v3 = any(k.startswith("midlayer.") for k in tensors)
    if is_v3 and e.version != 3:
        raise SpecError("speculative.eagle.version", f"is {e.version} but the weights are in the EAGLE-3 format (midlayer.*)",
                        "set speculative.eagle.version: 3 (toolchain reference)")
    if not is_v3 and e.version == 3:
        raise SpecError("speculative.eagle.version", "is 3 but the weights are in the EAGLE-1/2 format (fc [H, 2H], layers.*)",
                        "set speculative.eagle.version: 2")
    if eh != H and not is_v3:
        raise SpecError(where, f"EAGLE hidden_size {eh} differs from the target's {H}", "use EAGLE weights trained for this target")
    if is_v3:
        draft_config["layers_to_capture"] = list(eagle3_capture_layers(e.layers_to_capture, target.num_layers))
        ht = config.get("target_hidden_size") or H
        if ht != H:
            raise SpecError(where, f"EAGLE-3 target_hidden_size {ht} differs from the target's {H}",
                            "use EAGLE-3 weights trained for this target")
        vd = config.get("draft_vocab_size") or V
        expect = {"fc.weight": (eh, len(draft_config["layers_to_capture"]) * H), "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * eh),
                  "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * eh), "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * eh),
                  "midlayer.self_attn.o_proj.weight": (eh, nh * hd), "midlayer.mlp.gate_proj.weight": (inter, eh),
                  "midlayer.mlp.up_proj.weight": (inter, eh), "midlayer.mlp.down_proj.weight": (eh, inter),
                  "norm.weight": (eh,), "lm_head.weight": (vd, eh)}
        if vd != V:
            expect |= {"d2t": (vd,), "t2d": (V,)}
        check_shapes(tensors, expect, where)
        draft_config["draft_vocab_size"] = vd
        return draft_config, warnings
    expect = {"fc.weight": (H, 2 * H), "embed_tokens.weight": (V, H)}
    for i in range(draft_config["num_hidden_layers"]):
        p = f"layers.{i}."
        expect |= {p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                   p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                   p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                   p + "mlp.down_proj.weight": (H, inter), p + "post_attention_layernorm.weight": (H,)}
    check_shapes(tensors, expect, where, optional=("embed_tokens.weight",))
    draft_config["fc_bias"] = "fc.bias" in tensors
    return draft_config, warnings


# ----------------------------------------------------------------------------- the whole spec


def check_mtp(spec: Spec, target: CheckpointInfo) -> list[str]:
    """Mode mtp: the target carries MTP modules; relaxed acceptance needs DeepSeek-R1's thinking tokens. Returns
    warnings (more draft tokens than modules: TensorRT-LLM reuses them; pipeline/contracts/llmapi-facts.md)."""
    from pipeline.llmapi import contract

    where = "models.target.checkpoint"
    if not target.mtp_layers:
        key = mtp_architectures().get(target.architecture, {}).get("layers_key", "num_nextn_predict_layers")
        raise SpecError(where, f"the {target.architecture} checkpoint carries no MTP modules ({key} is 0 or missing)",
                        f"use a checkpoint with MTP layers ({', '.join(mtp_architectures())}), or another speculative.mode")
    m = spec.speculative.mtp
    if m is not None and m.relaxed_acceptance:
        thinking = contract()["mtp"]["thinking_phase_tokens"]
        mapping, _specials, _sp = tokenizer_facts(target.folder, where)
        found = {tok: (mapping or {}).get(tok) for tok in thinking}
        if found != thinking:
            raise SpecError("speculative.mtp.relaxed_acceptance", f"TensorRT-LLM relaxes acceptance only between the thinking "
                            f"tokens {thinking}, and this tokenizer maps them to {found}",
                            "set relaxed_acceptance: false (it is for DeepSeek-R1-style reasoning models)")
    k, n = spec.speculative.num_draft_tokens, target.mtp_layers
    if k > n == 1:
        return [f"{k} draft tokens from 1 MTP module: TensorRT-LLM runs the one module {k} times (MTP-Eagle)"]
    if k > n:
        return [f"{k} draft tokens from {n} MTP modules: TensorRT-LLM reuses module i mod {n} for step i"]
    return []


def check_group_size(model, info: CheckpointInfo, where: str) -> None:
    """int4 qformats: every decoder linear's input width must be a multiple of group_size."""
    if model.qformat not in ("int4_wo", "int4_awq") or info.tensors is None:
        return
    widths = sorted({shape[1] for name, (_dtype, shape) in info.tensors.items()
                     if name.startswith("model.layers.") and name.endswith("_proj.weight")})
    bad = [w for w in widths if w % model.group_size]
    if bad:
        fits = [g for g in (128, 64, 32, 16) if all(w % g == 0 for w in widths)]
        raise SpecError(f"{where}.group_size", f"{model.group_size} does not divide the linear input widths {bad}",
                        f"set group_size: {fits[0]}" if fits else "use int8_wo")


def inspect_spec(spec: Spec) -> Report:
    """Run every check on the spec's checkpoints and the memory plan; raises SpecError on the first problem."""
    from pipeline.memory import memory_plan

    check_pickle_policy(spec)
    report = Report()
    llmapi = spec.toolchain in TOOLCHAINS and not toolchain_traits(spec.toolchain).engine_build  # serves HF checkpoints
    target = read_checkpoint(spec.models.target.checkpoint, "models.target.checkpoint", llmapi=llmapi)
    report.models["target"] = target
    report.checks.append(f"target architecture {target.architecture} is supported"
                         + (" (LLM API only, read config-only)" if target.llmapi_only else ""))
    s = spec.speculative
    heads = {}
    mode = traits(s.mode)
    if target.llmapi_only and (spec.models.target.qformat != "none"):
        raise SpecError("models.target.qformat", f"{spec.models.target.qformat}: a {target.architecture} checkpoint is served "
                        "as published here (no ModelOpt step is planned for it)",
                        "set models.target.qformat: none (DeepSeek-V3 publishes FP8 weights)")
    if mode.drafts_in_target:
        report.warnings += check_mtp(spec, target)
        report.checks.append(f"target carries {target.mtp_layers} MTP module(s); {s.num_draft_tokens} draft token(s) per step")
    if mode.has_draft_engine:
        draft = read_checkpoint(spec.models.draft.checkpoint, "models.draft.checkpoint")
        report.models["draft"] = draft
        report.warnings += check_tokenizers(target, draft)
        report.checks.append("draft and target tokenizers map every token to the same id and share special tokens")
        if draft.num_layers >= target.num_layers and draft.hidden_size >= target.hidden_size:
            report.warnings.append("the draft is as large as the target: speculation cannot pay off")
    elif mode.heads_field == "medusa":
        heads, warnings = check_medusa(spec, target)
        report.warnings += warnings
        report.checks.append(f"{heads['num_heads']} Medusa heads x {heads['num_layers']} layers match hidden "
                             f"{target.hidden_size} / vocab {target.vocab_size}")
    elif mode.heads_field == "eagle":
        heads, warnings = check_eagle(spec, target)
        report.warnings += warnings
        report.checks.append(f"EAGLE-{s.eagle.version} weights match hidden {target.hidden_size} / vocab {target.vocab_size}")
    for role, info in report.models.items():
        check_group_size(getattr(spec.models, role), info, f"models.{role}")
    report.heads = heads
    report.memory = memory_plan(spec, report.models, heads)
    report.checks.append(f"engines fit on {spec.gpu.name} ({spec.gpu.memory_gib:g} GiB)")
    return report
