"""OpenAI `logprobs` objects from what the server returns: token ids, their log-probabilities, raw logits.

The speculative BLS returns, per generated token, its id (`output_ids`), the target model's
log-probability (`output_log_probs`) and, when top alternatives are asked for, the target's raw
logits (`generation_logits`); for an echoed prompt, the target's `context_logits`. This module turns
them into the completions shape (tokens, token_logprobs, top_logprobs, text_offset) and the chat
shape (content: [{token, logprob, bytes, top_logprobs}]). Token text comes from the tokenizer's
tokenizer.json (the `tokenizers` package, no transformers): a byte-level BPE token that holds part of
a UTF-8 character shows as U+FFFD in `token` and exactly in `bytes`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis, in float64 (rows of raw logits -> log-probabilities)."""
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> the byte it encodes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """Token ids -> raw bytes and display text, for one tokenizer (tokenizer.json)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)

    @classmethod
    def from_dir(cls, directory: str | Path) -> "TokenText":
        """Load tokenizer.json from a Hugging Face tokenizer directory."""
        return cls(Tokenizer.from_file(str(Path(directory) / "tokenizer.json")))

    def encode(self, text: str) -> list[int]:
        """The ids the server's preprocessing gives `text` (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """The text of a token sequence."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def tokens_for(self, ids: list[int], num_chars: int) -> int:
        """How many of `ids` it takes to produce the first `num_chars` characters of their text (as served:
        special tokens skipped, so a trailing end-of-turn token does not count)."""
        n = len(ids)
        while n > 0 and len(self.decode(ids[:n - 1], skip_special=True)) >= num_chars:
            n -= 1
        return n

    def bytes_of(self, token_id: int) -> bytes:
        """The raw bytes one token stands for."""
        piece = self.tokenizer.id_to_token(token_id)
        table = _byte_decoder()
        if self.byte_level and piece is not None and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return self.decode([token_id]).encode("utf-8")

    def text_of(self, token_id: int) -> str:
        """One token as text (U+FFFD for part of a multi-byte character)."""
        return self.bytes_of(token_id).decode("utf-8", errors="replace")


@dataclass
class TokenLogprobs:
    """Per-token data for one choice: ids, each one's log-probability (None for a first prompt token) and
    its top alternatives [(id, logprob)], most likely first (empty when not asked for)."""

    ids: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]]]
    context_logits: np.ndarray | None = None  # [prompt tokens, vocab] when the prompt's log-probs were asked for

    @classmethod
    def from_logits(cls, ids: list[int], logits: np.ndarray, k: int, first_is_prompt_start: bool) -> "TokenLogprobs":
        """From raw logits: row i is the distribution ids[i] was drawn from (or, for a prompt, row i - 1 when
        `first_is_prompt_start`: the first prompt token has no distribution)."""
        lp = log_softmax(logits)  # [rows, vocab]
        offset = 1 if first_is_prompt_start else 0
        values: list[float | None] = [None] * offset
        top: list[list[tuple[int, float]]] = [[] for _ in range(offset)]
        for i in range(offset, len(ids)):
            row = lp[i - offset]
            values.append(float(row[ids[i]]))
            top.append(_top(row, k))
        return cls(ids, values, top)

    def __add__(self, other: "TokenLogprobs") -> "TokenLogprobs":
        context = self.context_logits if self.context_logits is not None else other.context_logits
        return TokenLogprobs(self.ids + other.ids, self.logprobs + other.logprobs, self.top + other.top, context)

    def head(self, n: int) -> "TokenLogprobs":
        """The first n tokens."""
        return TokenLogprobs(self.ids[:n], self.logprobs[:n], self.top[:n], self.context_logits)

    def tail(self, start: int) -> "TokenLogprobs":
        """The tokens from `start` on."""
        return TokenLogprobs(self.ids[start:], self.logprobs[start:], self.top[start:])


def _top(row: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    idx = np.argpartition(-row, k - 1)[:k]
    idx = idx[np.argsort(-row[idx], kind="stable")]
    return [(int(i), float(row[i])) for i in idx]


def completion_logprobs(data: TokenLogprobs, text: TokenText, with_top: bool, offset0: int = 0) -> dict:
    """The completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [text.text_of(t) for t in data.ids]
    offsets, at = [], offset0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top = None
    if with_top:
        top = [None if lp is None else {text.text_of(i): v for i, v in alts} for lp, alts in zip(data.logprobs, data.top)]
    return {"tokens": tokens, "token_logprobs": data.logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(data: TokenLogprobs, text: TokenText) -> dict:
    """The chat `logprobs` object: content = [{token, logprob, bytes, top_logprobs}]."""
    def entry(token_id: int, value: float) -> dict:
        return {"token": text.text_of(token_id), "logprob": value, "bytes": list(text.bytes_of(token_id))}

    content = [{**entry(t, v), "top_logprobs": [entry(i, a) for i, a in alts]}
               for t, v, alts in zip(data.ids, data.logprobs, data.top)]
    return {"content": content, "refusal": None}
