"""Stress the python stubs of `ensemble` and `tensorrt_llm_bls` with concurrent BLS calls (docs/reliability.md,
"The python stub segfault and deadlock").

Builds the tests' tiny draft/target pair and its reference engines under FOLDER (kept between runs, so only
the first run builds), starts one real Triton server from this checkout's code, and sends rounds of requests
until SECONDS pass or a round fails: per round, two bursts to each of the two models, over gRPC and HTTP at
once; a burst is 4 streams (K 0-3), 2 unary calls and 2 streams its client leaves after one response.
Every finished request must return the same greedy text.

Prints one line: `RESULT ok|crash (<models> died; <error>)|hang (<error>) after S s, N rounds (R requests)`.
On a hang it writes `gdb` backtraces of every thread of the two text models' stubs to FOLDER/hang-<model>.txt.

    nice -n 10 .venv/bin/python tests/stress/stub_stress.py [SECONDS] [FOLDER]   # defaults: 90, /tmp/stub-stress
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from clients.client import AsyncTritonClient, GenerateRequest, SamplingParams  # noqa: E402
from pipeline.fixtures.toymodels import make_derived_pair  # noqa: E402
from pipeline.spec import load_spec  # noqa: E402
from specbuild.toolchains.reference import run_reference  # noqa: E402
from triton_fixtures import DRAFT_MAX_SEQ_LEN, serving, shorten_draft_engine, write_spec  # noqa: E402

PROMPT = "The class statement creates"
MAX_TOKENS = 16  # prompt + output stay under the draft's 64-token limit
MODELS = ("ensemble", "tensorrt_llm_bls", "ensemble", "tensorrt_llm_bls")
ROUND_TIMEOUT_S = 60


def request(k: int) -> GenerateRequest:
    return GenerateRequest(prompt=PROMPT, max_tokens=MAX_TOKENS, sampling=SamplingParams(temperature=0.0),
                           num_draft_tokens=k)


async def leave_after_one(client: AsyncTritonClient, k: int) -> None:
    """Stream, and leave after the first response (the server cancels the request)."""
    stream = client.stream(request(k))
    async for _ in stream:
        break
    await stream.aclose()


async def burst(url: str, protocol: str, model: str) -> list[str]:
    """One burst (see the module docstring); the finished requests' texts."""
    async with AsyncTritonClient(url, protocol, model=model) as client:
        done = await asyncio.gather(*(client.stream_completion(request(k)) for k in (0, 1, 2, 3)),
                                    client.generate(request(3)), client.generate(request(0)),
                                    leave_after_one(client, 2), leave_after_one(client, 0))
    return [d.text for d in done if d is not None]


def stub_processes(server) -> dict[int, str]:
    """pid -> model name of this server's python stubs (from /proc)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"triton_python_backend_stub") and server.shm_prefix.encode() in b" ".join(argv):
            found[int(pid)] = argv[1].decode().split("/model_repo/")[1].split("/")[0]
    return found


def engines(folder: Path):
    """The reference plan of the tiny pair under `folder` (built on the first run)."""
    if not (folder / "derived").exists():
        make_derived_pair(folder / "derived", eps=0.15)
    spec = load_spec(write_spec(folder, folder / "derived" / "target", folder / "derived" / "draft"))
    draft = spec.out_dir / "engines" / "draft"
    if draft.is_dir() and not draft.is_symlink():  # the shortened copy of an earlier run
        shutil.rmtree(draft)
    plan = run_reference(spec)
    shorten_draft_engine(draft, DRAFT_MAX_SEQ_LEN)
    return plan


def main(seconds: float, folder: Path) -> str:
    with serving(engines(folder)) as (server, _):
        stubs = stub_processes(server)
        start, rounds = time.monotonic(), 0

        async def hammer():
            nonlocal rounds
            while time.monotonic() - start < seconds:
                bursts = [burst(url, protocol, model) for model in MODELS
                          for url, protocol in ((server.grpc_url, "grpc"), (server.http_url, "http"))]
                texts = [t for b in await asyncio.wait_for(asyncio.gather(*bursts), ROUND_TIMEOUT_S) for t in b]
                if len(texts) != 12 * len(MODELS) or len(set(texts)) != 1:
                    raise RuntimeError(f"round {rounds}: {len(texts)} texts, {len(set(texts))} different")
                rounds += 1

        try:
            asyncio.run(hammer())
            result = "ok"
        except (Exception, asyncio.TimeoutError) as exc:
            alive = stub_processes(server)
            dead = sorted({name for pid, name in stubs.items() if pid not in alive})
            what = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            result = f"crash ({', '.join(dead)} died; {what})" if dead else f"hang ({what})"
            for pid, name in alive.items():
                if not dead and name in ("ensemble", "tensorrt_llm_bls"):
                    trace = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 20"],
                                           capture_output=True, text=True, timeout=300).stdout
                    (folder / f"hang-{name}.txt").write_text(trace)
        elapsed = time.monotonic() - start
        return f"RESULT {result} after {elapsed:.0f} s, {rounds} rounds ({rounds * 12 * len(MODELS)} requests)"


if __name__ == "__main__":
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 90.0
    folder = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/stub-stress")
    folder.mkdir(parents=True, exist_ok=True)
    print(main(seconds, folder), flush=True)
