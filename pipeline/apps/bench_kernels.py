"""`make bench-kernels`: CPU linear kernels for few rows on SmolLM2-135M's shapes, side by side in one run.

Part 1 (kernels): the 30 layers' fused qkv [960, 576], o [576, 576], gate_up [3072, 576] and
down [576, 1536] plus the output layer [49152, 576], random weights, timed for n = 1, 2, 4, 6, 8, 16
rows (the rows of one decode step, of a K + 1 verify, or of a few sequences' verifies), kernels
interleaved within each repeat so that load on the shared machine hits all alike; medians; the read
bandwidth of a 512 MB sum in the same repeats (the memory floor: weight bytes / bandwidth). The CPU's
model and the matrix instructions torch sees (AVX2, AVX-512, VNNI, AMX) head the run: which kernel wins
depends on them. For each kernel: whether it is batch-invariant (rows of a 6-row call equal to the same
rows alone, bit for bit), which decides whether speculative verification can take all its rows in one
call and stay exact.
Part 2 (model, with --engines DIR ...): one forward of 1 and of 6 new tokens on a 128-token
context, one decode step of 8 sequences in flight, their verify of 6 tokens each (48 rows: the int8 GEMMs at the
cores' arithmetic peak on AVX-512 hosts), and the 128-token prompt itself, through the reference model of each engine,
batch-invariant (as serving and the exactness tests run it) and batched (one masked SDPA per
sequence): the verify cost of K = 5 against a decode step, the 8-in-flight step and verify, and the plain decode
step's share of the memory roofline (weight bytes / bandwidth of the same repeats), per torch thread
count (--threads) and layer mode (--modes: eager op by op; compiled, the int8_sq layers' small ops
fused by inductor, pipeline/reference/compiled.py; fused, as the engine runs them: the compiled layers with the
forwards on the row attention kernel as one C++ call, pipeline/reference/fused_layers.py) and KV cache (--kv-caches:
float32, bf16: KVCache kv_dtype "BF16" on its own attention kernel; --context sets the cached tokens); then one
decode step per engine and mode under torch.profiler: the linear kernels' time against every other op's, and the
number of torch ops.

    python -m pipeline.apps.bench_kernels [--reps 7] [--only int8,fp32] [--threads 1,2] [--modes eager,compiled,fused]
        [--engines out/default/engines/target ...] [--kv-caches float32,bf16] [--context 128]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from pipeline.apps.host import cpu_summary
from pipeline.reference import int8_grid_gemm, row_attention
from pipeline.reference.checkpoint import quantize_int8
from pipeline.reference.linear import (GRID_STEP, GRID_ZERO_POINT, DenseLinear, Float16Weights, Int8PerToken,
                                      Int8WeightOnly, ScreenedOutputLayer, bf16_gemm, scale_rows, screen_gemm,
                                      wide_layout)

HIDDEN, INTER, VOCAB, QKV, LAYERS = 576, 1536, 49152, 960, 30
ROWS = (1, 2, 4, 6, 8, 16)
KV_DTYPES = {"float32": None, "bf16": "BF16"}  # --kv-caches -> KVCache kv_dtype


def smollm2_shapes(layers: int = LAYERS) -> list[tuple[int, int]]:
    """(out, in) of every linear one SmolLM2-135M forward runs, in order."""
    return [s for _ in range(layers) for s in ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))] + [(VOCAB, HIDDEN)]


def int4_kernel(w: torch.Tensor, act_dtype: torch.dtype):
    """torch's packed int4 CPU kernel (groups of 64, asymmetric as torch packs it), activations in act_dtype."""
    out_features, in_features = w.shape
    group = 64
    groups = w.reshape(out_features, in_features // group, group)
    low, high = groups.amin(2), groups.amax(2)
    scale = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([scale.t(), (low + 8 * scale).t()], -1).contiguous().to(act_dtype)  # [G, out, 2]
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(act_dtype), packed, group, scales_zeros)


def fbgemm_dynamic(w: torch.Tensor):
    """torch.ao's dynamic int8 linear (fbgemm): one activation scale for the whole batch."""
    q, scale = quantize_int8(w)
    qw = torch.quantize_per_channel(q.float() * scale[:, None], scale.double(), torch.zeros(len(scale), dtype=torch.long),
                                    0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, False)


