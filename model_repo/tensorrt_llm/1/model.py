"""Triton model `tensorrt_llm` / `tensorrt_llm_draft` (reference toolchain): the tensorrtllm backend's
interface over the reference engine. An EngineRunner thread steps the engine, so every concurrent request
(plain, or verifying external draft tokens) is batched in flight. Decoupled or not (serving.decoupled), each
request is handed to the engine at once and answered through its response sender: streamed when decoupled,
one response otherwise. As in NVIDIA's C++ backend, a request with `stop` true cancels the running requests
that carry its Triton request id and gets one empty response, and a non-decoupled model refuses `streaming`.
"""

import queue
import threading
import uuid

import triton_python_backend_utils as pb_utils

from pipeline.reference.engine import EngineInputError
from pipeline.reference.runner import EngineRunner
from pipeline.serving import triton_io
from pipeline.serving.reference_adapter import ResponseBuilder, engine_request, load_serving_engine
from pipeline.serving.metrics import EngineMetrics
from pipeline.serving.errors import RequestError, Stopped

CANCEL_POLL_S = 0.05  # how often a waiting request checks whether its client went away


class TritonPythonModel:
    def initialize(self, args):
        params = triton_io.model_parameters(args)
        self.input_names = [i["name"] for i in triton_io.model_config(args)["input"]]
        self.exclude_input = params.get("exclude_input_in_output", "false").lower() == "true"
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(triton_io.model_config(args))
        self.by_triton_id: dict[str, set[str]] = {}  # Triton request id -> running engine request ids (for `stop`)
        self.ids_lock = threading.Lock()
        self.engine = load_serving_engine(params["gpt_model_path"], params)
        self.metrics = EngineMetrics(args["model_name"])
        self.engine.on_step = self.metrics.step
        self.vocab_size = self.engine.model.vocab_size
        self.runner = EngineRunner(self.engine)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = triton_io.request_inputs(request, self.input_names)
                if "stop" in inputs and bool(inputs["stop"].reshape(-1)[0]):
                    self._stop(request, sender)
                    continue
                engine_req, options = engine_request(inputs, uuid.uuid4().hex, self.exclude_input, self.vocab_size)
                if options.streaming and not self.decoupled:
                    raise RequestError("streaming", "is only supported by a decoupled model (serving.decoupled: false here)",
                                       "send streaming false, or set serving.decoupled: true")
                outputs = self.runner.submit(engine_req)
            except EngineInputError as exc:
                triton_io.send_final_error(sender, RequestError(exc.field, "invalid", exc.fix))
                continue
            except Exception as exc:
                triton_io.send_final_error(sender, exc)
                continue
            builder = ResponseBuilder(engine_req.prompt_ids, options)
            with self.ids_lock:
                self.by_triton_id.setdefault(request.request_id(), set()).add(engine_req.request_id)
            threading.Thread(target=self._respond, args=(request, sender, engine_req.request_id, outputs, builder),
                             daemon=True).start()
        return None

    def _stop(self, request, sender):
        """Cancel the running requests with this request's Triton id; answer with one empty response."""
        if not request.request_id():
            triton_io.send_final_error(sender, RequestError("stop", "needs the request id of the request to stop",
                                                            "send the stop request with the same request id"))
            return
        with self.ids_lock:
            running = list(self.by_triton_id.get(request.request_id(), ()))
        for engine_id in running:
            self.runner.cancel(engine_id)
        sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

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
                if out.finish_reason == "cancelled":  # never a short final that looks complete
                    triton_io.send_final_error(sender, Stopped(
                        f"{len(builder.tokens) + len(out.new_token_ids)} tokens generated (its client left, "
                        "or the model is unloading)"))
                    return
                arrays = builder.add(out)
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0
                if arrays is not None:
                    sender.send(pb_utils.InferenceResponse(output_tensors=triton_io.tensors(arrays)), flags=flags)
                elif out.finished:
                    sender.send(flags=flags)
                if out.finished:
                    return
        except Exception as exc:
            triton_io.send_final_error(sender, exc)
        finally:
            with self.ids_lock:
                running = self.by_triton_id.get(request.request_id(), set())
                running.discard(request_id)
                if not running:
                    self.by_triton_id.pop(request.request_id(), None)

    def finalize(self):
        self.runner.close()
