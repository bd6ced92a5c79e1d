"""Generated models for tests, the demo and the benchmarks: tiny Llama checkpoints, the SmolLM2 example
draft and heads (`python -m pipeline models`), the trained stand-in pair. Not part of the pipeline."""