def onednn_prepacked(w: torch.Tensor):
    """oneDNN's prepacked fp32 linear (torch.utils.mkldnn)."""
    from torch.utils import mkldnn

    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data = w
    packed = mkldnn.to_mkldnn(linear)
    return lambda x: packed(x.to_mkldnn()).to_dense()


def onednn_packed_for_rows(w: torch.Tensor, rows: int = 6):
    """oneDNN's fp32 GEMM on weights packed once for `rows` rows (what inductor's freezing emits for linears)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def int_mm_per_token(w: torch.Tensor):
    """Per-token W8A8 through torch._int_mm (int8 x int8 -> int32), the alternative to fbgemm."""
    q, scale = quantize_int8(w)
    q_t = q.t()  # [in, out] view: _int_mm's faster layout for one row (measured)

    def run(x):
        row_scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
        x_q = torch.round(x / row_scale).clamp(-127, 127).to(torch.int8)
        return torch._int_mm(x_q, q_t).float() * row_scale * scale
    return run


def onednn_int8_per_token(w: torch.Tensor):
    """Int8PerToken's per-token W8A8 on oneDNN's int8 matmul instead of fbgemm's (AMX or VNNI brgemm where present).

    Rows are divided by their max |x| and rounded on Int8PerToken's fixed uint8 grid, so with exact int32
    sums (VNNI, AMX) the result equals Int8PerToken's bit for bit (tests/test_int8_kernels.py).
    """
    q, scale = quantize_int8(w)
    packed = torch.ops.onednn.qlinear_prepack(q, [1, w.shape[1]])
    zero_points = torch.zeros(len(scale), dtype=torch.long)

    def run(x):
        x_unit, row_scale = scale_rows(x.float())
        with warnings.catch_warnings():  # torch deprecates quantized tensors; its quantizer rounds as fbgemm's linear does
            warnings.simplefilter("ignore")
            x_u8 = torch.quantize_per_tensor(x_unit, GRID_STEP, GRID_ZERO_POINT, torch.quint8).int_repr()
        y = torch.ops.onednn.qlinear_pointwise(x_u8, GRID_STEP, GRID_ZERO_POINT, packed, scale.float(), zero_points,
                                               None, 1.0, 0, torch.float32, "none", [], "")
        return y * row_scale
    return run


def onednn_bf16_packed(w: torch.Tensor, rows: int = 6):
    """bf16 weights packed for oneDNN (AMX tiles where present); bf16 in and out, fp32 sums inside."""
    packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), rows)
    return lambda x: bf16_gemm(x.bfloat16(), packed)


def int8_project(kernel_cls):
    """A project int8 kernel over the per-channel quantization of w."""
    def build(w: torch.Tensor):
        q, scale = quantize_int8(w)
        return kernel_cls(q, scale)
    return build


# Int8PerToken on the project's kernel: a row only where one runs here (AVX512-VNNI or AVX2; else it is fbgemm's row)
PROJECT_INT8 = "int8 W8A8 per-token (Int8PerToken, project kernel: VNNI with AMX from 8 rows, or AVX2)"
KERNELS = {
    "fp32 F.linear": lambda w: (lambda x, w=w: F.linear(x, w)),
    "fp32 F.linear, wide layout": lambda w: (lambda x, w=wide_layout(w): F.linear(x, w)),
    "fp32 oneDNN prepacked": onednn_prepacked,
    "fp32 oneDNN packed for 6 rows (_linear_pointwise)": onednn_packed_for_rows,
    "fp32 DenseLinear (1 row: F.linear wide, split over the threads from 1 MB; oneDNN packed for 2-16)": DenseLinear,
    "bf16 F.linear": lambda w: (lambda x, w=w.bfloat16(): F.linear(x.bfloat16(), w)),
    "bf16 oneDNN packed, bf16 output": onednn_bf16_packed,
    "fp16 weights, fp32 act (Float16Weights, fbgemm)": functools.partial(Float16Weights, project_kernel=False),
    "fp16 weights, fp32 act (Float16Weights, project kernel: AVX2)": Float16Weights,
    "int8 W8A16 bf16 act (Int8WeightOnly)": int8_project(Int8WeightOnly),
    "int8 W8A8 per-token (Int8PerToken, fbgemm)": int8_project(functools.partial(Int8PerToken, project_kernel=False)),
    PROJECT_INT8: int8_project(Int8PerToken),
    "int8 W8A8 per-token, torch._int_mm": int_mm_per_token,
    "int8 W8A8 per-token, oneDNN qlinear": onednn_int8_per_token,
    "int8 fbgemm dynamic, per-batch act scale": fbgemm_dynamic,
    "int4 packed, bf16 act": lambda w: int4_kernel(w, torch.bfloat16),
    "int4 packed, fp32 act": lambda w: int4_kernel(w, torch.float32),
}


def batch_invariant(fns: list, shapes: list[tuple[int, int]]) -> bool:
    """Rows of a 6-row call equal the same rows alone, bit for bit (first layer's matrices and the output layer)."""
    g = torch.Generator().manual_seed(1)
    for fn, (_out, inp) in list(zip(fns, shapes))[:4] + [(fns[-1], shapes[-1])]:
        x = torch.randn(6, inp, generator=g)
        y = fn(x)
        if not all(torch.equal(y[r:r + 1], fn(x[r:r + 1])) for r in range(6)):
            return False
    return True


def bandwidth_gbs(buffer: torch.Tensor) -> float:
    """GB/s of one sum over buffer."""
    start = time.perf_counter()
    buffer.sum()
    return buffer.numel() * buffer.element_size() / (time.perf_counter() - start) / 1e9


def bench_kernels(names: list[str], reps: int, layers: int) -> None:
    """Part 1: print the kernel table (ms at 1 row, ratios for more rows, invariance)."""
    shapes = smollm2_shapes(layers)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g) * 0.02 for o, i in shapes]
    fp32_bytes = sum(w.numel() * 4 for w in weights)
    built = {}
    for name in names:
        built[name] = [KERNELS[name](w) for w in weights]
        for fn, (_o, i) in zip(built[name], shapes):
            fn(torch.randn(1, i))  # warm-up: packing, first-call allocations
    invariant = {name: batch_invariant(fns, shapes) for name, fns in built.items()}
    buffer = torch.ones(512 * 2**20 // 4)
    times = {(name, n): [] for name in built for n in ROWS}
    bandwidth = []
    for rep in range(reps):
        bandwidth.append(bandwidth_gbs(buffer))
        for name, fns in built.items():
            for n in ROWS[rep % len(ROWS):] + ROWS[:rep % len(ROWS)]:  # rotated: no row count always runs first
                xs = {i: torch.randn(n, i) for i in (HIDDEN, INTER)}
                start = time.perf_counter()
                for fn, (_o, i) in zip(fns, shapes):
                    fn(xs[i])
                times[(name, n)].append(time.perf_counter() - start)
    bw = statistics.median(bandwidth)
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}; read bandwidth "
          f"median {bw:.1f} GB/s (best {max(bandwidth):.1f}); fp32 weights {fp32_bytes / 1e6:.0f} MB -> floor "
          f"{fp32_bytes / bw / 1e6:.1f} ms; {layers} layers + output layer, median of {reps}")
    print("| kernel | batch-invariant | n=1 | " + " | ".join(f"n={n}" for n in ROWS[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(ROWS) - 1))
    for name in built:
        base = statistics.median(times[(name, 1)])
        ratios = " | ".join(f"{statistics.median(times[(name, n)]) / base:.2f}x" for n in ROWS[1:])
        print(f"| {name} | {'yes' if invariant[name] else 'no'} | {base * 1000:.1f} ms | {ratios} |", flush=True)


KERNEL_OPS = ("quantized::linear_with_input_q_dq_qweight_dq_output_fp32", "quantized::linear_dynamic",
              "quantized::linear_dynamic_fp16", "aten::_weight_int8pack_mm", "aten::addmm", "aten::mm", "aten::linear",
              "mkldnn::_linear_pointwise", "specdeploy::int8_grid_gemm", "specdeploy::int8_grid_gemm_avx2",
              "specdeploy::int8_grid_gemm_into", "specdeploy::int8_grid_gemm_avx2_into", "specdeploy::fp16_weight_gemm",
              "specdeploy::bf16_weight_gemm")


def _is_op(key: str) -> bool:
    # a torch op, or one call of an inductor-compiled region (compiled.CompiledLayers) and its wrapper
    return "::" in key or "CompiledFxGraph" in key or key.startswith("AOTDispatcher")


def step_profile(model, seq, kv, reps: int = 3) -> tuple[float, float, float]:
    """(torch ops per forward, ms in the weight-reading linear kernels, ms in all ops) of one forward, torch.profiler.

    Self CPU times (the profiler adds a few microseconds to every op, so "everything else" reads high).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            model([seq], kv)
    events = prof.key_averages()
    ops = sum(e.count for e in events if _is_op(e.key)) / reps
    kernel_us = sum(e.self_cpu_time_total for e in events if e.key in KERNEL_OPS) / reps
    total_us = sum(e.self_cpu_time_total for e in events if _is_op(e.key)) / reps
    return ops, kernel_us / 1000, total_us / 1000


def context_ids(tokenizer_dir: str | None, n: int) -> list[int]:
    """n token ids of local English text (pipeline.corpus) with the model's tokenizer; without one, a synthetic
    sequence (whose flat next-token distributions give ScreenedOutputLayer more candidates than text does)."""
    if tokenizer_dir is None:
        return [(7 * i + 3) % 1000 + 10 for i in range(n)]
    from transformers import AutoTokenizer

    from pipeline.corpus import local_text
    return AutoTokenizer.from_pretrained(tokenizer_dir)(local_text(20 * n))["input_ids"][:n]


def output_layer_variants(model, names: list[str]) -> dict:
    """{name: output-layer kernel} for a model whose output layer is kept in 16 bits ("screened": ScreenedOutputLayer,
    "fp16": Float16Weights); a float32 model keeps its own, named "fp32"."""
    loaded = model.lm_head_linear
    if isinstance(loaded, DenseLinear):
        return {"fp32": loaded}
    kinds = {"screened": ScreenedOutputLayer, "fp16": Float16Weights}
    return {name: loaded if type(loaded) is kinds[name] else kinds[name](model.lm_head) for name in names}


def bench_model(engine_dirs: list[str], reps: int, threads: list[int], layer_modes: list[str],
                output_layers: list[str], tokenizer_dir: str | None = None, context: int = 128, new: int = 6,
                batch: int = 8, kv_caches: tuple[str, ...] = ("float32",)) -> None:
    """Part 2: forwards after about `context` cached tokens of text (`context_ids`), per engine, layer mode and thread count, in both attention modes.

    Times one decode step, a verify of `new` tokens, one decode step of `batch` sequences (contexts
    spread around `context`: 8 in flight), their verify of `new` tokens each and the first sequence's prompt
    (`context` tokens), each batch-invariant (every token its own SDPA batch element over aligned keys, as serving and
    the exactness tests run) and batched
    (one masked SDPA per sequence);
    prints ms, the verify ratio and the plain step's share of the memory roofline (weight bytes / read
    bandwidth measured in the same repeats). Layer modes: "eager" (op by op), "compiled"
    (compiled.CompiledLayers: the ops between the int8 GEMMs fused by inductor; int8_sq engines only) and "fused"
    (the compiled layers plus fused_layers.FusedInt8Layers for forwards on the row attention kernel, as the engine
    runs them), timed alternately in the same repeats; so are the output layers of 16-bit output layers (`output_layers`:
    "screened", ScreenedOutputLayer, "fp16", Float16Weights), and the KV caches (`kv_caches`: "float32", "bf16":
    KVCache kv_dtype "BF16", each variant over its own cache). Then, per engine and mode, where one decode step goes
    (torch.profiler): the linear kernels against everything else, and the number of torch ops.
    """
    from pipeline.reference import compiled, fused_layers
    from pipeline.reference.model import LlamaModel, SequenceInput

    models = {d: LlamaModel.from_engine_dir(d) for d in engine_dirs}
    # (engine, layer mode, output layer) -> ((CompiledLayers or None (eager), FusedInt8Layers or None), output layer)
    variants = {}
    for d, model in models.items():
        heads = output_layer_variants(model, output_layers)
        regions = None
        for mode in layer_modes:
            if mode == "eager":
                layers = (None, None)
            elif compiled.eligible(model) is None:
                if regions is None:
                    start = time.perf_counter()
                    regions = compiled.CompiledLayers(model)
                    print(f"{d}: compiled layers built in {time.perf_counter() - start:.1f} s (compiled, or loaded "
                          "from inductor's on-disk cache)")
                layers = (regions, fused_layers.build(model) if mode == "fused" else None)
                if mode == "fused" and layers[1] is None:
                    continue
            else:
                continue
            variants.update({(d, mode, out, cache): (layers, head) for out, head in heads.items() for cache in kv_caches})
    lengths = [context * k // 8 for k in (8, 6, 9, 7, 10, 8, 5, 8)][:batch]  # the in-flight sequences' contexts
    ids = context_ids(tokenizer_dir, max(lengths) + new)
    per_seq = -(-(max(lengths) + new) // 32)  # blocks per sequence
    caches = {}  # (engine, KV cache) -> its prefilled cache
    for d, model in models.items():
        for cache in kv_caches:
            kv = model.new_kv_cache(per_seq * batch, 32, KV_DTYPES[cache])
            model([SequenceInput(ids[:n], 0, list(range(j * per_seq, (j + 1) * per_seq))) for j, n in enumerate(lengths)],
                  kv)
            caches[d, cache] = kv

    def seqs(d, n, b):
        """b sequences bringing n new tokens each (logits for every new token); n = "prompt": the first sequence's
        `context` tokens again (its keys and values written again)."""
        if n == "prompt":
            return [SequenceInput(ids[:context], 0, list(range(per_seq)))]
        return [SequenceInput(ids[lengths[j]:lengths[j] + n], lengths[j], list(range(j * per_seq, (j + 1) * per_seq)),
                              logits_rows=list(range(n))) for j in range(b)]

    cases = [(n, b, invariant) for n, b in ((1, 1), (new, 1), (1, batch), (new, batch), ("prompt", 1))
             for invariant in (True, False)]
    times = {(v, t, case): [] for v in variants for t in threads for case in cases}
    buffer = torch.ones(512 * 2**20 // 4)
    bandwidth = []
    for rep in range(reps):
        bandwidth.append(bandwidth_gbs(buffer))  # evicts the caches: the case right after it runs cold
        for t in threads:
            torch.set_num_threads(t)
            for (d, mode, out, cache), (layers, head) in variants.items():
                model = models[d]
                model.decode_threads = t  # the thread count small forwards run on (the model's default is 1)
                (model.compiled_layers, model.fused_layers), model.lm_head_linear = layers, head
                for n, b, invariant in cases[rep % len(cases):] + cases[:rep % len(cases)]:  # rotated: none always first
                    model.batch_invariant = invariant
                    start = time.perf_counter()
                    model(seqs(d, n, b), caches[d, cache])
                    times[((d, mode, out, cache), t, (n, b, invariant))].append(time.perf_counter() - start)
    bw = statistics.median(bandwidth)
    print(f"\nload average {os.getloadavg()[0]:.2f}; read bandwidth median {bw:.1f} GB/s; forwards after {context} cached "
          f"tokens ({batch} sequences: {min(lengths)}-{max(lengths)}), median of {reps}; exact = batch-invariant, "
          "batched = one masked SDPA per sequence")
    print(f"| engine | layers | output layer | KV cache | threads | weight MB | floor ms | 1 token exact | 1 token batched | {new} tokens exact | ratio | "
          f"{new} tokens batched | ratio | {batch} x 1 token exact | {batch} x 1 token batched | "
          f"{batch} x {new} tokens exact | ratio to {batch} x 1 | {batch} x {new} tokens batched | "
          f"{context}-token prompt exact | {context}-token prompt batched | roofline share at 1 token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (d, mode, out, cache), (_layers, head) in variants.items():
        model = models[d]
        model.lm_head_linear = head
        for t in threads:
            medians = (statistics.median(times[((d, mode, out, cache), t, case)]) for case in cases)
            one, one_b, many, many_b, wide, wide_b, wide_many, wide_many_b, prompt, prompt_b = medians
            floor = model.weight_bytes / bw / 1e9
            print(f"| {d} | {mode} | {out} | {cache} | {t} | {model.weight_bytes / 1e6:.0f} | {floor * 1000:.1f} | {one * 1000:.1f} ms | "
                  f"{one_b * 1000:.1f} ms | {many * 1000:.1f} ms | {many / one:.2f}x | {many_b * 1000:.1f} ms | "
                  f"{many_b / one_b:.2f}x | {wide * 1000:.1f} ms | {wide_b * 1000:.1f} ms | "
                  f"{wide_many * 1000:.1f} ms | {wide_many / wide:.2f}x | {wide_many_b * 1000:.1f} ms | "
                  f"{prompt * 1000:.1f} ms | "
                  f"{prompt_b * 1000:.1f} ms | {floor / one:.0%} |", flush=True)
    first = {}  # engine -> its first variant, the base of the per-repeat ratios
    for key in variants:
        first.setdefault(key[0], key)
    for key in variants:  # per-repeat ratios: all variants ran back to back in every repeat
        base = first[key[0]]
        if key != base:
            for t in threads:
                for case, name in ((cases[0], "1 token"), (cases[2], f"{new} tokens")):
                    ours, theirs = times[(key, t, case)], times[(base, t, case)]
                    ratios = sorted(a / b for a, b in zip(ours, theirs))
                    print(f"{key[0]}, {t} thread(s): {name} {key[1]} with {key[2]} output, {key[3]} KV / {base[1]} with "
                          f"{base[2]} output, {base[3]} KV, per repeat: median {statistics.median(ratios):.2f}, range "
                          f"{ratios[0]:.2f}-{ratios[-1]:.2f}; best times {min(ours) * 1000:.1f} against "
                          f"{min(theirs) * 1000:.1f} ms")
    torch.set_num_threads(threads[0])
    print(f"\nOne decode step under torch.profiler ({threads[0]} thread(s)): linear kernels against everything else")
    print("| engine | layers | output layer | KV cache | torch ops (nested ones included) | linear kernels ms | other ops ms | "
          "kernels' read rate GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for (d, mode, out, cache), (layers, head) in variants.items():
        model = models[d]
        model.decode_threads, model.lm_head_linear, model.batch_invariant = threads[0], head, True
        model.compiled_layers, model.fused_layers = layers
        ops, kernels, total = step_profile(model, seqs(d, 1, 1)[0], caches[d, cache])
        print(f"| {d} | {mode} | {out} | {cache} | {ops:.0f} | {kernels:.1f} | {total - kernels:.1f} | "
              f"{model.weight_bytes / kernels / 1e6:.1f} |", flush=True)


def main() -> None:
    """CLI (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--layers", type=int, default=LAYERS, help="fewer layers for a quick look")
    parser.add_argument("--only", default="", help="comma-separated substrings of kernel names")
    parser.add_argument("--engines", nargs="*", default=[], help="engine folders for part 2 (model forwards)")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--threads", default="1,2", help="torch thread counts for part 2 (default 1,2; part 1 runs on the first)")
    parser.add_argument("--tokenizer", help="part 2's context: local text tokenized with this tokenizer (default: synthetic ids)")
    parser.add_argument("--output-layers", default="screened,fp16" if screen_gemm() else "fp16",
                        help="part 2's 16-bit output layers: screened (bf16 + exact top, needs AMX or AVX512-BF16), "
                             "fp16")
    parser.add_argument("--modes", default="eager,compiled,fused",
                        help="part 2's layer modes: eager (op by op), compiled (CompiledLayers, int8_sq engines only), "
                             "fused (compiled + FusedInt8Layers, as the engine runs them)")
    parser.add_argument("--kv-caches", default="float32,bf16" if row_attention.bf16_kernel() else "float32",
                        help="part 2's KV caches: float32, bf16 (KVCache kv_dtype BF16; its kernel needs AVX512-BF16 "
                             "or AVX2)")
    parser.add_argument("--context", type=int, default=128,
                        help="part 2's cached tokens before the timed forwards (8 in flight: 5/8 to 10/8 of it)")
    args = parser.parse_args()
    threads = [min(int(t), os.cpu_count() or 1) for t in args.threads.split(",")]
    torch.set_num_threads(threads[0])
    print(cpu_summary())
    with torch.inference_mode():
        if not args.skip_kernels:
            wanted = [n for n in KERNELS if (not args.only or any(o in n for o in args.only.split(",")))
                      and (n != PROJECT_INT8 or int8_grid_gemm.kernel() is not None)]
            bench_kernels(wanted, args.reps, args.layers)
        if args.engines:
            bench_model(args.engines, args.reps, threads, args.modes.split(","), args.output_layers.split(","), args.tokenizer,
                        args.context, kv_caches=tuple(args.kv_caches.split(",")))


if __name__ == "__main__":
    main()
