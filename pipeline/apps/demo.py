"""`make demo`: models -> engines -> model repository -> Triton -> a few streamed requests, plain and speculative.

Runs the spec's reference engines on the real Triton server, streams each answer to the terminal
twice (num_draft_tokens 0, then the spec's K), prints acceptance and the measured speedup, and
stops the server. The prompts are grounded (the answer copies from the prompt), the case where
prompt-lookup speculation pays.
"""

from __future__ import annotations

import argparse
import sys
import time

from clients.client import Completion, GenerateRequest, TritonClient
from pipeline.cliargs import add_spec_arguments, spec_from_args
from pipeline.modes import traits
from pipeline.names import BLS_MODEL
from pipeline.spec import SpecError

DEMO_PROMPTS = [
    "Correct the spelling in this sentence and write it out again: \"The quikc brown fox jumpd over the lazzy dog "
    "that was sleeping near the river bank, and then it ran bak into the forrest.\"",
    "Here is a list of fruits: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango. "
    "Write the same list again, one fruit per line, numbered.",
]
MAX_TOKENS = 96


def chat_prompt(tokenizer, question: str) -> str:
    """The prompt text with the model's chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
    return question


def stream_once(grpc_url: str, prompt: str, num_draft_tokens: int, echo: bool) -> Completion:
    """Stream one request to tensorrt_llm_bls, echoing the text as it arrives; returns its Completion."""
    request = GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, num_draft_tokens=num_draft_tokens, request_id="demo")
    with TritonClient(grpc_url, protocol="grpc", model=BLS_MODEL, timeout_s=600) as client:
        start, deltas = time.perf_counter(), []
        for delta in client.stream(request):
            deltas.append(delta)
            if echo and delta.text:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        return Completion.from_deltas(request, deltas, time.perf_counter() - start)


def describe(run: Completion) -> str:
    """One line of numbers for a run."""
    tokens = run.num_output_tokens or 0
    line = (f"{tokens} tokens in {run.latency_s:.2f} s ({tokens / run.latency_s:.1f} tok/s, "
            f"first text after {run.ttft_s:.2f} s)")
    if run.total_draft_tokens:
        line += (f"; accepted {run.total_accepted_draft_tokens}/{run.total_draft_tokens} draft tokens "
                 f"({100 * run.acceptance_rate:.0f}%)")
    return line


def run_demo(spec, log=print) -> list[tuple[Completion, Completion]]:
    """Build what is missing, serve, stream the demo prompts plain and speculative; returns the run pairs."""
    from specbuild.toolchains.reference import run_reference
    from pipeline.repo.assemble import assemble
    from pipeline.server import TritonServer, free_ports, port_is_free
    from pipeline.serving.text import load_tokenizer

    t0 = time.perf_counter()
    repo = assemble(run_reference(spec))
    log(f"model repository: {repo} ({time.perf_counter() - t0:.0f} s so far)")
    s = spec.serving
    ports = [s.http_port, s.grpc_port, s.metrics_port]
    if not all(port_is_free(s.host, p) for p in ports):
        ports = free_ports(3, s.host)
        log(f"the spec's ports are busy; using HTTP {ports[0]}, gRPC {ports[1]}, metrics {ports[2]}")
    k = spec.speculative.num_draft_tokens
    tokenizer = load_tokenizer(str(spec.models.target.checkpoint))
    pairs = []
    with TritonServer(repo, host=s.host, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2],
                      log_file=spec.out_dir / "tritonserver.log") as server:
        log(f"Triton ready on {server.grpc_url} (gRPC), {server.http_url} (HTTP) after {time.perf_counter() - t0:.0f} s; "
            f"log {server.log_file}")
        stream_once(server.grpc_url, chat_prompt(tokenizer, "Say hello."), 0, echo=False)  # warm-up
        for question in DEMO_PROMPTS:
            prompt = chat_prompt(tokenizer, question)
            log(f"\n>>> {question}")
            runs = []
            for draft in (0, k):
                label = "plain decoding" if draft == 0 else f"speculative ({spec.speculative.mode}, K={draft})"
                log(f"--- {label}:")
                runs.append(stream_once(server.grpc_url, prompt, draft, echo=True))
                log(f"\n    [{describe(runs[-1])}]")
            plain, spec_run = runs
            log(f"    speedup {plain.latency_s / spec_run.latency_s:.2f}x; identical text: {'yes' if plain.text == spec_run.text else 'no'}")
            pairs.append((plain, spec_run))
    total_plain = sum(p.latency_s for p, _ in pairs)
    total_spec = sum(q.latency_s for _, q in pairs)
    drafted = sum(q.total_draft_tokens for _, q in pairs)
    accepted = sum(q.total_accepted_draft_tokens for _, q in pairs)
    log(f"\nsummary: acceptance {accepted}/{drafted} ({100 * accepted / max(drafted, 1):.0f}%), "
        f"speedup {total_plain / total_spec:.2f}x over {len(pairs)} prompts; demo took {time.perf_counter() - t0:.0f} s; "
        "server stopped")
    return pairs


def add_parser(subparsers) -> None:
    """Register `demo SPEC`."""
    p = subparsers.add_parser("demo", help="engines -> repository -> Triton -> streamed requests, plain vs speculative")
    add_spec_arguments(p)
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """`python -m pipeline demo SPEC`."""
    spec = spec_from_args(args)
    if not traits(spec.speculative.mode).bls_drafts:
        raise SpecError("speculative.mode", f"the demo compares BLS speculation, not {spec.speculative.mode!r}",
                        "use examples/default.yaml (ngram) or examples/draft-target.yaml")
    run_demo(spec)
    return 0
