"""deploy/: every overlay renders with kustomize, validates against the pinned Kubernetes schemas,
follows the policies (resources, probes, security, pinned images) and agrees with its spec.

One spec per overlay, on tiny generated checkpoints, with non-default values (ports, tp x pp, GPU
name, KV fractions) so that a value typed into the static YAML instead of generated would show.
"""

import ast
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pipeline import __version__, deploy, names, stack
from pipeline.lifecycle import ABORT_WAIT_S
from pipeline.llmapi import contract as llmapi_contract
from specbuild.plan import make_plan
from pipeline.spec import SpecError, load_spec
from pipeline.toolchains import toolchain_traits

KUBERNETES_VERSION = "1.32"  # the schema version the manifests are validated against
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (with kustomize) is not installed: overlays not rendered")
REPO_DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
BLS_METRICS = REPO_DEPLOY.parent / "pipeline" / "serving" / "metrics.py"
CRD_GROUP = "monitoring.coreos.com/"  # Prometheus operator CRDs: kubernetes-validate has no schema for them

SPECS = {
    "cpu-reference": """
name: cpu-tiny
toolchain: reference
models:
  target: {{checkpoint: {target}, dtype: float32}}
  draft: {{checkpoint: {draft}, dtype: float32}}
speculative: {{mode: draft_target, max_draft_len: 6, num_draft_tokens: 4, min_acceptance_rate: 0.2}}
engine: {{max_batch_size: 4, max_input_len: 256, max_seq_len: 512, max_num_tokens: 1024}}
serving: {{http_port: 9000, grpc_port: 9001, metrics_port: 9002}}
""",
    "gpu-draft-target": """
name: gpu-dt
toolchain: trtllm
models:
  target: {{checkpoint: {target}, dtype: float16, qformat: int8_wo}}
  draft: {{checkpoint: {draft}, dtype: float16}}
speculative: {{mode: draft_target, max_draft_len: 8, num_draft_tokens: 5}}
engine: {{tp_size: 2, pp_size: 1}}
serving: {{kv_cache_free_gpu_mem_fraction: {{target: 0.55, draft: 0.25}}, http_port: 8100, grpc_port: 8101, metrics_port: 8102}}
gpu: {{name: NVIDIA-A100-SXM4-80GB, memory_gib: 80, count: 2}}
""",
    "gpu-medusa": """
name: gpu-medusa
toolchain: trtllm
models:
  target: {{checkpoint: {target}, dtype: float16}}
speculative:
  mode: medusa
  max_draft_len: 7
  num_draft_tokens: 7
  medusa: {{checkpoint: {medusa}}}
engine: {{tp_size: 1, pp_size: 2}}
gpu: {{name: NVIDIA-L40S, memory_gib: 48, count: 2}}
""",
    "gpu-eagle": """
name: gpu-eagle
toolchain: trtllm
models:
  target: {{checkpoint: {target}, dtype: bfloat16}}
speculative:
  mode: eagle
  max_draft_len: 6
  num_draft_tokens: 6
  eagle: {{checkpoint: {eagle}}}
engine: {{tp_size: 4, pp_size: 1}}
gpu: {{count: 4}}
""",
    "gpu-llmapi": """
name: gpu-llmapi
toolchain: trtllm-llmapi
models:
  target: {{checkpoint: {target}, dtype: bfloat16, qformat: fp8}}
speculative:
  mode: eagle
  max_draft_len: 3
  num_draft_tokens: 3
  eagle: {{checkpoint: {eagle3}, version: 3, choices: [[0], [0, 0], [0, 0, 0]], layers_to_capture: [0, 1, 2]}}
engine: {{tp_size: 2, pp_size: 1}}
serving: {{http_port: 8300, grpc_port: 8301, metrics_port: 8302}}
gpu: {{count: 2}}
""",
}
OVERLAYS = list(SPECS)
# Each overlay with a tiny spec, and with its example spec when `make models` has made the checkpoints.
# (gpu-multinode, a LeaderWorkerSet, is tested in test_deploy_multinode.py)
CASES = OVERLAYS + [f"{overlay}@example" for overlay in deploy.EXAMPLE_SPECS if overlay in SPECS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny target + draft, untrained Medusa heads and EAGLE-1/2 and EAGLE-3 weights for that target."""
    from pipeline.fixtures.models import make_random_eagle, make_random_eagle3, make_random_medusa
    from pipeline.fixtures.toymodels import make_derived_pair

    root = tmp_path_factory.mktemp("ckpt")
    target, draft = make_derived_pair(root / "pair", eps=0.15)
    return {"target": target, "draft": draft, "medusa": make_random_medusa(target, root / "medusa"),
            "eagle": make_random_eagle(target, root / "eagle"), "eagle3": make_random_eagle3(target, root / "eagle3")}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, checkpoints):
    """A copy of deploy/ and one spec file per overlay."""
    root = tmp_path_factory.mktemp("deploy")
    shutil.copytree(REPO_DEPLOY, root / "deploy", ignore=shutil.ignore_patterns("generated"))
    for overlay, text in SPECS.items():
        body = text.format(**checkpoints) + f"output: {{dir: {root / 'out'}, cache_dir: {root / 'cache'}}}\n"
        (root / f"{overlay}.yaml").write_text(body)
    return root


def generate(root: Path, overlay: str, overrides=()) -> deploy.DeployPlan:
    """Run what `python -m pipeline deploy SPEC --overlay DIR` runs; returns the planned deployment."""
    return deploy.deploy_overlay(load_spec(root / f"{overlay}.yaml", list(overrides)), root / "deploy" / "overlays" / overlay)


def kustomize(folder: Path) -> list[dict]:
    """`kubectl kustomize` of a folder, as objects."""
    out = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


class Rendered(dict):
    """case -> (Deployment plan, rendered objects), generated and rendered on first use."""

    def __init__(self, workdir: Path):
        super().__init__()
        self.workdir = workdir

    def __missing__(self, case: str):
        overlay, _, example = case.partition("@")
        if example:
            try:
                spec = load_spec(REPO_DEPLOY.parent / deploy.EXAMPLE_SPECS[overlay])
            except SpecError as err:
                pytest.skip(f"example spec of {overlay} needs its checkpoints (make models): {err}")
        else:
            spec = load_spec(self.workdir / f"{overlay}.yaml")
        folder = self.workdir / "deploy" / "overlays" / overlay
        d = deploy.deploy_overlay(spec, folder)
        self[case] = (d, kustomize(folder))
        return self[case]


@pytest.fixture(scope="module")
def rendered(workdir):
    """case -> (Deployment plan, rendered objects)."""
    if KUBECTL is None:
        pytest.skip("kubectl (with kustomize) is not installed: overlays not rendered")
    return Rendered(workdir)


def find(objects, kind, name=None):
    """Objects of `kind` (and name prefix)."""
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"].startswith(name))]


def one(objects, kind, name=None):
    (obj,) = find(objects, kind, name)
    return obj


def pod_specs(objects):
    """(object name, pod spec) of every workload."""
    return [(o["metadata"]["name"], o["spec"]["template"]["spec"]) for o in objects if o["kind"] in ("Deployment", "Job")]


def containers(pod):
    return pod.get("initContainers", []) + pod["containers"]


def container(pod, name):
    (c,) = [c for c in containers(pod) if c["name"] == name]
    return c


def values_of(objects) -> dict:
    return one(objects, "ConfigMap", "specdeploy-values")["data"]


def files_of(objects) -> dict:
    return one(objects, "ConfigMap", "specdeploy-files")["data"]


# ----------------------------------------------------------------------------- rendering and schemas


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_overlay_renders_every_part(rendered, case):
    _d, objects = rendered[case]
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "ServiceAccount", "PersistentVolumeClaim", "Job", "Deployment", "Service",
            "PodDisruptionBudget", "NetworkPolicy", "HorizontalPodAutoscaler", "PodMonitor", "PrometheusRule",
            "ConfigMap"} <= kinds
    assert {o["metadata"]["name"].rsplit("-", 1)[0] for o in find(objects, "Job")} == {"specdeploy-engine-build", "specdeploy"}
    namespace = one(objects, "Namespace")["metadata"]["name"]
    assert all(o["metadata"].get("namespace") == namespace for o in objects if o["kind"] != "Namespace")


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_objects_validate_strictly_against_pinned_kubernetes_schemas(rendered, case):
    _d, objects = rendered[case]
    builtin = [o for o in objects if not o["apiVersion"].startswith(CRD_GROUP)]
    assert len(builtin) >= 14
    for obj in builtin:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {'.'.join(map(str, err.path))}: {err.message}")


@needs_kubectl
def test_strict_validation_rejects_a_misspelled_field(rendered):
    _d, objects = rendered["cpu-reference"]
    broken = json.loads(json.dumps(one(objects, "Deployment")))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"periodSeconds": 5}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    rule = json.loads(json.dumps(one(objects, "PrometheusRule")))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rule, CRD_SCHEMAS["PrometheusRule"])


# The part of the Prometheus operator's CRD schemas (monitoring.coreos.com/v1) these manifests use,
# written from its API reference; unknown fields are rejected as kubernetes-validate does in strict mode.
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {"type": "object", "required": ["name", "namespace"],
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": STRING_MAP}}
CRD_SCHEMAS = {
    "PodMonitor": {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"}, "metadata": METADATA,
                       "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"],
                                "properties": {
                                    "selector": {"type": "object", "additionalProperties": False,
                                                 "properties": {"matchLabels": STRING_MAP}},
                                    "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                                        "type": "object", "additionalProperties": False, "required": ["port"],
                                        "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                                       "interval": {"type": "string", "pattern": DURATION}}}}}}}},
    "PrometheusRule": {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"}, "metadata": METADATA,
                       "spec": {"type": "object", "additionalProperties": False, "required": ["groups"], "properties": {
                           "groups": {"type": "array", "minItems": 1, "items": {
                               "type": "object", "additionalProperties": False, "required": ["name", "rules"],
                               "properties": {
                                   "name": {"type": "string", "minLength": 1},
                                   "interval": {"type": "string", "pattern": DURATION},
                                   "rules": {"type": "array", "minItems": 1, "items": {
                                       "type": "object", "additionalProperties": False, "required": ["expr"],
                                       "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
                                       "properties": {"record": {"type": "string"}, "alert": {"type": "string"},
                                                      "expr": {"type": "string", "minLength": 1},
                                                      "for": {"type": "string", "pattern": DURATION},
                                                      "labels": STRING_MAP, "annotations": STRING_MAP}}}}}}}}}},
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric (and recorded series) names in a PromQL expression: identifiers followed by `{` or `[`."""
    return set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]", expr)) - {"by", "ignoring", "on", "without"}


