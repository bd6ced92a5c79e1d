"""The assembled model repository: Triton's schema, NVIDIA's interface, engine cross-checks, trtllm contract."""

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.repo.assemble import DraftTokenCosts, EngineInfo, assemble, engine_infos, repo_models, write_repo
from pipeline.repo.interface import MODEL_NAMES, contract, contract_interface
from pipeline.repo.launch import ORCHESTRATOR_ENV, render_launch_script, tritonserver_args, write_launch_script
from pipeline import stack
from pipeline.repo.validate import RepoError, load_config, validate_repo
from pipeline.limits import TOKENS_PER_BLOCK
from pipeline.reference import bf16_weight_gemm, fp16_weight_gemm, int8_screen
from pipeline.reference.engine import Request
from pipeline.reference.linear import DenseLinear, Float16Weights, argmax_output_layer
from pipeline.serving.reference_adapter import load_serving_engine
from pipeline.spec import load_spec
from specbuild.plan import make_plan
from tests.fake_tritonserver import EXIT_STATUS, recorded_args, wait_for, write_fake_tritonserver
from tests.triton_fixtures import MAX_DRAFT_LEN, write_spec


@pytest.fixture(scope="module")
def reference_repo(tiny_spec_engines, tmp_path_factory):
    """The reference repository assembled into a private folder (tests may tamper with it)."""
    plan = tiny_spec_engines.plan
    target, draft = engine_infos(plan)
    repo = write_repo(repo_models(plan, target, draft), tmp_path_factory.mktemp("repo") / "model_repo")
    return plan.spec, repo, target, draft


@pytest.fixture(scope="module")
def trtllm_repo(tiny_spec_engines):
    plan = make_plan(tiny_spec_engines.spec, "trtllm", inspection=tiny_spec_engines.plan.inspection)
    return plan.spec, assemble(plan)


