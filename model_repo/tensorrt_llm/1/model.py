"""Triton model `tensorrt_llm` / `tensorrt_llm_draft` (reference toolchain): the tensorrtllm backend's
interface over the reference engine. An EngineRunner thread steps the engine, so every concurrent request
(plain, or verifying external draft tokens) is batched in flight; it regathers the BLS's chained requests
(pipeline/reference/runner.py) so that rounds of concurrent requests share steps. Decoupled or not (serving.decoupled), each
request is handed to the engine at once and answered through its response sender: streamed when decoupled,
one response otherwise. As in NVIDIA's C++ backend, a request with `stop` true cancels the running requests
that carry its Triton request id and gets one empty final response (the tensorrtllm backend's handleStopRequest in
inflight_batcher_llm/src/model_instance_state.cc; a stopped request ends with the tokens it has), and a
non-decoupled model refuses `streaming`. An engine that drafts itself (prompt lookup, Medusa, EAGLE) exports the
spec_decode_* counters for its finished requests, labelled with this model's name.
"""

import queue
import threading
import uuid

import triton_python_backend_utils as pb_utils

from pipeline.names import CHAIN_PARAMETER
from pipeline.reference.engine import EngineInputError
from pipeline.reference.runner import EngineRunner
from pipeline.serving import heartbeat, triton_io
from pipeline.serving.reference_adapter import (REGATHER_S, ResponseBuilder, engine_request, load_serving_engine,
                                                stop_requested)
from pipeline.serving.metrics import EngineMetrics, SpecMetrics
from pipeline.serving.errors import RequestError, Stopped

CANCEL_POLL_S = 0.05  # how often a waiting request checks whether its client went away


class TritonPythonModel:
    def initialize(self, args):
        triton_io.enable_fault_dumps()
        heartbeat.start(args["model_name"])  # `pipeline health --live` sees a frozen stub
        params = triton_io.model_parameters(args)
        self.input_names = [i["name"] for i in triton_io.model_config(args)["input"]]
        self.exclude_input = params.get("exclude_input_in_output", "false").lower() == "true"
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(triton_io.model_config(args))
        self.engine = load_serving_engine(params["gpt_model_path"], params)
        # an engine that drafts itself (prompt lookup, Medusa, EAGLE) counts its speculation as the BLS counts its
        # rounds; on the engine's thread, as every metric update of this model, sent in sums (EngineMetrics)
        spec = (SpecMetrics(args["model_name"], self.engine.config.max_draft_len, callees=[])
                if self.engine.proposer is not None else None)
        self.metrics = EngineMetrics(args["model_name"], spec)
        self.engine.on_step, self.engine.on_idle = self.metrics.step, self.metrics.flush
        if spec is not None:
            self.engine.on_speculated = spec.speculated
        self.engine.on_decode_threads = lambda threads: pb_utils.Logger.log_info(
            f"{args['model_name']}: small forwards on {threads} thread(s), chosen before the first step")
        pb_utils.Logger.log_info(f"{args['model_name']}: {self.engine.kv.describe()}")
        self.vocab_size = self.engine.model.vocab_size
        self.runner = EngineRunner(self.engine, regather_s=REGATHER_S)
        self.running: dict[str, set[str]] = {}  # Triton request id -> engine request ids, for `stop`
        self.stopped: set[str] = set()  # engine request ids a `stop` request ended: they end normally
        self.running_lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = triton_io.request_inputs(request, self.input_names)
                if stop_requested(inputs):
                    self._stop(request.request_id(), sender)
                    continue
                engine_req, options = engine_request(inputs, uuid.uuid4().hex, self.exclude_input, self.vocab_size)
                if options.streaming and not self.decoupled:
                    raise RequestError("streaming", "is only supported by a decoupled model (serving.decoupled: false here)",
                                       "send streaming false, or set serving.decoupled: true")
                # the BLS names the chain a call continues (TextRequest.call_chain) in a request parameter
                outputs = self.runner.submit(engine_req, chain=triton_io.request_parameter(request, CHAIN_PARAMETER))
                if request.request_id():
                    with self.running_lock:
                        self.running.setdefault(request.request_id(), set()).add(engine_req.request_id)
            except EngineInputError as exc:
                triton_io.send_final_error(sender, RequestError(exc.field, "invalid", exc.fix))
                continue
            except Exception as exc:
                triton_io.send_final_error(sender, exc)
                continue
            builder = ResponseBuilder(engine_req.prompt_ids, options)
            threading.Thread(target=self._respond, args=(request, sender, engine_req.request_id, outputs, builder),
                             daemon=True).start()
        return None

    def _stop(self, triton_id: str, sender) -> None:
        """Stop every running request with this Triton request id; answer with an empty final response."""
        if not triton_id:
            raise RequestError("stop", "needs the request id of the request to stop",
                               "send the stop request with the same request id (gRPC/HTTP `id`)")
        with self.running_lock:
            engine_ids = list(self.running.get(triton_id, ()))
        with self.running_lock:
            self.stopped.update(engine_ids)
        for engine_id in engine_ids:  # an unknown id is no error: the request may have finished already
            self.runner.cancel(engine_id)
        triton_io.send_response(sender, pb_utils.InferenceResponse(output_tensors=[]),
                                pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _stopped_by_request(self, request_id: str) -> bool:
        with self.running_lock:
            return request_id in self.stopped

    def _forget(self, triton_id: str, request_id: str) -> None:
        with self.running_lock:
            self.stopped.discard(request_id)
            ids = self.running.get(triton_id)
            if ids is not None:
                ids.discard(request_id)
                if not ids:
                    del self.running[triton_id]

    def _respond(self, request, sender, request_id, outputs, builder):
        """Forward the engine's outputs of one request to its client until it finishes."""
        try:
            while True:
                try:
                    out = outputs.get(timeout=CANCEL_POLL_S)
                except queue.Empty:
                    if request.is_cancelled():
                        self.runner.cancel(request_id)
                    continue
                if out.error:
                    triton_io.send_final_error(sender, RuntimeError(out.error))
                    return
                # never a short final that looks complete, unless NVIDIA's `stop` request asked for it
                if out.finish_reason == "cancelled" and not self._stopped_by_request(request_id):
                    triton_io.send_final_error(sender, Stopped(
                        f"{builder.num_tokens + len(out.new_token_ids)} tokens generated (its client left, "
                        "or the model is unloading)"))
                    return
                arrays = builder.add(out)
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0
                if arrays is not None:
                    triton_io.send(sender, arrays, flags)
                elif out.finished:
                    triton_io.send_response(sender, flags=flags)
                if out.finished:
                    return
        except Exception as exc:
            triton_io.send_final_error(sender, exc)
        finally:
            self._forget(request.request_id(), request_id)

    def finalize(self):
        self.runner.close()
