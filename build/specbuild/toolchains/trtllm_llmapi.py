"""The trtllm-llmapi toolchain: TensorRT-LLM's LLM API (PyTorch backend), served by Triton's llmapi model.

There is no engine build. A quantized model is one ModelOpt step (`hf_ptq.py`, writing a quantized HF
checkpoint into the content-addressed cache, skipped when cached); then Triton starts on the llmapi
repository (`pipeline/repo/llmapi.py`: config.pbtxt + model.yaml from pipeline/llmapi.py). The script
(`render_script`, printed by `make plan`, written as launch_triton.sh by `make repo`) runs inside the
pinned Triton TensorRT-LLM container: ModelOpt steps, then tritonserver as launch_triton_server.py --no-mpi
composes it, as a child the script waits on (the launcher leaves it in the background), with SIGTERM/SIGINT
forwarded and tritonserver's exit status, after SIGTERM draining in-flight requests for EXIT_TIMEOUT_SECS
(serving.drain_timeout_s): the same generator as the trtllm launch script (pipeline/repo/launch.py). No
mpirun: the llmapi model runs at world size 1 (facts in pipeline/contracts/llmapi-facts.md). LAUNCH=0 stops
after the ModelOpt steps (the cluster's build Job). `trtllm_serve_command` is the same configuration for trtllm-serve.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from pipeline import stack
from pipeline.llmapi import MODELOPT_KV_QFORMAT, MODELOPT_QFORMAT, TOOLCHAIN, ContractError, check_rules, contract
from pipeline.repo.assemble import MODEL_CODE_DIR, repo_dir
from pipeline.repo.launch import foreground, server_variables
from pipeline.repo.llmapi import copy_model_code
from pipeline.spec import Spec
from specbuild.execute import write_if_changed
from specbuild.plan import Plan, Step, resolve_toolchain
from specbuild.toolchains.trtllm import RUN_STEP_FUNCTION, VERSION_CHECK, shell_quote

# A checkout of NVIDIA/Model-Optimizer (its examples/llm_ptq/hf_ptq.py) at the version of the container's
# nvidia-modelopt package: the container has the package, not the example scripts.
MODELOPT_DIR = "/opt/Model-Optimizer"
MODEL_DIR_VARS = {"target": "TARGET_MODEL_DIR", "draft": "DRAFT_MODEL_DIR"}


def versions() -> dict:
    """The versions a ModelOpt step's output depends on: the pinned container's TensorRT-LLM (and its ModelOpt)."""
    return {"tensorrt_llm": stack.TRTLLM_VERSION, "triton_container": stack.TRITON_CONTAINER_TAG, "api": "llmapi"}


def cache_dir(spec: Spec) -> Path:
    """Where the ModelOpt steps write (by key)."""
    return spec.output.cache_dir / TOOLCHAIN


def model_dirs(plan: Plan) -> dict[str, Path]:
    """The checkpoint each role serves: its ModelOpt output in the cache, or the spec's checkpoint as it is."""
    spec = plan.spec
    dirs = {"target": spec.models.target.checkpoint}
    if spec.models.draft is not None:
        dirs["draft"] = spec.models.draft.checkpoint
    for step in plan.steps:
        dirs[step.role] = cache_dir(spec) / step.key
    return dirs


def quantize_command(step: Step) -> list[str]:
    """hf_ptq.py for one quantize step, checked against the recorded options; writes $CACHE_DIR/<key>.tmp."""
    p = step.params
    args = ["--pyt_ckpt_path", f"${MODEL_DIR_VARS[step.role]}", "--qformat", MODELOPT_QFORMAT.get(p["qformat"], p["qformat"]),
            "--kv_cache_qformat", MODELOPT_KV_QFORMAT[p["kv_cache_dtype"]], "--calib_size", str(p["calib_size"]),
            "--export_path", f"$CACHE_DIR/{step.key}.tmp"]
    if "group_size" in p:  # int4_awq: the spec's group size
        args += ["--awq_block_size", str(p["group_size"])]
    facts = contract()["modelopt_hf_ptq"]
    options = [a for a in args if a.startswith("--")]
    if set(options) - set(facts["options"]):
        raise ContractError(f"hf_ptq.py options {sorted(set(options) - set(facts['options']))} are not recorded")
    value = dict(zip(args[::2], args[1::2]))
    if value["--qformat"] not in facts["pytorch_backend_loads"]["qformat"] \
            or value["--kv_cache_qformat"] not in facts["pytorch_backend_loads"]["kv_cache_qformat"]:
        raise ContractError(f"hf_ptq.py {value['--qformat']} / KV {value['--kv_cache_qformat']}: not a PyTorch-backend recipe")
    return ["python3", f"$MODELOPT_DIR/{facts['script']}", *args]


def model_code_dir() -> str:
    """NVIDIA's llmapi model code (model.py, helpers.py) inside the container."""
    return contract()["launch"]["container_repo_template"] + "tensorrt_llm/1"


def tritonserver_args(repo: Path, spec: Spec, exit_timeout: str = "$EXIT_TIMEOUT_SECS") -> list[str]:
    """What launch_triton_server.py --model_repo=REPO --no-mpi --exit_timeout N passes to tritonserver (world
    size 1: the llmapi model spawns its own tensor/pipeline-parallel ranks; pipeline/contracts/llmapi-facts.md)."""
    s = spec.serving
    return [f"--model-repository={repo}", f"--exit-timeout-secs={exit_timeout}",
            f"--grpc-port={s.grpc_port}", f"--http-port={s.http_port}", f"--metrics-port={s.metrics_port}",
            *contract()["launch"]["launcher_tritonserver_args"]]


