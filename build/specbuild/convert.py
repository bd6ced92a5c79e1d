"""The reference toolchain's steps: HF checkpoint -> reference checkpoint (convert / quantize) -> engine (build).

convert: dtype cast, weight-only int8 (per channel) / int4 (grouped) / fp8 (per channel, float8_e4m3fn)
quantization of the decoder's linear layers, Medusa heads or EAGLE weights added to the target.
quantize (calibrated qformats, on min(calib_size, 8) sequences of up to 128 tokens of local text, as
chat turns when the tokenizer has a chat template):
- int4_awq: activation-aware scaling as in AWQ (Lin et al. 2023) for o_proj, gate/up (one shared scale)
  and down_proj: s = mean|x|^alpha with alpha searched on a grid to minimize the output error of the
  int4 weights on calibration inputs; the weight is quantized as w * s and `pre_quant_scale` = 1/s
  scales the input. q/k/v stay plain grouped int4 (see UNSCALED).
- int8_sq: SmoothQuant (Xiao et al. 2023) smoothing factors s = max|x|^0.5 / max|w|^0.5 per input
  channel of o_proj, gate/up (shared) and down_proj (q/k/v: s = 1); weight int8 per channel of w * s,
  `smoother` = s. Activations are NOT quantized: the reference runs it weight-only.
- fp8: per-channel float8_e4m3fn weights; activations stay in the compute dtype (weight-only).
build: adds the engine limits and speculative-decoding settings (build_config) to the checkpoint.
Weights load from safetensors; pickle files only when the spec allows them (torch.load weights_only).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipeline.corpus import local_text
from pipeline.reference.checkpoint import (CONFIG_FILE, DTYPES, KV_CACHE_QUANT_ALGO, QUANT_ALGO, WEIGHTS_FILE,
                                           int4_values, is_quantized_linear, quantize_linear, save_engine)
from pipeline.reference.model import config_from_hf

CALIB_SEQUENCES = 8
CALIB_SEQ_LEN = 128
CALIB_ROWS = 256  # input rows kept per linear for the AWQ scale search
AWQ_ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # one calibrated scale per shared input
# q/k/v get no calibrated input scale: their error passes through softmax, which a per-linear output loss
# misses (AWQ proper measures the attention block's output); on SmolLM2 scaling them broke chat answers.
UNSCALED = ("q_proj", "k_proj", "v_proj")
ENGINE_VERSION = "reference-1"


def load_weights(folder: Path, allow_pickle: bool, names: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (or of the named files): safetensors, or pickle when allowed."""
    files = [folder / n for n in names if (folder / n).is_file()] if names else sorted(folder.glob("*.safetensors"))
    safetensors = [f for f in files if f.suffix == ".safetensors"]
    if safetensors:
        state = {}
        for f in safetensors:
            state.update(load_file(str(f)))
        return state
    pickles = [f for f in files if f.suffix in (".bin", ".pt", ".pth")] if names else sorted(folder.glob("*.bin"))
    if not pickles:
        raise FileNotFoundError(f"{folder} has no weights")
    if not allow_pickle:
        raise PermissionError(f"{folder} holds pickle weights; set security.allow_pickle_weights to load them")
    state = {}
    for f in pickles:
        state.update(torch.load(f, map_location="cpu", weights_only=True))  # weights_only: no arbitrary objects
    return state


# ----------------------------------------------------------------------------- calibration


def calibration_batch(tokenizer, n: int) -> torch.Tensor:
    """[n, CALIB_SEQ_LEN] token ids of local text; chat models get it as chat turns (their serving format)."""
    text = local_text(200_000)
    chunk = 300  # characters per chat turn
    rows = []
    for i in range(max(1, n)):
        if tokenizer.chat_template:
            a, b = text[2 * i * chunk:(2 * i + 1) * chunk], text[(2 * i + 1) * chunk:(2 * i + 2) * chunk]
            ids = tokenizer.apply_chat_template([{"role": "user", "content": a}, {"role": "assistant", "content": b}],
                                                tokenize=True, return_dict=True)["input_ids"]
        else:
            ids = tokenizer(text[i * 4 * chunk:(i + 1) * 4 * chunk]).input_ids
        rows.append(list(ids)[:CALIB_SEQ_LEN])
    length = min(len(r) for r in rows)
    return torch.tensor([r[:length] for r in rows])


