"""Weight quality of reference engines against their float32 HF checkpoint (docs/spec.md, "Measured").

    .venv/bin/python build/specbuild/quant_quality.py models/SmolLM2-135M-Instruct out/int4-awq/engines/target ...

For each engine: its dequantized weights go into the float32 transformers model; printed are the
top-1 agreement with float32 and the perplexity on 512 tokens of local text outside the calibration
slice, then greedy answers to a chat prompt. A measurement, not a test: run it by hand.
"""

import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.corpus import local_text  # noqa: E402
from pipeline.reference.checkpoint import load_engine  # noqa: E402

PROMPT = "What is the capital of France?"


def main(checkpoint: str, engines: list[str]) -> None:
    """Print agreement, perplexity and a chat answer per engine."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    ids = tokenizer(local_text(300_000)[250_000:260_000], return_tensors="pt").input_ids[:, :512]  # [1, 512]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        reference = model(ids).logits  # [1, 512, vocab]
    for engine in engines:
        config, state = load_engine(engine)
        model.load_state_dict(base)
        model.load_state_dict({k: v.float() for k, v in state.items() if k in base}, strict=False)
        with torch.no_grad():
            logits = model(ids).logits
            answer = model.generate(chat, max_new_tokens=12, do_sample=False)[0, chat.shape[1]:]
        agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        perplexity = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).exp().item()
        algo = config["pretrained_config"]["quantization"]["quant_algo"] or "none"
        print(f"{engine}: {algo} agreement {agreement:.3f} perplexity {perplexity:.2f} answer {tokenizer.decode(answer)!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
