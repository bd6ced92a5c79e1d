"""Kubernetes: the spec-derived part of a kustomize overlay, and the two steps the engine build Job runs.

`python -m pipeline deploy SPEC --overlay deploy/overlays/gpu-medusa` writes the overlay's
`generated/` kustomize Component: the build key, engine and checkpoint paths, ports, GPU count
(tp_size x pp_size), node affinity (gpu.name), Triton model names, KV-cache fractions, image tags,
the server command, the spec as the pods see it, the trtllm build script and the PrometheusRule.
Everything else in deploy/ is static YAML, so no value is typed twice.

In the cluster (pipeline image, see deploy/Dockerfile) the engine build Job runs
`python -m pipeline.deploy stage checkpoints.json`  (copy or download each checkpoint into
/models/<build-key>/<role> and check its digest against the one hashed into the build key), then
`python -m pipeline.deploy build spec.yaml`  (reference engines, the model repository, READY).

Paths in the pods: /models/<build-key>/<role> (checkpoints PVC), /engines/<build-key>/ (engines PVC:
the spec's output dir, READY marker), /engines/cache (content-addressed steps shared by build keys),
/etc/specdeploy (the generated files).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import yaml

from pipeline import __version__, lws, stack
from pipeline.cliargs import add_spec_arguments
from pipeline.lifecycle import ABORT_WAIT_S
from pipeline.llmapi import TOOLCHAIN as LLMAPI_TOOLCHAIN
from pipeline.modes import traits
from pipeline.names import ACCEPTED_TOKENS_METRIC, DRAFT_MODEL, DRAFT_TOKENS_METRIC, TARGET_MODEL
from pipeline.repo.llmapi import copy_model_code
from pipeline.rules import load_spec
from pipeline.serving.drain import DRAIN_ENV
from pipeline.spec import Spec, SpecError, named_checkpoints, parse_spec, to_dict
from pipeline.toolchains import CPU_TOOLCHAIN, GPU_TOOLCHAIN, TOOLCHAINS, toolchain_traits
from specbuild.plan import DigestCache, Plan, checkpoint_files, folder_digest, make_plan
from specbuild.toolchains import toolchain_module

PROJECT_ROOT = Path(__file__).resolve().parent.parent
GENERATED = "generated"  # the component folder inside an overlay
GPU_COMPONENT = "components/gpu"  # an overlay that uses it serves trtllm engines
LLMAPI_COMPONENT = "components/llmapi"  # ... or, with this one too, the LLM API (trtllm-llmapi)
# What a LeaderWorkerSet needs beyond the spec-derived part, from overlays/<name>/generated.
MULTINODE_COMPONENT = "../../../components/multinode"
PIPELINE_IMAGE = "specdeploy"  # image of this project (deploy/Dockerfile); tag = pipeline.__version__
APP_DIR = PurePosixPath("/app")  # the project inside the pipeline image
ENGINES_MOUNT = PurePosixPath("/engines")
MODELS_MOUNT = PurePosixPath("/models")
FILES_MOUNT = PurePosixPath("/etc/specdeploy")
READY = "READY"
# Triton's own shutdown wait (trtllm command): by the time Triton gets SIGTERM the preStop drain left nothing in flight.
EXIT_TIMEOUT_S = 90
# Shutdown (docs/reliability.md): preStop runs `pipeline drain`: readiness false for UNREADY_DELAY_S while endpoint
# removal reaches clients and proxies, then new requests are refused and in-flight ones get serving.drain_timeout_s,
# then the rest end with an error (lifecycle.ABORT_WAIT_S); the kubelet's SIGTERM then stops Triton within STOP_S.
UNREADY_DELAY_S = 15
STOP_S = 45
DRAIN_FILE = "/tmp/specdeploy.drain"  # the drain state file (pipeline.serving.drain) of the pod's server
KV_FRACTION_PARAM = "kv_cache_free_gpu_mem_fraction"  # engine models' config.pbtxt parameter
# Recording rules (PrometheusRule) and the HPA's Pods metric served by the Prometheus adapter.
QUEUE_RATIO_RECORD = "triton:queue_compute:ratio"
ACCEPTANCE_RECORD = "specdecode:acceptance_rate:rate5m"
HPA_METRIC = "triton_queue_compute_ratio"
# The example spec each overlay of deploy/overlays/ is rendered from by `make deploy-render`.
EXAMPLE_SPECS = {"cpu-reference": "examples/default.yaml", "gpu-draft-target": "examples/draft-target.yaml",
                 "gpu-medusa": "examples/medusa.yaml", "gpu-eagle": "examples/eagle.yaml",
                 "gpu-multinode": "examples/multinode.yaml", "gpu-llmapi": "examples/eagle3.yaml"}
# Spec fields holding a checkpoint folder, by the role name used under /models/<build-key>/.
CHECKPOINT_FIELDS = {"target": ("models", "target"), "draft": ("models", "draft"),
                     "medusa": ("speculative", "medusa"), "eagle": ("speculative", "eagle")}


class DeployError(SpecError):
    """A deploy problem: `path` names what to change (an option, file or spec field)."""


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint folder: where it is here, where the pods see it, and how the Job stages it."""

    role: str
    cluster: str  # /models/<build-key>/<role>
    digest: str  # specbuild.plan.folder_digest, as hashed into the build key
    files: tuple[str, ...]  # the files that digest covers (what a download fetches)
    image_path: str | None  # the same folder inside the pipeline image, when it lies in this project
    hf_repo: str | None  # a Hugging Face repo id to download it from


