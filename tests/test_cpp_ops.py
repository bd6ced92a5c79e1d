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


def test_a_sources_local_headers_are_compiled_inline_so_an_edit_rebuilds_it(tmp_path, monkeypatch):
    """torch's loader rebuilds a library when the text it compiles changes: a header a source includes is part of
    that text, so editing csrc/shared_items.h rebuilds every kernel that includes it. System headers stay includes."""
    for kernel in (fused_layers.BUILD, row_attention.AVX512):  # the project's own includes are all inlined
        assert '#include "' not in cpp_ops.source_text(kernel) and "struct SharedItems" in cpp_ops.source_text(kernel)
    (tmp_path / "kernel.cpp").write_text('#include <vector>\n#include "items.h"\nint f() { return ITEMS; }\n')
    (tmp_path / "items.h").write_text("#define ITEMS 3\n")
    monkeypatch.setattr(cpp_ops, "SOURCES", tmp_path)
    build = cpp_ops.Build("kernel", "kernel", (), lambda: True)
    assert cpp_ops.source_text(build) == "#include <vector>\n#define ITEMS 3\n\nint f() { return ITEMS; }\n"
    (tmp_path / "items.h").write_text("#define ITEMS 4\n")
    assert "ITEMS 4" in cpp_ops.source_text(build)
