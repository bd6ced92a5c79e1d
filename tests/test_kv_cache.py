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
        # consecutive slots read as a slice (views, no gather) give the gathered values
        assert all(torch.equal(a, b) for a, b in zip(cache.gather(1, slice(2, 5)), cache.gather(1, torch.arange(2, 5))))


def test_unknown_kv_cache_quant_algo_is_refused():
    with pytest.raises(ValueError, match="kv_cache_quant_algo"):
        KVCache(1, 1, BS, 1, 8, torch.float32, kv_dtype="FP8")


# ------------------------------------------------------------------ partial-block reuse (copy on reuse)

def finish(mgr: BlockManager, tokens: list[int], num_valid: int):
    """A sequence that computed `num_valid` of `tokens` and leaves: its valid tail block stays cached."""
    seq, _ = prefill(mgr, tokens[:num_valid])
    mgr.ensure_capacity(seq, len(tokens))
    mgr.free(seq, tokens, num_valid)


def test_valid_tail_of_a_freed_sequence_is_copied_not_shared():
    mgr = BlockManager(num_blocks=16, block_size=BS)
    tokens = list(range(11))
    finish(mgr, tokens, 10)  # token 10 was sampled last: its KV was never computed
    source = next(b for b in range(16) if mgr.block_tokens[b] == (8, 9))
    seq = mgr.match_prefix(tokens + [50, 51])
    assert seq.num_cached == 10  # two full blocks + slots 8, 9; token 10 is not cached
    assert seq.copy_source == (source, 2) and seq.blocks[2] != source
    assert mgr.ref_count[source] == 1  # pinned until the KV is copied
    mgr.release_copy_source(seq)
    assert mgr.ref_count[source] == 0 and source in mgr.free_cached
    assert cached_tokens(mgr, list(range(9)) + [77, 78]) == 9  # longest common prefix: slot 8 only


def test_full_blocks_are_partial_candidates_and_the_last_token_is_computed():
    mgr = BlockManager(num_blocks=16, block_size=BS)
    finish(mgr, [5, 6, 7, 8, 9], 4)
    assert cached_tokens(mgr, [5, 6, 1, 2]) == 2  # two slots of the full block [5, 6, 7, 8]
    assert cached_tokens(mgr, [5, 6, 7, 8]) == 3


def test_a_longer_tail_supersedes_its_prefix_entry():
    """BLS rounds: each round's tail extends the previous one; only the longest stays indexed."""
    mgr = BlockManager(num_blocks=16, block_size=BS)
    finish(mgr, list(range(7)), 6)  # tail (4, 5)
    first = next(b for b in range(16) if mgr.block_tokens[b] == (4, 5))
    finish(mgr, list(range(8)), 7)  # tail (4, 5, 6)
    assert mgr.block_tokens[first] is None and first not in mgr.free_cached
    assert [mgr.block_tokens[b] for b in range(16)].count((4, 5, 6)) == 1
    finish(mgr, list(range(6)), 5)  # (4,) is covered by (4, 5, 6): nothing new is indexed
    assert sum(t is not None for t in mgr.block_tokens) == 2
    assert cached_tokens(mgr, list(range(8)) + [1]) == 7


def test_evicted_partial_block_leaves_the_index():
    mgr = BlockManager(num_blocks=3, block_size=BS)
    finish(mgr, [1, 2, 3, 4, 5, 6, 7], 6)  # one full block [1-4] + tail (5, 6)
    assert cached_tokens(mgr, [1, 2, 3, 4, 5, 6, 0]) == 6
    mgr.free(prefill(mgr, [9] * 10)[0])  # 3 blocks: evicts both cached blocks
    assert cached_tokens(mgr, [1, 2, 3, 4, 5, 6, 0]) == 0
    assert all(t is None or t[0] == 9 for t in mgr.block_tokens) and mgr.by_hash.keys() == {
        mgr.chain_hash(None, [9] * 4), mgr.chain_hash(mgr.chain_hash(None, [9] * 4), [9] * 4)}


def test_copy_source_is_not_evicted_by_the_copy_or_the_rest_of_the_prompt():
    mgr = BlockManager(num_blocks=2, block_size=BS)
    finish(mgr, [1, 2, 3], 2)  # tail (1, 2) in one block; the other block is fresh
    seq = mgr.match_prefix([1, 2, 5, 6, 7, 8])
    assert seq.num_cached == 2 and mgr.num_free == 0
    with pytest.raises(OutOfBlocks):
        mgr.ensure_capacity(seq, 6)  # would need to evict the pinned source
    mgr.free(seq)
    assert mgr.num_free == 2 and all(r == 0 for r in mgr.ref_count)
    assert cached_tokens(mgr, [1, 2, 9]) == 2  # the source kept its tokens
