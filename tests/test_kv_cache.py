"""Block manager: chained prefix hashes, reuse, reference counts, LRU eviction; KV storage."""

import pytest
import torch

from pipeline.reference.kv_cache import BlockManager, KVCache, OutOfBlocks

BS = 4


def prefill(mgr: BlockManager, tokens: list[int]):
    """What the engine does for a new prompt: reuse cached blocks, allocate the rest, commit the full ones."""
    seq = mgr.match_prefix(tokens)
    reused = seq.num_cached
    mgr.ensure_capacity(seq, len(tokens))
    mgr.commit(seq, tokens, len(tokens))
    return seq, reused


def test_same_prefix_reuses_full_blocks_only():
    mgr = BlockManager(num_blocks=16, block_size=BS)
    a, reused_a = prefill(mgr, list(range(10)))  # blocks [0-3] [4-7] full, [8, 9] partial
    assert reused_a == 0 and len(a.blocks) == 3
    b, reused_b = prefill(mgr, list(range(8)) + [99, 98, 97])
    assert reused_b == 8 and b.blocks[:2] == a.blocks[:2] and b.blocks[2] != a.blocks[2]
    assert mgr.ref_count[a.blocks[0]] == 2


def test_hash_is_chained_over_the_whole_prefix():
    """Equal second blocks after different first blocks are different prefixes."""
    mgr = BlockManager(num_blocks=16, block_size=BS)
    prefill(mgr, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    _, reused = prefill(mgr, [9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert reused == 0


def test_last_token_is_never_served_from_cache():
    mgr = BlockManager(num_blocks=16, block_size=BS)
    prefill(mgr, list(range(8)))
    _, reused = prefill(mgr, list(range(8)))  # fully cached prompt: only its last token is recomputed for logits
    assert reused == 7  # one full block + 3 slots copied from the cached second block


def cached_tokens(mgr: BlockManager, tokens: list[int]) -> int:
    """How many leading tokens a new request with `tokens` would reuse (then gives the blocks back)."""
    seq = mgr.match_prefix(tokens)
    reused = seq.num_cached
    mgr.free(seq)
    return reused


def test_freed_blocks_stay_reusable_until_evicted_lru():
    mgr = BlockManager(num_blocks=4, block_size=BS)
    for tokens in ([1] * 4 + [0], [2] * 4 + [0]):  # each: one full hashed block + one partial block
        mgr.free(prefill(mgr, tokens)[0])
    assert mgr.num_free == 4
    touched, reused = prefill(mgr, [1] * 4 + [5])  # reuses [1]*4: now the most recently freed one
    assert reused == 4
    mgr.free(touched)
    mgr.free(prefill(mgr, [3] * 9)[0])  # 3 blocks: 2 fresh + evicts the least recently freed, [2]*4
    assert cached_tokens(mgr, [1] * 4 + [0]) == 4
    assert cached_tokens(mgr, [2] * 4 + [0]) == 0
    assert cached_tokens(mgr, [3] * 9) == 8


def test_out_of_blocks_allocates_nothing():
    mgr = BlockManager(num_blocks=2, block_size=BS)
    seq = mgr.match_prefix([1, 2, 3])
    with pytest.raises(OutOfBlocks):
        mgr.ensure_capacity(seq, 3 * BS)
    assert seq.blocks == [] and mgr.num_free == 2


def test_free_returns_every_block():
    mgr = BlockManager(num_blocks=8, block_size=BS)
    a, _ = prefill(mgr, list(range(13)))
    b, _ = prefill(mgr, list(range(13)))
    mgr.free(a)
    mgr.free(b)
    assert mgr.num_free == 8 and all(r == 0 for r in mgr.ref_count)


def test_kv_write_gather_and_int8_round_trip():
    torch.manual_seed(0)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([3, 9, 4, 0, 15])
    for kv_dtype, tol in ((None, 0.0), ("INT8", 0.02)):
        cache = KVCache(num_layers=2, num_blocks=4, block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32,
                        kv_dtype=kv_dtype)
        cache.write(0, slots, v, k)
        layer0 = cache.gather(0, slots)
        cache.write(1, slots, k, v)
        gk, gv = cache.gather(1, slots)
        assert (gk - k).abs().max() <= tol * k.abs().max() and (gv - v).abs().max() <= tol * v.abs().max()
        assert all(torch.equal(a, b) for a, b in zip(cache.gather(0, slots), layer0))  # other layers untouched
        cache.copy_slots(torch.tensor([3, 9]), torch.tensor([1, 2]))
        torch.testing.assert_close(cache.gather(1, torch.tensor([1, 2]))[0], gk[:2], atol=0, rtol=0)


def test_unknown_kv_cache_quant_algo_is_refused():
    with pytest.raises(ValueError, match="kv_cache_quant_algo"):
        KVCache(1, 1, BS, 1, 8, torch.float32, kv_dtype="FP8")
