"""Inspect: architectures, tokenizer compatibility, Medusa/EAGLE shapes, pickle policy, memory plan."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.checkpoints import inspect_spec, safetensors_header
from pipeline.fixtures.models import make_random_eagle, make_random_medusa, make_truncated_draft
from pipeline.spec import SpecError, load_spec
from pipeline.fixtures.toymodels import make_tiny_llama, make_tokenizer

SPEC = """\
name: t
models:
  target: {{checkpoint: {target}, dtype: float32}}
  draft: {{checkpoint: {draft}}}
speculative: {{mode: draft_target, max_draft_len: 8, num_draft_tokens: 4}}
output: {{dir: {tmp}/out, cache_dir: {tmp}/cache}}
"""


@pytest.fixture
def spec_file(derived_pair, tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC.format(target=derived_pair[0], draft=derived_pair[1], tmp=tmp_path))
    return path


@pytest.fixture
def draft_copy(derived_pair, tmp_path):
    """A copy of the draft checkpoint that a test may damage."""
    return shutil.copytree(derived_pair[1], tmp_path / "draft-copy")


def edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def inspect_error(spec_file, *overrides) -> SpecError:
    with pytest.raises(SpecError) as err:
        inspect_spec(load_spec(spec_file, list(overrides)))
    assert "\n" not in str(err.value)
    return err.value


def test_compatible_pair_passes_with_a_memory_plan(spec_file):
    report = inspect_spec(load_spec(spec_file))
    assert set(report.models) == {"target", "draft"}
    assert any("same id" in c for c in report.checks) and not report.warnings
    text = report.render()
    assert "memory plan" in text and "kv_cache_free_gpu_mem_fraction" in text


def test_safetensors_header_is_read_without_torch(derived_pair):
    header = safetensors_header(derived_pair[0] / "model.safetensors")
    assert header["model.embed_tokens.weight"] == ("F32", (512, 64))
    assert header["model.layers.0.self_attn.k_proj.weight"][1] == (32, 64)  # 2 kv heads x 16


def test_unsupported_architecture_is_refused(spec_file, draft_copy):
    edit_json(draft_copy / "config.json", architectures=["GPT2LMHeadModel"])
    err = inspect_error(spec_file, f"models.draft.checkpoint={draft_copy}")
    assert err.path == "models.draft.checkpoint" and "GPT2LMHeadModel" in err.problem and "Qwen2ForCausalLM" in err.fix


def test_remote_code_is_never_run(spec_file, draft_copy):
    edit_json(draft_copy / "config.json", auto_map={"AutoModelForCausalLM": "modeling_x.X"})
    assert "auto_map" in inspect_error(spec_file, f"models.draft.checkpoint={draft_copy}").problem


def test_different_tokenizer_is_an_error_before_any_build(spec_file, draft_copy):
    make_tokenizer(draft_copy, vocab_size=400)  # a different BPE: ids mean other tokens
    err = inspect_error(spec_file, f"models.draft.checkpoint={draft_copy}")
    assert err.path == "models.draft.checkpoint" and "tokenizer differs" in err.problem


def test_different_special_tokens_are_an_error(spec_file, draft_copy):
    edit_json(draft_copy / "tokenizer_config.json", eos_token="<|im_end|>")
    err = inspect_error(spec_file, f"models.draft.checkpoint={draft_copy}")
    assert "eos_token" in err.problem


def test_padded_vocab_passes_with_a_warning(spec_file, derived_pair, tmp_path):
    padded = make_tiny_llama(tmp_path / "padded", vocab_size=576, layers=1)  # embedding padded to 576 rows
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(derived_pair[0] / name, padded / name)
    report = inspect_spec(load_spec(spec_file, [f"models.draft.checkpoint={padded}"]))
    assert any("padding" in w and "576" in w for w in report.warnings)


def test_pickle_weights_need_explicit_permission(spec_file, draft_copy):
    (draft_copy / "pytorch_model.bin").write_bytes(b"not loaded")
    err = inspect_error(spec_file, f"models.draft.checkpoint={draft_copy}")
    assert err.path == "models.draft.checkpoint" and "pickle" in err.problem and "allow_pickle_weights" in err.fix
    inspect_spec(load_spec(spec_file, [f"models.draft.checkpoint={draft_copy}", "security.allow_pickle_weights=true"]))


def test_int4_group_size_must_divide_the_linear_widths(spec_file):
    err = inspect_error(spec_file, "models.draft.qformat=int4_wo", "models.draft.group_size=48")
    assert err.path == "models.draft.group_size" and err.fix == "set group_size: 64"


# ----------------------------------------------------------------------------- heads


def head_spec(spec_file, mode, folder, *extra):
    return [f"speculative.mode={mode}", "models.draft=null", f"speculative.{mode}.checkpoint={folder}", *extra]


def test_medusa_heads_shapes(spec_file, derived_pair, tmp_path):
    heads = make_random_medusa(derived_pair[0], tmp_path / "medusa", num_heads=3)
    report = inspect_spec(load_spec(spec_file, head_spec(spec_file, "medusa", heads)))
    assert any("3 Medusa heads" in c for c in report.checks)
    deep = "speculative.medusa.choices=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]"
    assert inspect_error(spec_file, *head_spec(spec_file, "medusa", heads, deep)).path == "speculative.medusa.choices"


def test_medusa_heads_for_another_model_are_refused(spec_file, tmp_path):
    other = make_tiny_llama(tmp_path / "wide", hidden=96, heads=4, kv_heads=2, intermediate=128)
    heads = make_random_medusa(other, tmp_path / "medusa-wide")
    err = inspect_error(spec_file, *head_spec(spec_file, "medusa", heads))
    assert err.path == "speculative.medusa.checkpoint" and "[96, 96]" in err.problem and "[64, 64]" in err.problem


def test_eagle_weights_shapes_and_version(spec_file, derived_pair, tmp_path):
    eagle = make_random_eagle(derived_pair[0], tmp_path / "eagle")
    report = inspect_spec(load_spec(spec_file, head_spec(spec_file, "eagle", eagle)))
    assert any("EAGLE-2" in c for c in report.checks)
    err = inspect_error(spec_file, *head_spec(spec_file, "eagle", eagle, "speculative.eagle.version=3", "toolchain=reference"))
    assert err.path == "speculative.eagle.version"


def test_eagle_fc_of_wrong_width_is_refused(spec_file, tmp_path):
    other = make_tiny_llama(tmp_path / "wide", hidden=96, heads=4, kv_heads=2, intermediate=128)
    eagle = make_random_eagle(other, tmp_path / "eagle-wide")
    err = inspect_error(spec_file, *head_spec(spec_file, "eagle", eagle))
    assert err.path == "speculative.eagle.checkpoint"


# ----------------------------------------------------------------------------- memory plan


def test_memory_plan_splits_kv_by_bytes_per_token(spec_file):
    plan = inspect_spec(load_spec(spec_file)).memory
    target, draft = plan.engines
    assert target.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4  # K+V x 4 layers x 2 kv heads x 16 dims x fp32
    assert draft.kv_bytes_per_token == 2 * 1 * 2 * 16 * 2  # 1 layer, float16 (the draft's default dtype)
    assert target.kv_fraction + draft.kv_fraction <= 0.9
    assert target.kv_fraction / draft.kv_fraction == pytest.approx(8, rel=0.1)


def test_quantized_weights_are_smaller(spec_file):
    plain = inspect_spec(load_spec(spec_file)).memory.engines[0].weight_bytes
    int4 = inspect_spec(load_spec(spec_file, ["models.target.qformat=int4_wo", "models.target.group_size=32"])).memory
    assert int4.engines[0].weight_bytes < plain


def test_models_that_cannot_fit_are_an_error(spec_file):
    err = inspect_error(spec_file, "gpu.memory_gib=1")
    assert err.path == "gpu.memory_gib" and "tp_size" in err.fix


def test_kv_fraction_too_small_for_one_sequence(spec_file):
    err = inspect_error(spec_file, "serving.kv_cache_free_gpu_mem_fraction.target=0.0000001")
    assert err.path == "serving.kv_cache_free_gpu_mem_fraction.target"


def test_truncated_draft_is_compatible_by_construction(spec_file, derived_pair, tmp_path):
    draft = make_truncated_draft(derived_pair[0], tmp_path / "draft-l2", num_layers=2)
    report = inspect_spec(load_spec(spec_file, [f"models.draft.checkpoint={draft}"]))
    assert report.models["draft"].num_layers == 2 and not report.warnings
    names = safetensors_header(draft / "model.safetensors")
    assert "model.layers.1.mlp.up_proj.weight" in names and "model.layers.2.mlp.up_proj.weight" not in names
    assert make_truncated_draft(derived_pair[0], tmp_path / "draft-l2", num_layers=2) == draft  # cached: no rework


def test_inspect_cli_reports_incompatible_tokenizers_in_one_line(spec_file, draft_copy):
    make_tokenizer(draft_copy, vocab_size=400)
    result = subprocess.run([sys.executable, "-m", "pipeline", "inspect", str(spec_file), "--set",
                             f"models.draft.checkpoint={draft_copy}"], cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: models.draft.checkpoint: tokenizer differs")
