"""A stand-in tritonserver for the GPU toolchains' launch scripts (no GPU, no TensorRT-LLM here).

It records its working directory, $TRTLLM_ORCHESTRATOR and its arguments, then runs until SIGTERM; on SIGTERM
it "drains" for DRAIN_S (in-flight requests finishing), marks that, and exits with EXIT_STATUS.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

EXIT_STATUS = 7
DRAIN_S = 1
SCRIPT = f"""#!/usr/bin/env bash
printf '%s\\n' "$PWD" "${{TRTLLM_ORCHESTRATOR:-}}" "$@" > "$FAKE_DIR/args"
trap 'echo TERM > "$FAKE_DIR/signal"; sleep {DRAIN_S}; touch "$FAKE_DIR/drained"; exit {EXIT_STATUS}' TERM
touch "$FAKE_DIR/started"
while :; do sleep 0.1; done
"""


def write_fake_tritonserver(folder: Path) -> Path:
    """The executable stand-in in `folder` (which also receives its records); returns its path."""
    fake = folder / "tritonserver"
    fake.write_text(SCRIPT)
    fake.chmod(0o755)
    return fake


def wait_for(path: Path, proc: subprocess.Popen, deadline_s: float = 60) -> None:
    """Wait until `path` exists, failing if `proc` exits first or the deadline passes."""
    end = time.monotonic() + deadline_s
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.05)


def recorded_args(folder: Path) -> tuple[str, str, list[str]]:
    """(working directory, $TRTLLM_ORCHESTRATOR, arguments) the stand-in was started with."""
    cwd, orchestrator, *args = (folder / "args").read_text().splitlines()
    return cwd, orchestrator, args