@dataclass(frozen=True)
class DeployPlan:
    """Everything the manifests take from one spec, for one toolchain."""

    spec: Spec  # as loaded here
    cluster_spec: Spec  # the same spec with the pods' paths
    toolchain: str
    build_key: str
    checkpoints: tuple[Checkpoint, ...]
    model_names: tuple[str, ...]
    kv_fractions: tuple[float, float | None]  # target, draft (None without a draft)
    acceptance_floor: float  # below this acceptance rate speculation costs more than it saves
    namespace: str | None
    trtllm_script: str | None  # the plan's build script with the pods' paths (trtllm only)
    topology: lws.Topology | None = None  # set when tp_size x pp_size exceeds gpu.gpus_per_node: a LeaderWorkerSet

    @property
    def gpu_count(self) -> int:
        """GPUs of one server (MPI ranks): tp_size x pp_size."""
        return self.spec.engine.tp_size * self.spec.engine.pp_size

    @property
    def gpus_per_pod(self) -> int:
        """GPUs of each Triton pod: all of them, or one node's share in a LeaderWorkerSet group."""
        return self.topology.ranks_per_pod if self.topology else self.gpu_count

    @property
    def build_gpus(self) -> int:
        """GPUs of the engine build Job: trtllm-build builds every rank on one node, rank r on GPU r % --workers
        (--workers is capped at the GPUs it sees; tensorrt_llm/commands/build.py parallel_build)."""
        return min(self.gpu_count, self.spec.gpu.gpus_per_node)

    @property
    def build_dir(self) -> str:
        """The build key's folder on the engines volume (the cluster spec's output.dir)."""
        return str(ENGINES_MOUNT / self.build_key)

    @property
    def model_repo(self) -> str:
        """The model repository Triton serves, inside build_dir."""
        from pipeline.repo.assemble import repo_dir

        return str(repo_dir(self.cluster_spec, self.toolchain))

    def values(self) -> dict[str, str]:
        """The ConfigMap specdeploy-values (environment of every container)."""
        s, e, serving = self.spec.speculative, self.spec.engine, self.spec.serving
        kv_target, kv_draft = self.kv_fractions
        return {
            "SPEC_NAME": self.spec.name,
            "TOOLCHAIN": self.toolchain,
            "BUILD_KEY": self.build_key,
            "BUILD_DIR": self.build_dir,
            "MODEL_REPO": self.model_repo,
            "SPEC_FILE": str(FILES_MOUNT / "spec.yaml"),
            "HTTP_PORT": str(serving.http_port),
            "GRPC_PORT": str(serving.grpc_port),
            "METRICS_PORT": str(serving.metrics_port),
            "TP_SIZE": str(e.tp_size),
            "PP_SIZE": str(e.pp_size),
            "GPU_COUNT": str(self.gpu_count),
            "SPECULATIVE_MODE": s.mode,
            "MAX_DRAFT_LEN": str(s.max_draft_len),
            "NUM_DRAFT_TOKENS": str(s.num_draft_tokens),
            "MIN_ACCEPTANCE_RATE": str(s.min_acceptance_rate),
            "ACCEPTANCE_FLOOR": str(self.acceptance_floor),
            "TRITON_MODELS": ",".join(self.model_names),
            "KV_CACHE_FREE_GPU_MEM_FRACTION_TARGET": str(kv_target),
            "KV_CACHE_FREE_GPU_MEM_FRACTION_DRAFT": "" if kv_draft is None else str(kv_draft),
        } | ({"LWS_SIZE": str(self.topology.size), "GPUS_PER_POD": str(self.gpus_per_pod)} if self.topology else {})


# ----------------------------------------------------------------------------- planning


