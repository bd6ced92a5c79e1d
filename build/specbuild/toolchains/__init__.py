"""One module per toolchain, all of one shape:

    versions() -> dict             the versions a step's output depends on (part of every cache key)
    build(plan) -> int             the `engines` command: build here, or write the script for a GPU host
    build_script(plan) -> str|None the script a GPU host runs (None: the engines build here)

What the later stages need to know about a toolchain is a row of pipeline/toolchains.py.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def toolchain_module(name: str) -> ModuleType:
    """The module of a toolchain (imported on first use: the reference one pulls in torch only when building)."""
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
