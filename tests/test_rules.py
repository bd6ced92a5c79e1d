"""Toolchain rules live in pipeline/rules.py: spec.py imports no toolchain module, and every load point checks them."""

import ast
from pathlib import Path

import pytest

from pipeline import rules, spec as spec_module
from pipeline.spec import SpecError, load_spec as load_spec_fields
from pipeline.toolchains import TOOLCHAINS
from specbuild.plan import make_plan

REPO = Path(__file__).resolve().parent.parent
INT8_KV = ["toolchain=trtllm", "models.target.kv_cache_dtype=int8", "serving.enable_kv_cache_reuse=true"]


def test_spec_module_imports_no_toolchain_module():
    """No import loop spec <-> gpus / llmapi, and no import hidden inside a function of spec.py."""
    tree = ast.parse(Path(spec_module.__file__).read_text())
    top = {node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))}
    nested = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) and node not in top]
    assert nested == []
    modules = {node.module for node in top if isinstance(node, ast.ImportFrom)}
    assert not modules & {"pipeline.gpus", "pipeline.llmapi", "pipeline.rules"}


def test_toolchain_rules_run_where_specs_are_loaded():
    """The field checks accept a spec whose toolchain refuses it; the loader and the plan refuse it in one line."""
    spec = load_spec_fields(REPO / "examples/draft-target.yaml", INT8_KV, check_paths=False)
    assert spec.models.target.kv_cache_dtype == "int8"
    with pytest.raises(SpecError) as err:
        rules.load_spec(REPO / "examples/draft-target.yaml", INT8_KV, check_paths=False)
    assert err.value.path == "models.target.kv_cache_dtype" and "\n" not in str(err.value)
    with pytest.raises(SpecError) as err:
        make_plan(spec)
    assert err.value.path == "models.target.kv_cache_dtype"


def test_every_toolchain_with_rules_is_a_toolchain():
    assert set(rules.TOOLCHAIN_RULES) <= set(TOOLCHAINS)