def acceptance_floor(plan: Plan) -> float:
    """The acceptance rate r (accepted / drafted tokens) below which speculation costs more than it saves.

    Decoding is memory-bound: a draft step costs c = draft weight bytes / target weight bytes of a
    target step, and verifying K tokens costs about one target step. A round then costs K*c + 1
    target steps and yields 1 + r*K tokens (accepted drafts plus the target's own token), so it beats
    plain decoding only while r > c. Never below the spec's speculative.min_acceptance_rate; modes
    without a draft model (n-gram, Medusa, EAGLE heads) use that alone.
    """
    spec = plan.spec
    floor = spec.speculative.min_acceptance_rate
    if not traits(spec.speculative.mode).has_draft_engine:
        return floor
    weights = {e.role: e.weight_bytes for e in plan.inspection.memory.engines}
    return round(max(floor, weights["draft"] / weights["target"]), 3)


def overlay_toolchain(overlay: Path) -> str:
    """trtllm-llmapi with the llmapi component, else the GPU toolchain (trtllm) with the GPU component, else reference."""
    components = [str(c).rstrip("/") for c in read_kustomization(overlay).get("components") or []]
    if any(c.endswith(LLMAPI_COMPONENT) for c in components):
        return LLMAPI_TOOLCHAIN
    return GPU_TOOLCHAIN if any(c.endswith(GPU_COMPONENT) for c in components) else CPU_TOOLCHAIN


def read_kustomization(overlay: Path) -> dict:
    """The overlay's kustomization.yaml as a mapping."""
    path = overlay / "kustomization.yaml"
    if not path.is_file():
        raise DeployError("--overlay", f"{path} does not exist", "pass a folder of deploy/overlays/")
    return yaml.safe_load(path.read_text()) or {}


def image_path(local: Path) -> str | None:
    """Where a checkpoint inside this project lies in the pipeline image (which copies the project to /app)."""
    try:
        return str(APP_DIR / local.resolve().relative_to(PROJECT_ROOT).as_posix())
    except ValueError:
        return None


def cluster_view(spec: Spec, toolchain: str, build_key: str, roles: list[str]) -> Spec:
    """The spec as the pods load it: staged checkpoints, outputs on the engines volume, all interfaces."""
    raw = to_dict(spec)
    for role in roles:
        section, name = CHECKPOINT_FIELDS[role]
        raw[section][name]["checkpoint"] = str(MODELS_MOUNT / build_key / role)
    raw["output"] = {"dir": str(ENGINES_MOUNT / build_key), "cache_dir": str(ENGINES_MOUNT / "cache")}
    raw["serving"]["host"] = "0.0.0.0"  # the pod's port, reached through the Service
    raw["toolchain"] = toolchain
    return parse_spec(raw, base_dir=Path("/"), check_paths=False)


def plan_deployment(spec: Spec, toolchain: str, namespace: str | None = None,
                    hf_repos: dict[str, str] | None = None) -> DeployPlan:
    """Plan the engines of `spec` for `toolchain` and collect every value the manifests need."""
    from pipeline.repo.assemble import EngineInfo, kv_fractions, repo_models

    hf_repos = dict(hf_repos or {})
    if spec.toolchain not in ("auto", toolchain):
        raise DeployError("toolchain", f"the spec says {spec.toolchain!r} but this overlay serves {toolchain!r} engines",
                          "use the overlay of that toolchain (cpu-reference or a gpu-* overlay), or change toolchain")
    plan = make_plan(spec, toolchain)
    digests = dict(plan.served)  # folders served as they are (no engine build)
    for step in plan.steps:
        if step.kind in ("convert", "quantize"):
            digests[step.role] = step.inputs["checkpoint"]
            digests.update({name: step.inputs[name] for name in ("medusa", "eagle") if name in step.inputs})
    unknown = sorted(set(hf_repos) - set(digests))
    if unknown:
        raise DeployError("--hf-repo", f"{', '.join(unknown)} is not a checkpoint of this spec",
                          f"use one of {', '.join(digests)}")
    checkpoints = []
    for role, digest in digests.items():
        section, name = CHECKPOINT_FIELDS[role]
        local = getattr(getattr(spec, section), name).checkpoint
        checkpoints.append(Checkpoint(role=role, cluster=str(MODELS_MOUNT / plan.build_key / role), digest=digest,
                                      files=tuple(p.name for p in checkpoint_files(local)),
                                      image_path=image_path(local), hf_repo=hf_repos.get(role)))
    cluster_spec = cluster_view(spec, toolchain, plan.build_key, list(digests))

    if toolchain_traits(toolchain).repository == "llmapi":  # one LLM API model
        model_names, kv = (TARGET_MODEL,), {TARGET_MODEL: kv_fractions(plan)["target"]}
    else:
        target = EngineInfo.planned(plan, "target", Path("target"))
        draft = EngineInfo.planned(plan, "draft", Path("draft")) if traits(spec.speculative.mode).has_draft_engine else None
        models = repo_models(plan, target, draft)  # the repository the build Job will assemble
        model_names = tuple(m.name for m in models)
        kv = {m.name: float(m.parameters[KV_FRACTION_PARAM]) for m in models if KV_FRACTION_PARAM in (m.parameters or {})}
    script = toolchain_module(toolchain).build_script(dataclasses.replace(plan, spec=cluster_spec))
    return DeployPlan(spec=spec, cluster_spec=cluster_spec, toolchain=toolchain, build_key=plan.build_key,
                      checkpoints=tuple(checkpoints), model_names=model_names,
                      kv_fractions=(kv[TARGET_MODEL], kv.get(DRAFT_MODEL)), acceptance_floor=acceptance_floor(plan),
                      namespace=namespace, trtllm_script=script, topology=lws.topology(spec, toolchain))


