"""The trtllm toolchain: TensorRT-LLM 1.2.1 command lines for a plan, as one shell script for a GPU host.

Each plan step becomes one command (the architecture's convert_checkpoint.py, the Medusa / EAGLE
converter, or quantize.py for calibrated qformats; then trtllm-build). The script runs as is inside
nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3: `set -euo pipefail`, every path a variable
that the environment may override, a version check, and the same content-addressed cache as the
reference toolchain (a step whose key folder exists is skipped; a step writes KEY.tmp and renames).

`check_command` validates a command against the argparse facts in
pipeline/contracts/trtllm-1.2.1-cli.json (flag names, types, choices) and their documented
incompatibilities; `render_script` runs it on every command it emits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pipeline
from pipeline import stack
from pipeline.modes import traits
from pipeline.gpus import check_gpu_rules, dtype_notices
from pipeline.spec import CALIBRATED_QFORMATS, Spec, SpecError
from specbuild.execute import write_if_changed
from specbuild.plan import Plan, Step, resolve_toolchain

CONTRACT = Path(pipeline.__file__).parent / "contracts" / "trtllm-1.2.1-cli.json"
# Script paths under $TRTLLM_EXAMPLES (TensorRT-LLM 1.2.1 layout), by contract tool name.
SCRIPTS = {
    "convert_checkpoint_llama": "models/core/llama/convert_checkpoint.py",
    "convert_checkpoint_medusa": "medusa/convert_checkpoint.py",
    "convert_checkpoint_eagle": "eagle/convert_checkpoint.py",
    "quantize": "quantization/quantize.py",
}
LLAMA_CONVERTER_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM")  # Mistral converts with the Llama example
WEIGHT_ONLY_PRECISION = {"int8_wo": "int8", "int4_wo": "int4"}
MODEL_DIR_VARS = {"target": "TARGET_MODEL_DIR", "draft": "DRAFT_MODEL_DIR"}


# The scripts' cache rule, shared with the other GPU toolchains' scripts.
RUN_STEP_FUNCTION = (
    "# run_step KEY LABEL COMMAND...: skip a step whose output is cached; otherwise write KEY.tmp, rename on success.",
    "run_step() {",
    '  local key="$1" label="$2"; shift 2',
    '  if [ -d "$CACHE_DIR/$key" ]; then echo "[$label] cached ($key)"; return 0; fi',
    '  rm -rf "$CACHE_DIR/$key.tmp"; mkdir -p "$CACHE_DIR"',
    '  echo "[$label] running ($key)"; local start=$SECONDS',
    '  "$@"',
    '  mv "$CACHE_DIR/$key.tmp" "$CACHE_DIR/$key"',
    '  echo "[$label] done in $((SECONDS - start)) s"',
    "}",
)


# Refuse to run outside the pinned TensorRT-LLM (engines and LLM API key spellings are tied to it).
VERSION_CHECK = (
    "python3 - <<'PY'",
    "import importlib.metadata, sys",
    "version = importlib.metadata.version('tensorrt_llm')",
    f"if version != '{stack.TRTLLM_VERSION}':",
    f"    sys.exit(f'error: tensorrt_llm {{version}} is installed; fix: run inside {stack.TRITON_IMAGE} (TensorRT-LLM {stack.TRTLLM_VERSION})')",
    "PY",
)


@dataclass(frozen=True)
class Command:
    """One command line: `tool` names its entry in the contract file; `args` are its arguments."""

    tool: str
    args: tuple[str, ...]

    def argv(self) -> list[str]:
        """The program and its arguments (paths as shell variables)."""
        if self.tool == "trtllm-build":
            return ["trtllm-build", *self.args]
        return ["python3", f"$TRTLLM_EXAMPLES/{SCRIPTS[self.tool]}", *self.args]


# ----------------------------------------------------------------------------- commands


def step_command(plan: Plan, step: Step) -> Command:
    """The TensorRT-LLM command of one plan step; its output goes to $CACHE_DIR/<key>.tmp."""
    out = f"$CACHE_DIR/{step.key}.tmp"
    if step.kind == "build":
        upstream = next(s for s in plan.steps if s.key == step.upstream)
        ranks = upstream.params["tp_size"] * upstream.params["pp_size"]
        # trtllm-build builds every rank on one host, rank r on GPU r % workers (build.py parallel_build):
        # an engine spanning nodes builds on one node's GPUs.
        return build_command(step, f"$CACHE_DIR/{step.upstream}", out, min(ranks, plan.spec.gpu.gpus_per_node))
    return convert_command(plan.spec, step, out)


def convert_command(spec: Spec, step: Step, out: str) -> Command:
    """convert_checkpoint.py (Llama / Medusa / EAGLE) or quantize.py for one model."""
    p = step.params
    role, qformat, kv = step.role, p["qformat"], p["kv_cache_dtype"]
    where = f"models.{role}"
    common = ["--model_dir", f"${MODEL_DIR_VARS[role]}", "--output_dir", out, "--dtype", p["dtype"],
              "--tp_size", str(p["tp_size"]), "--pp_size", str(p["pp_size"])]
    weight_only = ["--use_weight_only", "--weight_only_precision", WEIGHT_ONLY_PRECISION[qformat]] if qformat in WEIGHT_ONLY_PRECISION else []
    kv_flag = {"none": [], "int8": ["--int8_kv_cache"], "fp8": ["--fp8_kv_cache"]}[kv]
    ranks = p["tp_size"] * p["pp_size"]
    workers = ["--workers", str(ranks)] if ranks > 1 else []  # converters write one rank file per worker

    if "eagle" in p:
        e = p["eagle"]
        if p["architecture"] not in LLAMA_CONVERTER_ARCHS:
            raise SpecError("models.target.checkpoint", f"TensorRT-LLM 1.2.1's EAGLE converter reads Llama configs only, not {p['architecture']}",
                            "use toolchain: reference, or a Llama/Mistral target")
        if qformat in CALIBRATED_QFORMATS or kv != "none":
            raise SpecError(f"{where}.qformat" if qformat in CALIBRATED_QFORMATS else f"{where}.kv_cache_dtype",
                            "TensorRT-LLM 1.2.1's EAGLE converter has no calibrated quantization",
                            "use qformat none / int8_wo / int4_wo and kv_cache_dtype none, or toolchain: reference")
        return Command("convert_checkpoint_eagle", tuple(common + workers + weight_only + [
            "--eagle_model_dir", "$EAGLE_DIR", "--max_draft_len", str(e["max_draft_len"]),
            "--num_eagle_layers", str(e["num_eagle_layers"]), "--max_non_leaves_per_layer", str(e["max_non_leaves_per_layer"])]))

    medusa = []
    if "medusa" in p:
        m = p["medusa"]
        if not m["has_lm_heads"]:
            raise SpecError("speculative.medusa.checkpoint", "the heads have no per-head LM head ({h}.{L}.weight), which "
                            "TensorRT-LLM 1.2.1's converter reads", "add each head's LM head (a copy of the target's "
                            "lm_head.weight), or use toolchain: reference")
        medusa = ["--medusa_model_dir", "$MEDUSA_DIR", "--num_medusa_heads", str(m["num_heads"]),
                  "--num_medusa_layers", str(m["num_layers"])]

    needs_quantize = qformat in CALIBRATED_QFORMATS or (kv == "fp8" and "medusa" in p) \
        or p["architecture"] not in LLAMA_CONVERTER_ARCHS
    if needs_quantize:
        # ModelOpt PTQ/export: calibrated qformats, FP8 KV for Medusa, and Qwen2 (its converter is not in our contract facts)
        args = common + ["--qformat", qformat if qformat != "none" else "full_prec", "--calib_size", str(p.get("calib_size", 512))]
        if kv != "none":
            args += ["--kv_cache_dtype", kv]
        if qformat in ("int4_awq", "int4_wo"):
            args += ["--awq_block_size", str(p["group_size"])]
        if medusa:
            args += medusa + ["--max_draft_len", str(p["medusa"]["max_draft_len"])]
        return Command("quantize", tuple(args))
    if medusa:
        model_type = ["--model_type", "qwen2"] if p["architecture"] == "Qwen2ForCausalLM" else []
        return Command("convert_checkpoint_medusa", tuple(common + workers + weight_only + kv_flag + medusa + model_type + [
            "--max_medusa_token_len", str(p["medusa"]["max_draft_len"])]))
    return Command("convert_checkpoint_llama", tuple(common + workers + weight_only + kv_flag))


def build_command(step: Step, checkpoint: str, out: str, workers: int = 1) -> Command:
    """trtllm-build for one engine: limits, paged KV with paged context FMHA, speculative flags, one worker per GPU."""
    p = step.params
    args = ["--checkpoint_dir", checkpoint, "--output_dir", out,
            "--max_batch_size", str(p["max_batch_size"]), "--max_input_len", str(p["max_input_len"]),
            "--max_seq_len", str(p["max_seq_len"]), "--max_num_tokens", str(p["max_num_tokens"]),
            "--gemm_plugin", "auto", "--kv_cache_type", "paged", "--tokens_per_block", str(p["tokens_per_block"])]
    if p["use_paged_context_fmha"]:  # KV reuse (needed by draft-target) requires paged context FMHA
        args += ["--use_paged_context_fmha", "enable"]
    mode = p["speculative_decoding_mode"]
    if mode is not None:
        args += ["--speculative_decoding_mode", mode]
    if mode == "draft_tokens_external":
        args += ["--max_draft_len", str(p["max_draft_len"])]  # medusa/eagle: the converter wrote it into the checkpoint
    if p["gather_generation_logits"]:
        args += ["--gather_generation_logits"]
    if workers > 1:
        args += ["--workers", str(workers)]
    return Command("trtllm-build", tuple(args))


def check_plan_rules(spec: Spec) -> None:
    """Rules of the trtllm toolchain that the reference toolchain does not have."""
    check_gpu_rules(spec)
    e = spec.speculative.eagle
    if e is not None and e.version == 3:
        raise SpecError("speculative.eagle.version", "EAGLE-3 has no TensorRT engine converter in TensorRT-LLM 1.2.1",
                        "use toolchain: trtllm-llmapi (PyTorch backend) or reference")
    if e is not None:
        depth = max(len(c) for c in e.choices)
        if depth != e.num_layers:
            raise SpecError("speculative.eagle.num_layers", f"TensorRT-LLM 1.2.1 needs it equal to the deepest eagle choice ({depth})",
                            f"set num_layers: {depth}")
        for level in range(depth):
            parents = {c[:level + 1] for c in e.choices if len(c) > level + 1}
            if len(parents) > e.max_non_leaves_per_layer:
                raise SpecError("speculative.eagle.max_non_leaves_per_layer",
                                f"level {level} of the tree has {len(parents)} non-leaf nodes", f"set it to at least {len(parents)}")


# ----------------------------------------------------------------------------- contract


@lru_cache(maxsize=None)
def contract() -> dict:
    """The argparse facts of TensorRT-LLM 1.2.1's tools (pipeline/contracts/trtllm-1.2.1-cli.json)."""
    return json.loads(CONTRACT.read_text())


