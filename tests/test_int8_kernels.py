"""int8 engines run int8 kernels (linear.py): W8A16 for int8_wo, per-token W8A8 for int8_sq; float16
engines run fbgemm's fp16-weight GEMM.

The kernels are batch-invariant (a row's result never depends on the other rows), so the model
verifies a whole draft in one call per linear, and greedy speculative decoding still gives exactly
the plain greedy tokens of the same engine, at batch 1 and with 8 requests in flight.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from specbuild.plan import make_plan
from pipeline.reference.checkpoint import dequantize_linear, load_engine, quantize_linear
from specbuild.convert import build_engine, convert_checkpoint
from pipeline.reference.draft_model import DraftModelProposer
from pipeline.reference.engine import LLMEngine
from pipeline.reference.model import LlamaModel
from pipeline.reference.linear import (OUTPUT_LAYER_THREADS, SCREEN_ROWS, DenseLinear, Float16Weights, Int8PerToken,
                                       Int8WeightOnly, ScreenedOutputLayer, intra_op_threads, output_layer_16bit,
                                       screen_gemm)
from pipeline.reference.proposers import NgramProposer
from pipeline.spec import load_spec
from tests.test_speculative import drive, prompts

SPEC = """\
name: t
models:
  target: {{checkpoint: {target}, dtype: {dtype}, qformat: {qformat}, calib_size: 2}}
speculative: {{mode: ngram, max_draft_len: 6, num_draft_tokens: 4}}
output: {{dir: {tmp}/out, cache_dir: {tmp}/cache}}
"""


def stored(algo: str, out_features: int, in_features: int, seed: int) -> dict:
    """A random linear quantized as the engine stores it (with a SmoothQuant smoother for W8A8)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    smoother = torch.rand(in_features, generator=g) + 0.5 if algo == "W8A8_SQ_PER_CHANNEL" else None
    return quantize_linear(w, algo, 64, smoother)


@pytest.mark.parametrize("kernel_cls, algo", [(Int8WeightOnly, "W8A16"), (Int8PerToken, "W8A8_SQ_PER_CHANNEL")])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (96, 64)])
def test_int8_kernels_are_row_invariant_and_close_to_the_dequantized_weight(kernel_cls, algo, shape):
    s = stored(algo, *shape, seed=shape[0])
    kernel = kernel_cls(s["weight"], s["weight_scale"], smoother=s.get("smoother"))
    x = torch.randn(8, shape[1], generator=torch.Generator().manual_seed(1))
    batched = kernel(x)
    for n in (1, 2, 5):  # the same rows inside calls of other sizes: bit-for-bit the same results
        assert torch.equal(kernel(x[:n]), batched[:n])
    assert torch.equal(kernel(x[3:4]), batched[3:4])
    reference = x @ dequantize_linear(s, algo, 64).T
    rel = ((batched - reference).norm() / reference.norm()).item()
    assert 0 < rel < 0.02  # bf16 inputs (W8A16) or int8 inputs (W8A8) cost well under 2 %