def calibration_inputs(model_dir: Path, calib_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """Per decoder linear (HF name without `.weight`): input stats {absmean, absmax [in], rows [n, in]}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=False).eval()
    batch = calibration_batch(tokenizer, min(calib_size, CALIB_SEQUENCES))  # [n, T]
    stats: dict[str, dict[str, torch.Tensor]] = {}
    generator = torch.Generator().manual_seed(0)

    def hook(name):
        def record(_module, args, _output):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])  # [n*T, in]
            rows = x[torch.randperm(x.shape[0], generator=generator)[:CALIB_ROWS]]
            stats[name] = {"absmean": x.abs().mean(0), "absmax": x.abs().amax(0), "rows": rows}
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and is_quantized_linear(name + ".weight")]
    with torch.no_grad():
        model.model(input_ids=batch)  # the decoder only: the output layer is not quantized, its logits are not needed
    for h in handles:
        h.remove()
    return stats


def awq_scale(w: torch.Tensor, stat: dict, group_size: int) -> torch.Tensor:
    """The per-input-channel scale s [in] minimizing ||x w.T - (x / s) Q(w * s).T|| over the alpha grid (int4)."""
    x = stat["rows"]  # [n, in]
    w = w.float()
    out_features, in_features = w.shape
    best, best_err = torch.ones(in_features), float("inf")
    for alpha in AWQ_ALPHAS:  # alpha 0 is plain int4, so the result is never worse on these inputs
        s = stat["absmean"].clamp(min=1e-4).pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        q, scale = int4_values(w * s[None, :], group_size)  # [out, in], [out, G]
        w_hat = (q.float().reshape(out_features, -1, group_size) * scale[:, :, None]).reshape(out_features, in_features)
        err = (x @ (w_hat / s[None, :] - w).T).pow(2).mean().item()  # output error on calibration inputs
        if err < best_err:
            best, best_err = s, err
    return best


def smoothquant_scale(w: torch.Tensor, stat: dict, alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant's s [in] = max|x|^alpha / max|w|^(1 - alpha)."""
    return (stat["absmax"].clamp(min=1e-5).pow(alpha) / w.float().abs().amax(0).clamp(min=1e-5).pow(1 - alpha)).clamp(min=1e-5)


def input_scales(state: dict, stats: dict, qformat: str, group_size: int) -> dict[str, torch.Tensor]:
    """Calibrated input scale s per linear (key: `<prefix>.`); linears reading the same input share one."""
    scales = {}
    for name in state:
        if not is_quantized_linear(name) or name[: -len("weight")] in scales:
            continue
        prefix = name[: -len(".weight")]
        head, leaf = prefix.rsplit(".", 1)
        group = next((g for g in SHARED_INPUT if leaf in g), (leaf,))
        members = [f"{head}.{m}" for m in group if f"{head}.{m}.weight" in state]
        if leaf in UNSCALED:
            continue
        w = torch.cat([state[m + ".weight"].float() for m in members])  # [sum of out, in]
        s = awq_scale(w, stats[prefix], group_size) if qformat == "int4_awq" else smoothquant_scale(w, stats[prefix])
        scales.update({m + ".": s for m in members})
    return scales


# ----------------------------------------------------------------------------- steps


def convert_checkpoint(params: dict, model_dir: Path, out_dir: Path, medusa_dir: Path | None = None,
                       eagle_dir: Path | None = None, allow_pickle: bool = False) -> None:
    """One convert/quantize step: write the reference checkpoint (config.json + rank0.safetensors) to out_dir."""
    hf = json.loads((model_dir / "config.json").read_text())
    config = config_from_hf(hf, params["dtype"])
    qformat, group_size = params["qformat"], params.get("group_size", 128)
    algo = QUANT_ALGO[qformat]
    config["quantization"] = {"quant_algo": algo, "kv_cache_quant_algo": KV_CACHE_QUANT_ALGO[params["kv_cache_dtype"]],
                              "group_size": group_size}
    config["mapping"] = {"world_size": params["tp_size"] * params["pp_size"], "tp_size": params["tp_size"],
                         "pp_size": params["pp_size"]}
    dtype = DTYPES[params["dtype"]]
    state = load_weights(model_dir, allow_pickle)
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    scales = input_scales(state, calibration_inputs(model_dir, params["calib_size"]), qformat, group_size) \
        if qformat in ("int4_awq", "int8_sq") else {}
    tensors = {}
    for name, w in state.items():
        if algo and is_quantized_linear(name):
            prefix = name[: -len("weight")]
            for suffix, t in quantize_linear(w, algo, group_size, scales.get(prefix)).items():
                tensors[prefix + suffix] = t
        else:
            tensors[name] = w.to(dtype) if w.is_floating_point() else w
    if "medusa" in params:
        tensors |= medusa_tensors(medusa_dir, params["medusa"], state, allow_pickle, dtype)
        config["medusa"] = {"num_medusa_heads": params["medusa"]["num_heads"],
                            "num_medusa_layers": params["medusa"]["num_layers"],
                            "max_draft_len": params["medusa"]["max_draft_len"]}
    if "eagle" in params:
        e = params["eagle"]
        eagle = load_weights(eagle_dir, allow_pickle, ("model.safetensors", "pytorch_model.bin"))
        tensors |= {f"eagle.{k}": v.to(dtype) if v.is_floating_point() else v for k, v in eagle.items()}
        config["eagle"] = {"version": e["version"], "num_eagle_layers": e["num_eagle_layers"],
                           "max_draft_len": e["max_draft_len"], "max_non_leaves_per_layer": e["max_non_leaves_per_layer"],
                           **e["net"]}
    save_engine(out_dir, config, tensors)


def medusa_tensors(folder: Path, heads: dict, base: dict, allow_pickle: bool, dtype: torch.dtype) -> dict:
    """Medusa heads renamed to `medusa_heads.{h}.{l}.linear.*` and `medusa_heads.{h}.lm_head.weight`.

    Heads without their own LM head (Medusa-2 format) get a copy of the target's lm_head.
    """
    raw = load_weights(folder, allow_pickle, ("medusa_lm_head.safetensors", "medusa_lm_head.pt"))
    lm_head = base.get("lm_head.weight", base["model.embed_tokens.weight"])
    layers = heads["num_layers"]
    out = {}
    for h in range(heads["num_heads"]):
        for l in range(layers):
            for kind in ("weight", "bias"):
                out[f"medusa_heads.{h}.{l}.linear.{kind}"] = raw[f"{h}.{l}.linear.{kind}"].to(dtype)
        out[f"medusa_heads.{h}.lm_head.weight"] = raw.get(f"{h}.{layers}.weight", lm_head).to(dtype)
    return out


def build_engine(checkpoint_dir: Path, engine_dir: Path, params: dict) -> None:
    """One build step: the checkpoint's weights (hard-linked) plus config.json with build_config."""
    pretrained = json.loads((checkpoint_dir / CONFIG_FILE).read_text())
    build_config = {
        "max_batch_size": params["max_batch_size"], "max_input_len": params["max_input_len"],
        "max_seq_len": params["max_seq_len"], "max_num_tokens": params["max_num_tokens"],
        "max_draft_len": params["max_draft_len"], "speculative_decoding_mode": params["speculative_decoding_mode"],
        "gather_generation_logits": params["gather_generation_logits"],
        "plugin_config": {"paged_kv_cache": params["paged_kv_cache"], "use_paged_context_fmha": params["use_paged_context_fmha"],
                          "tokens_per_block": params["tokens_per_block"]},
    }
    engine_dir.mkdir(parents=True, exist_ok=True)
    try:
        os.link(checkpoint_dir / WEIGHTS_FILE, engine_dir / WEIGHTS_FILE)  # same bytes: no copy
    except OSError:
        shutil.copyfile(checkpoint_dir / WEIGHTS_FILE, engine_dir / WEIGHTS_FILE)
    engine = {"version": ENGINE_VERSION, "pretrained_config": pretrained, "build_config": build_config}
    (engine_dir / CONFIG_FILE).write_text(json.dumps(engine, indent=2) + "\n")
