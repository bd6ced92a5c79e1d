"""The project's C++ CPU kernels (pipeline/reference/csrc/), built where they are first used.

Each source registers ops in the `specdeploy` namespace (`torch.ops.specdeploy`). torch's C++ extension loader
compiles a source once per machine (gcc >= 11 and ninja, about 25 s; later processes load the cached library
from ~/.cache/torch_extensions). A kernel that cannot be built is logged once and its caller keeps its fallback.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)
SOURCES = Path(__file__).parent / "csrc"


def switched_on(env: str) -> bool:
    """Whether the environment allows a kernel (its variable `env` is not "0")."""
    return os.environ.get(env, "1") != "0"


def load(name: str, env: str, cpu_supported: Callable[[], bool], flags: list[str], fallback: str,
         source: str | None = None):
    """`torch.ops.specdeploy` with csrc/<source or name>.cpp's ops loaded (library specdeploy_<name>: one source may
    build twice with different flags), or None where they cannot run here: `env` is "0", the CPU lacks what
    `cpu_supported` checks (logged: `fallback` says what runs instead), or the build failed."""
    import torch

    if not switched_on(env):
        return None
    if not cpu_supported():
        log.info("%s: not for this CPU; %s", name, fallback)
        return None
    if not _build(name, source or name, flags):
        return None
    return torch.ops.specdeploy


def _build(name: str, source: str, flags: list[str]) -> bool:
    """Compile and load csrc/<source>.cpp as library specdeploy_<name>; False where that fails (logged)."""
    try:
        import ninja  # the pip package; torch's loader runs the `ninja` binary from PATH
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass
    try:
        from torch.utils.cpp_extension import load_inline
        load_inline(f"specdeploy_{name}", cpp_sources=[(SOURCES / f"{source}.cpp").read_text()], extra_cflags=flags,
                    is_python_module=False)
    except Exception as error:  # no compiler, no ninja, a failed build: the caller's fallback still works
        log.warning("could not build the %s kernel (%s); its fallback runs", name, error)
        return False
    return True
