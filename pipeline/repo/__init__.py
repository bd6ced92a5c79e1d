"""The Triton model repository: typed configs (config.py), NVIDIA's interface (interface.py),
assembly for both toolchains (assemble.py), validation (validate.py), the trtllm launch script
(launch.py), and the `repo` subcommand."""

from __future__ import annotations

import argparse

from pipeline.cliargs import add_spec_arguments, spec_from_args


def add_parser(subparsers) -> None:
    """Register `repo SPEC`."""
    p = subparsers.add_parser("repo", help="assemble and validate the Triton model repository")
    add_spec_arguments(p)
    p.add_argument("--toolchain", choices=["trtllm", "reference"], help="assemble for this toolchain instead of the spec's")
    p.set_defaults(func=run_repo)


def run_repo(args: argparse.Namespace) -> int:
    """`python -m pipeline repo SPEC`: write <out_dir>/model_repo (and the trtllm repository + launch script)."""
    from pipeline.repo.assemble import assemble
    from pipeline.repo.launch import write_launch_script
    from specbuild.plan import resolve_toolchain

    spec = spec_from_args(args)
    toolchain = args.toolchain or resolve_toolchain(spec)[0]
    # A reference spec also gets the trtllm repository: the same service for a GPU host.
    for tc in ("reference", "trtllm") if toolchain == "reference" else ("trtllm",):
        repo = assemble(spec, tc)
        print(f"model repository ({tc}): {repo}  [validated: configs parse as Triton ModelConfig, "
              "tensors match NVIDIA's interface, limits match the engines]")
        if tc == "trtllm":
            print(f"launch script: {write_launch_script(spec, repo)}")
    return 0
