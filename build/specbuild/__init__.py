"""The build stage: plan (steps and content keys), execute (cache, manifest), the toolchains (reference
conversion/quantization on CPU, TensorRT-LLM command scripts for a GPU host)."""
