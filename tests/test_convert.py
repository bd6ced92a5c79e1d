"""Reference convert/build: real weight quantization, engine layout, logits against transformers."""

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from pipeline.fixtures.models import make_random_eagle, make_random_medusa
from specbuild.plan import make_plan
from pipeline.reference.checkpoint import (dequantize_linear, load_engine, quantize_fp8, quantize_int4, quantize_int8,
                                           quantize_linear, unpack_int4)
from specbuild.convert import awq_scale, build_engine, calibration_inputs, convert_checkpoint
from pipeline.spec import load_spec

SPEC = """\
name: t
models:
  target: {{checkpoint: {target}, dtype: float32, group_size: 32}}
speculative: {{mode: ngram, max_draft_len: 6, num_draft_tokens: 4}}
output: {{dir: {tmp}/out, cache_dir: {tmp}/cache}}
"""


def test_int8_per_channel_error_is_at_most_half_a_step():
    w = torch.randn(32, 64)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (32,)
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


def test_int4_packs_two_values_per_byte_low_nibble_first():
    w = torch.randn(8, 64)
    packed, scale = quantize_int4(w, group_size=16)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 32) and scale.shape == (8, 4)
    q = unpack_int4(packed)
    assert q.min() >= -8 and q.max() <= 7
    assert torch.equal((packed[:, 0] & 0x0F).to(torch.int8), torch.where(q[:, 0] < 0, q[:, 0] + 16, q[:, 0]))
    w_hat = dequantize_linear({"weight": packed, "weight_scale": scale}, "W4A16", 16)
    step = scale.repeat_interleave(16, dim=1)  # [8, 64]
    assert ((w_hat - w).abs() <= step / 2 + 1e-6).all()


def test_fp8_storage_is_float8_e4m3fn_with_channel_scales():
    w = torch.randn(16, 32) * 3
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (16,)
    rel = (q.float() * scale[:, None] - w).abs() / w.abs().amax(1, keepdim=True)
    assert rel.max() < 0.07  # e4m3 has 3 mantissa bits


def test_input_scales_fold_back_exactly_in_float():
    w, s = torch.randn(16, 32), torch.rand(32) + 0.5
    for algo in ("W8A8_SQ_PER_CHANNEL", "W4A16_AWQ"):
        stored = quantize_linear(w, algo, 16, s)
        folded = dequantize_linear(stored, algo, 16)
        plain = dequantize_linear(quantize_linear(w, algo, 16), algo, 16)
        assert (folded - w).abs().max() < 3 * (plain - w).abs().max() + 0.1  # a reparametrization, not a new weight


