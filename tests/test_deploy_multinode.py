"""Past one node: a spec whose tp_size x pp_size exceeds gpu.gpus_per_node deploys as a LeaderWorkerSet.

The overlay renders with kustomize, the LeaderWorkerSet validates strictly against the CRD schema of
kubernetes-sigs/lws v0.10.0 (pipeline/contracts/lws-v0.10.0-crd.json) and its pod templates against
Kubernetes 1.32, every spec-derived value (world size, group size, GPUs per pod, ranks, ports) agrees
with the spec, the pods keep the Deployment's probes, drain, security and volumes, and a spec that
fits one node still gets the Deployment. Checkpoints: config-only Llama-3.1-70B / Llama-3.2-1B
(pipeline/fixtures/config_only.py), as the real ones cannot be downloaded here.
"""

import json
import math
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pipeline import deploy, lws
from pipeline.spec import SpecError, load_spec
from specbuild.plan import make_plan
from pipeline.fixtures.config_only import write_config_only_checkpoint
from tests.test_deploy import (KUBERNETES_VERSION, REPO_DEPLOY, container, containers, files_of, kustomize, needs_kubectl,
                               one, values_of)

OVERLAY = "gpu-multinode"
CRD = Path(deploy.__file__).parent / "contracts" / "lws-v0.10.0-crd.json"
TARGET, DRAFT = "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct"
# Non-default values everywhere: 3 pods per group, ports, GPU product, KV fractions.
SPEC = """
name: mn-tiny
toolchain: trtllm
models:
  target: {{checkpoint: {target}, dtype: bfloat16}}
  draft: {{checkpoint: {draft}, dtype: bfloat16}}
speculative: {{mode: draft_target, max_draft_len: 6, num_draft_tokens: 3}}
engine: {{max_batch_size: 8, max_input_len: 4096, max_seq_len: 8192, tp_size: 4, pp_size: 6}}
serving: {{kv_cache_free_gpu_mem_fraction: {{target: 0.7, draft: 0.1}}, http_port: 8200, grpc_port: 8201, metrics_port: 8202}}
gpu: {{name: NVIDIA-L40S, memory_gib: 44.5, count: 24, gpus_per_node: 8}}
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Config-only Llama-3.1-70B and Llama-3.2-1B checkpoints."""
    root = tmp_path_factory.mktemp("llama")
    return {"target": write_config_only_checkpoint(root / TARGET, TARGET), "draft": write_config_only_checkpoint(root / DRAFT, DRAFT)}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, llama):
    """A copy of deploy/ and the tiny multi-node spec."""
    root = tmp_path_factory.mktemp("deploy-mn")
    shutil.copytree(REPO_DEPLOY, root / "deploy", ignore=shutil.ignore_patterns("generated"))
    out = f"output: {{dir: {root / 'out'}, cache_dir: {root / 'cache'}}}\n"
    (root / "spec.yaml").write_text(SPEC.format(**llama) + out)
    return root


def example_spec(llama, *overrides) -> "deploy.Spec":
    """examples/multinode.yaml on the config-only checkpoints."""
    return load_spec(REPO_DEPLOY.parent / deploy.EXAMPLE_SPECS[OVERLAY],
                     [f"models.target.checkpoint={llama['target']}", f"models.draft.checkpoint={llama['draft']}", *overrides])


def render(workdir: Path, spec, overlay: str = OVERLAY) -> tuple[deploy.DeployPlan, list[dict]]:
    """`python -m pipeline deploy` into the overlay, then `kubectl kustomize` of it."""
    folder = workdir / "deploy" / "overlays" / overlay
    d = deploy.deploy_overlay(spec, folder)
    return d, kustomize(folder)


@pytest.fixture(scope="module")
def rendered(workdir, llama):
    """case -> (plan, objects): the tiny spec and the example spec in the multinode overlay."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with kustomize) is not installed: overlays not rendered")
    return {"tiny": render(workdir, load_spec(workdir / "spec.yaml")), "example": render(workdir, example_spec(llama))}


CASES = ["tiny", "example"]


def named(objects, kind, name) -> dict:
    """The object of `kind` called exactly `name`."""
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def unhashed(obj):
    """`obj` with the generated ConfigMaps' content-hash suffixes removed (the two renderings hold different specs)."""
    return json.loads(re.sub(r'"(specdeploy-(?:values|files))-[a-z0-9]{10}"', r'"\1"', json.dumps(obj)))