def test_w8a8_rounds_every_row_on_its_own_8_bit_grid():
    s = stored("W8A8_SQ_PER_CHANNEL", 96, 64, seed=3)
    kernel = Int8PerToken(s["weight"], s["weight_scale"], smoother=s["smoother"])
    x = torch.randn(4, 64)
    x[2] *= 1000  # a huge row does not coarsen the others' steps (one range per batch would)
    xs = x / s["smoother"]
    row_scale = xs.abs().amax(-1, keepdim=True)  # [4, 1]
    step = 2 / 255  # fbgemm's uint8 grid over the pinned range [-1, 1]
    x_q = (torch.round(xs / row_scale / step + 127) - 127) * step  # zero point 127: -1 and 1 are both on the grid
    expected = (x_q.double() @ s["weight"].double().T) * row_scale.double() * s["weight_scale"].double()
    torch.testing.assert_close(kernel(x).double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert torch.equal(kernel(x[:2]), kernel(x)[:2])


def test_onednn_int8_candidate_is_row_invariant_and_equals_fbgemm_where_sums_are_exact():
    """make bench-kernels' oneDNN per-token W8A8 row: same grid as Int8PerToken, so with VNNI / AMX (exact int32
    sums in both libraries) the same sums. The float epilogue (int32 sum x row scale x channel scale) rounds in
    oneDNN's order: the same bits on the Intel hosts measured, up to 2 ulps apart on AMD Zen4 (a third of the
    outputs), where the oneDNN kernel could not take over Int8PerToken's calls without changing greedy texts."""
    from pipeline.apps.bench_kernels import onednn_int8_per_token
    from pipeline.reference.checkpoint import quantize_int8

    w = torch.randn(960, 576, generator=torch.Generator().manual_seed(4)) * 0.05
    candidate = onednn_int8_per_token(w)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(5))
    batched = candidate(x)
    for n in (1, 6):
        assert torch.equal(candidate(x[:n]), batched[:n])
    assert torch.equal(candidate(x[7:8]), batched[7:8])
    if torch.cpu._is_vnni_supported():  # without VNNI oneDNN's u8 x s8 pairs may saturate in 16 bits, fbgemm's too
        torch.testing.assert_close(batched, Int8PerToken(*quantize_int8(w))(x), rtol=2.5e-7, atol=0)


def test_fp16_weight_kernel_is_row_invariant():
    w = torch.randn(512, 64)
    kernel = Float16Weights(w)
    x = torch.randn(6, 64)
    assert torch.equal(kernel(x[2:3]), kernel(x)[2:3])
    torch.testing.assert_close(kernel(x), x @ w.half().float().T, atol=1e-4, rtol=1e-4)
    assert kernel.nbytes == w.numel() * 2


SCREEN = screen_gemm()  # "onednn" with AMX, "kernel" with AVX512-BF16, None: the output layer is Float16Weights
needs_screen = pytest.mark.skipif(SCREEN is None, reason="ScreenedOutputLayer runs where the CPU has AMX or AVX512-BF16")


def exact_logits(x, w):
    """x @ W16^T summed in float64 and rounded once: the logits ScreenedOutputLayer's top must equal."""
    return (x.double() @ w.half().double().T).float()


@needs_screen
def test_screened_output_layer_picks_the_exact_argmax_among_near_ties():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3000, 64, generator=g) * 0.2
    # 12 tokens whose weights differ below bf16's resolution: their bf16 logits tie, their exact ones do not
    w[2890:2902] = w[2890] + torch.randn(12, 64, generator=g) * 1e-4  # past the last whole 256-token block
    layer = ScreenedOutputLayer(w, SCREEN)
    x = torch.randn(200, 64, generator=g) * 4
    x[:100] = w[2890] * 30 + torch.randn(100, 64, generator=g) * 0.1  # rows whose top is among the near ties
    out, exact = layer(x), exact_logits(x, w)
    assert torch.equal(out.argmax(dim=1), exact.argmax(dim=1))
    approx = (x.bfloat16() @ w.half().bfloat16().T).float()
    assert (approx[:100].argmax(dim=1) != exact[:100].argmax(dim=1)).any()  # bf16 alone would pick wrongly
    top = exact.argmax(dim=1, keepdim=True)
    assert torch.equal(out.gather(1, top), exact.gather(1, top))  # the top logit is the exact one
    bound = layer._bound(x, x.bfloat16().float(), approx.abs().amax(dim=1))
    assert ((out - exact).abs() <= bound.unsqueeze(1)).all()
    assert ((out - exact).abs().amax(dim=1) > 0).all()  # away from the top, logits are bf16's