# ----------------------------------------------------------------------------- rendering


def server_command(d: DeployPlan) -> list[str]:
    """The Triton container's command: `pipeline serve` (reference) or tritonserver (trtllm)."""
    if not toolchain_traits(d.toolchain).gpu:
        return ["python", "-m", "pipeline", "serve", str(FILES_MOUNT / "spec.yaml"), "--log-file", "/tmp/tritonserver.log"]
    if d.topology:  # a LeaderWorkerSet group: the leader's script starts every rank (pipeline/lws.py)
        return ["bash", str(FILES_MOUNT / lws.LEADER_SCRIPT)]
    if toolchain_traits(d.toolchain).repository == "llmapi":
        return llmapi_server_command(d)
    # What TensorRT-LLM's launch_triton_server.py --multi-model --world_size=1 runs (one tritonserver
    # under mpirun, each tensorrt_llm model spawning its tp x pp ranks), in the foreground as PID 1.
    return ["mpirun", "--allow-run-as-root", "-n", "1", "tritonserver", *tritonserver_flags(d)]


def tritonserver_flags(d: DeployPlan) -> list[str]:
    """The GPU server's tritonserver flags: the repository, the spec's ports, draining."""
    s = d.spec.serving
    return [f"--model-repository={d.model_repo}",
            f"--http-port={s.http_port}", f"--grpc-port={s.grpc_port}", f"--metrics-port={s.metrics_port}",
            "--disable-auto-complete-config", "--backend-config=python,shm-region-prefix-name=specdeploy_",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}", "--log-verbose=0"]


def llmapi_server_command(d: DeployPlan) -> list[str]:
    """The LLM API repository copied to /tmp with NVIDIA's model code from the container next to its
    model.yaml (the engines volume is read-only here), then tritonserver as PID 1, without mpirun (the llmapi
    model runs at world size 1), draining for serving.drain_timeout_s after SIGTERM."""
    from specbuild.toolchains.trtllm_llmapi import model_code_dir, server_command as llmapi_tritonserver

    repo = PurePosixPath("/tmp/llmapi_repo")
    # No BLS counts requests for the preStop drain here: tritonserver's own exit timeout after SIGTERM is the drain.
    serve = llmapi_tritonserver(Path(repo), d.spec, str(math.ceil(d.spec.serving.drain_timeout_s)))
    code = model_code_dir()
    script = f"rm -rf {repo} && cp -r {d.model_repo} {repo} && {copy_model_code(code, str(repo))} && exec {shlex.join(serve)}"
    return ["bash", "-c", script]


def engine_models(d: DeployPlan) -> list[str]:
    """The TensorRT-LLM models of the repository (every MPI rank loads them)."""
    return [m for m in (TARGET_MODEL, DRAFT_MODEL) if m in d.model_names]


def termination_grace_s(spec: Spec) -> int:
    """The pod's terminationGracePeriodSeconds: the preStop drain (unready delay, budget, aborts) plus the stop."""
    return int(UNREADY_DELAY_S + math.ceil(spec.serving.drain_timeout_s) + ABORT_WAIT_S + STOP_S)


def lifecycle_command(d: DeployPlan, *args: str) -> list[str]:
    """`python -m pipeline <args> SPEC --repo REPO` as the Triton container runs it (probes, preStop)."""
    python = "python3" if toolchain_traits(d.toolchain).gpu else "python"  # NVIDIA's image has no `python`
    return [python, "-m", "pipeline", *args, str(FILES_MOUNT / "spec.yaml"), "--repo", d.model_repo]


def _gpu_resources(count: int) -> dict:
    return {"limits": {"nvidia.com/gpu": count}, "requests": {"nvidia.com/gpu": count}}


