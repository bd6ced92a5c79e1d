"""The trained stand-in pair: a 6-layer/384 target and a 1-layer/128 draft trained a few minutes on local text.

Random derived pairs (toymodels.make_derived_pair) have the right acceptance but no language; SmolLM2's
real drafts are too weak on CPU (see docs/benchmarks.md). This pair is trained here, in minutes, on the
pydoc text every CPython ships (about 100k tokens), with one 4096-token BPE tokenizer, so that
draft-target speculation has a language-like acceptance and a realistic cost ratio (the draft costs
about 1/10 of the target per token). Recipe: 500 AdamW steps of 8 x 64 tokens each (one-cycle LR)
for the target on the text, then 500 steps for the draft distilled from the target's next-token
distributions; about 10 + 4 minutes on one loaded core. Built once by
`make trained-pair` into models/trained-pair/{target,draft}; a second run reuses it (recipe.json).
On an oversubscribed machine run it with OMP_NUM_THREADS=1: two spinning OpenMP threads per
process made training steps 6x slower there.

    python -m specfixtures.trainpair --out models/trained-pair [--target-steps 500 --draft-steps 500]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaForCausalLM

from pipeline.corpus import local_text
from specfixtures.toymodels import make_tokenizer, tiny_config

VOCAB = 4096
TARGET = dict(hidden=384, layers=6, heads=6, kv_heads=2, intermediate=1024)
DRAFT = dict(hidden=128, layers=1, heads=2, kv_heads=1, intermediate=384)
RECIPE_VERSION = 2  # bump when the recipe changes: the cached pair is rebuilt


def token_stream(tokenizer, max_chars: int = 400_000) -> torch.Tensor:
    """The local text as one long token tensor [N]."""
    return torch.tensor(tokenizer(local_text(max_chars))["input_ids"], dtype=torch.long)


def train(model: LlamaForCausalLM, tokens: torch.Tensor, steps: int, lr: float, seq_len: int = 64,
          batch: int = 8, seed: int = 0, label: str = "train", teacher: LlamaForCausalLM | None = None) -> float:
    """Next-token training on random windows of `tokens` [N]; returns the last loss.

    With a teacher the targets are its next-token distributions (distillation: the draft learns to
    agree with the target, which is what acceptance measures), else the text's next tokens.
    """
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    loss_value = float("nan")
    for _ in tqdm(range(steps), desc=label, unit="step"):
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch,), generator=g)
        x = torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])  # [batch, seq_len]
        if teacher is None:
            loss = model(input_ids=x, labels=x).loss
        else:
            with torch.no_grad():
                soft = torch.softmax(teacher(input_ids=x).logits, dim=-1)  # [batch, seq_len, vocab] target p
            logq = torch.log_softmax(model(input_ids=x).logits, dim=-1)  # [batch, seq_len, vocab] draft log q
            loss = -(soft * logq).sum(-1).mean()  # cross-entropy to p = KL(p || q) + const
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss)
    model.eval()
    return loss_value


def build_trained_pair(out_dir: str | Path, target_steps: int = 500, draft_steps: int = 500) -> tuple[Path, Path]:
    """Train (or reuse) the pair under out_dir; returns (target_dir, draft_dir)."""
    out_dir = Path(out_dir)
    target_dir, draft_dir = out_dir / "target", out_dir / "draft"
    stamp = out_dir / "recipe.json"
    recipe = {"version": RECIPE_VERSION, "vocab": VOCAB, "target": TARGET, "draft": DRAFT,
              "target_steps": target_steps, "draft_steps": draft_steps}
    if stamp.is_file() and json.loads(stamp.read_text()).get("recipe") == recipe:
        return target_dir, draft_dir
    torch.manual_seed(0)
    tokenizer = make_tokenizer(target_dir, VOCAB)
    tokens = token_stream(tokenizer)
    report = {"recipe": recipe, "train_tokens": tokens.numel()}
    teacher = None
    for name, shape, steps, lr, path in (("target", TARGET, target_steps, 3e-3, target_dir),
                                         ("draft", DRAFT, draft_steps, 3e-3, draft_dir)):
        torch.manual_seed(1)
        config = tiny_config(vocab_size=VOCAB, **shape)
        config.initializer_range = 0.02  # a trainable init (the test models use 0.1 for sharp random outputs)
        model = LlamaForCausalLM(config)
        started = time.perf_counter()
        report[f"{name}_loss"] = round(train(model, tokens, steps, lr, label=name, teacher=teacher), 4)
        report[f"{name}_seconds"] = round(time.perf_counter() - started, 1)
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        teacher = model  # the draft is distilled from the trained target
    stamp.write_text(json.dumps(report, indent=1))
    return target_dir, draft_dir


def main(argv: list[str] | None = None) -> None:
    """Command line: build the pair (cached)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/trained-pair", help="output folder (default: models/trained-pair)")
    parser.add_argument("--target-steps", type=int, default=500)
    parser.add_argument("--draft-steps", type=int, default=500)
    args = parser.parse_args(argv)
    target, draft = build_trained_pair(args.out, args.target_steps, args.draft_steps)
    print(f"target: {target}\ndraft:  {draft}\n{(Path(args.out) / 'recipe.json').read_text()}")


if __name__ == "__main__":
    main()
