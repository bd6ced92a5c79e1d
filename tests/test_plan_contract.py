"""Plans and the trtllm script: every example plans, every command passes TensorRT-LLM 1.2.1's CLI contract."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.fixtures.models import make_random_eagle, make_random_eagle3, make_random_medusa
from specbuild.plan import build_key, make_plan
from pipeline.spec import SpecError, load_spec
from specbuild.toolchains.trtllm import Command, ContractError, check_command, parse_script, render_script

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def heads(derived_pair, tmp_path_factory):
    """Tiny untrained Medusa heads and EAGLE weights for the derived target, made by the `models` code."""
    root = tmp_path_factory.mktemp("heads")
    return make_random_medusa(derived_pair[0], root / "medusa"), make_random_eagle(derived_pair[0], root / "eagle")


def tiny_overrides(example: Path, derived_pair, heads, tmp_path) -> list[str]:
    """Point an example's checkpoints at tiny generated ones and its outputs at a temp dir."""
    spec = load_spec(example, check_paths=False)
    sets = [f"models.target.checkpoint={derived_pair[0]}", f"output.dir={tmp_path / 'out'}",
            f"output.cache_dir={tmp_path / 'cache'}"]
    if spec.models.draft is not None:
        sets.append(f"models.draft.checkpoint={derived_pair[1]}")
    if spec.speculative.medusa is not None:
        sets.append(f"speculative.medusa.checkpoint={heads[0]}")
    if spec.speculative.eagle is not None:
        sets.append(f"speculative.eagle.checkpoint={heads[1]}")
    return sets


def script_for(example, derived_pair, heads, tmp_path, extra=()):
    spec = load_spec(example, tiny_overrides(example, derived_pair, heads, tmp_path) + list(extra))
    return spec, render_script(make_plan(spec, "trtllm"))


def refused_by_trtllm(example: Path) -> bool:
    """EAGLE-3 examples: no TensorRT engine path."""
    eagle = load_spec(example, check_paths=False).speculative.eagle
    return eagle is not None and eagle.version == 3


def llmapi_only(example: Path) -> bool:
    """MTP examples: the LLM API toolchain only (their spec says toolchain trtllm-llmapi; tests/test_mtp.py)."""
    return load_spec(example, check_paths=False).speculative.mode == "mtp"


@pytest.mark.parametrize("example", [e for e in EXAMPLES if not refused_by_trtllm(e) and not llmapi_only(e)],
                         ids=lambda p: p.name)
def test_every_example_plans_a_script_that_passes_the_contract(example, derived_pair, heads, tmp_path):
    spec, script = script_for(example, derived_pair, heads, tmp_path)
    assert script.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    steps = parse_script(script)
    roles = ["target", "draft"] if spec.speculative.mode == "draft_target" else ["target"]
    assert [label for _key, label, _cmd in steps][1::2] == [f"{r}/build" for r in roles]
    for _key, label, command in steps:
        ns = check_command(command)  # flag names, types, choices, documented incompatibilities
        if command.tool == "trtllm-build":
            assert ns.use_paged_context_fmha == "enable"
            assert ns.max_batch_size == spec.engine.max_batch_size and ns.max_seq_len == spec.engine.max_seq_len
            assert not ns.gather_context_logits
            assert ns.gather_generation_logits == spec.speculative.use_draft_logits
            if label == "draft/build":
                assert ns.speculative_decoding_mode is None and ns.max_draft_len == 0
            elif spec.speculative.mode in ("draft_target", "ngram"):
                assert ns.speculative_decoding_mode == "draft_tokens_external"
                assert ns.max_draft_len == spec.speculative.max_draft_len
            else:
                assert ns.speculative_decoding_mode == spec.speculative.mode
        else:
            model = getattr(spec.models, label.split("/")[0])
            calibrated = model.qformat in ("fp8", "int8_sq", "int4_awq")
            assert (command.tool == "quantize") == calibrated, (label, command.tool)
            # float32 is built as bfloat16 on the examples' H100 (TensorRT-LLM speculates in FP16/BF16/FP8)
            assert ns.dtype == ("bfloat16" if model.dtype == "float32" else model.dtype)
            if calibrated:
                assert ns.qformat == model.qformat and ns.calib_size == model.calib_size


def test_script_steps_chain_through_the_cache(derived_pair, heads, tmp_path):
    _spec, script = script_for(REPO / "examples/draft-target.yaml", derived_pair, heads, tmp_path)
    steps = parse_script(script)
    for (convert_key, _l1, convert), (build_key_, _l2, build) in zip(steps[0::2], steps[1::2]):
        args = list(build.args)
        assert args[args.index("--checkpoint_dir") + 1] == f"$CACHE_DIR/{convert_key}"
        assert args[args.index("--output_dir") + 1] == f"$CACHE_DIR/{build_key_}.tmp"
        assert f'ln -sfn "$CACHE_DIR/{build_key_}"' in script
        assert list(convert.args)[list(convert.args).index("--output_dir") + 1] == f"$CACHE_DIR/{convert_key}.tmp"


