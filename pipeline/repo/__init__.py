"""The Triton model repository: typed configs (config.py), NVIDIA's interface (interface.py),
assembly for both toolchains (assemble.py), validation (validate.py), the trtllm launch script
(launch.py), and the `repo` subcommand."""

from __future__ import annotations

import argparse

from pipeline.cliargs import add_spec_arguments, spec_from_args
from pipeline.toolchains import GPU_TOOLCHAIN, TOOLCHAINS, toolchain_traits


def add_parser(subparsers) -> None:
    """Register `repo SPEC`."""
    p = subparsers.add_parser("repo", help="assemble and validate the Triton model repository")
    add_spec_arguments(p)
    p.add_argument("--toolchain", choices=list(TOOLCHAINS), help="assemble for this toolchain instead of the spec's")
    p.set_defaults(func=run_repo)


def run_repo(args: argparse.Namespace) -> int:
    """`python -m pipeline repo SPEC`: write <out_dir>/model_repo (and the trtllm repository + launch script)."""
    from pipeline.repo.assemble import assemble
    from pipeline.repo.launch import write_launch_script
    from specbuild.plan import make_plan, resolve_toolchain

    spec = spec_from_args(args)
    toolchain = args.toolchain or resolve_toolchain(spec)[0]
    plan = make_plan(spec, toolchain)
    # A CPU spec also gets the GPU toolchain's repository: the same service for a GPU host.
    for tc in (toolchain,) if toolchain_traits(toolchain).gpu else (toolchain, GPU_TOOLCHAIN):
        repo = assemble(plan if tc == toolchain else make_plan(spec, tc, inspection=plan.inspection))
        print(f"model repository ({tc}): {repo}  [validated: configs parse as Triton ModelConfig, "
              "tensors match NVIDIA's interface, limits match the engines]")
        if toolchain_traits(tc).repository == "llmapi":
            print(f"launch script: {write_llmapi_scripts(spec, tc, repo)}")
        elif toolchain_traits(tc).launch_script:
            print(f"launch script: {write_launch_script(spec, repo)}")
    return 0


def write_llmapi_scripts(spec, toolchain: str, repo) -> str:
    """launch_triton.sh (ModelOpt steps, then Triton in the foreground) next to the llmapi repository; returns
    its path and the equivalent trtllm-serve command."""
    import shlex

    from pipeline.repo.llmapi import OPTIONS_FILE
    from specbuild.plan import make_plan
    from specbuild.toolchains import toolchain_module

    module = toolchain_module(toolchain)
    plan = make_plan(spec, toolchain)
    script = repo.parent / "launch_triton.sh"
    script.write_text(module.build_script(plan))
    script.chmod(0o755)
    serve = module.trtllm_serve_command(spec, module.model_dirs(plan)["target"], repo.parent / OPTIONS_FILE)
    return f"{script}\ntrtllm-serve (OpenAI API, same configuration): {shlex.join(serve)}"
