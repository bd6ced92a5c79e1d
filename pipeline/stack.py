"""Pinned versions of the production stack and of the reference toolchain: the one place they are written.

The production triple is one NVIDIA Triton release whose `trtllm-python-py3` image ships the pinned
TensorRT-LLM and TensorRT (engines built by one TensorRT do not load in another). Sources, cited in
pipeline/contracts/README.md: NVIDIA's Triton compatibility matrix (triton-inference-server/server
docs/introduction/compatibility.md, "Container Name: trtllm-python-py3": 26.04 = TensorRT-LLM 1.2.1,
TensorRT 10.14.1.48) and tensorrtllm_backend's dockerfile/Dockerfile.triton.trt_llm_backend on branch
r26.04 (TENSORRTLLM_VER=1.2.1, TRT_VER=10.14.1.48). tests/data/trtllm-stack-compat.csv holds those rows.
Images in deploy/, the generated scripts, docs and contract facts derive from these names.

Every step key hashes these, so upgrading either stack rebuilds what it must.
"""

TRTLLM_VERSION = "1.2.1"
TENSORRT_VERSION = "10.14.1.48"
TRITON_CONTAINER_TAG = "26.04"  # the Triton (NGC) release; its server is Triton 2.68.0
TRITON_IMAGE = f"nvcr.io/nvidia/tritonserver:{TRITON_CONTAINER_TAG}-trtllm-python-py3"
# Paths of TensorRT-LLM's example scripts inside that container (see docs/trtllm.md).
TRTLLM_EXAMPLES = "/app/examples"
# Bumped whenever the reference engine's on-disk format changes.
REFERENCE_FORMAT_VERSION = "1"
