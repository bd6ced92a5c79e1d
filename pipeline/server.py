"""Launch the real Triton 2.51 server bundled in the nvidia-pytriton wheel on a model repository.

The wheel ships `pytriton/tritonserver/bin/tritonserver`, the python backend and one backend stub
per Python version. We start that binary ourselves (no PyTriton): a backend directory made of
symlinks (the stub finds its libraries relative to its real path), the virtualenv's bin first on
PATH (models import what `python3` sees), the interpreter's lib dir on LD_LIBRARY_PATH, --disable-auto-complete-config, and a unique shared-memory prefix
that is removed after stop. A stub that cannot start leaves the server "loading" forever, so
startup has a deadline and scans the log.

    with TritonServer(repo, http_port=8000) as server:
        print(server.http_url)        # "127.0.0.1:8000"

or from the shell: `python -m pipeline serve SPEC`. On SIGTERM that command drains first
(pipeline.lifecycle.drain: readiness false, new requests refused, in-flight ones finish within
serving.drain_timeout_s, the rest end with an explicit error), then stops Triton and exits 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pipeline.cliargs import add_spec_arguments, spec_from_args
from pipeline.lifecycle import Endpoints, http_get
from pipeline.serving import heartbeat
from pipeline.serving.drain import DRAIN_ENV, SERVING, drain_path, write_state

# The stub ignores PYTHONPATH but puts its working directory on sys.path: models import `pipeline`
# because the server runs from the project root.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
PY_TAG = f"{sys.version_info.major}.{sys.version_info.minor}"
# Log lines that mean the server will never become ready.
FATAL_LOG_MARKERS = ("failed to load", "error: creating server", "failed to start", "Unable to find")


class ServerError(RuntimeError):
    """The server could not start or stopped unexpectedly; the message carries the log tail."""


def tritonserver_root() -> Path:
    """The tritonserver tree inside the installed nvidia-pytriton wheel."""
    import pytriton

    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise ServerError(f"{root}/bin/tritonserver is missing; fix: pip install nvidia-pytriton==0.7.0")
    return root


def make_backend_dir(dest: Path) -> Path:
    """Build a backend directory for the python backend out of symlinks into the wheel; returns it."""
    root = tritonserver_root()
    stub = root / "python_backend_stubs" / PY_TAG / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"no python backend stub for Python {PY_TAG} in {root}; fix: use Python 3.8-3.13")
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    links = {
        "libtriton_python.so": root / "backends" / "python" / "libtriton_python.so",
        "triton_python_backend_utils.py": root / "backends" / "python" / "triton_python_backend_utils.py",
        "triton_python_backend_stub": stub,
    }
    for name, target in links.items():
        link = python_dir / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return dest


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on host:port (we can bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(count: int = 3, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that are free right now (for tests and side-by-side servers)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


HUGEPAGE_TUNABLES = "glibc.malloc.hugetlb=1"


def server_env(drain_file: Path) -> dict[str, str]:
    """Environment for the server: this interpreter's bin first on PATH, its lib dir on LD_LIBRARY_PATH, passive
    OpenMP, huge-page malloc, and the drain state file the text models read (pipeline.serving.drain)."""
    env = dict(os.environ)
    env[DRAIN_ENV] = str(drain_file)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    # Each python model is its own process with its own OpenMP pool; spinning idle OpenMP threads steal
    # the cores from the process that works (measured: a SmolLM2 decode 5-6x slower on 2 busy cores).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # glibc >= 2.35 madvises malloc's heap for transparent huge pages (THP is "madvise" on common hosts):
    # fewer TLB misses while a decode step streams the weights (measured +10-15% plain tok/s through
    # Triton, docs/benchmarks.md); older glibc ignores the unknown tunable. A caller's own setting wins.
    env.setdefault("GLIBC_TUNABLES", HUGEPAGE_TUNABLES)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [libdir, env.get("LD_LIBRARY_PATH", "")] if p)
    return env


@dataclass
class TritonServer:
    """One tritonserver process on `model_repository`; a context manager (start on enter, stop on exit)."""

    model_repository: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_file: Path | None = None  # default: <workdir>/tritonserver.log
    startup_timeout_s: float = 180.0
    log_verbose: int = 0
    drain_file: Path | None = None  # default: pipeline.serving.drain.drain_path(http_port)

    def __post_init__(self):
        self.model_repository = Path(self.model_repository).resolve()
        self.drain_file = Path(self.drain_file) if self.drain_file else drain_path(self.http_port)
        self.shm_prefix = f"specdeploy_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self.workdir = Path(tempfile.mkdtemp(prefix="specdeploy-triton-"))
        self.log_file = Path(self.log_file) if self.log_file else self.workdir / "tritonserver.log"
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        """host:port for tritonclient.http."""
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """host:port for tritonclient.grpc."""
        return f"{self.host}:{self.grpc_port}"

    def endpoints(self, draft_failure: str = "restart") -> Endpoints:
        """This server's Endpoints (pipeline.lifecycle: health checks, drain); draft_failure: its spec's
        serving.draft_failure."""
        return Endpoints(self.http_url, self.metrics_url, self.model_repository, self.drain_file, draft_failure)

    @property
    def metrics_url(self) -> str:
        """The Prometheus endpoint."""
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        """The tritonserver command line."""
        backend_dir = make_backend_dir(self.workdir / "backends")
        return [
            str(tritonserver_root() / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_dir}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--disable-auto-complete-config",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            f"--log-verbose={self.log_verbose}",
            "--exit-on-error=true",
            "--exit-timeout-secs=30",  # python stubs unload slowly on a busy 2-core machine
        ]

    def start(self) -> "TritonServer":
        """Start the server and wait until every model is ready and the metrics endpoint answers (Triton starts it
        after HTTP and gRPC: a test read it in that gap and got "connection refused"); raises ServerError with the
        log tail."""
        if not self.model_repository.is_dir():
            raise ServerError(f"model repository {self.model_repository} does not exist; fix: run `make repo` first")
        for name in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, name)
            if not port_is_free(self.host, port):
                raise ServerError(f"{name} {port} on {self.host} is already in use; fix: stop the other server "
                                  f"or pick another port (serving.{name} in the spec)")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        write_state(self.drain_file, SERVING)  # a state left by an earlier server on this port would refuse every request
        log = open(self.log_file, "wb")
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=server_env(self.drain_file),
                                        cwd=PROJECT_ROOT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._cleanup_shm()
                reason = self._fatal_log_line() or f"exited with code {self.process.returncode}"
                raise ServerError(f"tritonserver failed: {reason}\n{self.log_tail()}")
            fatal = self._fatal_log_line()
            if fatal:
                self.stop()
                raise ServerError(f"tritonserver failed: {fatal}\n{self.log_tail()}")
            if self.is_ready() and self.metrics_up() and self.process.poll() is None:
                return self
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"tritonserver not ready after {self.startup_timeout_s:.0f} s\n{self.log_tail()}")

    def is_ready(self) -> bool:
        """True when /v2/health/ready answers 200 (all models loaded)."""
        return http_get(f"http://{self.http_url}/v2/health/ready")[0] == 200

    def metrics_up(self) -> bool:
        """True when the Prometheus endpoint answers 200."""
        return http_get(self.metrics_url)[0] == 200

    def stop(self) -> None:
        """Stop the server (SIGINT, then SIGKILL after a grace period), then any python stub it left running, and
        remove its shared memory.

        Triton gives its models `--exit-timeout-secs` to unload and then exits "immediately", and a stub may live on:
        two `tensorrt_llm` stubs whose first forward was building a kernel when their servers stopped (the failing
        dead-draft test, 2026-12-04) were still running, orphaned, two hours later. The stubs share the server's
        process group, which the server leads (start_new_session), so whatever is left in the group once the server
        has exited is killed. (A stub stopped with SIGSTOP did not reproduce it: Triton killed that one itself.) That
        happens also where the wait is cut short, by a Ctrl-C while the server unloads: the drain test's SIGINT after
        its SIGTERM (2026-12-07) left an ensemble stub running.
        """
        if self.process is None:
            return
        try:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGINT)
                try:
                    self.process.wait(timeout=45)
                except subprocess.TimeoutExpired:
                    os.killpg(self.process.pid, signal.SIGKILL)
                    self.process.wait(timeout=10)
        finally:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # stubs left behind, if any
            except ProcessLookupError:
                pass  # the group is empty: every stub exited with the server
            self._cleanup_shm()

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server log."""
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def _fatal_log_line(self) -> str | None:
        try:
            text = self.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return None
        for line in text.splitlines():
            if any(marker in line for marker in FATAL_LOG_MARKERS):
                return line.strip()
        return None

    def _cleanup_shm(self) -> None:
        for path in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            path.unlink(missing_ok=True)
        write_state(self.drain_file, SERVING)
        shutil.rmtree(heartbeat.beats_dir(self.drain_file), ignore_errors=True)
        shutil.rmtree(self.workdir / "backends", ignore_errors=True)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(server: TritonServer, drain_budget_s: float) -> None:
    """Run until Ctrl-C (stops at once) or SIGTERM (drains within `drain_budget_s`, then stops)."""
    from pipeline.lifecycle import drain

    stop = {"now": False}

    def _handle(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, _handle)
    with server:
        print(f"Triton ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}")
        print(f"log: {server.log_file}   (Ctrl-C stops; SIGTERM drains first)", flush=True)
        try:
            while not stop["now"]:
                if server.process.poll() is not None:
                    raise ServerError(f"tritonserver exited with code {server.process.returncode}\n{server.log_tail()}")
                time.sleep(0.5)
            drain(server.endpoints(), drain_budget_s, log=lambda line: print(line, flush=True))
        except KeyboardInterrupt:
            pass
    print("Triton stopped", flush=True)


def add_parser(subparsers) -> None:
    """Register `serve SPEC`."""
    p = subparsers.add_parser("serve", help="start Triton on the spec's model repository (reference toolchain)")
    add_spec_arguments(p)
    p.add_argument("--repo", type=Path, help="model repository (default: <out_dir>/model_repo)")
    p.add_argument("--log-file", type=Path)
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """`python -m pipeline serve SPEC`: start Triton on the spec's assembled repository and wait."""
    spec = spec_from_args(args)
    repo = args.repo or spec.out_dir / "model_repo"
    s = spec.serving
    server = TritonServer(repo, host=s.host, http_port=s.http_port, grpc_port=s.grpc_port,
                          metrics_port=s.metrics_port, log_file=args.log_file or spec.out_dir / "tritonserver.log",
                          drain_file=os.environ.get(DRAIN_ENV) or None)
    serve_forever(server, s.drain_timeout_s)
    return 0
