"""Assemble the Triton model repository of a spec, for either toolchain.

Model names, tensors and parameter keys are NVIDIA's inflight_batcher_llm ones
(preprocessing, postprocessing, tensorrt_llm, tensorrt_llm_draft, tensorrt_llm_bls, ensemble).
The ensemble serves NVIDIA's ensemble interface with tensorrt_llm_bls's code, so a text request
speculates when it sets num_draft_tokens. The python models (everything but the trtllm engines) are the files of
model_repo/ in this project, the same code for both toolchains.

    repo = assemble(make_plan(spec, "reference"))      # -> <out_dir>/model_repo

Everything comes from the Plan (its inspection: memory plan, vocabulary; its build steps: the limits of
engines a GPU host will build) and from built engines' config.json: the checkpoints are not read again.
"""

from __future__ import annotations

import json
import os
import shutil
import dataclasses
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from pipeline.limits import EngineLimits
from pipeline.modes import traits
from pipeline.repo.config import DynamicBatching, ModelConfigSpec
from pipeline.repo.interface import ENGINE_LOOKUP_INPUTS, interface
from pipeline.serving.params import format_draft_token_costs, format_row_costs
from pipeline.spec import NgramSpec, Spec, SpecError
from pipeline.toolchains import lookup_in_engine, toolchain_traits
from specbuild.plan import Plan, engine_limits

MODEL_CODE_DIR = Path(__file__).resolve().parent.parent.parent / "model_repo"


@dataclass(frozen=True)
class EngineInfo(EngineLimits):
    """What the repository needs to know about one engine: its limits, where it is, its vocabulary."""

    path: Path = field(kw_only=True)
    vocab_size: int = field(kw_only=True)

    @classmethod
    def from_engine_dir(cls, engine_dir: Path) -> "EngineInfo":
        """Read a built engine's config.json (reference engines, or trtllm engines on the GPU host)."""
        cfg_path = Path(engine_dir) / "config.json"
        if not cfg_path.is_file():
            raise SpecError("engines", f"{cfg_path} does not exist", "run `make engines` (python -m pipeline engines SPEC) first")
        cfg = json.loads(cfg_path.read_text())
        return cls(path=Path(engine_dir).resolve(), vocab_size=cfg["pretrained_config"]["vocab_size"],
                   **EngineLimits.build_config_values(cfg["build_config"]))

    @classmethod
    def planned(cls, plan: Plan, role: str, path: Path) -> "EngineInfo":
        """The engine a GPU host will build from the plan's build step (not built here)."""
        limits = engine_limits(plan.spec, role)
        return cls(path=path, vocab_size=plan.inspection.models[role].vocab_size, **dataclasses.asdict(limits))


def kv_fractions(plan: Plan) -> dict[str, float]:
    """kv_cache_free_gpu_mem_fraction per engine role, from the memory plan (which honours the spec's values)."""
    return {e.role: e.kv_fraction for e in plan.inspection.memory.engines}


def _choices_brace(choices) -> str:
    """TensorRT-LLM's brace format for medusa_choices / eagle_choices, e.g. "{0}, {0, 0}"."""
    return ", ".join("{" + ", ".join(str(i) for i in c) + "}" for c in choices)


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _ngram_params(ngram) -> dict[str, str]:
    """Prompt lookup's settings (a `pipeline.spec.NgramSpec`, None: its defaults) as model parameters."""
    ngram = ngram or NgramSpec()
    return {"ngram_min": str(ngram.min_ngram), "ngram_max": str(ngram.max_ngram),
            "ngram_min_token_prob": str(ngram.min_token_prob)}


class DraftTokenCosts(NamedTuple):
    """What draft tokens cost a speculative step on the engines built here, per running batch size, in plain steps of
    that batch (`measured_draft_token_costs`; () = free or not measured)."""

    # (batch, one draft token's cost in drafts of the spec's K), ...: the break-even
    at_k: tuple[tuple[int, float], ...] = ()
    # the same for drafts of one token, where the engine runs prompt lookup under pipeline.reference.policy: with at_k
    # it gives a step's fixed cost and its cost per token (PolicyConfig.step_costs)
    at_one: tuple[tuple[int, float], ...] = ()
    # there also (batch, a step's cost with 0, 1, 2, ... draft rows), every batch size from ROW_COST_FIRST_BATCH up to
    # COST_BATCHES' largest (pipeline.reference.step_cost.row_costs): the row count a step's drafts are cut to
    # (PolicyProposer.fit_rows)
    rows: tuple[tuple[int, tuple[float, ...]], ...] = ()


