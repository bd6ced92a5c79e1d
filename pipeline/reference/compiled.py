"""Compiled decode layers: the int8_sq engine's small ops fused by torch.compile's inductor (CPU, gcc).

Between two int8 GEMMs an int8_sq layer runs many small torch ops, 1-5 us each on these CPUs: the
residual add, the RMSNorm, the SmoothQuant input scaling, the per-token row scale (abs, amax, clamp,
divide) and, after the GEMM, the rescale, RoPE or SiLU * up. Here each such stretch is one
inductor-compiled C++ kernel call, and the model runs per layer:

    qkv GEMM -> [rescale, RoPE, split q/k/v] -> KV write, attention (eager, model.py)
    -> [o input's row scale] -> o GEMM -> [rescale, residual, RMSNorm, gate_up input's row scale]
    -> gate_up GEMM -> [rescale, SiLU * up, down input's row scale] -> down GEMM
    -> [rescale, residual, next layer's RMSNorm and qkv input's row scale] -> ...

The GEMMs stay fbgemm's (`Int8PerToken.grid_gemm`, called between the compiled regions): inductor
cannot trace fbgemm's prepacked weights (a TorchScript object), and wrapping them in a Python custom
op or calling the regions through `torch.compile`'s guarded wrapper cost more per call (40-50 us)
than the fused ops save. So every region is traced once with `make_fx` (symbolic row count, 1 not
specialised) and compiled with `torch._inductor.standalone_compile`: one kernel per region for every
row count, called directly (7-10 us a call through the artifact, against 7-20 us for the same ops eager,
measured per region at one row; 3.8 us calling inductor's generated code itself, `_direct`), and
inductor's on-disk cache makes later processes load instead of compile.

Batch invariance: every region works row by row (reductions over the hidden dimension only, the same
generated code for any row count), so a row's result does not depend on the other rows (tested bit
for bit). The results are not bitwise equal to the eager path (inductor sums the RMSNorm
in its own order); greedy tokens agree (tests/test_compiled.py).
"""

from __future__ import annotations

import functools
import locale
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.reference.linear import Int8PerToken, intra_op_threads, scale_rows

ENV = "REFERENCE_COMPILED_LAYERS"  # "0": engines run their layers eager (EngineConfig.compiled_layers' default)

log = logging.getLogger(__name__)


def eligible(model) -> str | None:
    """Why `model` cannot run compiled layers (None: it can): float32 int8_sq models with norms only."""
    if model.dtype != torch.float32:
        return f"dtype is {model.config['dtype']}; compiled layers need float32 activations"
    if model.final_norm is None or any(layer["input_norm"] is None for layer in model.layers):
        return "a layer has no input norm (an EAGLE drafter)"
    if not all(isinstance(layer[k], Int8PerToken) for layer in model.layers for k in ("qkv", "o", "gate_up", "down")):
        return "its linears are not int8_sq (Int8PerToken)"
    return None