def templates(objects) -> dict[str, dict]:
    """role -> pod template of the LeaderWorkerSet."""
    group = one(objects, lws.KIND)["spec"]["leaderWorkerTemplate"]
    return {"leader": group["leaderTemplate"], "worker": group["workerTemplate"]}


def leader_contexts(script: str) -> tuple[list[str], list[list[str]]]:
    """(mpirun options, one argv per app context) of the leader script's exec line."""
    start = script.index("exec mpirun")
    argv = shlex.split(script[start + len("exec "):].replace("\\\n", " "))
    contexts, current = [], []
    for arg in argv[argv.index("--host") + 2:]:
        if arg == ":":
            contexts.append(current)
            current = []
        else:
            current.append(arg)
    return argv[:argv.index("--host") + 2], contexts + [current]


# ----------------------------------------------------------------------------- schemas


def strict(schema):
    """A CRD's structural schema as a JSON schema that rejects unknown fields, as the API server's strict field validation."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def lws_schema():
    contract = json.loads(CRD.read_text())
    assert contract["_meta"]["source"]["repo"] == "kubernetes-sigs/lws" and contract["kind"] == lws.KIND
    assert f"{contract['group']}/{contract['version']}" == lws.API_VERSION
    return strict(contract["openAPIV3Schema"])


def validate_lws(obj, schema):
    """The CRD schema, and LWS's webhook rules this manifest touches (size >= 1; maxUnavailable 0 only with maxSurge)."""
    jsonschema.validate(obj, schema)
    spec = obj["spec"]
    assert spec["leaderWorkerTemplate"]["size"] >= 1
    rolling = spec["rolloutStrategy"]["rollingUpdateConfiguration"]
    assert rolling["maxUnavailable"] != 0 or rolling["maxSurge"] != 0


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_leaderworkerset_validates_strictly_against_the_lws_crd(rendered, lws_schema, case):
    _d, objects = rendered[case]
    validate_lws(one(objects, lws.KIND), lws_schema)


@needs_kubectl
def test_crd_validation_rejects_unknown_fields_and_wrong_types(rendered, lws_schema):
    _d, objects = rendered["tiny"]
    good = one(objects, lws.KIND)
    for path, value in ((("spec", "leaderWorkerTemplate", "sizes"), 2),
                        (("spec", "leaderWorkerTemplate", "size"), "two"),
                        (("spec", "leaderWorkerTemplate", "workerTemplate", "spec", "containers", 0, "readinessProbe"),
                         {"periodSeconds": 5, "httpGets": {}}),
                        (("spec", "leaderWorkerTemplate", "restartPolicy"), "Always")):
        broken = json.loads(json.dumps(good))
        node = broken
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, lws_schema)


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_pod_templates_and_builtin_objects_validate_against_kubernetes(rendered, case):
    _d, objects = rendered[case]
    for role, template in templates(objects).items():
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role}, "template": template}
        kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)
    for obj in objects:
        if obj["apiVersion"] != lws.API_VERSION and not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


