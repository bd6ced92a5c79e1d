"""Shared fixtures: tiny generated checkpoints, built once per test session."""

import os

import pytest

from pipeline.fixtures.toymodels import make_derived_pair, make_tiny_llama
from pipeline.reference.compiled import ENV as COMPILED_LAYERS_ENV
from pipeline.reference.engine import BF16_KV_CACHE_ENV

# Engines (in-process and in the servers the tests start) run eager layers unless a test turns compiled
# layers on: compiling them would add seconds to every engine load (tests/test_compiled.py covers them).
os.environ.setdefault(COMPILED_LAYERS_ENV, "0")
# ... and keep a float32 KV cache, whose logits the exactness tests compare with transformers' (tests/
# test_bf16_kv_cache.py turns the bf16 cache on)
os.environ.setdefault(BF16_KV_CACHE_ENV, "0")

# Real-Triton fixtures (tiny_spec_engines, triton_server): one server per session.
pytest_plugins = ["tests.triton_fixtures"]

# Seconds a slow test (the real SmolLM2: engines, servers, minutes) may take; every other test has pyproject.toml's
# timeout
SLOW_TEST_TIMEOUT_S = 1800


def pytest_collection_modifyitems(items):
    """Slow tests get SLOW_TEST_TIMEOUT_S instead of the default per-test timeout (unless they set their own)."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))


@pytest.fixture(scope="session")
def derived_pair(tmp_path_factory):
    """(target_dir, draft_dir) with ~58% greedy acceptance (eps=0.15)."""
    return make_derived_pair(tmp_path_factory.mktemp("derived"), eps=0.15)


@pytest.fixture(scope="session")
def exact_pair(tmp_path_factory):
    """(target_dir, draft_dir) where the draft always agrees with the target (eps=0)."""
    return make_derived_pair(tmp_path_factory.mktemp("exact"), eps=0.0)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A 4-layer random Llama with tied embeddings and GQA, vocab 512."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
