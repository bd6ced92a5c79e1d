"""Triton model `tensorrt_llm_bls`: async speculative orchestrator (NVIDIA's BLS interface).

Decoupled (serving.decoupled) it streams; otherwise every request gets one response (unary ModelInfer)
and calls the engines unary too, as NVIDIA's stock BLS does with decoupled_mode False.

Every request runs as its own coroutine (pipeline.serving.bls.SpeculativeDecoder), so many
requests stream concurrently while the target and draft models batch them in flight.
"""

import asyncio

import triton_python_backend_utils as pb_utils

from pipeline.serving import triton_io
from pipeline.serving.bls import SpeculativeDecoder, TextResponder
from pipeline.serving.bls_calls import TritonModelClient
from pipeline.serving.errors import RequestError
from pipeline.serving.metrics import SpecMetrics
from pipeline.serving.params import BlsSettings, parse_text_request
from pipeline.serving.text import load_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        self.settings = BlsSettings.from_parameters(triton_io.model_parameters(args))
        self.input_names = [i["name"] for i in triton_io.model_config(args)["input"]]
        self.tokenizer = load_tokenizer(self.settings.tokenizer_dir)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(triton_io.model_config(args))
        self.client = TritonModelClient(self.decoupled)  # one serving.decoupled for the BLS and the engines
        self.metrics = SpecMetrics(args["model_name"], self.settings.max_draft_len)
        self.decoder = SpeculativeDecoder(self.settings, self.client, self.metrics, pb_utils.Logger.log_warn,
                                          pb_utils.Logger.log_info)

    async def execute(self, requests):
        await asyncio.gather(*(self._serve(request) for request in requests))
        return None

    async def _serve(self, request):
        sender = request.get_response_sender()
        try:
            inputs = triton_io.request_inputs(request, self.input_names)
            req = parse_text_request(inputs, self.settings, self.tokenizer)
            if req.stream and not self.decoupled:
                raise RequestError("stream", "needs the decoupled BLS (serving.decoupled: false here)",
                                   "send stream false, or set serving.decoupled: true")
            prompt_text = inputs["text_input"].reshape(-1)[0].decode("utf-8")
            responder = TextResponder(req, prompt_text, self.tokenizer, self.settings.skip_special_tokens)
            async for chunk in self.decoder.generate(req, request.is_cancelled):
                arrays = responder.on_chunk(chunk)
                if arrays is not None:
                    flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if chunk.final else 0
                    sender.send(pb_utils.InferenceResponse(output_tensors=triton_io.tensors(arrays)), flags=flags)
        except Exception as exc:  # every error path closes the request, or its client waits forever
            if not request.is_cancelled():
                triton_io.send_final_error(sender, exc)

    def finalize(self):
        self.client.close()
