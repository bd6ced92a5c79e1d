"""A model's streamed int8 weights sit in one buffer that Linux is asked to back with 2 MB pages
(pipeline/reference/huge_pages.py): the same values, in forward order, advised MADV_HUGEPAGE before their first
write."""

import re
from pathlib import Path

import pytest
import torch

from pipeline.reference import huge_pages
from pipeline.reference.int8_screen import Int8Screen
from pipeline.reference.linear import Int8PerToken
from pipeline.reference.model import LlamaModel
from tests.test_int8_kernels import int8_engines  # noqa: F401 - the int8 engine builds, a fixture

linux_only = pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
                                reason="needs Linux with transparent huge pages (madvise, /proc/self/smaps)")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        bounds = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if bounds:
            inside = int(bounds[1], 16) <= address < int(bounds[2], 16)
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@linux_only
def test_weights_are_copied_in_order_into_one_buffer_advised_for_huge_pages(monkeypatch):
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    weights = [torch.randint(-128, 128, (3_000_000,), dtype=torch.int8), torch.randn(1000, 3),
               torch.randint(-128, 128, (5, 7, 64, 4), dtype=torch.int8), torch.randn(17).half()]
    copies = huge_pages.gathered(weights)
    for weight, copy in zip(weights, copies):
        assert copy.dtype == weight.dtype and copy.shape == weight.shape and torch.equal(copy, weight)
        assert copy.is_contiguous() and copy.data_ptr() % huge_pages.ALIGN == 0
    assert copies[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert len({copy.untyped_storage().data_ptr() for copy in copies}) == 1  # one buffer
    assert all(b.data_ptr() >= a.data_ptr() + a.nbytes for a, b in zip(copies, copies[1:]))  # in order
    assert "hg" in vm_flags(copies[0].data_ptr()) and "hg" in vm_flags(copies[-1].data_ptr())
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert huge_pages.gathered(weights) is weights


@linux_only
def test_an_int8_models_gemm_and_screen_weights_share_one_advised_buffer(int8_engines):  # noqa: F811
    model = LlamaModel.from_engine_dir(int8_engines["int8_sq"])
    packed = [layer[k].kernel.packed for layer in model.layers for k in ("qkv", "o", "gate_up", "down")
              if isinstance(layer[k], Int8PerToken) and layer[k].kernel is not None]
    if isinstance(model.argmax_layer, Int8Screen):
        packed.append(model.argmax_layer.packed)
    assert len(packed) == 4 * len(model.layers) + isinstance(model.argmax_layer, Int8Screen) > 0
    assert len({t.untyped_storage().data_ptr() for t in packed}) == 1
    assert all(b.data_ptr() > a.data_ptr() for a, b in zip(packed, packed[1:]))  # the order the forward reads them
    assert "hg" in vm_flags(packed[0].data_ptr())
