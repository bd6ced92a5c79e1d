"""Pinned versions of the production stack and of the reference toolchain.

Every step key hashes these, so upgrading either stack rebuilds what it must.
"""

TRTLLM_VERSION = "1.2.1"
TENSORRT_VERSION = "10.14.1"
TRITON_CONTAINER_TAG = "25.12"
TRITON_IMAGE = f"nvcr.io/nvidia/tritonserver:{TRITON_CONTAINER_TAG}-trtllm-python-py3"
# Paths of TensorRT-LLM's example scripts inside that container (see docs/trtllm.md).
TRTLLM_EXAMPLES = "/app/examples"
# Bumped whenever the reference engine's on-disk format changes.
REFERENCE_FORMAT_VERSION = "1"
