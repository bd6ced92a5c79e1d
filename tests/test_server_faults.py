"""Serving under faults, against real Triton servers (docs/reliability.md): clients that leave, bad
numbers, a SIGKILLed draft stub, and SIGTERM during streams.

Cancellation and bad input use the session server (`triton_server`); the dead draft and the drain
each get their own server, since they end it.
"""

import asyncio
import dataclasses
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from clients.client import AsyncTritonClient, ClientError, GenerateRequest, SamplingParams, TritonClient
from pipeline.lifecycle import Endpoints, check, stub_pids
from pipeline.limits import PLAIN_CHUNK_TOKENS
from pipeline.names import METRICS_FLUSH_S
from pipeline.serving import heartbeat
from pipeline.serving.drain import DRAIN_ENV, DRAINING, read_state
from tests.test_server_triton import prompts
from tests.triton_fixtures import MAX_DRAFT_LEN, serving, write_spec

LONG = 200  # tokens: far more than one plain chunk or one round, so a leak of work shows
K = 3
STALL_S = 4.0  # serving.stall_timeout_s of the dead-draft server
DRAIN_S = 6.0  # serving.drain_timeout_s of the drained server
DRAIN_LONG = 900  # tokens: takes far longer than DRAIN_S (the drained server's engines allow 1024)
FROZEN_S = 3.0  # the stale bound the frozen-stub check runs with (the Deployment's: heartbeat.STALE_S)
# What Triton 2.51's server log shows when a killed stub held the python backend's interprocess mutex and the whole
# server aborted (triton-inference-server/server#8882, open; docs/reliability.md)
UPSTREAM_STUB_ABORT = "boost::interprocess::lock_exception"


