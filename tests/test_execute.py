"""Execute: cached reference builds, atomic steps, manifest, trtllm hand-off, `engines` from the CLI."""

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from specbuild.execute import run_engines
from specbuild.plan import make_plan
from pipeline.spec import SpecError, load_spec

REPO = Path(__file__).resolve().parents[1]
SPEC = """\
name: t
models:
  target: {{checkpoint: {target}, dtype: float32}}
  draft: {{checkpoint: {draft}, dtype: float32}}
speculative: {{mode: draft_target, max_draft_len: 6, num_draft_tokens: 4}}
output: {{dir: {tmp}/out, cache_dir: {tmp}/cache}}
toolchain: reference
"""


@pytest.fixture
def spec_file(derived_pair, tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC.format(target=derived_pair[0], draft=derived_pair[1], tmp=tmp_path))
    return path


def statuses(output: str) -> dict[str, str]:
    """label -> last status word of each step line."""
    found = {}
    for line in output.splitlines():
        if line.startswith("[") and "/" in line.split()[1]:
            found[line.split()[1]] = line.split()[3]
    return found


def test_second_run_does_no_work_and_says_so(spec_file, capsys):
    spec = load_spec(spec_file)
    run_engines(spec)
    first = capsys.readouterr().out
    assert set(statuses(first).values()) == {"built"}
    entries = {p.name: p.stat().st_mtime_ns for p in spec.output.cache_dir.iterdir()}
    run_engines(spec)
    second = capsys.readouterr().out
    assert set(statuses(second).values()) == {"cached"} and "nothing to do: all 4 steps cached" in second
    assert {p.name: p.stat().st_mtime_ns for p in spec.output.cache_dir.iterdir()} == entries
    for role in ("target", "draft"):
        link = spec.out_dir / "engines" / role
        assert link.is_symlink() and (link / "config.json").is_file() and (link / "rank0.safetensors").is_file()


def test_changing_the_draft_qformat_rebuilds_only_the_draft(spec_file, capsys):
    run_engines(load_spec(spec_file))
    capsys.readouterr()
    spec = load_spec(spec_file, ["models.draft.qformat=int8_wo"])
    run_engines(spec)
    assert statuses(capsys.readouterr().out) == {"target/convert": "cached", "target/build": "cached",
                                                  "draft/convert": "built", "draft/build": "built"}
    config = json.loads((spec.out_dir / "engines/draft/config.json").read_text())
    assert config["pretrained_config"]["quantization"]["quant_algo"] == "W8A16"


def test_manifest_lists_keys_inputs_versions_sizes_and_times(spec_file, capsys):
    spec = load_spec(spec_file)
    run_engines(spec)
    manifest = json.loads((spec.out_dir / "manifest.json").read_text())
    plan = make_plan(spec, "reference")
    assert manifest["toolchain"] == "reference" and manifest["build_key"] == plan.build_key
    for role in ("target", "draft"):
        engine = manifest["engines"][role]
        assert engine["key"] == plan.engine_step(role).key
        assert engine["bytes"] > 0 and engine["build_seconds"] >= 0
        convert, build = engine["steps"]
        assert len(convert["inputs"]["checkpoint"]) == 20 and build["inputs"]["checkpoint"] == convert["key"]
        assert convert["versions"]["reference_format"] and "torch" in convert["versions"]


def test_an_interrupted_step_leaves_the_cache_consistent(spec_file, monkeypatch, capsys):
    spec = load_spec(spec_file)
    import specbuild.convert as convert

    real = convert.build_engine

    def interrupted(checkpoint_dir, engine_dir, params):
        real(checkpoint_dir, engine_dir, params)  # the engine is fully written to the temp folder ...
        raise KeyboardInterrupt  # ... when Ctrl-C arrives

    monkeypatch.setattr(convert, "build_engine", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_engines(spec)
    plan = make_plan(spec, "reference")
    cache = spec.output.cache_dir
    assert (cache / plan.steps[0].key / "step.json").is_file()  # the finished convert step stays cached
    assert not (cache / plan.steps[1].key).exists()
    assert not list(cache.glob(".tmp-*"))
    monkeypatch.setattr(convert, "build_engine", real)
    run_engines(spec)
    assert statuses(capsys.readouterr().out)["target/build"] == "built"


def test_stale_temporaries_of_killed_runs_are_removed(spec_file, capsys):
    spec = load_spec(spec_file)
    stale = spec.output.cache_dir / ".tmp-0123456789abcdef0123-999999999"
    stale.mkdir(parents=True)
    run_engines(spec)
    assert not stale.exists()


def test_trtllm_toolchain_writes_the_gpu_script_here(spec_file, capsys):
    spec = load_spec(spec_file, ["toolchain=trtllm"])
    assert run_engines(spec) == 0
    out = capsys.readouterr().out
    script = spec.out_dir / "trtllm" / "build_engines.sh"
    assert "must run on a GPU host" in out and script.is_file()
    assert "trtllm-build" in script.read_text() and not (spec.out_dir / "engines").exists()


def test_auto_toolchain_falls_back_with_one_notice(spec_file, capsys):
    run_engines(load_spec(spec_file, ["toolchain=auto"]))
    notices = [line for line in capsys.readouterr().out.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1 and "reference" in notices[0]


def test_pickle_weights_are_refused_before_building(spec_file, derived_pair, tmp_path):
    draft = shutil.copytree(derived_pair[1], tmp_path / "draft-pickle")
    (draft / "model.safetensors").unlink()
    (draft / "pytorch_model.bin").write_bytes(b"\x80\x04 pretend pickle")
    with pytest.raises(SpecError) as err:
        run_engines(load_spec(spec_file, [f"models.draft.checkpoint={draft}"]))
    assert err.value.path == "models.draft.checkpoint"
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("*/step.json"))


def test_engines_command_end_to_end(spec_file):
    def run(*flags):
        return subprocess.run([sys.executable, *flags, "-m", "pipeline", "engines", str(spec_file)], cwd=REPO,
                              capture_output=True, text=True, timeout=300)

    first, second = run(), run("-X", "importtime")
    assert first.returncode == 0 and "built 4 of 4 steps" in first.stdout, first.stderr
    assert second.returncode == 0 and "nothing to do" in second.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in second.stderr.splitlines() if line.startswith("import time:")}
    assert "specbuild.execute" in imported and "torch" not in imported  # a cache hit loads no ML stack


def test_fp8_kv_cache_is_refused_by_the_reference_toolchain(spec_file):
    with pytest.raises(SpecError) as err:
        run_engines(load_spec(spec_file, ["models.draft.kv_cache_dtype=fp8"]))
    assert err.value.path == "models.draft.kv_cache_dtype" and "int8" in err.value.fix


def test_ctrl_c_during_a_step_exits_130_and_leaves_no_partial_entry(spec_file):
    spec = load_spec(spec_file, ["models.target.qformat=int8_sq", "models.target.calib_size=2"])
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "engines", str(spec_file), "--set", "models.target.qformat=int8_sq",
                             "--set", "models.target.calib_size=2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # as a terminal's foreground job gets it, even where this run inherited SIGINT ignored
                            # (a background job of a shell without job control): Python then never raises on Ctrl-C
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stdout:
        if "target/quantize" in line and "running" in line:
            proc.send_signal(signal.SIGINT)  # Ctrl-C while the calibrated step runs
            break
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip().startswith("interrupted:") and "Traceback" not in err
    cache = spec.output.cache_dir
    assert not (cache / make_plan(spec, "reference").steps[0].key).exists() and not list(cache.glob(".tmp-*"))