class ContractError(ValueError):
    """A generated command that TensorRT-LLM 1.2.1 would reject."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ContractError(message)


@lru_cache(maxsize=None)
def contract_parser(tool: str) -> argparse.ArgumentParser:
    """An argparse parser rebuilt from the contract's facts for `tool` (names, aliases, types, choices, nargs)."""
    facts = contract()[tool]
    parser = _Parser(prog=tool, add_help=False, allow_abbrev=False, exit_on_error=False)
    types = {"int": int, "float": float}
    for arg in facts.get("args", []) + facts.get("plugin_args", []):
        if not arg["name"].startswith("-"):
            continue  # positionals (fill_template) are not generated here
        names = [arg["name"], *arg.get("aliases", [])]
        if arg.get("action") == "store_true":
            parser.add_argument(*names, action="store_true")
            continue
        kwargs = {"type": types.get(str(arg.get("type")), str)}
        default = arg.get("default")
        if default is not None and not (isinstance(default, str) and kwargs["type"] is not str):
            kwargs["default"] = None if str(default).startswith("argparse.SUPPRESS") else default
        if isinstance(arg.get("choices"), list):
            choices = [c for c in arg["choices"] if c is not None]
            kwargs["choices"] = choices
            if str(arg.get("type", "")).startswith("enum"):
                kwargs["type"] = str.lower  # parsed case-insensitively
        if arg.get("nargs") is not None:
            kwargs["nargs"] = arg["nargs"]
            if arg["nargs"] == "?":
                kwargs["const"] = arg.get("const")
        parser.add_argument(*names, **kwargs)
    return parser


