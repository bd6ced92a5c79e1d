"""The build plan: per model, ordered steps (convert or quantize, then build), each with a content key.

A step's key is a hash of its inputs' digests (checkpoint files or the upstream step's key), its
parameters (the part of the spec it depends on) and the toolchain versions. The execute stage skips
a step whose key is already in the cache; the trtllm script does the same on the GPU host.
Changing only the draft's qformat changes only the draft's keys.

This module imports no torch: it reads JSON and hashes files.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import stack
from pipeline.checkpoints import Report, inspect_spec
from pipeline.limits import EngineLimits
from pipeline.modes import traits
from pipeline.rules import check_toolchain_rules
from pipeline.spec import CALIBRATED_QFORMATS, ModelSpec, Spec, SpecError, check_mode_toolchain
from pipeline.gpus import engine_dtype
from pipeline.toolchains import CPU_TOOLCHAIN, GPU_TOOLCHAIN, toolchain_traits

# Files of a Hugging Face checkpoint folder that define the model (weights, configs, tokenizer).
CHECKPOINT_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".jinja", ".bin", ".pt", ".pth")
KEY_LENGTH = 20  # hex characters of sha256 kept in a step key


@dataclass(frozen=True)
class Step:
    """One cached unit of work: `kind` is convert, quantize or build; `role` is target or draft."""

    role: str
    kind: str
    key: str
    params: dict
    inputs: dict  # name -> digest: checkpoint folder digests, or the upstream step's key
    versions: dict
    upstream: str | None = None  # key of the step whose output this one reads

    @property
    def label(self) -> str:
        """Short human name, e.g. `target/quantize`."""
        return f"{self.role}/{self.kind}"


@dataclass
class Plan:
    """All steps of a spec for one toolchain, in execution order."""

    spec: Spec
    toolchain: str
    inspection: Report  # inspect_spec's result: checkpoint facts, head shapes, the memory plan (read once)
    steps: list[Step] = field(default_factory=list)
    # toolchains without an engine build: digests of the folders served as they are (role -> digest),
    # e.g. an unquantized target or EAGLE-3 heads; part of the build key
    served: dict[str, str] = field(default_factory=dict)

    def engine_step(self, role: str) -> Step:
        """The step whose output `role` serves: its engine build, or (no engine build) its quantize step."""
        return [s for s in self.steps if s.role == role][-1]

    @property
    def roles(self) -> list[str]:
        """Models with an engine, target first."""
        return list(dict.fromkeys(s.role for s in self.steps))

    @property
    def build_key(self) -> str:
        """One hash over every engine's key: names a complete set of engines."""
        return _hash({**{role: self.engine_step(role).key for role in self.roles}, **self.served})


# ----------------------------------------------------------------------------- toolchain


def toolchain_versions(toolchain: str) -> dict:
    """The versions a step's output depends on, per toolchain (its module's versions())."""
    from specbuild.toolchains import toolchain_module

    return toolchain_module(toolchain).versions()


def resolve_toolchain(spec: Spec) -> tuple[str, str | None]:
    """(toolchain, notice): `auto` is trtllm where tensorrt_llm imports and a GPU is present, else reference."""
    if spec.toolchain != "auto":
        return spec.toolchain, None
    has_trtllm = importlib.util.find_spec("tensorrt_llm") is not None
    has_gpu = shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()
    if has_trtllm and has_gpu:
        return GPU_TOOLCHAIN, None
    missing = "tensorrt_llm is not installed" if not has_trtllm else "no NVIDIA GPU is visible"
    return CPU_TOOLCHAIN, (f"notice: toolchain auto -> {CPU_TOOLCHAIN} ({missing}); "
                           f"set toolchain: {GPU_TOOLCHAIN} on a GPU host")


# ----------------------------------------------------------------------------- digests