def _gpu_affinity(product: str) -> dict:
    """Schedule only on nodes whose GPU feature discovery label names the spec's GPU."""
    term = {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": [product]}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def deployment_patch(d: DeployPlan) -> dict:
    """Strategic-merge patch of the Triton Deployment: command, port numbers, probes and preStop drain (with the
    grace period they need), GPUs, node affinity."""
    s = d.spec.serving
    container = {
        "name": "triton",
        "command": server_command(d),
        # `$patch: replace`: ports merge by number, so new numbers would otherwise be added, not replaced
        "ports": [{"$patch": "replace"}, {"name": "http", "containerPort": s.http_port},
                  {"name": "grpc", "containerPort": s.grpc_port}, {"name": "metrics", "containerPort": s.metrics_port}],
    }
    # Readiness and liveness are our checks, not Triton's /v2/health/*: those stay 200 when a python stub died
    # and know nothing of the drain (pipeline.lifecycle). `$patch: replace` drops the base's httpGet.
    probe = {"$patch": "replace", "periodSeconds": 10, "timeoutSeconds": 10}
    container["readinessProbe"] = {**probe, "exec": {"command": lifecycle_command(d, "health")}, "failureThreshold": 2}
    container["livenessProbe"] = {**probe, "exec": {"command": lifecycle_command(d, "health", "--live")},
                                  "failureThreshold": 3}
    container["lifecycle"] = {"preStop": {"exec": {"command": lifecycle_command(
        d, "drain", "--unready-delay", str(UNREADY_DELAY_S))}}}
    container["env"] = [{"name": DRAIN_ENV, "value": DRAIN_FILE}]
    pod: dict = {"containers": [container], "terminationGracePeriodSeconds": termination_grace_s(d.spec)}
    if toolchain_traits(d.toolchain).gpu:
        container["resources"] = _gpu_resources(d.gpus_per_pod)
        if toolchain_traits(d.toolchain).repository != "llmapi":  # the llmapi command runs no mpirun
            # On SIGTERM mpirun signals tritonserver, then kills it after this many seconds: let it drain.
            container["env"].append({"name": "OMPI_MCA_odls_base_sigkill_timeout", "value": str(EXIT_TIMEOUT_S + 5)})
        if d.topology:  # leader mode across nodes: no orchestrator (it spawns ranks on its own node only)
            container["env"].append({"name": "TRTLLM_ORCHESTRATOR", "$patch": "delete"})
        pod["affinity"] = _gpu_affinity(d.spec.gpu.name)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "specdeploy-triton"},
            "spec": {"template": {"spec": pod}}}


def service_patch(d: DeployPlan) -> dict:
    """Strategic-merge patch of the Service: the spec's port numbers."""
    s = d.spec.serving
    ports = [{"$patch": "replace"},
             {"name": "http", "port": s.http_port, "targetPort": "http"},
             {"name": "grpc", "port": s.grpc_port, "targetPort": "grpc", "appProtocol": "grpc"},
             {"name": "metrics", "port": s.metrics_port, "targetPort": "metrics"}]
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "specdeploy-triton"}, "spec": {"ports": ports}}


def build_job_patch(d: DeployPlan) -> list[dict]:
    """JSON patch of the engine build Job: its name (per build key), the trtllm-build step's GPUs, node affinity.

    A JSON patch, not a strategic merge: the latter would move the patched init container before
    stage-checkpoints. trtllm-build is the second init container (the GPU component appends it).
    """
    ops = [{"op": "replace", "path": "/metadata/name", "value": f"specdeploy-engine-build-{d.build_key}"}]
    if toolchain_traits(d.toolchain).gpu:
        gpus = "/spec/template/spec/initContainers/1/resources/{}/nvidia.com~1gpu"
        ops += [{"op": "add", "path": gpus.format("limits"), "value": d.build_gpus},
                {"op": "add", "path": gpus.format("requests"), "value": d.build_gpus},
                {"op": "add", "path": "/spec/template/spec/affinity", "value": _gpu_affinity(d.spec.gpu.name)}]
    return ops