def engine_steps(metrics_url: str) -> dict[str, float]:
    """reference_engine_steps_total per engine model."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return {m: float(v) for m, v in re.findall(r'reference_engine_steps_total\{model="(\w+)"\} (\S+)', text)}


def settled_steps(metrics_url: str, quiet_s: float = 1.0, limit_s: float = 30.0) -> dict[str, float]:
    """The engine step counters once they stopped moving for `quiet_s` (more than METRICS_FLUSH_S, within which
    a working engine sends them: then the engines are idle and their counters exact)."""
    assert quiet_s > METRICS_FLUSH_S
    last, since, deadline = engine_steps(metrics_url), time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = engine_steps(metrics_url)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def request(prompt: str, max_tokens: int, k: int, **sampling) -> GenerateRequest:
    return GenerateRequest(prompt=prompt, max_tokens=max_tokens, num_draft_tokens=k,
                           sampling=SamplingParams(**{"temperature": 0.0, **sampling}))


def leave_after_three(url: str, req: GenerateRequest, protocol: str = "grpc", model: str = "ensemble") -> None:
    """Stream `req` and leave after its third response: the gRPC call is cancelled / the HTTP connection closed."""
    with TritonClient(url, protocol=protocol, model=model, timeout_s=60) as client:  # closed even if the stream fails
        stream = client.stream(req)
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("k", [0, K])
def test_a_client_that_leaves_stops_engine_work(triton_server, model, protocol, k):
    """gRPC stream cancel / HTTP generate_stream disconnect: the engines stop within about one plain chunk (k=0) or
    two speculative rounds of the client's leaving, counted by the engines' own step counters from idle to idle
    (they are sent while an engine works at most every METRICS_FLUSH_S, and whenever it goes idle)."""
    url = triton_server.grpc_url if protocol == "grpc" else triton_server.http_url
    before = settled_steps(triton_server.metrics_url)
    leave_after_three(url, request(prompts(1)[0], LONG, k), protocol, model)
    after = settled_steps(triton_server.metrics_url)
    target = after["tensorrt_llm"] - before["tensorrt_llm"]
    draft = after.get("tensorrt_llm_draft", 0) - before.get("tensorrt_llm_draft", 0)
    # The chunk under way when the third response arrived and one more finish (or the rounds of the responses read,
    # the one in flight and one that started before the cancel arrived); the other ~170 tokens are never generated.
    assert target <= 2 * (PLAIN_CHUNK_TOKENS + 1), (target, draft)
    assert draft <= 6 * MAX_DRAFT_LEN, (target, draft)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("field,value", [("temperature", math.nan), ("temperature", math.inf),
                                         ("top_p", math.nan), ("repetition_penalty", -math.inf)])
def test_non_finite_floats_are_refused_in_one_line(triton_server, model, field, value):
    with TritonClient(triton_server.grpc_url, model=model) as client:
        with pytest.raises(ClientError) as err:
            client.generate(request(prompts(1)[0], 4, 0, **{field: value}))
    message = str(err.value)
    assert err.value.kind == "invalid_request" and "\n" not in message
    assert f"{field}: {value} is not a finite number; fix: send a finite value" in message


@pytest.mark.parametrize("field,value", [("max_tokens", 2**32 + 5), ("max_tokens", 2**40), ("top_k", 2**32 + 1),
                                         ("num_draft_tokens", 2**32 + 3), ("seed", -1)])
def test_integers_out_of_range_are_refused_before_they_wrap(triton_server, field, value):
    """2^32 + 5 in an INT32 tensor would arrive as 5 and return 200: the client refuses it instead."""
    req = request(prompts(1)[0], 4, 0)
    if field in ("max_tokens", "num_draft_tokens"):
        setattr(req, field, value)
    else:
        setattr(req.sampling, field, value)
    for protocol, url in (("grpc", triton_server.grpc_url), ("http", triton_server.http_url)):
        with TritonClient(url, protocol=protocol) as client:
            with pytest.raises(ClientError, match=rf"^{field}={value} does not fit the model's U?INT\d+ input") as err:
                client.generate(req)
        assert err.value.kind == "invalid_request"


def _fault_spec(tmp_path_factory, derived_pair, name: str, **serving_fields):
    """A draft_target spec over the derived pair with these serving fields: its plan (engines built) and path."""
    from specbuild.toolchains.reference import run_reference
    from pipeline.spec import load_spec

    folder = tmp_path_factory.mktemp(name)
    spec_path = write_spec(folder, *derived_pair, serving=serving_fields,
                           engine={"max_batch_size": 8, "max_input_len": 128, "max_seq_len": 1024, "max_num_tokens": 1024})
    return run_reference(load_spec(spec_path)), spec_path


def _run_streams(client_url: str, requests: list[GenerateRequest], results: list, started: threading.Barrier | None):
    """Stream each request on its own thread: results[i] = ("ok", text, num_output_tokens) or ("err", message,
    text so far). Each thread waits at `started` after its first response."""
    def one(i, req):
        text, stats = "", {}
        try:
            with TritonClient(client_url, timeout_s=120) as client:
                for n, delta in enumerate(client.stream(req)):
                    text += delta.text
                    stats.update(delta.stats)
                    if n == 0 and started is not None:
                        started.wait(timeout=60)
            results[i] = ("ok", text, int(stats.get("num_output_tokens", -1)))
        except ClientError as exc:
            results[i] = ("err", str(exc), text)

    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    return threads


def stub_stacks(repo: Path, log_file: Path, lines: int = 300) -> str:
    """The server log's tail after every python stub of `repo` wrote its threads' stacks there (SIGUSR1,
    triton_io.enable_fault_dumps): what a failed fault test shows of a stuck stub."""
    for pids in stub_pids(repo).values():
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
    time.sleep(1.0)
    return "\n".join(log_file.read_text(errors="replace").splitlines()[-lines:])


def assert_a_frozen_stub_is_not_live(ep: Endpoints) -> None:
    """A stub whose interpreter stops (SIGSTOP here; Triton 2.51's stub deadlock in production, pipeline.serving.
    heartbeat) fails liveness once silent for the stale bound, and passes again once it runs."""
    [pid] = stub_pids(ep.repo)["tensorrt_llm_bls"]
    ep = dataclasses.replace(ep, stale_s=FROZEN_S)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(FROZEN_S + 2 * heartbeat.BEAT_S)
        reported = [r for r in check(ep, live_only=True) if "tensorrt_llm_bls" in r]
        assert len(reported) == 1 and re.fullmatch(
            rf"the python stub of tensorrt_llm_bls \(pid {pid}\) has not beaten for \d+ s: frozen, or a response send "
            rf"stuck \(`kill -USR1 {pid}` writes its threads' stacks to the server log\)", reported[0]), reported
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while any("tensorrt_llm_bls" in r for r in check(ep, live_only=True)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any("tensorrt_llm_bls" in r for r in check(ep, live_only=True))


def test_dead_draft_every_request_answers_and_health_says_so(tmp_path_factory, derived_pair, monkeypatch):
    """SIGKILL of the draft's stub during 6 streams: each finishes (falling back to the target, same
    greedy text) within the stall bound, later requests fall back at once, the BLS's metric and log
    say so, and readiness/liveness fail unless serving.draft_failure is degraded.

    The server starts with no C++ kernel built (a folder of its own): the builds run while the models load,
    so a ready server answers its first requests within the stall bound (they ran in the first forward,
    25-40 s, and the first request failed with "no response for 4 s")."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path_factory.mktemp("kernels")))
    plan, _ = _fault_spec(tmp_path_factory, derived_pair, "dead-draft", stall_timeout_s=STALL_S)
    texts = prompts(6)
    with serving(plan) as (server, repo):
        ep = server.endpoints("restart")
        assert check(ep) == []
        assert_a_frozen_stub_is_not_live(ep)
        with TritonClient(server.grpc_url) as client:
            expected = [client.generate(request(p, LONG, 0)).text for p in texts]
        results: list = [None] * len(texts)
        started = threading.Barrier(len(texts) + 1)
        threads = _run_streams(server.grpc_url, [request(p, LONG, K) for p in texts], results, started)
        started.wait(timeout=60)  # every stream has its first tokens
        [draft_pid] = stub_pids(repo)["tensorrt_llm_draft"]
        os.kill(draft_pid, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(timeout=STALL_S + 60)
        assert time.monotonic() - killed < STALL_S + 60, (results, server.log_tail(30))
        if UPSTREAM_STUB_ABORT in server.log_file.read_text(errors="replace"):
            # every stream still ended explicitly: plain's whole text, or the transport's error (never a short text)
            assert all(r[:2] == ("ok", e) or r[0] == "err" for r, e in zip(results, expected)), results
            pytest.xfail("tritonserver aborted on the killed stub's interprocess lock (upstream #8882, "
                         "docs/reliability.md): the fallback was not exercised this time")
        assert [r[:2] for r in results] == [("ok", e) for e in expected]
        # Later requests fall back at once (no call to the dead stub), with the same text.
        with TritonClient(server.grpc_url) as client:
            assert client.generate(request(texts[0], LONG, K)).text == expected[0]
        metrics = urllib.request.urlopen(server.metrics_url).read().decode()
        assert re.search(r'spec_decode_model_up\{callee="tensorrt_llm_draft",model="ensemble"\} 0', metrics)
        assert "draft model tensorrt_llm_draft is down" in server.log_file.read_text()
        assert any("tensorrt_llm_draft" in r for r in check(ep, live_only=True))
        assert any("tensorrt_llm_draft" in r for r in check(ep))
        degraded = server.endpoints("degraded")
        assert check(degraded) == []


def test_sigterm_drains_then_exits_0(tmp_path_factory, derived_pair):
    """SIGTERM to `python -m pipeline serve` during 8 streams: readiness false at once, a new request is
    refused with a clear error, short requests finish, ones longer than the drain budget end with an
    explicit error (never a short final), and the process exits 0 within the budget."""
    from pipeline.repo.assemble import assemble
    from pipeline.server import free_ports

    http, grpc_port, metrics = free_ports(3)
    plan, spec_path = _fault_spec(tmp_path_factory, derived_pair, "drain", drain_timeout_s=DRAIN_S,
                                  http_port=http, grpc_port=grpc_port, metrics_port=metrics)
    repo = assemble(plan)
    drain_file = plan.spec.out_dir / "drain-state"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(spec_path)],
                            env={**os.environ, DRAIN_ENV: str(drain_file)}, cwd=Path(__file__).resolve().parent.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ep = Endpoints(f"127.0.0.1:{http}", f"http://127.0.0.1:{metrics}/metrics", repo, drain_file)
        deadline = time.monotonic() + 300
        while check(ep) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        url = f"127.0.0.1:{grpc_port}"
        texts = prompts(8)
        short = [request(p, 40, 0) for p in texts[:4]]
        with TritonClient(url) as client:
            expected = [client.generate(r).text for r in short]
        results: list = [None] * 8
        long = [request(p, DRAIN_LONG, K, min_tokens=DRAIN_LONG) for p in texts[4:]]  # no early end_id
        threads = _run_streams(url, short + long, results, None)
        time.sleep(0.3)  # every request is admitted
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while read_state(drain_file) != DRAINING and time.monotonic() < sent + 10:
            time.sleep(0.05)
        time.sleep(0.5)  # the models read the state at most 0.2 s late
        assert any("shutting down" in r for r in check(ep))
        with TritonClient(url) as client:
            with pytest.raises(ClientError) as refused:
                client.generate(request(texts[0], 4, 0))
        assert "shutting down and takes no new requests" in str(refused.value), (
            str(refused.value), check(dataclasses.replace(ep, stale_s=5.0), live_only=True),
            stub_stacks(repo, plan.spec.out_dir / "tritonserver.log"))
        for t in threads:
            t.join(timeout=120)
        code = proc.wait(timeout=DRAIN_S + 90)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:  # Ctrl-C stops `pipeline serve` and its tritonserver (SIGKILL would orphan it)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
    assert code == 0
    assert elapsed < DRAIN_S + 60
    assert [r[:2] for r in results[:4]] == [("ok", e) for e in expected]  # finished within the budget
    for result in results[4:]:  # far longer than the budget: an explicit error, never a short final
        assert result[0] == "err" and "the server shut down before this request finished" in result[1], result


