"""Past one node: the Triton server as a LeaderWorkerSet when engine.tp_size x engine.pp_size exceeds gpu.gpus_per_node.

A LeaderWorkerSet (kubernetes-sigs/lws, CRD leaderworkerset.x-k8s.io/v1) places one *group* of
size = ceil(world / gpus_per_node) pods, one per node, and scales whole groups. Pod 0 of a group (the
leader) runs Triton and MPI rank 0; the workers run the other ranks. The engines run in TensorRT-LLM's
*leader mode*: one tritonserver process per rank, as `launch_triton_server.py --world_size=N` starts
them (triton_backend/scripts/launch_triton_server.py, pipeline/contracts/trtllm-1.2.1-cli.json); the
single-node *orchestrator mode* (`--multi-model`, TRTLLM_ORCHESTRATOR=1) "only works for single node
deployments" (tensorrtllm_backend README). The leader's mpirun reaches the workers' containers through
`kubectl exec` (the `kubessh` agent of NVIDIA's multi-node Triton tutorial, triton-inference-server/
tutorials Deployment/Kubernetes/EKS_Multinode_Triton_TRTLLM), addressing them by the pod names behind
the headless Service that LWS creates (`<lws>-<group>` for the leader, `<lws>-<group>-<i>` for workers;
LWS_LEADER_ADDRESS = `<lws>-<group>.<lws>.<namespace>`).

Generated here (spec-derived): the group size, GPUs per pod, the rank layout, the leader and worker
scripts and the LeaderWorkerSet skeleton whose pod templates kustomize copies from the Deployment the
single-node overlays serve (so probes, drain, securityContext, /dev/shm and volumes are typed once).
Static (deploy/components/multinode): what changes for every multi-node shape.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from pipeline.spec import Spec, SpecError
from pipeline.toolchains import GPU_TOOLCHAIN, toolchain_traits

# TensorRT-LLM's Mapping(gpus_per_node=8) default (tensorrt_llm/mapping.py), written into every engine's
# config.json by the 1.2.1 converters (they have no flag for it, pipeline/contracts/trtllm-1.2.1-cli.json);
# the runtime puts rank r on GPU r % gpus_per_node of its node (cpp/tensorrt_llm/runtime/worldConfig.cpp).
ENGINE_GPUS_PER_NODE = 8
NAME = "specdeploy-triton"  # the LeaderWorkerSet, named as the Deployment it replaces (Service, PDB, rules keep working)
API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
# Labels LWS puts on its pods (site/content/en/docs/reference/labels-annotations-and-environment-variables.md).
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on leaders: the HPA's and Service's pods
CONTAINER = "triton"  # the server container of the Deployment's pod template, copied into both LWS templates
FILES = "/etc/specdeploy"  # the specdeploy-files ConfigMap in the pods
KUBECTL = "/opt/specdeploy/bin/kubectl"  # copied from the pipeline image by the leader's copy-kubectl init container
AGENT = "/tmp/kubessh"  # Open MPI's remote agent, made executable by the leader script
LEADER_SCRIPT, WORKER_SCRIPT, AGENT_SCRIPT = "mpi-leader.sh", "mpi-worker.sh", "kubessh"
SERVER_COMPONENT = "server"  # generated/server: the single-node component plus the LWS, nested in generated/


@dataclass(frozen=True)
class Topology:
    """How the MPI ranks of tp_size x pp_size engines spread over the pods of one LeaderWorkerSet group."""

    tp_size: int
    pp_size: int
    gpus_per_node: int

    @property
    def world(self) -> int:
        """MPI ranks (one GPU each): tp_size x pp_size."""
        return self.tp_size * self.pp_size

    @property
    def size(self) -> int:
        """Pods per group (leader + workers): ceil(world / gpus_per_node)."""
        return -(-self.world // self.gpus_per_node)

    @property
    def ranks_per_pod(self) -> int:
        """Ranks, and GPUs, of every pod of the group."""
        return self.world // self.size

    def pod_ranks(self, pod: int) -> range:
        """The MPI ranks pod `pod` of the group runs (0: the leader); ranks fill pods in order, as Open MPI's --host slots do."""
        return range(pod * self.ranks_per_pod, (pod + 1) * self.ranks_per_pod)


