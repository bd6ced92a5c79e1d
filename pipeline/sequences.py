"""Pure token-sequence helpers shared by the reference engine and the BLS (no torch, no numpy): prefix
matching (KV cache, accepted drafts), prompt lookup (n-gram drafts), the adaptive draft length and stop
detection."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def ngram_lookup(token_ids: Sequence[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Prompt lookup: the up-to-k tokens that followed the latest earlier occurrence of the longest suffix of
    `token_ids` of min_ngram..max_ngram tokens ([] when none matches)."""
    if k <= 0:
        return []
    tokens = list(token_ids)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first; each occurrence has a following token
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def find_stop(generated: Sequence[int], num_new: int, end_id: int | None,
              stop_words: Sequence[Sequence[int]]) -> tuple[int, str | None]:
    """Check the last `num_new` generated tokens for end_id / stop words.

    Returns (how many of the new tokens to keep, finish reason or None). end_id is dropped from the
    output; a stop word is kept.
    """
    start = len(generated) - num_new
    for i in range(start, len(generated)):
        if end_id is not None and generated[i] == end_id:
            return i - start, "end_id"
        for word in stop_words:
            if i + 1 >= len(word) and list(generated[i + 1 - len(word):i + 1]) == list(word):
                return i + 1 - start, "stop"
    return num_new, None


def next_draft_len(draft_len: int, num_accepted: int, num_proposed: int, max_draft_len: int) -> int:
    """Adaptive K (transformers' "heuristic" schedule): after a verify of num_proposed > 0 draft tokens, the next
    draft is 2 longer if every token was accepted, else 1 shorter; always within 1..max_draft_len."""
    grown = draft_len + 2 if num_accepted == num_proposed else draft_len - 1
    return max(1, min(grown, max_draft_len))
