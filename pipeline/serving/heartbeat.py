"""Heartbeats of the python model stubs: whether a stub's interpreter still runs, for `pipeline health --live`.

A stub can freeze while its process lives. Triton 2.51's python stub has a lock-order cycle (docs/reliability.md,
"The python stub segfault and deadlock") that leaves one thread waiting forever while it holds the GIL: no Python
code of that stub runs again, every request to its model waits until its client gives up, the server cannot stop
within its exit timeout, and Triton's health endpoints, which see a live process, stay green. So each text model
(tensorrt_llm, tensorrt_llm_bls and their copies) starts a heartbeat in initialize: a daemon thread that touches a
file every BEAT_S seconds, which it can only do while the interpreter runs. `pipeline.lifecycle.check` reads the
files: a stub silent for longer than STALE_S seconds is not live (Kubernetes then restarts the pod).

The files live in a folder beside the drain state file (pipeline.serving.drain, whose path every process of one
server knows), one per stub, named <model>.<pid>. A file older than its stub's process is a previous process's
whose pid was reused (a restarted container keeps /tmp's volume): it does not count.

A stub can also stop answering while its interpreter runs: a response send (`ResponseSender::Send`) that never
returns, waiting in a condition variable for the Triton process to take the response, with the GIL released. The
BLS sends from its one event-loop thread, so one such send stops the whole model (docs/reliability.md, "Seen again, in
the BLS"). So every send goes through `PENDING_SENDS.track()`, and the heartbeat stops beating while a send has waited
longer than SEND_STALL_S: the stub then reads as not live, as a frozen one does.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from pipeline.serving.drain import DRAIN_ENV

BEAT_S = 1.0
STALE_S = 30.0  # a long prefill holds the GIL for seconds at most; a frozen stub stays silent for good
# A send waits for the Triton process to take the response into its queue (not for the client), milliseconds
# normally; one that has waited this long will not return
SEND_STALL_S = 30.0


class PendingSends:
    """The response sends in flight in this process, with when each began (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._began: dict[int, float] = {}  # a send's key -> time.monotonic() when it began
        self._next_key = 0

    @contextmanager
    def track(self):
        """Count the block's send as in flight until it returns or raises."""
        with self._lock:
            key, self._next_key = self._next_key, self._next_key + 1
            self._began[key] = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                del self._began[key]

    def longest_wait_s(self) -> float:
        """Seconds the oldest send in flight has waited (0 with none)."""
        with self._lock:
            oldest = min(self._began.values(), default=None)
        return 0.0 if oldest is None else time.monotonic() - oldest


PENDING_SENDS = PendingSends()  # this process's sends (pipeline.serving.triton_io sends through it)


def beats_dir(drain_file: str | Path) -> Path:
    """The folder of the heartbeat files of the server whose drain state file is `drain_file`."""
    drain_file = Path(drain_file)
    return drain_file.with_name(drain_file.name + ".beats")


def start(model: str, drain_file: str | Path | None = None, interval_s: float = BEAT_S) -> threading.Thread | None:
    """Start this process's heartbeat as `model` (drain_file: default $SPECDEPLOY_DRAIN_FILE); None where neither is
    set (a model loaded outside `pipeline serve` and the Deployment, as in a unit test). It beats every interval_s
    while no send of `PENDING_SENDS` has waited SEND_STALL_S."""
    drain_file = drain_file or os.environ.get(DRAIN_ENV)
    if not drain_file:
        return None
    folder = beats_dir(drain_file)
    folder.mkdir(parents=True, exist_ok=True)
    beat = folder / f"{model}.{os.getpid()}"

    def run() -> None:
        while True:
            try:
                if PENDING_SENDS.longest_wait_s() < SEND_STALL_S:  # else silent: a stuck send
                    beat.touch()
            except OSError:  # the folder was removed: the check then sees no heartbeat, never a stale one
                pass
            time.sleep(interval_s)

    thread = threading.Thread(target=run, name=f"heartbeat-{model}", daemon=True)
    thread.start()
    return thread


def silent_for(drain_file: str | Path, model: str, pid: int) -> float | None:
    """Seconds since the stub `pid` of `model` last beat; None where it never did (it has not reached initialize
    yet, or its model has no heartbeat)."""
    try:
        last = (beats_dir(drain_file) / f"{model}.{pid}").stat().st_mtime
        if last < process_start_time(pid) - 1.0:  # a previous process's file (btime has whole seconds)
            return None
    except (FileNotFoundError, ProcessLookupError):
        return None
    return max(0.0, time.time() - last)


def process_start_time(pid: int) -> float:
    """When process `pid` started (seconds since the epoch), from /proc; ProcessLookupError where it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks after boot
