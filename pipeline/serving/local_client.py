"""`ModelClient` over in-process EngineRunners: the BLS orchestration without Triton.

Requests take the same path as in the server (engine_inputs -> engine_request -> EngineRunner), so
benchmarks can compare the same work with and without Triton, and tests can run the orchestrator
on real engines in one process.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator

import numpy as np

from pipeline.reference.runner import EngineRunner
from pipeline.serving.bls import Generation, ModelError, Returns
from pipeline.serving.engine_io import engine_inputs, generation_from_arrays, join_generations
from pipeline.serving.reference_adapter import ResponseBuilder, engine_request
from pipeline.serving.params import TextRequest


class LocalModelClient:
    """Calls engines by model name (e.g. {"tensorrt_llm": runner, "tensorrt_llm_draft": runner})."""

    def __init__(self, runners: dict[str, EngineRunner]):
        self.runners = runners

    async def generate(self, model: str, prompt_ids: list[int], max_new: int, req: TextRequest, seed: int | None,
                       draft_ids: list[int] | None = None, draft_logits: np.ndarray | None = None,
                       returns: Returns = Returns()) -> Generation:
        """One non-streaming call."""
        inputs = engine_inputs(prompt_ids, max_new, req, seed, False, draft_ids, draft_logits, returns)
        chain = req.call_chain(prompt_ids, max_new)
        return join_generations([part async for part in self._generations(model, inputs, chain)])

    async def stream(self, model: str, prompt_ids: list[int], max_new: int, req: TextRequest,
                     seed: int | None, returns: Returns = Returns(),
                     engine_draft_len: int | None = None, streaming: bool = True) -> AsyncIterator[Generation]:
        """One streaming call (streaming=False: one response with all of the call's tokens)."""
        inputs = engine_inputs(prompt_ids, max_new, req, seed, streaming, None, None, returns, engine_draft_len)
        chain = req.call_chain(prompt_ids, max_new)
        async for part in self._generations(model, inputs, chain):
            if part.tokens or part.context_logits is not None:
                yield part

    async def _generations(self, model: str, inputs: dict[str, np.ndarray], chain: str) -> AsyncIterator[Generation]:
        """The engine's outputs, rendered and read back through the tensorrt_llm arrays as in the server; chain: the
        call's (TextRequest.call_chain), which the runner regathers by."""
        runner = self.runners[model]
        request, options = engine_request(inputs, uuid.uuid4().hex, True, runner.engine.model.vocab_size)
        builder = ResponseBuilder(request.prompt_ids, options)
        queue = runner.submit(request, chain=chain)
        loop = asyncio.get_running_loop()
        while True:
            out = await loop.run_in_executor(None, queue.get)
            if out.error:
                raise ModelError(f"{model}: {out.error}")
            arrays = builder.add(out)
            if arrays is not None:
                yield generation_from_arrays(arrays)
            if out.finished:
                return
