"""A model's streamed weights in one buffer of 2 MB pages (Linux transparent huge pages, asked for by madvise).

A one-row step reads every int8 weight once, in order: SmolLM2's 120 GEMM weights (106 MB) and its int8 screen
(28 MB). torch allocates them in 4 KB pages on hosts whose transparent huge pages are in "madvise" mode (these
development hosts), so the stream crosses a page, where a core's hardware prefetcher stops and its TLB misses, every
4 KB. In 2 MB pages the same forwards ran 0.2-6.6% faster on AMD Zen4, in each of three runs and either of the
host's memory states (docs/benchmarks.md, "Weights in huge pages"). One buffer, the weights one after another in
the order the forward reads them: each weight in pages of its own would round up to whole 2 MB pages (SmolLM2's o
weight is 0.33 MB).
REFERENCE_HUGE_PAGES=0 keeps torch's own allocations.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

from pipeline.reference import cpp_ops

ENV = "REFERENCE_HUGE_PAGES"  # "0": weights stay where torch allocated them
HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
ALIGN = 64  # bytes: each weight's first byte on a cache line
MADV_HUGEPAGE = 14  # <linux/mman.h>

log = logging.getLogger(__name__)


def gathered(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (the same dtypes, shapes and values, contiguous) one after another in one buffer that
    starts on a 2 MB boundary and is advised MADV_HUGEPAGE before its first write, so Linux backs it with huge pages
    where its mode allows ("always" or "madvise"). `tensors` themselves where REFERENCE_HUGE_PAGES=0, off Linux, or
    where madvise fails (logged once)."""
    if not tensors or not cpp_ops.switched_on(ENV) or not sys.platform.startswith("linux"):
        return tensors
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end = -(-(end + t.numel() * t.element_size()) // ALIGN) * ALIGN
    buffer = torch.empty(end + HUGE_PAGE, dtype=torch.uint8)  # fresh pages, not touched before the advice
    start = -buffer.data_ptr() % HUGE_PAGE
    if not _advise(buffer.data_ptr() + start, end):
        return tensors
    copies = []
    for t, offset in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        copy = buffer[start + offset:start + offset + n].view(t.dtype).view(t.shape)
        copies.append(copy.copy_(t))
    return copies


def _advise(address: int, length: int) -> bool:
    """madvise(address, length, MADV_HUGEPAGE); False (logged once) where it fails."""
    result = _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE)
    if result != 0:
        _log_once(f"madvise(MADV_HUGEPAGE) failed (errno {ctypes.get_errno()}): weights stay in 4 KB pages")
    return result == 0


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@functools.cache
def _log_once(message: str) -> None:
    log.info(message)
