"""Command line: `python -m pipeline <command> SPEC [--set key=value ...]`.

A user error (bad spec, incompatible checkpoints, models that cannot fit) prints one line
`error: <field path>: <problem>; fix: <fix>` and exits 2, without a traceback.

Other modules add a subcommand by exposing `add_parser(subparsers)` (calling
pipeline.cliargs.add_spec_arguments on their parser and `set_defaults(func=handler)`, handler(args) -> exit code) and listing their
module in SUBCOMMAND_MODULES. They import heavy packages (torch) inside the handler, so
`validate`, `inspect` and `plan` stay fast on a machine without an ML stack.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pipeline.cliargs import add_spec_arguments, spec_from_args
from pipeline.spec import SpecError
from pipeline.toolchains import GPU_TOOLCHAIN, TOOLCHAINS, toolchain_traits

# Modules of other subcommands (each exposes add_parser(subparsers)).
SUBCOMMAND_MODULES: list[str] = ["pipeline.deploy", "pipeline.repo", "pipeline.server", "pipeline.lifecycle",
                                   "pipeline.apps.bench", "pipeline.apps.demo"]


BUILTIN_COMMANDS = ("validate", "inspect", "plan", "engines", "models")



def cmd_validate(args: argparse.Namespace) -> int:
    """Check the spec's types, fields, paths and combinations."""
    spec = spec_from_args(args)
    print(f"ok: {args.spec} is a valid spec (name {spec.name}, mode {spec.speculative.mode}, toolchain {spec.toolchain})")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """Check checkpoints (architecture, tokenizers, head shapes) and print the memory plan."""
    from pipeline.checkpoints import inspect_spec

    report = inspect_spec(spec_from_args(args))
    print(report.render())
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the steps and keys, or with --dry-run the trtllm shell script for a GPU host."""
    from specbuild import plan as planning

    spec = spec_from_args(args)  # make_plan inspects: incompatible checkpoints fail before any script is written
    if args.dry_run:  # the GPU toolchain's script: --toolchain, else the spec's if it is a GPU one, else trtllm
        from specbuild.toolchains import toolchain_module

        gpu = args.toolchain or (spec.toolchain if spec.toolchain in TOOLCHAINS and toolchain_traits(spec.toolchain).gpu
                                 else GPU_TOOLCHAIN)
        if gpu == GPU_TOOLCHAIN:  # TensorRT-LLM engines: float32 builds in a 16-bit dtype
            from pipeline.gpus import dtype_notices

            for notice in dtype_notices(spec):
                print(notice, file=sys.stderr)
        sys.stdout.write(toolchain_module(gpu).build_script(planning.make_plan(spec, gpu)))
        return 0
    toolchain, notice = planning.resolve_toolchain(spec) if args.toolchain is None else (args.toolchain, None)
    if notice:
        print(notice)
    from specbuild.execute import describe_plan

    print(describe_plan(planning.make_plan(spec, toolchain)))
    return 0


def cmd_engines(args: argparse.Namespace) -> int:
    """Build (or reuse from the cache) every engine of the spec."""
    from specbuild.execute import run_engines

    return run_engines(spec_from_args(args), toolchain=args.toolchain)


def cmd_models(args: argparse.Namespace) -> int:
    """Extract SmolLM2-135M-Instruct and derive the example draft and heads under models/."""
    from pipeline.fixtures.models import make_models

    make_models(args.out)
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; other modules' subcommands are imported unless `command` is one of ours."""
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check a spec")
    add_spec_arguments(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("inspect", help="check checkpoints and print the memory plan")
    add_spec_arguments(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("plan", help="print the build steps and their cache keys")
    add_spec_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="print the trtllm shell script a GPU host runs as is")
    p.add_argument("--toolchain", choices=list(TOOLCHAINS), help="plan for this toolchain instead of the spec's")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("engines", help="build the engines (cached)")
    add_spec_arguments(p)
    p.add_argument("--toolchain", choices=list(TOOLCHAINS), help="use this toolchain instead of the spec's")
    p.set_defaults(func=cmd_engines)

    p = sub.add_parser("models", help="extract SmolLM2 and make the example draft/heads under models/")
    p.add_argument("--out", default="models", help="folder for the checkpoints (default: models)")
    p.set_defaults(func=cmd_models)

    if command not in BUILTIN_COMMANDS:  # keeps `engines` on a cache hit free of their imports
        for name in SUBCOMMAND_MODULES:
            importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; user errors become one line on stderr and exit code 2."""
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished steps stay cached, the unfinished one left nothing behind", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
