"""A/B of the reference model's attention: this tree's model.py against a git revision's, in one process.

    .venv/bin/python -m pipeline.apps.attention_ab out/default/engines/target [--rev 51d9882] [--reps 11] [--context 128]

Loads the engine twice, once through this tree's pipeline/reference/model.py and once through the
revision's (`git show REV:pipeline/reference/model.py`, the rest of the package from this tree), and
times, interleaved in every repeat on one torch thread: one decode step after `context` cached tokens,
a verify of 6 tokens, and one decode step of 8 sequences in flight (contexts spread around `context`),
in both attention modes of each (batch_invariant on / off). Medians; the load average is printed.
A measurement, not a test: run it by hand under the bench lock (docs/benchmarks.md, "Greedy identity in serving").
"""

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipeline.reference import model as current

ROOT = Path(__file__).resolve().parents[2]


def revision_module(rev: str):
    """pipeline/reference/model.py at `rev`, imported as its own module."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:pipeline/reference/model.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"model_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    """CLI (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine")
    parser.add_argument("--rev", default="51d9882", help="git revision to compare against (default: before exact attention)")
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modules = {"this tree": current, args.rev: revision_module(args.rev)}
    ctx = args.context
    lengths = [ctx * k // 8 for k in (8, 6, 9, 7, 10, 8, 5, 8)]  # 8 in flight
    ids = [(7 * i + 3) % 1000 + 10 for i in range(max(lengths) + 8)]
    per_seq = -(-(max(lengths) + 8) // 32)
    setups = {}
    for name, module in modules.items():
        model = module.LlamaModel.from_engine_dir(args.engine)
        kv = model.new_kv_cache(per_seq * 8, 32)
        table = [list(range(j * per_seq, (j + 1) * per_seq)) for j in range(8)]
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
