"""The trtllm-llmapi toolchain: every example it supports plans, renders and validates (script, llmapi
repository, trtllm-serve options) with every generated key checked against the recorded LLM API facts; the
others are refused in one line. GPU-only: checked through its contract (pipeline/contracts/llmapi.json)."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from pipeline.llmapi import ContractError, check_llm_args, contract, llm_args, spelling
from pipeline.repo.assemble import assemble, kv_fractions
from pipeline.repo.config import parse_pbtxt
from pipeline.names import ACCEPTED_TOKENS_METRIC, DRAFT_TOKENS_METRIC, ROUNDS_METRIC
from pipeline.repo.llmapi import NVIDIA_MODEL_FILE, OPTIONS_FILE, LlmapiRepoError, validate_llmapi_repo, write_llmapi_repo
from pipeline.rules import load_spec
from pipeline.server import TritonServer, free_ports
from pipeline.serving.iteration_stats import SpecDecodeCounts, spec_decode_counts
from pipeline.spec import SpecError
from specbuild.plan import make_plan
from specbuild.toolchains.trtllm_llmapi import model_dirs, render_script, trtllm_serve_command
from pipeline import stack
from pipeline.fixtures.config_only import write_config_only_mtp_checkpoint
from pipeline.fixtures.models import make_random_eagle3
from tests.fake_tritonserver import EXIT_STATUS, recorded_args, wait_for, write_fake_tritonserver

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
TC = "trtllm-llmapi"
# examples whose spec this toolchain refuses, with the field the one-line error names
REFUSED = {"default.yaml": "models.target.qformat",  # int8_sq: the CPU kernels' choice, no PyTorch-backend recipe
           "draft-target.yaml": "speculative.use_draft_logits", "eagle.yaml": "speculative.eagle.version",
           "medusa.yaml": "speculative.mode", "qformat-int8-sq.yaml": "models.target.qformat",
           "qformat-weight-only.yaml": "models.target.qformat"}


@pytest.fixture(scope="module")
def eagle3_heads(derived_pair, tmp_path_factory):
    return make_random_eagle3(derived_pair[0], tmp_path_factory.mktemp("e3") / "eagle3", dtype="float32", draft_vocab_size=256)


def tiny_spec(example: Path, derived_pair, heads, tmp_path, extra=()):
    """The example on tiny checkpoints, outputs in tmp_path, toolchain trtllm-llmapi. An MTP example (DeepSeek-V3,
    not downloadable here) gets a tiny config-only DeepSeek-V3-style target: all that inspect, plan and repo read."""
    spec = load_spec(example, check_paths=False)
    target = write_config_only_mtp_checkpoint(tmp_path / "ds3") if spec.speculative.mode == "mtp" else derived_pair[0]
    sets = [f"models.target.checkpoint={target}", f"output.dir={tmp_path / 'out'}",
            f"output.cache_dir={tmp_path / 'cache'}", f"toolchain={TC}"]
    if spec.models.draft is not None:
        sets.append(f"models.draft.checkpoint={derived_pair[1]}")
    if spec.speculative.eagle is not None and spec.speculative.eagle.version == 3:  # 4 layers: too shallow for the default
        sets += [f"speculative.eagle.checkpoint={heads}", "speculative.eagle.layers_to_capture=[0, 1, 2]"]
    return load_spec(example, sets + list(extra))


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.name not in REFUSED], ids=lambda p: p.name)
def test_supported_examples_plan_render_and_validate(example, derived_pair, eagle3_heads, tmp_path):
    spec = tiny_spec(example, derived_pair, eagle3_heads, tmp_path)
    plan = make_plan(spec, TC)
    quantized = [r for r, m in (("target", spec.models.target), ("draft", spec.models.draft))
                 if m is not None and (m.qformat != "none" or m.kv_cache_dtype != "none")
                 and (r == "target" or spec.speculative.mode == "draft_target")]
    assert [s.label for s in plan.steps] == [f"{r}/quantize" for r in quantized]  # no engine build

    repo = assemble(plan)
    config = validate_llmapi_repo(repo)
    words = spelling()
    e, s = spec.engine, spec.speculative
    dirs = model_dirs(plan)
    assert config["model"] == str(dirs["target"]) and config["backend"] == "pytorch"
    assert (config["tensor_parallel_size"], config["pipeline_parallel_size"]) == (e.tp_size, e.pp_size)
    assert (config["max_batch_size"], config["max_num_tokens"], config["max_seq_len"]) == \
        (e.max_batch_size, e.max_num_tokens, e.max_seq_len)
    two_model = s.mode == "draft_target"
    assert config["kv_cache_config"]["enable_block_reuse"] == (spec.serving.enable_kv_cache_reuse and not two_model)
    assert config["kv_cache_config"]["free_gpu_memory_fraction"] == kv_fractions(plan)["target"]  # the memory plan's
    assert config["triton_config"] == {"max_batch_size": 0, "decoupled": True}
    sc = config.get("speculative_config")
    if s.mode == "none":
        assert sc is None
    elif s.mode == "mtp":  # TensorRT-LLM derives max_draft_len from num_nextn_predict_layers
        assert sc == {"decoding_type": "MTP", "num_nextn_predict_layers": s.num_draft_tokens}
    else:
        assert sc["max_draft_len"] == s.num_draft_tokens
    if s.mode == "eagle":
        assert sc == {"decoding_type": words["decoding_type"]["eagle3"], "max_draft_len": s.num_draft_tokens,
                      words["speculative_model_key"]: str(spec.speculative.eagle.checkpoint),
                      "eagle3_one_model": True, "eagle3_layers_to_capture": [0, 1, 2]}
    if s.mode == "draft_target":
        assert sc["decoding_type"] == words["decoding_type"]["draft_target"]
        assert sc[words["speculative_model_key"]] == str(dirs["draft"])
    if s.mode == "ngram":
        assert sc == {"decoding_type": "NGram", "max_draft_len": s.num_draft_tokens,
                      "max_matching_ngram_size": s.ngram.max_ngram if s.ngram else 3,
                      "is_keep_all": True, "is_use_oldest": False, "is_public_pool": False}

    # trtllm-serve: the same keys without `model`, which is its positional argument
    options = yaml.safe_load((repo.parent / OPTIONS_FILE).read_text())
    assert options == {k: v for k, v in config.items() if k not in ("model", "triton_config")}
    serve = trtllm_serve_command(spec, dirs["target"], repo.parent / OPTIONS_FILE)
    assert serve[:2] == ["trtllm-serve", config["model"]] and serve[serve.index("--extra_llm_api_options") + 1] == \
        str(repo.parent / OPTIONS_FILE)

    # config.pbtxt: NVIDIA's llmapi interface, no per-request speculation inputs, decoupled like model.yaml
    cfg = parse_pbtxt((repo / "tensorrt_llm" / "config.pbtxt").read_text())
    names = {t.name for t in cfg.input}
    assert names == set(contract()["config_pbtxt"]["inputs"]) and not names & {"num_draft_tokens", "use_draft_logits"}
    assert cfg.model_transaction_policy.decoupled and cfg.max_batch_size == 0

    script = render_script(plan)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert script.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in script
    [server] = [shlex.split(line) for line in script.splitlines() if line.startswith('"$TRITONSERVER" ')]
    assert server[-1] == "&" and "mpirun" not in script  # a child the script waits on (test_launch_script_*)
    assert "--model-repository=$LLMAPI_REPO" in server and "--disable-auto-complete-config" in server
    assert f'LLMAPI_REPO="${{LLMAPI_REPO:-{repo}}}"' in script
    for step in plan.steps:
        [line] = [l for l in script.splitlines() if l.startswith(f"run_step {step.key} ")]
        args = shlex.split(line)[5:]
        value = dict(zip(args[::2], args[1::2]))
        model = getattr(spec.models, step.role)
        assert value["--qformat"] == model.qformat and value["--calib_size"] == str(model.calib_size)
        assert value["--kv_cache_qformat"] == model.kv_cache_dtype
        assert value["--export_path"] == f"$CACHE_DIR/{step.key}.tmp"
        assert value.get("--awq_block_size") == (str(model.group_size) if model.qformat == "int4_awq" else None)


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.name in REFUSED], ids=lambda p: p.name)
def test_unsupported_examples_are_refused_in_one_line(example, derived_pair, eagle3_heads, tmp_path):
    with pytest.raises(SpecError) as err:
        tiny_spec(example, derived_pair, eagle3_heads, tmp_path)
    message = str(err.value)
    assert message.startswith(REFUSED[example.name] + ": ") and "\n" not in message and "fix: " in message


def test_key_spelling_follows_the_release(derived_pair, eagle3_heads, tmp_path):
    """1.2.1 reads the late-2025 names; releases after PRs #10099/#10124 read Eagle3 / Draft_Target /
    speculative_model; each release's check refuses the other's spelling."""
    spec = tiny_spec(REPO / "examples/eagle3.yaml", derived_pair, eagle3_heads, tmp_path)
    dirs = {"target": derived_pair[0]}
    old = llm_args(spec, dirs, release="1.2.1")["speculative_config"]
    new = llm_args(spec, dirs, release="after-pr10124")["speculative_config"]
    assert (old["decoding_type"], "speculative_model_dir" in old) == ("Eagle", True)
    assert (new["decoding_type"], "speculative_model" in new) == ("Eagle3", True)
    with pytest.raises(ContractError, match="decoding_type 'Eagle3'"):
        check_llm_args({"model": "m", "backend": "pytorch", "speculative_config": new}, release="1.2.1")
    with pytest.raises(ContractError, match="speculative_model_dir"):
        check_llm_args({"model": "m", "backend": "pytorch", "speculative_config": {**old, "decoding_type": "Eagle3"}},
                       release="after-pr10124")
    draft = tiny_spec(REPO / "examples/qformat-fp8.yaml", derived_pair, eagle3_heads, tmp_path)
    assert llm_args(draft, {"target": derived_pair[0], "draft": derived_pair[1]}, release="after-pr10124")[
        "speculative_config"]["decoding_type"] == "Draft_Target"
    with pytest.raises(SpecError, match="^toolchain: no LLM API facts for TensorRT-LLM 9.9"):
        spelling("9.9")


def test_quantized_models_are_served_from_their_cached_modelopt_output(derived_pair, eagle3_heads, tmp_path):
    spec = tiny_spec(REPO / "examples/default.yaml", derived_pair, eagle3_heads, tmp_path,
                     ["models.target.qformat=fp8", "models.target.kv_cache_dtype=fp8",
                      "speculative.ngram.min_token_prob=0"])  # NGramDecodingConfig has no cut
    plan = make_plan(spec, TC)
    [step] = plan.steps
    assert make_plan(spec, TC).steps[0].key == step.key  # content-addressed: the same inputs, the same key
    assert make_plan(load_spec(spec.source, [f"models.target.checkpoint={derived_pair[0]}", "models.target.qformat=int4_awq", "models.target.group_size=64",
                                             "speculative.ngram.min_token_prob=0",
                                             f"output.cache_dir={tmp_path / 'cache'}", f"toolchain={TC}"]), TC).steps[0].key != step.key
    config = yaml.safe_load((assemble(plan) / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert config["model"] == str(tmp_path / "cache" / TC / step.key)
    assert config["kv_cache_config"]["dtype"] == "fp8"


def test_a_repository_that_disagrees_with_itself_is_caught(derived_pair, eagle3_heads, tmp_path):
    spec = tiny_spec(REPO / "examples/eagle3.yaml", derived_pair, eagle3_heads, tmp_path)
    repo = assemble(make_plan(spec, TC))
    model_yaml = repo / "tensorrt_llm" / "1" / "model.yaml"
    config = yaml.safe_load(model_yaml.read_text())
    model_yaml.write_text(yaml.safe_dump({**config, "triton_config": {"max_batch_size": 0, "decoupled": False}}))
    with pytest.raises(LlmapiRepoError, match="disagrees with model.yaml"):
        validate_llmapi_repo(repo)
    model_yaml.write_text(yaml.safe_dump({**config, "speculative_config": {**config["speculative_config"], "medusa_choices": [[0]]}}))
    with pytest.raises(ContractError, match="medusa_choices"):
        validate_llmapi_repo(repo)


def test_clients_speak_the_llmapi_model_and_refuse_per_request_speculation(derived_pair, eagle3_heads, tmp_path):
    """The clients library maps a request onto the generated llmapi interface (text_input + sampling_param_*),
    and refuses num_draft_tokens / use_draft_logits (the CLI, OpenAI frontend and bench all build these requests)."""
    from tritonclient.grpc import model_config_pb2 as mc

    from clients.client import ClientError, GenerateRequest, ModelInputs, SamplingParams, _grpc_request

    repo = assemble(make_plan(tiny_spec(REPO / "examples/eagle3.yaml", derived_pair, eagle3_heads, tmp_path), TC))
    cfg = parse_pbtxt((repo / "tensorrt_llm" / "config.pbtxt").read_text())
    wire_type = {"TYPE_STRING": "BYTES"}
    model = ModelInputs(cfg.name, {t.name: (wire_type.get(mc.DataType.Name(t.data_type), mc.DataType.Name(t.data_type)[5:]),
                                            list(t.dims)) for t in cfg.input})
    assert model.is_llmapi
    request = GenerateRequest("Hello", max_tokens=5, sampling=SamplingParams(temperature=0.0, top_k=1, seed=3), stop_words=["x"])
    encoded = model.encode(request.wire_fields(stream=True))
    assert encoded == {"text_input": "Hello", "sampling_param_max_tokens": 5, "streaming": True,
                       "sampling_param_exclude_input_from_output": True, "sampling_param_stop": ["x"],
                       "sampling_param_return_perf_metrics": True, "sampling_param_temperature": 0.0,
                       "sampling_param_top_k": 1, "sampling_param_seed": 3}
    message = _grpc_request(model, request, stream=True)
    assert {t.name: t.datatype for t in message.inputs}["sampling_param_seed"] == "UINT64"
    for field in ({"num_draft_tokens": 4}, {"num_draft_tokens": 0}, {"use_draft_logits": True}):
        with pytest.raises(ClientError, match="draft length is fixed per server") as err:
            model.encode(GenerateRequest("Hello", **field).wire_fields(stream=True))
        assert err.value.kind == "invalid_request" and "\n" not in str(err.value)


def fake_container(folder: Path) -> dict:
    """What the launch part of the script needs from the Triton TensorRT-LLM container, as stand-ins: the
    tensorrt_llm distribution at the pinned version (its metadata only), NVIDIA's llmapi model code, tritonserver."""
    dist = folder / "site" / f"tensorrt_llm-{stack.TRTLLM_VERSION}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: {stack.TRTLLM_VERSION}\n")
    code = folder / "llmapi_code"
    code.mkdir()
    for name in ("model.py", "helpers.py"):
        (code / name).write_text(f"# stand-in for NVIDIA's {name}\n")
    return {**os.environ, "PYTHONPATH": str(folder / "site"), "LLMAPI_MODEL_CODE": str(code),
            "TRITONSERVER": str(write_fake_tritonserver(folder)), "FAKE_DIR": str(folder)}


@pytest.mark.parametrize("exit_timeout", [None, "45"])
def test_launch_script_stays_in_foreground_forwards_sigterm_and_drains(exit_timeout, derived_pair, eagle3_heads, tmp_path):
    """The generated script, run as is with a stand-in tritonserver: no mpirun, the server is a child the script
    waits on, SIGTERM reaches it, the script waits through its drain and exits with its status; the drain timeout
    is serving.drain_timeout_s unless EXIT_TIMEOUT_SECS overrides it."""
    spec = tiny_spec(REPO / "examples/eagle3.yaml", derived_pair, eagle3_heads, tmp_path, ["serving.drain_timeout_s=12.5"])
    plan = make_plan(spec, TC)
    repo = assemble(plan)
    script = tmp_path / "launch_triton.sh"
    script.write_text(render_script(plan))
    env = fake_container(tmp_path) | ({"EXIT_TIMEOUT_SECS": exit_timeout} if exit_timeout else {})
    proc = subprocess.Popen(["bash", str(script)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(tmp_path / "started", proc)
        assert proc.poll() is None  # in the foreground while tritonserver runs
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == EXIT_STATUS  # tritonserver's own exit status
    finally:
        proc.kill()
    assert (tmp_path / "signal").read_text().strip() == "TERM" and (tmp_path / "drained").exists()
    _cwd, _orchestrator, args = recorded_args(tmp_path)
    assert f"--exit-timeout-secs={exit_timeout or 13}" in args  # ceil(12.5)
    assert f"--model-repository={repo}" in args and "--disable-auto-complete-config" in args
    model_dir = repo / "tensorrt_llm" / "1"  # NVIDIA's model.py next to ours, which subclasses it
    assert (model_dir / NVIDIA_MODEL_FILE).read_text() == "# stand-in for NVIDIA's model.py\n"
    assert "pipeline.serving.llmapi_model import TritonPythonModel" in (model_dir / "model.py").read_text()
    # every flag is one launch_triton_server.py passes to tritonserver (its --no-mpi form)
    launcher = json.loads((REPO / "pipeline/contracts/trtllm-1.2.1-cli.json").read_text())["launch_triton_server"]
    assert {a.split("=")[0] for a in args} <= set(launcher["tritonserver_command"]["flags"])
    assert "--no-mpi" in {a["name"] for a in launcher["args"]}


def iteration(index: int, drafted: int, accepted: int, requests: int) -> dict:
    """One PyTorch-backend iteration stat, with the fields pipeline/contracts/llmapi.json records."""
    return {"iter": index, "iterLatencyMS": 12.0, "numActiveRequests": requests,
            "specDecodingStats": {"numDraftTokens": drafted, "numAcceptedTokens": accepted,
                                  "numRequestsWithDraftTokens": requests, "iterLatencyMS": 3.0, "draftOverhead": 0.2,
                                  "acceptanceLength": (accepted + requests) / requests if requests else 0.0}}


def test_iteration_stats_sum_to_the_bls_counters():
    stats = [iteration(0, 0, 0, 0), iteration(1, 12, 7, 4), {"iter": 2}, json.dumps(iteration(3, 6, 6, 2))]
    assert spec_decode_counts(stats) == SpecDecodeCounts(drafted=18, accepted=13, rounds=6)
    assert set(stats[1]["specDecodingStats"]) == set(contract()["iteration_stats"]["specDecodingStats"])
    with pytest.raises(ValueError, match="iteration 5"):
        spec_decode_counts([iteration(5, 2, 3, 1)])


def metric_value(text: str, name: str) -> float | None:
    """The value of `name{model="tensorrt_llm"}` in Prometheus text, None when absent."""
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="tensorrt_llm"}}'):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_llmapi_model_exports_spec_decode_metrics_from_iteration_stats(derived_pair, eagle3_heads, tmp_path):
    """Our tensorrt_llm model in a real Triton, over a stand-in for NVIDIA's model (tests/data): the iteration
    statistics its LLM reports become the BLS's counters on the metrics port, which the PrometheusRule reads."""
    spec = tiny_spec(REPO / "examples/eagle3.yaml", derived_pair, eagle3_heads, tmp_path)
    args = llm_args(spec, {"target": derived_pair[0]})
    assert args["enable_iter_perf_stats"] is True
    repo = write_llmapi_repo(args, tmp_path / "repo")
    model_dir = repo / "tensorrt_llm" / "1"
    shutil.copy(REPO / "tests/data/fake_nvidia_llmapi_model.py", model_dir / NVIDIA_MODEL_FILE)
    (model_dir / "helpers.py").write_text("")
    batches = [[iteration(0, 0, 0, 0), iteration(1, 8, 5, 2)], [], [json.dumps(iteration(2, 12, 3, 3))]]
    (model_dir / "fake_stats.json").write_text(json.dumps(batches))
    expected = spec_decode_counts([s for batch in batches for s in batch])
    http, grpc, metrics = free_ports()
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics) as server:
        deadline = time.monotonic() + 60
        while True:
            with urllib.request.urlopen(server.metrics_url, timeout=5) as resp:
                text = resp.read().decode()
            got = [metric_value(text, n) for n in (DRAFT_TOKENS_METRIC, ACCEPTED_TOKENS_METRIC, ROUNDS_METRIC)]
            if got == [expected.drafted, expected.accepted, expected.rounds] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert got == [expected.drafted, expected.accepted, expected.rounds]  # 20, 8, 5


def test_the_lookup_cut_is_refused_with_the_field_to_change(derived_pair, eagle3_heads, tmp_path):
    """TensorRT-LLM's NGram drafter has no min_token_prob: the spec that asks for it names the field and the fix."""
    with pytest.raises(SpecError) as err:
        tiny_spec(REPO / "examples/ngram.yaml", derived_pair, eagle3_heads, tmp_path,
                  extra=["speculative.ngram.min_token_prob=0.4"])
    assert str(err.value).startswith("speculative.ngram.min_token_prob: ") and "set it to 0" in err.value.fix
    assert tiny_spec(REPO / "examples/ngram.yaml", derived_pair, eagle3_heads, tmp_path).speculative.ngram.min_token_prob == 0
