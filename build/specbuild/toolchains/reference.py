"""The reference toolchain: the plan's steps run here on CPU (convert / quantize with torch, then build).

Each step writes into a temporary folder and is renamed into the content-addressed cache
(specbuild/execute.py); torch is imported only when a step has to run.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import time

from pipeline import stack
from pipeline.spec import Spec, SpecError
from specbuild.execute import (STEP_FILE, entry_dir, folder_bytes, is_cached, link, manifest, remove_stale_temporaries,
                               step_record, write_if_changed)
from specbuild.plan import Plan, Step, make_plan

# Bump when build/specbuild/convert.py changes the numbers it writes (e.g. a calibration change):
# every reference step key changes, so stale engines are rebuilt rather than reused.
REFERENCE_CONVERTER_VERSION = "3"


def versions() -> dict:
    """The versions a reference step's output depends on: our engine format and converter, and torch."""
    try:
        torch_version = importlib.metadata.version("torch")  # metadata only: torch is not imported
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {"reference_format": stack.REFERENCE_FORMAT_VERSION, "reference_converter": REFERENCE_CONVERTER_VERSION,
            "torch": torch_version}


def build(plan: Plan) -> int:
    """The `engines` command: build every missing step of the plan here."""
    run_plan(plan)
    return 0


def build_script(plan: Plan) -> None:
    """None: reference engines build on this machine, there is no script for another host."""
    return None


def run_step(plan: Plan, step: Step) -> None:
    """Run one step of the reference toolchain into a temporary folder and rename it into the cache."""
    from specbuild.convert import build_engine, convert_checkpoint

    spec, cache_dir = plan.spec, plan.spec.output.cache_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".tmp-{step.key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    try:
        if step.kind == "build":
            build_engine(entry_dir(cache_dir, step.upstream), tmp, step.params)
        else:
            model = getattr(spec.models, step.role)
            s = spec.speculative
            convert_checkpoint(step.params, model.checkpoint, tmp,
                               medusa_dir=s.medusa.checkpoint if s.medusa else None,
                               eagle_dir=s.eagle.checkpoint if s.eagle else None,
                               allow_pickle=spec.security.allow_pickle_weights)
        record = {"key": step.key, "kind": step.kind, "built_as": step.label, "params": step.params,
                  "inputs": step.inputs, "versions": step.versions, "upstream": step.upstream,
                  "seconds": round(time.perf_counter() - start, 3), "bytes": folder_bytes(tmp),
                  "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / STEP_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")
        try:
            os.rename(tmp, entry_dir(cache_dir, step.key))
        except OSError:  # another run finished the same key first: its entry is identical
            if not is_cached(cache_dir, step):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_reference_rules(spec: Spec) -> None:
    """What the reference engine cannot run: an FP8 KV cache (it stores KV in the compute dtype or int8)."""
    for role, model in (("target", spec.models.target), ("draft", spec.models.draft)):
        if model is not None and model.kv_cache_dtype == "fp8":
            raise SpecError(f"models.{role}.kv_cache_dtype", "an fp8 KV cache runs on the trtllm toolchain only",
                            "use kv_cache_dtype: int8 or none for reference engines")


def run_reference(spec: Spec) -> Plan:
    """Plan `spec` for the reference toolchain and build every missing step; returns the plan."""
    plan = make_plan(spec, "reference")
    run_plan(plan)
    return plan


def run_plan(plan: Plan) -> None:
    """Build every missing step of a reference plan, printing one line per step; link engines, write the manifest."""
    started = time.perf_counter()
    spec = plan.spec
    check_reference_rules(spec)
    cache_dir = spec.output.cache_dir
    remove_stale_temporaries(cache_dir)
    built = 0
    for i, step in enumerate(plan.steps, 1):
        prefix = f"[{i}/{len(plan.steps)}] {step.label:16s} {step.key}"
        if is_cached(cache_dir, step):
            print(f"{prefix}  cached", flush=True)
            continue
        print(f"{prefix}  running ...", flush=True)
        run_step(plan, step)
        record = step_record(cache_dir, step)
        print(f"{prefix}  built in {record['seconds']:.1f} s ({record['bytes'] / 1e6:.1f} MB)", flush=True)
        built += 1
    for role in plan.roles:
        link(entry_dir(cache_dir, plan.engine_step(role).key), spec.out_dir / "engines" / role)
    write_if_changed(spec.out_dir / "manifest.json", json.dumps(manifest(plan), indent=2, default=str) + "\n")
    elapsed = time.perf_counter() - started
    if built == 0:
        print(f"nothing to do: all {len(plan.steps)} steps cached ({elapsed:.2f} s); engines in {spec.out_dir / 'engines'}")
    else:
        print(f"built {built} of {len(plan.steps)} steps in {elapsed:.1f} s; engines in {spec.out_dir / 'engines'}")