def check_command(command: Command) -> argparse.Namespace:
    """Parse a command with the contract's parser and apply the documented incompatibilities."""
    try:
        ns, unknown = contract_parser(command.tool).parse_known_args(list(command.args))
    except argparse.ArgumentError as exc:
        raise ContractError(f"{command.tool}: {exc}") from None
    if unknown:
        raise ContractError(f"{command.tool}: unknown arguments {unknown}")
    if command.tool == "trtllm-build":
        if ns.gather_context_logits and ns.max_draft_len > 0:
            raise ContractError("trtllm-build: --gather_context_logits with --max_draft_len > 0 raises RuntimeError")
        if ns.multiple_profiles == "enable" and ns.opt_num_tokens is not None:
            raise ContractError("trtllm-build: --multiple_profiles enable with --opt_num_tokens raises RuntimeError")
        if ns.speculative_decoding_mode == "draft_tokens_external" and ns.max_draft_len < 1:
            raise ContractError("trtllm-build: draft_tokens_external needs --max_draft_len N on the target")
        if ns.streamingllm == "enable":
            raise ContractError("trtllm-build: StreamingLLM is no longer supported")
    elif command.tool == "quantize":
        if (ns.model_dir is None) == (ns.nemo_ckpt_path is None):
            raise ContractError("quantize.py: exactly one of --model_dir / --nemo_ckpt_path")
    elif command.tool == "convert_checkpoint_eagle":
        if ns.pp_size != 1:
            raise ContractError("eagle convert_checkpoint.py: pipeline parallelism is not supported")
    elif command.tool == "convert_checkpoint_medusa":
        if ns.max_medusa_token_len < 1 or ns.model_type not in ("llama", "mixtral", "qwen2"):
            raise ContractError("medusa convert_checkpoint.py: --max_medusa_token_len > 0 and model_type llama/mixtral/qwen2")
    return ns