def parse(path: Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


@pytest.mark.parametrize("toolchain", ["reference", "trtllm"])
def test_every_config_parses_and_validates(toolchain, reference_repo, trtllm_repo, tiny_spec_engines):
    spec, repo = (reference_repo[0], reference_repo[1]) if toolchain == "reference" else trtllm_repo
    plan = tiny_spec_engines.plan if toolchain == "reference" else make_plan(spec, toolchain, inspection=tiny_spec_engines.plan.inspection)
    target, draft = engine_infos(plan)
    configs = validate_repo(repo, spec, target, draft)
    assert sorted(configs) == sorted(MODEL_NAMES)
    for name in MODEL_NAMES:
        text = (repo / name / "config.pbtxt").read_text()
        assert "${" not in text
        assert parse(repo / name / "config.pbtxt").name == name


def test_tensors_match_nvidia_contract(reference_repo):
    _, repo, _, _ = reference_repo
    for name in MODEL_NAMES:
        cfg = parse(repo / name / "config.pbtxt")
        nvidia = contract_interface(name)
        declared = {t.name: t for t in cfg.input}
        for t in nvidia.inputs:  # every NVIDIA input is declared, with NVIDIA's type and dims
            assert t.name in declared, (name, t.name)
            assert mc.DataType.Name(declared[t.name].data_type) == t.data_type
            assert tuple(declared[t.name].dims) == t.dims
        assert {t.name for t in cfg.output} >= {t.name for t in nvidia.outputs}
    ensemble = parse(repo / "ensemble" / "config.pbtxt")
    assert {"num_draft_tokens", "use_draft_logits"} <= {t.name for t in ensemble.input}
    # a python model running the BLS's code (Triton passes no cancellation into a one-step ensemble)
    bls = parse(repo / "tensorrt_llm_bls" / "config.pbtxt")
    assert ensemble.backend == "python" and ensemble.model_transaction_policy.decoupled
    assert dict(ensemble.parameters) == dict(bls.parameters)
    assert (repo / "ensemble" / "1" / "model.py").read_bytes() == (repo / "tensorrt_llm_bls" / "1" / "model.py").read_bytes()


def test_the_served_draft_engine_runs_its_output_layer_in_16_bits(reference_repo, monkeypatch):
    """The reference repository marks tensorrt_llm_draft engine_role draft (the target none), and the engine loaded
    with those parameters runs the draft's float32 output layer on the fp16 kernel (a host without AVX512-BF16):
    its weights swapped for ones that leave two tokens a logit each (opposite signs, the rest 0), a request's every
    token is one of the two, which the float32 layer would not give. A role other than target or draft is refused by
    name."""
    if fp16_weight_gemm.kernel() is None:
        pytest.skip("the fp16 kernel does not run here")
    monkeypatch.setattr(bf16_weight_gemm, "kernel", lambda: None)
    _, repo, _, _ = reference_repo
    params = {name: {k: v.string_value for k, v in parse(repo / name / "config.pbtxt").parameters.items()}
              for name in ("tensorrt_llm", "tensorrt_llm_draft")}
    assert params["tensorrt_llm_draft"]["engine_role"] == "draft" and "engine_role" not in params["tensorrt_llm"]
    engines = {name: load_serving_engine(p["gpt_model_path"], p) for name, p in params.items()}
    draft = engines["tensorrt_llm_draft"].model
    assert isinstance(draft.lm_head_linear, Float16Weights)
    # the draft's costs are timed on the model as served in that role
    from pipeline.reference import step_cost
    timed = step_cost._served_engine(params["tensorrt_llm_draft"]["gpt_model_path"], draft=True).model
    assert isinstance(timed.lm_head_linear, Float16Weights) and type(timed.argmax_layer) is type(draft.argmax_layer)
    assert isinstance(engines["tensorrt_llm"].model.lm_head_linear, DenseLinear)
    # greedy rows on that layer's int8 screen where it runs
    assert isinstance(draft.argmax_layer, int8_screen.Int8Screen) == (int8_screen.kernel() is not None)
    two_tokens = torch.zeros_like(draft.lm_head)
    two_tokens[5], two_tokens[9] = draft.lm_head[7], -draft.lm_head[7]
    draft.lm_head_linear.kernel.packed = fp16_weight_gemm.pack(two_tokens)
    draft.argmax_layer = argmax_output_layer(draft.lm_head_linear)  # screening the swapped weights
    engine = engines["tensorrt_llm_draft"]
    engine.add_request(Request("r", list(range(3, 20)), 6))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert len(tokens) == 6 and set(tokens) <= {5, 9}
    with pytest.raises(ValueError, match="engine_role"):
        load_serving_engine(params["tensorrt_llm_draft"]["gpt_model_path"], {"engine_role": "drafter"})


def test_trtllm_repo_parameters(trtllm_repo, tiny_spec_engines):
    spec, repo = trtllm_repo
    keys = {p["key"] for p in contract()["models"]["tensorrt_llm"]["parameters"]}
    fractions = []
    for name, role in (("tensorrt_llm", "target"), ("tensorrt_llm_draft", "draft")):
        cfg = parse(repo / name / "config.pbtxt")
        params = {k: v.string_value for k, v in cfg.parameters.items()}
        assert cfg.backend == "tensorrtllm"
        assert cfg.model_transaction_policy.decoupled
        assert set(params) <= keys
        assert params["gpt_model_type"] == "inflight_fused_batching"
        assert params["gpt_model_path"] == str(spec.out_dir / "trtllm" / "engines" / role)
        assert params["enable_kv_cache_reuse"] == "true"
        assert params["exclude_input_in_output"] == "false"  # NVIDIA's draft-target recipe value
        fractions.append(float(params["kv_cache_free_gpu_mem_fraction"]))
    assert 0 < sum(fractions) < 1 and fractions[0] > fractions[1]  # the 4-layer target gets more than the 1-layer draft
    bls = {k: v.string_value for k, v in parse(repo / "tensorrt_llm_bls" / "config.pbtxt").parameters.items()}
    assert bls["tensorrt_llm_model_name"] == "tensorrt_llm"
    assert bls["tensorrt_llm_draft_model_name"] == "tensorrt_llm_draft"
    assert int(bls["verify_input_len"]) == spec.engine.max_input_len  # TensorRT-LLM's own input limit


@pytest.mark.parametrize("toolchain", ["reference", "trtllm"])
@pytest.mark.parametrize("decoupled", [True, False])
def test_serving_decoupled_sets_engines_and_bls(toolchain, decoupled, tiny_spec_engines):
    """serving.decoupled is NVIDIA's decoupled_mode: the engines and the BLS follow it, in both toolchains."""
    spec = dataclasses.replace(tiny_spec_engines.spec, serving=dataclasses.replace(
        tiny_spec_engines.spec.serving, decoupled=decoupled, streaming=decoupled))
    plan = make_plan(spec, toolchain, inspection=tiny_spec_engines.plan.inspection)
    target, draft = engine_infos(plan)
    configs = {m.name: m for m in repo_models(plan, target, draft)}
    for name in ("tensorrt_llm", "tensorrt_llm_draft", "tensorrt_llm_bls"):
        cfg = text_format.Parse(configs[name].render(), mc.ModelConfig())
        assert cfg.model_transaction_policy.decoupled is decoupled, name


def test_launch_script_matches_launcher_contract(trtllm_repo):
    """tritonserver gets what launch_triton_server.py --world_size=1 --multi-model composes, and nothing it lacks."""
    spec, repo = trtllm_repo
    facts = json.loads((Path("pipeline/contracts/trtllm-1.2.1-cli.json")).read_text())["launch_triton_server"]
    command = facts["tritonserver_command"]
    args = tritonserver_args(spec, repo)
    assert {a.split("=")[0] for a in args} <= set(command["flags"])
    assert set(command["always"][:1]) <= set(args)
    assert "--backend-config=python,shm-region-prefix-name=prefix0_" in args
    assert set(command["multi_model_flags"][:2]) <= set(args)
    assert ORCHESTRATOR_ENV == command["multi_model_env"]
    script = render_launch_script(spec, repo)
    assert stack.TRITON_IMAGE in script
    assert str(spec.out_dir / "trtllm" / "engines" / "draft" / "config.json") in script
    assert "pip install" not in script  # offline: nothing is fetched at launch
    # tritonserver's exit timeout after SIGTERM is the spec's drain budget (docs/reliability.md)
    assert f'EXIT_TIMEOUT_SECS="${{EXIT_TIMEOUT_SECS:-{math.ceil(spec.serving.drain_timeout_s)}}}"' in script


def test_launch_script_stays_in_foreground_and_forwards_sigterm(trtllm_repo, tmp_path):
    """The generated script, run as is with a fake tritonserver: it waits on the server and passes SIGTERM on."""
    spec, repo = trtllm_repo
    for role in ("target", "draft"):  # the engines the build script would have linked
        engine = spec.out_dir / "trtllm" / "engines" / role
        engine.mkdir(parents=True, exist_ok=True)
        (engine / "config.json").write_text("{}")
    fake = write_fake_tritonserver(tmp_path)
    env = {**os.environ, "TRITONSERVER": str(fake), "FAKE_DIR": str(tmp_path), "EXIT_TIMEOUT_SECS": "45"}
    proc = subprocess.Popen(["bash", str(write_launch_script(spec, repo))], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(tmp_path / "started", proc)
        assert proc.poll() is None  # still in the foreground while tritonserver runs
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == EXIT_STATUS  # tritonserver's own exit status
    finally:
        proc.kill()
    assert (tmp_path / "signal").read_text().strip() == "TERM"
    cwd, orchestrator, args = recorded_args(tmp_path)
    assert cwd == str(Path.cwd()) and orchestrator == "1"  # the project root: the python models import it
    assert f"--model-repository={repo}" in args and "--exit-timeout-secs=45" in args


def test_launch_script_refuses_missing_engines(trtllm_repo, tmp_path):
    spec, repo = trtllm_repo
    script = write_launch_script(spec, repo)
    shutil.rmtree(spec.out_dir / "trtllm" / "engines", ignore_errors=True)
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                            env={**os.environ, "TRITONSERVER": "/bin/false"}, timeout=60)
    assert result.returncode == 1 and "run the build script first" in result.stderr


def _rewrite(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_placeholder_and_schema_errors_are_caught(reference_repo, tmp_path):
    spec, repo, target, draft = reference_repo
    bad = shutil.copytree(repo, tmp_path / "repo")
    _rewrite(bad / "preprocessing" / "config.pbtxt", 'max_batch_size: 8', 'max_batch_size: ${triton_max_batch_size}')
    with pytest.raises(RepoError, match="placeholder"):
        validate_repo(bad, spec, target, draft)
    _rewrite(bad / "preprocessing" / "config.pbtxt", 'max_batch_size: ${triton_max_batch_size}', 'max_batch: 8')
    with pytest.raises(RepoError, match="not a valid Triton ModelConfig"):
        load_config(bad / "preprocessing" / "config.pbtxt")


def test_interface_drift_is_caught(reference_repo, tmp_path):
    spec, repo, target, draft = reference_repo
    bad = shutil.copytree(repo, tmp_path / "repo")
    cfg = bad / "tensorrt_llm" / "config.pbtxt"
    _rewrite(cfg, 'name: "input_lengths"\n  data_type: TYPE_INT32', 'name: "input_lengths"\n  data_type: TYPE_INT64')
    with pytest.raises(RepoError, match="input_lengths has data_type TYPE_INT64"):
        validate_repo(bad, spec, target, draft)
    shutil.copy(repo / "tensorrt_llm" / "config.pbtxt", cfg)
    _rewrite(cfg, 'key: "gpt_model_type"', 'key: "gpt_model_typo"')
    with pytest.raises(RepoError, match="gpt_model_typo"):
        validate_repo(bad, spec, target, draft)


def test_engine_cross_checks(reference_repo):
    spec, repo, target, draft = reference_repo
    small = dataclasses.replace(target, max_batch_size=4)
    with pytest.raises(RepoError, match="max_batch_size 8 exceeds the engine's 4"):
        validate_repo(repo, spec, small, draft)
    short = dataclasses.replace(target, max_draft_len=2)
    with pytest.raises(RepoError, match="num_draft_tokens 3 exceeds the target engine's max_draft_len 2"):
        validate_repo(repo, spec, short, draft)


def test_draft_logits_need_gathered_draft_logits(tiny_spec_engines, tmp_path):
    spec = load_spec(write_spec(tmp_path, tiny_spec_engines.target_dir, tiny_spec_engines.draft_dir,
                                **{"speculative.use_draft_logits": True}))
    plan = make_plan(dataclasses.replace(spec, output=tiny_spec_engines.spec.output), "reference")
    target, draft = engine_infos(plan)
    assert not draft.gather_generation_logits  # built without use_draft_logits
    repo = write_repo(repo_models(plan, target, draft), tmp_path / "model_repo")
    with pytest.raises(RepoError, match="does not gather generation logits"):
        validate_repo(repo, spec, target, draft)
    ok = dataclasses.replace(draft, gather_generation_logits=True)
    validate_repo(repo, spec, target, ok)


def test_tokenizer_must_be_the_targets(reference_repo, tmp_path):
    spec, repo, target, draft = reference_repo
    bad = shutil.copytree(repo, tmp_path / "repo")
    _rewrite(bad / "postprocessing" / "config.pbtxt", str(spec.models.target.checkpoint), str(spec.models.draft.checkpoint))
    with pytest.raises(RepoError, match="postprocessing: tokenizer_dir .* is not the target's tokenizer"):
        validate_repo(bad, spec, target, draft)


def test_engine_info_reads_engine_config(tiny_spec_engines):
    info = EngineInfo.from_engine_dir(tiny_spec_engines.spec.out_dir / "engines" / "target")
    assert (info.max_batch_size, info.max_draft_len, info.vocab_size) == (8, MAX_DRAFT_LEN, 512)


def test_planned_limits_are_what_the_build_writes(tiny_spec_engines):
    """EngineLimits is one type: the limits the repository plans for a GPU host's engine equal those a built
    engine's config.json holds (read by the repository and the reference engine alike)."""
    plan = tiny_spec_engines.plan
    built = EngineInfo.from_engine_dir(plan.spec.out_dir / "engines" / "target")
    assert EngineInfo.planned(plan, "target", built.path) == built
    assert built.max_draft_len == MAX_DRAFT_LEN and built.tokens_per_block == TOKENS_PER_BLOCK


@pytest.mark.parametrize("toolchain, floor, measured", [("reference", 0.2, True), ("reference", 0.0, False),
                                                         ("trtllm", 0.2, False)])
def test_bls_gets_the_draft_token_cost_measured_on_the_built_engines(tiny_spec_engines, toolchain, floor, measured):
    """The BLS's switch-off bar: the break-even measured on the reference engines at the spec's K goes into
    tensorrt_llm_bls's config (and BlsSettings reads it); 0 when min_acceptance_rate 0 turns the switch-off
    off, and for engines built on a GPU host (not timed here)."""
    from pipeline.repo.assemble import measured_draft_token_costs
    from pipeline.serving.params import BlsSettings

    spec = tiny_spec_engines.spec
    spec = dataclasses.replace(spec, speculative=dataclasses.replace(spec.speculative, min_acceptance_rate=floor))
    plan = make_plan(spec, toolchain, inspection=tiny_spec_engines.plan.inspection)
    target, draft = engine_infos(plan)
    costs = measured_draft_token_costs(plan, target, draft)
    # the BLS drafts one request's rounds: batch 1 only, at K; the tiny draft has a quarter of the target's layers
    assert [b for b, _ in costs.at_k] == ([1] if measured else []) and all(c > 0 for _, c in costs.at_k)
    assert costs.at_one == ()  # the BLS's switch-off prices a draft token alone
    bls = {m.name: m for m in repo_models(plan, target, draft, costs)}["tensorrt_llm_bls"]
    settings = BlsSettings.from_parameters(bls.parameters)
    cost = costs.at_k[0][1] if costs.at_k else 0.0
    assert settings.draft_token_cost == cost
    assert settings.switch_off_below == (max(floor, cost) if floor else 0.0)


def test_draft_token_cost_is_measured_once_per_engine_pair(tiny_spec_engines):
    """A second assembly of the same engines reuses the measured cost (kept in the output dir by engine pair and K)."""
    from pipeline.repo.assemble import measured_draft_token_costs

    spec = tiny_spec_engines.spec
    spec = dataclasses.replace(spec, speculative=dataclasses.replace(spec.speculative, min_acceptance_rate=0.2))
    plan = make_plan(spec, "reference", inspection=tiny_spec_engines.plan.inspection)
    target, draft = engine_infos(plan)
    first = measured_draft_token_costs(plan, target, draft)
    memo_path = spec.out_dir / "draft_token_cost.json"
    memo = json.loads(memo_path.read_text())
    (key,) = [k for k in memo if f"K={spec.speculative.num_draft_tokens} batches=1 on " in k]
    memo[key] = [[[1, first.at_k[0][1] + 1.0]]]  # what the file says the next assembly uses: nothing measured again
    memo_path.write_text(json.dumps(memo))
    try:
        assert measured_draft_token_costs(plan, target, draft).at_k == ((1, first.at_k[0][1] + 1.0),)
    finally:
        memo[key] = [first.at_k]
        memo_path.write_text(json.dumps(memo))


def memo_keys_added(tiny_spec_engines):
    """A function that assembles the tiny engines' draft-token costs (switch-off on) and returns the keys this call
    added to the memo; `.keys` holds every key after the last call."""
    from pipeline.repo.assemble import measured_draft_token_costs

    spec = tiny_spec_engines.spec
    spec = dataclasses.replace(spec, speculative=dataclasses.replace(spec.speculative, min_acceptance_rate=0.2))
    plan = make_plan(spec, "reference", inspection=tiny_spec_engines.plan.inspection)
    target, draft = engine_infos(plan)
    memo_path = spec.out_dir / "draft_token_cost.json"

    def measure() -> set[str]:
        before = set(json.loads(memo_path.read_text())) if memo_path.is_file() else set()
        measured_draft_token_costs(plan, target, draft)
        measure.keys = set(json.loads(memo_path.read_text()))
        return measure.keys - before

    return measure


@pytest.mark.parametrize("switch, value", [("int8_grid_gemm", "0"), ("fp16_weight_gemm", "0"), ("row_attention", "0"),
                                           ("decode_threads", "1")])
def test_draft_token_cost_is_measured_again_with_the_other_kernel(tiny_spec_engines, monkeypatch, switch, value):
    """The memo's key names the CPU, the kernel switches and a forced decode thread count: a cost timed on other
    kernels or threads is not reused."""
    import importlib

    measure = memo_keys_added(tiny_spec_engines)
    measure()
    env = importlib.import_module(f"pipeline.reference.{switch}").ENV
    monkeypatch.setenv(env, value)
    (added,) = measure()
    assert f"{env}={value}" in added


def test_draft_token_cost_is_measured_again_with_other_engine_code(tiny_spec_engines, monkeypatch, tmp_path):
    """The memo's key holds a digest of the engine's code (its Python, kernel sources and headers): a kernel change
    measures the cost again, as a change to any other file of the engine does; files that are not code do not."""
    import shutil

    from pipeline.reference import step_cost

    code = tmp_path / "reference"
    shutil.copytree(Path(step_cost.__file__).parent, code, ignore=shutil.ignore_patterns("__pycache__"))
    digest = step_cost.engine_code_digest(code)
    assert digest == step_cost.engine_code_digest()  # the copy's code is the engine's
    (code / "notes.md").write_text("not code")
    assert step_cost.engine_code_digest(code) == digest
    kernel = code / "csrc" / "row_attention.cpp"
    kernel.write_text(kernel.read_text() + "\n// changed\n")
    assert step_cost.engine_code_digest(code) != digest
    changed = step_cost.engine_code_digest(code)
    header = code / "csrc" / "int8_avx2_groups.h"  # a header the kernels include
    header.write_text(header.read_text() + "\n// changed\n")
    assert step_cost.engine_code_digest(code) != changed

    measure = memo_keys_added(tiny_spec_engines)
    measure()
    assert all(f"by engine code {digest}" in key for key in measure.keys if "batches=1 on " in key)
    changed = step_cost.engine_code_digest(code)
    monkeypatch.setattr(step_cost, "engine_code_digest", lambda: changed)  # the engine, as if its kernel had changed
    (added,) = measure()
    assert f"by engine code {changed}" in added


def test_an_engine_running_prompt_lookup_gets_the_cost_per_batch_size(tiny_spec_engines):
    """Where the engine applies the policy to a whole running batch, the cost of a draft token is measured at each
    batch size up to max_batch_for_speculation, in drafts of K and of one token, through the engine's steps (as it
    drafts there), and a step's cost per draft row count at every batch size from 2 up to the largest (1.0 with none,
    never less with more), for every draft row its requests can make (8 x 3 here: a cost past the timed rows is only
    extrapolated); the engine's policy reads all three from its config."""
    from pipeline.repo.assemble import measured_draft_token_costs
    from pipeline.serving.reference_adapter import lookup_proposer
    from pipeline.spec import NgramSpec

    spec = tiny_spec_engines.spec
    spec = dataclasses.replace(spec, models=dataclasses.replace(spec.models, draft=None), speculative=dataclasses.replace(
        spec.speculative, mode="ngram", ngram=NgramSpec(1, 3, 0.0), num_draft_tokens=3, max_batch_for_speculation=8,
        min_acceptance_rate=0.1))
    plan = make_plan(spec, "reference", inspection=tiny_spec_engines.plan.inspection)
    target, _ = engine_infos(plan)
    costs = measured_draft_token_costs(plan, target, None)
    for curve in (costs.at_k, costs.at_one):
        assert [b for b, _ in curve] == [1, 2, 4, 8] and all(c >= 0 for _, c in curve)
    assert [b for b, _ in costs.rows] == [2, 3, 4, 5, 6, 7, 8]
    for batch, row in costs.rows:  # up to the batch's drafts of K = 3
        assert len(row) == 3 * batch + 1 and row[0] == 1.0 and list(row) == sorted(row)
    memo = json.loads((spec.out_dir / "draft_token_cost.json").read_text())
    assert [k for k in memo if " ngram K=3,1 batches=1,2,4,8 " in k and k.endswith(" through engine steps")]
    engine = {m.name: m for m in repo_models(plan, target, None, costs)}["tensorrt_llm"]
    assert engine.parameters["draft_token_cost"] == " ".join(f"{b}:{c}" for b, c in costs.at_k)
    assert engine.parameters["one_token_cost"] == " ".join(f"{b}:{c}" for b, c in costs.at_one)
    assert engine.parameters["row_cost"] == " ".join(f"{b}:{','.join(map(str, row))}" for b, row in costs.rows)
    config = lookup_proposer(engine.parameters, target.max_draft_len).config
    assert (config.draft_token_costs, config.one_token_costs, config.row_costs) == costs


@pytest.mark.parametrize("toolchain", ["reference", "trtllm"])
def test_prompt_lookup_runs_in_the_reference_engine_and_in_the_trtllm_bls(tiny_spec_engines, toolchain, tmp_path):
    """speculative.mode ngram: the reference engine drafts by prompt lookup in its own steps, so its tensorrt_llm
    carries the lookup's settings and the num_draft_tokens input, and the BLS only forwards K (engine_lookup).
    TensorRT engines cannot look up: there the BLS does (draft_tokens_external) and tensorrt_llm keeps NVIDIA's
    interface. Both repositories validate."""
    from pipeline.reference.policy import PolicyConfig
    from pipeline.serving.params import BlsSettings
    from pipeline.serving.reference_adapter import lookup_proposer
    from pipeline.spec import NgramSpec

    spec = tiny_spec_engines.spec
    spec = dataclasses.replace(spec, models=dataclasses.replace(spec.models, draft=None), speculative=dataclasses.replace(
        spec.speculative, mode="ngram", ngram=NgramSpec(1, 3, 0.4), num_draft_tokens=3, max_batch_for_speculation=4))
    plan = make_plan(spec, toolchain, inspection=tiny_spec_engines.plan.inspection)
    target, draft = engine_infos(plan)
    assert draft is None
    costs = DraftTokenCosts(at_k=((1, 0.25), (4, 1.2)), at_one=((1, 0.5), (4, 1.3)))
    models = {m.name: m for m in repo_models(plan, target, None, costs)}
    validate_repo(write_repo(list(models.values()), tmp_path / "model_repo"), spec, target, None)
    engine, settings = models["tensorrt_llm"], BlsSettings.from_parameters(models["tensorrt_llm_bls"].parameters)
    if toolchain == "reference":
        assert "num_draft_tokens" in {t.name for t in engine.inputs}
        assert settings.engine_lookup and "ngram_min" not in models["tensorrt_llm_bls"].parameters
        proposer = lookup_proposer(engine.parameters, target.max_draft_len)
        assert (proposer.inner.min_ngram, proposer.inner.max_ngram, proposer.inner.min_token_prob) == (1, 3, 0.4)
        assert proposer.config == PolicyConfig(num_draft_tokens=3, max_draft_tokens=target.max_draft_len, adaptive=True,
                                               min_acceptance_rate=spec.speculative.min_acceptance_rate,
                                               draft_token_costs=costs.at_k, one_token_costs=costs.at_one,
                                               max_batch_for_speculation=4,
                                               min_new_tokens_for_speculation=0)
        assert settings.draft_token_cost == 0.25  # the BLS's own rounds: the cost at batch 1
    else:
        assert "num_draft_tokens" not in {t.name for t in engine.inputs}
        assert "speculative_mode" not in engine.parameters and not settings.engine_lookup
        assert (settings.ngram_min, settings.ngram_max, settings.ngram_min_token_prob) == (1, 3, 0.4)
