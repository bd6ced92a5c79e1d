"""Session fixtures for tests against a real Triton server (registered in tests/conftest.py).

- `tiny_spec_engines`: a draft_target spec over the derived tiny pair (fp32, ~58% greedy acceptance),
  with reference engines built by the real pipeline (`specbuild.toolchains.reference.run_reference`).
- `triton_server`: the spec's model repository assembled by `pipeline.repo.assemble` and ONE
  tritonserver (pipeline.server.TritonServer, free ports, unique shm prefix) shared by every test
  of the session. The draft engine's config is given a short max_seq_len (DRAFT_MAX_SEQ_LEN), so a
  long request makes the draft fail mid-generation: that is how tests reach the fallback path.

Other test modules use it as:

    def test_x(triton_server):
        client = tritonclient.grpc.InferenceServerClient(triton_server.grpc_url)
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

DRAFT_MAX_SEQ_LEN = 64  # draft calls whose sequence is longer fail: exercises the BLS fallback
MAX_DRAFT_LEN = 4
NUM_DRAFT_TOKENS = 3


@dataclass
class SpecEngines:
    """A spec with built reference engines."""

    spec: object  # pipeline.spec.Spec
    plan: object  # specbuild.plan.Plan (reference)
    spec_path: Path
    target_dir: Path  # HF checkpoints (the tokenizer lives in the target's)
    draft_dir: Path


@dataclass
class TritonHandle:
    """A running server on an assembled repository."""

    server: object  # pipeline.server.TritonServer
    spec: object
    repo: Path
    target_dir: Path
    draft_dir: Path

    @property
    def http_url(self) -> str:
        return self.server.http_url

    @property
    def grpc_url(self) -> str:
        return self.server.grpc_url

    @property
    def metrics_url(self) -> str:
        return self.server.metrics_url


def write_spec(folder: Path, target: Path, draft: Path, **overrides) -> Path:
    """A draft_target reference spec YAML for the tiny pair; returns its path."""
    raw = {
        "name": "tritontest",
        "models": {"target": {"checkpoint": str(target), "dtype": "float32"},
                   "draft": {"checkpoint": str(draft), "dtype": "float32"}},
        # min_acceptance_rate 0: requests keep speculating whatever their acceptance (tests rely on it)
        "speculative": {"mode": "draft_target", "max_draft_len": MAX_DRAFT_LEN, "num_draft_tokens": NUM_DRAFT_TOKENS,
                        "min_acceptance_rate": 0.0},
        "engine": {"max_batch_size": 8, "max_input_len": 128, "max_seq_len": 256, "max_num_tokens": 1024},
        "toolchain": "reference",
        "output": {"dir": str(folder / "out"), "cache_dir": str(folder / "cache")},
    }
    for key, value in overrides.items():
        node = raw
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="session")
def tiny_spec_engines(tmp_path_factory, derived_pair) -> SpecEngines:
    """Spec + reference engines for the derived pair (built once per session)."""
    from specbuild.toolchains.reference import run_reference
    from pipeline.spec import load_spec

    folder = tmp_path_factory.mktemp("triton-spec")
    target, draft = derived_pair
    spec_path = write_spec(folder, target, draft)
    spec = load_spec(spec_path)
    plan = run_reference(spec)
    return SpecEngines(spec=spec, plan=plan, spec_path=spec_path, target_dir=Path(target), draft_dir=Path(draft))


def shorten_draft_engine(engine_link: Path, max_seq_len: int) -> None:
    """Replace the draft engine link with a copy whose build limits are shorter (same weights)."""
    source = engine_link.resolve()
    engine_link.unlink()
    shutil.copytree(source, engine_link)
    cfg_path = engine_link / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["build_config"]["max_seq_len"] = max_seq_len
    cfg["build_config"]["max_input_len"] = min(cfg["build_config"]["max_input_len"], max_seq_len - 1)
    cfg_path.write_text(json.dumps(cfg, indent=2))


@contextmanager
def serving(plan) -> Iterator[tuple[Any, Path]]:
    """Assemble the plan's reference repository and run one real Triton server on free ports: (server, repo)."""
    from pipeline.repo.assemble import assemble
    from pipeline.server import TritonServer, free_ports

    spec = plan.spec
    repo = assemble(plan)
    http, grpc, metrics = free_ports(3)
    server = TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                          log_file=spec.out_dir / "tritonserver.log", startup_timeout_s=300)
    server.start()
    try:
        yield server, repo
    finally:
        server.stop()


@pytest.fixture(scope="session")
def triton_server(tiny_spec_engines) -> TritonHandle:
    """ONE real Triton server on the assembled tiny repository, shared by the whole session."""
    spec = tiny_spec_engines.spec
    shorten_draft_engine(spec.out_dir / "engines" / "draft", DRAFT_MAX_SEQ_LEN)
    with serving(tiny_spec_engines.plan) as (server, repo):
        yield TritonHandle(server=server, spec=spec, repo=repo, target_dir=tiny_spec_engines.target_dir,
                           draft_dir=tiny_spec_engines.draft_dir)


# Seconds the shared server may take to answer the one-token request before a test that uses it
ANSWERS_WITHIN_S = 60


@pytest.fixture(autouse=True)
def triton_server_answers(request):
    """Before every test that uses the shared server: it is live (`pipeline health --live`'s check: every stub beating,
    no response send stuck) and answers a one-token request, or the session stops at once (pytest.exit, exit status
    1). Triton 2.51's python backend deadlocks now and then in a response send (docs/reliability.md, "Seen again"):
    the stuck requests never end while the server still answers a new one-token request, and every later test on it
    waited out its client's timeout, which took a CI run past its 30 minutes. Stopped at once, the run fails fast and
    CI's second run (.ci/run) starts on a fresh server."""
    if "triton_server" not in request.fixturenames:
        return
    from clients.client import ClientError, GenerateRequest, SamplingParams, TritonClient
    from pipeline.lifecycle import check

    server = request.getfixturevalue("triton_server")
    log = server.spec.out_dir / "tritonserver.log"
    reasons = check(server.server.endpoints(server.spec.serving.draft_failure), live_only=True)
    if reasons:
        pytest.exit(f"the shared Triton server is not live before {request.node.nodeid} ({'; '.join(reasons)}); "
                    f"stopping the session: a wedged server fails every later test on its timeout. Its log: {log}",
                    returncode=1)
    try:
        with TritonClient(server.grpc_url, timeout_s=ANSWERS_WITHIN_S) as client:
            client.generate(GenerateRequest("Is the server alive?", 1, SamplingParams(temperature=0.0),
                                            num_draft_tokens=0))
    except ClientError as error:
        pytest.exit(f"the shared Triton server did not answer a one-token request before {request.node.nodeid} "
                    f"({error}); stopping the session: a wedged server fails every later test on its timeout. "
                    f"Its log: {log}", returncode=1)
