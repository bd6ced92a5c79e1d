"""The llmapi repository's `tensorrt_llm` model: NVIDIA's llmapi model plus the BLS's spec_decode_* metrics.

NVIDIA's `all_models/llmapi/tensorrt_llm/1/model.py` creates no Prometheus metric, so on that path an
acceptance alert would never fire. This model is NVIDIA's (copied from the container at launch as
`nvidia_llmapi_model.py` next to it, not part of this project) with one addition: a thread that reads the
LLM's iteration statistics (`LLM.get_stats`, enabled by `enable_iter_perf_stats` in model.yaml) and adds
them to the counters the BLS exports (pipeline.serving.metrics.SpecMetrics, names in pipeline.names), so
the deploy overlays' PrometheusRule reads the same series on every toolchain. It relies on two names of
NVIDIA's model.py at the recorded commit (pipeline/contracts/llmapi.json `llmapi_model_hooks`).
"""

from __future__ import annotations

import threading

import triton_python_backend_utils as pb_utils
from nvidia_llmapi_model import TritonPythonModel as NvidiaLlmapiModel

from pipeline.names import TARGET_MODEL
from pipeline.serving.iteration_stats import spec_decode_counts
from pipeline.serving.metrics import SpecMetrics

POLL_S = 1.0  # how often the iteration statistics are read (they queue up in between)


class TritonPythonModel(NvidiaLlmapiModel):
    def initialize(self, args):
        super().initialize(args)
        self.spec_metrics = SpecMetrics(TARGET_MODEL, max_draft_len=1, callees=[])
        self._stats_stop = threading.Event()
        self._stats_thread = threading.Thread(target=self._read_stats_until_stopped, daemon=True)
        self._stats_thread.start()

    def _read_stats(self) -> None:
        engine = getattr(self, "_llm_engine", None)  # None on MPI ranks other than 0 and after shutdown
        if engine is None:
            return
        try:
            self.spec_metrics.count(spec_decode_counts(engine.get_stats(timeout=POLL_S)))
        except Exception as exc:  # a metrics failure must not take the model down: log it, keep serving
            pb_utils.Logger.log_error(f"[specdeploy] reading iteration stats failed: {exc}")

    def _read_stats_until_stopped(self) -> None:
        while not self._stats_stop.wait(POLL_S):
            self._read_stats()

    def finalize(self):
        self._stats_stop.set()
        self._stats_thread.join()
        self._read_stats()  # what the last iterations reported
        super().finalize()