class CompiledLayers:
    """The decoder layers of an eligible model (see `eligible`) with the ops between GEMMs compiled."""

    def __init__(self, model):
        reason = eligible(model)
        if reason is not None:
            raise ValueError(f"compiled layers are not available for this model: {reason}")
        self.model = model
        H, KVH, D = model.num_heads, model.num_kv_heads, model.head_size
        hidden, inter = model.hidden_size, model.config["intermediate_size"]
        # per layer: the SmoothQuant input scalings (1 / smoother; ones without one) and the qkv bias (zeros without)
        self.layers = [{
            "input_norm": layer["input_norm"], "post_norm": layer["post_norm"],
            **{k: layer[k] for k in ("qkv", "o", "gate_up", "down")},
            "qkv_in": _or(layer["qkv"].inv_smoother, torch.ones(hidden)),
            "o_in": _or(layer["o"].inv_smoother, torch.ones(H * D)),
            "gate_up_in": _or(layer["gate_up"].inv_smoother, torch.ones(hidden)),
            "down_in": _or(layer["down"].inv_smoother, torch.ones(inter)),
            "qkv_bias": _or(layer["qkv"].bias, torch.zeros((H + 2 * KVH) * D)),
        } for layer in model.layers]
        start = time.perf_counter()
        self.regions = _regions(H, KVH, D, hidden, inter, model.eps)
        self.compile_seconds = time.perf_counter() - start

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv, plan,
                 capture_layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run every layer and the final norm on x [T, hidden] (cos, sin [T, 1, D]); (final-norm output, captured).

        captured: the residual-stream outputs of `capture_layers`, as model.forward returns them.
        """
        model, layers, r = self.model, self.layers, self.regions
        xq, s = r.head(x, layers[0]["input_norm"], layers[0]["qkv_in"])
        captured = []
        for li, layer in enumerate(layers):
            q, k, v = r.rope(layer["qkv"].grid_gemm(xq), s, layer["qkv_bias"], cos, sin)  # [T, H|KVH, D]
            aq, s = r.scale(model._write_and_attend(li, q, k, v, kv, plan), layer["o_in"])
            x, hq, s = r.residual(x, layer["o"].grid_gemm(aq), s, layer["post_norm"], layer["gate_up_in"])
            dq, s_down = r.silu(layer["gate_up"].grid_gemm(hq), s, layer["down_in"])
            y = layer["down"].grid_gemm(dq)
            if li + 1 < len(layers):
                nxt = layers[li + 1]
                x, xq, s = r.residual(x, y, s_down, nxt["input_norm"], nxt["qkv_in"])
            else:
                x, hidden = r.tail(x, y, s_down, model.final_norm)
            if capture_layers is not None and li in capture_layers:
                captured.append(x)
        return hidden, captured


def build(model) -> CompiledLayers | None:
    """CompiledLayers for `model`, or None, with one logged line, when the model is not eligible or inductor fails."""
    reason = eligible(model)
    if reason is not None:
        log.info("compiled layers off, running eager: %s", reason)
        return None
    try:
        layers = CompiledLayers(model)
    except Exception as e:  # noqa: BLE001 - whatever inductor or the C++ compiler raises, the eager layers still run
        log.warning("compiled layers off, running eager: compiling failed: %s: %s", type(e).__name__,
                    (str(e).splitlines() or [""])[0])
        return None
    log.info("compiled layers on (%.1f s to compile, or to load from inductor's cache)", layers.compile_seconds)
    return layers


@dataclass(frozen=True)
class _Regions:
    """The compiled regions of one layer shape (weights are inputs: every layer and model of the shape shares them)."""

    head: Callable  # (x, norm, 1/smoother) -> qkv input / row scale, row scale
    rope: Callable  # (qkv GEMM output, row scale, bias, cos, sin) -> q, k, v
    scale: Callable  # (attention output, 1/smoother) -> o input / row scale, row scale
    residual: Callable  # (x, GEMM output, row scale, norm, next 1/smoother) -> x, next input / row scale, row scale
    silu: Callable  # (gate_up GEMM output, row scale, 1/smoother) -> down input / row scale, row scale
    tail: Callable  # (x, down GEMM output, row scale, final norm) -> x, final-norm output


@functools.lru_cache(maxsize=None)
def _regions(H: int, KVH: int, D: int, hidden: int, inter: int, eps: float) -> _Regions:
    """Trace and compile the regions (or load them from inductor's on-disk cache), once per process and shape.

    Compiled on one thread: inductor fixes a kernel's OpenMP thread count at compile time, and a
    one-thread kernel reduces every row in the same order whatever the row count.
    """
    T = 2  # traced with 2 rows; the row count stays symbolic (1 included)

    def r(*shape):  # a fresh example tensor per input: make_fx would merge one passed twice into one input
        return torch.rand(*shape)

    qkv_out = (H + 2 * KVH) * D
    _utf8_text_files()
    with intra_op_threads(1):
        return _Regions(
            head=_compile(functools.partial(_norm_scale, eps=eps), r(T, hidden), r(hidden), r(hidden)),
            rope=_compile(functools.partial(_rope, heads=H, kv_heads=KVH, head_size=D),
                          r(T, qkv_out), r(T, 1), r(qkv_out), r(T, 1, D), r(T, 1, D)),
            scale=_compile(_scale, r(T, H * D), r(H * D)),
            residual=_compile(functools.partial(_residual_norm_scale, eps=eps),
                              r(T, hidden), r(T, hidden), r(T, 1), r(hidden), r(hidden)),
            silu=_compile(_silu_scale, r(T, 2 * inter), r(T, 1), r(inter)),
            tail=_compile(functools.partial(_residual_norm, eps=eps), r(T, hidden), r(T, hidden), r(T, 1), r(hidden)),
        )


# ---------------------------------------------------------------- the regions (traced; x: [T, features] float32)
def _norm_scale(x, norm, inv_smoother, eps: float):
    # RMSNorm, then the next GEMM's input: (x * 1/smoother) / row scale, and the row scale [T, 1]
    return scale_rows(F.rms_norm(x, (x.shape[-1],), norm, eps) * inv_smoother)


def _scale(x, inv_smoother):
    return scale_rows(x * inv_smoother)


def _residual_norm_scale(x, y, s, norm, inv_smoother, eps: float):
    # x + the GEMM's output rescaled by its input's row scale s [T, 1]; then as _norm_scale
    x = x + y * s
    return (x, *_norm_scale(x, norm, inv_smoother, eps))


def _residual_norm(x, y, s, norm, eps: float):
    x = x + y * s
    return x, F.rms_norm(x, (x.shape[-1],), norm, eps)


def _silu_scale(y, s, inv_smoother):
    gate, up = (y * s).chunk(2, dim=-1)  # [T, I] each
    return scale_rows(F.silu(gate) * up * inv_smoother)


def _rope(y, s, bias, cos, sin, heads: int, kv_heads: int, head_size: int):
    # the qkv GEMM's output [T, (H + 2 KVH) * D] rescaled, + bias; RoPE on q and k; q [T, H, D], k, v [T, KVH, D]
    H, KVH = heads, kv_heads
    qkv = (y * s + bias).view(y.shape[0], -1, head_size)
    qk = qkv[:, :H + KVH]
    qk = qk * cos + torch.roll(qk, head_size // 2, dims=-1) * sin
    return qk[:, :H].contiguous(), qk[:, H:].contiguous(), qkv[:, H + KVH:].contiguous()


def _compile(fn, *example) -> Callable:
    """fn traced with a symbolic row count (dim 0 of the inputs with 2 rows; other sizes fixed), compiled by inductor,
    called directly (`_direct`)."""
    return _direct(_artifact(fn, *example))


def _artifact(fn, *example):
    """inductor's compiled artifact of fn traced with a symbolic row count (as `_compile`)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental import _config as fx_config
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    rows = example[0].shape[0]

    def fake(t: torch.Tensor) -> torch.Tensor:
        dims = [DimDynamic.DYNAMIC if i == 0 and t.dim() > 1 and n == rows else DimDynamic.STATIC
                for i, n in enumerate(t.shape)]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

    inputs = [fake(t) for t in example]
    with fx_config.patch(backed_size_oblivious=True):  # the row count is never specialised to 1: one kernel for all
        graph = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="symbolic")(*inputs)
    # without the generated code's size, stride and alignment asserts on its inputs (about 600 a SmolLM2 step: 0.6 ms
    # of 17, measured side by side): every region is called by CompiledLayers with tensors it made itself, contiguous
    # rows of the traced widths, and tests/test_compiled.py compares the regions' results with the eager layers'
    with torch._inductor.config.patch(size_asserts=False, alignment_asserts=False):
        return torch._inductor.standalone_compile(graph, inputs, dynamic_shapes="from_graph")


