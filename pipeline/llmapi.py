"""TensorRT-LLM's LLM API (PyTorch backend) arguments from a spec: the `trtllm-llmapi` toolchain's one config.

One dict of `LLM(**args)` keys drives both servers: Triton's `all_models/llmapi` model (its model.yaml is
these keys plus `triton_config`) and `trtllm-serve --extra_llm_api_options FILE` (the same keys without
`model`, its positional argument). Speculation is a `speculative_config` keyed by `decoding_type`, spelled
as the pinned release reads it (`releases` in pipeline/contracts/llmapi.json, keyed by
stack.TRTLLM_VERSION). `check_llm_args` checks every generated key and value against those facts.
Sources and caveats: pipeline/contracts/llmapi-facts.md. Imports no torch.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from pipeline import stack
from pipeline.modes import traits
from pipeline.spec import Spec, SpecError

CONTRACT = Path(__file__).parent / "contracts" / "llmapi.json"
TOOLCHAIN = "trtllm-llmapi"
# Our qformat / kv_cache_dtype -> ModelOpt hf_ptq.py --qformat / --kv_cache_qformat, for what the
# PyTorch backend loads; the other qformats are refused (check_rules).
MODELOPT_QFORMAT = {"fp8": "fp8", "int4_awq": "int4_awq"}
MODELOPT_KV_QFORMAT = {"none": "none", "fp8": "fp8"}


class ContractError(ValueError):
    """A generated LLM API key or value that the recorded facts do not allow (a bug here, not in the spec)."""


@lru_cache(maxsize=1)
def contract() -> dict:
    """The LLM API facts (pipeline/contracts/llmapi.json)."""
    return json.loads(CONTRACT.read_text())


def spelling(release: str = stack.TRTLLM_VERSION) -> dict:
    """decoding_type names and the draft-path key that `release` reads."""
    releases = contract()["releases"]
    if release not in releases:
        raise SpecError("toolchain", f"no LLM API facts for TensorRT-LLM {release}", f"use one of {', '.join(releases)}")
    return contract()["spellings"][releases[release]["spelling"]]


def check_rules(spec: Spec) -> None:
    """What the PyTorch backend cannot do, refused with the field to change (pipeline/contracts/llmapi-facts.md)."""
    s = spec.speculative
    fix_tc = "or use toolchain: trtllm (TensorRT engines)"
    if traits(s.mode).heads_field == "medusa":
        raise SpecError("speculative.mode", "Medusa has no PyTorch-backend path (MedusaDecodingConfig refuses backend pytorch)",
                        f"use EAGLE-3 heads (mode eagle, eagle.version 3) {fix_tc}")
    if s.eagle is not None and s.eagle.version != 3:
        raise SpecError("speculative.eagle.version", f"EAGLE-{s.eagle.version} has no PyTorch-backend path (its Eagle config "
                        "drafts with EAGLE-3 heads only)", f"use EAGLE-3 weights with version: 3 {fix_tc}")
    if s.eagle is not None:
        chain = tuple((0,) * d for d in range(1, s.num_draft_tokens + 1))
        if tuple(sorted(s.eagle.choices, key=len)) != chain:
            raise SpecError("speculative.eagle.choices", "the PyTorch backend drafts a chain of max_draft_len tokens, not a tree",
                            f"use choices {[list(c) for c in chain]} (a chain of num_draft_tokens), so the reference oracle matches")
    if s.use_draft_logits:
        raise SpecError("speculative.use_draft_logits", "the LLM API has no per-request draft logits",
                        "set it to false (the server verifies as its decoding config says)")
    for role, model in (("target", spec.models.target), ("draft", spec.models.draft)):
        if model is None or (role == "draft" and not traits(s.mode).has_draft_engine):
            continue
        if model.qformat not in ("none", *MODELOPT_QFORMAT):
            raise SpecError(f"models.{role}.qformat", f"{model.qformat} is not a PyTorch-backend recipe",
                            f"use none, {' or '.join(MODELOPT_QFORMAT)} {fix_tc}")
        if model.kv_cache_dtype not in MODELOPT_KV_QFORMAT:
            raise SpecError(f"models.{role}.kv_cache_dtype", f"{model.kv_cache_dtype} KV cache is not a PyTorch-backend recipe",
                            f"use none or fp8 {fix_tc}")
    if s.ngram is not None and s.ngram.min_token_prob > 0:
        raise SpecError("speculative.ngram.min_token_prob", "TensorRT-LLM's NGram drafter has no cut by agreement "
                        "(NGramDecodingConfig)", f"set it to 0 {fix_tc}")


def decoding_config(spec: Spec, draft_dir: Path | None, release: str = stack.TRTLLM_VERSION) -> dict | None:
    """`speculative_config` for the spec's mode (None: no speculation); draft_dir: the draft model or EAGLE-3 heads."""
    s = spec.speculative
    words = spelling(release)
    names, model_key = words["decoding_type"], words["speculative_model_key"]
    mode = traits(s.mode)
    if not mode.speculates:
        return None
    if mode.has_draft_engine:
        return {"decoding_type": names["draft_target"], "max_draft_len": s.num_draft_tokens, model_key: str(draft_dir)}
    if mode.prompt_lookup:  # prompt lookup in the request's own context, latest match first (our NgramProposer)
        ngram = s.ngram
        return {"decoding_type": names["ngram"], "max_draft_len": s.num_draft_tokens,
                "max_matching_ngram_size": ngram.max_ngram if ngram else 3,
                "is_keep_all": True, "is_use_oldest": False, "is_public_pool": False}
    if mode.heads_field == "eagle":
        config = {"decoding_type": names["eagle3"], "max_draft_len": s.num_draft_tokens, model_key: str(draft_dir),
                  "eagle3_one_model": True}
        if s.eagle.layers_to_capture is not None:
            config["eagle3_layers_to_capture"] = sorted(s.eagle.layers_to_capture)
        return config
    if mode.drafts_in_target:  # the target's own MTP modules draft a chain of num_draft_tokens (= max_draft_len)
        config = {"decoding_type": names["mtp"], "num_nextn_predict_layers": s.num_draft_tokens}
        if s.mtp is not None and s.mtp.relaxed_acceptance:
            config |= {"use_relaxed_acceptance_for_thinking": True, "relaxed_topk": s.mtp.relaxed_topk,
                       "relaxed_delta": s.mtp.relaxed_delta}
        return config
    raise SpecError("speculative.mode", f"{s.mode} has no LLM API decoding config", "use eagle (version 3), draft_target, ngram or mtp")


