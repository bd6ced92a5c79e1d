"""Config-only stand-ins for checkpoints too large to download here (Llama-3.1-70B, Llama-3.2-1B), for the
multi-node deploy tests (tests/test_deploy_multinode.py).

Each folder holds what `inspect`, `plan` and `deploy` read: config.json, a tokenizer, and a
model.safetensors whose header lists every tensor with its real shape but whose data is absent
(the file ends after the header). Weight bytes, the memory plan, the build key and the manifests
come out as for the real checkpoint; nothing here can be loaded as weights.

Architectures are Meta's (meta-llama/llama-models models/sku_list.py @5309637ceedec731719b742d9a44176a8e96b494:
Llama-3.1-70B-Instruct and arch_args_1b() of Llama-3.2-1B-Instruct), turned into the Hugging Face
config the way transformers' convert_llama_weights_to_hf.py does (intermediate_size from Meta's
FeedForward rule). Llama-3.2-1B ties its output layer to the embeddings (its Hub config.json:
tie_word_embeddings true; not readable here, so uncertain).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

LLAMA3_VOCAB_SIZE = 128256
META_ARCH_ARGS = {
    "Llama-3.1-70B-Instruct": {"dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "ffn_dim_multiplier": 1.3,
                               "multiple_of": 4096, "norm_eps": 1e-05, "rope_theta": 500000.0, "tied": False},
    "Llama-3.2-1B-Instruct": {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_dim_multiplier": 1.5,
                              "multiple_of": 256, "norm_eps": 1e-05, "rope_theta": 500000.0, "tied": True},
}


def intermediate_size(dim: int, ffn_dim_multiplier: float, multiple_of: int) -> int:
    """Meta's FeedForward hidden size for a 4*dim MLP (llama-models models/llama3/model.py)."""
    hidden = int(2 * (4 * dim) / 3)
    hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def hf_config(name: str) -> dict:
    """The Hugging Face config.json of one of META_ARCH_ARGS."""
    a = META_ARCH_ARGS[name]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a["dim"],
            "intermediate_size": intermediate_size(a["dim"], a["ffn_dim_multiplier"], a["multiple_of"]),
            "num_hidden_layers": a["n_layers"], "num_attention_heads": a["n_heads"], "num_key_value_heads": a["n_kv_heads"],
            "head_dim": a["dim"] // a["n_heads"], "vocab_size": LLAMA3_VOCAB_SIZE, "rms_norm_eps": a["norm_eps"],
            "rope_theta": a["rope_theta"], "tie_word_embeddings": a["tied"], "torch_dtype": "bfloat16"}


def tensor_shapes(config: dict) -> dict[str, list[int]]:
    """Every tensor of a Llama checkpoint with its shape."""
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": [V, H], "model.norm.weight": [H]}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = [V, H]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": [q, H], p + "self_attn.k_proj.weight": [kv, H],
                   p + "self_attn.v_proj.weight": [kv, H], p + "self_attn.o_proj.weight": [H, q],
                   p + "mlp.gate_proj.weight": [I, H], p + "mlp.up_proj.weight": [I, H], p + "mlp.down_proj.weight": [H, I],
                   p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H]}
    return shapes


def write_header_only_safetensors(path: Path, shapes: dict[str, list[int]], dtype: str = "BF16", itemsize: int = 2) -> None:
    """A safetensors header (8-byte length + JSON with dtype, shape, data_offsets) without the tensor data."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = itemsize
        for n in shape:
            size *= n
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def write_config_only_checkpoint(folder: Path, name: str) -> Path:
    """config.json, a shared small tokenizer and a header-only model.safetensors for META_ARCH_ARGS[name]."""
    folder.mkdir(parents=True, exist_ok=True)
    config = hf_config(name)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1} | {f"tok{i}": i for i in range(2, 256)}
    tokenizer = {"version": "1.0", "added_tokens": [], "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "tok2"}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    write_header_only_safetensors(folder / "model.safetensors", tensor_shapes(config))
    return folder