def test_a_server_stops_within_seconds_after_concurrent_streams(tmp_path_factory, derived_pair):
    """Our clients let a finished gRPC stream end instead of cancelling it: a cancel right after the final response
    left Triton 2.51 holding the ensemble model, and the server's next stop waited its whole exit timeout (30 s).
    Streams that clients leave mid-way (gRPC cancel, HTTP disconnect) leave nothing held either: a BLS that stopped
    the target's call with NVIDIA's stop request as soon as an HTTP client left did (docs/reliability.md)."""
    plan, _ = _fault_spec(tmp_path_factory, derived_pair, "prompt-stop")
    texts = prompts(4)
    with serving(plan) as (server, _repo):
        async def async_streams():
            async with AsyncTritonClient(server.grpc_url) as client:
                return await asyncio.gather(*(client.stream_completion(request(p, 40, K)) for p in texts))

        assert all(c.text for c in asyncio.run(async_streams()))
        results: list = [None] * len(texts)
        for t in _run_streams(server.grpc_url, [request(p, 40, 0) for p in texts], results, None):
            t.join(timeout=120)
        assert [r[0] for r in results] == ["ok"] * len(texts), results
        for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
            for _ in range(2):
                leave_after_three(url, request(texts[0], LONG, 0), protocol)
        start = time.monotonic()
        server.stop()
        stopped = time.monotonic() - start
        log = server.log_file.read_text(errors="replace")
    assert "Exit timeout expired" not in log and stopped < 20, (stopped, server.log_tail(20))
