"""`ModelClient` over Triton BLS calls: how tensorrt_llm_bls talks to tensorrt_llm / tensorrt_llm_draft.

With decoupled target and draft models (serving.decoupled) every call is `exec(decoupled=True)`, which
returns a plain (blocking) iterator; with non-decoupled models every call is one unary `exec()` with one
response, as NVIDIA's stock BLS calls them, and a "stream" is that one response. Both run on this
client's thread pool so the event loop keeps serving the other requests. A non-streaming call (`generate`:
a speculative round, a draft) runs exec and reads every response in one pool job: one thread hop per call
instead of one per response (each hop measured 0.25-0.35 ms of a round outside the model).

A model whose python stub died never answers the calls already sent to it (Triton 2.51 keeps them
waiting forever) and refuses new ones with "Stub process ... is not healthy". That error marks the
model down: every waiting and later call to it raises ModelDown at once (the BLS then falls back
from a dead draft, or fails the request for a dead target), and `on_down(model, reason)` reports it
once (metric, log line). A call with no response for `stall_timeout_s` fails on its own.

Every call's pb_utils objects (the request, a decoupled call's response iterator, every response) stay
referenced from Python for a few seconds after the call ends (pipeline.serving.stub_keeper): Triton
2.51's stub can otherwise free their numpy arrays on its own C++ threads without the GIL, which corrupts
the interpreter and kills the stub (docs/reliability.md, "The python stub segfault and deadlock").
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.names import CHAIN_PARAMETER
from pipeline.serving.bls import Generation, ModelDown, ModelError, Returns
from pipeline.serving.engine_io import engine_inputs, generation_from_arrays, join_generations
from pipeline.serving.params import TextRequest
from pipeline.serving.stub_keeper import CallObjects, StubObjectKeeper
from pipeline.serving.triton_io import response_outputs

_DONE = object()
POLL_S = 0.25  # how often a waiting call checks whether its model was marked down meanwhile
DEAD_STUB_MARKER = "is not healthy"  # Triton's error for a call to a model whose python stub died


def _exec_all(request) -> tuple:
    """exec(decoupled=True) and every response up to the final flag: (the response iterator, the responses)."""
    answer = request.exec(decoupled=True)
    return answer, list(answer)


class TritonModelClient:
    """Calls the tensorrt_llm-interface models of this server (see the module docstring)."""

    def __init__(self, decoupled: bool, stall_timeout_s: float, on_down: Callable[[str, str], None],
                 max_concurrent_calls: int = 256):
        self.decoupled = decoupled
        self.pool = ThreadPoolExecutor(max_workers=max_concurrent_calls, thread_name_prefix="bls-call")
        self.stall_timeout_s = stall_timeout_s
        self.on_down = on_down
        self.down: dict[str, str] = {}  # model -> why it is down
        self.keeper = StubObjectKeeper()

    def mark_down(self, model: str, reason: str) -> None:
        """Record that `model` is down (reported once)."""
        if model not in self.down:
            self.down[model] = reason
            self.on_down(model, reason)

    async def _call(self, model: str, call: CallObjects, fn, *args):
        """fn(*args) on the pool, awaited with a watch: raises ModelDown when the model is or goes down, and
        ModelError after stall_timeout_s. A thread stuck on a dead stub is abandoned (it never returns)."""
        pending = call.pending = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
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

    def _checked(self, model: str, response):
        """The response, or ModelDown / ModelError for an error response."""
        if response.has_error():
            message = response.error().message()
            if DEAD_STUB_MARKER in message:
                self.mark_down(model, message)
                raise ModelDown(f"{model}: {message}")
            raise ModelError(f"{model}: {message}")
        return response

    async def _responses(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str], chain: str,
                         collect: bool = False) -> AsyncIterator:
        if model in self.down:
            raise ModelDown(f"{model} is down ({self.down[model]})")
        self.keeper.release_expired()
        call = CallObjects()
        try:
            async for response in self._call_responses(model, call, inputs, outputs, chain, collect):
                yield response
        finally:
            self.keeper.hold(call)

    async def _call_responses(self, model: str, call: CallObjects, inputs: dict[str, np.ndarray],
                              outputs: list[str], chain: str, collect: bool) -> AsyncIterator:
        # a request parameter names the chain the call continues (TextRequest.call_chain): the model's EngineRunner
        # regathers by it
        request = pb_utils.InferenceRequest(model_name=model, requested_output_names=outputs,
                                            inputs=[pb_utils.Tensor(k, v) for k, v in inputs.items()],
                                            parameters={CHAIN_PARAMETER: chain} if chain else {})
        call.objects.append(request)
        # Not async_exec: in 2.51 it runs exec() on the event loop's default executor (a few threads), which
        # calls to a dead stub block for good, and then every other call queues behind them.
        collect = collect and self.decoupled  # a unary call has one response anyway
        job = (functools.partial(_exec_all, request) if collect
               else functools.partial(request.exec, decoupled=self.decoupled))
        try:
            answer = await self._call(model, call, job)
        except ModelError:
            raise
        except Exception as exc:
            if DEAD_STUB_MARKER in str(exc):
                self.mark_down(model, str(exc))
                raise ModelDown(f"{model}: {exc}") from None
            raise
        if collect:
            iterator, responses = answer
            call.objects += [iterator, *responses]
            for response in responses:
                yield self._checked(model, response)
            return
        call.objects.append(answer)
        if not self.decoupled:  # one unary response
            yield self._checked(model, answer)
            return
        while True:
            response = await self._call(model, call, next, answer, _DONE)
            if response is _DONE:
                return
            call.objects.append(response)
            yield self._checked(model, response)

    async def generate(self, model: str, prompt_ids: list[int], max_new: int, req: TextRequest, seed: int | None,
                       draft_ids: list[int] | None = None, draft_logits: np.ndarray | None = None,
                       returns: Returns = Returns()) -> Generation:
        """One non-streaming call: all generated tokens (and what `returns` asks for)."""
        inputs = engine_inputs(prompt_ids, max_new, req, seed, False, draft_ids, draft_logits, returns)
        chain = req.call_chain(prompt_ids, max_new)
        parts = [part async for part in self._generations(model, inputs, returns, chain, collect=True)]
        return join_generations(parts)

    async def stream(self, model: str, prompt_ids: list[int], max_new: int, req: TextRequest,
                     seed: int | None, returns: Returns = Returns(),
                     engine_draft_len: int | None = None, streaming: bool = True) -> AsyncIterator[Generation]:
        """One streaming call: yields each response's new tokens (and what `returns` asks for); a non-decoupled
        model, or streaming=False, answers once, with all of them. engine_draft_len: K for a target that drafts
        itself."""
        inputs = engine_inputs(prompt_ids, max_new, req, seed, self.decoupled and streaming, None, None, returns,
                               engine_draft_len)
        chain = req.call_chain(prompt_ids, max_new)
        async for part in self._generations(model, inputs, returns, chain, counters=engine_draft_len is not None):
            if part.tokens or part.context_logits is not None:
                yield part

    async def _generations(self, model: str, inputs: dict[str, np.ndarray], returns: Returns, chain: str,
                           collect: bool = False, counters: bool = False) -> AsyncIterator[Generation]:
        names = {"output_log_probs": returns.log_probs, "generation_logits": returns.generation_logits,
                 "context_logits": returns.context_logits,
                 "total_draft_tokens": counters, "total_accepted_draft_tokens": counters}
        outputs = ["output_ids", "sequence_length"] + [name for name, wanted in names.items() if wanted]
        async for response in self._responses(model, inputs, outputs, chain, collect):
            arrays = response_outputs(response)
            if "output_ids" not in arrays:  # the empty final-flag response
                continue
            yield generation_from_arrays({name: arrays[name] for name in outputs if name in arrays})
