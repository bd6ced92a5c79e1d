"""Text <-> token ids for the Triton models: the target's tokenizer, word lists, streaming detokenization.

Shared by preprocessing, postprocessing and tensorrt_llm_bls (no Triton import here).
"""

from __future__ import annotations

import functools

import numpy as np

from pipeline.serving.errors import RequestError

REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


@functools.lru_cache(maxsize=4)
def load_tokenizer(tokenizer_dir: str):
    """The Hugging Face (fast) tokenizer saved in `tokenizer_dir`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def default_end_id(tokenizer) -> int:
    """The id generation stops at when a request gives no end_id: eos, else pad."""
    for tid in (tokenizer.eos_token_id, tokenizer.pad_token_id):
        if tid is not None:
            return int(tid)
    return -1


def default_pad_id(tokenizer) -> int:
    """The pad id: pad, else eos."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def words_to_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Token id sequences of each non-empty word/phrase (no special tokens added)."""
    return [ids for ids in (tokenizer.encode(w, add_special_tokens=False) for w in words if w) if ids]


def to_word_list_format(sequences: list[list[int]]) -> np.ndarray:
    """TensorRT-LLM's [2, L] int32 word list: row 0 the concatenated ids, row 1 the end offsets, -1 padded."""
    flat = [t for seq in sequences for t in seq]
    offsets = list(np.cumsum([len(seq) for seq in sequences])) if sequences else []
    width = max(len(flat), len(offsets), 1)
    out = np.full((2, width), -1, dtype=np.int32)  # [2, L]
    out[0, :len(flat)] = flat
    out[1, :len(offsets)] = offsets
    return out


def from_word_list_format(array: np.ndarray) -> list[list[int]]:
    """Inverse of `to_word_list_format` for one [2, L] array."""
    ids, offsets = array[0], array[1]
    out, start = [], 0
    for end in offsets:
        if end < 0:
            break
        out.append([int(t) for t in ids[start:int(end)]])
        start = int(end)
    return [seq for seq in out if seq]


def decode_bytes_list(values) -> list[str]:
    """Strings from a BYTES tensor's elements; raises UnicodeDecodeError on invalid UTF-8."""
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without ever splitting a multi-byte character.

    Decodes a small window of recent tokens twice (before and after the new ones) and emits the
    difference; when the new text ends in an incomplete UTF-8 sequence (a replacement character)
    it waits for more tokens. The window always starts where earlier text ended on a whole
    character, so the deltas concatenate to exactly `decode(all ids)`. `flush` emits whatever is
    left at the end of generation.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: text before it was emitted long ago
        self.read_offset = 0  # tokens before this have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly complete text (may be empty)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """The text of tokens not emitted yet (an incomplete character shows as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]


def _row_strings(arr: np.ndarray | None, row: int, name: str) -> list[str]:
    if arr is None:
        return []
    try:
        return decode_bytes_list(arr[row].reshape(-1).tolist())
    except UnicodeDecodeError:
        raise RequestError(name, "is not valid UTF-8", "send UTF-8 encoded text") from None


def _pad_rows(rows: list[list[int]], pad: int) -> np.ndarray:
    width = max(len(r) for r in rows)
    out = np.full((len(rows), width), pad, dtype=np.int32)  # [B, L]
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _stack_word_lists(lists: list[np.ndarray]) -> np.ndarray:
    width = max(a.shape[1] for a in lists)
    out = np.full((len(lists), 2, width), -1, dtype=np.int32)  # [B, 2, L]
    for i, a in enumerate(lists):
        out[i, :, :a.shape[1]] = a
    return out


def preprocess(inputs: dict[str, np.ndarray], tokenizer, add_special_tokens: bool) -> dict[str, np.ndarray]:
    """NVIDIA's preprocessing model on one (possibly batched) request: QUERY etc. -> INPUT_ID etc."""
    query = inputs["QUERY"]  # [B, 1] bytes
    batch = query.shape[0]
    ids, stops, bads = [], [], []
    for row in range(batch):
        (text,) = _row_strings(query, row, "QUERY")
        row_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not row_ids:
            raise RequestError("QUERY", "is empty", "send a non-empty prompt")
        ids.append(row_ids)
        stops.append(to_word_list_format(words_to_ids(tokenizer, _row_strings(inputs.get("STOP_WORDS_DICT"), row, "STOP_WORDS_DICT"))))
        bads.append(to_word_list_format(words_to_ids(tokenizer, _row_strings(inputs.get("BAD_WORDS_DICT"), row, "BAD_WORDS_DICT"))))
    end_id = inputs.get("END_ID")
    pad_id = inputs.get("PAD_ID")
    end = np.full((batch, 1), default_end_id(tokenizer), dtype=np.int32) if end_id is None else end_id.astype(np.int32).reshape(batch, 1)
    pad = np.full((batch, 1), default_pad_id(tokenizer), dtype=np.int32) if pad_id is None else pad_id.astype(np.int32).reshape(batch, 1)
    return {
        "INPUT_ID": _pad_rows(ids, int(pad[0, 0])),  # [B, L]
        "REQUEST_INPUT_LEN": np.array([[len(r)] for r in ids], dtype=np.int32),  # [B, 1]
        "DECODER_INPUT_ID": np.full((batch, 1), int(pad[0, 0]), dtype=np.int32),
        "REQUEST_DECODER_INPUT_LEN": np.zeros((batch, 1), dtype=np.int32),
        "BAD_WORDS_IDS": _stack_word_lists(bads),  # [B, 2, L]
        "STOP_WORDS_IDS": _stack_word_lists(stops),  # [B, 2, L]
        "EMBEDDING_BIAS": np.zeros((batch, 0), dtype=np.float32),
        "REQUEST_OUTPUT_LEN": inputs["REQUEST_OUTPUT_LEN"].astype(np.int32).reshape(batch, 1),
        "OUT_END_ID": end,
        "OUT_PAD_ID": pad,
        "OUT_PROMPT_TABLE_EXTRA_IDS": np.zeros((batch, 0), dtype=np.uint64),
    }


def postprocess(tokens: np.ndarray, lengths: np.ndarray, tokenizer, skip_special_tokens: bool) -> np.ndarray:
    """NVIDIA's postprocessing: TOKENS_BATCH [B, beams, L] + SEQUENCE_LENGTH [B, beams] -> OUTPUT [B, beams] bytes."""
    if tokens.ndim == 2:  # [B, L]: no beam dimension
        tokens, lengths = tokens[:, None, :], lengths.reshape(-1, 1)
    out = np.empty(lengths.shape, dtype=object)
    for b in range(tokens.shape[0]):
        for beam in range(tokens.shape[1]):
            ids = tokens[b, beam, :int(lengths[b, beam])].tolist()
            text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
            out[b, beam] = text.encode("utf-8")
    return out
