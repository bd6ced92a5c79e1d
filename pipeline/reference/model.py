"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a paged KV cache.

One forward runs a batch of ragged sequences: each sequence brings some new tokens on top of its
cached prefix (prefill, chunked prefill, decode, draft verification). The new tokens of all
sequences are flattened into one token batch for the matmuls; attention runs per sequence, over the
sequence's cached prefix (gathered from its KV blocks) plus its new tokens. The new tokens of a
sequence may form a tree (Medusa / EAGLE verification): then a token attends to the prefix and to
its ancestors only, at position prefix_len + depth.

Linear layers run the kernel of the engine's weight format (linear.py): dense in the compute dtype,
fbgemm's fp16-weight GEMM for float16 engines, or int8 kernels for int8_wo (W8A16) and int8_sq
(W8A8, per-token activations) engines, whose output layer then runs on fp16 weights; int4 / fp8
weights are dequantized at load (no faster CPU kernel that keeps them, see docs/engine.md).

`batch_invariant=True` makes every token's result independent of what else is in the batch
(bit-for-bit): every linear whose kernel is not batch-invariant by construction runs row by row
(CPU fp32 GEMM kernels round differently for different row counts), and attention runs every
token as its own batch element of an SDPA call whose key count is the one a plain decode of that
token's slot has (slot + 1, aligned to KEY_ALIGN; see there). Serving and the exactness tests
(speculative == plain) use it; with the int8 kernels it costs little, since their linears take
all rows in one call. Tree tokens (Medusa, EAGLE) see their ancestors among masked siblings: close
to a plain decode of their path, not bit-identical. Off, a sequence's new tokens attend as the
query rows of one masked SDPA call (cheaper for long contexts, but a verify then rounds
differently from plain decoding).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.limits import TOKENS_PER_BLOCK
from pipeline.reference import row_attention
from pipeline.reference.fused_layers import FusedDenseLayers, FusedInt8Layers
from pipeline.reference.kv_cache import KVCache
from pipeline.reference.linear import (DenseLinear, Float16Weights, Int8PerToken, Int8WeightOnly, ScreenedOutputLayer,
                                       argmax_output_layer, intra_op_threads, output_layer_16bit, wide_layout)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Forwards of at most this many new tokens (decode steps, drafts to verify) run on `decode_threads` threads: one
# unless the engine measured more to be faster where the thread count cannot change a bit (decode_threads.py;
# docs/engine.md, "Decode step"). Larger forwards (prefill) keep torch's thread count.
DECODE_ROWS = 16
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Batch-invariant attention runs every token as its own SDPA batch element (its query heads of each KV head as
# that head's query rows) over the key count a plain decode of its slot has, aligned up to KEY_ALIGN with masked
# keys; tokens with the same count share a call. torch's CPU SDPA gives a batch element the same bits whatever the
# other elements hold, so a token computes alike alone, in a verify or beside other sequences. Other key counts
# (from 400 keys on) and two threads round differently (exact mode runs on decode_threads = 1); aligning lets a
# verify's tokens share one or two calls. Measured: docs/engine.md, "Batch invariance"; tests/test_model.py.
KEY_ALIGN = 16


def config_from_hf(hf: dict, dtype: str = "float32") -> dict:
    """The engine's `pretrained_config` dict (docs/engine-format.md, TensorRT-LLM's layout) from an HF config.json dict."""
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; use one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    rope = hf.get("rope_parameters") or {}  # transformers 5 nests rope settings here
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    heads = hf["num_attention_heads"]
    return {
        "architecture": arch, "dtype": dtype,
        "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"], "intermediate_size": hf["intermediate_size"],
        "num_hidden_layers": hf["num_hidden_layers"], "num_attention_heads": heads,
        "num_key_value_heads": hf.get("num_key_value_heads") or heads,
        "head_size": hf.get("head_dim") or hf["hidden_size"] // heads,
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
        "rotary_scaling": dict(scaling) if scaling else None,
        "norm_epsilon": hf.get("rms_norm_eps", 1e-5), "hidden_act": hf.get("hidden_act", "silu"),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "attention_bias": bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None, "group_size": 128},
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "medusa": None, "eagle": None,
    }


