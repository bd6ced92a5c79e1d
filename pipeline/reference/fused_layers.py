"""Fused layers: a model's decoder layers as one C++ call (csrc/fused_layers.cpp), for forwards on the row attention
kernel (decode steps and short chains; a prefill keeps the eager or compiled path and SDPA).

- Dense float32 models (drafts): a draft exists to be cheap, but on these CPUs a draft step of a 1-layer, 128-wide
  draft cost 0.42 ms, almost half of its 6-layer target's step (0.93 ms): nearly all of it op overhead, 20-30 torch
  calls per layer at 2-40 us each (the RMSNorm alone is five ATen ops) around a few microseconds of arithmetic.
  `FusedDenseLayers` runs every layer and the final norm in one op: the GEMMs of a few rows on small weights on the
  op's own GEMVs (at::linear's dispatch and MKL's entry cost 3-8 us a call around a few microseconds of arithmetic),
  larger ones on at::linear as the eager layers' F.linear, the attention on the row attention kernel, the rest plain
  loops. Its results are close to the eager layers', not bit-equal (its GEMVs and RMSNorm sum in their own order),
  so it is for drafts, whose tokens are proposals the target
  verifies: `DraftModelProposer` switches it on. Dense targets keep their eager layers, whose bits the exactness
  tests and the transformers comparisons pin. `greedy_chains` runs a whole greedy draft chain (every forward, the
  output layer and the argmax) in one op call: the trained pair's draft proposed 4 tokens in 1.1-1.3 ms forward by
  forward and 0.51-0.65 ms in one call (docs/benchmarks.md).
- int8_sq models (targets, as served): between its four int8 GEMMs a layer ran five inductor-compiled regions and
  five Python calls of custom ops (compiled.py), 4-17 us each: about 2 ms of a SmolLM2 decode step's 8-11.
  `FusedInt8Layers` runs the same layers in one op, the GEMMs on the project's int8 kernel (int8_grid_gemm.py). The
  engine switches it on beside the compiled layers (`EngineConfig.compiled_layers`). The forward is one parallel
  region: its threads take each phase's items (channel groups, attention work items, rows) from shared counters
  instead of opening 150-300 OpenMP regions, each a sleeping thread's wake under the server's PASSIVE wait policy
  (docs/engine.md). Every row is computed alone in a fixed order, so the results are batch-invariant and the same
  on any thread count; they are close to the compiled layers', not bit-equal (tests/test_fused_layers.py). In exact
  mode (as served) every forward runs on the row attention kernel, so every token of a request is computed by these
  layers, speculative or not, and the engine compiles no regions there (3.7 s of loading SmolLM2's engine from
  inductor's cache, 17 s to compile them).
REFERENCE_FUSED_LAYERS=0 keeps both on the eager or compiled path.
"""

from __future__ import annotations

import functools
import logging

import torch

from pipeline.reference import cpp_ops, greedy_tokens, int8_grid_gemm, row_attention
from pipeline.reference.linear import (ONE_ROW_SPLIT_BYTES, ONEDNN_ROWS, BFloat16Weights, DenseLinear, Float16Weights,
                                        Int8PerToken, intra_op_threads)

ENV = "REFERENCE_FUSED_LAYERS"  # "0": models run their layers eager or compiled
BUILD = cpp_ops.Build("fused_layers", "fused_layers", ("-O3", "-ffp-contract=off"), lambda: True)
LINEARS = ("qkv", "o", "gate_up", "down")

log = logging.getLogger(__name__)


def eligible(model) -> str | None:
    """Why `model` cannot run fused layers (None: it can; a forward over an INT8 KV cache still runs eager or compiled,
    as it cannot use the row attention kernel)."""
    if model.dtype != torch.float32:
        return "it needs float32 activations"
    if model.final_norm is None or any(layer["input_norm"] is None for layer in model.layers):
        return "a layer has no input norm (an EAGLE drafter)"
    linears = [layer[k] for layer in model.layers for k in LINEARS]
    int8_sq = all(isinstance(lin, Int8PerToken) and lin.kernel is not None for lin in linears)
    if not (all(isinstance(lin, DenseLinear) for lin in linears) or int8_sq):
        return "its linears are neither dense float32 nor int8_sq on the project's int8 kernel"
    if int8_sq and any(layer[k].bias is not None for layer in model.layers for k in ("o", "gate_up", "down")):
        return "an int8_sq o, gate_up or down linear has a bias"
    if not row_attention.supports(model.num_heads, model.num_kv_heads, model.head_size) or row_attention.kernel() is None:
        return "the row attention kernel does not run here or takes not these heads"
    return None