def prometheus_rule(d: DeployPlan) -> dict:
    """Recording rules (queue-to-compute ratio, acceptance rate) and the acceptance-collapse alert (the BLS, or on
    trtllm-llmapi our tensorrt_llm model over NVIDIA's, exports the spec_decode_* counters)."""
    namespace = f'namespace="{d.namespace}"' if d.namespace else ""
    pods = ", ".join(filter(None, [namespace, 'pod=~"specdeploy-triton-.*"']))
    # the autoscaler watches the target's queue
    queue = f'rate(nv_inference_queue_duration_us{{{pods}, model="{TARGET_MODEL}"}}[1m])'
    compute = f'rate(nv_inference_compute_infer_duration_us{{{pods}, model="{TARGET_MODEL}"}}[1m])'
    accepted = f"rate({ACCEPTED_TOKENS_METRIC}{{{pods}}}[5m])"
    drafted = f"rate({DRAFT_TOKENS_METRIC}{{{pods}}}[5m])"
    rules = [
        {"record": QUEUE_RATIO_RECORD,
         "expr": f"sum by (namespace, pod) ({queue})\n/\nclamp_min(sum by (namespace, pod) ({compute}), 1)"},
        {"record": ACCEPTANCE_RECORD,
         "expr": f"sum by (namespace, model) ({accepted})\n/\n(sum by (namespace, model) ({drafted}) > 0)"},
    ]
    threshold = d.acceptance_floor
    alerts = []
    if traits(d.spec.speculative.mode).speculates:
        alerts.append({
            "alert": "SpeculativeAcceptanceCollapsed",
            "expr": f"{ACCEPTANCE_RECORD}{{{namespace}}} < {threshold}" if namespace else f"{ACCEPTANCE_RECORD} < {threshold}",
            "for": "15m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": f"Speculative decoding acceptance of {d.spec.name} fell below {threshold:.0%}",
                "description": ("{{ $labels.model }} in {{ $labels.namespace }} accepts {{ $value | humanizePercentage }} "
                                f"of draft tokens, below {threshold} (the draft/target cost ratio, or "
                                "speculative.min_acceptance_rate): drafting and verifying now cost more than they "
                                "save. Check that the traffic matches what the draft was trained on, lower "
                                "num_draft_tokens, or set speculative.mode: none."),
            },
        })
    groups = [{"name": "specdeploy-triton", "interval": "15s", "rules": rules}]
    if alerts:
        groups.append({"name": "specdeploy-speculation", "rules": alerts})
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "specdeploy-triton", "labels": {"release": "kube-prometheus-stack"}},
            "spec": {"groups": groups}}


def checkpoints_manifest(d: DeployPlan) -> list[dict]:
    """checkpoints.json: what `stage` puts where, and the digest each copy must have."""
    return [{"role": c.role, "dest": c.cluster, "digest": c.digest, "files": list(c.files),
             "image_path": c.image_path, "hf_repo": c.hf_repo} for c in d.checkpoints]


def image_tags() -> list[dict]:
    """kustomize `images`: the pipeline image at this version, the Triton image of the pinned stack."""
    triton_name, triton_tag = stack.TRITON_IMAGE.rsplit(":", 1)
    return [{"name": PIPELINE_IMAGE, "newTag": __version__}, {"name": triton_name, "newTag": triton_tag}]


def render_component(d: DeployPlan) -> dict[str, str]:
    """The files of the overlay's generated/ kustomize Component, by name."""
    files = ["spec.yaml", "checkpoints.json"] + (["trtllm.sh"] if d.trtllm_script else [])
    files += [lws.LEADER_SCRIPT, lws.WORKER_SCRIPT, lws.AGENT_SCRIPT] if d.topology else []
    patches = [{"path": "triton-deployment.yaml"}, {"path": "triton-service.yaml"},
               {"path": "engine-build-job.yaml", "target": {"kind": "Job", "name": "specdeploy-engine-build"}}]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1alpha1",
        "kind": "Component",
        "labels": [{"pairs": {"app.kubernetes.io/instance": d.spec.name}, "includeTemplates": True}],
        "images": image_tags(),
        "configMapGenerator": [{"name": "specdeploy-values", "envs": ["values.env"]},
                               {"name": "specdeploy-files", "files": files}],
        "resources": ["prometheusrule.yaml"] + (["leaderworkerset.yaml"] if d.topology else []),
        "patches": patches,
    }
    if d.topology:
        kustomization["replacements"] = lws.template_replacements()
    header = (f"# Generated by `python -m pipeline deploy` from spec '{d.spec.name}' (build key {d.build_key}).\n"
              "# Regenerate instead of editing.\n")
    out = {
        "kustomization.yaml": header + yaml.safe_dump(kustomization, sort_keys=False),
        "values.env": header + "".join(f"{k}={v}\n" for k, v in d.values().items()),
        "spec.yaml": header + yaml.safe_dump(to_dict(d.cluster_spec), sort_keys=False),
        "checkpoints.json": json.dumps(checkpoints_manifest(d), indent=2) + "\n",
        "triton-deployment.yaml": header + yaml.safe_dump(deployment_patch(d), sort_keys=False),
        "triton-service.yaml": header + yaml.safe_dump(service_patch(d), sort_keys=False),
        "prometheusrule.yaml": header + yaml.safe_dump(prometheus_rule(d), sort_keys=False),
        "engine-build-job.yaml": header + yaml.safe_dump(build_job_patch(d), sort_keys=False),
    }
    if d.trtllm_script is not None:
        out["trtllm.sh"] = trtllm_job_script(d)
    if d.topology:
        return multinode_component(d, out, header)
    return out