def _policy_params(s, draft_token_costs: tuple[tuple[int, float], ...]) -> dict[str, str]:
    """The speculation policy's settings (a `pipeline.spec.SpeculativeSpec`) for whichever model applies it."""
    return {"num_draft_tokens": str(s.num_draft_tokens), "min_acceptance_rate": str(s.min_acceptance_rate),
            "draft_token_cost": format_draft_token_costs(draft_token_costs),
            "max_batch_for_speculation": str(s.max_batch_for_speculation)}


def engine_model(spec: Spec, toolchain: str, name: str, engine: EngineInfo, kv_fraction: float,
                 costs: DraftTokenCosts = DraftTokenCosts()) -> ModelConfigSpec:
    """tensorrt_llm or tensorrt_llm_draft: the tensorrtllm backend (trtllm) or the reference engine (python).

    costs: what draft tokens cost per running batch size, measured on the engines (`measured_draft_token_costs`), for
    the switch-off and batch gate of a target engine that runs prompt lookup.
    """
    s = spec.speculative
    params = {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": str(engine.path),
        "max_beam_width": "1",
        "kv_cache_free_gpu_mem_fraction": str(kv_fraction),
        "enable_kv_cache_reuse": _bool(spec.serving.enable_kv_cache_reuse),
        # NVIDIA's draft-target recipe fills exclude_input_in_output:False: its stock BLS and clients read the
        # prompt back in output_ids. Our BLS sends exclude_input_in_output per call, so either default serves it.
        "exclude_input_in_output": "false",
        "batch_scheduler_policy": "guaranteed_no_evict",
    }
    heads_field = traits(s.mode).heads_field
    if name == "tensorrt_llm" and heads_field is not None:  # the engine speculates itself on its heads' tree
        params.update({"decoding_mode": traits(s.mode).engine_decoding_mode,
                       f"{heads_field}_choices": _choices_brace(getattr(s, heads_field).choices)})
        if heads_field == "eagle" and toolchain_traits(toolchain).grows_eagle2_tree and s.eagle.version == 2:
            params["eagle_dynamic_tree_top_k"] = str(s.eagle.dynamic_tree_top_k)  # the reference engine grows EAGLE-2's tree
    if name == "tensorrt_llm_draft" and toolchain_traits(toolchain).engines_built_here:
        params["engine_role"] = "draft"  # the reference engine runs a draft's float32 output layer in 16 bits
    engine_lookup = name == "tensorrt_llm" and lookup_in_engine(s.mode, toolchain)
    if engine_lookup:  # the engine drafts by prompt lookup every step, under the spec's policy (load_serving_engine)
        params.update(speculative_mode=s.mode, **_ngram_params(s.ngram), **_policy_params(s, costs.at_k),
                      one_token_cost=format_draft_token_costs(costs.at_one), row_cost=format_row_costs(costs.rows))
    if toolchain_traits(toolchain).engine_backend == "tensorrtllm":
        params["executor_worker_path"] = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
    iface = interface(name)
    inputs = iface.inputs if engine_lookup else tuple(t for t in iface.inputs if t.name not in ENGINE_LOOKUP_INPUTS)
    return ModelConfigSpec(
        name=name, backend=toolchain_traits(toolchain).engine_backend,
        max_batch_size=spec.engine.max_batch_size, inputs=inputs, outputs=iface.outputs,
        decoupled=spec.serving.decoupled, instance_count=1,
        # The engine batches in flight itself (decoupled or not, requests are handed over at once): no queue delay.
        dynamic_batching=DynamicBatching(preferred_batch_size=(spec.engine.max_batch_size,), max_queue_delay_microseconds=0),
        parameters=params)


