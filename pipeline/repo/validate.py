"""Validate an assembled model repository before a server ever sees it.

Checks, each failing with a `RepoError` that names the model, the problem and the fix:
- every config.pbtxt parses as Triton's ModelConfig protobuf and holds no `${...}` placeholder;
- tensor names, data types, dims, reshape and optional flags match NVIDIA's contract
  (pipeline/contracts/triton-trtllm-backend-models.json), required inputs are declared, and
  anything else is one of our documented extensions; parameter keys likewise;
- cross-checks against the engines: max_batch_size <= the engine's, the BLS's num_draft_tokens
  <= the target's max_draft_len, the draft engine gathers generation logits when
  use_draft_logits is on, and every tokenizer_dir is the target's tokenizer (the draft's
  vocabulary must equal it).
"""

from __future__ import annotations

import json
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.modes import traits
from pipeline.repo.interface import EXTENSIONS, MODEL_NAMES, Interface, TensorSpec, contract_interface
from pipeline.spec import Spec


class RepoError(ValueError):
    """A model repository problem: `model` names the model (or file), `fix` says what to do."""

    def __init__(self, model: str, problem: str, fix: str):
        self.model, self.problem, self.fix = model, problem, fix
        super().__init__(f"{model}: {problem}; fix: {fix}")


def load_config(path: Path) -> mc.ModelConfig:
    """Parse one config.pbtxt, rejecting placeholders and anything Triton's schema rejects."""
    text = path.read_text()
    model = path.parent.name
    if "${" in text:
        line = next(l for l in text.splitlines() if "${" in l).strip()
        raise RepoError(model, f"{path} still holds a template placeholder ({line})", "fill every ${...} value")
    try:
        return text_format.Parse(text, mc.ModelConfig())
    except text_format.ParseError as exc:
        raise RepoError(model, f"{path} is not a valid Triton ModelConfig: {exc}", "regenerate it with `make repo`") from None


def _declared(t: mc.ModelInput | mc.ModelOutput, is_input: bool) -> TensorSpec:
    return TensorSpec(name=t.name, data_type=mc.DataType.Name(t.data_type), dims=tuple(t.dims),
                      optional=t.optional if is_input else False,
                      reshape=tuple(t.reshape.shape) if t.HasField("reshape") else None,
                      allow_ragged_batch=t.allow_ragged_batch if is_input else False)


def check_interface(model: str, cfg: mc.ModelConfig) -> None:
    """Tensors and parameter keys of `cfg` against NVIDIA's contract plus our EXTENSIONS."""
    nvidia = contract_interface(model)
    ext = EXTENSIONS.get("tensorrt_llm" if model == "tensorrt_llm_draft" else model, Interface((), (), frozenset()))
    for kind, declared_list, expected, extra in (
            ("input", cfg.input, nvidia.inputs, ext.inputs), ("output", cfg.output, nvidia.outputs, ext.outputs)):
        want = {t.name: t for t in expected + extra}
        seen = set()
        for raw in declared_list:
            got = _declared(raw, kind == "input")
            if got.name in seen:
                raise RepoError(model, f"{kind} {got.name} is declared twice", "declare each tensor once")
            seen.add(got.name)
            exp = want.get(got.name)
            if exp is None:
                raise RepoError(model, f"{kind} {got.name} is not in NVIDIA's interface nor a documented extension",
                                "remove it or add it to pipeline/repo/interface.py EXTENSIONS")
            for attr in ("data_type", "dims", "reshape", "optional"):
                if getattr(got, attr) != getattr(exp, attr):
                    raise RepoError(model, f"{kind} {got.name} has {attr} {getattr(got, attr)}, the contract says "
                                    f"{getattr(exp, attr)}", f"set {attr} to {getattr(exp, attr)}")
        if kind == "input":
            missing = [t.name for t in expected if not t.optional and t.name not in seen]
            if missing:
                raise RepoError(model, f"required inputs {missing} are missing", "declare them as NVIDIA's template does")
    allowed = nvidia.parameter_keys | ext.parameter_keys
    unknown = sorted(set(cfg.parameters) - allowed)
    if unknown:
        raise RepoError(model, f"parameter keys {unknown} are not NVIDIA's nor documented extensions",
                        f"use one of {sorted(allowed)}")


def _param(cfg: mc.ModelConfig, key: str, default: str = "") -> str:
    return cfg.parameters[key].string_value if key in cfg.parameters else default


def _vocab(tokenizer_dir: Path) -> dict | None:
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("model", {}).get("vocab")


def check_engines(configs: dict[str, mc.ModelConfig], spec: Spec, target, draft) -> None:
    """Cross-checks between the configs and the engines they serve."""
    engines = {"tensorrt_llm": target, "tensorrt_llm_draft": draft}
    for name, engine in engines.items():
        if engine is None:
            continue
        cfg = configs[name]
        if cfg.max_batch_size > engine.max_batch_size:
            raise RepoError(name, f"max_batch_size {cfg.max_batch_size} exceeds the engine's {engine.max_batch_size}",
                            f"set engine.max_batch_size <= {engine.max_batch_size} or rebuild the engine")
        if Path(_param(cfg, "gpt_model_path")) != engine.path:
            raise RepoError(name, f"gpt_model_path {_param(cfg, 'gpt_model_path')} is not the engine {engine.path}",
                            "regenerate the repository with `make repo`")
    bls = configs["tensorrt_llm_bls"]
    k = int(_param(bls, "num_draft_tokens", "0"))
    if k > target.max_draft_len and traits(spec.speculative.mode).bls_drafts:
        raise RepoError("tensorrt_llm_bls", f"num_draft_tokens {k} exceeds the target engine's max_draft_len {target.max_draft_len}",
                        f"lower speculative.num_draft_tokens to <= {target.max_draft_len} or rebuild with a larger max_draft_len")
    if _param(bls, "use_draft_logits") == "true":
        if draft is None:
            raise RepoError("tensorrt_llm_bls", "use_draft_logits is on but there is no draft model", "set speculative.use_draft_logits: false")
        if not draft.gather_generation_logits:
            raise RepoError("tensorrt_llm_draft", "use_draft_logits is on but the draft engine does not gather generation logits",
                            "rebuild the draft with gather_generation_logits (make engines)")
    if bool(_param(bls, "tensorrt_llm_draft_model_name")) != (draft is not None):
        raise RepoError("tensorrt_llm_bls", "tensorrt_llm_draft_model_name disagrees with the presence of a draft engine",
                        "regenerate the repository with `make repo`")
    target_tok = spec.models.target.checkpoint.resolve()
    for name in ("preprocessing", "postprocessing", "tensorrt_llm_bls", "ensemble"):
        tok = Path(_param(configs[name], "tokenizer_dir")).resolve()
        if tok != target_tok:
            raise RepoError(name, f"tokenizer_dir {tok} is not the target's tokenizer {target_tok}",
                            "point tokenizer_dir at models.target.checkpoint")
    if spec.models.draft is not None:
        tv, dv = _vocab(target_tok), _vocab(spec.models.draft.checkpoint)
        if tv is not None and dv is not None and tv != dv:
            raise RepoError("tensorrt_llm_draft", "the draft's tokenizer vocabulary differs from the target's",
                            "use a draft of the same family (same tokenizer) as models.target")
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise RepoError("tensorrt_llm_draft", f"draft vocab_size {draft.vocab_size} != target {target.vocab_size}",
                            "use a draft with the target's (padded) vocabulary")


def validate_repo(repo: Path, spec: Spec, target, draft) -> dict[str, mc.ModelConfig]:
    """Run every check on the repository at `repo`; returns the parsed configs by model name."""
    repo = Path(repo)
    expected = [n for n in MODEL_NAMES if n != "tensorrt_llm_draft" or draft is not None]
    configs = {}
    for name in expected:
        path = repo / name / "config.pbtxt"
        if not path.is_file():
            raise RepoError(name, f"{path} is missing", "regenerate the repository with `make repo`")
        cfg = load_config(path)
        if cfg.name != name:
            raise RepoError(name, f"config name {cfg.name!r} differs from its folder", f"set name: \"{name}\"")
        if cfg.backend == "python" and not (repo / name / "1" / "model.py").is_file():
            raise RepoError(name, "python backend but no 1/model.py", "regenerate the repository with `make repo`")
        check_interface(name, cfg)
        configs[name] = cfg
    mbs = spec.engine.max_batch_size
    for name, cfg in configs.items():
        if cfg.max_batch_size != mbs:
            raise RepoError(name, f"max_batch_size {cfg.max_batch_size} differs from engine.max_batch_size {mbs}",
                            "regenerate the repository with `make repo`")
    check_engines(configs, spec, target, draft)
    return configs
