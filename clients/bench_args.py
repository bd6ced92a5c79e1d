"""Arguments of the serving benchmark, and its `python -m pipeline bench SPEC` subcommand.

Kept apart from clients/bench.py so that registering the subcommand imports nothing heavy: the
pipeline CLI stays fast for validate/inspect/plan.
"""

from __future__ import annotations

import argparse
from pathlib import Path

BUILTIN_SETS = ("chat", "code", "summarize")
DEFAULT_CONCURRENCY, FULL_CONCURRENCY = (1, 4), (1, 4, 8, 16)
DEFAULT_KS, FULL_KS = (0, 2, 5), tuple(range(9))


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `bench run` (shared with `python -m pipeline bench SPEC`)."""
    p.add_argument("--prompts", default=",".join(BUILTIN_SETS),
                   help="comma-separated built-in sets (chat, code, summarize) and/or JSONL files")
    p.add_argument("--concurrency", type=_ints, help=f"default {','.join(map(str, DEFAULT_CONCURRENCY))}")
    p.add_argument("--k", type=_ints, help=f"draft tokens per round to sweep (0 = off); default {','.join(map(str, DEFAULT_KS))}")
    p.add_argument("--full", action="store_true", help="full sweep: concurrency 1,4,8,16 and K 0..8")
    p.add_argument("--requests", type=int, default=4, help="requests per cell (at least the concurrency)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", default="ensemble")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--tokenizer", help="tokenizer directory for the chat template (default: the server's)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=Path("out/bench"))


def add_parser(subparsers) -> None:
    """Register `python -m pipeline bench SPEC`: the sweep against the spec's server (ports from the spec)."""
    from pipeline.cli import add_spec_arguments

    p = subparsers.add_parser("bench", help="load-test the running server (TTFT, TPOT, acceptance, speedup vs K)")
    add_spec_arguments(p)
    add_run_arguments(p)
    p.set_defaults(func=_run_for_spec)


def _run_for_spec(args: argparse.Namespace) -> int:
    from clients.bench import config_from_args, run_and_report
    from pipeline.cli import spec_from_args

    spec = spec_from_args(args, check_paths=False)
    s = spec.serving
    port = s.grpc_port if args.protocol == "grpc" else s.http_port
    return run_and_report(config_from_args(args, f"{s.host}:{port}", f"http://{s.host}:{s.metrics_port}/metrics"),
                          args.out)
