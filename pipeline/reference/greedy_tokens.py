"""Each row's greedy token (its argmax) as the project's own kernel (csrc/greedy_tokens.cpp): the same index as
torch.argmax(dim=-1), the first of the largest value (a NaN counts as the largest), in a fraction of its time on a
vocabulary of SmolLM2's size (one row 43 -> 5 us, a verify's 6 rows 208 -> 28 us; docs/benchmarks.md). Greedy
verification and draft chains ask for it every step. The source is compiled once per machine
(pipeline.reference.cpp_ops); where it cannot run (no AVX2), or REFERENCE_ARGMAX_KERNEL=0, torch.argmax runs.
"""

from __future__ import annotations

import functools

import torch

from pipeline.reference import cpp_ops

ENV = "REFERENCE_ARGMAX_KERNEL"  # "0": torch.argmax even where the kernel runs
AVX2 = cpp_ops.Build("greedy_tokens", "greedy_tokens", ("-O3", "-mavx2"), torch.cpu._is_avx2_supported)


@functools.cache
def kernel() -> cpp_ops.Build | None:
    """The build, or None where it cannot run (no AVX2, REFERENCE_ARGMAX_KERNEL=0, or the build failed: logged once)."""
    return cpp_ops.first_build((AVX2,), ENV, "greedy tokens come from torch.argmax")


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """logits [R, V] -> each row's argmax (torch.argmax(dim=-1)'s choice), as a list of R ints."""
    if logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] > 0 and kernel() is not None:
        return torch.ops.specdeploy.greedy_tokens(logits).tolist()
    return logits.argmax(dim=-1).tolist()
