"""The tensorrt_llm tensor interface as a caller (the BLS) sends it: numpy only, for either engine.

NVIDIA's input names (input_ids, request_output_len, draft_input_ids, draft_logits, end_id,
runtime_top_k, ...); the reference engine reads them back in reference_adapter.py.
"""

from __future__ import annotations

import numpy as np

from pipeline.serving.params import TextRequest
from pipeline.serving.text import to_word_list_format


def engine_inputs(prompt_ids: list[int], max_new: int, req: TextRequest, seed: int | None, streaming: bool,
                  draft_ids: list[int] | None, draft_logits: np.ndarray | None, return_logits: bool) -> dict[str, np.ndarray]:
    """tensorrt_llm input arrays (batch dimension 1) for one call."""
    s = req.sampling
    already = len(prompt_ids) - len(req.prompt_ids)  # tokens generated before this call
    arrays = {
        "input_ids": np.array([prompt_ids], dtype=np.int32),  # [1, L]
        "input_lengths": np.array([[len(prompt_ids)]], dtype=np.int32),
        "request_output_len": np.array([[max_new]], dtype=np.int32),
        "end_id": np.array([[req.end_id]], dtype=np.int32),
        "pad_id": np.array([[req.pad_id]], dtype=np.int32),
        "streaming": np.array([[streaming]], dtype=bool),
        "exclude_input_in_output": np.array([[True]], dtype=bool),
        "temperature": np.array([[s.temperature]], dtype=np.float32),
        "runtime_top_k": np.array([[s.top_k]], dtype=np.int32),
        "runtime_top_p": np.array([[s.top_p]], dtype=np.float32),
        "repetition_penalty": np.array([[s.repetition_penalty]], dtype=np.float32),
        "presence_penalty": np.array([[s.presence_penalty]], dtype=np.float32),
        "frequency_penalty": np.array([[s.frequency_penalty]], dtype=np.float32),
        "min_tokens": np.array([[max(0, s.min_tokens - already)]], dtype=np.int32),
    }
    if seed is not None:
        arrays["seed"] = np.array([[seed]], dtype=np.uint64)
    if req.stop_words:
        arrays["stop_words_list"] = to_word_list_format(req.stop_words)[None]  # [1, 2, L]
    if req.bad_words:
        arrays["bad_words_list"] = to_word_list_format(req.bad_words)[None]
    if draft_ids:
        arrays["draft_input_ids"] = np.array([draft_ids], dtype=np.int32)  # [1, k]
    if draft_logits is not None:
        arrays["draft_logits"] = np.ascontiguousarray(draft_logits, dtype=np.float32)[None]  # [1, k, vocab]
    if return_logits:
        arrays["return_generation_logits"] = np.array([[True]], dtype=bool)
    return arrays
