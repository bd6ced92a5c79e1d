"""Heartbeats of the python model stubs (pipeline/serving/heartbeat.py): silence measures a stopped interpreter.

The check against a real Triton server (a SIGSTOPped BLS stub is not live) is in tests/test_server_faults.py.
"""

import os
import signal
import subprocess
import sys
import threading
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


def test_a_stuck_send_silences_the_heartbeat_until_it_returns(tmp_path):
    """A process whose interpreter runs but one of whose response sends has waited past SEND_STALL_S (0.3 s here)
    goes silent, as a frozen one does, and beats again once the send returns."""
    drain, release = tmp_path / "server.drain", tmp_path / "release"
    code = (
        "import threading, time\n"
        "from pathlib import Path\n"
        "from pipeline.serving import heartbeat\n"
        "heartbeat.SEND_STALL_S = 0.3\n"
        f"heartbeat.start('m', {str(drain)!r}, 0.05)\n"
        "time.sleep(0.5)\n"
        "def stuck_send():\n"
        "    with heartbeat.PENDING_SENDS.track():\n"
        f"        while not Path({str(release)!r}).exists(): time.sleep(0.01)\n"
        "threading.Thread(target=stuck_send).start()\n"
        "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        wait_for(lambda: heartbeat.silent_for(drain, "m", proc.pid) is not None)
        wait_for(lambda: heartbeat.silent_for(drain, "m", proc.pid) >= 1.0)  # the send has waited past 0.3 s
        assert proc.poll() is None  # running, not frozen
        release.touch()
        wait_for(lambda: heartbeat.silent_for(drain, "m", proc.pid) < 0.5)
    finally:
        proc.kill()
        proc.wait()


def test_pending_sends_measure_the_longest_wait_of_those_in_flight():
    sends, started, release = heartbeat.PendingSends(), threading.Event(), threading.Event()

    def send():
        with sends.track():
            started.set()
            release.wait(30)

    assert sends.longest_wait_s() == 0.0
    thread = threading.Thread(target=send)
    thread.start()
    started.wait(30)
    time.sleep(0.3)
    with sends.track():  # a second send, just begun: the first one's wait counts
        assert sends.longest_wait_s() >= 0.3
    release.set()
    thread.join(30)
    assert sends.longest_wait_s() == 0.0
    with pytest.raises(RuntimeError), sends.track():  # a send that raises is no longer in flight
        raise RuntimeError("the client is gone")
    assert sends.longest_wait_s() == 0.0


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