@needs_screen
def test_screened_output_layer_is_batch_invariant_past_one_gemm_call():
    w = torch.randn(4096, 64, generator=torch.Generator().manual_seed(8)) * 0.2
    layer = ScreenedOutputLayer(w, SCREEN)
    x = torch.randn(SCREEN_ROWS + 9, 64, generator=torch.Generator().manual_seed(9)) * 4
    alone = torch.cat([layer(x[r:r + 1]) for r in range(len(x))])
    for n in (2, 6, 16, SCREEN_ROWS, SCREEN_ROWS + 9):
        assert torch.equal(layer(x[:n]), alone[:n]), n
    assert layer.rows_invariant()  # the load-time check output_layer_16bit runs agrees
    assert layer.nbytes == w.numel() * 2


@needs_screen
def test_the_screened_output_layer_runs_its_gemm_on_two_threads_with_the_same_bits():
    """output_layer_16bit gives the screened layer's bf16 GEMM OUTPUT_LAYER_THREADS threads where the machine has
    them: the logits equal one thread's, and a row's equal its logits alone."""
    w = torch.randn(4096, 64, generator=torch.Generator().manual_seed(10)) * 0.2
    layer = output_layer_16bit(w)
    assert isinstance(layer, ScreenedOutputLayer)
    assert layer.threads == (OUTPUT_LAYER_THREADS if (os.cpu_count() or 1) >= OUTPUT_LAYER_THREADS else 1)
    x = torch.randn(SCREEN_ROWS, 64, generator=torch.Generator().manual_seed(11)) * 4
    with intra_op_threads(1):
        both = layer(x)
        alone = torch.cat([layer(x[r:r + 1]) for r in range(len(x))])
        assert torch.get_num_threads() == 1  # the layer's threads end with its call
        layer.threads = 1
        single = layer(x)
    assert torch.equal(both, single) and torch.equal(both, alone)


def test_float32_dense_linear_takes_verify_sized_calls_on_onednn():
    w = torch.randn(200, 64, generator=torch.Generator().manual_seed(4))
    kernel = DenseLinear(w)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(5))
    for n in (1, 17, 20):  # one row and prefill-sized calls: MKL's F.linear on the (wide) weight layout
        assert torch.equal(kernel(x[:n]), F.linear(x[:n], kernel.weight))
    for n in (2, 6, 16):  # verify-sized calls: oneDNN's packed GEMM, within fp32 rounding of the same product
        torch.testing.assert_close(kernel(x[:n]), F.linear(x[:n], w), atol=1e-5, rtol=1e-5)
    assert kernel.nbytes == w.numel() * 4
    # two rows run as three, the third zero: each row's sums as in a 3-row call, whatever the third row holds
    two = kernel(x[:2])
    assert two.shape == (2, 200) and two.is_contiguous()
    assert torch.equal(two, kernel(torch.cat([x[:2], torch.zeros(1, 64)]))[:2])
    assert torch.equal(two, kernel(x[:3])[:2])


@pytest.fixture(scope="module")
def int8_engines(derived_pair, tmp_path_factory):
    """{name: engine dir}: int8_wo and int8_sq builds (float32) and a float16 build of the derived target."""
    engines = {}
    for name, qformat, dtype in (("int8_wo", "int8_wo", "float32"), ("int8_sq", "int8_sq", "float32"),
                                 ("float16", "none", "float16")):
        tmp = tmp_path_factory.mktemp(name)
        (tmp / "spec.yaml").write_text(SPEC.format(target=derived_pair[0], qformat=qformat, dtype=dtype, tmp=tmp))
        spec = load_spec(tmp / "spec.yaml")
        convert, build = make_plan(spec, "reference").steps
        convert_checkpoint(convert.params, spec.models.target.checkpoint, tmp / "ckpt")
        build_engine(tmp / "ckpt", tmp / "engine", build.params)
        engines[name] = tmp / "engine"
    return engines


