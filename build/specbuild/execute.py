"""Execute a plan: skip cached steps, run the rest, link the engines and write the manifest.

The cache (spec.output.cache_dir) is content-addressed: a step's output lives in `<cache>/<key>/`
next to `step.json` (what it was built from, how long it took, how big it is). A step writes into
`<cache>/.tmp-<key>-<pid>/` and is renamed to `<cache>/<key>` only when it succeeded, so Ctrl-C or a
failure never leaves a half-written entry. `<out>/engines/<role>` are symlinks into the cache and
`<out>/manifest.json` lists every engine with its key, inputs, toolchain versions, size and build time.

What a step runs is its toolchain's module (specbuild/toolchains/): reference steps run here on CPU,
the trtllm plan becomes `<out>/trtllm/build_engines.sh` for a GPU host.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pipeline.spec import Spec, to_dict
from pipeline.toolchains import toolchain_traits
from specbuild.plan import Plan, Step, make_plan, resolve_toolchain
from specbuild.toolchains import toolchain_module

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
        if not toolchain_traits(plan.toolchain).engines_built_here:
            state = "runs on a GPU host (plan --dry-run)"
        else:
            state = "cached" if is_cached(cache_dir, step) else "to build"
        lines.append(f"  [{i}/{len(plan.steps)}] {step.label:16s} {step.key}  {state}")
    return "\n".join(lines)


def run_engines(spec: Spec, toolchain: str | None = None) -> int:
    """The `engines` command: resolve the toolchain (auto prints a one-line notice) and build."""
    if toolchain is None:
        toolchain, notice = resolve_toolchain(spec)
        if notice:
            print(notice)
    return toolchain_module(toolchain).build(make_plan(spec, toolchain))
