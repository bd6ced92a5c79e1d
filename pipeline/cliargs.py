"""The arguments every spec command shares (SPEC, --set overrides): the bottom of the command line.

Stages that register a subcommand import this module, never pipeline.cli, which dispatches to them.
"""

from __future__ import annotations

import argparse

from pipeline.rules import load_spec
from pipeline.spec import Spec


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """The SPEC positional and repeatable `--set key.path=value` overrides."""
    parser.add_argument("spec", help="the spec YAML file, e.g. examples/default.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field, e.g. --set models.draft.qformat=int4_wo (repeatable)")


def spec_from_args(args: argparse.Namespace, check_paths: bool = True) -> Spec:
    """Load the spec named by parsed arguments, with its overrides (and its toolchain's rules)."""
    return load_spec(args.spec, args.overrides, check_paths=check_paths)