def bls_metric_names() -> set[str]:
    """The spec_decode_* metric families pipeline/serving/metrics.py creates, read from its source (it imports
    triton_python_backend_utils, which exists only inside Triton): the pipeline.names constant each
    MetricFamily(...) call is given."""
    tree = ast.parse(BLS_METRICS.read_text())
    created = {node.args[0].id for node in ast.walk(tree) if isinstance(node, ast.Call)
               and isinstance(node.func, ast.Attribute) and node.func.attr == "MetricFamily" and node.args
               and isinstance(node.args[0], ast.Name)}
    return {getattr(names, c) for c in created if getattr(names, c).startswith("spec_decode_")}


def llmapi_model_metric_names() -> set[str]:
    """The spec_decode_* metrics our llmapi tensorrt_llm model exports: the SpecMetrics counters its source
    increments through SpecMetrics.count (read from the sources: they import triton_python_backend_utils)."""
    source = (REPO_DEPLOY.parent / "pipeline" / "serving" / "llmapi_model.py").read_text()
    assert "SpecMetrics(" in source and ".count(spec_decode_counts(" in source
    tree = ast.parse(BLS_METRICS.read_text())
    [count] = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "count"]
    used = {n.value.attr for n in ast.walk(count) if isinstance(n, ast.Attribute) and n.attr == "increment"}
    names_of = {"draft_tokens": names.DRAFT_TOKENS_METRIC, "accepted_tokens": names.ACCEPTED_TOKENS_METRIC,
                "rounds": names.ROUNDS_METRIC}
    return {names_of[u] for u in used}


