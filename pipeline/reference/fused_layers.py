"""Fused dense layers: a small float32 model's decoder layers as one C++ call (csrc/dense_layers.cpp).

A draft model exists to be cheap, but on these CPUs a draft step of a 1-layer, 128-wide draft cost 0.42 ms,
almost half of its 6-layer target's step (0.93 ms): nearly all of it op overhead, 20-30 torch calls per layer at
2-40 us each (the RMSNorm alone is five ATen ops) around a few microseconds of arithmetic. `FusedDenseLayers` runs
every layer and the final norm in one op: the GEMMs on at::linear, as the eager layers' F.linear, the attention on
the row attention kernel, the rest plain loops. It runs forwards whose attention plan uses the row attention kernel
(decode steps and short chains; a prefill keeps the eager path and SDPA).

The results are close to the eager layers', not bit-equal (its RMSNorm sums in row order), so it is for drafts,
whose tokens are proposals the target verifies: `DraftModelProposer` switches it on. Targets keep their eager or
compiled layers, whose bits the exactness tests and the transformers comparisons pin.
REFERENCE_FUSED_LAYERS=0 keeps drafts on the eager path.
"""

from __future__ import annotations

import functools
import logging

import torch

from pipeline.reference import cpp_ops, row_attention
from pipeline.reference.linear import DenseLinear

ENV = "REFERENCE_FUSED_LAYERS"  # "0": drafts run their layers eager
BUILD = cpp_ops.Build("dense_layers", "dense_layers", ("-O3",), lambda: True)

log = logging.getLogger(__name__)


def eligible(model) -> str | None:
    """Why `model` cannot run fused layers (None: it can; a forward over an INT8 KV cache still runs eager, as it
    cannot use the row attention kernel)."""
    if model.dtype != torch.float32:
        return "it needs float32 activations"
    if model.final_norm is None or any(layer["input_norm"] is None for layer in model.layers):
        return "a layer has no input norm (an EAGLE drafter)"
    if not all(isinstance(layer[k], DenseLinear) for layer in model.layers for k in ("qkv", "o", "gate_up", "down")):
        return "its linears are not dense float32"
    if not row_attention.supports(model.num_heads, model.num_kv_heads, model.head_size) or row_attention.kernel() is None:
        return "the row attention kernel does not run here or takes not these heads"
    return None


class FusedDenseLayers:
    """The decoder layers and final norm of an eligible model (see `eligible`) as one op call."""

    def __init__(self, model):
        self.model = model
        no_bias = torch.empty(0)
        self.weights = [t for layer in model.layers
                        for t in (layer["input_norm"], layer["post_norm"], layer["qkv"].weight,
                                  no_bias if layer["qkv"].bias is None else layer["qkv"].bias, layer["o"].weight,
                                  layer["gate_up"].weight, layer["down"].weight)]
        self.attention = "specdeploy::" + row_attention.op_name("write_and_attend")

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv, plan) -> torch.Tensor:
        """x [T, hidden] (embeddings) through every layer and the final norm -> [T, hidden]; plan: a row attention
        plan (`plan.row_keys` set)."""
        m = self.model
        return torch.ops.specdeploy.dense_layers(x, cos, sin, self.weights, kv.k, kv.v, plan.slots, *plan.row_keys,
                                                 m.final_norm, m.num_heads, m.num_kv_heads, m.eps, m.scale,
                                                 self.attention)


def build(model) -> FusedDenseLayers | None:
    """FusedDenseLayers for `model`, or None (logged once per reason) where it is not eligible, switched off or the
    kernel does not build."""
    reason = "REFERENCE_FUSED_LAYERS=0" if not cpp_ops.switched_on(ENV) else eligible(model)
    if reason is None and not cpp_ops.loaded(BUILD):
        reason = "the kernel did not build"
    if reason is not None:
        _log_once(reason)
        return None
    return FusedDenseLayers(model)


@functools.cache
def _log_once(reason: str) -> None:
    log.info("fused dense layers off, the draft runs eager: %s", reason)
