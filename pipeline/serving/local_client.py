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
from pipeline.serving.bls import Generation, ModelError
from pipeline.serving.engine_io import engine_inputs
from pipeline.serving.reference_adapter import engine_request
from pipeline.serving.params import TextRequest


class LocalModelClient:
    """Calls engines by model name (e.g. {"tensorrt_llm": runner, "tensorrt_llm_draft": runner})."""

    def __init__(self, runners: dict[str, EngineRunner]):
        self.runners = runners

    async def _outputs(self, model: str, inputs: dict[str, np.ndarray]) -> AsyncIterator:
        runner = self.runners[model]
        request, _ = engine_request(inputs, uuid.uuid4().hex, True, runner.engine.model.vocab_size)
        queue = runner.submit(request)
        loop = asyncio.get_running_loop()
        while True:
            out = await loop.run_in_executor(None, queue.get)
            if out.error:
                raise ModelError(f"{model}: {out.error}")
            yield out
            if out.finished:
                return

    async def generate(self, model: str, prompt_ids: list[int], max_new: int, req: TextRequest, seed: int | None,
                       draft_ids: list[int] | None = None, draft_logits: np.ndarray | None = None,
                       return_logits: bool = False) -> Generation:
        """One non-streaming call."""
        inputs = engine_inputs(prompt_ids, max_new, req, seed, False, draft_ids, draft_logits, return_logits)
        tokens, logits = [], []
        async for out in self._outputs(model, inputs):
            tokens += out.new_token_ids
            if out.generation_logits is not None:
                logits.append(out.generation_logits.float().numpy())  # [n, vocab]
        return Generation(tokens=tokens, logits=np.concatenate(logits) if logits else None)

    async def stream(self, model: str, prompt_ids: list[int], max_new: int, req: TextRequest,
                     seed: int | None) -> AsyncIterator[list[int]]:
        """One streaming call."""
        inputs = engine_inputs(prompt_ids, max_new, req, seed, True, None, None, False)
        async for out in self._outputs(model, inputs):
            if out.new_token_ids:
                yield out.new_token_ids
