"""pipeline.server.TritonServer on small hand-written repositories: readiness, failures, cleanup."""

import _thread
import os
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from pipeline.server import ServerError, TritonServer, free_ports

ECHO_CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
input [{ name: "x" data_type: TYPE_STRING dims: [1] }]
output [{ name: "y" data_type: TYPE_STRING dims: [1] }]
"""
ECHO_MODEL = """import triton_python_backend_utils as pb_utils
import pipeline  # the server runs from the project root, so models import the project
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy())])
                for r in requests]
"""


def make_repo(root: Path, model_code: str) -> Path:
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (root / "echo" / "1" / "model.py").write_text(model_code)
    return root


def shm_files(prefix: str) -> list[Path]:
    return list(Path("/dev/shm").glob(f"{prefix}*"))


def test_serves_and_cleans_up(tmp_path):
    http, grpc, metrics = free_ports(3)
    server = TritonServer(make_repo(tmp_path / "repo", ECHO_MODEL), http_port=http, grpc_port=grpc, metrics_port=metrics)
    with server:
        assert shm_files(server.shm_prefix)  # the python backend's regions carry our unique prefix
        client = httpclient.InferenceServerClient(server.http_url)
        x = httpclient.InferInput("x", [1], "BYTES")
        x.set_data_from_numpy(np.array([b"hi"], dtype=object))
        assert client.infer("echo", [x]).as_numpy("y").tolist() == [b"hi"]
    assert server.process.poll() is not None
    assert not shm_files(server.shm_prefix)
    assert "Started HTTPService" in server.log_file.read_text()


def test_a_stop_cut_short_by_ctrl_c_still_kills_the_server_and_its_stubs(tmp_path):
    """A Ctrl-C while the server unloads (a model's finalize hangs, so Triton waits its exit timeout) interrupts
    `stop`, which still kills the server's process group: no python stub is left running."""
    hanging = ECHO_MODEL + "    def finalize(self):\n        import time\n        time.sleep(300)\n"
    http, grpc, metrics = free_ports(3)
    server = TritonServer(make_repo(tmp_path / "repo", hanging), http_port=http, grpc_port=grpc, metrics_port=metrics)
    server.start()
    group = server.process.pid
    threading.Timer(2.0, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        server.stop()
    server.process.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    left = os.popen(f"ps -o pid,cmd -g {group}").read()
    os.killpg(group, signal.SIGKILL)
    pytest.fail(f"processes left in the server's group: {left}")


def test_model_that_cannot_load_fails_fast_with_the_log(tmp_path):
    http, grpc, metrics = free_ports(3)
    server = TritonServer(make_repo(tmp_path / "repo", "raise ImportError('no such thing')\n"), http_port=http,
                          grpc_port=grpc, metrics_port=metrics, startup_timeout_s=120)
    with pytest.raises(ServerError, match="failed to load 'echo'"):
        server.start()
    assert server.process.poll() is not None
    assert not shm_files(server.shm_prefix)


def test_busy_port_is_refused(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        grpc, metrics = free_ports(2)
        server = TritonServer(make_repo(tmp_path / "repo", ECHO_MODEL), http_port=port, grpc_port=grpc, metrics_port=metrics)
        with pytest.raises(ServerError, match=f"http_port {port} .* already in use"):
            server.start()


def test_missing_repository_is_refused(tmp_path):
    with pytest.raises(ServerError, match="make repo"):
        TritonServer(tmp_path / "nope").start()


ENV_MODEL = """import os
import numpy as np
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        weights = np.ones(64 << 20, dtype=np.uint8)  # a 64 MB heap allocation, touched
        huge = [line for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:")][0]
        answer = f"{os.environ.get('GLIBC_TUNABLES')}|{os.environ.get('OMP_WAIT_POLICY')}|{huge.split()[1]}|{weights.sum()}"
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", np.array([answer.encode()], dtype=object))])
                for r in requests]
"""


def thp_mode() -> str:
    """The bracketed choice of /sys/kernel/mm/transparent_hugepage/enabled ("never" if absent)."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else "[never]"
    return text[text.index("[") + 1:text.index("]")]


def model_process_environment(tmp_path: Path) -> list[str]:
    """GLIBC_TUNABLES, OMP_WAIT_POLICY, kB on huge pages, bytes summed: as a python model on a fresh server sees them."""
    http, grpc, metrics = free_ports(3)
    with TritonServer(make_repo(tmp_path / "repo", ENV_MODEL), http_port=http, grpc_port=grpc, metrics_port=metrics) as server:
        x = httpclient.InferInput("x", [1], "BYTES")
        x.set_data_from_numpy(np.array([b"?"], dtype=object))
        return httpclient.InferenceServerClient(server.http_url).infer("echo", [x]).as_numpy("y")[0].decode().split("|")


def test_model_processes_get_passive_openmp_and_huge_page_malloc(tmp_path, monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)  # the server's default, not the caller's (make exports it)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    tunables, omp, huge_kb, total = model_process_environment(tmp_path)
    assert (tunables, omp, int(total)) == ("glibc.malloc.hugetlb=1", "PASSIVE", 64 << 20)
    if thp_mode() in ("madvise", "always"):  # the kernel backs the model's heap with 2 MB pages
        assert int(huge_kb) >= 32 << 10, f"only {huge_kb} kB of the model process's memory is on huge pages"


def test_a_callers_malloc_tunables_win(tmp_path, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    assert model_process_environment(tmp_path)[0] == "glibc.malloc.hugetlb=0"
