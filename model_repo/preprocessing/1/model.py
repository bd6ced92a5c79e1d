"""Triton model `preprocessing`: text -> token ids (NVIDIA's interface); logic in pipeline.serving.text."""

import triton_python_backend_utils as pb_utils

from pipeline.serving import triton_io
from pipeline.serving.text import load_tokenizer, preprocess


class TritonPythonModel:
    def initialize(self, args):
        params = triton_io.model_parameters(args)
        self.tokenizer = load_tokenizer(params["tokenizer_dir"])
        self.add_special_tokens = params.get("add_special_tokens", "false").lower() == "true"
        self.input_names = [i["name"] for i in triton_io.model_config(args)["input"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs = preprocess(triton_io.request_inputs(request, self.input_names), self.tokenizer, self.add_special_tokens)
                responses.append(pb_utils.InferenceResponse(output_tensors=triton_io.tensors(outputs)))
            except Exception as exc:  # every request gets an answer; the model keeps serving
                responses.append(triton_io.error_response(exc))
        return responses