def multinode_component(d: DeployPlan, server: dict[str, str], header: str) -> dict[str, str]:
    """generated/ for a LeaderWorkerSet: the single-node component (plus the LWS and its scripts) under server/,
    then deploy/components/multinode, which needs the LWS pod templates copied first (nested components run in order)."""
    t = d.topology
    server = server | {
        "leaderworkerset.yaml": header + yaml.safe_dump(lws.leaderworkerset(t), sort_keys=False),
        lws.LEADER_SCRIPT: lws.leader_script(t, tritonserver_flags(d), engine_models(d), d.spec.name),
        lws.WORKER_SCRIPT: lws.worker_script(),
        lws.AGENT_SCRIPT: lws.agent_script(),
    }
    outer = {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component",
             "labels": [{"pairs": {"app.kubernetes.io/instance": d.spec.name}, "includeTemplates": True}],
             "images": image_tags(),  # again: deploy/components/multinode adds a container
             "components": [lws.SERVER_COMPONENT, MULTINODE_COMPONENT]}
    return {"kustomization.yaml": header + yaml.safe_dump(outer, sort_keys=False)} | {
        f"{lws.SERVER_COMPONENT}/{name}": text for name, text in server.items()}


def trtllm_job_script(d: DeployPlan) -> str:
    """The plan's build script, skipped when this build key is already complete."""
    guard = (f'if [ -f "$BUILD_DIR/{READY}" ]; then echo "engines of build key $BUILD_KEY are ready"; exit 0; fi\n')
    shebang, rest = d.trtllm_script.split("\n", 1)
    return f"{shebang}\n{guard}{rest}"


def write_component(d: DeployPlan, overlay: Path) -> Path:
    """Write generated/ into `overlay`, replacing what was there; returns the folder."""
    dest = overlay / GENERATED
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name, text in render_component(d).items():
        (dest / name).parent.mkdir(exist_ok=True)
        (dest / name).write_text(text)
    return dest


def deploy_overlay(spec: Spec, overlay: Path, hf_repos: dict[str, str] | None = None) -> DeployPlan:
    """Plan `spec` for `overlay` (its toolchain and namespace) and write its generated/ component."""
    d = plan_deployment(spec, overlay_toolchain(overlay), read_kustomization(overlay).get("namespace"), hf_repos)
    write_component(d, overlay)
    return d


def deploy_examples(overlays_dir: Path) -> dict[str, DeployPlan | str]:
    """Write every overlay's component from its example spec (EXAMPLE_SPECS). An example whose checkpoint folders
    are not on this machine (examples/multinode.yaml's 70B target) gets no component, only the reason."""
    done: dict[str, DeployPlan | str] = {}
    for overlay, spec_file in EXAMPLE_SPECS.items():
        shutil.rmtree(overlays_dir / overlay / GENERATED, ignore_errors=True)  # never render a stale component
        spec = load_spec(PROJECT_ROOT / spec_file, check_paths=False)
        missing = [f"{where} {path}" for where, path in named_checkpoints(spec) if not path.exists()]
        if missing:
            done[overlay] = f"{spec_file} needs {', '.join(missing)} (see its comments)"
        else:
            done[overlay] = deploy_overlay(load_spec(PROJECT_ROOT / spec_file), overlays_dir / overlay)
    return done


# ----------------------------------------------------------------------------- in the cluster


def stage_checkpoints(manifest: Path) -> list[str]:
    """Put every checkpoint of checkpoints.json at its dest (copy from the image, else download), check digests."""
    done = []
    for item in json.loads(Path(manifest).read_text()):
        dest = Path(item["dest"])
        if not dest.exists():
            tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            source = Path(item["image_path"]) if item["image_path"] else None
            if source is not None and source.is_dir():
                shutil.copytree(source, tmp)
            elif source is not None and source.is_file():
                shutil.copy2(source, tmp)
            elif item["hf_repo"]:
                from huggingface_hub import snapshot_download

                # exactly the files the digest covers
                snapshot_download(repo_id=item["hf_repo"], local_dir=tmp, token=os.environ.get("HF_TOKEN") or None,
                                  allow_patterns=item["files"])
            else:
                raise DeployError(item["role"], f"no checkpoint at {dest}, none in the image and no Hugging Face repo",
                                  f"pass --hf-repo {item['role']}=ORG/NAME to `pipeline deploy`, or copy the folder "
                                  f"to {dest} on the checkpoints volume (see deploy/README.md)")
            os.replace(tmp, dest)
        digest = folder_digest(dest, DigestCache(None))
        if digest != item["digest"]:
            raise DeployError(item["role"], f"{dest} has digest {digest}, but the build key was computed from {item['digest']}",
                              "stage the same checkpoint the spec names, or re-run `pipeline deploy` on this one")
        done.append(f"{item['role']}: {dest} ({digest})")
    return done