# ----------------------------------------------------------------------------- script


def render_script(plan: Plan) -> str:
    """The whole trtllm plan as one bash script a GPU host runs as is inside the Triton TRT-LLM container."""
    spec = plan.spec
    check_plan_rules(spec)
    commands = [(step, step_command(plan, step)) for step in plan.steps]
    for _step, command in commands:
        check_command(command)
    variables = {
        "TRTLLM_EXAMPLES": stack.TRTLLM_EXAMPLES,
        "CACHE_DIR": str(spec.output.cache_dir / "trtllm"),
        "ENGINES_DIR": str(spec.out_dir / "trtllm" / "engines"),
        "TARGET_MODEL_DIR": str(spec.models.target.checkpoint),
    }
    if traits(plan.spec.speculative.mode).has_draft_engine:
        variables["DRAFT_MODEL_DIR"] = str(spec.models.draft.checkpoint)
    if spec.speculative.medusa is not None:
        variables["MEDUSA_DIR"] = str(spec.speculative.medusa.checkpoint)
    if spec.speculative.eagle is not None:
        variables["EAGLE_DIR"] = str(spec.speculative.eagle.checkpoint)
    source = spec.source.name if spec.source else "SPEC"
    lines = [
        "#!/usr/bin/env bash",
        f"# TensorRT-LLM {stack.TRTLLM_VERSION} engines for spec '{spec.name}' (build key {plan.build_key}).",
        f"# Generated by `python -m pipeline plan {source} --dry-run`; regenerate instead of editing.",
        f"# Run on a GPU host inside {stack.TRITON_IMAGE}, e.g.",
        f"#   docker run --rm --gpus all -v /models:/models -v $PWD:$PWD -w $PWD {stack.TRITON_IMAGE} bash build_engines.sh",
        "# Every path below may be overridden from the environment (e.g. TARGET_MODEL_DIR=/models/x bash build_engines.sh).",
        *(f"# {notice}" for notice in dtype_notices(spec)),
        "set -euo pipefail",
        "",
    ]
    lines += [f'{name}="${{{name}:-{value}}}"' for name, value in variables.items()]
    lines += [
        "",
        "# The pinned stack: engines built by another TensorRT-LLM do not load in this Triton container.",
        *VERSION_CHECK,
        "",
        *RUN_STEP_FUNCTION,
        "",
    ]
    for step, command in commands:
        argv = " ".join(shell_quote(a) for a in command.argv())
        lines.append(f"run_step {step.key} {step.label} {argv}")
    lines += ["", 'mkdir -p "$ENGINES_DIR"']
    for role in plan.roles:
        lines.append(f'ln -sfn "$CACHE_DIR/{plan.engine_step(role).key}" "$ENGINES_DIR/{role}"')
    lines.append('echo "engines ready in $ENGINES_DIR: ' + " ".join(plan.roles) + '"')
    return "\n".join(lines) + "\n"


