#!/usr/bin/env bash
# Write the TensorRT-LLM 1.2.1 build script of a spec for a GPU host: build/trtllm-script.sh [SPEC] [--set key=value ...]
# The script lands in out/<name>/trtllm/build_engines.sh; run it inside
# nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3 (docs/trtllm.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
SPEC="${1:-examples/default.yaml}"
shift $(( $# > 0 ? 1 : 0 ))
exec "$PY" -m pipeline engines "$SPEC" --toolchain trtllm "$@"
