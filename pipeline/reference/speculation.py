"""The proposer a reference engine directory asks for: Medusa heads or EAGLE weights stored in the engine.

TensorRT-LLM builds Medusa and EAGLE into the target engine and reads the tree at run time
(`medusa_choices` / `eagle_choices` parameters of the tensorrt_llm model). The reference engine does
the same: `pretrained_config.medusa` / `.eagle` say what rank0.safetensors holds (`medusa_heads.*`,
`eagle.*`, written by build/specbuild/convert.py), and this module turns them into a proposer.
"""

from __future__ import annotations

from pipeline.reference.eagle import EagleProposer
from pipeline.reference.medusa import MedusaProposer, medusa_heads_from_engine
from pipeline.reference.model import LlamaModel


def engine_proposer(pretrained_config: dict, state: dict, target: LlamaModel, choices=None,
                    dynamic_top_k: int | None = None, max_batch_size: int = 8, max_seq_len: int = 2048):
    """MedusaProposer / EagleProposer for an engine whose config has `medusa` / `eagle`; None for plain engines.

    choices: medusa_choices or eagle_choices (required for Medusa and EAGLE-1 trees); EAGLE-2 uses
    dynamic_top_k instead (its depth is the engine's num_eagle_layers).
    """
    medusa, eagle = pretrained_config.get("medusa"), pretrained_config.get("eagle")
    if medusa:
        if choices is None:
            raise ValueError("medusa engine: pass medusa_choices (e.g. [[0], [0, 0], [1]])")
        return MedusaProposer(medusa_heads_from_engine(state, medusa, target.lm_head), choices)
    if eagle:
        net = {"hidden_size": eagle["hidden_size"], "intermediate_size": eagle["intermediate_size"],
               "num_attention_heads": eagle["num_attention_heads"], "num_key_value_heads": eagle["num_key_value_heads"],
               "head_dim": eagle["head_size"], "rms_norm_eps": eagle["norm_epsilon"],
               "vocab_size": target.vocab_size, "max_position_embeddings": target.config["max_position_embeddings"],
               "rope_theta": target.config["rotary_base"]}
        tree = {"choices": choices} if dynamic_top_k is None else {"dynamic_top_k": dynamic_top_k, "depth": eagle["num_eagle_layers"]}
        layers = tuple(eagle["layers_to_capture"]) if eagle.get("layers_to_capture") else None  # EAGLE-3
        return EagleProposer.from_state_dict(state, net, target, prefix="eagle.", layers_to_capture=layers,
                                             max_batch_size=max_batch_size, max_seq_len=max_seq_len, **tree)
    return None
