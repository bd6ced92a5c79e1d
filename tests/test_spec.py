"""Spec validation: every bad spec gets one error naming the field path and the fix."""

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.spec import SpecError, load_spec

REPO = Path(__file__).resolve().parents[1]

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
    ("serving.decoupled=false", "serving.streaming", "serving.streaming: false"),
    ("serving.stream_interval=0", "serving.stream_interval", "stream every step"),
    ("serving.stream_interval=17", "serving.stream_interval", "e.g. 8"),
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


# ----------------------------------------------------------------------------- the CLI's one-line errors


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m pipeline ...` in a subprocess, from the repository root."""
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("overrides, path", [
    (["engine.max_batch_sise=4"], "engine.max_batch_sise"),                       # unknown key
    (["engine.max_batch_size=four"], "engine.max_batch_size"),                    # wrong type
    (["models.draft.checkpoint=/nonexistent/x"], "models.draft.checkpoint"),      # missing path
    (["speculative.num_draft_tokens=9"], "speculative.num_draft_tokens"),         # impossible combination
])
def test_cli_prints_one_line_error_and_exits_2(spec_file, overrides, path):
    sets = [a for o in overrides for a in ("--set", o)]
    result = run_cli("validate", str(spec_file), *sets)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {path}: ") and "; fix: " in lines[0]
    assert "Traceback" not in result.stderr


def test_cli_eagle_combinations_are_one_line_errors(spec_file, tmp_path):
    eagle = ["--set", "models.draft=null", "--set", "speculative.mode=eagle",
             "--set", f"speculative.eagle.checkpoint={tmp_path / 'ckpt'}"]
    result = run_cli("validate", str(spec_file), *eagle, "--set", "engine.pp_size=2", "--set", "gpu.count=2")
    assert result.returncode == 2 and result.stderr.startswith("error: engine.pp_size: ")
    result = run_cli("validate", str(spec_file), *eagle, "--set", "toolchain=trtllm", "--set", "speculative.eagle.version=3")
    assert result.returncode == 2 and result.stderr.startswith("error: speculative.eagle.version: ")


def test_cli_missing_spec_file_is_a_user_error(tmp_path):
    result = run_cli("validate", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and result.stderr.startswith("error: spec: ")


def test_cli_valid_spec(spec_file):
    result = run_cli("validate", str(spec_file))
    assert result.returncode == 0 and result.stdout.startswith("ok: ")


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_a_valid_spec(example):
    spec = load_spec(example, check_paths=False)
    assert spec.models.target.checkpoint.is_relative_to(REPO / "models")


def test_every_mode_has_its_traits():
    """The spec's modes and the traits table (pipeline/modes.py) list the same modes."""
    import typing

    from pipeline.modes import MODES
    from pipeline.spec import Mode

    assert set(typing.get_args(Mode)) == set(MODES)


@pytest.mark.parametrize("value", ["1.5", "-0.1", "1"])
def test_a_lookup_cut_outside_0_1_names_the_field(value):
    with pytest.raises(SpecError) as err:
        load_spec(REPO / "examples/ngram.yaml", [f"speculative.ngram.min_token_prob={value}"], check_paths=False)
    assert err.value.path == "speculative.ngram.min_token_prob" and "0.4" in err.value.fix
    assert load_spec(REPO / "examples/ngram.yaml", ["speculative.ngram.min_token_prob=0.4"],
                     check_paths=False).speculative.ngram.min_token_prob == 0.4
