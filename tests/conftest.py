"""Shared fixtures: tiny generated checkpoints, built once per test session."""

import pytest

from pipeline.fixtures.toymodels import make_derived_pair, make_tiny_llama

# Real-Triton fixtures (tiny_spec_engines, triton_server): one server per session.
pytest_plugins = ["tests.triton_fixtures"]


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
