"""Heartbeats of the python model stubs (pipeline/serving/heartbeat.py): silence measures a stopped interpreter.

The check against a real Triton server (a SIGSTOPped BLS stub is not live) is in tests/test_server_faults.py.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.serving import heartbeat

ROOT = Path(__file__).resolve().parent.parent


def wait_for(condition, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_stopped_process_goes_silent_and_beats_again_once_it_runs(tmp_path):
    drain = tmp_path / "server.drain"
    code = f"from pipeline.serving import heartbeat; import time; heartbeat.start('m', {str(drain)!r}, 0.05); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        wait_for(lambda: heartbeat.silent_for(drain, "m", proc.pid) is not None)
        assert heartbeat.silent_for(drain, "m", proc.pid) < 1.0
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(1.0)
        assert heartbeat.silent_for(drain, "m", proc.pid) >= 0.8
        os.kill(proc.pid, signal.SIGCONT)
        wait_for(lambda: heartbeat.silent_for(drain, "m", proc.pid) < 0.5)
    finally:
        proc.kill()
        proc.wait()
    assert heartbeat.silent_for(drain, "m", proc.pid) is None  # the process is gone
    assert heartbeat.silent_for(drain, "other", os.getpid()) is None  # never beat


def test_a_file_older_than_its_pids_process_is_a_previous_processs(tmp_path):
    """A restarted container keeps /tmp's volume and reuses pids: an old process's file must not read as silence."""
    drain = tmp_path / "server.drain"
    beat = heartbeat.beats_dir(drain) / f"m.{os.getpid()}"
    beat.parent.mkdir()
    beat.touch()
    started = heartbeat.process_start_time(os.getpid())
    assert started <= time.time()
    os.utime(beat, (started - 60, started - 60))
    assert heartbeat.silent_for(drain, "m", os.getpid()) is None
    os.utime(beat, (started + 0.5, started + 0.5))
    assert heartbeat.silent_for(drain, "m", os.getpid()) == pytest.approx(time.time() - started - 0.5, abs=0.5)


def test_no_drain_file_no_heartbeat(monkeypatch):
    monkeypatch.delenv(heartbeat.DRAIN_ENV, raising=False)
    assert heartbeat.start("m") is None
