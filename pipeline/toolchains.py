"""What each toolchain means for the stages after the build: one table (the build itself is one module per
toolchain in build/specbuild/toolchains/, each with versions(), build(spec) and build_script(plan)).

Repository assembly, the `repo` command and deploy ask a trait instead of comparing toolchain strings,
so that a new toolchain is one module plus one row here. Imports nothing beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolchainTraits:
    """One toolchain, as the repository, the server and the cluster see it."""

    gpu: bool  # its engines build and serve on a GPU host (GPU overlays, GPU resources)
    engines_built_here: bool  # `engines` builds them on this machine; else a GPU host runs build_script(plan)
    engine_backend: str  # the Triton backend of tensorrt_llm / tensorrt_llm_draft
    out_subdir: str  # its engines/ and model_repo/ live under <out_dir>/<out_subdir>
    verify_bounded_by_max_input_len: bool  # a verify call's input_ids <= max_input_len (else max_seq_len - 1)
    grows_eagle2_tree: bool  # the engine grows EAGLE-2's dynamic tree (eagle_dynamic_tree_top_k)
    launch_script: bool  # the repository comes with TensorRT-LLM's launch_triton_server.py script
    engine_build: bool = True  # the plan builds engines; False: it serves HF checkpoints (quantized by ModelOpt if asked)
    repository: str = "inflight_batcher_llm"  # our five-model repository, or "llmapi" (NVIDIA's one LLM API model)


TOOLCHAINS: dict[str, ToolchainTraits] = {
    "trtllm": ToolchainTraits(gpu=True, engines_built_here=False, engine_backend="tensorrtllm", out_subdir="trtllm",
                              verify_bounded_by_max_input_len=True, grows_eagle2_tree=False, launch_script=True),
    "reference": ToolchainTraits(gpu=False, engines_built_here=True, engine_backend="python", out_subdir="",
                                 verify_bounded_by_max_input_len=False, grows_eagle2_tree=True, launch_script=False),
    # TensorRT-LLM's LLM API / PyTorch backend: no engine build, one `tensorrt_llm` model configured by model.yaml
    "trtllm-llmapi": ToolchainTraits(gpu=True, engines_built_here=False, engine_backend="python", out_subdir="trtllm-llmapi",
                                     verify_bounded_by_max_input_len=False, grows_eagle2_tree=False, launch_script=True,
                                     engine_build=False, repository="llmapi"),
}
# What `toolchain: auto` resolves to with and without TensorRT-LLM and a GPU; a CPU spec also gets the
# GPU toolchain's repository (the same service for a GPU host), and overlays pick one by their components.
GPU_TOOLCHAIN, CPU_TOOLCHAIN = "trtllm", "reference"


def toolchain_traits(name: str) -> ToolchainTraits:
    """The traits of a toolchain (one of TOOLCHAINS)."""
    return TOOLCHAINS[name]
