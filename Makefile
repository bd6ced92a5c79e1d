# Two newcomer commands: `make demo` (the main job on the default spec) and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SPEC ?= examples/default.yaml
ARGS ?=
# Huge-page malloc, as the server's model processes get it (pipeline/server.py server_env), so in-process
# benchmarks run the engine the way Triton does.
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1

.PHONY: trained-pair bench-kernels bench-lookup bench-engine repo serve demo bench openai venv test test-all models engines plan inspect clean deploy-render deploy-check

venv: $(VENV)/.installed

# Creates and reuses a local virtualenv; `pip install torch==2.13.0` takes the CPU build from local disk.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

test: venv
	$(PY) -m pytest -m "not slow" $(ARGS)

test-all: venv
	$(PY) -m pytest $(ARGS)

models: venv
	$(PY) -m pipeline models

inspect: venv
	$(PY) -m pipeline inspect $(SPEC) $(ARGS)

plan: venv
	$(PY) -m pipeline plan $(SPEC) --dry-run $(ARGS)

# The trained stand-in pair for the engine benchmark (6-layer/384 target, 1-layer/128 draft; minutes, cached).
trained-pair: venv
	$(PY) -m pipeline.fixtures.trainpair --out models/trained-pair

# CPU linear kernels for 1-8 rows on SmolLM2's shapes (speed, batch invariance) and the verify cost of 6 tokens
# against 1 on the default spec's engine and a float32 one; prints markdown tables (docs/engine.md quotes them).
bench-kernels: venv models
	$(PY) -m pipeline engines examples/default.yaml >/dev/null
	$(PY) -m pipeline engines examples/default.yaml --set name=float32 --set models.target.qformat=none >/dev/null
	$(PY) -m pipeline.apps.bench_kernels --engines out/float32/engines/target out/default/engines/target \
		--tokenizer models/SmolLM2-135M-Instruct $(ARGS)

# What prompt lookup can bring on the built-in prompt sets (tokens per target forward, counted on the default
# engine's greedy answers: the first factor of `make bench`'s speedup split; the served engine's own policy replayed
# from its repository); writes out/bench-lookup/lookup.{md,json,png}.
bench-lookup: venv models
	$(PY) -m pipeline repo examples/default.yaml >/dev/null
	$(PY) -m pipeline.apps.lookup_ceiling --engine out/default/engines/target --repo out/default/model_repo $(ARGS)

# Engine benchmark (not a test): our plain/speculative decoding vs transformers, roofline; writes docs/bench-engine.*.
# Default is a short sweep (K 2,4, 2 prompts); ARGS="--full" for K 1..8.
# Both targets run from int8_sq engines (the default spec's qformat; the trained pair's is built here).
bench-engine: venv models trained-pair
	$(PY) -m pipeline engines examples/default.yaml >/dev/null
	$(PY) -m pipeline repo examples/default.yaml >/dev/null
	$(PY) -m pipeline engines examples/draft-target.yaml --set name=trained-int8 --set models.target.qformat=int8_sq \
		--set models.target.checkpoint=../models/trained-pair/target --set models.draft.checkpoint=../models/trained-pair/draft >/dev/null
	$(PY) -m pipeline.apps.bench_engine --smollm2-engine out/default/engines/target \
		--trained-engine out/trained-int8/engines/target --served-lookup out/default/model_repo $(ARGS)

# Build (or reuse from the cache) the engines of a spec; with toolchain trtllm on a machine without a GPU this
# writes out/<name>/trtllm/build_engines.sh for a GPU host (docs/trtllm.md).
engines: venv models
	$(PY) -m pipeline engines $(SPEC) $(ARGS)

# Kubernetes: write each deploy/overlays/*/generated/ component from its example spec and render the
# overlays to out/deploy/<overlay>.yaml (kubectl with kustomize); an example whose checkpoints are absent
# (gpu-multinode's 70B) is skipped with the reason. deploy-check also runs the deploy tests.
deploy-render: venv models
	$(PY) -m pipeline.deploy examples
	mkdir -p out/deploy
	for overlay in deploy/overlays/*/; do \
	  [ -f $$overlay/generated/kustomization.yaml ] || continue; \
	  kubectl kustomize $$overlay > out/deploy/$$(basename $$overlay).yaml || exit 1; \
	  echo "rendered out/deploy/$$(basename $$overlay).yaml"; done

# Triton (issue 4): assemble and validate the model repository (reference, plus the trtllm one and its
# launch script), serve it on 127.0.0.1:8000/8001/8002, or run the whole demo (models -> engines ->
# repository -> server -> streamed requests plain vs speculative -> stop).
repo: venv engines
	$(PY) -m pipeline repo $(SPEC) $(ARGS)

serve: venv repo
	$(PY) -m pipeline serve $(SPEC) $(ARGS)

demo: venv models
	$(PY) -m pipeline demo $(SPEC) $(ARGS)

# Triton vs engine throughput (concurrency 1 and 8) and per-round orchestration overhead -> docs/benchmarks.md.
bench-serve: venv models
	$(PY) -m pipeline.apps.bench_serve $(SPEC) $(ARGS)

deploy-check: deploy-render
	$(PY) -m pytest tests/test_deploy.py tests/test_deploy_multinode.py $(ARGS)

# Load test against the running server (`make serve` in another terminal): sweeps concurrency x K and
# writes out/bench/{bench.json,bench.md,*.png}. ARGS="--full" for concurrency 1,4,8,16 x K 0..8.
bench: venv
	$(PY) -m pipeline bench $(SPEC) $(ARGS)

# OpenAI-compatible API on http://127.0.0.1:$(OPENAI_PORT)/v1 in front of the running server's gRPC port.
OPENAI_PORT ?= 9000
openai: venv
	$(PY) -m clients.openai_server --triton-url 127.0.0.1:8001 --port $(OPENAI_PORT) $(ARGS)

clean:
	rm -rf out .cache/engines
