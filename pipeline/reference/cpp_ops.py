"""The project's C++ CPU kernels (pipeline/reference/csrc/), built where they are first used.

Each source registers ops in the `specdeploy` namespace (`torch.ops.specdeploy`). torch's C++ extension loader
compiles a source once per machine and torch install (gcc >= 11 and ninja, about 25 s; later processes load the cached
library from ~/.cache/torch_extensions, one folder per build and torch install: `build_directory`). A kernel that
cannot be built is logged once and its caller keeps its fallback.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)
SOURCES = Path(__file__).parent / "csrc"
# Every build compiles and links with OpenMP: without it (_OPENMP undefined) ATen's header-only at::parallel_for runs
# its body on the calling thread alone, so the kernels ignored torch's thread count (measured: a one-row int8 GEMM
# over SmolLM2's matrices 12.2 ms on one thread and 11.8 on "two", docs/benchmarks.md). The library's libgomp.so.1
# is the one torch already loaded (same soname), so torch.set_num_threads governs the kernels' threads too.
OPENMP = ("-fopenmp",)


def switched_on(env: str) -> bool:
    """Whether the environment allows a kernel (its variable `env` is not "0")."""
    return os.environ.get(env, "1") != "0"


@dataclass(frozen=True)
class Build:
    """One build of a kernel source: library specdeploy_<library> from csrc/<source>.cpp with `flags`, for CPUs
    that pass `cpu_supported` (one source may build twice, for AVX-512 and for AVX2)."""

    library: str
    source: str
    flags: tuple[str, ...]
    cpu_supported: Callable[[], bool]


def first_build(builds: tuple[Build, ...], env: str, fallback: str) -> Build | None:
    """The first of `builds` this CPU runs that builds and loads (its ops then in `torch.ops.specdeploy`), or None:
    `env` is "0", no build suits the CPU (logged: `fallback` says what runs instead), or the builds failed."""
    if not switched_on(env):
        return None
    build = next((b for b in builds if b.cpu_supported() and loaded(b)), None)
    if build is None:
        log.info("%s: no build runs on this CPU; %s", builds[0].library, fallback)
    return build


@functools.cache
def loaded(build: Build) -> bool:
    """Compile the build (once per machine) and load it into `torch.ops.specdeploy`; False where that fails
    (logged)."""
    try:
        import ninja  # the pip package; torch's loader runs the `ninja` binary from PATH
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass
    name = f"specdeploy_{build.library}"
    try:
        from torch.utils.cpp_extension import load_inline
        folder = build_directory(build)
        with _build_lock(folder):
            load_inline(name, cpp_sources=[source_text(build)], build_directory=str(folder),
                        extra_cflags=[*build.flags, *OPENMP], extra_ldflags=list(OPENMP), is_python_module=False)
    except Exception as error:  # no compiler, no ninja, a failed build: the caller's fallback still works
        log.warning("could not build the %s kernel (%s); its fallback runs", build.library, error)
        return False
    return True


def source_text(build: Build) -> str:
    """The build's source with each `#include "<name>.h"` replaced by csrc/<name>.h's text: torch's loader compiles
    the text it is given and rebuilds when that text changes, so a header edit rebuilds every source that includes
    it."""
    return re.sub(r'^#include "(\w+\.h)"$', lambda m: (SOURCES / m.group(1)).read_text(),
                  (SOURCES / f"{build.source}.cpp").read_text(), flags=re.MULTILINE)


def build_directory(build: Build) -> Path:
    """The folder of a build's cached library: torch's extension folder for it, suffixed with a hash of the torch
    install and the flags it compiles against.

    torch's own folder is named after the library alone, and its ninja file holds the include paths of the torch
    that built it, so two checkouts (two virtual environments) rebuilt each other's library whenever they
    alternated: about 25-40 s of compiling in the first forward of a served model, past a stall bound
    (serving.stall_timeout_s) measured in seconds.
    """
    import sysconfig

    import torch
    from torch.utils.cpp_extension import _get_build_directory

    toolchain = "\n".join([str(Path(torch.__file__).resolve().parent), torch.__version__,
                           sysconfig.get_path("include"), *build.flags, *OPENMP])
    digest = hashlib.sha256(toolchain.encode()).hexdigest()[:10]
    return Path(_get_build_directory(f"specdeploy_{build.library}-{digest}", verbose=False))


@contextmanager
def _build_lock(build_dir: Path):
    """Hold an advisory lock on build_dir for one process's build, and remove a stale torch `lock` file first.

    torch's loader marks a build in progress with a `lock` file and waits, without end, while it exists; a build
    killed midway (Ctrl-C during the first 25 s compile, an OOM kill) leaves the file behind, and every later
    process hung on it. The kernel lock (flock, released by the kernel when its holder dies) serialises this
    project's builds of a library, so a `lock` file found while holding it belongs to a dead build.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "specdeploy.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield
