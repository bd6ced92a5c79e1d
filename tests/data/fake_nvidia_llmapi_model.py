"""Stand-in for NVIDIA's llmapi model.py (not part of this project, and it needs TensorRT-LLM and a GPU).

It has what pipeline/serving/llmapi_model.py uses of the real one (contract `llmapi_model_hooks`): a
TritonPythonModel whose initialize() leaves the LLM in `_llm_engine`, and an LLM whose get_stats(timeout)
returns the iteration statistics queued since the last call. Here they come from fake_stats.json next to
this file: a list of batches, one per get_stats call.
"""

import json
from pathlib import Path


class FakeLLM:
    def __init__(self, batches):
        self.batches = batches

    def get_stats(self, timeout=2):
        return self.batches.pop(0) if self.batches else []


class TritonPythonModel:
    def initialize(self, args):
        self._llm_engine = FakeLLM(json.loads((Path(__file__).parent / "fake_stats.json").read_text()))

    def execute(self, requests):
        return None

    def finalize(self):
        self._llm_engine = None
