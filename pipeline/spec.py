"""The deployment spec: one YAML file validated into typed, frozen dataclasses.

Every error is a `SpecError` that names the field path and the fix, e.g.
``speculative.num_draft_tokens: 9 is larger than speculative.max_draft_len (8); lower it or raise max_draft_len``.
This module imports no torch: a spec validates in well under a second on a bare machine.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pipeline.limits import PLAIN_CHUNK_TOKENS
from pipeline.modes import traits

Dtype = Literal["float16", "bfloat16", "float32"]
QFormat = Literal["none", "fp8", "int8_sq", "int4_awq", "int8_wo", "int4_wo"]
KvCacheDtype = Literal["none", "fp8", "int8"]
Mode = Literal["draft_target", "medusa", "eagle", "ngram", "mtp", "none"]
Toolchain = Literal["trtllm", "trtllm-llmapi", "reference", "auto"]

# qformats that need a calibration pass (TensorRT-LLM's quantize.py); the others convert directly.
CALIBRATED_QFORMATS = frozenset({"fp8", "int8_sq", "int4_awq"})


class SpecError(ValueError):
    """A spec problem: `path` is the dotted field path, `fix` says what to do."""

    def __init__(self, path: str, problem: str, fix: str):
        self.path, self.problem, self.fix = path, problem, fix
        super().__init__(f"{path}: {problem}; fix: {fix}")


@dataclass(frozen=True)
class ModelSpec:
    """One Hugging Face checkpoint and how to quantize it."""

    checkpoint: Path
    dtype: Dtype = "float16"
    qformat: QFormat = "none"
    kv_cache_dtype: KvCacheDtype = "none"
    calib_size: int = 512
    group_size: int = 128  # for int4_wo / int4_awq: input columns sharing one scale


@dataclass(frozen=True)
class MedusaSpec:
    """FasterDecoding/Medusa heads trained on the target."""

    checkpoint: Path
    choices: tuple[tuple[int, ...], ...] = ((0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0))


@dataclass(frozen=True)
class EagleSpec:
    """SafeAILab/EAGLE weights: version 1/2 share a format; 3 has its own (no TensorRT engine path)."""

    checkpoint: Path
    version: Literal[1, 2, 3] = 2
    choices: tuple[tuple[int, ...], ...] = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    num_layers: int = 3  # depth of the EAGLE tree; every choice path must be at most this deep
    max_non_leaves_per_layer: int = 4
    dynamic_tree_top_k: int = 4  # EAGLE-2 dynamic tree width (reference toolchain)
    # EAGLE-3: target layers whose outputs the head fuses; default TensorRT-LLM's (1, L//2 - 1, L - 4)
    layers_to_capture: tuple[int, ...] | None = None


@dataclass(frozen=True)
class NgramSpec:
    """Prompt lookup: propose the continuation of the longest matching n-gram in the context."""

    min_ngram: int = 1
    max_ngram: int = 3
    # cut a draft where the context disagrees with it (pipeline.sequences.ngram_lookup; 0: the whole continuation)
    min_token_prob: float = 0.0


@dataclass(frozen=True)
class MtpSpec:
    """Multi-token prediction with the target's own MTP modules (toolchain trtllm-llmapi): relaxed acceptance,
    which TensorRT-LLM applies only inside a reasoning model's <think> ... </think> phase."""

    relaxed_acceptance: bool = False  # MTPDecodingConfig.use_relaxed_acceptance_for_thinking
    relaxed_topk: int = 1  # a draft token is accepted if it is among the target's top-k ...
    relaxed_delta: float = 0.0  # ... and its probability is at least the top-1's minus delta


