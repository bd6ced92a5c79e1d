"""`python -m pipeline bench SPEC`: the clients' serving benchmark against the spec's server (ports from the spec).

The pipeline side of clients/bench.py: clients/ stays standalone (it imports nothing from pipeline/).
"""

from __future__ import annotations

import argparse

from clients.bench_args import add_run_arguments
from pipeline.cliargs import add_spec_arguments, spec_from_args


def add_parser(subparsers) -> None:
    """Register `python -m pipeline bench SPEC`: the sweep against the spec's server."""
    p = subparsers.add_parser("bench", help="load-test the running server (TTFT, TPOT, acceptance, speedup vs K)")
    add_spec_arguments(p)
    add_run_arguments(p)
    p.set_defaults(func=run_for_spec)


def run_for_spec(args: argparse.Namespace) -> int:
    """Run the sweep against the spec's server and write the report."""
    from clients.bench import config_from_args, run_and_report

    spec = spec_from_args(args, check_paths=False)
    s = spec.serving
    port = s.grpc_port if args.protocol == "grpc" else s.http_port
    return run_and_report(config_from_args(args, f"{s.host}:{port}", f"http://{s.host}:{s.metrics_port}/metrics"),
                          args.out)
