"""A/B of the reference model's attention: this tree's model.py, or its row attention kernel, against a git
revision's, in one process.

    .venv/bin/python -m pipeline.apps.attention_ab out/default/engines/target [--rev 51d9882] [--reps 11] [--context 128]
    .venv/bin/python -m pipeline.apps.attention_ab out/default/engines/target --kernel --rev c5eb53d [--context 300] \
        [--decode-threads 2]

Loads the engine twice, once through this tree's pipeline/reference/model.py and once through the
revision's (`git show REV:pipeline/reference/model.py`, the rest of the package from this tree), and
times, interleaved in every repeat on one torch thread: one decode step after `context` cached tokens,
a verify of 6 tokens, and one decode step of 8 sequences in flight (contexts spread around `context`),
in both attention modes of each (batch_invariant on / off). Medians; the load average is printed.
With --kernel: one model (this tree's, as serving loads it, on its own decode threads or --decode-threads) whose fused
layers call, in turn, this tree's csrc/row_attention.cpp and the revision's (built under its own op namespace), timed
for a forward of 1, 2, 3, 4 and 6 new tokens and one step of 8 sequences in flight, and whether the two kernels give
the same logits bit for bit.
A measurement, not a test: run it by hand under the bench lock (docs/benchmarks.md, "Greedy identity in serving").
"""

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipeline.reference import model as current

ROOT = Path(__file__).resolve().parents[2]


