"""The reference LlamaModel against transformers (fp32 logits), over paged KV, trees and ragged batches."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import torch.nn.functional as F

from pipeline.reference.model import (DECODE_ROWS, KEY_ALIGN, LlamaModel, SequenceInput, _slots_or_range, config_from_hf,
                                        perplexity)
from pipeline.fixtures.toymodels import tiny_config

BLOCK = 16


def blocks_for(first: int, num_tokens: int) -> list[int]:
    """A block table of consecutive blocks starting at `first`, holding num_tokens."""
    return list(range(first, first + -(-num_tokens // BLOCK)))


def full_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Prefill ids in one forward and return the logits of every position [len(ids), vocab]."""
    kv = model.new_kv_cache(64, BLOCK)
    return model([SequenceInput(ids, 0, blocks_for(0, len(ids)), logits_rows=list(range(len(ids))))], kv).logits


def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def random_ids(n: int, vocab: int = 512, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def save_random(model_cls, config, path: Path) -> Path:
    torch.manual_seed(0)
    model_cls(config).eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """A tiny random Qwen2 (q/k/v biases, untied)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # biases start at zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("qwen2") / "m"
    model.save_pretrained(path, safe_serialization=True)
    return path


ROPE_SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 4.0},
}


def test_logits_match_transformers_tied_gqa(tiny_llama):
    ids = random_ids(40)
    model = LlamaModel.from_hf(tiny_llama)
    assert model.config["tie_word_embeddings"] and model.num_kv_heads < model.num_heads
    torch.testing.assert_close(full_logits(model, ids), hf_logits(tiny_llama, ids), atol=1e-4, rtol=0)


def test_logits_match_transformers_untied(derived_pair):
    target, _ = derived_pair
    ids = random_ids(33, seed=1)
    model = LlamaModel.from_hf(target)
    assert not model.config["tie_word_embeddings"]
    torch.testing.assert_close(full_logits(model, ids), hf_logits(target, ids), atol=1e-4, rtol=0)


def test_logits_match_transformers_qwen2_biases(qwen2_dir):
    ids = random_ids(25, seed=2)
    model = LlamaModel.from_hf(qwen2_dir)
    assert model.layers[0]["qkv"].bias is not None
    torch.testing.assert_close(full_logits(model, ids), hf_logits(qwen2_dir, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", sorted(ROPE_SCALINGS))
def test_logits_match_transformers_with_rope_scaling(kind, tmp_path):
    config = tiny_config(layers=2, tie_word_embeddings=False, head_dim=16, rope_scaling=ROPE_SCALINGS[kind])
    path = save_random(LlamaForCausalLM, config, tmp_path / kind)
    ids = random_ids(150, seed=3)  # beyond original_max_position_embeddings, where llama3 scaling matters
    model = LlamaModel.from_hf(path)
    assert model.config["rotary_scaling"]["rope_type"] == kind
    torch.testing.assert_close(full_logits(model, ids), hf_logits(path, ids), atol=1e-4, rtol=0)


def test_cached_prefix_plus_new_tokens_equals_one_pass(tiny_llama):
    model = LlamaModel.from_hf(tiny_llama)
    ids = random_ids(45, seed=4)
    ref = full_logits(model, ids)
    kv = model.new_kv_cache(64, BLOCK)
    table = [7, 2, 9]  # non-contiguous blocks
    model([SequenceInput(ids[:20], 0, table[:2])], kv)
    out = model([SequenceInput(ids[20:44], 20, table, logits_rows=list(range(24)))], kv).logits
    step = model([SequenceInput(ids[44:], 44, table)], kv).logits
    torch.testing.assert_close(out, ref[20:44], atol=1e-5, rtol=0)
    torch.testing.assert_close(step[0], ref[44], atol=1e-5, rtol=0)


def test_tree_tokens_see_only_their_ancestors(tiny_llama):
    """Logits of every tree node equal those of its root-to-node path run as a plain sequence."""
    model = LlamaModel.from_hf(tiny_llama)
    prefix = random_ids(18, seed=5)
    tree = [11, 22, 33, 44, 55]
    parents = [-1, -1, 0, 0, 2]  # two branches off the prefix; node 4 = 11 -> 33 -> 55
    kv = model.new_kv_cache(64, BLOCK)
    table = blocks_for(0, len(prefix) + len(tree))
    model([SequenceInput(prefix, 0, table)], kv)
    got = model([SequenceInput(tree, len(prefix), table, parents=parents, logits_rows=list(range(5)))], kv).logits
    paths = [[11], [22], [11, 33], [11, 44], [11, 33, 55]]
    for node, path in enumerate(paths):
        torch.testing.assert_close(got[node], full_logits(model, prefix + path)[-1], atol=1e-5, rtol=0)


def test_ragged_batch_is_bitwise_batch_invariant(tiny_llama):
    """With batch_invariant, a sequence's logits do not depend on what else is in the forward."""
    model = LlamaModel.from_hf(tiny_llama, batch_invariant=True)
    a, b, c = random_ids(30, seed=6), random_ids(5, seed=7), random_ids(17, seed=8)

    def alone(ids):
        kv = model.new_kv_cache(64, BLOCK)
        model([SequenceInput(ids[:-3], 0, blocks_for(0, len(ids)))], kv)
        return model([SequenceInput(ids[-3:], len(ids) - 3, blocks_for(0, len(ids)), logits_rows=[0, 1, 2])], kv).logits

    kv = model.new_kv_cache(64, BLOCK)
    tables = [blocks_for(0, 30), blocks_for(10, 5), blocks_for(20, 17)]
    model([SequenceInput(s[:-3], 0, t) for s, t in zip((a, b, c), tables)], kv)
    batched = model([SequenceInput(s[-3:], len(s) - 3, t, logits_rows=[0, 1, 2]) for s, t in zip((a, b, c), tables)], kv).logits
    assert torch.equal(batched, torch.cat([alone(a), alone(b), alone(c)]))


def test_consecutive_and_scattered_kv_blocks_give_the_same_bits(tiny_llama):
    """Attention reads a sequence's consecutive KV slots as views and scattered ones by gathering: same logits, bit for bit."""
    pad: list[torch.Tensor] = []
    assert _slots_or_range(torch.arange(32, 80), 38, 16, KEY_ALIGN, pad) == (slice(32, 80), 48)
    assert torch.equal(torch.cat(pad), torch.arange(70, 80))  # the aligned view's padding slots, zeroed by the forward
    keys, S = _slots_or_range(torch.tensor([32, 33, 35]), 3, 16, KEY_ALIGN, pad)
    assert S == KEY_ALIGN and torch.equal(keys, torch.tensor([[32, 33, 35] + [32] * 13]))  # gathered, padded with the first
    ids = random_ids(40, seed=11)
    for batch_invariant in (False, True):
        model = LlamaModel.from_hf(tiny_llama, batch_invariant=batch_invariant)
        runs = []
        for table in ([0, 1, 2], [7, 2, 9]):  # consecutive slots, then scattered blocks
            kv = model.new_kv_cache(16, BLOCK)
            model([SequenceInput(ids[:34], 0, table)], kv)
            verify = model([SequenceInput(ids[34:39], 34, table, logits_rows=list(range(5)))], kv).logits
            step = model([SequenceInput(ids[39:], 39, table)], kv).logits
            runs.append(torch.cat([verify, step]))
        assert torch.equal(runs[0], runs[1])


def test_small_forwards_run_on_the_decode_thread_count(tiny_llama):
    """Decode steps and verifies (<= DECODE_ROWS new tokens) run on decode_threads; prefill keeps torch's count."""
    model = LlamaModel.from_hf(tiny_llama)
    kernel, seen = model.layers[0]["o"], []

    class Recording:  # the real kernel, noting the thread count it runs under
        batch_invariant = kernel.batch_invariant

        def __call__(self, x):
            seen.append(torch.get_num_threads())
            return kernel(x)

    model.layers[0]["o"] = Recording()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ids = random_ids(DECODE_ROWS + 8, seed=13)
        kv = model.new_kv_cache(8, BLOCK)
        model([SequenceInput(ids[:-1], 0, blocks_for(0, len(ids)))], kv)  # prefill: more than DECODE_ROWS tokens
        model([SequenceInput(ids[-1:], len(ids) - 1, blocks_for(0, len(ids)))], kv)  # decode step
        model.batch_invariant = True  # exact mode: every forward on the decode thread count
        model([SequenceInput(ids[:-1], 0, blocks_for(0, len(ids)))], kv)
        assert seen[:2] == [2, 1] and set(seen[2:]) == {1} and torch.get_num_threads() == 2  # exact mode: row by row
    finally:
        torch.set_num_threads(before)


def test_float32_rms_norm_is_hf_normalise_then_scale(tiny_llama):
    model = LlamaModel.from_hf(tiny_llama)
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(5, model.hidden_size, generator=g) * 3, torch.rand(model.hidden_size, generator=g) + 0.5
    hf = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.eps))  # transformers' LlamaRMSNorm in fp32
    assert torch.equal(model.rms_norm(x, w), hf)