class FusedDenseLayers:
    """The decoder layers and final norm of an eligible dense float32 model (see `eligible`) as one op call."""

    def __init__(self, model):
        self.model = model
        no_bias = torch.empty(0)
        self.weights = [t for layer in model.layers
                        for t in (layer["input_norm"], layer["post_norm"], layer["qkv"].weight,
                                  no_bias if layer["qkv"].bias is None else layer["qkv"].bias, layer["o"].weight,
                                  layer["gate_up"].weight, layer["down"].weight)]
        self.attention = "specdeploy::" + row_attention.op_name("write_and_attend")
        self.attention_bf16 = "write_and_attend"  # in the build over a bf16 cache (`attention_op`)

    @property
    def lm_head(self) -> BFloat16Weights | Float16Weights | DenseLinear | None:
        """greedy_chains' output layer: the model's as it is now, run as it runs: a draft's BFloat16Weights or
        Float16Weights on the fp16 kernel (draft_output_layer), or a bias-free DenseLinear; None for a biased or other
        output layer (the proposer's forward-by-forward loop runs those)."""
        head = self.model.lm_head_linear
        chainable = (isinstance(head, BFloat16Weights)
                     or isinstance(head, Float16Weights) and head.kernel is not None and head.bias is None
                     or isinstance(head, DenseLinear) and head.bias is None)
        return head if chainable else None

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv, plan) -> torch.Tensor:
        """x [T, hidden] (embeddings) through every layer and the final norm -> [T, hidden]; plan: a row attention
        plan (`plan.row_keys` set)."""
        m = self.model
        return torch.ops.specdeploy.dense_layers(x, cos, sin, self.weights, kv.k, kv.v, plan.slots, *plan.row_keys,
                                                 m.final_norm, m.num_heads, m.num_kv_heads, m.eps, m.scale,
                                                 attention_op(self, kv), ONE_ROW_SPLIT_BYTES)

    def greedy_chains(self, feeds: list[list[int]], cached: list[int], counts: list[int],
                      block_tables: list[list[int]], kv) -> list[list[int]]:
        """counts[b] greedy (argmax) draft tokens for every request b, all forwards in one op call: request b's
        feed (the tokens its cache lacks, from position cached[b]) first, then each draft token in turn, their KV
        written to its blocks (block_tables[b], enough for cached + feed + counts - 1 tokens). Needs `self.lm_head`.
        The whole call runs on the model's decode threads, as its forwards of up to DECODE_ROWS rows do, a prompt's
        feed included (the model's own forward of more rows would run on torch's thread count)."""
        m, head, bs = self.model, self.lm_head, kv.block_size
        bf16 = head.kernel.packed if isinstance(head, BFloat16Weights) else torch.empty(0)
        fp16 = head.kernel.packed if isinstance(head, Float16Weights) else torch.empty(0)
        weight = head.weight if isinstance(head, DenseLinear) else m.lm_head  # a 16-bit head's: its row count alone
        packed = head.packed if isinstance(head, DenseLinear) else None  # its oneDNN weight for 2-16 rows
        blocks = [b for feed, c, n, table in zip(feeds, cached, counts, block_tables)  # the blocks each chain writes
                  for b in table[:-(-(c + len(feed) + n - 1) // bs)]]
        with intra_op_threads(m.decode_threads):
            drafts = torch.ops.specdeploy.dense_greedy_chains(
                [t for feed in feeds for t in feed], [len(feed) for feed in feeds], cached, counts, blocks, bs, m.embed,
                weight, bf16, fp16, torch.empty(0) if packed is None else packed, ONEDNN_ROWS.start,
                ONEDNN_ROWS.stop - 1, m.rope_cos, m.rope_signed_sin, self.weights, kv.k, kv.v, m.final_norm,
                m.num_heads, m.num_kv_heads, m.eps, m.scale, attention_op(self, kv), ONE_ROW_SPLIT_BYTES,
                "" if greedy_tokens.kernel() is None else "specdeploy::greedy_tokens")  # [B, max(counts)]
        return [row[:count] for row, count in zip(drafts.tolist(), counts)]


class FusedInt8Layers:
    """The decoder layers and final norm of an eligible int8_sq model (see `eligible`) as one op call."""

    def __init__(self, model):
        self.model = model
        hidden, width = model.hidden_size, model.num_heads * model.head_size
        inter = model.config["intermediate_size"]
        qkv_width = (model.num_heads + 2 * model.num_kv_heads) * model.head_size

        def inv_smoother(linear, n):  # the GEMM input's SmoothQuant scaling, ones without one
            return torch.ones(n) if linear.inv_smoother is None else linear.inv_smoother.float().contiguous()

        self.weights = []
        for layer in model.layers:
            qkv = layer["qkv"]
            self.weights += [layer["input_norm"].float().contiguous(), layer["post_norm"].float().contiguous(),
                             inv_smoother(qkv, hidden), inv_smoother(layer["o"], width),
                             inv_smoother(layer["gate_up"], hidden), inv_smoother(layer["down"], inter),
                             torch.zeros(qkv_width) if qkv.bias is None else qkv.bias.float().contiguous()]
            self.weights += [t for k in LINEARS for t in (layer[k].kernel.packed, layer[k].kernel.offset,
                                                          layer[k].kernel.multiplier)]
        kernel = model.layers[0]["qkv"].kernel  # every linear's: the grid and the build are the model's
        op = "int8_grid_gemm_into" if kernel.isa is int8_grid_gemm.VNNI else "int8_grid_gemm_avx2_into"
        self.gemm = ("specdeploy::" + op, kernel.step, kernel.zero_point, kernel.amx_min_rows)
        self.attention = "specdeploy::" + row_attention.op_name("row_attention_into")
        self.attention_bf16 = "row_attention_into"  # in the build over a bf16 cache (`attention_op`)

    def chains(self, seqs, kv) -> torch.Tensor:
        """The decoder layers and final norm over the new tokens of `seqs` (model.SequenceInput chains, checked by the
        caller) -> [T, hidden]. The op builds the row attention's plan (as model._AttentionPlan.for_row_attention)
        and gathers the embeddings and RoPE rows itself: from Python those took about 0.2 ms of a SmolLM2 decode
        step, some 15 torch calls on caches the step's weights had flushed (docs/benchmarks.md)."""
        m, bs = self.model, kv.block_size
        tokens, counts, cached, blocks = [], [], [], []
        for seq in seqs:
            n, c = len(seq.token_ids), seq.num_cached
            tokens += seq.token_ids
            counts.append(n)
            cached.append(c)
            blocks += seq.block_table[:-(-(c + n) // bs)]
        return torch.ops.specdeploy.int8_sq_chains(tokens, counts, cached, blocks, bs, m.embed, m.rope_cos,
                                                   m.rope_signed_sin, self.weights, kv.k, kv.v, m.final_norm,
                                                   m.num_heads, m.num_kv_heads, m.eps, m.scale,
                                                   attention_op(self, kv), *self.gemm)


def attention_op(layers: "FusedDenseLayers | FusedInt8Layers", kv) -> str:
    """The attention op `layers` call over KV cache `kv`: their `attention` (over float32; a revision's in
    pipeline.apps.attention_ab) or, over a bf16 cache, their `attention_bf16` op in the build that attends over it
    (row_attention.bf16_kernel)."""
    if kv.kv_dtype != "BF16":
        return layers.attention
    return "specdeploy::" + row_attention.op_name(layers.attention_bf16, row_attention.bf16_kernel())


def build(model) -> FusedDenseLayers | FusedInt8Layers | None:
    """The fused layers of `model` (dense or int8_sq), or None (logged once per reason) where it is not eligible,
    switched off or the kernel does not build."""
    reason = "REFERENCE_FUSED_LAYERS=0" if not cpp_ops.switched_on(ENV) else eligible(model)
    if reason is None and not cpp_ops.loaded(BUILD):
        reason = "the kernel did not build"
    if reason is not None:
        _log_once(reason)
        return None
    return FusedDenseLayers(model) if isinstance(model.layers[0]["qkv"], DenseLinear) else FusedInt8Layers(model)


@functools.cache
def _log_once(reason: str) -> None:
    log.info("fused layers off: %s", reason)
