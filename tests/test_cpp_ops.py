"""Building the project's C++ kernels (pipeline/reference/cpp_ops.py): a build killed midway must not hang later ones.

torch's loader waits without end while its `lock` file exists in a kernel's build folder; a first build killed
midway (Ctrl-C during the compile) leaves it behind. The project's builds hold a kernel lock instead and remove
such a file, in a folder of their own per build and torch install.
"""

import subprocess
import sys
from pathlib import Path

import torch

from pipeline.reference import cpp_ops, fused_layers, row_attention

ROOT = Path(__file__).resolve().parents[1]


def test_a_stale_build_lock_does_not_hang_the_next_process():
    assert cpp_ops.loaded(fused_layers.BUILD)  # built and cached for this machine
    stale = cpp_ops.build_directory(fused_layers.BUILD) / "lock"
    stale.touch()  # as a killed build leaves it
    load = ("from pipeline.reference import cpp_ops, fused_layers, row_attention; "
            "assert cpp_ops.loaded(fused_layers.BUILD); import torch; print(torch.ops.specdeploy.dense_layers)")
    done = subprocess.run([sys.executable, "-c", load], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "dense_layers" in done.stdout and not stale.exists()
    assert "left by a build that was killed" in done.stderr


def test_each_torch_install_and_build_has_its_own_library_folder(monkeypatch):
    """Two virtual environments (two checkouts) no longer rebuild each other's library when they alternate, nor do
    a source's AVX-512 and AVX2 builds share a folder."""
    assert cpp_ops.loaded(fused_layers.BUILD)
    here = cpp_ops.build_directory(fused_layers.BUILD)
    assert (here / f"specdeploy_{fused_layers.BUILD.library}.so").exists()  # the library loaded is built there
    assert cpp_ops.build_directory(row_attention.AVX512) != cpp_ops.build_directory(row_attention.AVX2)
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/python3.11/site-packages/torch/__init__.py")
    assert cpp_ops.build_directory(fused_layers.BUILD) != here
