"""Tiny generated Llama checkpoints for tests: seconds to build, real HF format (safetensors + tokenizer).

`make_derived_pair` gives a target/draft pair with controllable acceptance: the draft is the
target's first layer, and the target's other layers add `eps` times their output (untied output
layer scaled x8 so distributions are sharp and greedy has few near-ties). Measured greedy
agreement (teacher-forced on random ids): eps=0 100%, 0.05 ~89%, 0.1 ~70%, 0.15 ~58%, 0.5 ~11%.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pipeline.corpus import local_text

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(out_dir: Path, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on local text and save it (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([local_text(100_000)], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.save_pretrained(out_dir)
    return fast


def tiny_config(vocab_size: int = 512, hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 128, **extra) -> LlamaConfig:
    """A small Llama config with GQA and tied embeddings (like SmolLM2)."""
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.1,
                       bos_token_id=0, eos_token_id=0, pad_token_id=0, **{"tie_word_embeddings": True, **extra})


def make_tiny_llama(out_dir: str | Path, seed: int = 0, vocab_size: int = 512, **config_kwargs) -> Path:
    """A random tiny Llama checkpoint with a trained tokenizer, saved as safetensors. Returns out_dir."""
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(vocab_size=vocab_size, **config_kwargs)).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    make_tokenizer(out_dir, vocab_size)
    return out_dir


def make_derived_pair(out_dir: str | Path, eps: float = 0.15, seed: int = 0, layers: int = 4,
                      logit_scale: float = 8.0) -> tuple[Path, Path]:
    """A target and its 1-layer draft (see module docstring). Returns (target_dir, draft_dir)."""
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    untied = {"tie_word_embeddings": False}
    target = LlamaForCausalLM(tiny_config(layers=layers, **untied)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(logit_scale)  # sharpens the output distribution
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(eps)
            layer.mlp.down_proj.weight.mul_(eps)
    draft = LlamaForCausalLM(tiny_config(layers=1, **untied)).eval()
    state = {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    draft.load_state_dict(state, strict=False)
    paths = out_dir / "target", out_dir / "draft"
    for model, path in zip((target, draft), paths):
        model.save_pretrained(path, safe_serialization=True)
        make_tokenizer(path)
    return paths
