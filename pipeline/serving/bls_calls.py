"""`ModelClient` over Triton BLS calls: how tensorrt_llm_bls talks to tensorrt_llm / tensorrt_llm_draft.

With decoupled target and draft models (serving.decoupled) every call is `async_exec(decoupled=True)`; in
Triton 2.51 that returns a plain (blocking) iterator, which is drained on a thread pool so the
event loop keeps serving the other requests. With non-decoupled models every call is one unary
`async_exec()` with one response, as NVIDIA's stock BLS calls them, and a "stream" is that one response.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.serving.bls import Generation, ModelError, Returns
from pipeline.serving.engine_io import engine_inputs, generation_from_arrays, join_generations
from pipeline.serving.params import TextRequest

_DONE = object()


class TritonModelClient:
    """Calls the tensorrt_llm-interface models of this server (see the module docstring)."""

    def __init__(self, decoupled: bool = True, max_concurrent_calls: int = 256):
        self.decoupled = decoupled
        self.pool = ThreadPoolExecutor(max_workers=max_concurrent_calls, thread_name_prefix="bls-call")

    def close(self) -> None:
        """Stop the thread pool."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _responses(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> AsyncIterator:
        request = pb_utils.InferenceRequest(model_name=model, requested_output_names=outputs,
                                            inputs=[pb_utils.Tensor(k, v) for k, v in inputs.items()])
        if not self.decoupled:
            response = await request.async_exec()
            if response.has_error():
                raise ModelError(f"{model}: {response.error().message()}")
            yield response
            return
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
                       returns: Returns = Returns()) -> Generation:
        """One non-streaming call: all generated tokens (and what `returns` asks for)."""
        inputs = engine_inputs(prompt_ids, max_new, req, seed, False, draft_ids, draft_logits, returns)
        parts = [part async for part in self._generations(model, inputs, returns)]
        return join_generations(parts)

    async def stream(self, model: str, prompt_ids: list[int], max_new: int, req: TextRequest,
                     seed: int | None, returns: Returns = Returns()) -> AsyncIterator[Generation]:
        """One streaming call: yields each response's new tokens (and what `returns` asks for); a non-decoupled
        model answers once, with all of them."""
        inputs = engine_inputs(prompt_ids, max_new, req, seed, self.decoupled, None, None, returns)
        async for part in self._generations(model, inputs, returns):
            if part.tokens or part.context_logits is not None:
                yield part

    async def _generations(self, model: str, inputs: dict[str, np.ndarray], returns: Returns) -> AsyncIterator[Generation]:
        names = {"output_log_probs": returns.log_probs, "generation_logits": returns.generation_logits,
                 "context_logits": returns.context_logits}
        outputs = ["output_ids", "sequence_length"] + [name for name, wanted in names.items() if wanted]
        async for response in self._responses(model, inputs, outputs):
            ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
            if ids is None:  # the empty final-flag response
                continue
            arrays = {name: pb_utils.get_output_tensor_by_name(response, name) for name in outputs}
            yield generation_from_arrays({k: v.as_numpy() for k, v in arrays.items() if v is not None})
