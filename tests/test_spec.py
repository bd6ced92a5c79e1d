"""Spec validation: every bad spec gets one error naming the field path and the fix."""

import pytest

from pipeline.spec import SpecError, load_spec

BASE = """\
name: t
models:
  target: {{checkpoint: {ckpt}, dtype: float32}}
  draft: {{checkpoint: {ckpt}}}
speculative: {{mode: draft_target, max_draft_len: 8, num_draft_tokens: 4}}
"""


@pytest.fixture
def spec_file(tmp_path):
    (tmp_path / "ckpt").mkdir()
    path = tmp_path / "spec.yaml"
    path.write_text(BASE.format(ckpt=tmp_path / "ckpt"))
    return path


def test_valid_spec_loads_typed(spec_file):
    spec = load_spec(spec_file)
    assert spec.speculative.mode == "draft_target"
    assert spec.models.target.dtype == "float32"
    assert spec.models.draft.qformat == "none"
    assert spec.engine.max_batch_size == 8


@pytest.mark.parametrize("override, path, fix_word", [
    ("engine.max_batch_sise=4", "engine.max_batch_sise", "max_batch_size"),
    ("engine.max_batch_size=four", "engine.max_batch_size", "whole number"),
    ("models.target.qformat=int4", "models.target.qformat", "int4_wo"),
    ("speculative.num_draft_tokens=9", "speculative.num_draft_tokens", "max_draft_len"),
    ("models.draft.checkpoint=/nonexistent/x", "models.draft.checkpoint", "make models"),
    ("engine.max_input_len=4096", "engine.max_input_len", "max_seq_len"),
    ("models.draft=null", "models.draft", "add"),
    ("serving.kv_cache_free_gpu_mem_fraction.target=1.5", "serving.kv_cache_free_gpu_mem_fraction.target", "0.4"),
])
def test_bad_spec_names_field_and_fix(spec_file, override, path, fix_word):
    with pytest.raises(SpecError) as err:
        load_spec(spec_file, [override])
    assert err.value.path == path
    assert fix_word in err.value.fix
    assert "\n" not in str(err.value)


def test_eagle_rules(spec_file, tmp_path):
    eagle = ["models.draft=null", "speculative.mode=eagle", f"speculative.eagle.checkpoint={tmp_path / 'ckpt'}"]
    assert load_spec(spec_file, eagle).speculative.eagle.version == 2
    with pytest.raises(SpecError) as err:
        load_spec(spec_file, eagle + ["engine.pp_size=2", "gpu.count=2"])
    assert err.value.path == "engine.pp_size"
    with pytest.raises(SpecError) as err:
        load_spec(spec_file, eagle + ["toolchain=trtllm", "speculative.eagle.version=3"])
    assert err.value.path == "speculative.eagle.version"
