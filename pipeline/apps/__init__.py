"""Applications on top of the pipeline: the demo and the engine/serving benchmarks."""
