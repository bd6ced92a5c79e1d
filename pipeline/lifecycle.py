"""Health and shutdown of a running server: what readiness and liveness mean, and the drain on SIGTERM.

Triton's own /v2/health/ready cannot carry these (docs/reliability.md): in Triton 2.51 (and up to
at least 26.04) it stays 200 when a python stub died, and a server that got SIGTERM refuses the
BLS's own calls to the target, so in-flight requests fail instead of finishing. Hence:

- `check(...)` (CLI `python -m pipeline health SPEC [--live]`, the Deployment's exec probes) says
  why the server is not ready / not live, or nothing when it is:
  live   = Triton answers /v2/health/live, every python model's stub is running and none of the text models'
           stubs is frozen (its heartbeat silent for STALE_S seconds: pipeline.serving.heartbeat), and the BLS
           reports every model it calls as up; a dead draft does not count with serving.draft_failure=degraded;
  ready  = live, Triton ready, and no drain started.
- `drain(...)` (run by `pipeline serve` on SIGTERM, and by `python -m pipeline drain SPEC` as the
  Deployment's preStop hook): readiness false, then after `unready_delay_s` new requests are refused,
  the ones in flight get `budget_s` to finish, the rest end with an explicit error; then Triton can
  stop with nothing in flight.
"""

from __future__ import annotations

import argparse
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pipeline.names import BLS_MODEL, DRAFT_MODEL, IN_FLIGHT_METRIC, MODEL_UP_METRIC
from pipeline.serving import heartbeat
from pipeline.serving.drain import ABORTING, DRAINING, SERVING, UNREADY, drain_path, read_state, write_state

STUB = "triton_python_backend_stub"
ABORT_WAIT_S = 10.0  # after the budget: how long aborted requests get to send their error


