"""Building the project's C++ kernels (pipeline/reference/cpp_ops.py): a build killed midway must not hang later ones.

torch's loader waits without end while its `lock` file exists in a kernel's build folder; a first build killed
midway (Ctrl-C during the compile) leaves it behind. The project's builds hold a kernel lock instead and remove
such a file.
"""

import subprocess
import sys
from pathlib import Path

from torch.utils.cpp_extension import _get_build_directory

from pipeline.reference import cpp_ops, fused_layers

ROOT = Path(__file__).resolve().parents[1]


def test_a_stale_build_lock_does_not_hang_the_next_process():
    assert cpp_ops.loaded(fused_layers.BUILD)  # built and cached for this machine
    stale = Path(_get_build_directory(f"specdeploy_{fused_layers.BUILD.library}", verbose=False)) / "lock"
    stale.touch()  # as a killed build leaves it
    load = ("from pipeline.reference import cpp_ops, fused_layers; "
            "assert cpp_ops.loaded(fused_layers.BUILD); import torch; print(torch.ops.specdeploy.dense_layers)")
    done = subprocess.run([sys.executable, "-c", load], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "dense_layers" in done.stdout and not stale.exists()
    assert "left by a build that was killed" in done.stderr
