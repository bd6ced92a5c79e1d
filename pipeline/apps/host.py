"""What machine a benchmark ran on: which kernel wins, and by how much, depends on the CPU's matrix instructions."""

from __future__ import annotations

import os

import torch

# torch.cpu's detectors, in the order they widen what a linear kernel can use
ISA_CHECKS = {"AVX2": "_is_avx2_supported", "AVX-512": "_is_avx512_supported", "VNNI": "_is_vnni_supported",
              "AVX-512 bf16": "_is_avx512_bf16_supported", "AMX": "_is_amx_tile_supported"}


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown CPU" where there is none)."""
    try:
        with open(cpuinfo) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    except OSError:
        return "unknown CPU"


def cpu_summary() -> str:
    """One line: the CPU's model, its CPU count and the matrix instruction sets torch detects."""
    found = [name for name, fn in ISA_CHECKS.items() if getattr(torch.cpu, fn, lambda: False)()]
    seen = ", ".join(found) or "none of AVX2 / AVX-512 / VNNI / AMX"
    return f"{cpu_model()}, {os.cpu_count()} CPUs; torch sees {seen}"