def shell_quote(arg: str) -> str:
    """Shell-quote an argument, keeping $VARIABLES expandable (double quotes)."""
    if "$" in arg:
        return '"' + arg.replace('"', '\\"') + '"'
    return shlex.quote(arg)


def parse_script(script: str) -> list[tuple[str, str, Command]]:
    """(key, label, command) of every run_step line of a rendered script (for tests and reviews)."""
    steps = []
    tools = {path: tool for tool, path in SCRIPTS.items()}
    for line in script.splitlines():
        if not line.startswith("run_step "):
            continue
        _, key, label, program, *rest = shlex.split(line)
        if program == "trtllm-build":
            steps.append((key, label, Command("trtllm-build", tuple(rest))))
        else:
            script_path, *args = rest
            steps.append((key, label, Command(tools[script_path.removeprefix("$TRTLLM_EXAMPLES/")], tuple(args))))
    return steps


def versions() -> dict:
    """The versions a trtllm step's output depends on: the pinned serving container's stack."""
    return {"tensorrt_llm": stack.TRTLLM_VERSION, "tensorrt": stack.TENSORRT_VERSION,
            "triton_container": stack.TRITON_CONTAINER_TAG}


def build_script(plan: Plan) -> str:
    """The shell script a GPU host runs (render_script)."""
    return render_script(plan)


def build(plan: Plan) -> int:
    """The `engines` command: write the GPU script; run it here only when TensorRT-LLM and a GPU are present."""
    spec = plan.spec
    script = spec.out_dir / "trtllm" / "build_engines.sh"
    write_if_changed(script, render_script(plan))
    script.chmod(0o755)
    if resolve_toolchain(dataclasses.replace(spec, toolchain="auto"))[0] != "trtllm":
        print(f"wrote {script}: it must run on a GPU host inside the Triton TensorRT-LLM container (see docs/trtllm.md)")
        return 0
    return subprocess.call(["bash", str(script)], stdout=sys.stdout, stderr=sys.stderr)