@dataclass(frozen=True)
class Endpoints:
    """Where one server answers, and the files that identify its processes."""

    http_url: str  # host:port
    metrics_url: str  # http://host:port/metrics
    repo: Path  # its model repository (the stubs' command lines name their model.py in it)
    drain_file: Path
    draft_failure: str = "restart"  # serving.draft_failure
    stale_s: float = heartbeat.STALE_S  # a text model's stub silent for longer is frozen


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """(HTTP status, body) of a GET of `url`; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, ""


def expected_stubs(repo: Path) -> Counter:
    """model -> number of python stub processes its config.pbtxt asks for.

    Reads the text format our repository writes (pipeline.repo.config) with a pattern, not the
    protobuf schema: the probe also runs in NVIDIA's trtllm image, which may lack tritonclient.
    """
    want: Counter = Counter()
    for cfg_path in sorted(Path(repo).glob("*/config.pbtxt")):
        text = cfg_path.read_text()
        if re.search(r'^backend: "python"$', text, re.M):
            counts = [int(n) for n in re.findall(r"^instance_group \{\s*count: (\d+)", text, re.M)]
            want[cfg_path.parent.name] = sum(counts) or 1
    return want


def stub_pids(repo: Path) -> dict[str, list[int]]:
    """model -> pids of the live (not zombie) python stub processes serving `repo`, from /proc."""
    prefix = str(Path(repo).resolve()) + "/"
    found: dict[str, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if not argv[0].endswith(STUB.encode()) or len(argv) < 2:
                continue
            model_py = argv[1].decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError, UnicodeDecodeError):
            continue  # the process ended while we looked
        if model_py.startswith(prefix) and state != "Z":
            found.setdefault(Path(model_py).parent.parent.name, []).append(int(proc.name))
    return found


def models_down(metrics_text: str) -> set[str]:
    """Models a BLS reports down (spec_decode_model_up{callee=...} 0)."""
    pattern = MODEL_UP_METRIC + r'\{[^}]*callee="([^"]+)"[^}]*\} (\S+)'
    return {callee for callee, value in re.findall(pattern, metrics_text) if float(value) == 0}


def in_flight(metrics_url: str) -> int:
    """Requests the text models (BLS, ensemble) are serving now; 0 when the server does not answer."""
    status, text = http_get(metrics_url)
    if status != 200:
        return 0
    return int(sum(float(v) for v in re.findall(IN_FLIGHT_METRIC + r"\{[^}]*\} (\S+)", text)))


def check(ep: Endpoints, live_only: bool = False) -> list[str]:
    """Why the server is not live (live_only) or not ready; an empty list means it is."""
    reasons = []
    tolerated = {DRAFT_MODEL} if ep.draft_failure == "degraded" else set()
    status, _ = http_get(f"http://{ep.http_url}/v2/health/live")
    if status != 200:
        return [f"Triton does not answer /v2/health/live at {ep.http_url}"]
    have = stub_pids(ep.repo)
    for model, count in sorted(expected_stubs(ep.repo).items()):
        if len(have.get(model, [])) < count and model not in tolerated:
            reasons.append(f"the python stub of {model} is not running ({len(have.get(model, []))} of {count})")
    for model, pids in sorted(have.items()):
        for pid in pids:
            silent = heartbeat.silent_for(ep.drain_file, model, pid)
            if silent is not None and silent > ep.stale_s and model not in tolerated:
                reasons.append(f"the python stub of {model} (pid {pid}) has not beaten for {silent:.0f} s: frozen, or "
                               f"a response send stuck (`kill -USR1 {pid}` writes its threads' stacks to the server "
                               "log)")
    status, text = http_get(ep.metrics_url)
    for model in sorted(models_down(text) - tolerated):
        reasons.append(f"{BLS_MODEL} reports {model} down")
    if live_only:
        return reasons
    state = read_state(ep.drain_file)
    if state != SERVING:
        reasons.append(f"shutting down ({state})")
    status, _ = http_get(f"http://{ep.http_url}/v2/health/ready")
    if status != 200:
        reasons.append("Triton is not ready (/v2/health/ready)")
    return reasons


def drain(ep: Endpoints, budget_s: float, unready_delay_s: float = 0.0, log=print) -> int:
    """Drain the server (see the module docstring); returns how many requests had to be aborted."""
    write_state(ep.drain_file, UNREADY)
    log(f"draining: readiness is false{f', new requests are refused in {unready_delay_s:g} s' if unready_delay_s else ''}")
    time.sleep(unready_delay_s)
    write_state(ep.drain_file, DRAINING)
    time.sleep(0.5)  # the models read the state at most 0.2 s late: later admissions are counted below
    deadline = time.monotonic() + budget_s
    left = in_flight(ep.metrics_url)
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = in_flight(ep.metrics_url)
    if not left:
        log("drained: no request in flight")
        return 0
    log(f"drain budget of {budget_s:g} s spent: ending {left} request(s) with an error")
    write_state(ep.drain_file, ABORTING)
    deadline = time.monotonic() + ABORT_WAIT_S
    while in_flight(ep.metrics_url) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


def endpoints(spec, repo: Path | None = None) -> Endpoints:
    """The Endpoints of the server that `pipeline serve SPEC` (or the Deployment) runs."""
    import os

    from pipeline.serving.drain import DRAIN_ENV

    s = spec.serving
    host = "127.0.0.1" if s.host in ("0.0.0.0", "") else s.host
    drain_file = Path(os.environ.get(DRAIN_ENV) or drain_path(s.http_port))
    return Endpoints(http_url=f"{host}:{s.http_port}", metrics_url=f"http://{host}:{s.metrics_port}/metrics",
                     repo=Path(repo or spec.out_dir / "model_repo"), drain_file=drain_file,
                     draft_failure=s.draft_failure)


def add_parser(subparsers) -> None:
    """Register `health SPEC` and `drain SPEC`."""
    from pipeline.cliargs import add_spec_arguments

    p = subparsers.add_parser("health", help="exit 0 when the running server is ready (--live: alive); else say why")
    add_spec_arguments(p)
    p.add_argument("--repo", type=Path, help="model repository (default: <out_dir>/model_repo)")
    p.add_argument("--live", action="store_true", help="liveness only (stubs and models up), not readiness")
    p.set_defaults(func=run_health)
    p = subparsers.add_parser("drain", help="drain the running server (the Deployment's preStop hook)")
    add_spec_arguments(p)
    p.add_argument("--repo", type=Path, help="model repository (default: <out_dir>/model_repo)")
    p.add_argument("--unready-delay", type=float, default=0.0,
                   help="seconds between readiness going false and refusing new requests (endpoint removal)")
    p.set_defaults(func=run_drain)


def run_health(args: argparse.Namespace) -> int:
    """`python -m pipeline health SPEC`: 0 when ready (or live), 1 with one line per reason."""
    from pipeline.cliargs import spec_from_args

    reasons = check(endpoints(spec_from_args(args, check_paths=False), args.repo), live_only=args.live)
    for reason in reasons:
        print(f"not {'live' if args.live else 'ready'}: {reason}")
    return 1 if reasons else 0


def run_drain(args: argparse.Namespace) -> int:
    """`python -m pipeline drain SPEC`: drain within serving.drain_timeout_s."""
    from pipeline.cliargs import spec_from_args

    spec = spec_from_args(args, check_paths=False)
    drain(endpoints(spec, args.repo), spec.serving.drain_timeout_s, args.unready_delay)
    return 0