@dataclass(frozen=True)
class SpeculativeSpec:
    """How draft tokens are proposed and how many."""

    mode: Mode = "none"
    max_draft_len: int = 0  # engine capacity (trtllm-build --max_draft_len)
    num_draft_tokens: int = 0  # default K per request; requests may ask for fewer
    use_draft_logits: bool = False  # lossless rejection sampling with the draft's probabilities
    medusa: MedusaSpec | None = None
    eagle: EagleSpec | None = None
    ngram: NgramSpec | None = None
    mtp: MtpSpec | None = None
    # Policy (reference toolchain and BLS): speculation pays only in some regimes.
    min_new_tokens_for_speculation: int = 8  # shorter requests decode plainly
    max_batch_for_speculation: int = 32  # above this running batch size, speculation is off
    # a request whose acceptance stays below this, or below the break-even measured on the engines when that is
    # higher (reference toolchain: the tensorrt_llm_bls parameter draft_token_cost), stops speculating; 0: never
    min_acceptance_rate: float = 0.1


@dataclass(frozen=True)
class EngineSpec:
    """Engine limits (trtllm-build flags) and parallelism."""

    max_batch_size: int = 8
    max_input_len: int = 1024
    max_seq_len: int = 2048
    max_num_tokens: int = 8192
    tp_size: int = 1
    pp_size: int = 1


@dataclass(frozen=True)
class KvFractionSpec:
    """Fraction of free GPU memory each engine's KV cache may take; None lets the memory plan pick."""

    target: float | None = None
    draft: float | None = None


@dataclass(frozen=True)
class ServingSpec:
    """Triton model repository and server settings."""

    preprocessing_instances: int = 1
    postprocessing_instances: int = 1
    bls_instances: int = 1
    kv_cache_free_gpu_mem_fraction: KvFractionSpec = field(default_factory=KvFractionSpec)
    enable_kv_cache_reuse: bool = True
    # Triton's decoupled transaction policy for tensorrt_llm, tensorrt_llm_draft and tensorrt_llm_bls (NVIDIA's
    # fill_template `decoupled_mode`): true streams (gRPC streams, /generate_stream); false answers unary
    # ModelInfer (HTTP /infer, tritonclient.infer), as NVIDIA's draft-target recipe configures its stock BLS.
    decoupled: bool = True
    streaming: bool = True
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    max_queue_delay_microseconds: int = 1000
    # Shutdown (docs/reliability.md): after SIGTERM, requests in flight get this long to finish; the
    # Deployment's terminationGracePeriodSeconds is derived from it.
    drain_timeout_s: float = 60.0
    # A draft model whose stub died: `restart` fails readiness and liveness (Kubernetes takes the pod out
    # of the Service and restarts it); `degraded` stays ready and serves without speculation.
    draft_failure: Literal["restart", "degraded"] = "restart"
    # A model call (BLS -> target or draft) with no response for this long fails.
    stall_timeout_s: float = 60.0
    # Tokens a streamed plain response carries after the request's first (which is sent at once): 1 sends every
    # engine step's tokens; N > 1 asks the target for calls of N tokens answered once each. Each response costs CPU
    # beside the engine (about 1.5 ms on a 2-core CPU host, where 16 served plain decoding 18-24% faster;
    # docs/benchmarks.md). At most PLAIN_CHUNK_TOKENS, so a cancelled request still stops within one call.
    stream_interval: int = 1


@dataclass(frozen=True)
class GpuSpec:
    """The GPU the trtllm engines are planned for (memory plan, node affinity) and how many one node holds."""

    name: str = "NVIDIA-H100-80GB-HBM3"
    memory_gib: float = 80.0
    count: int = 1
    # GPUs of one node: when tp_size x pp_size exceeds it, `pipeline deploy` writes a LeaderWorkerSet
    # whose group spans ceil(tp_size x pp_size / gpus_per_node) nodes (pipeline/lws.py).
    gpus_per_node: int = 8
    compute_capability: float | None = None  # overrides the lookup of `name` in pipeline/gpus.py (e.g. 9.0)


@dataclass(frozen=True)
class OutputSpec:
    """Where results go; relative paths resolve against the spec file's folder."""

    dir: Path = Path("out")  # out/<spec name>/{engines,model_repo,trtllm,manifest.json}
    cache_dir: Path = Path(".cache/engines")  # content-addressed step outputs, shared by specs


@dataclass(frozen=True)
class SecuritySpec:
    """Weight loading policy: safetensors only unless pickle is allowed explicitly."""

    allow_pickle_weights: bool = False