def build_in_cluster(spec_file: Path, toolchain: str) -> str:
    """Build the reference engines (trtllm: the trtllm-build step did), assemble the model repository, write READY."""
    from pipeline.repo.assemble import assemble

    spec = load_spec(spec_file)
    ready = spec.output.dir / READY  # output.dir is /engines/<build-key>
    if ready.exists():
        return f"build key {spec.output.dir.name} is ready; nothing to do"
    plan = make_plan(spec, toolchain)
    if toolchain_traits(toolchain).engines_built_here:
        code = toolchain_module(toolchain).build(plan)
        if code:
            raise DeployError("engines", f"the {toolchain} engine build failed (exit code {code})", "read the Job's log above")
    repo = assemble(plan)
    ready.write_text(json.dumps({"spec": spec.name, "toolchain": toolchain, "model_repo": str(repo)}) + "\n")
    return f"engines and model repository ready: {repo}"


# ----------------------------------------------------------------------------- command line


def parse_hf_repos(items: list[str]) -> dict[str, str]:
    """`role=org/name` options as a mapping."""
    repos = {}
    for item in items:
        role, sep, repo = item.partition("=")
        if not sep or role not in CHECKPOINT_FIELDS or not repo:
            raise DeployError("--hf-repo", f"{item!r} is not ROLE=ORG/NAME", f"use a role of {', '.join(CHECKPOINT_FIELDS)}")
        repos[role] = repo
    return repos


def add_parser(subparsers) -> None:
    """Register `deploy SPEC --overlay DIR`."""
    p = subparsers.add_parser("deploy", help="write the spec-derived kustomize component of a deploy/ overlay")
    add_spec_arguments(p)
    p.add_argument("--overlay", type=Path, required=True, help="e.g. deploy/overlays/cpu-reference")
    p.add_argument("--hf-repo", action="append", default=[], metavar="ROLE=ORG/NAME",
                   help="let the engine build Job download a checkpoint (role: target, draft, medusa, eagle)")
    p.set_defaults(func=run_deploy)


def run_deploy(args: argparse.Namespace) -> int:
    """`python -m pipeline deploy SPEC --overlay DIR`."""
    overlay = Path(args.overlay)
    d = deploy_overlay(load_spec(args.spec, args.overrides), overlay, parse_hf_repos(args.hf_repo))
    print(describe(d, overlay))
    print(f"next: kubectl apply -k {overlay}")
    return 0


def describe(d: DeployPlan, overlay: Path) -> str:
    """One line: what was written where."""
    where = f"{d.gpu_count} GPU(s) per pod" if toolchain_traits(d.toolchain).gpu else "CPU"
    if d.topology:
        where = f"LeaderWorkerSet groups of {d.topology.size} pods x {d.gpus_per_pod} GPUs"
    return f"wrote {overlay / GENERATED} (spec {d.spec.name}, build key {d.build_key}, toolchain {d.toolchain}, {where})"


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.deploy stage CHECKPOINTS_JSON | build SPEC --toolchain T` (the build Job's steps),
    or `examples` (every overlay's component from its example spec, for `make deploy-render`)."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.deploy", description=main.__doc__)
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("examples", help="write every overlay's component from its example spec")
    p.add_argument("--overlays", type=Path, default=PROJECT_ROOT / "deploy" / "overlays")
    p = sub.add_parser("stage", help="stage and verify the checkpoints")
    p.add_argument("manifest", type=Path)
    p = sub.add_parser("build", help="build engines and the model repository, then write READY")
    p.add_argument("spec", type=Path)
    p.add_argument("--toolchain", choices=list(TOOLCHAINS), required=True)
    args = parser.parse_args(argv)
    try:
        if args.step == "examples":
            for overlay, d in deploy_examples(args.overlays).items():
                print(f"skipped {overlay}: {d}" if isinstance(d, str) else describe(d, args.overlays / overlay))
        elif args.step == "stage":
            print("\n".join(stage_checkpoints(args.manifest)))
        else:
            print(build_in_cluster(args.spec, args.toolchain))
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
