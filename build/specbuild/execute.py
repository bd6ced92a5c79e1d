"""Execute a plan: skip cached steps, run the rest, link the engines and write the manifest.

The cache (spec.output.cache_dir) is content-addressed: a step's output lives in `<cache>/<key>/`
next to `step.json` (what it was built from, how long it took, how big it is). A step writes into
`<cache>/.tmp-<key>-<pid>/` and is renamed to `<cache>/<key>` only when it succeeded, so Ctrl-C or a
failure never leaves a half-written entry. `<out>/engines/<role>` are symlinks into the cache and
`<out>/manifest.json` lists every engine with its key, inputs, toolchain versions, size and build time.

reference: the steps run here on CPU (build/specbuild/convert.py; torch is imported only when a
step has to run). trtllm: the plan becomes `<out>/trtllm/build_engines.sh`, run here when
TensorRT-LLM and a GPU are present, otherwise handed to a GPU host.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pipeline.checkpoints import inspect_spec
from specbuild.plan import Plan, Step, make_plan, resolve_toolchain
from pipeline.spec import Spec, SpecError, to_dict

STEP_FILE = "step.json"


def entry_dir(cache_dir: Path, key: str) -> Path:
    """Where a step's finished output lives."""
    return cache_dir / key


def is_cached(cache_dir: Path, step: Step) -> bool:
    """A finished entry exists for the step's key (entries appear only by rename, so existing means complete)."""
    return (entry_dir(cache_dir, step.key) / STEP_FILE).is_file()


def folder_bytes(folder: Path) -> int:
    """Bytes of the files in a folder (hard links counted once per folder)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def remove_stale_temporaries(cache_dir: Path) -> None:
    """Delete `.tmp-*` folders left by processes that were killed (pid no longer running)."""
    if not cache_dir.is_dir():
        return
    for tmp in cache_dir.glob(".tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ----------------------------------------------------------------------------- one step


def run_reference_step(plan: Plan, step: Step) -> None:
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


def step_record(cache_dir: Path, step: Step) -> dict:
    """The step.json of a cached step."""
    return json.loads((entry_dir(cache_dir, step.key) / STEP_FILE).read_text())


# ----------------------------------------------------------------------------- whole plan


def link(target: Path, link_path: Path) -> None:
    """Point `link_path` at `target`, replacing an older link atomically."""
    link_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = link_path.with_name(f".{link_path.name}.tmp{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, link_path)


def manifest(plan: Plan) -> dict:
    """Every engine with its key, inputs, versions, sizes and build times (from the cache's step records)."""
    cache_dir = plan.spec.output.cache_dir
    engines = {}
    for role in plan.roles:
        steps = [step_record(cache_dir, s) for s in plan.steps if s.role == role]
        build = plan.engine_step(role)
        engines[role] = {
            "key": build.key,
            "path": str(entry_dir(cache_dir, build.key)),
            "bytes": step_record(cache_dir, build)["bytes"],
            "build_seconds": round(sum(r["seconds"] for r in steps), 3),
            "steps": [{k: r[k] for k in ("kind", "key", "inputs", "params", "versions", "seconds", "bytes", "built_at")}
                      for r in steps],
        }
    return {"spec": plan.spec.name, "source": str(plan.spec.source), "toolchain": plan.toolchain,
            "build_key": plan.build_key, "spec_values": to_dict(plan.spec), "engines": engines}


def write_if_changed(path: Path, text: str) -> bool:
    """Write atomically unless the file already holds exactly `text`; True when written."""
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


def describe_plan(plan: Plan) -> str:
    """The plan as lines: step, key, cached or to build."""
    cache_dir = plan.spec.output.cache_dir
    lines = [f"plan for {plan.spec.name} (toolchain {plan.toolchain}, build key {plan.build_key}):"]
    for i, step in enumerate(plan.steps, 1):
        if plan.toolchain == "trtllm":
            state = "runs on a GPU host (plan --dry-run)"
        else:
            state = "cached" if is_cached(cache_dir, step) else "to build"
        lines.append(f"  [{i}/{len(plan.steps)}] {step.label:16s} {step.key}  {state}")
    return "\n".join(lines)


def check_reference_rules(spec: Spec) -> None:
    """What the reference engine cannot run: an FP8 KV cache (it stores KV in the compute dtype or int8)."""
    for role, model in (("target", spec.models.target), ("draft", spec.models.draft)):
        if model is not None and model.kv_cache_dtype == "fp8":
            raise SpecError(f"models.{role}.kv_cache_dtype", "an fp8 KV cache runs on the trtllm toolchain only",
                            "use kv_cache_dtype: int8 or none for reference engines")


def run_reference(spec: Spec) -> Plan:
    """Build every missing step of the reference plan, printing one line per step."""
    started = time.perf_counter()
    check_reference_rules(spec)
    inspect_spec(spec)  # incompatible checkpoints and impossible memory plans fail before any work
    plan = make_plan(spec, "reference")
    cache_dir = spec.output.cache_dir
    remove_stale_temporaries(cache_dir)
    built = 0
    for i, step in enumerate(plan.steps, 1):
        prefix = f"[{i}/{len(plan.steps)}] {step.label:16s} {step.key}"
        if is_cached(cache_dir, step):
            print(f"{prefix}  cached", flush=True)
            continue
        print(f"{prefix}  running ...", flush=True)
        run_reference_step(plan, step)
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
    return plan


def run_trtllm(spec: Spec) -> int:
    """Write the GPU script; run it here only when TensorRT-LLM and a GPU are present."""
    from specbuild.toolchains.trtllm import render_script

    inspect_spec(spec)
    plan = make_plan(spec, "trtllm")
    script = spec.out_dir / "trtllm" / "build_engines.sh"
    write_if_changed(script, render_script(plan))
    script.chmod(0o755)
    if resolve_toolchain(dataclasses.replace(spec, toolchain="auto"))[0] != "trtllm":
        print(f"wrote {script}: it must run on a GPU host inside the Triton TensorRT-LLM container (see docs/trtllm.md)")
        return 0
    return subprocess.call(["bash", str(script)], stdout=sys.stdout, stderr=sys.stderr)


def run_engines(spec: Spec, toolchain: str | None = None) -> int:
    """The `engines` command: resolve the toolchain (auto prints a one-line notice) and build."""
    if toolchain is None:
        toolchain, notice = resolve_toolchain(spec)
        if notice:
            print(notice)
    if toolchain == "trtllm":
        return run_trtllm(spec)
    run_reference(spec)
    return 0
