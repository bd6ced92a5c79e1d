"""The tensorrt_llm tensor interface as a caller (the BLS) sees it: numpy only, for either engine.

NVIDIA's input names (input_ids, request_output_len, draft_input_ids, draft_logits, end_id,
runtime_top_k, return_log_probs, ...); the reference engine reads them back in reference_adapter.py.
`generation_from_arrays` reads a response (output_ids, sequence_length, output_log_probs,
generation_logits, context_logits, and the engine's own acceptance counters) back into a Generation.
"""

from __future__ import annotations

import numpy as np

from pipeline.serving.bls import Generation, Returns
from pipeline.serving.params import TextRequest
from pipeline.serving.text import to_word_list_format


def engine_inputs(prompt_ids: list[int], max_new: int, req: TextRequest, seed: int | None, streaming: bool,
                  draft_ids: list[int] | None, draft_logits: np.ndarray | None, returns: Returns,
                  engine_draft_len: int | None = None) -> dict[str, np.ndarray]:
    """tensorrt_llm input arrays (batch dimension 1) for one call.

    engine_draft_len: K for a target engine that drafts itself by prompt lookup (num_draft_tokens, 0: plain);
    the call then asks for the engine's acceptance counters (return_perf_metrics, NVIDIA's switch for them).
    """
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
    if engine_draft_len is not None:
        arrays["num_draft_tokens"] = np.array([[engine_draft_len]], dtype=np.int32)
    for name, wanted in (("return_generation_logits", returns.generation_logits), ("return_log_probs", returns.log_probs),
                         ("return_context_logits", returns.context_logits),
                         ("return_perf_metrics", engine_draft_len is not None)):
        if wanted:
            arrays[name] = np.array([[True]], dtype=bool)
    return arrays


def generation_from_arrays(arrays: dict[str, np.ndarray]) -> Generation:
    """One tensorrt_llm response (output_ids [1, 1, n], sequence_length, and the optional log-prob and logits
    outputs) as a Generation."""
    n = int(arrays["sequence_length"].reshape(-1)[0])
    tokens = arrays["output_ids"].reshape(-1)[:n].tolist()
    logits, log_probs, context = (arrays.get(name) for name in ("generation_logits", "output_log_probs", "context_logits"))
    drafted, accepted = (int(arrays[name].reshape(-1)[0]) if name in arrays else 0
                         for name in ("total_draft_tokens", "total_accepted_draft_tokens"))
    return Generation(tokens=tokens, drafted=drafted, accepted=accepted,
                      logits=None if logits is None else logits.reshape(-1, logits.shape[-1]),  # [n, vocab]
                      log_probs=None if log_probs is None else log_probs.reshape(-1).tolist(),
                      context_logits=None if context is None else context.reshape(-1, context.shape[-1]))  # [L, vocab]


def join_generations(parts: list[Generation]) -> Generation:
    """The Generations of one call's responses as one."""
    logits = [p.logits for p in parts if p.logits is not None]
    log_probs = [p.log_probs for p in parts if p.log_probs is not None]
    context = [p.context_logits for p in parts if p.context_logits is not None]
    return Generation(tokens=[t for p in parts for t in p.tokens], logits=np.concatenate(logits) if logits else None,
                      drafted=max((p.drafted for p in parts), default=0), accepted=max((p.accepted for p in parts), default=0),
                      log_probs=[v for lp in log_probs for v in lp] if log_probs else None,
                      context_logits=context[0] if context else None)