def topology(spec: Spec, toolchain: str) -> Topology | None:
    """The multi-node layout of `spec`, or None when its engines fit one node (or run on CPUs); raises SpecError if impossible."""
    e, gpu = spec.engine, spec.gpu
    if not toolchain_traits(toolchain).gpu or e.tp_size * e.pp_size <= gpu.gpus_per_node:
        return None
    t = Topology(tp_size=e.tp_size, pp_size=e.pp_size, gpus_per_node=gpu.gpus_per_node)
    if toolchain != GPU_TOOLCHAIN:
        # trtllm-llmapi could span nodes upstream (launch_triton_server.py --world_size N --trtllm_llmapi_launch:
        # one `trtllm-llmapi-launch tritonserver` per MPI rank, the llmapi model's rank 0 driving the others through
        # MpiCommSession(COMM_WORLD); pipeline/contracts/llmapi.json `multinode`), but that launch is not generated here
        raise SpecError("toolchain", f"tp_size x pp_size = {t.world} exceeds gpu.gpus_per_node {gpu.gpus_per_node}, and only "
                        f"the {GPU_TOOLCHAIN} toolchain's servers span nodes here (MPI leader mode; {toolchain}'s "
                        "multi-node launch, trtllm-llmapi-launch under mpirun, is not generated)",
                        f"use toolchain: {GPU_TOOLCHAIN}, or fit the model on one node")
    if gpu.gpus_per_node != ENGINE_GPUS_PER_NODE:
        raise SpecError("gpu.gpus_per_node", f"tp_size x pp_size = {t.world} spans nodes of {gpu.gpus_per_node} GPUs, but "
                        f"TensorRT-LLM engines put rank r on GPU r % {ENGINE_GPUS_PER_NODE} of its node (the converters "
                        f"write gpus_per_node {ENGINE_GPUS_PER_NODE})",
                        f"use nodes of {ENGINE_GPUS_PER_NODE} GPUs, or fit the engines on one node "
                        f"(tp_size x pp_size <= {gpu.gpus_per_node})")
    if t.world % gpu.gpus_per_node:
        raise SpecError("engine.pp_size", f"tp_size x pp_size = {t.world} does not fill whole nodes of {gpu.gpus_per_node} "
                        f"GPUs: rank r runs on GPU r % {gpu.gpus_per_node}, which the last pod would not have",
                        f"make tp_size x pp_size a multiple of {gpu.gpus_per_node}")
    if gpu.gpus_per_node % e.tp_size and e.tp_size % gpu.gpus_per_node:
        raise SpecError("engine.tp_size", f"tensor-parallel groups of {e.tp_size} consecutive ranks would straddle nodes of "
                        f"{gpu.gpus_per_node} GPUs (an all-reduce over the network in every layer)",
                        f"use a tp_size that divides {gpu.gpus_per_node} and scale across nodes with pp_size")
    return t


# ----------------------------------------------------------------------------- MPI


def rank_argv(server_flags: list[str], rank: int, engine_models: list[str]) -> list[str]:
    """One rank's tritonserver command line in leader mode.

    As launch_triton_server.py builds it: every rank gets the same repository and ports and its own
    python shared-memory prefix; ranks other than 0 load only the TensorRT-LLM models (explicit model
    control). Like NVIDIA's multi-node tutorial they also switch off HTTP, gRPC and metrics: only
    rank 0 serves.
    """
    flags = [f for f in server_flags if not f.startswith("--backend-config=python,shm-region-prefix-name=")]
    argv = ["tritonserver", *flags, f"--backend-config=python,shm-region-prefix-name=specdeploy{rank}_"]
    if rank:
        argv += ["--model-control-mode=explicit", *[f"--load-model={m}" for m in engine_models],
                 "--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"]
    return argv


# Open MPI options of the leader's mpirun: kubessh as the remote agent; only the leader holds kubectl and a
# token, so no tree spawn from the workers (orte plm_rsh component parameters).
MPIRUN = ["mpirun", "--allow-run-as-root", "--mca", "plm_rsh_agent", AGENT, "--mca", "plm_rsh_no_tree_spawn", "1"]


def mpirun_contexts(t: Topology, server_flags: list[str], engine_models: list[str]) -> list[list[str]]:
    """mpirun's app contexts, one per rank in rank order (`-n 1 tritonserver ...`); ranks fill the --host slots in order."""
    return [["-n", "1", *rank_argv(server_flags, rank, engine_models)] for rank in range(t.world)]