@dataclass(frozen=True)
class Models:
    """The target, and the draft model for draft_target mode."""

    target: ModelSpec
    draft: ModelSpec | None = None


@dataclass(frozen=True)
class Spec:
    """A whole deployment: models, speculation, engine limits, serving, GPU, outputs."""

    name: str
    models: Models
    speculative: SpeculativeSpec = field(default_factory=SpeculativeSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    serving: ServingSpec = field(default_factory=ServingSpec)
    gpu: GpuSpec = field(default_factory=GpuSpec)
    toolchain: Toolchain = "auto"
    output: OutputSpec = field(default_factory=OutputSpec)
    security: SecuritySpec = field(default_factory=SecuritySpec)
    source: Path | None = None  # the YAML file it came from (not a YAML key)

    @property
    def out_dir(self) -> Path:
        """The folder of this spec's results: output.dir / name."""
        return self.output.dir / self.name

    @property
    def engine_models(self) -> list[tuple[str, ModelSpec]]:
        """(role, model) pairs that get an engine: the target, and the draft when the mode has a draft engine."""
        roles = [("target", self.models.target)]
        if traits(self.speculative.mode).has_draft_engine:
            roles.append(("draft", self.models.draft))
        return roles


# ----------------------------------------------------------------------------- loading


def load_spec(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (), check_paths: bool = True) -> Spec:
    """Read a YAML spec, apply `key.path=value` overrides, validate, and return a `Spec`.

    Relative paths resolve against the spec file's folder. Raises `SpecError`.
    """
    path = Path(path)
    if not path.is_file():
        raise SpecError("spec", f"file {path} does not exist", "pass the path of a spec YAML file (see examples/)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise SpecError("spec", f"{path} is not valid YAML{where}", "fix the YAML syntax") from None
    if not isinstance(raw, dict):
        raise SpecError("spec", f"{path} must hold a mapping at the top level", "start from a file in examples/")
    for item in overrides:
        apply_override(raw, item)
    return parse_spec(raw, base_dir=path.resolve().parent, source=path.resolve(), check_paths=check_paths)


def apply_override(raw: dict, item: str) -> None:
    """Set one `a.b.c=value` override in a raw spec mapping; the value is parsed as YAML."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SpecError("--set", f"{item!r} is not KEY=VALUE", "write e.g. --set models.target.qformat=int8_wo")
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise SpecError(key, f"{part} is not a section", "override a field inside a section")
        node = child
    node[parts[-1]] = yaml.safe_load(value)


def parse_spec(raw: dict, base_dir: Path, source: Path | None = None, check_paths: bool = True) -> Spec:
    """Validate a raw mapping into a `Spec` (types, unknown keys, paths, combinations)."""
    if "source" in raw:
        raise SpecError("source", "is not a spec field", "remove it")
    spec = _convert(Spec, raw, "", base_dir)
    # Defaults (not written in the YAML) are relative to the working directory.
    output = OutputSpec(dir=spec.output.dir.resolve(), cache_dir=spec.output.cache_dir.resolve())
    spec = dataclasses.replace(spec, source=source, output=output)
    check_combinations(spec)
    if check_paths:
        check_spec_paths(spec)
    return spec


def _convert(tp: Any, value: Any, path: str, base_dir: Path) -> Any:
    """Convert a YAML value to the annotated type `tp`, raising SpecError at `path`."""
    origin = typing.get_origin(tp)
    where = path or "spec"
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, path, base_dir)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"use one of {', '.join(map(str, choices))}"
            raise SpecError(where, f"{value!r} is not allowed", fix)
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise SpecError(where, f"expected a section (mapping), got {_kind(value)}", "indent its fields under it")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp) if f.name != "source"}
        for key in value:
            if key not in fields:
                hint = difflib.get_close_matches(str(key), list(fields), n=1)
                fix = f"did you mean {hint[0]!r}?" if hint else f"known fields: {', '.join(fields)}"
                raise SpecError(_join(path, key), "unknown field", fix)
        kwargs = {}
        for name, f in fields.items():
            if name in value:
                kwargs[name] = _convert(hints[name], value[name], _join(path, name), base_dir)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SpecError(_join(path, name), "is required", f"add {name}: to {where}")
        return tp(**kwargs)
    if tp is Path:
        if not isinstance(value, str) or not value:
            raise SpecError(where, f"expected a path string, got {_kind(value)}", "write a folder path")
        p = Path(os.path.expandvars(os.path.expanduser(value)))
        return p if p.is_absolute() else (base_dir / p).resolve()
    if origin is tuple:  # tuple[tuple[int, ...], ...]: tree choices
        if not isinstance(value, list):
            raise SpecError(where, f"expected a list, got {_kind(value)}", "write e.g. [[0], [0, 0], [1]]")
        (inner, _ellipsis) = typing.get_args(tp)
        return tuple(_convert(inner, v, f"{where}[{i}]", base_dir) for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(where, f"expected true or false, got {_kind(value)}", "write true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(where, f"expected an integer, got {_kind(value)}", "write a whole number")
        if value < 0:
            raise SpecError(where, f"{value} is negative", "use a value >= 0")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(where, f"expected a number, got {_kind(value)}", "write a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str) or not value:
            raise SpecError(where, f"expected a non-empty string, got {_kind(value)}", "write a string")
        return value
    raise TypeError(f"spec type {tp!r} at {where} is not handled")  # a bug in this module, not in the spec


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _kind(value: Any) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {value!r}"


# ----------------------------------------------------------------------------- semantic checks


def check_combinations(spec: Spec) -> None:
    """Reject impossible combinations with the field that must change (every toolchain's; a toolchain's own
    rules are in pipeline/rules.py)."""
    s, e = spec.speculative, spec.engine
    if not spec.name.replace("-", "").replace("_", "").isalnum():
        raise SpecError("name", f"{spec.name!r} has characters other than letters, digits, - and _", "rename it")
    if spec.serving.streaming and not spec.serving.decoupled:
        raise SpecError("serving.streaming", "streams only from decoupled models (serving.decoupled: false)",
                        "set serving.streaming: false, or serving.decoupled: true")
    for key in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "tp_size", "pp_size"):
        if getattr(e, key) < 1:
            raise SpecError(f"engine.{key}", "must be at least 1", "set a positive value")
    if spec.gpu.gpus_per_node < 1:
        raise SpecError("gpu.gpus_per_node", "must be at least 1", "set the number of GPUs one node holds, e.g. 8")
    if e.max_input_len >= e.max_seq_len:
        raise SpecError("engine.max_input_len", f"{e.max_input_len} leaves no room for output in max_seq_len {e.max_seq_len}",
                        "raise engine.max_seq_len above max_input_len")
    if e.max_num_tokens < e.max_batch_size:
        raise SpecError("engine.max_num_tokens", f"{e.max_num_tokens} is below max_batch_size {e.max_batch_size}",
                        "raise max_num_tokens")
    if e.tp_size * e.pp_size > spec.gpu.count:
        raise SpecError("gpu.count", f"{spec.gpu.count} GPUs cannot hold tp_size x pp_size = {e.tp_size * e.pp_size}",
                        "raise gpu.count or lower engine.tp_size / engine.pp_size")
    if s.num_draft_tokens > s.max_draft_len:
        raise SpecError("speculative.num_draft_tokens",
                        f"{s.num_draft_tokens} is larger than speculative.max_draft_len ({s.max_draft_len})",
                        "lower num_draft_tokens or raise max_draft_len")
    mode = traits(s.mode)
    present = {"models.draft": spec.models.draft, "speculative.medusa": s.medusa, "speculative.eagle": s.eagle}
    for where, value in present.items():
        if value is not None and mode.requires != where:
            raise SpecError(where, f"is set but speculative.mode is {s.mode!r}",
                            f"remove {where} or set speculative.mode to the mode that uses it")
    if mode.requires is not None and present[mode.requires] is None:
        raise SpecError(mode.requires, f"is required for speculative.mode {s.mode!r}", f"add the {mode.requires} section")
    if s.ngram is not None and not mode.prompt_lookup:
        raise SpecError("speculative.ngram", f"is set but speculative.mode is {s.mode!r}", "remove it or use mode ngram")
    if s.mtp is not None and not mode.drafts_in_target:
        raise SpecError("speculative.mtp", f"is set but speculative.mode is {s.mode!r}", "remove it or use mode mtp")
    check_mode_toolchain(spec, spec.toolchain)
    if s.mtp is not None:
        if s.mtp.relaxed_topk < 1:
            raise SpecError("speculative.mtp.relaxed_topk", "must be at least 1", "use 1 (strict) or e.g. 10")
        if s.mtp.relaxed_delta < 0:
            raise SpecError("speculative.mtp.relaxed_delta", f"{s.mtp.relaxed_delta} is negative", "use e.g. 0.6")
        if not s.mtp.relaxed_acceptance and (s.mtp.relaxed_topk, s.mtp.relaxed_delta) != (1, 0.0):
            raise SpecError("speculative.mtp.relaxed_topk", "relaxed_topk / relaxed_delta act only with relaxed acceptance",
                            "set speculative.mtp.relaxed_acceptance: true, or remove them")
    if not mode.speculates:
        if s.max_draft_len or s.num_draft_tokens:
            raise SpecError("speculative.max_draft_len", "draft lengths are set but speculative.mode is 'none'",
                            "set speculative.mode or remove max_draft_len / num_draft_tokens")
    else:
        if s.max_draft_len < 1:
            raise SpecError("speculative.max_draft_len", f"must be at least 1 for mode {s.mode!r}", "set e.g. max_draft_len: 8")
        if s.num_draft_tokens < 1:
            raise SpecError("speculative.num_draft_tokens", f"must be at least 1 for mode {s.mode!r}",
                            "set e.g. num_draft_tokens: 4")
    if s.use_draft_logits and not mode.has_draft_engine:
        raise SpecError("speculative.use_draft_logits", f"needs a draft model, but mode is {s.mode!r}",
                        "set it to false or use mode draft_target")
    if s.ngram is not None and not 1 <= s.ngram.min_ngram <= s.ngram.max_ngram:
        raise SpecError("speculative.ngram.min_ngram", "must be between 1 and max_ngram", "fix min_ngram / max_ngram")
    if s.ngram is not None and not 0 <= s.ngram.min_token_prob < 1:
        raise SpecError("speculative.ngram.min_token_prob", f"{s.ngram.min_token_prob} is not in [0, 1)",
                        "set e.g. min_token_prob: 0.4 (0 drafts the whole continuation)")
    for name, tree in (("medusa", s.medusa), ("eagle", s.eagle)):
        if tree is not None:
            check_tree_choices(f"speculative.{name}.choices", tree.choices, s.max_draft_len)
    if s.eagle is not None:
        if e.pp_size > 1:
            raise SpecError("engine.pp_size", "EAGLE does not support pipeline parallelism in TensorRT-LLM 1.2.1",
                            "set engine.pp_size: 1 (use tp_size)")
        if spec.toolchain == "trtllm" and s.eagle.version == 3:
            raise SpecError("speculative.eagle.version", "EAGLE-3 has no TensorRT engine converter in TensorRT-LLM 1.2.1",
                            "use EAGLE-1/2 weights, or toolchain: trtllm-llmapi or reference")
        if s.eagle.layers_to_capture is not None and s.eagle.version != 3:
            raise SpecError("speculative.eagle.layers_to_capture", f"is for EAGLE-3 heads, but version is {s.eagle.version}",
                            "remove it, or set version: 3")
        depth = max(len(c) for c in s.eagle.choices)
        if depth > s.eagle.num_layers:
            raise SpecError("speculative.eagle.num_layers", f"{s.eagle.num_layers} is shallower than the deepest choice ({depth})",
                            f"set num_layers: {depth}")
    kv = spec.serving.kv_cache_free_gpu_mem_fraction
    for name in ("target", "draft"):
        value = getattr(kv, name)
        if value is not None and not 0 < value < 1:
            raise SpecError(f"serving.kv_cache_free_gpu_mem_fraction.{name}", f"{value} is not between 0 and 1",
                            "use e.g. 0.4, or leave it out for the memory plan's choice")
    if kv.draft is not None and spec.models.draft is None:
        raise SpecError("serving.kv_cache_free_gpu_mem_fraction.draft", "is set but there is no draft model", "remove it")
    if kv.target is not None and kv.draft is not None and kv.target + kv.draft >= 1:
        raise SpecError("serving.kv_cache_free_gpu_mem_fraction", f"target + draft = {kv.target + kv.draft:.2f} >= 1",
                        "lower them so both engines fit")
    for name in ("drain_timeout_s", "stall_timeout_s"):
        if not 0 < getattr(spec.serving, name) < 86400:
            raise SpecError(f"serving.{name}", f"{getattr(spec.serving, name)} is not between 0 and 86400 seconds",
                            "use e.g. 60")
    if not 1 <= spec.serving.stream_interval <= PLAIN_CHUNK_TOKENS:
        raise SpecError("serving.stream_interval", f"{spec.serving.stream_interval} is not between 1 and "
                        f"{PLAIN_CHUNK_TOKENS} tokens (a call of more could not be cancelled within it)",
                        "use 1 to stream every step, or e.g. 8")
    ports = [spec.serving.http_port, spec.serving.grpc_port, spec.serving.metrics_port]
    if len(set(ports)) != 3 or not all(0 < p < 65536 for p in ports):
        raise SpecError("serving.http_port", f"ports {ports} must be distinct and in 1..65535", "pick three free ports")


def check_mode_toolchain(spec: Spec, toolchain: str) -> None:
    """A mode that only some toolchains run (modes.ModeTraits.toolchains) is refused on the others."""
    allowed = traits(spec.speculative.mode).toolchains
    if allowed is not None and toolchain not in allowed:
        raise SpecError("toolchain", f"{toolchain} cannot run speculative.mode {spec.speculative.mode} (TensorRT-LLM runs it "
                        "on its PyTorch backend only: no TensorRT engine, no reference engine)",
                        f"use toolchain: {' or '.join(allowed)}")


def check_tree_choices(path: str, choices: tuple[tuple[int, ...], ...], max_draft_len: int) -> None:
    """A token tree: non-empty paths of non-negative ints, unique, each prefix present, at most max_draft_len nodes."""
    if not choices:
        raise SpecError(path, "is empty", "give at least one path, e.g. [[0]]")
    seen = set(choices)
    if len(seen) != len(choices):
        raise SpecError(path, "has a repeated path", "remove duplicates")
    for c in choices:
        if not c:
            raise SpecError(path, "has an empty path", "every path needs at least one index")
        if len(c) > 1 and c[:-1] not in seen:
            raise SpecError(path, f"path {list(c)} has no parent {list(c[:-1])}", f"add {list(c[:-1])}")
    if len(choices) > max_draft_len:
        raise SpecError(path, f"{len(choices)} tree nodes exceed speculative.max_draft_len ({max_draft_len})",
                        f"raise max_draft_len to {len(choices)} or prune the tree")


def named_checkpoints(spec: Spec) -> list[tuple[str, Path]]:
    """(field path, folder) of every checkpoint the spec names."""
    named = [("models.target.checkpoint", spec.models.target.checkpoint)]
    if spec.models.draft is not None:
        named.append(("models.draft.checkpoint", spec.models.draft.checkpoint))
    if spec.speculative.medusa is not None:
        named.append(("speculative.medusa.checkpoint", spec.speculative.medusa.checkpoint))
    if spec.speculative.eagle is not None:
        named.append(("speculative.eagle.checkpoint", spec.speculative.eagle.checkpoint))
    return named


def check_spec_paths(spec: Spec) -> None:
    """Every checkpoint folder named in the spec exists."""
    for where, p in named_checkpoints(spec):
        if not p.exists():
            raise SpecError(where, f"{p} does not exist",
                            "run `make models` for the default checkpoints, or point it at a Hugging Face checkpoint folder")


def to_dict(obj: Any) -> Any:
    """A spec (or part of one) as plain YAML-able data; used for step keys and for rendering."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name != "source"}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj
