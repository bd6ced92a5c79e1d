"""`ModelClient` over Triton BLS calls: how tensorrt_llm_bls talks to tensorrt_llm / tensorrt_llm_draft.

The target and draft models are decoupled, so every call is `async_exec(decoupled=True)`; in
Triton 2.51 that returns a plain (blocking) iterator, which is drained on a thread pool so the
event loop keeps serving the other requests.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.serving.bls import Generation, ModelError
from pipeline.serving.params import TextRequest
from pipeline.serving.text import to_word_list_format

_DONE = object()


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


class TritonModelClient:
    """Calls the tensorrt_llm-interface models of this server (see the module docstring)."""

    def __init__(self, max_concurrent_calls: int = 256):
        self.pool = ThreadPoolExecutor(max_workers=max_concurrent_calls, thread_name_prefix="bls-call")

    def close(self) -> None:
        """Stop the thread pool."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _responses(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> AsyncIterator:
        request = pb_utils.InferenceRequest(model_name=model, requested_output_names=outputs,
                                            inputs=[pb_utils.Tensor(k, v) for k, v in inputs.items()])
        iterator = await request.async_exec(decoupled=True)
        loop = asyncio.get_running_loop()
        while True:
            response = await loop.run_in_executor(self.pool, next, iterator, _DONE)
            if response is _DONE:
                return
            if response.has_error():
                raise ModelError(f"{model}: {response.error().message()}")
            yield response

    async def generate(self, model: str, prompt_ids: list[int], max_new: int, req: TextRequest, seed: int | None,
                       draft_ids: list[int] | None = None, draft_logits: np.ndarray | None = None,
                       return_logits: bool = False) -> Generation:
        """One non-streaming call: all generated tokens (and raw logits when asked)."""
        inputs = engine_inputs(prompt_ids, max_new, req, seed, False, draft_ids, draft_logits, return_logits)
        outputs = ["output_ids", "sequence_length"] + (["generation_logits"] if return_logits else [])
        tokens: list[int] = []
        logits = []
        async for response in self._responses(model, inputs, outputs):
            ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
            if ids is None:  # the empty final-flag response
                continue
            n = int(pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().reshape(-1)[0])
            tokens += ids.as_numpy().reshape(-1)[:n].tolist()
            gen = pb_utils.get_output_tensor_by_name(response, "generation_logits") if return_logits else None
            if gen is not None:
                arr = gen.as_numpy()
                logits.append(arr.reshape(-1, arr.shape[-1]))  # [n, vocab]
        return Generation(tokens=tokens, logits=np.concatenate(logits) if logits else None)

    async def stream(self, model: str, prompt_ids: list[int], max_new: int, req: TextRequest,
                     seed: int | None) -> AsyncIterator[list[int]]:
        """One streaming call: yields each response's new tokens."""
        inputs = engine_inputs(prompt_ids, max_new, req, seed, True, None, None, False)
        async for response in self._responses(model, inputs, ["output_ids", "sequence_length"]):
            ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
            if ids is None:
                continue
            n = int(pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().reshape(-1)[0])
            new = ids.as_numpy().reshape(-1)[:n].tolist()
            if new:
                yield new
