"""speculative.mode mtp: DeepSeek-V3-style targets draft with their own MTP modules on TensorRT-LLM's PyTorch
backend (toolchain trtllm-llmapi only). GPU-only, so checked through its contract (pipeline/contracts/llmapi.json)
on tiny config-only DeepSeek-V3-style checkpoints (config.json + safetensors headers, no weights)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.checkpoints import inspect_spec
from pipeline.fixtures.config_only import deepseek_v3_tensors, write_config_only_mtp_checkpoint
from pipeline.llmapi import ContractError, check_llm_args, contract, llm_args, spelling
from pipeline.memory import GIB
from pipeline.repo.assemble import assemble
from pipeline.spec import SpecError, load_spec
from specbuild.plan import make_plan

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "mtp.yaml"
TC = "trtllm-llmapi"
ITEMSIZE = {"F8_E4M3": 1, "BF16": 2}


@pytest.fixture(scope="module")
def ds3(tmp_path_factory):
    """A tiny config-only DeepSeek-V3 (3 layers + 1 MTP module)."""
    return write_config_only_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "ds3")


def mtp_spec(target: Path, tmp_path: Path, *sets: str):
    """examples/mtp.yaml on `target`, outputs in tmp_path."""
    return load_spec(EXAMPLE, [f"models.target.checkpoint={target}", f"output.dir={tmp_path / 'out'}",
                               f"output.cache_dir={tmp_path / 'cache'}", *sets])


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and "; fix: " in message
    return message


def test_the_example_generates_an_mtp_config_checked_against_the_facts(ds3, tmp_path):
    spec = mtp_spec(ds3, tmp_path)
    repo = assemble(make_plan(spec, TC))
    config = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    options = yaml.safe_load((repo.parent / "extra_llm_api_options.yaml").read_text())
    sc = config["speculative_config"]
    assert sc == options["speculative_config"] == {"decoding_type": "MTP", "num_nextn_predict_layers": spec.speculative.num_draft_tokens}
    assert config["model"] == str(ds3) and config["tensor_parallel_size"] == spec.engine.tp_size
    assert config["kv_cache_config"]["enable_block_reuse"] is True  # one model: the spec's setting stays
    # every generated MTP key is a field each recorded release reads, with the type of its recorded default
    for name, fields in contract()["mtp"]["config_fields"].items():
        assert set(sc) - {"decoding_type"} <= set(fields), name
        assert all(type(v) is type(fields[k]) for k, v in sc.items() if k != "decoding_type")


@pytest.mark.parametrize("release", ["1.2.1", "after-pr10124"])
def test_relaxed_acceptance_needs_the_reasoning_tokenizer_and_is_generated_per_release(ds3, tmp_path, release):
    knobs = ["speculative.mtp.relaxed_acceptance=true", "speculative.mtp.relaxed_topk=10", "speculative.mtp.relaxed_delta=0.6"]
    with pytest.raises(SpecError) as err:  # DeepSeek-V3's tokenizer: no <think> at 128798
        inspect_spec(mtp_spec(ds3, tmp_path, *knobs))
    assert one_line_error(err).startswith("speculative.mtp.relaxed_acceptance: ")
    r1 = write_config_only_mtp_checkpoint(tmp_path / "r1", thinking=True)
    spec = mtp_spec(r1, tmp_path, *knobs)
    inspect_spec(spec)
    sc = llm_args(spec, {"target": r1}, release=release)["speculative_config"]
    assert sc == {"decoding_type": spelling(release)["decoding_type"]["mtp"], "num_nextn_predict_layers": 3,
                  "use_relaxed_acceptance_for_thinking": True, "relaxed_topk": 10, "relaxed_delta": 0.6}
    with pytest.raises(SpecError) as err:
        mtp_spec(r1, tmp_path, "speculative.mtp.relaxed_topk=10")
    assert one_line_error(err).startswith("speculative.mtp.relaxed_topk: ")
    with pytest.raises(SpecError) as err:
        mtp_spec(r1, tmp_path, "speculative.mode=ngram", "speculative.mtp.relaxed_acceptance=true")
    assert one_line_error(err).startswith("speculative.mtp: is set but speculative.mode is 'ngram'")


def test_the_contract_refuses_keys_and_values_no_release_reads():
    base = {"model": "m", "backend": "pytorch"}
    check_llm_args({**base, "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 2}})
    with pytest.raises(ContractError, match="eagle3_one_model"):
        check_llm_args({**base, "speculative_config": {"decoding_type": "MTP", "eagle3_one_model": True}})
    with pytest.raises(ContractError, match="num_nextn_predict_layers must be an integer > 0"):
        check_llm_args({**base, "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 0}})
    with pytest.raises(ContractError, match="relaxed_delta must be >= 0"):
        check_llm_args({**base, "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 1,
                                                       "relaxed_delta": -0.1}})


@pytest.mark.parametrize("toolchain", ["reference", "trtllm", "auto"])
def test_other_toolchains_refuse_mtp_in_one_line(ds3, tmp_path, toolchain):
    with pytest.raises(SpecError) as err:
        mtp_spec(ds3, tmp_path, f"toolchain={toolchain}")
    message = one_line_error(err)
    assert message.startswith(f"toolchain: {toolchain} cannot run speculative.mode mtp") and \
        message.endswith("fix: use toolchain: trtllm-llmapi")
    spec = mtp_spec(ds3, tmp_path)  # planned for another toolchain than its own: refused the same way
    with pytest.raises(SpecError, match="^toolchain: trtllm cannot run speculative.mode mtp"):
        make_plan(spec, "trtllm")


def test_only_the_llmapi_toolchain_reads_mtp_architectures(ds3, tmp_path):
    """Other toolchains keep refusing the architecture exactly as before; the LLM API one plans it config-only."""
    sets = ["speculative.mode=ngram", "speculative.max_draft_len=3", "speculative.num_draft_tokens=3"]
    with pytest.raises(SpecError) as err:
        inspect_spec(mtp_spec(ds3, tmp_path, *sets, "toolchain=reference"))
    assert str(err.value) == ("models.target.checkpoint: architecture DeepseekV3ForCausalLM is not supported; "
                              "fix: use a LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM checkpoint")
    spec = mtp_spec(ds3, tmp_path, *sets)
    assert inspect_spec(spec).models["target"].llmapi_only
    with pytest.raises(SpecError, match="^models.target.checkpoint: DeepseekV3ForCausalLM is planned for TensorRT-LLM's "
                                        "LLM API only; fix: use toolchain: trtllm-llmapi"):
        make_plan(spec, "reference")
    with pytest.raises(SpecError) as err:
        inspect_spec(mtp_spec(ds3, tmp_path, "models.target.qformat=fp8"))
    assert one_line_error(err).startswith("models.target.qformat: ")


def test_a_checkpoint_without_mtp_modules_is_refused(ds3, derived_pair, tmp_path):
    with pytest.raises(SpecError) as err:  # a Llama target
        inspect_spec(mtp_spec(derived_pair[0], tmp_path))
    assert "carries no MTP modules" in one_line_error(err)
    plain = write_config_only_mtp_checkpoint(tmp_path / "plain", num_nextn_predict_layers=0)
    with pytest.raises(SpecError) as err:
        inspect_spec(mtp_spec(plain, tmp_path))
    assert one_line_error(err).startswith("models.target.checkpoint: the DeepseekV3ForCausalLM checkpoint carries no MTP")
    stripped = write_config_only_mtp_checkpoint(tmp_path / "stripped", num_nextn_predict_layers=0)
    config = json.loads((stripped / "config.json").read_text())
    (stripped / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))  # claims a module it lacks
    with pytest.raises(SpecError, match="^models.target.checkpoint: tensor model.layers.3.eh_proj.weight is missing"):
        inspect_spec(mtp_spec(stripped, tmp_path))


@pytest.mark.parametrize("modules, k, warning", [(1, 1, None), (1, 3, "runs the one module 3 times (MTP-Eagle)"),
                                                 (2, 2, None), (2, 3, "reuses module i mod 2")])
def test_more_draft_tokens_than_modules_is_allowed_as_tensorrt_llm_reuses_them(tmp_path, modules, k, warning):
    target = write_config_only_mtp_checkpoint(tmp_path / "t", num_nextn_predict_layers=modules)
    report = inspect_spec(mtp_spec(target, tmp_path, f"speculative.num_draft_tokens={k}", f"speculative.max_draft_len={k}"))
    found = [w for w in report.warnings if "MTP module" in w]
    assert (found == []) if warning is None else (len(found) == 1 and warning in found[0])


def test_memory_plan_counts_stored_bytes_and_the_latent_kv_cache(tmp_path):
    """Weights at the bytes the headers store (FP8 linears, BF16 rest, MTP module included) split over tp x pp;
    MLA caches one (kv_lora_rank + qk_rope_head_dim) row per token and layer, MTP layer included, split by pp only."""
    target = write_config_only_mtp_checkpoint(tmp_path / "t")
    config = json.loads((target / "config.json").read_text())
    stored = 0
    for dtype, shape in deepseek_v3_tensors(config).values():
        n = 1
        for d in shape:
            n *= d
        stored += ITEMSIZE[dtype] * n
    plan = inspect_spec(mtp_spec(target, tmp_path, "engine.tp_size=4", "engine.pp_size=2")).memory
    [engine] = plan.engines
    assert engine.weight_bytes == stored // 8
    layers = config["num_hidden_layers"] + config["num_nextn_predict_layers"]
    assert engine.kv_bytes_per_token == layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2 // 2
    assert plan.gpu_bytes == 139 * GIB


def test_make_plan_and_repo_for_the_example(ds3, tmp_path):
    """`make plan` / `make repo` (engines, then repo) with SPEC=examples/mtp.yaml, ARGS pointing at the stand-in."""
    sets = ["--set", f"models.target.checkpoint={ds3}", "--set", f"output.dir={tmp_path / 'out'}",
            "--set", f"output.cache_dir={tmp_path / 'cache'}"]
    plan = subprocess.run([sys.executable, "-m", "pipeline", "plan", str(EXAMPLE), "--dry-run", *sets],
                          capture_output=True, text=True, cwd=REPO)
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.startswith("#!/usr/bin/env bash\n") and 'wait "$server"' in plan.stdout  # server in the foreground
    assert subprocess.run(["bash", "-n"], input=plan.stdout, text=True).returncode == 0
    for command in ("engines", "repo"):  # `make repo` runs `engines` first: it writes the launch script
        done = subprocess.run([sys.executable, "-m", "pipeline", command, str(EXAMPLE), *sets], capture_output=True,
                              text=True, cwd=REPO)
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "mtp" / TC / "launch_triton.sh").read_text() == plan.stdout
    written = yaml.safe_load((tmp_path / "out" / "mtp" / TC / "model_repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert written["speculative_config"]["decoding_type"] == "MTP"
