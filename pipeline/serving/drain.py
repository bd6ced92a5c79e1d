"""Shutdown state shared by the process that stops the server and the models that serve text, through one file.

`pipeline serve` (on SIGTERM) and `pipeline drain` (the Kubernetes preStop hook) write the state;
tensorrt_llm_bls reads it (no Triton import here). The file's content is the state; no file means
SERVING:
- UNREADY: readiness fails (load balancers stop sending), requests are still admitted;
- DRAINING: new requests are refused with an UNAVAILABLE error, the ones in flight finish;
- ABORTING: the drain budget is spent: the ones still in flight end with an UNAVAILABLE error now.
The path comes from $SPECDEPLOY_DRAIN_FILE (the server's environment), default
<tmp>/specdeploy-<http_port>.drain, so every process of one server agrees on it.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

DRAIN_ENV = "SPECDEPLOY_DRAIN_FILE"
SERVING, UNREADY, DRAINING, ABORTING = "serving", "unready", "draining", "aborting"
STATES = (SERVING, UNREADY, DRAINING, ABORTING)


def drain_path(http_port: int) -> Path:
    """The default state file of the server whose HTTP port is `http_port`."""
    return Path(tempfile.gettempdir()) / f"specdeploy-{http_port}.drain"


def write_state(path: Path, state: str) -> None:
    """Set the state (atomically: readers never see a half-written file); SERVING removes the file."""
    if state not in STATES:
        raise ValueError(f"drain state {state!r} is not one of {STATES}")
    path = Path(path)
    if state == SERVING:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(state)
    tmp.replace(path)


def read_state(path: Path | None) -> str:
    """The current state (SERVING when there is no file or no path)."""
    if path is None:
        return SERVING
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        return SERVING
    return text if text in STATES else SERVING


class DrainState:
    """A reader that looks at the file at most every `ttl_s` seconds (the BLS asks once per round)."""

    def __init__(self, path: str | Path | None = None, ttl_s: float = 0.2):
        path = path if path is not None else os.environ.get(DRAIN_ENV)
        self.path = Path(path) if path else None
        self.ttl_s = ttl_s
        self._state, self._at = SERVING, float("-inf")

    def get(self) -> str:
        """The state, at most `ttl_s` old."""
        now = time.monotonic()
        if now - self._at >= self.ttl_s:
            self._state, self._at = read_state(self.path), now
        return self._state

    def admits(self) -> bool:
        """Whether a new request may start."""
        return self.get() in (SERVING, UNREADY)

    def aborting(self) -> bool:
        """Whether requests in flight must end now."""
        return self.get() == ABORTING
