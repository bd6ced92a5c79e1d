"""The tensor interface and parameter keys of NVIDIA's inflight_batcher_llm models, read from the contract.

`pipeline/contracts/triton-trtllm-backend-models.json` records NVIDIA's config.pbtxt templates
(TensorRT-LLM's triton_backend/all_models/inflight_batcher_llm). Our repository declares the same
tensors, so NVIDIA's clients work unchanged; the few additions are listed in EXTENSIONS and are
the only departures validation allows.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.names import MODEL_NAMES

CONTRACT_PATH = Path(__file__).resolve().parent.parent / "contracts" / "triton-trtllm-backend-models.json"
LOGITS_DATATYPE = "TYPE_FP32"
# Values for the data-type placeholders of the templates (what NVIDIA's docs fill in).
DATATYPE_PLACEHOLDERS = {
    "${logits_datatype}": LOGITS_DATATYPE,
    "${encoder_input_features_data_type}": "TYPE_FP16",
    "${prompt_embedding_table_data_type}": "TYPE_FP16",
}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a Triton model (dims exclude the batch dimension)."""

    name: str
    data_type: str  # Triton's TYPE_* name
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None  # () reshapes to a scalar
    allow_ragged_batch: bool = False


@dataclass(frozen=True)
class Interface:
    """The tensors and parameter keys one model declares."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    parameter_keys: frozenset[str]


# Our additions to NVIDIA's interface. The ensemble runs tensorrt_llm_bls's code (so it carries the
# BLS's parameters) and speculation is one request field away; the python models read a few more parameters.
# Text responses also carry `output_ids`, the token ids behind each text delta, so that a client can
# line up output_log_probs / generation_logits with tokens (the OpenAI frontend's logprobs).
OUTPUT_IDS = TensorSpec("output_ids", "TYPE_INT32", (-1,))
ENGINE_DRAFT_LEN = TensorSpec("num_draft_tokens", "TYPE_INT32", (1,), optional=True)
BLS_PARAMETER_KEYS = frozenset({
    "tokenizer_dir", "speculative_mode", "num_draft_tokens", "max_draft_len", "use_draft_logits",
    "ngram_min", "ngram_max", "ngram_min_token_prob", "max_input_len", "max_seq_len", "verify_input_len", "min_new_tokens_for_speculation",
    "min_acceptance_rate", "draft_token_cost", "max_batch_for_speculation", "skip_special_tokens", "stall_timeout_s",
    "stream_interval", "engine_lookup"})
EXTENSIONS: dict[str, Interface] = {
    "ensemble": Interface(
        inputs=(TensorSpec("num_draft_tokens", "TYPE_INT32", (1,), optional=True),
                TensorSpec("use_draft_logits", "TYPE_BOOL", (1,), optional=True)),
        outputs=(OUTPUT_IDS,), parameter_keys=BLS_PARAMETER_KEYS | {"accumulate_tokens", "tensorrt_llm_model_name",
                                                                  "tensorrt_llm_draft_model_name"}),
    "tensorrt_llm_bls": Interface(inputs=(), outputs=(OUTPUT_IDS,), parameter_keys=BLS_PARAMETER_KEYS),
    # Reference toolchain only: the width of EAGLE-2's dynamic tree (the reference engine grows it; trtllm uses
    # eagle_choices), batch_invariant (default true: exact greedy speculation, see load_serving_engine), engine_role
    # (draft for tensorrt_llm_draft: its output layer may run in 16 bits, see load_serving_engine), and
    # prompt lookup inside the engine (toolchains.lookup_in_engine): its settings, and each request's K as the
    # input num_draft_tokens (0: plain decoding), which the BLS forwards.
    "tensorrt_llm": Interface(inputs=(ENGINE_DRAFT_LEN,), outputs=(), parameter_keys=frozenset({
        "eagle_dynamic_tree_top_k", "batch_invariant", "engine_role", "speculative_mode", "num_draft_tokens",
        "ngram_min", "ngram_max", "ngram_min_token_prob", "min_acceptance_rate", "draft_token_cost", "one_token_cost",
        "row_cost", "max_batch_for_speculation"})),
}
# Inputs only an engine that runs prompt lookup itself reads (TensorRT-LLM's tensorrtllm backend has none of them).
ENGINE_LOOKUP_INPUTS = frozenset({ENGINE_DRAFT_LEN.name})


@functools.lru_cache(maxsize=1)
def contract() -> dict:
    """The parsed contract JSON."""
    return json.loads(CONTRACT_PATH.read_text())


def _tensor(raw: dict) -> TensorSpec:
    reshape = raw.get("reshape")
    return TensorSpec(
        name=raw["name"],
        data_type=DATATYPE_PLACEHOLDERS.get(raw["data_type"], raw["data_type"]),
        dims=tuple(raw["dims"]),
        optional=bool(raw.get("optional", False)),
        reshape=None if reshape is None else tuple(reshape),
        allow_ragged_batch=bool(raw.get("allow_ragged_batch", False)),
    )


def _unique(tensors) -> tuple[TensorSpec, ...]:
    seen: dict[str, TensorSpec] = {}
    for t in tensors:
        seen.setdefault(t.name, t)  # the ensemble template lists one output twice
    return tuple(seen.values())


def contract_interface(model: str) -> Interface:
    """NVIDIA's interface for `model` (tensorrt_llm_draft is a copy of tensorrt_llm)."""
    raw = contract()["models"]["tensorrt_llm" if model == "tensorrt_llm_draft" else model]
    return Interface(
        inputs=_unique(_tensor(t) for t in raw["inputs"]),
        outputs=_unique(_tensor(t) for t in raw["outputs"]),
        parameter_keys=frozenset(p["key"] for p in raw.get("parameters", [])),
    )


def interface(model: str) -> Interface:
    """What our repository declares for `model`: NVIDIA's interface plus EXTENSIONS."""
    base = contract_interface(model)
    ext = EXTENSIONS.get("tensorrt_llm" if model == "tensorrt_llm_draft" else model)
    if ext is None:
        return base
    return Interface(base.inputs + ext.inputs, base.outputs + ext.outputs, base.parameter_keys | ext.parameter_keys)