def test_hidden_states_are_the_lm_head_input(tiny_llama):
    model = LlamaModel.from_hf(tiny_llama)
    ids = random_ids(9, seed=9)
    out = model([SequenceInput(ids, 0, blocks_for(0, 9), logits_rows=list(range(9)))], model.new_kv_cache(8, BLOCK),
                return_hidden=True)
    assert out.hidden_states.shape == (9, model.hidden_size)
    torch.testing.assert_close(out.hidden_states @ model.lm_head.T, out.logits, atol=1e-5, rtol=0)


def test_int8_kv_cache_stays_close(tiny_llama):
    model = LlamaModel.from_hf(tiny_llama)
    ids = random_ids(30, seed=10)
    ref = full_logits(model, ids)
    kv = model.new_kv_cache(64, BLOCK, "INT8")
    assert kv.k.dtype == torch.int8
    got = model([SequenceInput(ids, 0, blocks_for(0, 30), logits_rows=list(range(30)))], kv).logits
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert not torch.equal(got, ref)


def test_engine_dir_round_trip(tiny_llama, tmp_path):
    """from_engine_dir reads the engine layout written by pipeline.reference.checkpoint."""
    from safetensors.torch import load_file

    from pipeline.reference.checkpoint import save_engine

    config = {"pretrained_config": config_from_hf(json.loads((tiny_llama / "config.json").read_text())),
              "build_config": {"max_batch_size": 2}}
    save_engine(tmp_path / "engine", config, load_file(tiny_llama / "model.safetensors"))
    ids = random_ids(12, seed=11)
    torch.testing.assert_close(full_logits(LlamaModel.from_engine_dir(tmp_path / "engine"), ids),
                               full_logits(LlamaModel.from_hf(tiny_llama), ids), atol=0, rtol=0)


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        config_from_hf({"architectures": ["GPT2LMHeadModel"]})