def test_medusa_and_eagle_converters_get_their_heads(derived_pair, heads, tmp_path):
    _spec, script = script_for(REPO / "examples/medusa.yaml", derived_pair, heads, tmp_path)
    ns = check_command(parse_script(script)[0][2])
    assert ns.medusa_model_dir == "$MEDUSA_DIR" and ns.num_medusa_heads == 3 and ns.max_medusa_token_len == 8
    _spec, script = script_for(REPO / "examples/eagle.yaml", derived_pair, heads, tmp_path)
    ns = check_command(parse_script(script)[0][2])
    assert ns.eagle_model_dir == "$EAGLE_DIR" and ns.num_eagle_layers == 3 and ns.max_draft_len == 8


def test_weight_only_and_kv_cache_flags(derived_pair, heads, tmp_path):
    _spec, script = script_for(REPO / "examples/qformat-weight-only.yaml", derived_pair, heads, tmp_path)
    target, draft = (check_command(cmd) for _k, label, cmd in parse_script(script) if label.endswith("convert"))
    assert target.use_weight_only and target.weight_only_precision == "int8" and not target.int8_kv_cache
    assert draft.use_weight_only and draft.weight_only_precision == "int4" and not draft.int8_kv_cache


def test_int8_kv_cache_builds_without_paged_context_fmha(derived_pair, heads, tmp_path):
    """TensorRT-LLM refuses paged context FMHA with an INT8 KV cache; allowed only where no KV reuse is lost."""
    _spec, script = script_for(REPO / "examples/medusa.yaml", derived_pair, heads, tmp_path,
                               ["models.target.kv_cache_dtype=int8", "serving.enable_kv_cache_reuse=false"])
    (_k1, _l1, convert), (_k2, _l2, build) = parse_script(script)
    assert check_command(convert).int8_kv_cache
    assert "--use_paged_context_fmha" not in build.args


def test_qwen2_converts_through_quantize(derived_pair, heads, tmp_path):
    qwen = tmp_path / "qwen"
    shutil.copytree(derived_pair[0], qwen)
    config = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    _spec, script = script_for(REPO / "examples/ngram.yaml", derived_pair, heads, tmp_path, [f"models.target.checkpoint={qwen}"])
    command = parse_script(script)[0][2]
    assert command.tool == "quantize" and check_command(command).qformat == "full_prec"


@pytest.mark.parametrize("extra, path", [
    (["speculative.eagle.num_layers=4"], "speculative.eagle.num_layers"),  # deepest choice is 3
    (["models.target.qformat=int8_sq"], "models.target.qformat"),          # no calibrated EAGLE converter
    (["speculative.eagle.max_non_leaves_per_layer=1"], "speculative.eagle.max_non_leaves_per_layer"),
])
def test_trtllm_only_eagle_rules(derived_pair, heads, tmp_path, extra, path):
    with pytest.raises(SpecError) as err:
        script_for(REPO / "examples/eagle.yaml", derived_pair, heads, tmp_path, extra)
    assert err.value.path == path


@pytest.mark.parametrize("command, message", [
    (Command("trtllm-build", ("--checkpoint_dir", "c", "--max_draft_len", "4", "--gather_context_logits")), "gather_context_logits"),
    (Command("trtllm-build", ("--checkpoint_dir", "c", "--speculative_decoding_mode", "draft_tokens_external")), "max_draft_len"),
    (Command("trtllm-build", ("--speculative_decoding_mode", "ngram",)), "invalid choice"),
    (Command("trtllm-build", ("--max_batch_size", "eight")), "invalid int"),
    (Command("trtllm-build", ("--use_paged_context_fmha", "true")), "invalid choice"),
    (Command("trtllm-build", ("--paged_context_fmha", "enable")), "unknown"),
    (Command("trtllm-build", ("--multiple_profiles", "enable", "--opt_num_tokens", "64")), "opt_num_tokens"),
    (Command("quantize", ("--qformat", "int4_gptq", "--model_dir", "m")), "invalid choice"),
    (Command("quantize", ("--qformat", "fp8",)), "model_dir"),
    (Command("convert_checkpoint_llama", ("--model_dir", "m", "--qformat", "int8")), "unknown"),
    (Command("convert_checkpoint_eagle", ("--model_dir", "m", "--pp_size", "2")), "pipeline parallelism"),
])
def test_contract_rejects_what_trtllm_rejects(command, message):
    with pytest.raises(ContractError, match=message):
        check_command(command)


