"""`make demo`: models -> engines -> model repository -> Triton -> a few streamed requests, plain and speculative.

Runs the spec's reference engines on the real Triton server, streams each answer to the terminal
twice (num_draft_tokens 0, then the spec's K), prints acceptance and the measured speedup, and
stops the server. The prompts are grounded (the answer copies from the prompt), the case where
prompt-lookup speculation pays.

The speedup of a prompt is the median over `repeats` pairs of runs (plain, then speculative, back to
back; the first pair is the one streamed to the terminal): one pair on a shared 2-core machine swings
by about 0.2x, and on the AVX2 host a prompt's median of 3 pairs moved from 1.23x to 1.81x between two runs
minutes apart (docs/benchmarks.md), so 5 pairs (about 4 s more than 3). Each prompt is sent once for one token
before its pairs, so every run finds the prompt's KV blocks cached (the server reuses prefixes): otherwise the
first plain run alone paid the prompt's prefill (0.14 s of its 0.60 on a Zen3 host, where its speculative run
waited 0.02 s for its first text).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

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
REPEATS = 5  # timed pairs per prompt; the speedup is their median


@dataclass
class PromptResult:
    """One demo prompt: its plain and speculative runs, pair by pair (pairs[0] was streamed to the terminal)."""

    question: str
    pairs: list[tuple[Completion, Completion]]

    @property
    def ratios(self) -> list[float]:
        """plain latency / speculative latency of each pair."""
        return [plain.latency_s / spec.latency_s for plain, spec in self.pairs]

    @property
    def speedup(self) -> float:
        """The median ratio."""
        return statistics.median(self.ratios)

    @property
    def identical(self) -> bool:
        """Every run produced the same text."""
        return len({run.text for pair in self.pairs for run in pair}) == 1


def chat_prompt(tokenizer, question: str) -> str:
    """The prompt text with the model's chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
    return question


def stream_once(grpc_url: str, prompt: str, num_draft_tokens: int, echo: bool,
                max_tokens: int = MAX_TOKENS) -> Completion:
    """Stream one request to tensorrt_llm_bls, echoing the text as it arrives; returns its Completion."""
    request = GenerateRequest(prompt=prompt, max_tokens=max_tokens, num_draft_tokens=num_draft_tokens,
                              request_id="demo")
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


def run_demo(spec, log=print, repeats: int = REPEATS) -> list[PromptResult]:
    """Build what is missing, serve, stream the demo prompts plain and speculative, time `repeats` pairs each."""
    from specbuild.toolchains.reference import run_reference
    from pipeline.repo.assemble import assemble
    from pipeline.server import TritonServer, free_ports, port_is_free
    from pipeline.serving.text import load_tokenizer

    if repeats < 1:
        raise ValueError(f"repeats={repeats}: time at least one pair per prompt")
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
    results = []
    with TritonServer(repo, host=s.host, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2],
                      log_file=spec.out_dir / "tritonserver.log") as server:
        log(f"Triton ready on {server.grpc_url} (gRPC), {server.http_url} (HTTP) after {time.perf_counter() - t0:.0f} s; "
            f"log {server.log_file}")
        for question in DEMO_PROMPTS:
            prompt = chat_prompt(tokenizer, question)
            stream_once(server.grpc_url, prompt, 0, echo=False, max_tokens=1)  # the prompt's KV cached for every run
            log(f"\n>>> {question}")
            shown = []
            for draft in (0, k):
                label = "plain decoding" if draft == 0 else f"speculative ({spec.speculative.mode}, K={draft})"
                log(f"--- {label}:")
                shown.append(stream_once(server.grpc_url, prompt, draft, echo=True))
                log(f"\n    [{describe(shown[-1])}]")
            result = PromptResult(question, [tuple(shown)])
            for _ in range(repeats - 1):
                result.pairs.append(tuple(stream_once(server.grpc_url, prompt, draft, echo=False) for draft in (0, k)))
            ratios = ", ".join(f"{r:.2f}" for r in result.ratios)
            log(f"    speedup {result.speedup:.2f}x (median of {len(result.pairs)} pairs: {ratios}); "
                f"identical text: {'yes' if result.identical else 'no'}")
            results.append(result)
    total_plain = sum(statistics.median(p.latency_s for p, _ in r.pairs) for r in results)
    total_spec = sum(statistics.median(q.latency_s for _, q in r.pairs) for r in results)
    drafted = sum(r.pairs[0][1].total_draft_tokens for r in results)
    accepted = sum(r.pairs[0][1].total_accepted_draft_tokens for r in results)
    log(f"\nsummary: acceptance {accepted}/{drafted} ({100 * accepted / max(drafted, 1):.0f}%), "
        f"speedup {total_plain / total_spec:.2f}x over {len(results)} prompts (median latencies); "
        f"identical text: {'yes' if all(r.identical for r in results) else 'no'}; "
        f"demo took {time.perf_counter() - t0:.0f} s; server stopped")
    return results


def add_parser(subparsers) -> None:
    """Register `demo SPEC`."""
    p = subparsers.add_parser("demo", help="engines -> repository -> Triton -> streamed requests, plain vs speculative")
    add_spec_arguments(p)
    p.add_argument("--repeats", type=int, default=REPEATS, help="timed plain/speculative pairs per prompt (median)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """`python -m pipeline demo SPEC`."""
    spec = spec_from_args(args)
    if not traits(spec.speculative.mode).bls_drafts:
        raise SpecError("speculative.mode", f"the demo compares BLS speculation, not {spec.speculative.mode!r}",
                        "use examples/default.yaml (ngram) or examples/draft-target.yaml")
    results = run_demo(spec, repeats=args.repeats)
    return 0 if all(r.identical for r in results) else 1