def text_model(spec: Spec, name: str, tokenizer_dir: Path) -> ModelConfigSpec:
    """preprocessing or postprocessing: the target's tokenizer."""
    iface = interface(name)
    if name == "preprocessing":
        params = {"tokenizer_dir": str(tokenizer_dir), "add_special_tokens": "false"}
        count = spec.serving.preprocessing_instances
        batching = DynamicBatching(preferred_batch_size=(spec.engine.max_batch_size,),
                                   max_queue_delay_microseconds=spec.serving.max_queue_delay_microseconds)
    else:
        params = {"tokenizer_dir": str(tokenizer_dir), "skip_special_tokens": "true"}
        count = spec.serving.postprocessing_instances
        batching = DynamicBatching()
    return ModelConfigSpec(name=name, backend="python", max_batch_size=spec.engine.max_batch_size,
                           inputs=iface.inputs, outputs=iface.outputs, instance_count=count,
                           dynamic_batching=batching, parameters=params)


def bls_model(spec: Spec, toolchain: str, tokenizer_dir: Path, target: EngineInfo, has_draft: bool,
              draft_token_costs: tuple[tuple[int, float], ...] = ()) -> ModelConfigSpec:
    """tensorrt_llm_bls: the concurrent speculative orchestrator (streaming when serving.decoupled).

    draft_token_costs: the break-even acceptance measured on the engines (`measured_draft_token_costs`).
    """
    s = spec.speculative
    params = {
        "accumulate_tokens": "false",
        "tensorrt_llm_model_name": "tensorrt_llm",
        "tensorrt_llm_draft_model_name": "tensorrt_llm_draft" if has_draft else "",
        "tokenizer_dir": str(tokenizer_dir),
        "skip_special_tokens": "true",
        "speculative_mode": s.mode,
        "max_draft_len": str(target.max_draft_len),
        "use_draft_logits": _bool(s.use_draft_logits),
        "max_input_len": str(target.max_input_len),
        "max_seq_len": str(target.max_seq_len),
        # A verify call sends the whole sequence as input_ids: TensorRT-LLM bounds it by max_input_len,
        # the reference python model accepts up to max_seq_len - 1.
        "verify_input_len": str(target.max_input_len if toolchain_traits(toolchain).verify_bounded_by_max_input_len
                                else target.max_seq_len - 1),
        "min_new_tokens_for_speculation": str(s.min_new_tokens_for_speculation),
        "stall_timeout_s": str(spec.serving.stall_timeout_s),
        "stream_interval": str(spec.serving.stream_interval),
        **_policy_params(s, draft_token_costs),
    }
    if lookup_in_engine(s.mode, toolchain):  # the target drafts: the BLS streams and forwards each request's K
        params["engine_lookup"] = "true"
    elif traits(s.mode).prompt_lookup:
        params.update(_ngram_params(s.ngram))
    iface = interface("tensorrt_llm_bls")
    return ModelConfigSpec(name="tensorrt_llm_bls", backend="python", max_batch_size=spec.engine.max_batch_size,
                           inputs=iface.inputs, outputs=iface.outputs, decoupled=spec.serving.decoupled,
                           instance_count=spec.serving.bls_instances, parameters=params)


def ensemble_model(bls: ModelConfigSpec) -> ModelConfigSpec:
    """ensemble: NVIDIA's text interface plus num_draft_tokens/use_draft_logits, served by the BLS's code.

    Not a Triton ensemble: Triton (2.51 and later) checks a cancelled ensemble request only between
    its steps, so a one-step ensemble never passes a client's cancellation to the BLS, which kept
    generating after the client left. As a python model running the BLS's code it sees the
    cancellation itself (docs/reliability.md); clients see the same inputs and outputs.
    """
    iface = interface("ensemble")
    missing = [t.name for t in iface.inputs if t.name not in {i.name for i in bls.inputs}]
    if missing:  # the BLS's code reads its inputs by name: a contract change would silently drop these
        raise RuntimeError(f"ensemble inputs {missing} have no tensorrt_llm_bls input")
    return replace(bls, name="ensemble", inputs=iface.inputs, outputs=iface.outputs)


def engine_infos(plan: Plan) -> tuple[EngineInfo, EngineInfo | None]:
    """Target and draft engine facts: read from built engines (reference) or from the plan (trtllm)."""
    has_draft = traits(plan.spec.speculative.mode).has_draft_engine
    tc = toolchain_traits(plan.toolchain)
    engines = plan.spec.out_dir / tc.out_subdir / "engines"
    if not tc.engines_built_here:  # the GPU host's build script links them there
        target = EngineInfo.planned(plan, "target", engines / "target")
        draft = EngineInfo.planned(plan, "draft", engines / "draft") if has_draft else None
    else:
        target = EngineInfo.from_engine_dir(engines / "target")
        draft = EngineInfo.from_engine_dir(engines / "draft") if has_draft else None
    return target, draft


# the running batch sizes a draft token's cost is measured at, where the engine applies the policy (up to the spec's
# max_batch_for_speculation; the BLS's rounds are one request's: batch 1 only)
COST_BATCHES = (1, 2, 4, 8)
# the smallest running batch size whose steps are priced by their row count (PolicyProposer.fit_rows): one request's
# draft of K <= 5 stays within the AVX2 int8 GEMM's first 6-row block, and with the cut `make bench-engine` read prompt
# lookup at batch 1 at 1.06x its fixed K=4 where it read 1.14x without (docs/benchmarks.md)
ROW_COST_FIRST_BATCH = 2


def measured_draft_token_costs(plan: Plan, target: EngineInfo, draft: EngineInfo | None) -> DraftTokenCosts:
    """What one draft token costs a speculative step on the engines built here, as a fraction of a plain step, per
    running batch size (the switch-off's break-even, pipeline.reference.step_cost) at the spec's K: batch 1 for the
    BLS's rounds, COST_BATCHES up to max_batch_for_speculation where the engine runs prompt lookup itself, and there
    also in one-token drafts (at_one: where a step's fixed part, its calls and the verify's second row, is large,
    short drafts cost more per token than K's; PolicyConfig.step_costs), timed through the engine's steps as it runs
    the lookup (`engine_draft_token_costs`' lookup_in_engine), with a step's cost per draft row count at every batch
    size from ROW_COST_FIRST_BATCH up to the largest (rows, `engine_row_costs`). Nothing where the BLS makes no
    drafts (none, medusa, eagle), where min_acceptance_rate 0 turns the switch-off off, or where the engines are built
    elsewhere (a GPU host: verification rows are nearly free there, and this machine cannot time them).

    Measured here rather than at every model load: it costs seconds, a loaded server would time it
    against its own start-up, and the numbers stay visible in config.pbtxt. Kept in
    `<output dir>/draft_token_cost.json` by engine pair, K, batch sizes, CPU, kernel switches and the engine code's
    digest (the engine links resolve to their cached builds), so the next assembly of the same engines on the same
    machine with the same engine code reuses them.
    """
    s = plan.spec.speculative
    if not (traits(s.mode).bls_drafts and s.num_draft_tokens > 0 and s.min_acceptance_rate > 0
            and toolchain_traits(plan.toolchain).engines_built_here):
        return DraftTokenCosts()
    from pipeline.apps.host import cpu_summary
    from pipeline.reference import cpp_ops, decode_threads, fp16_weight_gemm, int8_grid_gemm, row_attention
    from pipeline.reference.step_cost import (ENGINE_TIMING, engine_code_digest, engine_draft_token_costs,
                                              engine_row_costs)

    in_engine = lookup_in_engine(s.mode, plan.toolchain)
    batches = (1,) if not in_engine else tuple(b for b in COST_BATCHES if b <= max(s.max_batch_for_speculation, 1))
    ks = (s.num_draft_tokens, 1) if in_engine and s.num_draft_tokens > 1 else (s.num_draft_tokens,)
    switches = " ".join(f"{m.ENV}={int(m.switched_on())}" for m in (int8_grid_gemm, fp16_weight_gemm, row_attention))
    builds = [int8_grid_gemm.kernel(), row_attention.kernel()]  # which build of each kernel runs (AVX-512 or AVX2)
    switches += " builds " + ",".join(f"{isa.library}[{' '.join((*isa.flags, *cpp_ops.OPENMP))}]"
                                      for isa in builds if isa is not None)
    switches += (f" {decode_threads.ENV}={os.environ.get(decode_threads.ENV) or 'measured'}; timed {ENGINE_TIMING}"
                 f" by engine code {engine_code_digest()}{' through engine steps' if in_engine else ''}")
    key = (f"{target.path.resolve()} {draft.path.resolve() if draft is not None else 'ngram'} "
           f"K={','.join(map(str, ks))} "
           f"batches={','.join(map(str, batches))} on {cpu_summary()}; {switches}")
    memo_path = plan.spec.out_dir / "draft_token_cost.json"
    memo = json.loads(memo_path.read_text()) if memo_path.is_file() else {}
    row_batches = tuple(range(ROW_COST_FIRST_BATCH, max(batches) + 1))
    rows_key = f"{key}; rows at batches {','.join(map(str, row_batches))}"
    if key not in memo or in_engine and row_batches and rows_key not in memo:
        if key not in memo:  # [[[batch, cost], ...] per K]
            memo[key] = engine_draft_token_costs(target.path, draft.path if draft is not None else None, ks, batches,
                                                 lookup_in_engine=in_engine)
        if in_engine and row_batches:  # [[batch, [cost per draft row count]], ...]
            memo[rows_key] = engine_row_costs(target.path, row_batches, s.num_draft_tokens)
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        memo_path.write_text(json.dumps(memo, indent=2))
    rows = tuple((int(batch), tuple(map(float, costs))) for batch, costs in memo.get(rows_key, ()))
    return DraftTokenCosts(*(tuple((int(batch), float(cost)) for batch, cost in at) for at in memo[key]), rows=rows)


