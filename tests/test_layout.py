"""The layout's promises: what each stage may import, and that the build stage imports in a source tree
without shadowing PyPA's `build`."""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, cwd: Path = ROOT, **env) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (cwd the project root by default, PYTHONPATH unset unless given)."""
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd,
                          timeout=120, env=environ)


def test_names_module_imports_nothing():
    tree = ast.parse((ROOT / "pipeline" / "names.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_specbuild_imports_from_the_source_tree_it_belongs_to():
    """As `python -m pipeline` and the Triton models run (cwd the root, no PYTHONPATH): importing pipeline makes
    this tree's build/specbuild importable, ahead of any other checkout's."""
    out = run_python("""
        import pipeline, specbuild.plan, specbuild.toolchains.trtllm
        print(specbuild.plan.__file__)
    """)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == ROOT / "build" / "specbuild" / "plan.py"


def test_build_dir_does_not_shadow_pypa_build(tmp_path):
    """build/ is not an importable package: a regular `build` package elsewhere on the path (PyPA's) wins."""
    assert not (ROOT / "build" / "__init__.py").exists()
    fake = tmp_path / "build"
    fake.mkdir()
    (fake / "__init__.py").write_text("PYPA = True\n")
    out = run_python("""
        import sys
        sys.path.append(%r)  # after the project root, as site-packages is
        import pipeline, build
        print(getattr(build, "PYPA", False))
    """ % str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_trtllm_repository_python_models_import_no_torch():
    """The python models of the trtllm repository (pre/postprocessing, the BLS) drive TensorRT-LLM's engines:
    importing them, with all the serving modules they use, must not import torch or the reference engine.
    triton_python_backend_utils exists only inside Triton: an empty stand-in module lets them import here."""
    out = run_python("""
        import importlib.util, sys, types
        sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
        for name in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
            spec = importlib.util.spec_from_file_location(f"{name}_model", f"model_repo/{name}/1/model.py")
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        import pipeline.serving.bls, pipeline.serving.bls_calls, pipeline.serving.engine_io, pipeline.serving.params
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torch" or m.startswith("pipeline.reference"))
        print("loaded:", loaded)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "loaded: []"


def test_reference_engine_model_does_load_torch():
    """The counterpart: the reference tensorrt_llm model does import torch (so the check above can fail)."""
    out = run_python("""
        import importlib.util, sys, types
        sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
        spec = importlib.util.spec_from_file_location("engine_model", "model_repo/tensorrt_llm/1/model.py")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        print("torch" in sys.modules)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