@pytest.mark.parametrize("qformat, kernel_cls", [("int8_wo", Int8WeightOnly), ("int8_sq", Int8PerToken)])
def test_int8_engines_load_int8_kernels(int8_engines, qformat, kernel_cls):
    engine = LLMEngine.from_engine_dir(int8_engines[qformat])
    layer = engine.model.layers[0]
    assert all(isinstance(layer[k], kernel_cls) for k in ("qkv", "o", "gate_up", "down"))
    assert isinstance(engine.model.lm_head_linear, ScreenedOutputLayer if SCREEN else Float16Weights)
    _config, dense = load_engine(int8_engines[qformat])  # dequantized: what the model ran before the int8 kernels
    fp32_body = sum(dense[k].numel() * 4 for k in dense if k.startswith("model.layers.") and k.endswith("_proj.weight"))
    int8_body = sum(lyr[k].nbytes for lyr in engine.model.layers for k in ("qkv", "o", "gate_up", "down"))
    assert int8_body < 0.3 * fp32_body  # int8 weights + per-channel scales: about a quarter of the fp32 bytes


def test_embeddings_are_a_contiguous_table_and_16_bit_output_layers_keep_no_wide_copy(int8_engines, tiny_llama):
    """Rows are gathered from a contiguous embedding table (a row of a tied head in linear.py's wide layout was a cache
    line per value); an int8 engine's output layer runs on its own 16-bit copy, so its float32 head stays as loaded, no
    second copy in the wide layout; a float32 model's output layer runs F.linear on the wide layout."""
    int8 = LLMEngine.from_engine_dir(int8_engines["int8_sq"]).model
    assert int8.embed.is_contiguous() and int8.lm_head.is_contiguous()
    fp32 = LlamaModel.from_hf(tiny_llama)  # tied; vocab 512 > hidden: the wide layout
    assert fp32.embed.is_contiguous() and not fp32.lm_head.is_contiguous()
    assert torch.equal(fp32.embed, fp32.lm_head)


def generate(engine_dir, requests, proposer=None, stagger=False):
    """{request_id: tokens} and summed accepted draft tokens from a fresh engine (batch-invariant math)."""
    engine = LLMEngine.from_engine_dir(engine_dir, proposer=proposer, batch_invariant=True, max_batch_size=8,
                                       max_seq_len=256, max_input_len=128, max_draft_len=6)
    tokens, stats = drive(engine, requests, stagger)
    return tokens, sum(st.accepted_tokens for st in stats)


def test_float16_engines_run_fp16_weight_kernels(int8_engines):
    model = LLMEngine.from_engine_dir(int8_engines["float16"]).model
    assert all(isinstance(model.layers[0][k], Float16Weights) for k in ("qkv", "o", "gate_up", "down"))
    assert isinstance(model.lm_head_linear, ScreenedOutputLayer if SCREEN else Float16Weights)


@pytest.fixture(scope="module")
def plain_tokens(int8_engines):
    """{engine name: {request_id: plain greedy tokens}}, each request alone (batch 1)."""
    return {name: {f"r{i}": generate(engine_dir, [(i, p)])[0][f"r{i}"] for i, p in enumerate(prompts())}
            for name, engine_dir in int8_engines.items()}


@pytest.mark.parametrize("qformat", ["int8_wo", "int8_sq", "float16"])
@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_int8_speculative_greedy_equals_plain_greedy(int8_engines, plain_tokens, derived_pair, qformat, kind):
    engine_dir = int8_engines[qformat]
    cases = list(enumerate(prompts()))
    plain = plain_tokens[qformat]

    def proposer():
        return NgramProposer(1, 3) if kind == "ngram" else DraftModelProposer.from_hf(derived_pair[1], max_seq_len=256)

    alone, _accepted = generate(engine_dir, cases[:1], proposer())
    assert alone["r0"] == plain["r0"]
    batched, accepted = generate(engine_dir, cases, proposer(), stagger=True)  # 8 in flight, joining step by step
    assert batched == plain
    assert accepted > 0  # drafts were verified in batched calls, not skipped


@pytest.mark.skipif(not (torch.cpu._is_vnni_supported() if SCREEN else torch.cpu._is_avx2_supported()),
                    reason="the int8 screen serves argmax-only rows over Float16Weights (AVX2) or ScreenedOutputLayer "
                           "(its AVX-512 VNNI build)")