def llm_args(spec: Spec, model_dirs: dict[str, Path], kv_fraction: float | None = None,
             release: str = stack.TRTLLM_VERSION) -> dict:
    """The `LLM(**args)` keys: model_dirs maps target (and draft) to the checkpoint served (quantized or not);
    kv_fraction: the memory plan's free_gpu_memory_fraction (None: the spec's, else the LLM API default)."""
    check_rules(spec)
    s, e = spec.speculative, spec.engine
    draft_dir = model_dirs.get("draft") if traits(s.mode).has_draft_engine else (s.eagle.checkpoint if s.eagle else None)
    speculative = decoding_config(spec, draft_dir, release)
    # a draft model (draft_target, or EAGLE-3 in two-model form) switches block reuse off in 1.0+ and raised
    # "Draft model engine + KV cache reuse is not supported yet" before: say so explicitly
    two_model = speculative is not None and traits(s.mode).has_draft_engine
    kv = {"enable_block_reuse": bool(spec.serving.enable_kv_cache_reuse and not two_model)}
    fraction = kv_fraction if kv_fraction is not None else spec.serving.kv_cache_free_gpu_mem_fraction.target
    if fraction is not None:
        kv["free_gpu_memory_fraction"] = fraction
    if spec.models.target.kv_cache_dtype == "fp8":
        kv["dtype"] = "fp8"
    args = {"model": str(model_dirs["target"]), "backend": "pytorch",
            "tensor_parallel_size": e.tp_size, "pipeline_parallel_size": e.pp_size,
            "max_batch_size": e.max_batch_size, "max_num_tokens": e.max_num_tokens, "max_seq_len": e.max_seq_len,
            "kv_cache_config": kv}
    if speculative is not None:
        args["speculative_config"] = speculative
        args["enable_iter_perf_stats"] = True  # specDecodingStats for the spec_decode_* metrics (serving/llmapi_model.py)
    check_llm_args(args, release)
    return args


def model_yaml(args: dict) -> dict:
    """Triton's llmapi model.yaml: the LLM args plus `triton_config` (batching happens inside the LLM)."""
    return {**args, "triton_config": {"max_batch_size": 0, "decoupled": True}}


def extra_llm_api_options(args: dict) -> dict:
    """trtllm-serve's --extra_llm_api_options file: the LLM args without `model` (a positional argument)."""
    return {k: v for k, v in args.items() if k != "model"}


def check_llm_args(args: dict, release: str = stack.TRTLLM_VERSION) -> None:
    """Every key and value against the facts for `release`; raises ContractError."""
    facts = contract()["llm_args"]
    unknown = set(args) - set(facts["top_level"]) - {"triton_config"}
    if unknown:
        raise ContractError(f"LLM args {sorted(unknown)} are not among the recorded keys")
    if args.get("backend") not in facts["backend"]:
        raise ContractError(f"backend {args.get('backend')!r} is not {facts['backend']}")
    kv = args.get("kv_cache_config", {})
    if set(kv) - set(facts["kv_cache_config"]) or kv.get("dtype", "auto") not in facts["kv_cache_dtype"]:
        raise ContractError(f"kv_cache_config {kv} has keys or a dtype outside the recorded facts")
    if "triton_config" in args and set(args["triton_config"]) - set(contract()["triton_config"]["keys"]):
        raise ContractError(f"triton_config {args['triton_config']} has keys model.py does not read")
    spec_config = args.get("speculative_config")
    if spec_config is None:
        return
    words = spelling(release)
    by_name = {name: mode for mode, name in words["decoding_type"].items()}
    mode = by_name.get(spec_config.get("decoding_type"))
    if mode not in facts["decoding_fields"]:
        raise ContractError(f"decoding_type {spec_config.get('decoding_type')!r} is not one TensorRT-LLM {release} "
                            f"reads for a supported mode ({sorted(by_name)})")
    allowed = {words["speculative_model_key"] if f == "SPECULATIVE_MODEL" else f for f in facts["decoding_fields"][mode]}
    if set(spec_config) - allowed:
        raise ContractError(f"{mode} speculative_config keys {sorted(set(spec_config) - allowed)} are not read by {release}")
    for key in ("max_draft_len", "num_nextn_predict_layers", "relaxed_topk"):  # PositiveInt / > 0 in the facts
        if key in spec_config and not (isinstance(spec_config[key], int) and spec_config[key] > 0):
            raise ContractError(f"{key} must be an integer > 0, not {spec_config[key]!r}")
    if spec_config.get("relaxed_delta", 0.0) < 0:
        raise ContractError(f"relaxed_delta must be >= 0, not {spec_config['relaxed_delta']!r}")