def rope_inv_freq(config: dict) -> torch.Tensor:
    """RoPE inverse frequencies [head_size / 2] in fp32, with HF rope scaling (linear, dynamic, llama3)."""
    dim, base = config["head_size"], config["rotary_base"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.get("rotary_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind in ("default", "dynamic"):
        # dynamic NTK equals default up to max_position_embeddings; the engine caps max_seq_len there.
        return inv_freq
    raise ValueError(f"rotary_scaling type {kind!r} is not supported; use default, linear, dynamic or llama3")


@dataclass
class SequenceInput:
    """One sequence's part of a forward: new tokens on top of `num_cached` tokens already in its KV blocks."""

    token_ids: list[int]  # new tokens; their KV goes to logical slots num_cached .. num_cached + len - 1
    num_cached: int  # prefix tokens whose KV is already in the cache
    block_table: list[int]  # KV blocks of this sequence, enough for num_cached + len(token_ids) tokens
    parents: list[int] | None = None  # tree over new tokens: parent index of token i (< i), -1 = hangs off the prefix
    logits_rows: list[int] | None = None  # which new tokens need logits; None = the last one
    # only each logits row's argmax is read (a greedy request without penalties, bans or returned logits): the model
    # may compute them on its argmax layer (exact at each row's top only, Int8Screen)
    argmax_only: bool = False


@dataclass
class ForwardOutput:
    """Logits of the requested rows (sequence by sequence) and, on request, hidden states of all new tokens."""

    logits: torch.Tensor  # [sum(len(logits_rows)), vocab] float32
    # [sum(len(token_ids)), hidden]: final-norm output (the lm_head input), or the captured layers' outputs
    hidden_states: torch.Tensor | None


class LlamaModel(torch.nn.Module):
    """Llama/Mistral/Qwen2 decoder with fused qkv and gate_up weights, built from a config dict + HF state dict."""

    def __init__(self, config: dict, state_dict: dict[str, torch.Tensor], batch_invariant: bool = False):
        super().__init__()
        self.config = config
        self.dtype = DTYPES[config["dtype"]]
        self.batch_invariant = batch_invariant
        self.decode_threads: int | None = 1  # None: small forwards keep torch's thread count too
        self.measured_decode_threads: int | None = None  # decode_threads.choose's result, once measured
        self.compiled_layers = None  # compiled.CompiledLayers: the layers with the ops between GEMMs fused
        self.fused_layers = None  # fused_layers.build's: the layers as one C++ call (a draft's, an int8_sq target's)
        self.num_layers = config["num_hidden_layers"]
        self.num_heads, self.num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_size, self.hidden_size = config["head_size"], config["hidden_size"]
        self.vocab_size = config["vocab_size"]
        self.eps = config["norm_epsilon"]
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported; Llama-family models use silu")

        def w(name: str) -> torch.Tensor:
            return state_dict[name].to(self.dtype).contiguous()

        quant_algo = (config.get("quantization") or {}).get("quant_algo")
        kernel = {"W8A16": Int8WeightOnly, "W8A8_SQ_PER_CHANNEL": Int8PerToken}.get(quant_algo)
        # float16 weights run on fbgemm's fp16 GEMM (fp32 sums, batch-invariant, 2-8x faster than F.linear in fp16)
        dense = Float16Weights if self.dtype == torch.float16 else DenseLinear

        def linear(prefix: str, names: list[str], bias: torch.Tensor | None = None):
            """One kernel over the fused weights prefix + name (int8 when the state holds them stored)."""
            weights = [state_dict[f"{prefix}{n}.weight"] for n in names]
            if weights[0].dtype != torch.int8:
                return dense(torch.cat([w.to(self.dtype) for w in weights]).contiguous(), bias)
            if kernel is None:
                raise ValueError(f"{prefix}{names[0]}.weight is int8 but quant_algo is {quant_algo!r}; "
                                 "load the engine with load_engine, which dequantizes other formats")
            scale = torch.cat([state_dict[f"{prefix}{n}.weight_scale"] for n in names])
            smoother = state_dict.get(f"{prefix}{names[0]}.smoother")  # fused linears share their input's smoother
            return kernel(torch.cat(weights), scale, bias, smoother)

        tied = config["tie_word_embeddings"] or "lm_head.weight" not in state_dict
        head = w("model.embed_tokens.weight" if tied else "lm_head.weight")  # [vocab, hidden]
        # contiguous rows to gather: a row of a tied head in the wide layout touched a cache line per value (the trained
        # pair's draft spent 62 us of a 409 us four-token chain gathering, its target 35 us of a 785 us step)
        self.embed = head if tied else w("model.embed_tokens.weight")
        # int8 and float16 engines: the output layer stays in 16 bits as in TensorRT-LLM, on a batch-invariant kernel
        # with its own copy of the weights (the head as loaded: no second float32 copy in the wide layout); a float32
        # output layer runs F.linear on the wide layout
        sixteen_bit = kernel is not None or self.dtype == torch.float16
        self.lm_head = head if sixteen_bit else wide_layout(head)  # [vocab, hidden]
        self.lm_head_linear = output_layer_16bit(self.lm_head) if sixteen_bit else dense(self.lm_head)
        # argmax-only rows (SequenceInput.argmax_only) on int8 weights where the int8 screen runs: the same argmax,
        # half the bytes (None: they take lm_head_linear too)
        self.argmax_layer = argmax_output_layer(self.lm_head_linear, self.dtype)
        self.final_norm = w("model.norm.weight") if "model.norm.weight" in state_dict else None  # None: EAGLE drafter
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            bias = None
            if config.get("attention_bias") and p + "self_attn.q_proj.bias" in state_dict:
                bias = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])  # [(H + 2 KVH) * D]
            self.layers.append({
                # EAGLE-1/2 drafters have no input norm in their layer 0: None skips it
                "input_norm": w(p + "input_layernorm.weight") if p + "input_layernorm.weight" in state_dict else None,
                "post_norm": w(p + "post_attention_layernorm.weight"),
                "qkv": linear(p + "self_attn.", ["q_proj", "k_proj", "v_proj"], bias),  # [(H + 2 KVH) * D, hidden]
                "o": linear(p + "self_attn.", ["o_proj"]),
                "gate_up": linear(p + "mlp.", ["gate_proj", "up_proj"]),  # [2 I, hidden]
                "down": linear(p + "mlp.", ["down_proj"]),
            })
        max_pos = max(config.get("max_position_embeddings", 2048), 1)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), rope_inv_freq(config))  # [max_pos, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, D]
        self.rope_cos = emb.cos().to(self.dtype)
        sin = emb.sin().to(self.dtype)
        self.rope_signed_sin = torch.cat([-sin[:, :sin.shape[1] // 2], sin[:, sin.shape[1] // 2:]], dim=-1)
        self.scale = 1.0 / math.sqrt(self.head_size)
        # built (the first time on a machine and torch install, about 25 s) or loaded now, not in the first forward: a
        # served model is ready once its first request runs at speed, within serving.stall_timeout_s
        if self.dtype == torch.float32 and row_attention.supports(self.num_heads, self.num_kv_heads, self.head_size):
            row_attention.kernel()

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_hf(cls, checkpoint_dir: str | Path, dtype: str = "float32", batch_invariant: bool = False) -> "LlamaModel":
        """Load an HF checkpoint directory (config.json + *.safetensors)."""
        from safetensors.torch import load_file

        checkpoint_dir = Path(checkpoint_dir)
        config = config_from_hf(json.loads((checkpoint_dir / "config.json").read_text()), dtype)
        files = sorted(checkpoint_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {checkpoint_dir}; save the model with safe_serialization=True")
        state = {}
        for f in files:
            state.update(load_file(f))
        return cls(config, state, batch_invariant=batch_invariant)

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path, batch_invariant: bool = False) -> "LlamaModel":
        """Load a reference engine directory (config.json + rank0.safetensors, see pipeline.reference.checkpoint)."""
        from pipeline.reference.checkpoint import load_engine

        config, state = load_engine(engine_dir, int8_kernels=True)
        return cls(config.get("pretrained_config", config), state, batch_invariant=batch_invariant)

    def thread_count_invariant(self, kv: KVCache) -> bool:
        """Whether a small forward over `kv` gives the same bits on any thread count: it runs on the project's
        kernels alone (compiled regions, fixed at one thread, around the int8 kernel, or the fused int8 layers, which
        take every forward of chains; row attention; an output layer on the fp16 kernel or on its own fixed threads),
        each of which computes an output element on one thread in a fixed order. Then `decode_threads` is a matter of
        speed only (decode_threads.choose)."""
        lm_head = self.lm_head_linear
        layers_on_kernels = self.compiled_layers is not None or isinstance(self.fused_layers, FusedInt8Layers)
        return (layers_on_kernels and self.dtype == torch.float32 and row_attention.kernel_for(kv) is not None
                and row_attention.supports(self.num_heads, self.num_kv_heads, self.head_size)
                and all(layer[k].kernel is not None for layer in self.layers for k in ("qkv", "o", "gate_up", "down"))
                and (isinstance(lm_head, ScreenedOutputLayer)
                     or isinstance(lm_head, (Float16Weights, Int8PerToken)) and lm_head.kernel is not None))

    def new_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: str | None = None) -> KVCache:
        """A KV cache shaped for this model (kv_dtype "INT8" stores int8 values with per-token-head scales, "BF16"
        bf16 values)."""
        return KVCache(self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_size, self.dtype, kv_dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one greedy decode step reads (the memory roofline's numerator): its logits row on the argmax
        layer where the model has one."""
        head = self.argmax_layer or self.lm_head_linear
        nbytes = head.nbytes + sum(t.numel() * t.element_size() for t in [self.final_norm] if t is not None)
        for layer in self.layers:
            nbytes += sum(v.nbytes if hasattr(v, "nbytes") else v.numel() * v.element_size()
                          for k, v in layer.items() if v is not None)
        return nbytes

    # ---------------------------------------------------------------- forward
    def _linear(self, x: torch.Tensor, kernel) -> torch.Tensor:
        if self.batch_invariant and x.shape[0] > 1 and not kernel.batch_invariant:
            return torch.cat([kernel(x[i:i + 1]) for i in range(x.shape[0])])
        return kernel(x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm with this model's epsilon and dtype."""
        if self.dtype == torch.float32:  # one call: the same bits as HF's normalise-then-scale (tested)
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        # as HF: normalise in fp32, cast back, then scale
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(self.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]; cos, signed_sin: [T, 1, D]. HF's rotate_half(x) * sin == roll(x, D/2) * signed_sin
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin

    @torch.inference_mode()
    def forward(self, seqs: list[SequenceInput], kv: KVCache, return_hidden: bool = False,
                input_embeds: torch.Tensor | None = None, capture_layers: tuple[int, ...] | None = None,
                first_layer_input: torch.Tensor | None = None) -> ForwardOutput:
        """Run the new tokens of every sequence, write their KV, return logits of the requested rows.

        input_embeds [T, hidden] replaces the token embeddings (EAGLE feeds fc(embedding, target feature)).
        capture_layers: with return_hidden, hidden_states are the residual-stream outputs of these layers
        (ascending), concatenated [T, len * hidden], instead of the final-norm output (EAGLE-3 reads the
        target's low / middle / high layers; a drafter reads its pre-norm output).
        first_layer_input [T, in] replaces layer 0's normed input to attention (EAGLE-3's midlayer attends
        over concat(norm(embedding), norm(hidden)), 2 * hidden wide); its residual stays input_embeds.
        """
        # exact mode runs every forward on the decode thread count: a row's sums never depend on the forward's size
        small = self.batch_invariant or sum(len(seq.token_ids) for seq in seqs) <= DECODE_ROWS
        row_kernel = (self.dtype == torch.float32 and all(seq.parents is None for seq in seqs)
                      and row_attention.supports(self.num_heads, self.num_kv_heads, self.head_size)
                      and row_attention.kernel_for(kv) is not None)
        # the fused int8 layers take every forward of chains, prompts too: a prefill 0.70-0.90x the time of the
        # compiled regions with SDPA (32-1024 tokens, docs/benchmarks.md)
        if (row_kernel and isinstance(self.fused_layers, FusedInt8Layers) and input_embeds is None
                and capture_layers is None and first_layer_input is None):
            return self._fused_chains(seqs, kv, return_hidden, small)
        # elsewhere the row attention kernel is exact mode's attention, and otherwise that of decode and verify rows
        # (at most DECODE_ROWS new tokens per sequence, any batch: its one call per layer beats SDPA's per-group calls
        # there, 8 verifies of 5 rows 3x); a long prompt's layers run as compiled regions with SDPA
        row_keys = row_kernel and (self.batch_invariant or max(len(seq.token_ids) for seq in seqs) <= DECODE_ROWS)
        plan = (_AttentionPlan.for_row_attention(seqs, kv.block_size) if row_keys
                else _AttentionPlan.build(seqs, kv.block_size, self.batch_invariant, self.dtype))
        kv.clear(plan.pad_slots)
        with intra_op_threads(self.decode_threads if small else None):
            return self._forward(plan, kv, return_hidden, input_embeds, capture_layers, first_layer_input,
                                 _argmax_rows(seqs))

    def _fused_chains(self, seqs: list[SequenceInput], kv: KVCache, return_hidden: bool, small: bool) -> ForwardOutput:
        """A forward of chains on the fused int8 layers, which build the row attention's plan and gather the
        embeddings and RoPE rows in their op (FusedInt8Layers.chains): the same computation as `_forward` on
        `_AttentionPlan.for_row_attention`'s plan, without its torch calls."""
        for seq in seqs:
            _checked_sizes(seq, kv.block_size)
        self._check_position(max(seq.num_cached + len(seq.token_ids) for seq in seqs) - 1)
        with intra_op_threads(self.decode_threads if small else None):
            hidden = self.fused_layers.chains(seqs, kv)  # [T, hidden]
            logits = self._logits(hidden, _logits_index(seqs), _argmax_rows(seqs))
        return ForwardOutput(logits=logits, hidden_states=hidden if return_hidden else None)

    def _check_position(self, position: int) -> None:
        """A ValueError where `position` has no RoPE row (max_position_embeddings)."""
        if position >= self.rope_cos.shape[0]:
            raise ValueError(f"position {position} exceeds max_position_embeddings {self.rope_cos.shape[0]}")

    def _logits(self, hidden: torch.Tensor, logits_index: torch.Tensor | None,
                argmax_rows: list[bool] | None = None) -> torch.Tensor:
        """The output layer on the rows of hidden [T, hidden] that want logits (None: all) -> [R, vocab] float32; the
        rows argmax_rows marks (None: none) on the argmax layer where the model has one and they are few enough for it
        to pay (Int8Screen.max_rows; either layer gives them the same argmax)."""
        rows = hidden.index_select(0, logits_index) if logits_index is not None else hidden
        screen = self.argmax_layer
        if (screen is None or argmax_rows is None
                or screen.max_rows is not None and sum(argmax_rows) > screen.max_rows):
            return self._linear(rows, self.lm_head_linear).float()
        if all(argmax_rows):
            return self.argmax_layer(rows)
        screened = torch.tensor(argmax_rows)
        top = self.argmax_layer(rows[screened])
        logits = top.new_empty(rows.shape[0], top.shape[1])
        logits[screened] = top
        logits[~screened] = self._linear(rows[~screened], self.lm_head_linear).float()
        return logits

    def _forward(self, plan: "_AttentionPlan", kv: KVCache, return_hidden: bool, input_embeds: torch.Tensor | None,
                 capture_layers: tuple[int, ...] | None, first_layer_input: torch.Tensor | None,
                 argmax_rows: list[bool] | None) -> ForwardOutput:
        tokens = torch.tensor(plan.token_ids, dtype=torch.long)  # [T]
        self._check_position(max(plan.positions))
        positions = torch.tensor(plan.positions, dtype=torch.long)  # [T]
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D]
        sin = self.rope_signed_sin.index_select(0, positions).unsqueeze(1)
        x = self.embed.index_select(0, tokens) if input_embeds is None else input_embeds.to(self.dtype)  # [T, hidden]
        if capture_layers is not None and (list(capture_layers) != sorted(set(capture_layers))
                                           or not all(0 <= li < self.num_layers for li in capture_layers)):
            raise ValueError(f"capture_layers {capture_layers} must be distinct, ascending layer ids below {self.num_layers}")
        if (isinstance(self.fused_layers, FusedDenseLayers) and first_layer_input is None and capture_layers is None
                and plan.row_keys is not None):
            hidden, captured = self.fused_layers(x, cos, sin, kv, plan), []
        elif self.compiled_layers is not None and first_layer_input is None:
            hidden, captured = self.compiled_layers(x, cos, sin, kv, plan, capture_layers)
        else:
            hidden, captured = self._eager_layers(x, cos, sin, kv, plan, capture_layers, first_layer_input)
        logits = self._logits(hidden, plan.logits_index, argmax_rows)  # [R, vocab]
        if not return_hidden:
            return ForwardOutput(logits=logits, hidden_states=None)
        return ForwardOutput(logits=logits, hidden_states=torch.cat(captured, dim=-1) if capture_layers is not None else hidden)

    def _eager_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, plan: "_AttentionPlan",
                      capture_layers: tuple[int, ...] | None, first_layer_input: torch.Tensor | None):
        # the decoder layers and the final norm op by op: (final-norm output [T, hidden], captured layer outputs)
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_size
        captured = []
        for li, layer in enumerate(self.layers):
            if li == 0 and first_layer_input is not None:
                h = first_layer_input.to(self.dtype)
            else:
                h = self.rms_norm(x, layer["input_norm"]) if layer["input_norm"] is not None else x
            qkv = self._linear(h, layer["qkv"])  # [T, (H + 2 KVH) * D]
            qk = self._rope(qkv[:, :(H + KVH) * D].view(-1, H + KVH, D), cos, sin)  # [T, H + KVH, D]
            q, k = qk.split([H, KVH], dim=1)  # [T, H, D], [T, KVH, D]
            attn = self._write_and_attend(li, q, k, qkv[:, (H + KVH) * D:].view(-1, KVH, D), kv, plan)  # [T, H * D]
            x = x + self._linear(attn, layer["o"])
            h = self.rms_norm(x, layer["post_norm"])
            gate, up = self._linear(h, layer["gate_up"]).chunk(2, dim=-1)  # [T, I] each
            x = x + self._linear(F.silu(gate) * up, layer["down"])
            if capture_layers is not None and li in capture_layers:
                captured.append(x)
        return (self.rms_norm(x, self.final_norm) if self.final_norm is not None else x), captured

    def _write_and_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache,
                          plan: "_AttentionPlan") -> torch.Tensor:
        """Store the new tokens' k, v [T, KVH, D] in the cache, then attention of every new token over its sequence's
        visible keys; q: [T, H, D] -> [T, H * D]. On the row attention kernel both are one call."""
        if plan.row_keys is not None:  # every row alone over its own keys: the project's kernel
            return row_attention.write_and_attend(q, k, v, plan.slots, kv.k[layer], kv.v[layer], plan.row_keys, self.scale,
                                                  row_attention.kernel_for(kv))
        kv.write(layer, plan.slots, k, v)
        return self._attention(layer, q, kv, plan)

    def _attention(self, layer: int, q: torch.Tensor, kv: KVCache, plan: "_AttentionPlan") -> torch.Tensor:
        """SDPA attention of every new token over its sequence's visible keys (the cache holds them); q: [T, H, D] ->
        [T, H * D]."""
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_size
        out = q.new_empty(q.shape[0], H * D)
        for rows, batch, keys, mask in plan.groups:  # `rows` of the flat batch as `batch` SDPA batch elements
            if isinstance(keys, slice):  # one sequence over consecutive slots: views, no gather
                G, S = 1, keys.stop - keys.start
            else:
                G, S = keys.shape
                keys = keys.flatten()
            k, v = kv.gather(layer, keys)  # [G * S, KVH, D] each
            k = k.view(G, S, KVH, D).transpose(1, 2)  # [G, KVH, S, D]
            v = v.view(G, S, KVH, D).transpose(1, 2)
            if G != batch:  # one sequence's keys for every row: a stride-0 batch view
                k, v = k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)
            qr = q[rows]  # [n, H, D]
            if batch == qr.shape[0]:
                # one row per batch element: its H // KVH query heads of each KV head are that head's query rows
                # (q head h reads KV head h // (H // KVH), as enable_gqa), so every call computes a row alike
                o = F.scaled_dot_product_attention(qr.view(batch, KVH, H // KVH, D), k, v, attn_mask=mask, scale=self.scale)
            else:  # one batch element, the sequence's new tokens as its query rows
                qb = qr.view(1, -1, H, D).transpose(1, 2)  # [1, H, n, D]
                o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True).transpose(1, 2)
            out[rows] = o.reshape(qr.shape[0], -1)
        return out


def perplexity(model: LlamaModel, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:] given their prefixes, from one prefill."""
    kv = model.new_kv_cache(-(-len(token_ids) // TOKENS_PER_BLOCK), TOKENS_PER_BLOCK)
    seq = SequenceInput(token_ids, 0, list(range(kv.num_blocks)), logits_rows=list(range(len(token_ids) - 1)))
    logits = model([seq], kv).logits  # [N - 1, vocab]
    nll = F.cross_entropy(logits, torch.tensor(token_ids[1:]))
    return float(nll.exp())


@dataclass
class _AttentionPlan:
    """Index tensors of one forward, computed once and shared by every layer."""

    token_ids: list[int]
    positions: list[int]
    slots: torch.Tensor  # [T] cache slot of every new token
    # (rows, batch, keys, mask): one SDPA call for `rows` of the flat batch (a slice or row indices [n]) as `batch`
    # batch elements: one row each (batch = n), or one element whose n query rows are a sequence's new tokens
    # (batch = 1). keys: a slice of S consecutive cache slots, or slots [G, S] (G = 1 or batch); mask
    # [batch, 1, 1, S] or [n, S] (0 = attend, -inf = masked), None: all visible
    groups: list[tuple[slice | torch.Tensor, int, torch.Tensor | slice, torch.Tensor | None]]
    pad_slots: torch.Tensor  # [P] slots after the sequences' last tokens that attention reads masked: zeroed first
    logits_index: torch.Tensor | None  # [R] rows of the flat batch that need logits; None = all
    # (slots, starts, lengths) for the row_attention kernel instead of `groups`: row t attends over
    # slots[starts[t]:starts[t] + lengths[t]], its sequence's first slots up to its own
    row_keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def for_row_attention(cls, seqs: list[SequenceInput], block_size: int) -> "_AttentionPlan":
        """The plan of a forward of chains on the row_attention kernel: row_keys, no SDPA groups.

        The key slots are every sequence's blocks up to its last new token, expanded to slots (a block's slots
        past the sequence's end are never read: a row's length stops at its own slot), so a forward of any
        number of sequences costs a few torch calls; the rows read the same slots in the same order as
        `build`'s per-sequence slot lists did.
        """
        token_ids, positions, slots, blocks, starts, lengths = [], [], [], [], [], []
        for seq in seqs:
            n, c = _checked_sizes(seq, block_size)
            if seq.parents is not None:
                raise ValueError("row attention takes chains: a tree forward needs SDPA's masks (build)")
            table = seq.block_table
            starts += [len(blocks) * block_size] * n  # where this sequence's slots begin in the key slots
            blocks += table[:-(-(c + n) // block_size)]
            token_ids += seq.token_ids
            positions += range(c, c + n)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
            lengths += range(c + 1, c + n + 1)
        key_slots = (torch.tensor(blocks, dtype=torch.long)[:, None] * block_size + _block_offsets(block_size)).flatten()
        keys = (key_slots, torch.tensor(starts, dtype=torch.long), torch.tensor(lengths, dtype=torch.long))
        new_slots = torch.tensor(slots, dtype=torch.long)
        return cls(token_ids, positions, new_slots, [], _NO_SLOTS, _logits_index(seqs), keys)

    @classmethod
    def build(cls, seqs: list[SequenceInput], block_size: int, batch_invariant: bool,
              dtype: torch.dtype) -> "_AttentionPlan":
        """The plan of a forward on SDPA (masks additive, in the compute `dtype`).

        batch_invariant: every row is its own batch element, and its call has exactly the key count a plain
        decode of its slot has: its slot index + 1, aligned up to KEY_ALIGN (rows of one sequence, or decodes of
        several, that share that count share a call). So a verify row and a plain decode step of the same token
        make the same computation, whatever else is in the forward. Else a sequence's new tokens are the query
        rows of one masked call, and one-token sequences share one call padded to the longest.
        """
        align = KEY_ALIGN if batch_invariant else 1
        token_ids, positions, slots, groups, pad_slots = [], [], [], [], []
        decodes: list[tuple[int, torch.Tensor, int]] = []  # one-token sequences (row, slots, key count): grouped last
        row = 0
        for seq in seqs:
            n, c = _checked_sizes(seq, block_size)
            blocks = torch.tensor(seq.block_table, dtype=torch.long)
            all_slots = (blocks[:, None] * block_size + _block_offsets(block_size)).flatten()  # [capacity]
            if seq.parents is None:
                depth = list(range(1, n + 1))
                ancestors = None
            else:
                depth, ancestors = [], []
                for i, p in enumerate(seq.parents):
                    if not -1 <= p < i:
                        raise ValueError(f"tree token {i} has parent {p}: parents must come before their children")
                    depth.append(1 if p < 0 else depth[p] + 1)
                    ancestors.append(([] if p < 0 else ancestors[p]) + [i])
            token_ids += seq.token_ids
            positions += [c + d - 1 for d in depth]
            slots.append(all_slots[c:c + n])
            if n == 1:
                decodes.append((row, all_slots, c + 1))
            else:
                visible = torch.ones(n, c + n, dtype=torch.bool).tril(diagonal=c)  # [n, c + n] True = attend
                if ancestors is not None:
                    visible[:, c:] = False
                    for i, anc in enumerate(ancestors):
                        visible[i, [c + a for a in anc]] = True
                if batch_invariant:
                    groups += _exact_rows(row, visible, all_slots, block_size, pad_slots)
                else:
                    keys, _ = _slots_or_range(all_slots, c + n, block_size, 1, pad_slots)
                    groups.append((slice(row, row + n), 1, keys, visible))
            row += n
        buckets: dict[int, list] = {}  # batch-invariant: decodes with the same aligned key count share a call; else all
        for decode in decodes:
            buckets.setdefault(_aligned(decode[2], align) if batch_invariant else 0, []).append(decode)
        for bucket in buckets.values():
            groups += _decode_group(bucket, block_size, align, pad_slots)
        pad = torch.cat(pad_slots) if pad_slots else _NO_SLOTS
        # additive masks, made once for every layer (SDPA would turn a boolean mask into one per call: the same values)
        groups = [(rows, batch, keys, None if mask is None else torch.zeros(mask.shape, dtype=dtype).masked_fill_(
            ~mask, float("-inf"))) for rows, batch, keys, mask in groups]
        return cls(token_ids, positions, torch.cat(slots), groups, pad, _logits_index(seqs))


_NO_SLOTS = torch.empty(0, dtype=torch.long)  # no padding slots to clear (read only)


def _argmax_rows(seqs: list[SequenceInput]) -> list[bool] | None:
    """Per logits row (in _logits_index's order), whether only its argmax is read; None when no row's is."""
    if not any(seq.argmax_only for seq in seqs):
        return None
    return [seq.argmax_only for seq in seqs
            for _ in (seq.logits_rows if seq.logits_rows is not None else [None])]


def _logits_index(seqs: list[SequenceInput]) -> torch.Tensor | None:
    """[R] the rows of a forward's flat batch whose logits its sequences want (each its logits_rows, else its last new
    token), in order; None when that is every row."""
    rows, row = [], 0
    for seq in seqs:
        n = len(seq.token_ids)
        rows += [row + r for r in (seq.logits_rows if seq.logits_rows is not None else [n - 1])]
        row += n
    return None if rows == list(range(row)) else torch.tensor(rows, dtype=torch.long)


def _checked_sizes(seq: SequenceInput, block_size: int) -> tuple[int, int]:
    """(new tokens, cached tokens) of a sequence whose block table holds them all; else a ValueError."""
    n, c = len(seq.token_ids), seq.num_cached
    if n == 0:
        raise ValueError("a sequence in a forward must bring at least one new token")
    if len(seq.block_table) * block_size < c + n:
        raise ValueError(f"block table holds {len(seq.block_table) * block_size} tokens, the sequence needs {c + n}")
    return n, c


@functools.cache
def _block_offsets(block_size: int) -> torch.Tensor:
    """[block_size] slot offsets within a block (read only)."""
    return torch.arange(block_size)


def _aligned(length: int, align: int) -> int:
    """The key count of an attention call over `length` keys: the next multiple of `align`."""
    return -(-length // align) * align


def _rows(rows: list[int]) -> slice | torch.Tensor:
    """Rows of the flat batch: a slice when consecutive, else their indices."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.long)