def _direct(artifact) -> Callable:
    """The region as inductor's generated `call(args)` itself, without the artifact's wrappers (dynamo's frame
    guard, aot_autograd's runtime wrapper: they handle autograd, aliased and mutated inputs, which these
    inference regions of fresh outputs do not have): 3.8 us a call instead of 8.1 (151 calls a SmolLM2 step).
    Reaches into torch 2.13's internals: where they differ, the artifact itself (logged)."""
    try:
        aot_forward = artifact._compiled_fn.__wrapped__
        graph = next(c.cell_contents for c in aot_forward.__closure__
                     if callable(getattr(c.cell_contents, "current_callable", None)))
        call = graph.current_callable
    except (AttributeError, StopIteration, TypeError, ValueError) as e:
        log.info("compiled regions run through their wrappers: %s: %s", type(e).__name__, e)
        return artifact

    def region(*args):
        return call(list(args))  # `call` empties the list it is given

    return region


def _utf8_text_files() -> None:
    """Make open()'s default encoding UTF-8 when the process still runs in the C locale (ASCII).

    Triton's python model stubs start their interpreter without Python's locale coercion, and under
    ASCII torch's inductor cannot even be imported (it reads its kernel templates, which hold UTF-8
    characters, with the default encoding); PYTHONUTF8=1 in the server's environment does not reach it.
    """
    if locale.getpreferredencoding(False).lower().replace("-", "") != "utf8":
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")


def _or(tensor: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    return default if tensor is None else tensor
