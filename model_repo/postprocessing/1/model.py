"""Triton model `postprocessing`: token ids -> text (NVIDIA's interface); logic in pipeline.serving.text."""

import triton_python_backend_utils as pb_utils

from pipeline.serving import triton_io
from pipeline.serving.text import load_tokenizer, postprocess


class TritonPythonModel:
    def initialize(self, args):
        params = triton_io.model_parameters(args)
        self.tokenizer = load_tokenizer(params["tokenizer_dir"])
        self.skip_special_tokens = params.get("skip_special_tokens", "true").lower() == "true"

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                inputs = triton_io.request_inputs(request, ["TOKENS_BATCH", "SEQUENCE_LENGTH"])
                text = postprocess(inputs["TOKENS_BATCH"], inputs["SEQUENCE_LENGTH"], self.tokenizer, self.skip_special_tokens)
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", text)]))
            except Exception as exc:
                responses.append(triton_io.error_response(exc))
        return responses
