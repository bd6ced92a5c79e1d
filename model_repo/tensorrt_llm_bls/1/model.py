"""Triton model `tensorrt_llm_bls`: async speculative orchestrator (NVIDIA's BLS interface).

Decoupled (serving.decoupled) it streams; otherwise every request gets one response (unary ModelInfer)
and calls the engines unary too, as NVIDIA's stock BLS does with decoupled_mode False.

Every request runs as its own coroutine (pipeline.serving.bls.SpeculativeDecoder), so many
requests stream concurrently while the target and draft models batch them in flight. A request's
responses are sent on the event loop's next turn, in order: by then its next round's engine call is on
its way, so the engine does not wait for the client's response (a send took about 0.5 ms of a round,
traced). A request
ends early with an explicit error when its client leaves (CANCELLED) or when the server's drain
budget runs out (UNAVAILABLE); while the server drains, new requests are refused (UNAVAILABLE).
"""

import asyncio

import triton_python_backend_utils as pb_utils

from pipeline.serving import heartbeat, triton_io
from pipeline.serving.bls import SpeculativeDecoder, TextResponder
from pipeline.serving.bls_calls import TritonModelClient
from pipeline.serving.drain import DrainState
from pipeline.serving.errors import RequestError, Stopped, Unavailable
from pipeline.serving.metrics import SpecMetrics
from pipeline.serving.params import BlsSettings, parse_text_request
from pipeline.serving.text import load_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        triton_io.enable_fault_dumps()
        heartbeat.start(args["model_name"])  # `pipeline health --live` sees a frozen stub
        self.name = args["model_name"]
        self.settings = BlsSettings.from_parameters(triton_io.model_parameters(args))
        self.input_names = [i["name"] for i in triton_io.model_config(args)["input"]]
        self.tokenizer = load_tokenizer(self.settings.tokenizer_dir)
        callees = [m for m in (self.settings.target_model, self.settings.draft_model) if m]
        self.metrics = SpecMetrics(self.name, self.settings.max_draft_len, callees)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(triton_io.model_config(args))
        # one serving.decoupled for the BLS and the engines
        self.client = TritonModelClient(self.decoupled, self.settings.stall_timeout_s, self._model_down)
        # the decoder counts the requests in flight (its batch gate); the drain gauge shows its count
        self.decoder = SpeculativeDecoder(self.settings, self.client, self.metrics, pb_utils.Logger.log_warn,
                                          on_in_flight=self.metrics.set_in_flight)
        self.drain = DrainState()

    def _model_down(self, model, reason):
        role = "draft" if model == self.settings.draft_model else "target"
        after = ("every request runs without speculation from now on" if role == "draft"
                 else "every request fails until the server restarts")
        pb_utils.Logger.log_error(f"{self.name}: {role} model {model} is down ({reason}); {after}")
        self.metrics.down(model)

    async def execute(self, requests):
        await asyncio.gather(*(self._serve(request) for request in requests))
        return None

    async def _serve(self, request):
        sender = request.get_response_sender()
        if not self.drain.admits():  # nothing was sent for this request yet: no order to keep
            triton_io.send_final_error(sender, Unavailable(
                f"{self.name}: the server is shutting down and takes no new requests; send it to another replica"))
            return
        with self.decoder.admit():
            await self._respond(request, sender)

    async def _respond(self, request, sender):
        """Parse, generate and send one admitted request; every path ends it with a final response or error."""
        try:
            inputs = triton_io.request_inputs(request, self.input_names)
            req = parse_text_request(inputs, self.settings, self.tokenizer)
            if req.stream and not self.decoupled:
                raise RequestError("stream", "needs the decoupled BLS (serving.decoupled: false here)",
                                   "send stream false, or set serving.decoupled: true")
            prompt_text = inputs["text_input"].reshape(-1)[0].decode("utf-8")
            responder = TextResponder(req, prompt_text, self.tokenizer, self.settings.skip_special_tokens)
            stop = lambda: request.is_cancelled() or self.drain.aborting()  # noqa: E731
            async for chunk in self.decoder.generate(req, stop):
                arrays = responder.on_chunk(chunk)
                if arrays is not None:
                    flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if chunk.final else 0
                    self._send_soon(triton_io.send, sender, arrays, flags)
        except Stopped as exc:
            if request.is_cancelled():
                pb_utils.Logger.log_info(f"{self.name}: request cancelled by its client, {exc}")
                self._send_soon(triton_io.send_final_error, sender, exc)
            else:
                self._send_soon(triton_io.send_final_error, sender, Unavailable(
                    f"{self.name}: the server shut down before this request finished ({exc}); retry it"))
        except Exception as exc:  # every error path closes the request, or its client waits forever
            if not request.is_cancelled():
                self._send_soon(triton_io.send_final_error, sender, exc)

    def _send_soon(self, send, *args):
        """Run `send(*args)` on the event loop's next turn, after the sends scheduled before it (call_soon is FIFO)."""
        asyncio.get_running_loop().call_soon(self._send_now, send, args)

    def _send_now(self, send, args):
        try:
            send(*args)
        except Exception as exc:  # the client may be gone; the request's coroutine has ended or sees is_cancelled()
            pb_utils.Logger.log_error(f"{self.name}: a response could not be sent ({exc})")

    def finalize(self):
        self.client.close()
