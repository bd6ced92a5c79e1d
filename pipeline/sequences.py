"""Pure token-sequence helpers shared by the reference engine and the BLS (no torch, no numpy): prefix
matching (KV cache, accepted drafts), prompt lookup (n-gram drafts), the adaptive draft length and stop
detection."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

_TOKEN_BYTES = array("i").itemsize  # a token's bytes in prompt lookup's packed search (int32)
MATCH_LENGTH_CAP = 16  # the longest match length ngram_lookup reports


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share. Compared as list slices (in C, not a Python loop per token: a draft
    model trims its cache to the committed tokens before every draft), bisecting to the first difference."""
    hi = min(len(a), len(b))
    a, b = list(a[:hi]), list(b[:hi])  # lists (a tuple never equals a list), no longer than the shorter
    lo = 0  # a[:lo] == b[:lo]; the first difference, if any, is before hi
    if a == b:
        return hi
    while hi - lo > 1:  # a[lo:hi] != b[lo:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def ngram_lookup(token_ids: Sequence[int], k: int, min_ngram: int, max_ngram: int,
                 min_token_prob: float = 0.0) -> tuple[list[int], int]:
    """Prompt lookup: (the up-to-k tokens that followed the latest earlier occurrence of the longest suffix of
    `token_ids` of min_ngram..max_ngram tokens, the match length) (([], 0) when none matches).

    The match length says how much of the context the copied continuation followed: the n-gram's n, extended
    backwards while the tokens before that occurrence equal the context's tokens before its suffix, at most
    MATCH_LENGTH_CAP. Longer matches are likelier copies: on SmolLM2's answers to grounded prompts the first draft
    token was accepted 43% of the time after a match of one token, 80% after 3-4 and 95% after 9 or more
    (docs/benchmarks.md), which is what the engine's policy weighs against a draft token's cost.

    min_token_prob > 0 cuts the draft where the context disagrees with it (SuffixDecoding's min_token_prob,
    arXiv 2411.04975, frequencies counted over the context instead of a suffix tree): draft token i's
    frequency is the share of the suffix's earlier occurrences, among those that agree with draft tokens
    0..i-1 and have an i-th following token, whose i-th following token is draft token i; the draft stops
    before the product of these frequencies falls below min_token_prob. The first token is always kept
    (the latest occurrence's continuation, as with min_token_prob 0).
    """
    if k <= 0:
        return [], 0
    tokens = list(token_ids)
    packed = array("i", tokens).tobytes()  # searched in C (bytes.rfind): a Python scan cost 50-130 us a step
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        # where each occurrence's continuation starts, latest first; each occurrence has a following token
        occurrences = (s + n for s in _starts(packed, tokens[-n:], len(tokens) - 1))
        latest = next(occurrences, None)
        if latest is None:
            continue
        draft, matched = tokens[latest:latest + k], n
        while matched < MATCH_LENGTH_CAP and latest > matched and tokens[latest - matched - 1] == tokens[-matched - 1]:
            matched += 1
        if min_token_prob <= 0:
            return draft, matched
        starts, prob = [latest, *occurrences], 1.0
        for i, token in enumerate(draft):
            live = [s for s in starts if s + i < len(tokens)]  # occurrences that still have an i-th token
            agree = [s for s in live if tokens[s + i] == token]  # never empty: the latest occurrence agrees
            prob *= len(agree) / len(live)
            if i and prob < min_token_prob:
                return draft[:i], matched
            starts = agree
        return draft, matched
    return [], 0


def _starts(packed: bytes, ngram: list[int], end: int) -> Iterator[int]:
    """Every s with tokens[s:s + len(ngram)] == ngram and s + len(ngram) <= end, latest first; `packed` holds the
    tokens as array("i") bytes (a match at a byte offset that is no multiple of the item size straddles two tokens
    and is skipped)."""
    needle = array("i", ngram).tobytes()
    stop = end * _TOKEN_BYTES
    while (found := packed.rfind(needle, 0, stop)) >= 0:
        if found % _TOKEN_BYTES == 0:
            yield found // _TOKEN_BYTES
        stop = found + len(needle) - 1  # an earlier match may overlap this one


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