def find_smollm2() -> Path | None:
    """The SmolLM2-135M checkpoint `make models` extracts under models/ (any folder with its shape)."""
    for config in sorted(Path("models").glob("**/config.json")):
        c = json.loads(config.read_text())
        if c.get("hidden_size") == 576 and c.get("num_hidden_layers") == 30 and c.get("vocab_size") == 49152:
            return config.parent
    return None


@pytest.mark.slow
def test_smollm2_logits_match_transformers():
    path = find_smollm2()
    if path is None:
        pytest.skip("SmolLM2-135M not found under models/: run `make models` first")
    ids = random_ids(64, vocab=49152, seed=12)
    torch.testing.assert_close(full_logits(LlamaModel.from_hf(path), ids), hf_logits(path, ids), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_smollm2_quantized_weights_run_with_small_perplexity_change():
    """Weight-only int8 / int4 (grouped) / fp8-stored weights, dequantized as load_engine does; prints the table."""
    from transformers import AutoTokenizer

    from pipeline.reference.checkpoint import dequantize_linear, is_quantized_linear, quantize_linear
    from pipeline.corpus import local_text

    path = find_smollm2()
    if path is None:
        pytest.skip("SmolLM2-135M not found under models/: run `make models` first")
    ids = AutoTokenizer.from_pretrained(path)(local_text(20_000)[5_000:8_000]).input_ids[:512]
    base = LlamaModel.from_hf(path)
    config = dict(base.config)
    from safetensors.torch import load_file

    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(f))
    ppl = {"float32": perplexity(base, ids)}
    for algo in ("W8A16", "FP8", "W4A16"):
        dense = {k: dequantize_linear(quantize_linear(v, algo, 64), algo, 64) if is_quantized_linear(k) else v
                 for k, v in state.items()}
        ppl[algo] = perplexity(LlamaModel(config, dense), ids)
    print("perplexity on 512 tokens of pydoc text:", {k: round(v, 3) for k, v in ppl.items()})
    assert ppl["float32"] < 30
    assert abs(ppl["W8A16"] / ppl["float32"] - 1) < 0.02
    assert abs(ppl["FP8"] / ppl["float32"] - 1) < 0.10
    assert abs(ppl["W4A16"] / ppl["float32"] - 1) < 0.60  # measured +51%: a 135M model (itself from a Q4_1 GGUF) is fragile


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_transformers(tiny_llama, dtype):
    ids = random_ids(20, seed=13)
    model = LlamaModel.from_hf(tiny_llama, dtype)
    assert model.embed.dtype == getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    got = full_logits(model, ids)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_batched_one_token_rows_match_each_alone(tiny_llama):
    """Without batch invariance, consecutive decode rows share one padded, masked SDPA call."""
    model = LlamaModel.from_hf(tiny_llama)
    seqs = [random_ids(n, seed=20 + n) for n in (30, 5, 17)]
    tables = [blocks_for(0, 30), blocks_for(10, 5), blocks_for(20, 17)]
    kv = model.new_kv_cache(64, BLOCK)
    model([SequenceInput(s[:-1], 0, t) for s, t in zip(seqs, tables)], kv)
    batched = model([SequenceInput(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables)], kv).logits
    for s, row in zip(seqs, batched):
        torch.testing.assert_close(row, full_logits(model, s)[-1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("heads, kv_heads, head_size, dtype", [(4, 2, 16, torch.float32), (9, 3, 64, torch.float32),
                                                              (9, 3, 64, torch.bfloat16)])  # tiny Llama; SmolLM2-135M
def test_sdpa_row_alone_in_its_batch_element_ignores_its_neighbours(heads, kv_heads, head_size, dtype):
    """What batch-invariant attention relies on, over many key counts: torch's CPU SDPA gives a token that is alone in
    its batch element (its query heads of each KV head as that head's query rows) over S = L aligned to KEY_ALIGN
    keys, L visible, the same bits whatever the other batch elements of the call hold, as plain one-token decoding
    computes it; on one thread, as exact mode runs. (Over a different key count the bits may change: from 400 keys
    on they do, for 3 query rows per KV head, so each call has exactly the key count of its tokens' own decode.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_rows_alone(heads, kv_heads, head_size, dtype)
    finally:
        torch.set_num_threads(before)


def _check_rows_alone(heads: int, kv_heads: int, head_size: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, kv_heads, 1200, head_size, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, 1200, head_size, generator=g).to(dtype)
    q = torch.randn(6, kv_heads, heads // kv_heads, head_size, generator=g).to(dtype)  # [batch, KVH, query heads per KV head, D]

    def attend(batch: int, S: int, lengths: list[int]) -> torch.Tensor:
        mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]  # [batch, 1, 1, S]
        return F.scaled_dot_product_attention(q[:batch], k[:, :, :S].expand(batch, -1, -1, -1),
                                              v[:, :, :S].expand(batch, -1, -1, -1), attn_mask=mask)

    for L in list(range(1, 80)) + list(range(150, 1100, 29)):
        S = -(-L // KEY_ALIGN) * KEY_ALIGN
        alone = attend(1, S, [L])[0]
        if L == S:  # no padding: the same bits as the unmasked call
            assert torch.equal(alone, F.scaled_dot_product_attention(q[:1], k[:, :, :L], v[:, :, :L])[0])
        for batch in (2, 3, 6):
            others = [S - KEY_ALIGN + 1 + (L * 7 + j * 5) % KEY_ALIGN for j in range(1, batch)]  # in L's bucket
            assert torch.equal(attend(batch, S, [L] + others)[0], alone), (L, batch)


def test_verify_rows_and_batched_decodes_equal_plain_decode_steps_bit_for_bit(tiny_llama):
    """batch_invariant: every token of a 6-token verify, and every decode step beside 7 other sequences, gives
    the logits plain one-token decoding gives, bit for bit, at context lengths around KEY_ALIGN and block
    boundaries, from consecutive and scattered blocks, with never-written cache memory holding NaN."""
    model = LlamaModel.from_hf(tiny_llama, batch_invariant=True)

    def nan_cache():
        kv = model.new_kv_cache(256, BLOCK)
        kv.k.fill_(float("nan"))
        kv.v.fill_(float("nan"))
        return kv

    others = [random_ids(n, seed=100 + n) for n in (3, 50, 77, 130, 9, 33, 260)]
    for c in (1, 2, 9, 15, 16, 17, 31, 33, 47, 64, 100, 250):
        ids = random_ids(c + 6, seed=c)
        table = blocks_for(0, c + 6)
        kv = nan_cache()
        model([SequenceInput(ids[:c], 0, table)], kv)
        steps = torch.cat([model([SequenceInput([t], c + i, table)], kv).logits for i, t in enumerate(ids[c:])])
        assert torch.isfinite(steps).all()
        kv = nan_cache()
        model([SequenceInput(ids[:c], 0, table)], kv)
        verify = model([SequenceInput(ids[c:], c, table, logits_rows=list(range(6)))], kv).logits
        assert torch.equal(verify, steps), c
        kv = nan_cache()
        scattered = list(reversed(blocks_for(20, c + 6)))  # gathered keys instead of views
        tables = [blocks_for(40 + 20 * j, len(o) + 6) for j, o in enumerate(others)]
        model([SequenceInput(ids[:c], 0, scattered)] + [SequenceInput(o[:-1], 0, t) for o, t in zip(others, tables)], kv)
        batched = []
        for i, t in enumerate(ids[c:]):
            rows = [SequenceInput([o[-1] if i == 0 else 5], len(o) - 1 + i, tb) for o, tb in zip(others, tables)]
            batched.append(model(rows[:3] + [SequenceInput([t], c + i, scattered)] + rows[3:], kv).logits[3])
        assert torch.equal(torch.stack(batched), steps), c


def test_verify_rows_after_long_contexts_equal_plain_decode_steps_bit_for_bit(tiny_llama):
    """batch_invariant, past the 400 keys where the SDPA kernel's bits start to depend on the key count: each token
    of a 6-token verify still gives plain decoding's logits bit for bit (its call has its own decode's key count)."""
    model = LlamaModel.from_hf(tiny_llama, batch_invariant=True)
    for c in (380, 395, 410, 470, 500):
        ids = random_ids(c + 6, seed=c)
        table = blocks_for(0, c + 6)
        kv = model.new_kv_cache(64, BLOCK)
        model([SequenceInput(ids[:c], 0, table)], kv)
        steps = torch.cat([model([SequenceInput([t], c + i, table)], kv).logits for i, t in enumerate(ids[c:])])
        kv = model.new_kv_cache(64, BLOCK)
        model([SequenceInput(ids[:c], 0, table)], kv)
        verify = model([SequenceInput(ids[c:], c, table, logits_rows=list(range(6)))], kv).logits
        assert torch.equal(verify, steps), c