@pytest.fixture(scope="module")
def tiny_spec(derived_pair, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("convert")
    path = tmp / "spec.yaml"
    path.write_text(SPEC.format(target=derived_pair[0], tmp=tmp))
    return path


def build(spec, tmp_path):
    """Run the plan's convert and build steps directly; return the engine folder."""
    plan = make_plan(spec, "reference")
    convert, engine = plan.steps
    ckpt = tmp_path / "ckpt"
    s = spec.speculative
    convert_checkpoint(convert.params, spec.models.target.checkpoint, ckpt,
                       medusa_dir=s.medusa.checkpoint if s.medusa else None, eagle_dir=s.eagle.checkpoint if s.eagle else None)
    build_engine(ckpt, tmp_path / "engine", engine.params)
    return tmp_path / "engine"


def hf_logits(checkpoint, state=None):
    model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    ids = torch.arange(1, 33).unsqueeze(0) * 7 % 500
    with torch.no_grad():
        return model(ids).logits[0]  # [T, vocab]


def test_float32_engine_has_the_documented_layout_and_exact_weights(tiny_spec, derived_pair, tmp_path):
    engine = build(load_spec(tiny_spec), tmp_path)
    config = json.loads((engine / "config.json").read_text())
    assert sorted(p.name for p in engine.iterdir()) == ["config.json", "rank0.safetensors"]
    pc, bc = config["pretrained_config"], config["build_config"]
    assert config["version"] == "reference-1" and pc["architecture"] == "LlamaForCausalLM" and pc["dtype"] == "float32"
    assert (pc["num_hidden_layers"], pc["num_key_value_heads"], pc["head_size"]) == (4, 2, 16)
    assert bc["speculative_decoding_mode"] == "draft_tokens_external" and bc["max_draft_len"] == 6
    assert bc["plugin_config"]["use_paged_context_fmha"] and bc["max_batch_size"] == 8
    _config, state = load_engine(engine)
    assert torch.equal(hf_logits(derived_pair[0], state), hf_logits(derived_pair[0]))


@pytest.mark.parametrize("qformat, algo, max_rel", [
    ("int8_wo", "W8A16", 0.05), ("int4_wo", "W4A16", 0.5), ("fp8", "FP8", 0.2),
    ("int4_awq", "W4A16_AWQ", 0.5), ("int8_sq", "W8A8_SQ_PER_CHANNEL", 0.05),
])
def test_quantized_engines_store_quantized_weights_and_stay_close(tiny_spec, derived_pair, tmp_path, qformat, algo, max_rel):
    engine = build(load_spec(tiny_spec, [f"models.target.qformat={qformat}", "models.target.calib_size=2"]), tmp_path)
    from safetensors.torch import load_file

    raw = load_file(str(engine / "rank0.safetensors"))
    q = raw["model.layers.0.mlp.down_proj.weight"]
    expected_dtype = {"W8A16": torch.int8, "W8A8_SQ_PER_CHANNEL": torch.int8, "FP8": torch.float8_e4m3fn}.get(algo, torch.uint8)
    assert q.dtype == expected_dtype
    assert raw["lm_head.weight"].dtype == torch.float32  # output layer and embeddings stay in the compute dtype
    assert ("model.layers.0.mlp.down_proj.pre_quant_scale" in raw) == (algo == "W4A16_AWQ")
    assert ("model.layers.0.mlp.down_proj.smoother" in raw) == (algo == "W8A8_SQ_PER_CHANNEL")
    config, state = load_engine(engine)
    assert config["pretrained_config"]["quantization"]["quant_algo"] == algo
    ref, got = hf_logits(derived_pair[0]), hf_logits(derived_pair[0], state)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < max_rel


def test_awq_scales_never_do_worse_than_plain_int4(derived_pair):
    stats = calibration_inputs(derived_pair[0], calib_size=2)
    from safetensors.torch import load_file

    state = load_file(str(derived_pair[0] / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    w, x = state[name + ".weight"], stats[name]["rows"]
    s = awq_scale(w, stats[name], 32)
    awq = dequantize_linear(quantize_linear(w, "W4A16_AWQ", 32, s), "W4A16_AWQ", 32)
    plain = dequantize_linear(quantize_linear(w, "W4A16", 32), "W4A16", 32)
    assert (x @ (awq - w).T).pow(2).mean() <= (x @ (plain - w).T).pow(2).mean()


def test_medusa_heads_go_into_the_target_engine(tiny_spec, derived_pair, tmp_path):
    heads = make_random_medusa(derived_pair[0], tmp_path / "medusa", num_heads=3)
    spec = load_spec(tiny_spec, ["speculative.mode=medusa", "speculative.ngram=null", f"speculative.medusa.checkpoint={heads}",
                                 "speculative.max_draft_len=8"])
    config, state = load_engine(build(spec, tmp_path))
    assert config["pretrained_config"]["medusa"]["num_medusa_heads"] == 3
    assert config["build_config"]["speculative_decoding_mode"] == "medusa"
    assert state["medusa_heads.2.0.linear.weight"].shape == (64, 64)
    assert torch.allclose(state["medusa_heads.0.lm_head.weight"], state["lm_head.weight"], atol=2e-3)  # copied (float16)


def test_eagle_weights_go_into_the_target_engine(tiny_spec, derived_pair, tmp_path):
    eagle = make_random_eagle(derived_pair[0], tmp_path / "eagle")
    spec = load_spec(tiny_spec, ["speculative.mode=eagle", "speculative.ngram=null", f"speculative.eagle.checkpoint={eagle}",
                                 "speculative.max_draft_len=8"])
    config, state = load_engine(build(spec, tmp_path))
    e = config["pretrained_config"]["eagle"]
    assert (e["version"], e["num_eagle_layers"], e["hidden_size"], e["fc_bias"]) == (2, 3, 64, True)
    assert state["eagle.fc.weight"].shape == (64, 128) and state["eagle.fc.weight"].dtype == torch.float32


@pytest.mark.slow
def test_smollm2_default_engine_matches_transformers(tmp_path):
    """The real model: `models` extracts SmolLM2 (cached in models/), the default spec builds, logits match HF."""
    from pathlib import Path

    from specbuild.execute import run_engines
    from pipeline.fixtures.models import make_models

    repo = Path(__file__).resolve().parents[1]
    paths = make_models(repo / "models")
    spec = load_spec(repo / "examples/default.yaml", [f"output.dir={tmp_path / 'out'}", f"output.cache_dir={tmp_path / 'cache'}",
                                                      "toolchain=reference"])
    run_engines(spec)
    config, state = load_engine(spec.out_dir / "engines/target")
    assert config["pretrained_config"]["num_hidden_layers"] == 30 and config["pretrained_config"]["vocab_size"] == 49152
    assert torch.equal(hf_logits(paths["target"], state), hf_logits(paths["target"]))
