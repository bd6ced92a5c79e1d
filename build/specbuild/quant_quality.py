"""Quality of reference engines against their float32 HF checkpoint, through the engine's own kernels.

    .venv/bin/python build/specbuild/quant_quality.py models/SmolLM2-135M-Instruct out/<name>/engines/target ...

For each engine: the reference model as the engine runs it (int8_wo / int8_sq on their int8 kernels,
with per-token activation quantization for int8_sq; int4 / fp8 dequantized at load; over the engine's KV
cache: a bf16 one with REFERENCE_BF16_KV_CACHE=1) scores 512 tokens of local text outside the calibration slice in
one prefill; printed are the top-1 agreement
with the float32 checkpoint, the perplexity, and the greedy answer to a chat prompt.
A measurement, not a test: run it by hand (docs/engine.md, "Quantized weights").
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.corpus import local_text  # noqa: E402
from pipeline.reference.engine import LLMEngine, Request, SamplingParams  # noqa: E402
from pipeline.reference.model import LlamaModel, SequenceInput  # noqa: E402

PROMPT = "What is the capital of France?"


def all_logits(model: LlamaModel, ids: list[int], kv_dtype: str | None = None) -> torch.Tensor:
    """[len(ids), vocab] logits of one prefill over a KV cache of `kv_dtype` (KVCache)."""
    kv = model.new_kv_cache(-(-len(ids) // 32), 32, kv_dtype)
    return model([SequenceInput(ids, 0, list(range(kv.num_blocks)), logits_rows=list(range(len(ids))))], kv).logits


def answer(engine: LLMEngine, prompt_ids: list[int], end_id: int, max_new: int = 12) -> list[int]:
    """Greedy tokens for one prompt."""
    engine.add_request(Request("q", prompt_ids, max_new, sampling=SamplingParams(end_id=end_id)))
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def main(checkpoint: str, engines: list[str]) -> None:
    """Print agreement, perplexity and a chat answer per engine (float32 checkpoint first)."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer(local_text(300_000)[250_000:260_000]).input_ids[:512]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer(chat, add_special_tokens=False).input_ids
    with torch.inference_mode():
        reference = all_logits(LlamaModel.from_hf(checkpoint), ids).argmax(-1)
        for engine_dir in engines:
            engine = LLMEngine.from_engine_dir(engine_dir)
            logits = all_logits(engine.model, ids, engine.kv.kv_dtype)
            agreement = (logits.argmax(-1) == reference).float().mean().item()
            perplexity = F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).exp().item()
            algo = engine.model.config["quantization"]["quant_algo"] or "none"
            kernel = type(engine.model.layers[0]["qkv"]).__name__
            print(f"{engine_dir}: {algo} ({kernel}, {engine.kv.k.dtype} KV cache) agreement {agreement:.3f} perplexity {perplexity:.2f} "
                  f"answer {tokenizer.decode(answer(engine, chat_ids, tokenizer.eos_token_id))!r}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
