"""Build-and-deploy pipeline: HF checkpoints -> engines -> Triton speculative decoding."""

__version__ = "0.1.0"
