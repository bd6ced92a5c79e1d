"""`ModelClient` over Triton BLS calls: how tensorrt_llm_bls talks to tensorrt_llm / tensorrt_llm_draft.

The target and draft models are decoupled, so every call is `exec(decoupled=True)`, which returns a
plain (blocking) iterator; both run on this client's thread pool so the event loop keeps serving
the other requests.

A model whose python stub died never answers the calls already sent to it (Triton 2.51 keeps them
waiting forever) and refuses new ones with "Stub process ... is not healthy". That error marks the
model down: every waiting and later call to it raises ModelDown at once (the BLS then falls back
from a dead draft, or fails the request for a dead target), and `on_down(model, reason)` reports it
once (metric, log line). A call with no response for `stall_timeout_s` fails on its own.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.serving.bls import Generation, ModelDown, ModelError
from pipeline.serving.engine_io import engine_inputs
from pipeline.serving.params import TextRequest

_DONE = object()
POLL_S = 0.25  # how often a waiting call checks whether its model was marked down meanwhile
DEAD_STUB_MARKER = "is not healthy"  # Triton's error for a call to a model whose python stub died


class TritonModelClient:
    """Calls the tensorrt_llm-interface models of this server (see the module docstring)."""

    def __init__(self, stall_timeout_s: float, on_down: Callable[[str, str], None],
                 max_concurrent_calls: int = 256):
        self.pool = ThreadPoolExecutor(max_workers=max_concurrent_calls, thread_name_prefix="bls-call")
        self.stall_timeout_s = stall_timeout_s
        self.on_down = on_down
        self.down: dict[str, str] = {}  # model -> why it is down

    def mark_down(self, model: str, reason: str) -> None:
        """Record that `model` is down (reported once)."""
        if model not in self.down:
            self.down[model] = reason
            self.on_down(model, reason)

    async def _call(self, model: str, fn, *args):
        """fn(*args) on the pool, awaited with a watch: raises ModelDown when the model is or goes down, and
        ModelError after stall_timeout_s. A thread stuck on a dead stub is abandoned (it never returns)."""
        pending = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        waited = 0.0
        while True:
            if model in self.down:
                raise ModelDown(f"{model} is down ({self.down[model]})")
            try:
                return await asyncio.wait_for(asyncio.shield(pending), POLL_S)
            except asyncio.TimeoutError:
                waited += POLL_S
                if waited >= self.stall_timeout_s:
                    raise ModelError(f"{model}: no response for {self.stall_timeout_s:g} s") from None

    def close(self) -> None:
        """Stop the thread pool."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _responses(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> AsyncIterator:
        if model in self.down:
            raise ModelDown(f"{model} is down ({self.down[model]})")
        request = pb_utils.InferenceRequest(model_name=model, requested_output_names=outputs,
                                            inputs=[pb_utils.Tensor(k, v) for k, v in inputs.items()])
        # Not async_exec: in 2.51 it runs exec() on the event loop's default executor (a few threads), which
        # calls to a dead stub block for good, and then every other call queues behind them.
        try:
            iterator = await self._call(model, functools.partial(request.exec, decoupled=True))
        except ModelError:
            raise
        except Exception as exc:
            if DEAD_STUB_MARKER in str(exc):
                self.mark_down(model, str(exc))
                raise ModelDown(f"{model}: {exc}") from None
            raise
        while True:
            response = await self._call(model, next, iterator, _DONE)
            if response is _DONE:
                return
            if response.has_error():
                message = response.error().message()
                if DEAD_STUB_MARKER in message:
                    self.mark_down(model, message)
                    raise ModelDown(f"{model}: {message}")
                raise ModelError(f"{model}: {message}")
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