# ----------------------------------------------------------------------------- keys


def keys(spec, toolchain="reference"):
    return {s.label: s.key for s in make_plan(spec, toolchain).steps}


@pytest.fixture
def dt_spec(derived_pair, heads, tmp_path):
    example = REPO / "examples/draft-target.yaml"
    return example, tiny_overrides(example, derived_pair, heads, tmp_path)


def test_changing_the_draft_qformat_changes_only_draft_keys(dt_spec):
    example, sets = dt_spec
    before = keys(load_spec(example, sets))
    after = keys(load_spec(example, sets + ["models.draft.qformat=int8_wo"]))
    assert {k for k in before if before[k] != after[k]} == {"draft/convert", "draft/build"}


def test_engine_limits_change_build_keys_only(dt_spec):
    example, sets = dt_spec
    before = keys(load_spec(example, sets))
    after = keys(load_spec(example, sets + ["engine.max_batch_size=16"]))
    assert {k for k in before if before[k] != after[k]} == {"target/build", "draft/build"}


def test_checkpoint_contents_and_toolchain_are_in_the_keys(dt_spec, derived_pair, tmp_path):
    example, sets = dt_spec
    spec = load_spec(example, sets)
    assert keys(spec, "reference") != keys(spec, "trtllm")
    assert build_key(spec) == build_key(spec)
    copy = tmp_path / "target-copy"
    shutil.copytree(derived_pair[0], copy)
    moved = load_spec(example, sets + [f"models.target.checkpoint={copy}"])
    assert keys(moved) == keys(spec)  # same bytes elsewhere: same keys
    (copy / "generation_config.json").write_text('{"max_length": 7}')
    assert keys(load_spec(example, sets + [f"models.target.checkpoint={copy}"]))["target/convert"] != keys(spec)["target/convert"]


# ----------------------------------------------------------------------------- no torch


def test_spec_inspect_and_plan_run_without_torch(derived_pair, heads, tmp_path):
    example = REPO / "examples/medusa.yaml"
    sets = [a for o in tiny_overrides(example, derived_pair, heads, tmp_path) for a in ("--set", o)]
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; sys.modules['safetensors'] = None\n"
            "from pipeline.cli import main\n"
            f"assert main(['inspect', {str(example)!r}, *{sets!r}]) == 0\n"
            f"sys.exit(main(['plan', {str(example)!r}, '--dry-run', *{sets!r}]))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "memory plan" in result.stdout and "run_step" in result.stdout


@pytest.mark.parametrize("example, tool, flag", [
    ("default.yaml", "quantize", "kv_cache_dtype"),  # int8_sq: ModelOpt PTQ
    ("qformat-fp8.yaml", "quantize", "kv_cache_dtype"),
    ("medusa.yaml", "quantize", "kv_cache_dtype"),  # the Medusa converter has no FP8 KV flag: ModelOpt PTQ with the heads
])
def test_fp8_kv_cache_on_trtllm(derived_pair, heads, tmp_path, example, tool, flag):
    _spec, script = script_for(REPO / "examples" / example, derived_pair, heads, tmp_path, ["models.target.kv_cache_dtype=fp8"])
    command = parse_script(script)[0][2]
    ns = check_command(command)
    assert command.tool == tool and getattr(ns, flag) in (True, "fp8")
    if example == "medusa.yaml":
        assert ns.medusa_model_dir == "$MEDUSA_DIR" and ns.qformat == "full_prec"


def test_tensor_parallel_plans_one_worker_per_rank(derived_pair, heads, tmp_path):
    _spec, script = script_for(REPO / "examples/draft-target.yaml", derived_pair, heads, tmp_path,
                               ["engine.tp_size=2", "gpu.count=2"])
    for _key, label, command in parse_script(script):
        ns = check_command(command)
        assert ns.workers == 2, label
        if command.tool != "trtllm-build":
            assert ns.tp_size == 2


@pytest.mark.parametrize("example", [e for e in EXAMPLES if refused_by_trtllm(e)], ids=lambda p: p.name)
def test_trtllm_refuses_eagle3_examples_in_one_line(example, derived_pair, tmp_path):
    heads = make_random_eagle3(derived_pair[0], tmp_path / "eagle3", dtype="float32")
    sets = [f"models.target.checkpoint={derived_pair[0]}", f"speculative.eagle.checkpoint={heads}",
            "speculative.eagle.layers_to_capture=[0, 1, 2]", f"output.dir={tmp_path / 'out'}", f"output.cache_dir={tmp_path / 'c'}"]
    with pytest.raises(SpecError, match="^speculative.eagle.version: EAGLE-3 has no TensorRT engine converter"):
        render_script(make_plan(load_spec(example, sets), "trtllm"))