def _exact_rows(row: int, visible: torch.Tensor, all_slots: torch.Tensor, block_size: int,
                pad_slots: list[torch.Tensor]) -> list[tuple]:
    """Batch-invariant groups of one sequence's n new tokens (flat rows row..row + n - 1; visible [n, c + n]): new
    token i is its own batch element over the first _aligned(c + i + 1) keys (the key count of a plain decode of its
    slot), masked; tokens with the same count share a call."""
    n, width = visible.shape
    buckets: dict[int, list[int]] = {}
    for i in range(n):
        buckets.setdefault(_aligned(width - n + i + 1, KEY_ALIGN), []).append(i)
    groups = []
    for S, members in buckets.items():
        keys, _ = _slots_or_range(all_slots, min(S, width), block_size, KEY_ALIGN, pad_slots)
        mask = F.pad(visible[members, :min(S, width)], (0, max(S - width, 0)), value=False)  # [m, S]
        groups.append((_rows([row + i for i in members]), len(members), keys, mask[:, None, None, :]))
    return groups


def _decode_group(decodes: list[tuple[int, torch.Tensor, int]], block_size: int, align: int,
                  pad_slots: list[torch.Tensor]) -> list[tuple]:
    """One attention group for one-token rows (row, the sequence's slots, its key count): one batch element per row,
    keys padded to the longest and masked."""
    lengths = torch.tensor([length for _, _, length in decodes])
    if len(decodes) == 1:
        row, all_slots, length = decodes[0]
        keys, S = _slots_or_range(all_slots, length, block_size, align, pad_slots)
    else:
        S = _aligned(int(lengths.max()), align)
        # padding keys repeat each row's first slot (masked: any finite value gives the same bits)
        keys = torch.stack([F.pad(k[:n], (0, S - n), value=int(k[0])) for _, k, n in decodes])  # [B, S]
    mask = None if S == int(lengths.min()) else (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, S]
    return [(_rows([r for r, _, _ in decodes]), len(decodes), keys, mask)]


def _slots_or_range(all_slots: torch.Tensor, length: int, block_size: int, align: int,
                    pad_slots: list[torch.Tensor]) -> tuple[torch.Tensor | slice, int]:
    """One sequence's first `length` key slots of all_slots [capacity], padded to S = _aligned(length, align).

    Returns (keys, S): a slice when the slots are consecutive (a view of the cache, no gather), its padding
    slots, which follow the sequence's last token in its own last block, added to pad_slots (the forward
    zeroes them: never-written cache memory may hold NaN); else slots [1, S] padded with the first slot.
    """
    slots, S = all_slots[:length], _aligned(length, align)
    first = int(slots[0])
    consecutive = int(slots[-1]) - first == length - 1 and (length < 3 or bool((slots.diff() == 1).all()))
    if consecutive and block_size % align == 0:
        if S > length:
            pad_slots.append(all_slots[length:S])
        return slice(first, first + S), S
    return F.pad(slots, (0, S - length), value=first)[None], S
