"""A bf16 KV cache (KVCache kv_dtype "BF16": the engine option bf16_kv_cache, on unless REFERENCE_BF16_KV_CACHE=0;
the suite's engines keep float32 unless a test asks).

The cache stores what torch's bf16 rounding gives, in the layout csrc/bf16_kv.h documents, and reads it back the
same from Python (the SDPA path's gather) as the C++ stores it. Its row attention kernel (csrc/row_attention_bf16.cpp:
vdpbf16ps where the CPU has AVX512-BF16, else AVX2's fused multiply-adds in vdpbf16ps's order, the same bits)
computes softmax attention over those values to float32 accuracy, given its documented roundings, every row alone over
its own keys: its bits never depend on the other rows or the thread count. So an int8_sq engine with the option keeps
its guarantee: speculative greedy output equals plain greedy output, at batch 1 and with 8 in flight. On a CPU with
neither the engine keeps a float32 cache.
"""

import logging
import math

import pytest
import torch

from pipeline.reference import cpp_ops, fused_layers, int8_grid_gemm, row_attention, step_cost
from pipeline.reference.engine import BF16_KV_CACHE_ENV, EngineConfig, LLMEngine
from pipeline.reference.kv_cache import KVCache
from pipeline.reference.medusa import MedusaProposer, load_medusa_dir
from pipeline.reference.model import LlamaModel, SequenceInput
from pipeline.reference.proposers import NgramProposer
from tests.test_compiled import assert_rows_do_not_depend_on_the_batch
from tests.test_int8_kernels import int8_engines  # noqa: F401 - the int8 engine builds, a fixture
from tests.test_speculative import MEDUSA_CHOICES, drive, prompts, random_medusa_dir

# each build of the bf16 row attention kernel this CPU runs
BUILDS = [pytest.param(build, id=build.library, marks=pytest.mark.skipif(not build.cpu_supported(),
                                                                         reason=f"{build.library} does not run here"))
          for build in (row_attention.BF16, row_attention.BF16_AVX2)]
needs_both_builds = pytest.mark.skipif(not row_attention.BF16.cpu_supported(),
                                       reason="needs AVX512-BF16 (and so AVX2) to run both builds")


def bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (nearest even), back in float64."""
    return x.bfloat16().double()


def reference(q, k, v, slots, starts, lengths, scale) -> torch.Tensor:
    """The kernel's documented computation in float64: q, k and v rounded to bf16; the softmax numerators rounded to
    bf16 for the values, their sum not. Query head h reads KV head h // (H // KVH)."""
    H, KVH = q.shape[1], k.shape[1]
    rows = []
    for r in range(q.shape[0]):
        keys = slots[starts[r]:starts[r] + lengths[r]]
        heads = []
        for h in range(H):
            scores = bf16(k[keys, h // (H // KVH)]) @ bf16(q[r, h]) * scale
            e = torch.exp(scores - scores.max())
            heads.append(bf16(e) @ bf16(v[keys, h // (H // KVH)]) / e.sum())
        rows.append(torch.cat(heads))
    return torch.stack(rows)


def filled_cache(num_blocks=40, block=32, kv_heads=3, head_size=64, seed=0):
    """(a one-layer bf16 cache with every slot written, the float32 keys and values written)."""
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(1, num_blocks, block, kv_heads, head_size, torch.float32, "BF16")
    n = num_blocks * block
    k, v = torch.randn(n, kv_heads, head_size, generator=g), torch.randn(n, kv_heads, head_size, generator=g)
    kv.write(0, torch.arange(n), k, v)
    return kv, k, v


def test_the_cache_stores_bf16_rounding_and_copies_clears_and_gathers_it():
    kv, k, v = filled_cache(num_blocks=4)
    slots = torch.tensor([5, 17, 64, 127, 0])
    got_k, got_v = kv.gather(0, slots)
    assert torch.equal(got_k, k[slots].bfloat16().float()) and torch.equal(got_v, v[slots].bfloat16().float())
    assert torch.equal(kv.gather(0, slice(16, 20))[0], k[16:20].bfloat16().float())
    kv.copy_slots(torch.tensor([5, 17]), torch.tensor([40, 41]))
    assert torch.equal(kv.gather(0, torch.tensor([40, 41]))[1], got_v[:2])
    kv.clear(torch.tensor([40]))
    assert not kv.gather(0, torch.tensor([40]))[0].any() and torch.equal(kv.gather(0, torch.tensor([41]))[0], got_k[1:2])
    assert kv.nbytes == 2 * 4 * 32 * 3 * 64 * 2  # half a float32 cache's
    with pytest.raises(ValueError, match="multiple of 16 tokens"):
        KVCache(1, 4, 8, 3, 64, torch.float32, "BF16")


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("heads, kv_heads, head_size", [(9, 3, 64), (4, 4, 32), (8, 1, 128), (6, 2, 16), (18, 1, 256)])
def test_rows_attend_over_their_own_keys_to_float32_accuracy_and_alone(heads, kv_heads, head_size, build):
    kv, k, v = filled_cache(kv_heads=kv_heads, head_size=head_size, seed=heads)
    g = torch.Generator().manual_seed(head_size)
    seq = (torch.randperm(40, generator=g)[:, None] * 32 + torch.arange(32)).flatten()  # a block table's slots
    q = torch.randn(9, heads, head_size, generator=g) * 3
    starts = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 640])
    lengths = torch.tensor([1, 15, 16, 17, 300, 301, 302, 1000, 33])  # odd and even, across groups of 16
    keys, scale = (seq, starts, lengths), 1 / math.sqrt(head_size)
    out = row_attention.row_attention(q, kv.k[0], kv.v[0], keys, scale, build)
    # float32 sums; a numerator whose float32 and float64 values straddle a bf16 rounding boundary rounds to the
    # neighbouring bf16 (2^-8 relative), which the bound allows for the largest probabilities
    assert (out.double() - reference(q, k, v, *keys, scale)).abs().max() < 3e-4
    alone = torch.cat([row_attention.row_attention(q[r:r + 1], kv.k[0], kv.v[0], (seq, starts[r:r + 1], lengths[r:r + 1]),
                                                   scale, build) for r in range(len(q))])
    assert torch.equal(alone, out)  # a row's bits do not depend on the other rows
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(row_attention.row_attention(q, kv.k[0], kv.v[0], keys, scale, build), out)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("build", BUILDS)
def test_the_kernel_stores_what_the_cache_stores_and_refuses_keys_outside_groups_of_16(build):
    kv, k, v = filled_cache(num_blocks=4)
    ours = KVCache(1, 4, 32, 3, 64, torch.float32, "BF16")
    ours.k.copy_(kv.k), ours.v.copy_(kv.v)
    new_k, new_v = torch.randn(3, 3, 64), torch.randn(3, 3, 64)
    new_slots = torch.tensor([33, 34, 35])
    kv.write(0, new_slots, new_k, new_v)
    keys = (torch.arange(36), torch.tensor([0, 0, 0]), torch.tensor([34, 35, 36]))
    q = torch.randn(3, 9, 64)
    written = row_attention.write_and_attend(q, new_k, new_v, new_slots, ours.k[0], ours.v[0], keys, 0.125,
                                             build)
    assert torch.equal(ours.k, kv.k) and torch.equal(ours.v, kv.v)  # the C++ store's bits are torch's
    assert torch.equal(written, row_attention.row_attention(q, kv.k[0], kv.v[0], keys, 0.125, build))
    scattered = (torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 40]), torch.tensor([0]),
                 torch.tensor([17]))
    with pytest.raises(RuntimeError, match="must fill groups of 16 slots in order"):
        row_attention.row_attention(q[:1], kv.k[0], kv.v[0], scattered, 0.125, build)


@needs_both_builds
@pytest.mark.parametrize("heads, kv_heads, head_size", [(9, 3, 64), (8, 1, 128), (6, 2, 16)])
def test_the_avx2_build_gives_the_avx512_bf16_builds_bits(heads, kv_heads, head_size):
    """vdpbf16ps adds a dim pair's two products in turn, the odd one first, each rounded once (bf16 products are exact
    in float32): the AVX2 build's fused multiply-adds in that order, its softmax summed in the same 16 lanes and
    reduced in the same order. Rows of one sequence (a verify) and of another, odd and even lengths."""
    kv, _, _ = filled_cache(kv_heads=kv_heads, head_size=head_size, seed=heads)
    g = torch.Generator().manual_seed(7)
    seq = (torch.randperm(40, generator=g)[:, None] * 32 + torch.arange(32)).flatten()
    q = torch.randn(12, heads, head_size, generator=g) * 4
    starts = torch.tensor([0] * 6 + [320] * 6)
    lengths = torch.tensor([1, 2, 31, 32, 33, 1000, 100, 101, 102, 103, 104, 105])
    keys, scale = (seq, starts, lengths), 1 / math.sqrt(head_size)
    avx512, avx2 = (row_attention.row_attention(q, kv.k[0], kv.v[0], keys, scale, build)
                    for build in (row_attention.BF16, row_attention.BF16_AVX2))
    assert torch.equal(avx512, avx2)


@needs_both_builds
@pytest.mark.skipif(int8_grid_gemm.kernel() is None, reason="needs the int8 GEMM kernel")
def test_fused_int8_layers_on_the_avx2_build_give_the_avx512_builds_logits(int8_engines, monkeypatch):  # noqa: F811
    """The fused layers' team calls the AVX2 build's row_attention_into where it is the build here (AMD Zen3)."""
    prompt = prompts(1)[0] * 4  # 24 tokens
    logits = []
    for build in (row_attention.BF16, row_attention.BF16_AVX2):
        assert cpp_ops.loaded(build)  # as bf16_kernel() loads the build it picks
        monkeypatch.setattr(row_attention, "bf16_kernel", lambda build=build: build)
        model, kv = int8_sq_model(int8_engines["int8_sq"], "BF16")
        model([SequenceInput(prompt[:14], 0, [0, 1, 2])], kv)
        logits.append(model([SequenceInput(prompt[14:20], 14, [0, 1, 2], logits_rows=list(range(6)))], kv).logits)
    assert torch.equal(*logits)


def int8_sq_model(engine_dir, kv_dtype):
    """The int8_sq engine's model on fused layers, batch-invariant, and a cache of `kv_dtype`."""
    model = LlamaModel.from_engine_dir(engine_dir, batch_invariant=True)
    model.fused_layers = fused_layers.build(model)
    assert isinstance(model.fused_layers, fused_layers.FusedInt8Layers)
    return model, model.new_kv_cache(8, 16, kv_dtype)


needs_fused_int8 = pytest.mark.skipif(int8_grid_gemm.kernel() is None or row_attention.bf16_kernel() is None,
                                      reason="needs the int8 GEMM kernel and the bf16 row attention kernel")


@needs_fused_int8
def test_fused_int8_layers_over_a_bf16_cache_compute_the_python_layers_over_it(int8_engines):  # noqa: F811
    """The fused op (its own KV store and the bf16 attention op) against the model's Python layers on the same kernel
    (write_and_attend_bf16): logits within float32 rounding of the GEMMs' inputs, the same keys stored, and both
    near the float32 cache's logits."""
    prompt = prompts(1)[0] * 4  # 24 tokens
    results = {}
    for name, fused, kv_dtype in (("fused", True, "BF16"), ("python", False, "BF16"), ("float32", True, None)):
        model, kv = int8_sq_model(int8_engines["int8_sq"], kv_dtype)
        if not fused:
            model.fused_layers = None
        kv.k.zero_(), kv.v.zero_()  # unwritten slots compare equal
        model([SequenceInput(prompt[:14], 0, [0, 1, 2])], kv)
        chain = model([SequenceInput(prompt[14:20], 14, [0, 1, 2], logits_rows=list(range(6)))], kv).logits
        results[name] = chain, kv
    (fused, fused_kv), (python, python_kv), (full, _) = results["fused"], results["python"], results["float32"]
    torch.testing.assert_close(fused, python, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fused_kv.gather(0, torch.arange(20))[0], python_kv.gather(0, torch.arange(20))[0],
                               rtol=1e-2, atol=1e-2)
    assert not torch.equal(fused, full) and (fused - full).abs().max() < 0.1 * full.abs().max()  # rounded, not wrecked


@needs_fused_int8
def test_fused_int8_rows_over_a_bf16_cache_do_not_depend_on_the_batch(int8_engines, monkeypatch):  # noqa: F811
    model, _ = int8_sq_model(int8_engines["int8_sq"], "BF16")
    new_kv_cache = model.new_kv_cache
    monkeypatch.setattr(model, "new_kv_cache", lambda blocks, size: new_kv_cache(blocks, size, "BF16"))
    assert_rows_do_not_depend_on_the_batch(model)


def generate(engine_dir, requests, proposer=None, stagger=False):
    """({request_id: tokens}, the engine) from a fresh batch-invariant engine on fused layers with the option on."""
    engine = LLMEngine.from_engine_dir(engine_dir, proposer=proposer, batch_invariant=True, max_batch_size=8,
                                       max_seq_len=256, max_input_len=128, max_draft_len=6, compiled_layers=True,
                                       bf16_kv_cache=True)
    return drive(engine, requests, stagger)[0], engine


@needs_fused_int8
def test_speculative_greedy_equals_plain_greedy_over_a_bf16_cache(int8_engines):  # noqa: F811
    cases = list(enumerate(prompts()))
    plain = {}
    for case in cases:
        tokens, engine = generate(int8_engines["int8_sq"], [case])
        assert engine.kv.kv_dtype == "BF16" and isinstance(engine.model.fused_layers, fused_layers.FusedInt8Layers)
        plain.update(tokens)
    alone, _ = generate(int8_engines["int8_sq"], cases[:1], NgramProposer(1, 3))
    assert alone["r0"] == plain["r0"]
    batched, _ = generate(int8_engines["int8_sq"], cases, NgramProposer(1, 3), stagger=True)  # 8 in flight
    assert batched == plain


def test_the_option_keeps_float32_where_its_kernel_does_not_run(int8_engines, monkeypatch, caplog):  # noqa: F811
    monkeypatch.setenv(BF16_KV_CACHE_ENV, "1")
    monkeypatch.setattr(row_attention, "bf16_kernel", lambda: None)
    with caplog.at_level(logging.INFO):
        engine = LLMEngine.from_engine_dir(int8_engines["int8_sq"], max_batch_size=2, max_seq_len=128, max_input_len=64)
    assert engine.config.bf16_kv_cache and engine.kv.kv_dtype is None and engine.kv.k.dtype == torch.float32
    assert f"{BF16_KV_CACHE_ENV}: the bf16 KV cache needs the bf16 row attention kernel" in caplog.text
    monkeypatch.delenv(BF16_KV_CACHE_ENV)  # on by default (the suite sets it to 0)
    assert LLMEngine.from_engine_dir(int8_engines["int8_sq"], max_batch_size=2, max_seq_len=128,
                                     max_input_len=64).config.bf16_kv_cache


@needs_fused_int8
def test_engines_that_verify_trees_keep_a_float32_cache(int8_engines, tmp_path):  # noqa: F811
    """Medusa's and EAGLE's trees gather their keys for SDPA, which the bf16 layout makes dearer: float32 there."""
    model = LlamaModel.from_engine_dir(int8_engines["int8_sq"])
    medusa = MedusaProposer(load_medusa_dir(random_medusa_dir(tmp_path / "medusa"), model.lm_head), MEDUSA_CHOICES)
    config = EngineConfig(max_batch_size=2, max_seq_len=128, max_input_len=64, bf16_kv_cache=True)
    assert LLMEngine(model, config, medusa).kv.kv_dtype is None
    assert LLMEngine(model, config, NgramProposer(1, 3)).kv.kv_dtype == "BF16"


@needs_fused_int8
def test_repository_step_costs_are_timed_over_the_served_bf16_cache(int8_engines, monkeypatch):  # noqa: F811
    """The row costs and draft token costs `pipeline repo` writes price a served engine's steps: timed over a float32
    cache, they priced extra rows against a plain step dearer than the served one by its float32 attention."""
    monkeypatch.setenv(BF16_KV_CACHE_ENV, "1")
    created = []
    new_kv_cache = LlamaModel.new_kv_cache

    def recording(model, *args):  # the real cache, its kv_dtype recorded
        kv = new_kv_cache(model, *args)
        created.append(kv.kv_dtype)
        return kv

    monkeypatch.setattr(LlamaModel, "new_kv_cache", recording)
    (batch, costs), = step_cost.engine_row_costs(int8_engines["int8_sq"], (2,), 2)
    assert batch == 2 and len(costs) == 5 and costs[0] == 1.0
    assert created and set(created) == {"BF16"}  # the engine's own cache, then the timed forwards'
    created.clear()
    (k1,), = step_cost.engine_draft_token_costs(int8_engines["int8_sq"], None, (1,), (1,))
    assert k1[0] == 1 and k1[1] >= 0 and created and set(created) == {"BF16"}
