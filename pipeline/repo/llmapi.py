"""The trtllm-llmapi repository: NVIDIA's one-model LLM API repository (`all_models/llmapi`), generated.

`tensorrt_llm/config.pbtxt` declares the llmapi model's interface (pipeline/contracts/llmapi.json
`config_pbtxt`) and, because launch_triton_server.py passes --disable-auto-complete-config, the same
`max_batch_size` / `decoupled` as model.yaml's `triton_config`; `tensorrt_llm/1/model.yaml` holds the
LLM API arguments (pipeline/llmapi.py). NVIDIA's model.py / helpers.py are copied from the container at
launch (they are not part of this project). Next to the repository: `extra_llm_api_options.yaml`, the same
keys for `trtllm-serve`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from pipeline.llmapi import check_llm_args, contract, extra_llm_api_options, model_yaml
from pipeline.names import TARGET_MODEL
from pipeline.repo.config import ModelConfigSpec, parse_pbtxt
from pipeline.repo.interface import TensorSpec

OPTIONS_FILE = "extra_llm_api_options.yaml"


class LlmapiRepoError(ValueError):
    """A written llmapi repository that disagrees with the facts or with itself."""


def _tensors(raw: dict) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(name, t["data_type"], tuple(t["dims"]), optional=t.get("optional", False)) for name, t in raw.items())


def llmapi_config(triton_config: dict) -> ModelConfigSpec:
    """The tensorrt_llm config.pbtxt of the llmapi repository."""
    facts = contract()["config_pbtxt"]
    return ModelConfigSpec(name=facts["name"], backend=facts["backend"], max_batch_size=triton_config["max_batch_size"],
                           decoupled=triton_config["decoupled"], instance_count=facts["instance_group"]["count"],
                           inputs=_tensors(facts["inputs"]), outputs=_tensors(facts["outputs"]))


def write_llmapi_repo(args: dict, dest: Path) -> Path:
    """Write the repository for LLM args `args` into `dest` (replaced), plus the trtllm-serve options file; validate."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / TARGET_MODEL / "1").mkdir(parents=True)
    yaml_config = model_yaml(args)
    (tmp / TARGET_MODEL / "config.pbtxt").write_text(llmapi_config(yaml_config["triton_config"]).render())
    (tmp / TARGET_MODEL / "1" / "model.yaml").write_text(yaml.safe_dump(yaml_config, sort_keys=False))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    (dest.parent / OPTIONS_FILE).write_text(yaml.safe_dump(extra_llm_api_options(args), sort_keys=False))
    validate_llmapi_repo(dest)
    return dest


def validate_llmapi_repo(repo: Path) -> dict:
    """Parse what was written: config.pbtxt through Triton's schema against the recorded interface, model.yaml
    against the LLM API facts, and the two agreeing on batching and decoupling; returns model.yaml."""
    facts = contract()["config_pbtxt"]
    cfg = parse_pbtxt((repo / TARGET_MODEL / "config.pbtxt").read_text())
    config = yaml.safe_load((repo / TARGET_MODEL / "1" / "model.yaml").read_text())
    declared = {t.name for t in cfg.input}, {t.name for t in cfg.output}
    if declared != (set(facts["inputs"]), set(facts["outputs"])) or cfg.backend != facts["backend"]:
        raise LlmapiRepoError(f"{repo}: tensorrt_llm declares other tensors than NVIDIA's llmapi model reads")
    check_llm_args(config)
    tc = config["triton_config"]
    if (cfg.max_batch_size, cfg.model_transaction_policy.decoupled) != (tc["max_batch_size"], tc["decoupled"]):
        raise LlmapiRepoError(f"{repo}: config.pbtxt (max_batch_size {cfg.max_batch_size}, decoupled "
                              f"{cfg.model_transaction_policy.decoupled}) disagrees with model.yaml triton_config {tc}")
    return config
