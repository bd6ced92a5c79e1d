"""What each toolchain means for the stages after the build: one table (the build itself is one module per
toolchain in build/specbuild/toolchains/, each with versions(), build(spec) and build_script(plan)).

Repository assembly, the `repo` command and deploy ask a trait instead of comparing toolchain strings,
so that a new toolchain is one module plus one row here. Imports nothing beyond the standard library and
pipeline.modes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.modes import traits


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
    # Prompt lookup (speculative.mode ngram) runs inside the target engine's step loop, as TensorRT-LLM's PyTorch
    # backend runs NGramDecodingConfig; False: the BLS looks up and sends each round's draft (draft_tokens_external,
    # TensorRT-LLM's orchestrator-mode prompt lookup for TensorRT engines, one BLS round trip per round).
    engine_runs_lookup: bool = False


TOOLCHAINS: dict[str, ToolchainTraits] = {
    "trtllm": ToolchainTraits(gpu=True, engines_built_here=False, engine_backend="tensorrtllm", out_subdir="trtllm",
                              verify_bounded_by_max_input_len=True, grows_eagle2_tree=False, launch_script=True),
    "reference": ToolchainTraits(gpu=False, engines_built_here=True, engine_backend="python", out_subdir="",
                                 verify_bounded_by_max_input_len=False, grows_eagle2_tree=True, launch_script=False,
                                 engine_runs_lookup=True),
    # TensorRT-LLM's LLM API / PyTorch backend: no engine build, one `tensorrt_llm` model configured by model.yaml
    "trtllm-llmapi": ToolchainTraits(gpu=True, engines_built_here=False, engine_backend="python", out_subdir="trtllm-llmapi",
                                     verify_bounded_by_max_input_len=False, grows_eagle2_tree=False, launch_script=True,
                                     engine_build=False, repository="llmapi", engine_runs_lookup=True),
}
# What `toolchain: auto` resolves to with and without TensorRT-LLM and a GPU; a CPU spec also gets the
# GPU toolchain's repository (the same service for a GPU host), and overlays pick one by their components.
GPU_TOOLCHAIN, CPU_TOOLCHAIN = "trtllm", "reference"


def toolchain_traits(name: str) -> ToolchainTraits:
    """The traits of a toolchain (one of TOOLCHAINS)."""
    return TOOLCHAINS[name]


def lookup_in_engine(mode: str, toolchain: str) -> bool:
    """Whether this mode's prompt lookup runs inside the target engine on this toolchain (else in the BLS)."""
    return traits(mode).prompt_lookup and toolchain_traits(toolchain).engine_runs_lookup
