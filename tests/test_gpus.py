"""GPU rules of the trtllm toolchain: compute capability by name, float32 mapping, quantization refusals."""

import dataclasses
from pathlib import Path

import pytest

from pipeline.gpus import check_gpu_rules, compute_capability, dtype_notices, engine_dtype
from pipeline.rules import load_spec
from pipeline.spec import GpuSpec, SpecError
from specbuild.plan import make_plan
from specbuild.toolchains.trtllm import check_command, parse_script, render_script

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, cc", [
    ("NVIDIA-H100-80GB-HBM3", 9.0), ("NVIDIA H200", 9.0), ("NVIDIA-A100-SXM4-80GB", 8.0), ("NVIDIA-A10G", 8.6),
    ("NVIDIA-L40S", 8.9), ("NVIDIA-L4", 8.9), ("Tesla-T4", 7.5), ("NVIDIA-B200", 10.0), ("NVIDIA-GB300", 10.3),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 12.0),
])
def test_compute_capability_from_gpu_name(name, cc):
    assert compute_capability(GpuSpec(name=name)) == cc


def test_compute_capability_override_and_unknown_name():
    assert compute_capability(GpuSpec(name="NVIDIA-H100-80GB-HBM3", compute_capability=10.0)) == 10.0
    with pytest.raises(SpecError) as err:
        compute_capability(GpuSpec(name="Acme-X1"))
    assert err.value.path == "gpu.name" and "gpu.compute_capability" in err.value.fix


def spec_with(*sets: str):
    return load_spec(REPO / "examples/draft-target.yaml", list(sets), check_paths=False)


def test_float32_is_built_as_bfloat16_or_float16_with_a_notice():
    spec = spec_with()
    assert spec.models.target.dtype == "float32"
    assert engine_dtype(spec, spec.models.target) == "bfloat16"
    t4 = dataclasses.replace(spec, gpu=GpuSpec(name="Tesla-T4", memory_gib=16))
    assert engine_dtype(t4, t4.models.target) == "float16"  # no bfloat16 below compute capability 8.0
    assert [n.split()[1] for n in dtype_notices(spec)] == ["models.target.dtype", "models.draft.dtype"]
    assert engine_dtype(spec_with("models.target.dtype=float16"), spec_with("models.target.dtype=float16").models.target) == "float16"


def test_default_spec_plans_cleanly_for_a_gpu(derived_pair, tmp_path):
    """examples/default.yaml (float32 activations for the CPU kernels) yields a bfloat16 GPU build with a notice
    (on a tiny checkpoint: the plan inspects it)."""
    spec = load_spec(REPO / "examples/default.yaml", [f"models.target.checkpoint={derived_pair[0]}",
                                                      f"output.cache_dir={tmp_path / 'cache'}"])
    script = render_script(make_plan(spec, "trtllm"))
    convert = check_command(parse_script(script)[0][2])
    assert convert.dtype == "bfloat16"
    assert "# notice: models.target.dtype float32 -> bfloat16" in script


@pytest.mark.parametrize("sets, path", [
    # INT8 KV turns paged context FMHA, hence KV reuse, off: BLS verify rounds would re-prefill
    (["models.target.kv_cache_dtype=int8"], "models.target.kv_cache_dtype"),
    (["models.draft.kv_cache_dtype=int8", "serving.enable_kv_cache_reuse=false"], "models.draft.kv_cache_dtype"),
    # FP8 needs Ada or later
    (["models.target.qformat=fp8", "gpu.name=NVIDIA-A100-SXM4-80GB"], "models.target.qformat"),
    (["models.target.kv_cache_dtype=fp8", "gpu.name=Tesla-T4"], "models.target.kv_cache_dtype"),
    # Blackwell builds none of the INT8/INT4 recipes
    (["models.target.qformat=int4_awq", "gpu.name=NVIDIA-B200"], "models.target.qformat"),
    (["models.draft.qformat=int8_wo", "gpu.compute_capability=10.0"], "models.draft.qformat"),
    (["models.target.qformat=int8_sq", "gpu.name=NVIDIA-GB200"], "models.target.qformat"),
])
def test_gpu_rules_are_spec_errors_at_validate_time(sets, path):
    with pytest.raises(SpecError) as err:
        spec_with("toolchain=trtllm", *sets)
    assert err.value.path == path and "\n" not in str(err.value)


def test_gpu_rules_allow_what_the_gpu_builds():
    check_gpu_rules(spec_with("models.target.qformat=int8_wo", "models.draft.qformat=int4_awq"))  # H100
    check_gpu_rules(spec_with("models.target.qformat=fp8", "models.target.kv_cache_dtype=fp8", "gpu.name=NVIDIA-B200"))
    # the reference toolchain has its own INT8 KV cache: only trtllm specs are held to the GPU's rules
    assert spec_with("models.target.kv_cache_dtype=int8", "toolchain=reference").models.target.kv_cache_dtype == "int8"