@pytest.mark.parametrize("qformat", ["int8_wo", "int8_sq"])
def test_argmax_only_rows_take_the_int8_screen_and_greedy_tokens_stay(int8_engines, plain_tokens, qformat):
    """Greedy requests' rows run the int8 screen (the engine marks them argmax_only): the same plain greedy tokens as
    with every row on the exact layer; rows that read their logits (a sampled request's, returned logits) take the
    exact layer, and in one forward each row gets what it gets alone. A float16 engine, whose logits round to fp16,
    keeps every row exact."""
    from pipeline.reference.int8_screen import Int8Screen
    from pipeline.reference.model import SequenceInput

    engine = LLMEngine.from_engine_dir(int8_engines[qformat], batch_invariant=True, max_batch_size=8,
                                       max_seq_len=256, max_input_len=128, max_draft_len=6)
    model = engine.model
    assert isinstance(model.argmax_layer, Int8Screen)
    screened_bytes, screen = model.weight_bytes, model.argmax_layer
    model.argmax_layer = None
    assert model.weight_bytes - screened_bytes == model.lm_head_linear.nbytes - screen.nbytes > 0  # the roofline's
    exact_tokens, _stats = drive(engine, list(enumerate(prompts())), stagger=True)
    assert exact_tokens == plain_tokens[qformat]  # plain_tokens ran with the screen

    model = LLMEngine.from_engine_dir(int8_engines[qformat], batch_invariant=True).model
    kv = model.new_kv_cache(10, 32)
    ids = prompts()[0]

    def logits(flags):
        seqs = [SequenceInput(ids, 0, [2 * i, 2 * i + 1], logits_rows=[0, 3, len(ids) - 1], argmax_only=f)
                for i, f in enumerate(flags)]
        return model(seqs, kv).logits

    screened, exact = logits([True]), logits([False])
    assert torch.equal(exact, model.lm_head_linear(model(
        [SequenceInput(ids, 0, [0, 1], logits_rows=[0, 3, len(ids) - 1])], kv, return_hidden=True).hidden_states[
            [0, 3, len(ids) - 1]]))
    assert torch.equal(screened.argmax(dim=1), exact.argmax(dim=1)) and not torch.equal(screened, exact)
    assert torch.equal(logits([False, True, False]), torch.cat([exact, screened, exact]))
    # more argmax-only rows than pay on the screen (over ScreenedOutputLayer: 5 x 3 > 12) take the exact layer
    many = logits([True] * 5)
    assert torch.equal(many, torch.cat([exact] * 5) if screen.max_rows else torch.cat([screened] * 5))
    assert LLMEngine.from_engine_dir(int8_engines["float16"]).model.argmax_layer is None


def test_bench_kernels_times_each_output_layer_and_kv_cache(int8_engines, derived_pair, capsys):
    from pipeline.apps.bench_kernels import bench_model
    from pipeline.reference import row_attention

    engine = str(int8_engines["int8_sq"])
    outs = ["screened", "fp16"] if SCREEN else ["fp16"]
    caches = ["float32", "bf16"] if row_attention.bf16_kernel() is not None else ["float32"]
    bench_model([engine], reps=1, threads=[1], layer_modes=["eager"], output_layers=outs,
                tokenizer_dir=str(derived_pair[0]), context=32, new=3, batch=2, kv_caches=tuple(caches))
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {engine} | eager |")]
    variants = [[out, cache] for out in outs for cache in caches]
    assert [r[2:4] for r in rows] == variants + variants  # the forwards table, then the profiler's, one row each
    rows = rows[:len(variants)]
    assert all(r[4] == "1" and r[-1].endswith("% |") for r in rows)  # 1 thread; a roofline share
    assert all(r[-3].endswith(" ms") and r[-2].endswith(" ms") for r in rows)  # the prompt, both modes
    # the batch's verify (2 x 3 tokens): exact, its ratio to the batch's one-token step, batched
    assert all(r[-6].endswith(" ms") and r[-5].endswith("x") and r[-4].endswith(" ms") for r in rows)