# ----------------------------------------------------------------------------- shape


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_leaderworkerset_replaces_the_deployment_and_the_stack_follows(rendered, case):
    _d, objects = rendered[case]
    assert not [o for o in objects if o["kind"] == "Deployment"]
    lws_obj = one(objects, lws.KIND)
    assert lws_obj["metadata"]["name"] == lws.NAME and "replicas" not in lws_obj["spec"]  # the HPA owns it
    assert lws_obj["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    # the HPA scales groups; the Service reaches leaders only (rank 0 serves); PDB and NetworkPolicies select the pods
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": lws.API_VERSION, "kind": lws.KIND, "name": lws.NAME}
    leader, worker = templates(objects)["leader"], templates(objects)["worker"]
    service = one(objects, "Service")["spec"]["selector"]
    assert service[lws.WORKER_INDEX_LABEL] == "0"
    assert set(service.items()) - {(lws.WORKER_INDEX_LABEL, "0")} <= set(leader["metadata"]["labels"].items())
    for template in (leader, worker):
        labels = template["metadata"]["labels"]
        assert set(one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items()) <= set(labels.items())
        assert set(named(objects, "NetworkPolicy", "specdeploy-triton")["spec"]["podSelector"]["matchLabels"].items()) <= set(labels.items())
    mpi = named(objects, "NetworkPolicy", "specdeploy-triton-mpi")["spec"]
    assert mpi["podSelector"]["matchLabels"] == {lws.NAME_LABEL: lws.NAME}
    assert {"podSelector": {"matchLabels": {lws.NAME_LABEL: lws.NAME}}} in mpi["ingress"][0]["from"]
    # the leader (only) may exec into pods, with its own service account
    assert leader["spec"]["serviceAccountName"] == "specdeploy-mpi-launcher" and leader["spec"]["automountServiceAccountToken"]
    assert worker["spec"]["automountServiceAccountToken"] is False
    (rule_exec,) = [r for r in one(objects, "Role", "specdeploy-mpi-launcher")["rules"] if "pods/exec" in r["resources"]]
    assert rule_exec["verbs"] == ["create"]
    binding = one(objects, "RoleBinding", "specdeploy-mpi-launcher")
    assert binding["subjects"][0]["name"] == "specdeploy-mpi-launcher"
    assert binding["subjects"][0]["namespace"] == one(objects, "Namespace")["metadata"]["name"]
    # every ConfigMap a template names exists (kustomize's hashed names reach the LeaderWorkerSet too)
    configmaps = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
    for template in (leader, worker):
        referenced = {v["configMap"]["name"] for v in template["spec"]["volumes"] if "configMap" in v}
        referenced |= {r["configMapRef"]["name"] for c in containers(template["spec"]) for r in c.get("envFrom", [])}
        assert referenced and referenced <= configmaps


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_pods_keep_the_deployments_probes_drain_security_shm_and_volumes(rendered, workdir, case):
    """The same spec on nodes large enough for it renders the Deployment: the LWS pods carry its settings."""
    d, objects = rendered[case]
    one_node = load_spec(d.spec.source, [f"gpu.gpus_per_node={d.gpu_count}"] + (
        [] if case == "tiny" else [f"models.target.checkpoint={d.spec.models.target.checkpoint}",
                                   f"models.draft.checkpoint={d.spec.models.draft.checkpoint}"]))
    single, single_objects = render(workdir, one_node)
    assert single.topology is None
    deployment = unhashed(one(single_objects, "Deployment")["spec"]["template"])
    render(workdir, d.spec)  # restore the multi-node component for the other tests
    for role, template in unhashed(templates(objects)).items():
        pod, ref = template["spec"], deployment["spec"]
        for key in ("securityContext", "terminationGracePeriodSeconds", "tolerations", "affinity", "volumes",
                    "topologySpreadConstraints", "enableServiceLinks"):
            assert pod[key] == ref[key], (role, key)
        server, ref_server = container(pod, lws.CONTAINER), container(ref, lws.CONTAINER)
        for key in ("image", "securityContext", "volumeMounts", "lifecycle", "envFrom", "workingDir"):
            assert server[key] == ref_server[key], (role, key)
        assert server["resources"]["limits"]["memory"] == ref_server["resources"]["limits"]["memory"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in server["volumeMounts"]
        assert [c["name"] for c in ref.get("initContainers", [])] == [c["name"] for c in pod["initContainers"]][:len(ref["initContainers"])]
        env = {e["name"] for e in server["env"]}
        assert env == {e["name"] for e in ref_server["env"]} - {"TRTLLM_ORCHESTRATOR"}  # leader mode across nodes
    leader = container(templates(objects)["leader"]["spec"], lws.CONTAINER)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert leader[probe] == container(deployment["spec"], lws.CONTAINER)[probe]
    worker = container(templates(objects)["worker"]["spec"], lws.CONTAINER)
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe"} & set(worker)
    assert worker["command"] == ["bash", f"{lws.FILES}/{lws.WORKER_SCRIPT}"]


# ----------------------------------------------------------------------------- values from the spec


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_spec_derived_values_agree_with_the_spec(rendered, case):
    d, objects = rendered[case]
    e, s, gpu = d.spec.engine, d.spec.serving, d.spec.gpu
    world = e.tp_size * e.pp_size
    size = math.ceil(world / gpu.gpus_per_node)
    per_pod = world // size
    assert world > gpu.gpus_per_node and size >= 2

    # group size and GPUs per pod: LWS, both templates, values; the build Job builds every rank on one node
    assert one(objects, lws.KIND)["spec"]["leaderWorkerTemplate"]["size"] == size
    for template in templates(objects).values():
        resources = container(template["spec"], lws.CONTAINER)["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == per_pod == gpu.gpus_per_node
    job = one(objects, "Job", "specdeploy-engine-build")["spec"]["template"]["spec"]
    assert container(job, "trtllm-build")["resources"]["limits"]["nvidia.com/gpu"] == min(world, gpu.gpus_per_node)
    builds = [line for line in files_of(objects)["trtllm.sh"].splitlines() if " trtllm-build " in line]
    assert len(builds) == 2 and all(f"--workers {gpu.gpus_per_node}" in line for line in builds)  # ranks r on GPU r % 8
    assert job["affinity"] == templates(objects)["leader"]["spec"]["affinity"]
    values = values_of(objects)
    assert (values["GPU_COUNT"], values["LWS_SIZE"], values["GPUS_PER_POD"]) == (str(world), str(size), str(per_pod))
    assert (values["TP_SIZE"], values["PP_SIZE"]) == (str(e.tp_size), str(e.pp_size))

    # ranks: one app context per rank, ranks_per_pod slots per pod, rank 0 (and only rank 0) serves
    files = files_of(objects)
    script = files[lws.LEADER_SCRIPT]
    options, contexts = leader_contexts(script)
    assert options[options.index("--host") + 1] == "$MPI_HOSTS"
    assert len(contexts) == world and all(c[:3] == ["-n", "1", "tritonserver"] for c in contexts)
    assert f'"${{LWS_GROUP_SIZE:-}}" != "{size}"' in script and f"seq 1 {size - 1}" in script
    assert script.count(f":{per_pod}\"") == 2  # leader and worker slots in MPI_HOSTS
    ports = {f"--http-port={s.http_port}", f"--grpc-port={s.grpc_port}", f"--metrics-port={s.metrics_port}"}
    repo = f"--model-repository={values['MODEL_REPO']}"
    engine_models = {"--load-model=tensorrt_llm", "--load-model=tensorrt_llm_draft"}
    for rank, argv in enumerate(contexts):
        assert ports <= set(argv) and repo in argv
        assert f"--backend-config=python,shm-region-prefix-name=specdeploy{rank}_" in argv
        if rank == 0:
            assert not engine_models & set(argv) and not any(a.startswith("--allow-") for a in argv)
        else:
            assert engine_models <= set(argv) and "--model-control-mode=explicit" in argv
            assert {"--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"} <= set(argv)
    assert [r for p in range(size) for r in d.topology.pod_ranks(p)] == list(range(world))

    # ports: Service, leader container, rank 0
    service_ports = {p["name"]: p["port"] for p in one(objects, "Service")["spec"]["ports"]}
    assert service_ports == {"http": s.http_port, "grpc": s.grpc_port, "metrics": s.metrics_port}
    leader = container(templates(objects)["leader"]["spec"], lws.CONTAINER)
    assert {p["name"]: p["containerPort"] for p in leader["ports"]} == service_ports
    assert leader["command"] == ["bash", f"{lws.FILES}/{lws.LEADER_SCRIPT}"]
    assert f"kubectl exec \"$pod\" -c {lws.CONTAINER}" in files[lws.AGENT_SCRIPT]
    assert make_plan(d.spec, "trtllm").build_key == values["BUILD_KEY"]


@needs_kubectl
@pytest.mark.parametrize("case", CASES)
def test_images_are_pinned_and_commands_use_defined_variables(rendered, case):
    _d, objects = rendered[case]
    values = set(values_of(objects))
    lws_env = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}  # injected by LWS into every container
    for role, template in templates(objects).items():
        for c in containers(template["spec"]):
            name, _, tag = c["image"].rpartition(":")
            assert name and tag and tag != "latest" and "/" not in tag, (role, c["name"], c["image"])
            env = {e["name"] for e in c.get("env", [])} | lws_env | (values if c.get("envFrom") else set())
            text = " ".join(c.get("command", []))
            assert set(re.findall(r"\$\(([A-Z_]+)\)", text)) <= env
    script = files_of(objects)[lws.LEADER_SCRIPT]
    assert set(re.findall(r"\$\{?([A-Z_]+)", script)) <= lws_env | {"MPI_HOSTS"}


@needs_kubectl
def test_any_gpu_overlay_gets_the_leaderworkerset_when_the_spec_needs_it(workdir):
    d, objects = render(workdir, load_spec(workdir / "spec.yaml"), overlay="gpu-draft-target")
    assert d.topology.size == 3 and not [o for o in objects if o["kind"] == "Deployment"]
    assert one(objects, lws.KIND)["metadata"]["namespace"] == one(objects, "Namespace")["metadata"]["name"] == "specdeploy-draft-target"


def test_mpi_scripts_are_valid_bash_and_the_leader_refuses_a_different_group_size(workdir, tmp_path):
    d = deploy.plan_deployment(load_spec(workdir / "spec.yaml"), "trtllm")
    files = deploy.render_component(d)
    for name in (lws.LEADER_SCRIPT, lws.WORKER_SCRIPT):
        path = tmp_path / name
        path.write_text(files[f"{lws.SERVER_COMPONENT}/{name}"])
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    out = subprocess.run(["bash", str(tmp_path / lws.LEADER_SCRIPT)], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin", "LWS_GROUP_SIZE": str(d.topology.size + 1),
                              "LWS_LEADER_ADDRESS": "specdeploy-triton-0.specdeploy-triton.ns"})
    assert out.returncode == 1 and f"starts ranks on {d.topology.size} pods" in out.stderr


def test_worker_waits_for_its_ranks_after_sigterm(workdir, tmp_path):
    """In its own PID namespace (as in a container): SIGTERM leaves the worker running while a tritonserver rank runs."""
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
        pytest.skip("unshare --pid (a PID namespace, like the pod's) is not permitted here")
    d = deploy.plan_deployment(load_spec(workdir / "spec.yaml"), "trtllm")
    (tmp_path / "worker.sh").write_text(deploy.render_component(d)[f"{lws.SERVER_COMPONENT}/{lws.WORKER_SCRIPT}"])
    shutil.copy(shutil.which("sleep"), tmp_path / "tritonserver")  # a process named like a rank
    scenario = f"""
        {tmp_path}/tritonserver 60 & rank=$!
        bash {tmp_path}/worker.sh & worker=$!
        sleep 1; kill -TERM $worker; sleep 3
        kill -0 $worker && echo "worker waits for the rank"
        kill $rank; wait $worker; echo "worker exit $?"
    """
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c", scenario],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["worker waits for the rank", "worker exit 0"], out.stdout + out.stderr


@needs_kubectl
def test_rank_flags_exist_in_tritonserver(rendered):
    from pipeline.server import tritonserver_root

    _d, objects = rendered["tiny"]
    _options, contexts = leader_contexts(files_of(objects)[lws.LEADER_SCRIPT])
    out = subprocess.run([str(tritonserver_root() / "bin" / "tritonserver"), "--help"], capture_output=True, text=True, timeout=30)
    accepted = set(re.findall(r"--[a-z][a-z-]*", out.stdout + out.stderr))
    flags = {a.split("=", 1)[0] for argv in contexts for a in argv[3:]}
    assert {"--model-control-mode", "--load-model", "--allow-http"} <= flags <= accepted, flags - accepted


# ----------------------------------------------------------------------------- when and why


def test_a_spec_that_fits_one_node_gets_the_unchanged_deployment_component(workdir, llama):
    """gpus_per_node matters only when exceeded: the single-node component is the same file for file."""
    spec = load_spec(workdir / "spec.yaml", ["engine.pp_size=1", "gpu.gpus_per_node=8"])
    at_limit = deploy.plan_deployment(spec, "trtllm")
    roomier = deploy.plan_deployment(load_spec(workdir / "spec.yaml", ["engine.pp_size=1", "gpu.gpus_per_node=64"]), "trtllm")
    assert at_limit.topology is None and roomier.topology is None
    a, b = deploy.render_component(at_limit), deploy.render_component(roomier)
    assert set(a) == set(b) and not any("/" in name for name in a)
    assert {name for name in a if a[name] != b[name]} == {"spec.yaml"}  # which holds gpus_per_node itself
    patch = yaml.safe_load(a["triton-deployment.yaml"])
    assert patch["kind"] == "Deployment"
    assert patch["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert "LWS_SIZE" not in at_limit.values()


def test_topology_sizes_and_refusals():
    t = lws.Topology(tp_size=8, pp_size=2, gpus_per_node=8)
    assert (t.world, t.size, t.ranks_per_pod, list(t.pod_ranks(1))) == (16, 2, 8, list(range(8, 16)))


@pytest.mark.parametrize("overrides, field", [
    (["engine.tp_size=4", "engine.pp_size=3", "gpu.count=12"], "engine.pp_size"),        # 12 ranks: 1.5 nodes
    (["engine.tp_size=3", "engine.pp_size=8", "gpu.count=24"], "engine.tp_size"),        # tp groups straddle nodes
    (["gpu.gpus_per_node=4"], "gpu.gpus_per_node"),                                       # engines assume 8 per node
])
def test_impossible_multinode_layouts_name_the_field(workdir, overrides, field):
    with pytest.raises(SpecError) as err:
        deploy.plan_deployment(load_spec(workdir / "spec.yaml", overrides), "trtllm")
    assert err.value.path == field and err.value.fix


def test_reference_toolchain_never_spans_nodes(workdir):
    spec = load_spec(workdir / "spec.yaml", ["toolchain=auto"])
    assert lws.topology(spec, "reference") is None and lws.topology(spec, "trtllm") is not None


def test_llmapi_toolchain_refuses_to_span_nodes_saying_why(workdir):
    """NVIDIA's llmapi model can run an MPI world across nodes (trtllm-llmapi-launch per rank); that launch is not
    generated here, and the one-line refusal says so instead of claiming the model cannot."""
    spec = load_spec(workdir / "spec.yaml", ["toolchain=auto"])
    with pytest.raises(SpecError) as err:
        lws.topology(spec, "trtllm-llmapi")
    assert err.value.path == "toolchain" and "\n" not in str(err.value)
    assert "trtllm-llmapi-launch" in err.value.problem and "not generated" in err.value.problem


def test_example_memory_plan_shows_why_two_nodes(llama):
    """70B bf16 + 1B draft with 128k context on 24 GB A10Gs: one 8-GPU node cannot hold one full sequence, two can."""
    from pipeline.checkpoints import inspect_spec

    spec = example_spec(llama)
    two_nodes = inspect_spec(spec).memory
    target = next(x for x in two_nodes.engines if x.role == "target")
    assert target.token_capacity >= spec.engine.max_seq_len
    with pytest.raises(SpecError) as err:
        inspect_spec(example_spec(llama, "engine.pp_size=1", "gpu.count=8"))
    assert err.value.path == "gpu.memory_gib" and str(spec.engine.max_seq_len) in err.value.problem
    assert lws.topology(spec, "trtllm").size == 2


def test_make_deploy_render_skips_the_example_whose_checkpoints_are_absent(workdir, monkeypatch, tmp_path):
    """`python -m pipeline.deploy examples` (make deploy-render) on a machine without the 70B checkpoints."""
    monkeypatch.setattr(deploy, "EXAMPLE_SPECS", {OVERLAY: deploy.EXAMPLE_SPECS[OVERLAY]})
    overlays = tmp_path / "overlays"
    shutil.copytree(workdir / "deploy" / "overlays", overlays)
    (overlays / OVERLAY / deploy.GENERATED).mkdir(exist_ok=True)  # a stale component must not stay behind
    spec = load_spec(REPO_DEPLOY.parent / deploy.EXAMPLE_SPECS[OVERLAY], check_paths=False)
    if spec.models.target.checkpoint.exists():
        pytest.skip("the example's checkpoints are on this machine")
    (reason,) = deploy.deploy_examples(overlays).values()
    assert isinstance(reason, str) and "models.target.checkpoint" in reason
    assert not (overlays / OVERLAY / deploy.GENERATED).exists()