def leader_script(t: Topology, server_flags: list[str], engine_models: list[str], spec_name: str) -> str:
    """mpi-leader.sh: wait until every worker pod of this group answers `kubectl exec`, then exec mpirun (PID 1 drains on SIGTERM)."""
    contexts = " \\\n  : ".join(shlex.join(c) for c in mpirun_contexts(t, server_flags, engine_models))
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Leader of one LeaderWorkerSet group of spec '{spec_name}' (generated by `python -m pipeline deploy`).",
        f"# {t.world} MPI ranks (tp {t.tp_size} x pp {t.pp_size}), {t.ranks_per_pod} on each of the {t.size} pods of this group,",
        "# rank 0 (Triton's HTTP, gRPC and metrics) in this pod. Open MPI starts the workers' ranks through",
        f"# `kubectl exec` ({AGENT_SCRIPT}), addressing them by the pod names behind the LeaderWorkerSet's headless Service.",
        "set -euo pipefail",
        f'if [ "${{LWS_GROUP_SIZE:-}}" != "{t.size}" ]; then',
        f'  echo "LWS_GROUP_SIZE is \'${{LWS_GROUP_SIZE:-}}\' but this script starts ranks on {t.size} pods" >&2; exit 1',
        "fi",
        'leader="${LWS_LEADER_ADDRESS%%.*}"  # <lws>-<group>: this pod',
        f"install -m 0755 {FILES}/{AGENT_SCRIPT} {AGENT}",
        f'MPI_HOSTS="$leader:{t.ranks_per_pod}"',
        f"for i in $(seq 1 {t.size - 1}); do",
        '  worker="$leader-$i"',
        f'  until {AGENT} "$worker" true >/dev/null 2>&1; do echo "waiting for worker pod $worker"; sleep 5; done',
        f'  MPI_HOSTS="$MPI_HOSTS,$worker:{t.ranks_per_pod}"',
        "done",
        'echo "MPI hosts: $MPI_HOSTS"',
        f'exec {shlex.join(MPIRUN)} --host "$MPI_HOSTS" \\',
        f"  {contexts}",
        "",
    ])


def agent_script() -> str:
    """kubessh: Open MPI's remote agent, `kubessh POD COMMAND...` runs COMMAND in the POD's server container."""
    return "\n".join([
        "#!/bin/sh",
        "# Open MPI's plm_rsh_agent inside a LeaderWorkerSet group (after NVIDIA's multi-node Triton tutorial):",
        "# runs the remote command in the worker pod's server container with the leader's service account.",
        'pod="$1"; shift',
        f'exec {KUBECTL} exec "$pod" -c {CONTAINER} -- /bin/sh -c "$*"',
        "",
    ])


def worker_script() -> str:
    """mpi-worker.sh: keep the worker container up for the leader's ranks; on SIGTERM wait until they have exited."""
    return "\n".join([
        "#!/usr/bin/env bash",
        "# A worker pod of a LeaderWorkerSet group: the leader's mpirun starts this pod's ranks through `kubectl exec`.",
        "# On SIGTERM wait for those ranks: mpirun on the leader stops them after rank 0 has drained its requests.",
        "ranks_running() { grep -qsx tritonserver /proc/[0-9]*/comm; }",
        "drain() { while ranks_running; do sleep 1; done; exit 0; }",
        "trap drain TERM INT",
        'while :; do sleep 5 & wait "$!"; done',
        "",
    ])


# ----------------------------------------------------------------------------- manifests


def leaderworkerset(t: Topology) -> dict:
    """The LeaderWorkerSet; its pod templates are filled from the Deployment's by kustomize (replacements)."""
    return {
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": {"name": NAME, "labels": {"app.kubernetes.io/name": NAME, "app.kubernetes.io/component": "server"}},
        "spec": {
            # No replicas: the HorizontalPodAutoscaler scales groups through the scale subresource.
            "startupPolicy": "LeaderCreated",
            # As the Deployment's maxSurge 1 / maxUnavailable 0: a new group loads before an old one goes.
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0}},
            "leaderWorkerTemplate": {
                "size": t.size,
                # An MPI job cannot lose a rank: any pod's restart recreates its whole group.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {}, "workerTemplate": {},
            },
        },
    }


def template_replacements() -> list[dict]:
    """kustomize replacements: both LWS pod templates start as the Deployment's (after the GPU component and the spec patches)."""
    base = "spec.leaderWorkerTemplate"
    return [{"source": {"kind": "Deployment", "name": NAME, "fieldPath": "spec.template"},
             "targets": [{"select": {"kind": KIND, "name": NAME},
                          "fieldPaths": [f"{base}.leaderTemplate", f"{base}.workerTemplate"]}]}]
