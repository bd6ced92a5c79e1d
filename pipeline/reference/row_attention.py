"""Batch-invariant attention of decode and verify rows as the project's own kernel (csrc/row_attention.cpp).

Each row's result is a function of its query and its keys alone (a query head's scores, each a dot product in one
fixed order; the softmax's maximum and sum in slot order; the weighted values in slot order), so a verify row and a
plain decode step of the same token get the same bits whatever else the forward holds, without the per-row SDPA
calls of the model's fallback (one SDPA batch element per row, keys aligned to KEY_ALIGN,
pipeline/reference/model.py; torch's CPU SDPA costs about 2 ms for one row over SmolLM2's 30 layers and 0.5 ms per
further row, in call overhead). Rows share work, not arithmetic: the rows of one sequence and the query heads of
one KV head read each key and value once (16 keys transposed in registers), and the next keys are prefetched. A
verify's second row costs 4% of a step where it cost 11%, with the same bits as before (docs/benchmarks.md).

It runs where the CPU has AVX-512 or AVX2 (a second build of the same source, ops `row_attention_avx2` and
`write_and_attend_avx2`: 8-lane arithmetic of its own, fixed the same way), the model computes in float32 with a
float32 KV cache and the rows form chains (trees keep SDPA); REFERENCE_ROW_ATTENTION=0 keeps SDPA everywhere. Each
build also registers `row_attention_into` (`_avx2`), which the fused int8_sq layers call from every thread of their
team: each caller plans the same work items and takes them from shared counters (csrc/shared_items.h).
Over a bf16 KV cache (KVCache's kv_dtype "BF16", an engine option) csrc/row_attention_bf16.cpp attends: the same
work items and the same guarantee over half the bytes, with vdpbf16ps where the CPU has AVX512-BF16 (ops with the
suffix _bf16), else with AVX2's fused multiply-adds in vdpbf16ps's order (suffix _bf16_avx2; AMD Zen3): the same bits
(`kernel_for` picks the build for a cache).
Numbers: docs/benchmarks.md.
"""

from __future__ import annotations

import functools
import torch

from pipeline.reference import cpp_ops

ENV = "REFERENCE_ROW_ATTENTION"  # "0": the model's SDPA path even where this kernel can run


AVX512 = cpp_ops.Build("row_attention", "row_attention", ("-O3", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl"),
                       torch.cpu._is_avx512_supported)
AVX2 = cpp_ops.Build("row_attention_avx2", "row_attention", ("-O3", "-mavx2", "-mfma"), torch.cpu._is_avx2_supported)
# over a bf16 KV cache (KVCache kv_dtype "BF16"): csrc/row_attention_bf16.cpp, ops with the suffix _bf16, or _bf16_avx2
BF16 = cpp_ops.Build("row_attention_bf16", "row_attention_bf16",
                     ("-O3", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
                     torch.cpu._is_avx512_bf16_supported)
BF16_AVX2 = cpp_ops.Build("row_attention_bf16_avx2", "row_attention_bf16", ("-O3", "-mavx2", "-mfma"),
                          torch.cpu._is_avx2_supported)


def switched_on() -> bool:
    """Whether the environment allows the kernel (REFERENCE_ROW_ATTENTION is not "0")."""
    return cpp_ops.switched_on(ENV)


@functools.cache
def kernel() -> cpp_ops.Build | None:
    """The build the model runs here: AVX-512 where the CPU has it, else AVX2; None where neither runs
    (REFERENCE_ROW_ATTENTION=0, no AVX2, or the build failed: logged once)."""
    return cpp_ops.first_build((AVX512, AVX2), ENV, "attention runs on SDPA")


@functools.cache
def bf16_kernel() -> cpp_ops.Build | None:
    """The build over a bf16 KV cache: AVX512-BF16's where the CPU has it, else AVX2's; None where neither runs
    (REFERENCE_ROW_ATTENTION=0, no AVX2, or the builds failed: logged once; attention over that cache then runs on
    SDPA)."""
    return cpp_ops.first_build((BF16, BF16_AVX2), ENV, "attention over a bf16 KV cache runs on SDPA")


def kernel_for(kv) -> cpp_ops.Build | None:
    """The build that attends over KV cache `kv`: `kernel()` over float32, `bf16_kernel()` over bf16, None over INT8
    (SDPA)."""
    if kv.kv_dtype == "BF16":
        return bf16_kernel()
    return None if kv.quantized else kernel()


def op_name(name: str, build: cpp_ops.Build | None = None) -> str:
    """The name under which a build (default `kernel()`) registers op `name`: the AVX2 build adds the suffix _avx2,
    the bf16 ones _bf16 and _bf16_avx2."""
    build = build or kernel()
    return name + {AVX2: "_avx2", BF16: "_bf16", BF16_AVX2: "_bf16_avx2"}.get(build, "")


@functools.cache
def _op(name: str, build: cpp_ops.Build):
    """The op `name` of a build, built and loaded if need be (an explicit build, such as the AVX2 one the tests run
    on AVX-512 CPUs, is not loaded by `kernel()`), resolved once."""
    if not cpp_ops.loaded(build):
        raise RuntimeError(f"the {build.library} kernel did not build on this machine (see the log)")
    return getattr(torch.ops.specdeploy, op_name(name, build))


def supports(num_heads: int, num_kv_heads: int, head_size: int) -> bool:
    """Whether the kernel takes these shapes: head_size a multiple of 16 up to 256, whole groups of query heads per
    KV head."""
    return head_size % 16 == 0 and head_size <= 256 and num_heads % num_kv_heads == 0


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  scale: float, isa: cpp_ops.Build | None = None) -> torch.Tensor:
    """q [T, H, D] over one layer's cache k, v [slots, KVH, D]; keys = (slots, starts, lengths): row t attends over
    slots[starts[t]:starts[t] + lengths[t]]. -> [T, H * D]. isa: the build (default `kernel()`)."""
    return _op("row_attention", isa or kernel())(q, k, v, *keys, scale)


def write_and_attend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, new_slots: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float,
                     isa: cpp_ops.Build | None = None) -> torch.Tensor:
    """Store the new tokens' k_new, v_new [T, KVH, D] at new_slots [T] of one layer's cache k, v, then row_attention:
    one call a layer instead of three (the KV write's two index_copy_ were 5% of a SmolLM2 step)."""
    return _op("write_and_attend", isa or kernel())(q, k_new, v_new, new_slots, k, v, *keys, scale)
