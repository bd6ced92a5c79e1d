#!/usr/bin/env bash
# Build (or reuse from the cache) the engines of a spec: build/engines.sh [SPEC] [--set key=value ...]
# A thin wrapper: `make models` checkpoints, then `python -m pipeline engines`. With toolchain trtllm on a
# machine without a GPU it writes out/<name>/trtllm/build_engines.sh for a GPU host (docs/trtllm.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
SPEC="${1:-examples/default.yaml}"
shift $(( $# > 0 ? 1 : 0 ))
"$PY" -m pipeline models
exec "$PY" -m pipeline engines "$SPEC" "$@"