class DigestCache:
    """sha256 of files, remembered by (path, size, mtime) in a JSON file so re-planning is fast."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, list] = {}
        self.dirty = False
        if path is not None and path.is_file():
            try:
                self.entries = json.loads(path.read_text())
            except (OSError, ValueError):
                self.entries = {}

    def file_digest(self, file: Path) -> str:
        """The sha256 hex digest of one file."""
        st = file.stat()
        name = str(file.resolve())
        known = self.entries.get(name)
        if known and known[0] == st.st_size and known[1] == st.st_mtime_ns:
            return known[2]
        with open(file, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        self.entries[name] = [st.st_size, st.st_mtime_ns, digest]
        self.dirty = True
        return digest

    def save(self) -> None:
        """Write the remembered digests (best effort: a read-only cache folder only costs speed)."""
        if not self.dirty or self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.entries))
            os.replace(tmp, self.path)
            self.dirty = False
        except OSError:
            pass


def checkpoint_files(folder: Path) -> list[Path]:
    """The files of a checkpoint folder that define it (top level, no hidden files), sorted."""
    if folder.is_file():
        return [folder]
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix in CHECKPOINT_SUFFIXES)


def folder_digest(folder: Path, digests: DigestCache) -> str:
    """One digest over a checkpoint folder: names and contents of its defining files."""
    return _hash({p.name: digests.file_digest(p) for p in checkpoint_files(folder)})


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:KEY_LENGTH]


# ----------------------------------------------------------------------------- planning


def convert_params(spec: Spec, role: str, model: ModelSpec, inspection: Report) -> dict:
    """What the convert/quantize step of `role` depends on in the spec (and the heads' shapes)."""
    s, e = spec.speculative, spec.engine
    info = inspection.models[role]
    params = {
        "architecture": info.architecture,
        "dtype": model.dtype, "qformat": model.qformat, "kv_cache_dtype": model.kv_cache_dtype,
        "tp_size": e.tp_size, "pp_size": e.pp_size,
    }
    if model.qformat in ("int4_wo", "int4_awq"):
        params["group_size"] = model.group_size
    if model.qformat in CALIBRATED_QFORMATS or model.kv_cache_dtype != "none":
        params["calib_size"] = model.calib_size
    heads_field = traits(s.mode).heads_field if role == "target" else None
    if heads_field == "medusa":
        params["medusa"] = {"max_draft_len": s.max_draft_len, **inspection.heads}
    if heads_field == "eagle":
        net = inspection.heads
        params["eagle"] = {"version": s.eagle.version, "num_eagle_layers": s.eagle.num_layers,
                           "max_draft_len": s.max_draft_len, "max_non_leaves_per_layer": s.eagle.max_non_leaves_per_layer,
                           "net": net}
    return params


def decoding_mode(spec: Spec, role: str) -> str | None:
    """The engine's speculative_decoding_mode: the draft is a plain engine (the BLS asks it for K tokens);
    draft_tokens_external: tokens come from outside the target engine; medusa / eagle: its heads draft."""
    return None if role == "draft" else traits(spec.speculative.mode).engine_decoding_mode


def engine_limits(spec: Spec, role: str) -> EngineLimits:
    """The limits the engine of `role` is built with."""
    s, e = spec.speculative, spec.engine
    return EngineLimits(max_batch_size=e.max_batch_size, max_input_len=e.max_input_len, max_seq_len=e.max_seq_len,
                        max_num_tokens=e.max_num_tokens,
                        max_draft_len=0 if decoding_mode(spec, role) is None else s.max_draft_len,
                        # lossless acceptance compares the draft's q with the target's p: both engines return logits
                        gather_generation_logits=bool(s.use_draft_logits))


def build_params(spec: Spec, role: str) -> dict:
    """What the build step of `role` depends on (hashed into its key): engine limits and speculative flags."""
    limits = engine_limits(spec, role)
    return {
        "max_batch_size": limits.max_batch_size, "max_input_len": limits.max_input_len,
        "max_seq_len": limits.max_seq_len, "max_num_tokens": limits.max_num_tokens,
        "max_draft_len": limits.max_draft_len, "speculative_decoding_mode": decoding_mode(spec, role),
        "gather_generation_logits": limits.gather_generation_logits,
        # paged context FMHA is what KV-cache reuse needs; TensorRT-LLM refuses it with an INT8 KV cache
        "use_paged_context_fmha": dict(spec.engine_models)[role].kv_cache_dtype != "int8",
        "paged_kv_cache": True, "tokens_per_block": limits.tokens_per_block,
    }


def make_plan(spec: Spec, toolchain: str | None = None, digests: DigestCache | None = None,
              inspection: Report | None = None) -> Plan:
    """Every step of `spec` for `toolchain` (default: the spec's, with auto resolved), keys computed.

    The plan carries the inspection (inspect_spec: incompatible checkpoints and impossible memory plans fail
    here, before any work); pass `inspection` to plan the same spec for another toolchain without re-reading.
    """
    toolchain = toolchain or resolve_toolchain(spec)[0]
    check_mode_toolchain(spec, toolchain)
    check_toolchain_rules(spec, toolchain)  # what the planned toolchain refuses (pipeline/rules.py)
    inspection = inspection or inspect_spec(spec)
    for role, info in inspection.models.items():
        if info.llmapi_only and toolchain_traits(toolchain).engine_build:  # no engine path for it here
            raise SpecError(f"models.{role}.checkpoint", f"{info.architecture} is planned for TensorRT-LLM's LLM API only",
                            "use toolchain: trtllm-llmapi")
    own_digests = digests is None
    if own_digests:
        digests = DigestCache(spec.output.cache_dir / "digests.json")
    versions = toolchain_versions(toolchain)
    plan = Plan(spec=spec, toolchain=toolchain, inspection=inspection)
    builds_engines = toolchain_traits(toolchain).engine_build
    for role, model in spec.engine_models:
        if not builds_engines:  # LLM API: the HF checkpoint is served; quantizing it is the only step
            steps = quantize_steps(spec, role, model, versions, digests, inspection)
            plan.steps += steps
            if not steps:
                plan.served[role] = folder_digest(model.checkpoint, digests)
            continue
        params = convert_params(spec, role, model, inspection)
        if toolchain_traits(toolchain).gpu:  # TensorRT-LLM builds no float32 engines (pipeline/gpus.py)
            params["dtype"] = engine_dtype(spec, model)
        inputs = {"checkpoint": folder_digest(model.checkpoint, digests)}
        if "medusa" in params:
            inputs["medusa"] = folder_digest(spec.speculative.medusa.checkpoint, digests)
        if "eagle" in params:
            inputs["eagle"] = folder_digest(spec.speculative.eagle.checkpoint, digests)
        kind = "quantize" if model.qformat in CALIBRATED_QFORMATS else "convert"
        convert = Step(role=role, kind=kind, params=params, inputs=inputs, versions=versions,
                       key=_hash({"kind": kind, "params": params, "inputs": inputs, "versions": versions}))
        bparams = build_params(spec, role)
        binputs = {"checkpoint": convert.key}
        build = Step(role=role, kind="build", params=bparams, inputs=binputs, versions=versions, upstream=convert.key,
                     key=_hash({"kind": "build", "params": bparams, "inputs": binputs, "versions": versions}))
        plan.steps += [convert, build]
    heads = traits(spec.speculative.mode).heads_field
    if not builds_engines and heads is not None:  # heads (EAGLE-3) are read by the server as they are
        plan.served[heads] = folder_digest(getattr(spec.speculative, heads).checkpoint, digests)
    if own_digests:
        digests.save()
    return plan


def quantize_steps(spec: Spec, role: str, model: ModelSpec, versions: dict, digests: DigestCache,
                   inspection: Report) -> list[Step]:
    """For toolchains without an engine build: one ModelOpt quantize step writing a quantized HF checkpoint,
    or none when the model is served as it is."""
    if model.qformat == "none" and model.kv_cache_dtype == "none":
        return []
    params = {"architecture": inspection.models[role].architecture,
              "dtype": model.dtype, "qformat": model.qformat, "kv_cache_dtype": model.kv_cache_dtype,
              "calib_size": model.calib_size}
    if model.qformat == "int4_awq":
        params["group_size"] = model.group_size
    inputs = {"checkpoint": folder_digest(model.checkpoint, digests)}
    return [Step(role=role, kind="quantize", params=params, inputs=inputs, versions=versions,
                 key=_hash({"kind": "quantize", "params": params, "inputs": inputs, "versions": versions}))]


def build_key(spec: Spec, toolchain: str = GPU_TOOLCHAIN) -> str:
    """A stable hash naming the complete engine set of `spec` (default: the GPU engines a cluster builds)."""
    return make_plan(spec, toolchain).build_key