def revision_source(rev: str, path: str) -> str:
    """The text of `path` (relative to the repository) at git revision `rev`."""
    return subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def contexts(ctx: int) -> tuple[list[int], list[int], list[list[int]], int]:
    """8 sequences in flight around `ctx` cached tokens: (their lengths, token ids to slice them from, their block
    tables, the cache's block count), blocks of 32 tokens with room for 8 new tokens each."""
    lengths = [ctx * k // 8 for k in (8, 6, 9, 7, 10, 8, 5, 8)]
    ids = [(7 * i + 3) % 1000 + 10 for i in range(max(lengths) + 8)]
    per_seq = -(-(max(lengths) + 8) // 32)
    return lengths, ids, [list(range(j * per_seq, (j + 1) * per_seq)) for j in range(8)], per_seq * 8


def revision_module(rev: str):
    """pipeline/reference/model.py at `rev`, imported as its own module."""
    path = Path(tempfile.mkdtemp()) / f"model_{rev}.py"
    path.write_text(revision_source(rev, "pipeline/reference/model.py"))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def revision_kernel(rev: str) -> str:
    """csrc/row_attention.cpp at `rev`, built (for the CPU the model runs it on) under the op namespace
    specdeploy_<rev> (non-word characters as _); returns its write_and_attend op's qualified name."""
    from torch.utils.cpp_extension import load_inline

    from pipeline.reference import cpp_ops, row_attention
    build = row_attention.kernel()
    source = revision_source(rev, "pipeline/reference/csrc/row_attention.cpp")
    namespace = "specdeploy_" + re.sub(r"\W", "_", rev)  # HEAD~1 -> specdeploy_HEAD_1
    source = source.replace("TORCH_LIBRARY_FRAGMENT(specdeploy,", f"TORCH_LIBRARY_FRAGMENT({namespace},")
    load_inline(namespace, cpp_sources=[source], extra_cflags=[*build.flags, *cpp_ops.OPENMP],
                extra_ldflags=list(cpp_ops.OPENMP), is_python_module=False)
    return f"{namespace}::{row_attention.op_name('write_and_attend')}"


def kernel_ab(engine: str, rev: str, reps: int, ctx: int, decode_threads: int | None) -> None:
    """This tree's row attention kernel against the revision's, in one model (see the module docstring)."""
    from pipeline.reference import row_attention
    if row_attention.kernel() is None:
        raise SystemExit("the row attention kernel does not run here (no AVX-512, or REFERENCE_ROW_ATTENTION=0)")
    from pipeline.serving.reference_adapter import load_serving_engine

    kernels = {"this tree": f"specdeploy::{row_attention.op_name('write_and_attend')}", rev: revision_kernel(rev)}
    model = load_serving_engine(Path(engine)).model  # as the tensorrt_llm model serves it: batch-invariant, fused
    if model.fused_layers is None:
        raise SystemExit("the engine's model runs no fused layers here: nothing calls the kernel by name")
    model.decode_threads = decode_threads or model.decode_threads
    lengths, ids, table, blocks = contexts(ctx)
    kv = model.new_kv_cache(blocks, 32)
    shapes = {"1 token": (1, 1)} | {f"{n} tokens": (n, 1) for n in (2, 3, 4, 6)} | {"8 x 1 token": (1, 8)}

    def forward(kernel: str, n: int, batch: int) -> torch.Tensor:
        model.fused_layers.attention = kernel  # the fused layers call their attention op by its name
        return model([current.SequenceInput(ids[lengths[j]:lengths[j] + n], lengths[j], table[j],
                                            logits_rows=list(range(n))) for j in range(batch)], kv).logits

    times = {(name, shape): [] for name in kernels for shape in shapes}
    same = {}
    installed = model.fused_layers.attention
    try:
        with torch.inference_mode():
            model([current.SequenceInput(ids[:n], 0, t) for n, t in zip(lengths, table)], kv)
            for _ in range(reps):
                for shape, (n, batch) in shapes.items():
                    logits = {}
                    for name, kernel in kernels.items():
                        start = time.perf_counter()
                        logits[name] = forward(kernel, n, batch)
                        times[(name, shape)].append(time.perf_counter() - start)
                    same[shape] = torch.equal(*logits.values())
    finally:
        model.fused_layers.attention = installed
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{engine}; load average {load}; median of {reps}, decode threads {model.decode_threads}, context {ctx} "
          f"(8 in flight: {min(lengths)}-{max(lengths)}); ratio = against the same kernel's 1 token")
    print("| kernel | " + " | ".join(f"{shape} ms (ratio)" for shape in shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    for name in kernels:
        one = statistics.median(times[(name, "1 token")])
        cells = (statistics.median(times[(name, shape)]) for shape in shapes)
        print(f"| {name} | " + " | ".join(f"{t * 1000:.1f} ({t / one:.3f})" for t in cells) + " |")
    print("same logits bit for bit: " + ", ".join(f"{shape} {'yes' if ok else 'NO'}" for shape, ok in same.items()))


def main() -> None:
    """CLI (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine")
    parser.add_argument("--rev", default="51d9882", help="git revision to compare against (default: before exact attention)")
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--kernel", action="store_true", help="compare the row attention kernels, not model.py")
    parser.add_argument("--decode-threads", type=int, help="--kernel: the model's decode threads (default: its own)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.kernel:
        kernel_ab(args.engine, args.rev, args.reps, args.context, args.decode_threads)
        return
    modules = {"this tree": current, args.rev: revision_module(args.rev)}
    ctx = args.context
    lengths, ids, table, blocks = contexts(ctx)
    setups = {}
    for name, module in modules.items():
        model = module.LlamaModel.from_engine_dir(args.engine)
        kv = model.new_kv_cache(blocks, 32)
        with torch.inference_mode():
            model([module.SequenceInput(ids[:n], 0, t) for n, t in zip(lengths, table)], kv)
        setups[name] = (module, model, kv, table)

    def forward(name: str, n: int, batch: int) -> None:
        module, model, kv, table = setups[name]
        model([module.SequenceInput(ids[lengths[j]:lengths[j] + n], lengths[j], table[j], logits_rows=list(range(n)))
               for j in range(batch)], kv)

    shapes = {"1 token": (1, 1), "6 tokens": (6, 1), "8 x 1 token": (1, 8)}
    cases = [(name, invariant) for name in modules for invariant in (False, True)]
    times = {(case, shape): [] for case in cases for shape in shapes}
    with torch.inference_mode():
        for _ in range(args.reps):
            for case in cases:
                setups[case[0]][1].batch_invariant = case[1]
                for shape, (n, batch) in shapes.items():
                    start = time.perf_counter()
                    forward(case[0], n, batch)
                    times[(case, shape)].append(time.perf_counter() - start)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{args.engine}; load average {load}; median of {args.reps}, 1 thread, context {ctx} (8 in flight: "
          f"{min(lengths)}-{max(lengths)})")
    print("| model.py | batch_invariant | 1 token ms | 6 tokens ms | ratio | 8 x 1 token ms |")
    print("|---|---|---|---|---|---|")
    for case in cases:
        one, six, eight = (statistics.median(times[(case, s)]) * 1000 for s in shapes)
        print(f"| {case[0]} | {case[1]} | {one:.1f} | {six:.1f} | {six / one:.2f}x | {eight:.1f} |")


if __name__ == "__main__":
    main()