def server_command(repo: Path, spec: Spec, exit_timeout: str) -> list[str]:
    """tritonserver itself, no mpirun (which SIGKILLs its child a few seconds after SIGTERM): the pods' command."""
    return [contract()["launch"]["tritonserver"], *tritonserver_args(repo, spec, exit_timeout)]


def trtllm_serve_command(spec: Spec, model: Path, options_file: Path, host: str = "0.0.0.0") -> list[str]:
    """trtllm-serve with the same LLM API keys (--extra_llm_api_options FILE), OpenAI API on the spec's HTTP port."""
    argv = ["trtllm-serve", str(model), "--host", host, "--port", str(spec.serving.http_port), "--backend", "pytorch",
            "--extra_llm_api_options", str(options_file)]
    known = set(contract()["trtllm_serve"]["options"])
    if {a for a in argv if a.startswith("--")} - known:
        raise ContractError(f"trtllm-serve options {sorted({a for a in argv if a.startswith('--')} - known)} are not recorded")
    return argv


def render_script(plan: Plan) -> str:
    """ModelOpt steps (cached), then Triton on the llmapi repository in the foreground (skipped with LAUNCH=0)."""
    spec = plan.spec
    check_rules(spec)
    repo = repo_dir(spec, TOOLCHAIN)
    variables = {"MODELOPT_DIR": MODELOPT_DIR, "CACHE_DIR": str(cache_dir(spec)),
                 "TARGET_MODEL_DIR": str(spec.models.target.checkpoint), "LLMAPI_REPO": str(repo),
                 "LLMAPI_MODEL_CODE": model_code_dir(), "SPECDEPLOY_ROOT": str(MODEL_CODE_DIR.parent)}
    if any(step.role == "draft" for step in plan.steps):
        variables["DRAFT_MODEL_DIR"] = str(spec.models.draft.checkpoint)
    source = spec.source.name if spec.source else "SPEC"
    lines = [
        "#!/usr/bin/env bash",
        f"# TensorRT-LLM {stack.TRTLLM_VERSION} LLM API (PyTorch backend) for spec '{spec.name}': ModelOpt, then Triton.",
        f"# Generated by `python -m pipeline plan {source} --dry-run` / `repo`; regenerate instead of editing.",
        f"# Run on a GPU host inside {stack.TRITON_IMAGE} with the checkpoints, output folder and",
        "# this repository's model_repo at the host's paths. LAUNCH=0 stops after the ModelOpt steps.",
        "set -euo pipefail",
        "",
        *[f'{name}="${{{name}:-{value}}}"' for name, value in variables.items()],
        *server_variables(spec),
        "",
        "# The pinned stack: the LLM API key spellings in model.yaml are those of this TensorRT-LLM.",
        *VERSION_CHECK,
        "",
        *RUN_STEP_FUNCTION,
        "",
    ]
    if plan.steps:
        script = contract()["modelopt_hf_ptq"]["script"]
        lines.append(f'test -f "$MODELOPT_DIR/{script}" || {{ echo "error: $MODELOPT_DIR/{script} is missing; fix: clone '
                     'NVIDIA/Model-Optimizer at the installed nvidia-modelopt version into MODELOPT_DIR" >&2; exit 1; }')
    for step in plan.steps:
        lines.append(f"run_step {step.key} {step.label} " + " ".join(shell_quote(a) for a in quantize_command(step)))
    lines += [
        "",
        '[ "${LAUNCH:-1}" = 1 ] || { echo "checkpoints ready; LAUNCH=0: not starting Triton"; exit 0; }',
        "",
        "# NVIDIA's llmapi model code from the container (not part of this project), next to the generated model.yaml.",
        f'test -f "$LLMAPI_REPO/tensorrt_llm/1/model.yaml" || {{ echo "missing $LLMAPI_REPO: run python -m pipeline repo {source}" >&2; exit 1; }}',
        copy_model_code('"$LLMAPI_MODEL_CODE"', '"$LLMAPI_REPO"'),
        "# Our model.py subclasses NVIDIA's (metrics) and imports this project: put it on the python path.",
        'export PYTHONPATH="$SPECDEPLOY_ROOT${PYTHONPATH:+:$PYTHONPATH}"',
        "# launch_triton_server.py --no-mpi would start this in the background and return: run it in the foreground,",
        "# forward SIGTERM/SIGINT; tritonserver then waits up to EXIT_TIMEOUT_SECS for in-flight requests.",
        *foreground('"$TRITONSERVER" ' + " ".join(shell_quote(a) for a in tritonserver_args(Path("$LLMAPI_REPO"), spec))),
    ]
    return "\n".join(lines) + "\n"


def build_script(plan: Plan) -> str:
    """The script a GPU host runs (render_script)."""
    return render_script(plan)


def build(plan: Plan) -> int:
    """The `engines` command: write the script; run its ModelOpt steps here only inside the GPU container."""
    spec = plan.spec
    script = spec.out_dir / TOOLCHAIN / "launch_triton.sh"
    write_if_changed(script, render_script(plan))
    script.chmod(0o755)
    if resolve_toolchain(dataclasses.replace(spec, toolchain="auto"))[0] == "reference":
        print(f"wrote {script}: it runs on a GPU host inside {stack.TRITON_IMAGE} (see docs/trtllm.md)")
        return 0
    return subprocess.call(["bash", str(script)], env={**os.environ, "LAUNCH": "0"},
                           stdout=sys.stdout, stderr=sys.stderr)
