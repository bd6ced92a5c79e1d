"""Arguments of the serving benchmark (`python -m clients bench run`, and `python -m pipeline bench SPEC`
through pipeline/apps/bench.py).

Kept apart from clients/bench.py so that registering the subcommand imports nothing heavy: the
pipeline CLI stays fast for validate/inspect/plan.
"""

from __future__ import annotations

import argparse
from pathlib import Path

BUILTIN_SETS = ("chat", "code", "summarize")
DEFAULT_CONCURRENCY, FULL_CONCURRENCY = (1, 4), (1, 4, 8, 16)
DEFAULT_KS, FULL_KS = (0, 2, 5), tuple(range(9))
# Long enough for the answers to finish (summaries here end after 35-75 tokens, code edits after 25 to more than 128):
# a 32-token cut measured the answers' openings ("Here is the function..."), where prompt lookup rarely
# matches, not their copying middle. vLLM's spec-decode benchmark (`vllm bench serve --dataset-name
# spec_bench`) defaults to 256 output tokens; 128 keeps `make bench` within about 5 minutes here.
DEFAULT_MAX_TOKENS = 128


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive integer")
    return value


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `bench run` (shared with `python -m pipeline bench SPEC`)."""
    p.add_argument("--prompts", default=",".join(BUILTIN_SETS),
                   help="comma-separated built-in sets (chat, code, summarize) and/or JSONL files")
    p.add_argument("--concurrency", type=_ints, help=f"default {','.join(map(str, DEFAULT_CONCURRENCY))}")
    p.add_argument("--k", type=_ints, help=f"draft tokens per round to sweep (0 = off); default {','.join(map(str, DEFAULT_KS))}")
    p.add_argument("--full", action="store_true", help="full sweep: concurrency 1,4,8,16 and K 0..8")
    p.add_argument("--requests", type=_positive, default=4, help="requests per cell and repeat (at least the concurrency)")
    p.add_argument("--repeats", type=_positive, default=2,
                   help="sweeps of each prompt set and concurrency's K cells, the K order rotated each time, each "
                        "repeat on the set's next prompts (default 2: the built-in sets' 8 prompts at 4 requests)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"output tokens per request (default {DEFAULT_MAX_TOKENS}; a prompt set item may set its own)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", default="ensemble")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--tokenizer", help="tokenizer directory for the chat template (default: the server's)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=Path("out/bench"))