def known_metric_names() -> set[str]:
    """Triton's metrics used here, the BLS's metrics and our recorded series."""
    triton = {"nv_inference_request_success", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
              "nv_inference_compute_infer_duration_us", "up"}
    return triton | bls_metric_names() | {deploy.QUEUE_RATIO_RECORD, deploy.ACCEPTANCE_RECORD}


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_monitoring_objects_structurally(rendered, case):
    """The Prometheus operator CRDs have no schema in kubernetes-validate: check their structure and references."""
    d, objects = rendered[case]
    for obj in objects:
        if obj["apiVersion"].startswith(CRD_GROUP):
            jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]])
    server = one(objects, "Deployment", "specdeploy-triton")
    pod_labels = server["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in container(server["spec"]["template"]["spec"], "triton")["ports"]}

    monitor = one(objects, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]["selector"]["matchLabels"].items()) <= set(pod_labels.items())
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    assert "metrics" in port_names

    rule = one(objects, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    known = known_metric_names()
    for r in rules:
        assert r["expr"].count("(") == r["expr"].count(")") and r["expr"].count("{") == r["expr"].count("}")
        assert promql_metric_names(r["expr"]) <= known, r["expr"]
    records = {r["record"]: r["expr"] for r in rules if "record" in r}
    assert "nv_inference_queue_duration_us" in records[deploy.QUEUE_RATIO_RECORD]
    assert "nv_inference_compute_infer_duration_us" in records[deploy.QUEUE_RATIO_RECORD]
    if toolchain_traits(d.toolchain).repository == "llmapi":
        # every series a rule reads exists on that path: Triton's per-model metrics (the contract's facts; NVIDIA's
        # model adds none) and the counters our tensorrt_llm model exports from the iteration stats
        on_path = set(llmapi_contract()["metrics"]["triton_llmapi_model"]["prometheus"]) | llmapi_model_metric_names()
        assert set().union(*(promql_metric_names(r["expr"]) for r in rules)) <= on_path | set(records)
    assert {deploy.DRAFT_TOKENS_METRIC, deploy.ACCEPTED_TOKENS_METRIC} <= promql_metric_names(records[deploy.ACCEPTANCE_RECORD])
    (alert,) = [r for r in rules if "alert" in r]
    assert alert["expr"].endswith(f"< {d.acceptance_floor}")
    assert d.acceptance_floor >= d.spec.speculative.min_acceptance_rate
    assert deploy.ACCEPTANCE_RECORD in alert["expr"] and f'namespace="{d.namespace}"' in alert["expr"]


def test_bls_exports_the_counters_the_rules_use():
    assert {deploy.DRAFT_TOKENS_METRIC, deploy.ACCEPTED_TOKENS_METRIC} <= bls_metric_names()


@needs_kubectl
def test_hpa_metric_is_served_by_the_adapter_from_the_recording_rule(rendered):
    _d, objects = rendered["gpu-draft-target"]
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "specdeploy-triton"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == deploy.HPA_METRIC
    adapter = yaml.safe_load((REPO_DEPLOY / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert rule["seriesQuery"].startswith(deploy.QUEUE_RATIO_RECORD + "{")
    assert re.fullmatch(rule["name"]["matches"], deploy.QUEUE_RATIO_RECORD)
    assert rule["name"]["as"] == deploy.HPA_METRIC
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


def test_grafana_dashboard_has_throughput_latency_and_acceptance_panels():
    dashboard = json.loads((REPO_DEPLOY / "base" / "grafana-dashboard.json").read_text())
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    assert {"throughput", "latency", "acceptance"} <= set(re.findall(r"[a-z]+", titles))
    known = known_metric_names()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            assert promql_metric_names(target["expr"]) <= known, target["expr"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


# ----------------------------------------------------------------------------- policies


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_every_container_has_requests_limits_and_a_restricted_security_context(rendered, case):
    _d, objects = rendered[case]
    for name, pod in pod_specs(objects):
        pod_security = pod["securityContext"]
        assert pod_security["runAsNonRoot"] is True and pod_security["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["automountServiceAccountToken"] is False, name
        for c in containers(pod):
            where = f"{name}/{c['name']}"
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), where
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert "privileged" not in sc, where


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_server_probes_startup_budget_and_draining(rendered, case):
    d, objects = rendered[case]
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    triton = container(pod, "triton")
    assert triton["startupProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    # readiness, liveness and preStop run our lifecycle commands (Triton's endpoints miss a dead stub and the drain)
    spec_args = [str(deploy.FILES_MOUNT / "spec.yaml"), "--repo", d.model_repo]
    python = "python3" if toolchain_traits(d.toolchain).gpu else "python"  # NVIDIA's images have no `python`
    assert triton["readinessProbe"]["exec"]["command"] == [python, "-m", "pipeline", "health", *spec_args]
    assert triton["livenessProbe"]["exec"]["command"] == [python, "-m", "pipeline", "health", "--live", *spec_args]
    for probe in ("readinessProbe", "livenessProbe"):
        assert "httpGet" not in triton[probe]
    assert triton["lifecycle"]["preStop"]["exec"]["command"] == [
        python, "-m", "pipeline", "drain", "--unready-delay", str(deploy.UNREADY_DELAY_S), *spec_args]
    assert {"name": "SPECDEPLOY_DRAIN_FILE", "value": deploy.DRAIN_FILE} in triton["env"]
    startup = triton["startupProbe"]
    budget_s = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget_s >= (1200 if toolchain_traits(d.toolchain).gpu else 300)  # a cold engine load
    # the grace covers the whole preStop drain (unready delay, budget, aborted requests' errors) and the stop
    drain_s = deploy.UNREADY_DELAY_S + d.spec.serving.drain_timeout_s + ABORT_WAIT_S
    assert pod["terminationGracePeriodSeconds"] >= drain_s + 30
    if toolchain_traits(d.toolchain).repository == "llmapi":  # no BLS to drain: tritonserver's exit timeout drains
        assert f"--exit-timeout-secs={math.ceil(d.spec.serving.drain_timeout_s)}" in " ".join(triton["command"])
        assert "mpirun" not in " ".join(triton["command"])
        assert "OMPI_MCA_odls_base_sigkill_timeout" not in {e["name"] for e in triton["env"]}
    elif toolchain_traits(d.toolchain).gpu:
        assert f"--exit-timeout-secs={deploy.EXIT_TIMEOUT_S}" in " ".join(triton["command"])
    shm = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm[0]["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in triton["volumeMounts"]
    hf = [e for e in triton["env"] if e["name"] == "HF_TOKEN"]
    assert hf[0]["valueFrom"]["secretKeyRef"] == {"name": "specdeploy-hf-token", "key": "token", "optional": True}


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_images_are_pinned(rendered, case):
    d, objects = rendered[case]
    images = {c["image"] for _name, pod in pod_specs(objects) for c in containers(pod)}
    for image in images:
        name, _, tag = image.rpartition(":")
        assert "@sha256:" in image or (name and tag and tag != "latest" and "/" not in tag), image
    expected = {f"{deploy.PIPELINE_IMAGE}:{__version__}"} | ({stack.TRITON_IMAGE} if toolchain_traits(d.toolchain).gpu else set())
    assert images == expected


@needs_kubectl
def test_an_overlay_can_pin_the_triton_image_by_digest(rendered, workdir):
    """What deploy/README.md tells users: an `images:` entry with a digest in the overlay."""
    folder = workdir / "deploy" / "overlays" / "gpu-medusa"
    digest = "sha256:" + "ab" * 32
    original = (folder / "kustomization.yaml").read_text()
    name = stack.TRITON_IMAGE.rsplit(":", 1)[0]
    try:
        (folder / "kustomization.yaml").write_text(original + f"images:\n- name: {name}\n  digest: {digest}\n")
        pod = one(kustomize(folder), "Deployment")["spec"]["template"]["spec"]
    finally:
        (folder / "kustomization.yaml").write_text(original)
    assert container(pod, "triton")["image"] == f"{name}@{digest}"


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_selectors_and_named_ports_reach_the_server_pods(rendered, case):
    _d, objects = rendered[case]
    server = one(objects, "Deployment")
    labels = server["spec"]["template"]["metadata"]["labels"]
    assert set(server["spec"]["selector"]["matchLabels"].items()) <= set(labels.items())
    ports = {p["name"]: p["containerPort"] for p in container(server["spec"]["template"]["spec"], "triton")["ports"]}
    service = one(objects, "Service")
    assert set(service["spec"]["selector"].items()) <= set(labels.items())
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {n: n for n in ("http", "grpc", "metrics")}
    assert set(one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items()) <= set(labels.items())
    policy = one(objects, "NetworkPolicy", "specdeploy-triton")
    assert set(policy["spec"]["podSelector"]["matchLabels"].items()) <= set(labels.items())
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"] and policy["spec"]["egress"] == []
    assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} == set(ports)
    bench_policy = one(objects, "NetworkPolicy", "specdeploy-bench")
    bench_pod = one(objects, "Job", "specdeploy-bench")["spec"]["template"]
    assert set(bench_policy["spec"]["podSelector"]["matchLabels"].items()) <= set(bench_pod["metadata"]["labels"].items())


# ----------------------------------------------------------------------------- values from the spec


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_values_agree_with_the_spec(rendered, case):
    d, objects = rendered[case]
    spec = d.spec
    s, e = spec.serving, spec.engine
    key = make_plan(spec, d.toolchain).build_key
    values = values_of(objects)

    # ports: Service, container and (trtllm) server flags
    service_ports = {p["name"]: p["port"] for p in one(objects, "Service")["spec"]["ports"]}
    assert service_ports == {"http": s.http_port, "grpc": s.grpc_port, "metrics": s.metrics_port}
    server = one(objects, "Deployment")["spec"]["template"]["spec"]
    triton = container(server, "triton")
    assert {p["name"]: p["containerPort"] for p in triton["ports"]} == service_ports
    assert (values["HTTP_PORT"], values["GRPC_PORT"], values["METRICS_PORT"]) == tuple(map(str, service_ports.values()))

    # GPU count = tp x pp on the server and the trtllm-build step; GPU product affinity; none on CPU
    job = one(objects, "Job", "specdeploy-engine-build")
    gpu_containers = [triton] + [c for c in containers(job["spec"]["template"]["spec"]) if c["name"] == "trtllm-build"]
    all_containers = [c for _n, pod in pod_specs(objects) for c in containers(pod)]
    if toolchain_traits(d.toolchain).gpu:
        assert len(gpu_containers) == 2
        for c in gpu_containers:
            assert c["resources"]["limits"]["nvidia.com/gpu"] == e.tp_size * e.pp_size
            assert c["resources"]["requests"]["nvidia.com/gpu"] == e.tp_size * e.pp_size
        for pod in (server, job["spec"]["template"]["spec"]):
            term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
            assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.product", "operator": "In", "values": [spec.gpu.name]}]
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert [c["name"] for c in job["spec"]["template"]["spec"]["initContainers"]] == ["stage-checkpoints", "trtllm-build"]
    else:
        assert not any("nvidia.com/gpu" in c["resources"].get("limits", {}) for c in all_containers)
        assert "affinity" not in server

    # build key: Job name, engine folder, READY marker the server waits for, staged checkpoint paths
    assert job["metadata"]["name"] == f"specdeploy-engine-build-{key}"
    assert values["BUILD_KEY"] == key and values["BUILD_DIR"] == f"/engines/{key}"
    assert values["MODEL_REPO"].startswith(f"/engines/{key}/")
    assert '"$BUILD_DIR/READY"' in " ".join(container(server, "wait-for-engines")["command"])
    staged = json.loads(files_of(objects)["checkpoints.json"])
    roles = {"draft_target": {"target", "draft"}, "medusa": {"target", "medusa"}, "eagle": {"target", "eagle"},
             "ngram": {"target"}, "none": {"target"}}
    assert {c["role"] for c in staged} == roles[spec.speculative.mode]
    assert all(c["dest"] == f"/models/{key}/{c['role']}" for c in staged)

    # the spec the pods load: same spec, pods' paths
    cluster = yaml.safe_load(files_of(objects)["spec.yaml"])
    assert cluster["output"]["dir"] == f"/engines/{key}" and cluster["serving"]["host"] == "0.0.0.0"
    assert cluster["models"]["target"]["checkpoint"] == f"/models/{key}/target"
    assert cluster["engine"] == {k: getattr(e, k) for k in cluster["engine"]}

    # model names and KV fractions: what the repository assembler will write
    names = values["TRITON_MODELS"].split(",")
    if toolchain_traits(d.toolchain).repository == "llmapi":
        assert names == ["tensorrt_llm"]  # NVIDIA's one LLM API model
    else:
        assert {"preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls", "ensemble"} <= set(names)
        assert ("tensorrt_llm_draft" in names) == (spec.speculative.mode == "draft_target")
    kv = s.kv_cache_free_gpu_mem_fraction
    if kv.target is not None:
        assert float(values["KV_CACHE_FREE_GPU_MEM_FRACTION_TARGET"]) == kv.target
        assert float(values["KV_CACHE_FREE_GPU_MEM_FRACTION_DRAFT"]) == kv.draft
    assert 0 < float(values["KV_CACHE_FREE_GPU_MEM_FRACTION_TARGET"]) < 1
    assert values["GPU_COUNT"] == str(e.tp_size * e.pp_size)


@needs_kubectl
@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("gpu-")])
def test_trtllm_build_step_runs_the_plan_script_on_the_staged_checkpoints(rendered, case):
    d, objects = rendered[case]
    script = files_of(objects)["trtllm.sh"]
    job = one(objects, "Job", "specdeploy-engine-build")["spec"]["template"]["spec"]
    assert container(job, "trtllm-build")["command"] == ["bash", "/etc/specdeploy/trtllm.sh"]
    assert script.splitlines()[1] == f'if [ -f "$BUILD_DIR/{deploy.READY}" ]; then echo "engines of build key $BUILD_KEY are ready"; exit 0; fi'
    # the same steps and keys as `plan --dry-run` on the local spec, with the pods' paths
    local = make_plan(d.spec, d.toolchain)
    assert [line.split()[1] for line in script.splitlines() if line.startswith("run_step ")] == [s.key for s in local.steps]
    assert f'TARGET_MODEL_DIR="${{TARGET_MODEL_DIR:-/models/{d.build_key}/target}}"' in script
    assert f'CACHE_DIR="${{CACHE_DIR:-/engines/cache/{d.toolchain}}}"' in script
    assert str(d.spec.models.target.checkpoint) not in script  # no path of this machine
    # the values ConfigMap reaches the script's environment: it must not override the script's own paths
    script_vars = set(re.findall(r'^([A-Z_]+)="\$\{', script, re.M))
    assert script_vars and not script_vars & set(values_of(objects))


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_variables_in_commands_are_defined(rendered, case):
    """$(VAR) is expanded by Kubernetes and $VAR by the shell: both must come from the container's environment."""
    _d, objects = rendered[case]
    values = set(values_of(objects))
    for name, pod in pod_specs(objects):
        for c in containers(pod):
            env = {e["name"] for e in c.get("env", [])}
            if any(ref.get("configMapRef", {}).get("name", "").startswith("specdeploy-values") for ref in c.get("envFrom", [])):
                env |= values
            text = " ".join(c.get("command", []) + c.get("args", []))
            used = set(re.findall(r"\$\(([A-Z_]+)\)", text)) | set(re.findall(r"\$([A-Z_]+)", text))
            assert used <= env, f"{name}/{c['name']}: {used - env}"


@needs_kubectl
def test_changed_engine_spec_gets_new_build_key_and_serving_change_does_not(workdir, rendered):
    d, _objects = rendered["cpu-reference"]
    changed = generate(workdir, "cpu-reference", ["models.draft.qformat=int8_wo"])
    assert changed.build_key != d.build_key
    objects = kustomize(workdir / "deploy" / "overlays" / "cpu-reference")
    assert one(objects, "Job", "specdeploy-engine-build")["metadata"]["name"].endswith(changed.build_key)
    assert values_of(objects)["BUILD_DIR"] == f"/engines/{changed.build_key}"
    ports_only = generate(workdir, "cpu-reference", ["serving.http_port=9100"])
    assert ports_only.build_key == d.build_key
    generate(workdir, "cpu-reference")  # restore for the other tests


# ----------------------------------------------------------------------------- the command line


def test_deploy_refuses_a_spec_for_the_other_toolchain(workdir):
    from pipeline.cli import main

    overlay = workdir / "deploy" / "overlays" / "gpu-medusa"
    code = main(["deploy", str(workdir / "cpu-reference.yaml"), "--overlay", str(overlay)])
    assert code == 2


def test_deploy_command_writes_the_component(workdir, capsys):
    from pipeline.cli import main

    overlay = workdir / "deploy" / "overlays" / "gpu-eagle"
    assert main(["deploy", str(workdir / "gpu-eagle.yaml"), "--overlay", str(overlay), "--hf-repo", "eagle=org/eagle"]) == 0
    assert "build key" in capsys.readouterr().out
    staged = {c["role"]: c for c in json.loads((overlay / "generated" / "checkpoints.json").read_text())}
    assert staged["eagle"]["hf_repo"] == "org/eagle" and staged["target"]["hf_repo"] is None
    assert main(["deploy", str(workdir / "gpu-eagle.yaml"), "--overlay", str(overlay), "--hf-repo", "drafty=x/y"]) == 2
    assert "--hf-repo" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the build Job's steps, run here


@pytest.fixture
def cluster_dirs(tmp_path, monkeypatch, checkpoints):
    """Point the pods' mounts at tmp folders; the checkpoints' folder plays the pipeline image's /app."""
    project = checkpoints["target"].parent.parent
    monkeypatch.setattr(deploy, "ENGINES_MOUNT", tmp_path / "engines")
    monkeypatch.setattr(deploy, "MODELS_MOUNT", tmp_path / "models")
    monkeypatch.setattr(deploy, "PROJECT_ROOT", project)
    monkeypatch.setattr(deploy, "APP_DIR", project)
    return tmp_path


def write_files(d: deploy.DeployPlan, folder: Path) -> Path:
    """The specdeploy-files ConfigMap as the pods see it under /etc/specdeploy."""
    folder.mkdir()
    for name, text in deploy.render_component(d).items():
        (folder / name).write_text(text)
    return folder


def test_build_job_stages_builds_and_marks_ready_what_the_server_serves(workdir, cluster_dirs):
    from pipeline.repo.validate import load_config

    spec = load_spec(workdir / "cpu-reference.yaml")
    d = deploy.plan_deployment(spec, "reference", "specdeploy-cpu")
    files = write_files(d, cluster_dirs / "etc")
    staged = deploy.stage_checkpoints(files / "checkpoints.json")
    assert [line.split(":")[0] for line in staged] == ["target", "draft"]
    assert (cluster_dirs / "models" / d.build_key / "draft" / "config.json").is_file()

    ready = cluster_dirs / "engines" / d.build_key / deploy.READY
    assert not ready.exists()
    deploy.build_in_cluster(files / "spec.yaml", "reference")
    assert ready.is_file()
    values = d.values()
    repo = Path(values["MODEL_REPO"])
    assert sorted(p.name for p in repo.iterdir()) == sorted(values["TRITON_MODELS"].split(","))
    for name, fraction in (("tensorrt_llm", values["KV_CACHE_FREE_GPU_MEM_FRACTION_TARGET"]),
                           ("tensorrt_llm_draft", values["KV_CACHE_FREE_GPU_MEM_FRACTION_DRAFT"])):
        config = load_config(repo / name / "config.pbtxt")
        assert float(config.parameters[deploy.KV_FRACTION_PARAM].string_value) == float(fraction)
    # a second run of the Job (same build key) does nothing
    assert "nothing to do" in deploy.build_in_cluster(files / "spec.yaml", "reference")


def test_stage_refuses_a_checkpoint_other_than_the_one_in_the_build_key(workdir, cluster_dirs):
    spec = load_spec(workdir / "cpu-reference.yaml")
    d = deploy.plan_deployment(spec, "reference")
    files = write_files(d, cluster_dirs / "etc")
    deploy.stage_checkpoints(files / "checkpoints.json")
    staged_config = cluster_dirs / "models" / d.build_key / "draft" / "config.json"
    staged_config.write_text(staged_config.read_text().replace("}", ', "edited": true}', 1))
    with pytest.raises(deploy.DeployError) as err:
        deploy.stage_checkpoints(files / "checkpoints.json")
    assert err.value.path == "draft" and "build key" in err.value.problem


def test_stage_without_a_source_says_how_to_provide_one(workdir, cluster_dirs, monkeypatch):
    monkeypatch.setattr(deploy, "PROJECT_ROOT", cluster_dirs / "elsewhere")  # checkpoints not in the image
    d = deploy.plan_deployment(load_spec(workdir / "gpu-medusa.yaml"), "trtllm")
    files = write_files(d, cluster_dirs / "etc")
    with pytest.raises(deploy.DeployError) as err:
        deploy.stage_checkpoints(files / "checkpoints.json")
    assert err.value.path == "target" and "--hf-repo target=" in err.value.fix


@pytest.mark.slow  # starts Triton with six python models: about a minute on two cores
def test_server_pod_command_serves_probes_metrics_and_the_benchmark_then_drains_on_sigterm(workdir, cluster_dirs):
    """The Triton container's own command on the build Job's output: probe paths answer, the benchmark
    Job's command runs against it, every metric the rules and dashboard read is exposed, and SIGTERM
    (what the kubelet sends after preStop) stops it well within the grace period."""
    import os
    import signal
    import time
    import urllib.request

    from clients.bench import main as bench_main
    from pipeline.server import free_ports

    http, grpc, metrics = free_ports(3)
    ports = [f"serving.http_port={http}", f"serving.grpc_port={grpc}", f"serving.metrics_port={metrics}"]
    d = deploy.plan_deployment(load_spec(workdir / "cpu-reference.yaml", ports), "reference")
    files = write_files(d, cluster_dirs / "etc")
    deploy.stage_checkpoints(files / "checkpoints.json")
    deploy.build_in_cluster(files / "spec.yaml", "reference")

    command = [a.replace("/tmp/tritonserver.log", str(cluster_dirs / "tritonserver.log"))
               .replace(str(deploy.FILES_MOUNT), str(files)) for a in deploy.server_command(d)]
    assert command[:4] == ["python", "-m", "pipeline", "serve"]
    server = subprocess.Popen([sys.executable, *command[1:]], cwd=REPO_DEPLOY.parent, start_new_session=True)
    try:
        deadline = time.monotonic() + 300  # the CPU overlay's startup budget
        while True:
            assert server.poll() is None, "the server command exited"
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2).status == 200:
                    break
            except OSError:
                assert time.monotonic() < deadline, "not ready within the startup budget"
                time.sleep(1)
        assert urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/live", timeout=5).status == 200

        # the benchmark Job's command, against this server instead of the Service, with a one-cell sweep
        job = yaml.safe_load((REPO_DEPLOY / "base" / "bench-job.yaml").read_text())
        (bench,) = job["spec"]["template"]["spec"]["containers"]
        assert bench["command"] == ["python", "-m", "clients.bench"]
        args = [a.replace("specdeploy-triton", "127.0.0.1").replace("$(GRPC_PORT)", str(grpc))
                .replace("$(METRICS_PORT)", str(metrics)).replace("/tmp/bench", str(cluster_dirs / "bench"))
                for a in bench["args"]]
        sweep = ["--prompts", "chat", "--concurrency", "1", "--k", "0,2", "--requests", "1", "--max-tokens", "4"]
        assert bench_main(args + sweep) == 0
        assert json.loads((cluster_dirs / "bench" / "bench.json").read_text())
        exposed = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()

        started = time.monotonic()
        os.kill(server.pid, signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        # the grace period minus what the preStop drain may use
        grace_s = deploy.termination_grace_s(d.spec)
        assert time.monotonic() - started < grace_s - deploy.UNREADY_DELAY_S - d.spec.serving.drain_timeout_s
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    exposed_names = {line.split("{")[0].split(" ")[0] for line in exposed.splitlines() if line and not line.startswith("#")}
    dashboard = json.loads((REPO_DEPLOY / "base" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [r["expr"] for g in deploy.prometheus_rule(d)["spec"]["groups"] for r in g["rules"]]
    used = set().union(*map(promql_metric_names, exprs)) - {"up", deploy.QUEUE_RATIO_RECORD, deploy.ACCEPTANCE_RECORD}
    assert {"nv_inference_queue_duration_us", deploy.ACCEPTED_TOKENS_METRIC} <= used
    assert used <= exposed_names


def test_trtllm_build_job_assembles_a_repository_serving_the_engines_its_script_links(workdir, cluster_dirs):
    """The build container's repository points at the engine folders trtllm.sh links (the GPU step is not run here)."""
    from pipeline.repo.validate import load_config

    d = deploy.plan_deployment(load_spec(workdir / "gpu-draft-target.yaml"), "trtllm")
    files = write_files(d, cluster_dirs / "etc")
    deploy.stage_checkpoints(files / "checkpoints.json")
    deploy.build_in_cluster(files / "spec.yaml", "trtllm")
    assert (cluster_dirs / "engines" / d.build_key / deploy.READY).is_file()
    engines_dir = re.search(r'^ENGINES_DIR="\$\{ENGINES_DIR:-(.*)\}"$', (files / "trtllm.sh").read_text(), re.M).group(1)
    repo = Path(d.values()["MODEL_REPO"])
    for name, role in (("tensorrt_llm", "target"), ("tensorrt_llm_draft", "draft")):
        config = load_config(repo / name / "config.pbtxt")
        assert config.backend == "tensorrtllm"
        assert config.parameters["gpt_model_path"].string_value == f"{engines_dir}/{role}"
        assert config.parameters["gpt_model_path"].string_value.startswith(d.values()["BUILD_DIR"] + "/")


@needs_kubectl
@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("gpu-")])
def test_trtllm_server_flags_exist_in_tritonserver(rendered, case):
    """Every tritonserver flag of the GPU server command is one the real binary (the wheel's 2.51) accepts."""
    from pipeline.server import tritonserver_root

    _d, objects = rendered[case]
    command = container(one(objects, "Deployment")["spec"]["template"]["spec"], "triton")["command"]
    if command[:2] == ["bash", "-c"]:  # trtllm-llmapi: copy the repository and NVIDIA's model code, then exec the server
        command = shlex.split(command[2].split(" && exec ", 1)[1])  # tritonserver itself: world size 1, no mpirun
    else:
        assert command[:4] == ["mpirun", "--allow-run-as-root", "-n", "1"]
        command = command[4:]
    assert Path(command[0]).name == "tritonserver"
    out = subprocess.run([str(tritonserver_root() / "bin" / "tritonserver"), "--help"],
                         capture_output=True, text=True, timeout=30)
    help_text = out.stdout + out.stderr
    accepted = set(re.findall(r"--[a-z][a-z-]*", help_text))
    assert "--model-repository" in accepted
    flags = {arg.split("=", 1)[0] for arg in command[1:]}
    assert flags <= accepted, flags - accepted


def test_plain_decoding_spec_has_no_draft_model_and_no_acceptance_alert(workdir):
    plain = ["speculative.mode=none", "models.draft=null", "speculative.max_draft_len=0", "speculative.num_draft_tokens=0"]
    d = deploy.plan_deployment(load_spec(workdir / "cpu-reference.yaml", plain), "reference", "ns")
    assert [c.role for c in d.checkpoints] == ["target"]
    assert "tensorrt_llm_draft" not in d.model_names and d.values()["KV_CACHE_FREE_GPU_MEM_FRACTION_DRAFT"] == ""
    rules = [r for g in deploy.prometheus_rule(d)["spec"]["groups"] for r in g["rules"]]
    assert [r.get("record") for r in rules] == [deploy.QUEUE_RATIO_RECORD, deploy.ACCEPTANCE_RECORD]


def test_stage_downloads_exactly_the_digested_files_with_the_token(workdir, cluster_dirs, monkeypatch, checkpoints):
    """The Hugging Face Hub is out of reach here: a stand-in snapshot_download serves the local folder."""
    import inspect

    import huggingface_hub

    assert {"repo_id", "local_dir", "token", "allow_patterns"} <= set(inspect.signature(huggingface_hub.snapshot_download).parameters)
    calls = []

    def snapshot_download(repo_id, local_dir, token, allow_patterns):
        calls.append({"repo_id": repo_id, "token": token, "allow_patterns": allow_patterns})
        Path(local_dir).mkdir(parents=True)
        for name in allow_patterns:
            shutil.copy2(checkpoints[repo_id.split("/")[1]] / name, Path(local_dir) / name)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(deploy, "PROJECT_ROOT", cluster_dirs / "elsewhere")  # not in the image: download
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    (checkpoints["target"] / "README.md").write_text("not part of the checkpoint's digest\n")
    d = deploy.plan_deployment(load_spec(workdir / "gpu-medusa.yaml"), "trtllm",
                               hf_repos=deploy.parse_hf_repos(["target=org/target", "medusa=org/medusa"]))
    files = write_files(d, cluster_dirs / "etc")
    assert [line.split(":")[0] for line in deploy.stage_checkpoints(files / "checkpoints.json")] == ["target", "medusa"]
    assert [c["repo_id"] for c in calls] == ["org/target", "org/medusa"] and {c["token"] for c in calls} == {"hf_test"}
    assert "README.md" not in calls[0]["allow_patterns"] and "config.json" in calls[0]["allow_patterns"]


def test_acceptance_floor_is_the_draft_to_target_cost_ratio(workdir):
    """A round of K drafts costs K*c + 1 target steps and yields 1 + r*K tokens: it pays only while r > c."""
    from pipeline.checkpoints import inspect_spec

    spec = load_spec(workdir / "cpu-reference.yaml")
    weights = {e.role: e.weight_bytes for e in inspect_spec(spec).memory.engines}
    cost_ratio = weights["draft"] / weights["target"]
    assert spec.speculative.min_acceptance_rate < cost_ratio < 1  # the tiny draft is a quarter of the layers
    plan = make_plan(spec, "reference")
    assert deploy.acceptance_floor(plan) == round(cost_ratio, 3)
    cheaper = make_plan(load_spec(workdir / "cpu-reference.yaml", ["models.draft.qformat=int8_wo"]), "reference")
    assert deploy.acceptance_floor(cheaper) < deploy.acceptance_floor(plan)  # a cheaper draft pays off sooner
    heads = make_plan(load_spec(workdir / "gpu-medusa.yaml", ["speculative.min_acceptance_rate=0.3"]), "trtllm")
    assert deploy.acceptance_floor(heads) == 0.3


def test_llmapi_build_job_assembles_a_repository_serving_the_staged_checkpoints(workdir, cluster_dirs):
    """trtllm-llmapi: the build container writes the llmapi repository whose model.yaml serves the ModelOpt output
    the GPU step writes (fp8 target) and the staged EAGLE-3 heads; the server command copies and serves it."""
    from pipeline.repo.llmapi import validate_llmapi_repo

    d = deploy.plan_deployment(load_spec(workdir / "gpu-llmapi.yaml"), "trtllm-llmapi")
    files = write_files(d, cluster_dirs / "etc")
    deploy.stage_checkpoints(files / "checkpoints.json")
    deploy.build_in_cluster(files / "spec.yaml", "trtllm-llmapi")
    assert (cluster_dirs / "engines" / d.build_key / deploy.READY).is_file()
    config = validate_llmapi_repo(Path(d.values()["MODEL_REPO"]))
    cache = re.search(r'^CACHE_DIR="\$\{CACHE_DIR:-(.*)\}"$', (files / "trtllm.sh").read_text(), re.M).group(1)
    [quantize] = [line.split()[1] for line in (files / "trtllm.sh").read_text().splitlines() if line.startswith("run_step ")]
    assert config["model"] == f"{cache}/{quantize}"  # what hf_ptq.py --export_path writes (then renamed)
    heads = next(c.cluster for c in d.checkpoints if c.role == "eagle")
    assert config["speculative_config"]["speculative_model_dir"] == heads
    script = deploy.server_command(d)[2]
    assert f"cp -r {d.values()['MODEL_REPO']} /tmp/llmapi_repo" in script and "--model-repository=/tmp/llmapi_repo" in script
