"""Toolchain rules of a spec: what a toolchain refuses beyond the generic checks of pipeline/spec.py.

spec.py validates what holds for every toolchain and imports no toolchain module; the rules that belong to
one toolchain (the GPU's for trtllm in pipeline/gpus.py, the PyTorch backend's for trtllm-llmapi in
pipeline/llmapi.py) run here, where specs are loaded for use: `load_spec` (the CLI, deploy, benchmarks)
and the plan stage (specbuild.plan.make_plan). One table, no import inside a function, no import loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from pipeline import gpus, llmapi
from pipeline.spec import Spec, check_spec_paths
from pipeline.spec import load_spec as load_spec_fields

# The rules a spec's `toolchain` adds, by toolchain (auto and reference add none).
TOOLCHAIN_RULES: dict[str, Callable[[Spec], None]] = {
    "trtllm": gpus.check_gpu_rules,
    llmapi.TOOLCHAIN: llmapi.check_rules,
}


def check_toolchain_rules(spec: Spec, toolchain: str | None = None) -> Spec:
    """Raise SpecError for what `toolchain` (default: the spec's own) refuses; returns the spec."""
    rules = TOOLCHAIN_RULES.get(toolchain or spec.toolchain)
    if rules is not None:
        rules(spec)
    return spec


def load_spec(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (), check_paths: bool = True) -> Spec:
    """pipeline.spec.load_spec with the spec's toolchain rules: a spec as the stages may use it.

    The rules run before the paths are checked: what the toolchain cannot run is said before asking for files.
    """
    spec = check_toolchain_rules(load_spec_fields(path, overrides, check_paths=False))
    if check_paths:
        check_spec_paths(spec)
    return spec
