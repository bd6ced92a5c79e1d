"""Paged KV cache: preallocated K/V slots in fixed-size blocks, and a block manager with prefix reuse.

Storage (`KVCache`): per layer a [num_blocks * block_size, kv_heads, head_size] tensor for K and
one for V; token t of a sequence lives in slot block_table[t // block_size] * block_size +
t % block_size. With kv_dtype "INT8" values are stored as int8 with one float scale per
(slot, kv head) (symmetric, absmax / 127) and dequantized when gathered. With kv_dtype "BF16" (the 16-bit cache
TensorRT-LLM keeps for a bf16 model) they are rounded to bf16 (nearest even) and laid out for the bf16 row attention
kernel (csrc/bf16_kv.h): slots in groups of 16, per group and KV head the keys as [D / 2][16][2] (two dims of 16
keys side by side) and the values as [8][D][2] (two slots' values side by side); block_size a multiple of 16.

Reuse (`BlockManager`): a full block is identified by a hash chained over the token prefix,
hash(parent block's hash, this block's tokens), so equal hashes mean equal prefixes (up to 64-bit
collisions of Python's tuple hash). A request whose prompt starts with cached full blocks takes
them (reference count + 1) and computes only the rest. Blocks whose count drops to zero keep
their hash and sit in an LRU list; they are reused by a later request with the same prefix or
evicted (least recently freed first) when fresh blocks run out.

Partial reuse (TensorRT-LLM's enable_partial_reuse + copy_on_partial_reuse): a freed sequence's
last, partly valid block stays cached with its valid tokens, indexed (like every cached full block)
under its parent block's hash. After the full-block walk, a request copies the longest common
token prefix of one such block into a fresh block of its own, so the cached block stays intact
for others. This is what makes a client that re-sends a growing sequence (the BLS verify rounds)
compute only its new tokens instead of the whole unfinished last block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from pipeline.sequences import common_prefix_len


class KVCache:
    """Preallocated K/V storage for every layer, addressed by slot index."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype, kv_dtype: str | None = None):
        if kv_dtype not in (None, "INT8", "BF16"):
            raise ValueError(f"kv_cache_quant_algo {kv_dtype!r} is not supported by the reference engine; use null or INT8")
        if kv_dtype == "BF16" and (block_size % 16 or head_size % 2):
            raise ValueError(f"a bf16 KV cache needs blocks of a multiple of 16 tokens and an even head size, not "
                             f"{block_size} and {head_size}")
        self.num_blocks, self.block_size, self.dtype, self.kv_dtype = num_blocks, block_size, dtype, kv_dtype
        self.quantized = kv_dtype == "INT8"
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_size)
        # empty, not zeros: untouched pages cost no memory, and attention only ever gathers written slots
        if kv_dtype == "BF16":
            groups = num_blocks * block_size // 16
            self.k = torch.empty(num_layers, groups, num_kv_heads, head_size // 2, 16, 2, dtype=torch.bfloat16)
            self.v = torch.empty(num_layers, groups, num_kv_heads, 8, head_size, 2, dtype=torch.bfloat16)
            return
        store = torch.int8 if self.quantized else dtype
        self.k = torch.empty(shape, dtype=store)  # [layers, slots, KVH, D]
        self.v = torch.empty(shape, dtype=store)
        if self.quantized:
            self.k_scale = torch.empty(shape[:3] + (1,), dtype=torch.float32)  # [layers, slots, KVH, 1]
            self.v_scale = torch.empty(shape[:3] + (1,), dtype=torch.float32)

    def _bf16_places(self, slots: torch.Tensor) -> tuple[tuple, tuple]:
        """Index tuples of `slots` [S] into one layer's bf16 keys and values (after the layer index): keys[...] and
        values[...] are [S, KVH, D / 2, 2] and [S, KVH, D]."""
        group, place = slots // 16, slots % 16
        return (group, slice(None), slice(None), place), (group, slice(None), place // 2, slice(None), place % 2)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, KVH, D] at `slots` [T]."""
        if self.kv_dtype == "BF16":
            key_at, value_at = self._bf16_places(slots)
            self.k[layer][key_at] = k.to(torch.bfloat16).unflatten(-1, (-1, 2))
            self.v[layer][value_at] = v.to(torch.bfloat16)
            return
        # index_copy_ / index_select: advanced indexing (t[layer, slots]) is ~1000x slower on CPU under load
        if not self.quantized:
            self.k[layer].index_copy_(0, slots, k)
            self.v[layer].index_copy_(0, slots, v)
            return
        for store, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0  # [T, KVH, 1]
            store[layer].index_copy_(0, slots, torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8))
            scales[layer].index_copy_(0, slots, scale)

    def clear(self, slots: torch.Tensor) -> None:
        """Zero K/V of every layer at `slots` [P] (padding keys attention reads masked: they must be finite)."""
        if not len(slots):
            return
        if self.kv_dtype == "BF16":
            key_at, value_at = self._bf16_places(slots)
            self.k[(slice(None),) + key_at] = 0
            self.v[(slice(None),) + value_at] = 0
            return
        for t in (self.k, self.v) + ((self.k_scale, self.v_scale) if self.quantized else ()):
            t.index_fill_(1, slots, 0)

    def gather(self, layer: int, slots: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [S, KVH, D] of `slots` [S], in the compute dtype; a slice of consecutive slots reads views (no copy,
        except from a bf16 cache)."""
        if self.kv_dtype == "BF16":
            if isinstance(slots, slice):
                slots = torch.arange(slots.start, slots.stop)
            key_at, value_at = self._bf16_places(slots)
            return self.k[layer][key_at].flatten(-2).to(self.dtype), self.v[layer][value_at].to(self.dtype)
        if isinstance(slots, slice):
            k, v = self.k[layer, slots], self.v[layer, slots]
        else:
            k, v = self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)
        if self.quantized:
            k_scale, v_scale = ((s[layer, slots] if isinstance(slots, slice) else s[layer].index_select(0, slots))
                                for s in (self.k_scale, self.v_scale))
            k = (k.float() * k_scale).to(self.dtype)
            v = (v.float() * v_scale).to(self.dtype)
        return k, v

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from slots `src` [n] to `dst` [n] (compacts an accepted tree path)."""
        if self.kv_dtype == "BF16":
            (key_src, value_src), (key_dst, value_dst) = self._bf16_places(src), self._bf16_places(dst)
            self.k[(slice(None),) + key_dst] = self.k[(slice(None),) + key_src]
            self.v[(slice(None),) + value_dst] = self.v[(slice(None),) + value_src]
            return
        for t in (self.k, self.v) + ((self.k_scale, self.v_scale) if self.quantized else ()):
            t.index_copy_(1, dst, t.index_select(1, src))

    @property
    def nbytes(self) -> int:
        """Bytes of preallocated storage."""
        tensors = [self.k, self.v] + ([self.k_scale, self.v_scale] if self.quantized else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def describe(self) -> str:
        """One line for a server's log: what the cache stores, its blocks and its bytes."""
        kind = {"INT8": "int8", "BF16": "bf16"}.get(self.kv_dtype, str(self.dtype).removeprefix("torch."))
        return (f"{kind} KV cache, {self.num_blocks} blocks of {self.block_size} tokens "
                f"({self.nbytes / 2**20:.0f} MiB)")


class OutOfBlocks(RuntimeError):
    """No free or evictable block is left."""


@dataclass
class SequenceBlocks:
    """The blocks of one sequence and the chained hashes of its leading full, committed blocks."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hashes[i] belongs to blocks[i]
    num_cached: int = 0  # leading tokens whose KV match_prefix found (full blocks + a partial copy)
    copy_source: tuple[int, int] | None = None  # (cached block, n): copy its first n slots into blocks[len(hashes)]


class BlockManager:
    """Allocation, reference counts, prefix hashing and LRU eviction of KV blocks."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks  # full blocks only
        self.by_hash: dict[int, int] = {}  # hash -> block holding that prefix
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # valid tokens of a cached block (full or partial)
        self.block_parent: list[int | None] = [None] * num_blocks  # its parent block's hash (None: first block)
        self.by_parent: dict[int | None, dict[int, None]] = {}  # parent hash -> cached blocks after it (ordered set)
        self.free_fresh = list(range(num_blocks - 1, -1, -1))  # unhashed free blocks (stack)
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # hashed free blocks, least recently freed first

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (fresh or evictable)."""
        return len(self.free_fresh) + len(self.free_cached)

    def chain_hash(self, parent: int | None, tokens: list[int]) -> int:
        """The hash of a full block given its parent block's hash and its tokens."""
        return hash((parent, tuple(tokens)))

    def match_prefix(self, token_ids: list[int]) -> SequenceBlocks:
        """Take the cached full blocks that start `token_ids`, then a fresh block to copy a partial match into.

        Never covers the last token (it is always computed, for its logits). With a partial match,
        `copy_source` names the cached block and its matching slot count, pinned until the caller
        has copied the KV and called `release_copy_source` (or `free`).
        """
        seq = SequenceBlocks()
        bs, parent = self.block_size, None
        for i in range((len(token_ids) - 1) // bs):
            h = self.chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            block = self.by_hash.get(h)
            if block is None:
                break
            self._take(block)
            seq.blocks.append(block)
            seq.hashes.append(h)
            parent = h
        start = len(seq.blocks) * bs
        seq.num_cached = start
        source, n = self._longest_partial(parent, token_ids[start:min(len(token_ids) - 1, start + bs)])
        if n == 0:
            return seq
        self._take(source)  # pinned: allocating the copy's block must not evict it
        if self.num_free == 0:
            self.release_blocks([source])
            return seq
        seq.blocks.append(self._allocate())
        seq.copy_source = (source, n)
        seq.num_cached = start + n
        return seq

    def release_copy_source(self, seq: SequenceBlocks) -> None:
        """Unpin the block a partial match was copied from (after the KV copy)."""
        if seq.copy_source is not None:
            self.release_blocks([seq.copy_source[0]])
            seq.copy_source = None

    def _longest_partial(self, parent: int | None, tokens: list[int]) -> tuple[int, int]:
        """The cached block after `parent` sharing the longest token prefix with `tokens`, and that length."""
        best, best_n = -1, 0
        for block in self.by_parent.get(parent, ()):
            n = common_prefix_len(self.block_tokens[block], tokens)
            if n > best_n:
                best, best_n = block, n
        return best, best_n

    def ensure_capacity(self, seq: SequenceBlocks, num_tokens: int) -> None:
        """Append fresh blocks until `seq` holds `num_tokens` tokens; raises OutOfBlocks (allocating nothing)."""
        needed = -(-num_tokens // self.block_size) - len(seq.blocks)
        if needed > self.num_free:
            raise OutOfBlocks(f"need {needed} KV blocks, {self.num_free} free")
        for _ in range(max(needed, 0)):
            seq.blocks.append(self._allocate())

    def commit(self, seq: SequenceBlocks, token_ids: list[int], num_valid: int) -> None:
        """Hash the full blocks among the first `num_valid` tokens (whose KV is final) so others can reuse them."""
        bs = self.block_size
        for i in range(len(seq.hashes), num_valid // bs):
            parent, tokens = seq.hashes[-1] if seq.hashes else None, tuple(token_ids[i * bs:(i + 1) * bs])
            h = self.chain_hash(parent, tokens)
            seq.hashes.append(h)
            block = seq.blocks[i]
            if h not in self.by_hash and self.block_hash[block] is None:
                self.by_hash[h] = block
                self.block_hash[block] = h
                self._index(block, parent, tokens)

    def free(self, seq: SequenceBlocks, token_ids: list[int] | None = None, num_valid: int = 0) -> None:
        """Release every block of a finished or cancelled sequence.

        With `token_ids`, the first `num_valid` of which have final KV (committed), the valid tokens of
        its last, partly filled block stay cached for partial reuse.
        """
        self.release_copy_source(seq)
        full = num_valid // self.block_size
        if token_ids is not None and num_valid % self.block_size and len(seq.hashes) == full < len(seq.blocks):
            self._cache_partial(seq.blocks[full], seq.hashes[-1] if full else None, tuple(token_ids[full * self.block_size:num_valid]))
        self.release_blocks(seq.blocks)
        seq.blocks, seq.hashes, seq.num_cached = [], [], 0

    def _cache_partial(self, block: int, parent: int | None, tokens: tuple[int, ...]) -> None:
        """Index a partly valid block, unless a cached block already covers its tokens; drops the entries it covers."""
        if self.ref_count[block] != 1 or self.block_tokens[block] is not None:
            return
        for other in list(self.by_parent.get(parent, ())):
            cached = self.block_tokens[other]
            if cached[:len(tokens)] == tokens:
                return
            if tokens[:len(cached)] == cached and self.block_hash[other] is None and self.ref_count[other] == 0:
                self._unindex(other)  # a shorter copy of the same prefix: make it a fresh block
                del self.free_cached[other]
                self.free_fresh.append(other)
        self._index(block, parent, tokens)

    def _index(self, block: int, parent: int | None, tokens: tuple[int, ...]) -> None:
        self.block_tokens[block], self.block_parent[block] = tokens, parent
        self.by_parent.setdefault(parent, {})[block] = None

    def _unindex(self, block: int) -> None:
        if self.block_hash[block] is not None:
            del self.by_hash[self.block_hash[block]]
            self.block_hash[block] = None
        siblings = self.by_parent[self.block_parent[block]]
        del siblings[block]
        if not siblings:
            del self.by_parent[self.block_parent[block]]
        self.block_tokens[block] = self.block_parent[block] = None

    def release_blocks(self, blocks: list[int]) -> None:
        """Decrement reference counts; unreferenced hashed blocks become evictable, others fresh."""
        for block in reversed(blocks):  # tail blocks first, so the LRU evicts them before the shared prefix
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                if self.block_tokens[block] is not None:
                    self.free_cached[block] = None
                else:
                    self.free_fresh.append(block)

    def _take(self, block: int) -> None:
        if self.ref_count[block] == 0:
            self.free_cached.pop(block, None)
        self.ref_count[block] += 1

    def _allocate(self) -> int:
        if self.free_fresh:
            block = self.free_fresh.pop()
        else:
            block, _ = self.free_cached.popitem(last=False)  # evict the least recently freed cached block
            self._unindex(block)
        self.ref_count[block] = 1
        return block