def repo_models(plan: Plan, target: EngineInfo, draft: EngineInfo | None,
                costs: DraftTokenCosts = DraftTokenCosts()) -> list[ModelConfigSpec]:
    """Every model config of the repository (costs: see `measured_draft_token_costs`)."""
    spec, toolchain = plan.spec, plan.toolchain
    tokenizer_dir = spec.models.target.checkpoint  # the target's tokenizer, always
    kv = kv_fractions(plan)
    models = [text_model(spec, "preprocessing", tokenizer_dir), text_model(spec, "postprocessing", tokenizer_dir),
              engine_model(spec, toolchain, "tensorrt_llm", target, kv["target"], costs)]
    if draft is not None:
        models.append(engine_model(spec, toolchain, "tensorrt_llm_draft", draft, kv["draft"]))
    bls = bls_model(spec, toolchain, tokenizer_dir, target, draft is not None, costs.at_k)
    models += [bls, ensemble_model(bls)]
    return models


def repo_dir(spec: Spec, toolchain: str) -> Path:
    """Where `assemble` writes: <out_dir>/model_repo (reference) or <out_dir>/trtllm/model_repo."""
    return spec.out_dir / toolchain_traits(toolchain).out_subdir / "model_repo"


def write_repo(models: list[ModelConfigSpec], dest: Path) -> Path:
    """Write config.pbtxt files and copy the python models' code; replaces `dest` atomically-ish."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for m in models:
        model_dir = tmp / m.name
        (model_dir / "1").mkdir(parents=True)
        (model_dir / "config.pbtxt").write_text(m.render())
        if m.backend == "python":
            code = {"tensorrt_llm_draft": "tensorrt_llm", "ensemble": "tensorrt_llm_bls"}.get(m.name, m.name)
            shutil.copy2(MODEL_CODE_DIR / code / "1" / "model.py", model_dir / "1" / "model.py")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def assemble(plan: Plan) -> Path:
    """Generate, write and validate the model repository of the plan's spec and toolchain; returns its folder."""
    from pipeline.repo.validate import validate_repo

    if toolchain_traits(plan.toolchain).repository == "llmapi":  # one LLM API model on HF checkpoints, no engines
        from pipeline.llmapi import llm_args
        from pipeline.repo.llmapi import write_llmapi_repo
        from specbuild.toolchains import toolchain_module

        dirs = toolchain_module(plan.toolchain).model_dirs(plan)
        return write_llmapi_repo(llm_args(plan.spec, dirs, kv_fractions(plan)["target"]), repo_dir(plan.spec, plan.toolchain))
    target, draft = engine_infos(plan)
    costs = measured_draft_token_costs(plan, target, draft)
    dest = write_repo(repo_models(plan, target, draft, costs), repo_dir(plan.spec, plan.toolchain))
    validate_repo(dest, plan.spec, target, draft)
    return dest
