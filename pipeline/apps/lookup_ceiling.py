"""`make bench-lookup`: what prompt lookup can bring on the served prompt sets, counted rather than timed.

`make bench` measures a speedup and splits it: tokens per target step x step cost x busy share (clients/bench.py).
This tool bounds the first factor. It takes the target engine's greedy answers to the built-in prompt sets
(the answers serving gives, as `make bench` sends them), then replays lookup policies over them without
running the model again: every round looks up the context's last n-gram (pipeline.sequences.ngram_lookup,
what the BLS calls), the answer says how many drafted tokens the target accepts, and each target forward is
counted. tokens per forward is what a policy's speedup would be if a verify forward cost no more than a plain
step and calls cost nothing; with the measured cost c of a draft token (pipeline.reference.step_cost) the
estimate is tokens / (forwards + c x drafted tokens).

Policies:
- the served engine (with --repo, a model repository whose tensorrt_llm model looks up in the engine, the reference
  toolchain's): the repository's own policy object (pipeline.serving.reference_adapter.lookup_proposer: its K, cut,
  measured costs, switch-off, slow start, match classes and row cut), asked exactly as the engine asks it
  (`replay_served`), one request after another as at concurrency 1, so its counts are the engine's own
  (tests/test_lookup_ceiling.py runs both);
- BLS rounds: what the trtllm toolchain serves, the BLS's rounds (at most K draft tokens, cut where the context
  disagrees when min_token_prob > 0;
  adaptive: one fewer after a partly rejected draft, two more after a fully accepted one,
  pipeline.sequences.next_draft_len; a lookup miss decodes the current draft length + 1 tokens plainly; the
  switch-off and its back-off are the BLS's own, pipeline.serving.bls.RoundPolicy);
- BLS rounds without the cut: the same with min_token_prob 0 (the whole continuation, up to the draft length);
- fixed K: the BLS rounds with K never changing and no cut (the BLS before 2026-12-02);
- every token: the lookup runs again after every plain token (a miss costs one forward);
- oracle: every token, but each draft cut to the tokens the target will accept (it knows the answer): no rejected
  row, so its estimate bounds what any policy can take from this lookup at K (when to draft and how far);
- every token, K=16, no switch-off: prompt lookup's ceiling on these answers (longer drafts, never giving up).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.reference.policy import PolicyProposer
from pipeline.reference.proposers import ProposalInput
from pipeline.sequences import common_prefix_len, ngram_lookup
from pipeline.serving.bls import RoundPolicy

CEILING_K = 16


@dataclass(frozen=True)
class LookupPolicy:
    """How a request drafts: at most K tokens per round (adaptive: the BLS's draft length schedule, else always K),
    plain tokens per lookup miss (None: draft length + 1, as the BLS), the switch-off bar
    (pipeline.serving.bls.RoundPolicy; 0: never), the lookup's settings (pipeline.sequences.ngram_lookup), and
    whether it drafts only the looked-up tokens the target will accept (`oracle`: it knows the answer)."""

    name: str
    k: int
    miss_tokens: int | None
    switch_off_below: float
    adaptive: bool = False
    min_ngram: int = 1
    max_ngram: int = 3
    min_token_prob: float = 0.0
    oracle: bool = False


@dataclass
class Replay:
    """Counts of one policy over answers: tokens, target forwards, drafted and accepted tokens."""

    tokens: int = 0
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, other: "Replay") -> None:
        """Accumulate another replay's counts."""
        self.tokens += other.tokens
        self.forwards += other.forwards
        self.drafted += other.drafted
        self.accepted += other.accepted

    def tokens_per_forward(self) -> float:
        """The speedup over plain decoding if verification and calls were free."""
        return self.tokens / self.forwards if self.forwards else 0.0

    def estimated_speedup(self, draft_token_cost: float) -> float:
        """tokens / (forwards + c x drafted): plain decoding costs one forward per token, a verify forward 1 + c x its drafts."""
        cost = self.forwards + draft_token_cost * self.drafted
        return self.tokens / cost if cost else 0.0


def replay(prompt: list[int], answer: list[int], policy: LookupPolicy) -> Replay:
    """Count the target forwards `policy` needs to produce `answer` (greedy, so the target accepts a drafted token
    exactly when it equals the answer's next token). The prompt's prefill forward is not counted (plain decoding
    pays it too)."""
    out = Replay(tokens=len(answer))
    done, schedule = 0, RoundPolicy(policy.k, policy.switch_off_below, adaptive=policy.adaptive)  # as the BLS
    while done < len(answer):
        remaining = len(answer) - done
        if remaining == 1:
            out.forwards += remaining
            break
        k = min(schedule.draft_len, remaining - 1)
        draft, _ = ngram_lookup(prompt + answer[:done], k, policy.min_ngram, policy.max_ngram, policy.min_token_prob)
        accepted = common_prefix_len(draft, answer[done:])
        if policy.oracle:
            draft = draft[:accepted]
        if not draft:
            plain = min(k + 1 if policy.miss_tokens is None else policy.miss_tokens, remaining)
            out.forwards += plain
            done += plain
        else:
            out.forwards += 1
            out.drafted += len(draft)
            out.accepted += accepted
            done += accepted + 1
        plain = min(schedule.record(len(draft), accepted), len(answer) - done)  # a back-off's plain tokens
        out.forwards += plain
        done += plain
    return out


def replay_served(items: list[dict], proposer: PolicyProposer) -> Replay:
    """Count what the served engine's prompt lookup does over greedy answers (`greedy_answers`' items, in order):
    `proposer` (the repository's, `lookup_proposer`) is asked as LLMEngine asks it with one request running, at the
    K the served requests carry (the policy's num_draft_tokens: the spec's, as the BLS sends it, within the engine's
    max_draft_len) (pipeline.reference.engine: the gate `skips_step`, then `propose` with the committed tokens and K,
    then `update` after the verify of a non-empty draft, `release` when the request ends; one request after another, so
    the evidence carries over as it does in a server), and the answer says what the target accepts. Every engine
    step is one forward, the one that completes the prompt included (it verifies a draft of the prompt alone), and
    the step that produced the end token too (an answer that ended on its end_id), so plain decoding takes one forward
    per token counted."""
    out, k = Replay(), proposer.config.num_draft_tokens
    for number, item in enumerate(items):
        request_id, prompt = f"replay-{number}", item["prompt"]
        target = item["answer"] + ([item["end_id"]] if item["finish_reason"] == "end_id" else [])
        done = 0
        while done < len(target):
            draft: list[int] = []
            if not proposer.skips_step([request_id], [done]):
                [proposed] = proposer.propose([ProposalInput(request_id, prompt + target[:done], k,
                                                             max_new_tokens=item["max_tokens"], num_generated=done)])
                draft = proposed.token_ids[:k]
            accepted = common_prefix_len(draft, target[done:])
            if draft:
                proposer.update(request_id, accepted, len(draft))
            out.forwards += 1
            out.drafted += len(draft)
            out.accepted += accepted
            done = min(done + accepted + 1, len(target))
        out.tokens += len(target)
        proposer.release(request_id)
    return out


def policies(k: int, switch_off_below: float, min_ngram: int, max_ngram: int,
             min_token_prob: float) -> list[LookupPolicy]:
    """The BLS's served policy, the same without the cut and with fixed K, and the three that bound them (module
    docstring; the served engine's is its repository's own, `replay_served`)."""
    return [LookupPolicy(f"BLS rounds: K<={k} adaptive, cut below {min_token_prob:g}, a miss decodes K+1", k, None,
                         switch_off_below, True, min_ngram, max_ngram, min_token_prob),
            LookupPolicy(f"BLS rounds without the cut: K<={k} adaptive", k, None, switch_off_below, True, min_ngram, max_ngram),
            LookupPolicy(f"fixed K={k}, a miss decodes K+1", k, None, switch_off_below, False, min_ngram, max_ngram),
            LookupPolicy(f"every token: K={k}, a miss decodes 1", k, 1, switch_off_below, False, min_ngram, max_ngram),
            LookupPolicy(f"oracle: K={k} every token, drafts only what the target accepts (knows the answer)", k, 1,
                         0.0, False, min_ngram, max_ngram, oracle=True),
            LookupPolicy(f"ceiling: K={CEILING_K}, a miss decodes 1, no switch-off", CEILING_K, 1, 0.0, False,
                         min_ngram, max_ngram)]


def greedy_answers(engine_dir: Path, tokenizer_dir: Path, sets: list[str], max_tokens: int) -> dict[str, list[dict]]:
    """Each prompt set's prompts (as serving tokenizes them) and the engine's greedy answers, one request at a time:
    per set a list of {prompt, answer (without the end token), max_tokens, end_id, finish_reason}."""
    from clients.bench import PromptSet
    from clients.chat import ChatTemplate
    from pipeline.reference.engine import Request
    from pipeline.reference.sampling import SamplingParams
    from pipeline.serving.reference_adapter import load_serving_engine
    from pipeline.serving.text import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    template = ChatTemplate.from_tokenizer_dir(tokenizer_dir)
    engine = load_serving_engine(engine_dir)
    answers: dict[str, list[dict]] = {}
    for prompt_set in map(PromptSet.load, sets):
        name = prompt_set.name
        answers[name] = []
        for number, item in enumerate(prompt_set.items):
            text = template.render(item["messages"]) if "messages" in item else item["prompt"]
            prompt = tokenizer.encode(text, add_special_tokens=False)
            limit = item.get("max_tokens", max_tokens)
            engine.add_request(Request(f"{name}-{number}", prompt, limit,
                                       sampling=SamplingParams(end_id=tokenizer.eos_token_id)))
            answer, finish_reason = [], None
            while engine.has_unfinished():
                for output in engine.step():
                    answer += output.new_token_ids
                    finish_reason = output.finish_reason or finish_reason
            answers[name].append({"prompt": prompt, "answer": answer, "max_tokens": limit,
                                  "end_id": tokenizer.eos_token_id, "finish_reason": finish_reason})
        print(f"  {name}: {len(answers[name])} greedy answers, {sum(len(a['answer']) for a in answers[name])} tokens",
              flush=True)
    return answers


def evaluate(answers: dict[str, list[dict]], rules: list[LookupPolicy]) -> dict[str, dict[str, Replay]]:
    """policy name -> prompt set -> the replay's counts over the set's answers."""
    result: dict[str, dict[str, Replay]] = {}
    for policy in rules:
        result[policy.name] = {}
        for name, items in answers.items():
            total = Replay()
            for item in items:
                total.add(replay(item["prompt"], item["answer"], policy))
            result[policy.name][name] = total
    return result


def replay_repository(parameters: dict[str, str], engine_dir: Path,
                      answers: dict[str, list[dict]]) -> dict[str, dict[str, Replay]]:
    """The served engine's row: per prompt set, `replay_served` with a fresh policy built from the repository's
    tensorrt_llm parameters as the server builds it, at the K its requests carry (the policy's: the spec's, within
    the engine's max_draft_len)."""
    from pipeline.serving.reference_adapter import lookup_proposer

    max_draft_len = json.loads((engine_dir / "config.json").read_text())["build_config"]["max_draft_len"]
    k = lookup_proposer(parameters, max_draft_len).config.num_draft_tokens
    name = (f"the served engine: K<={k}, the repository's policy (costs, switch-off, classes, row cut), "
            f"cut below {float(parameters.get('ngram_min_token_prob', 0)):g}")
    return {name: {s: replay_served(items, lookup_proposer(parameters, max_draft_len))
                   for s, items in answers.items()}}


def render_markdown(result: dict[str, dict[str, Replay]], draft_token_cost: float, header: str) -> str:
    """One row per policy: per prompt set tokens per forward, acceptance and the estimate with cost c."""
    sets = list(next(iter(result.values())))
    lines = [header, "",
             "| policy | " + " | ".join(f"{s}: tokens/forward, acceptance, est. speedup" for s in sets) + " |",
             "|---|" + "---|" * len(sets)]
    for policy, by_set in result.items():
        cells = [f"{r.tokens_per_forward():.2f}, {r.accepted / r.drafted if r.drafted else 0:.0%}, "
                 f"{r.estimated_speedup(draft_token_cost):.2f}x" for r in by_set.values()]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    lines += ["", f"tokens/forward: the speedup if a verify forward cost one plain step (free verification and calls); "
              f"est. speedup: tokens / (forwards + c x drafted tokens) with c = {draft_token_cost:.2f} plain steps per "
              f"draft token, measured on the engine in this run.", ""]
    return "\n".join(lines)


def write_plot(result: dict[str, dict[str, Replay]], draft_token_cost: float, path: Path) -> Path:
    """Bars per prompt set: each policy's tokens per forward, and its estimated speedup as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(next(iter(result.values())))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(result)
    for i, (policy, by_set) in enumerate(result.items()):
        xs = [j + i * width for j in range(len(sets))]
        ax.bar(xs, [by_set[s].tokens_per_forward() for s in sets], width, label=policy)
        ax.plot(xs, [by_set[s].estimated_speedup(draft_token_cost) for s in sets], "k_", markersize=14)
    ax.axhline(1.5, color="grey", linestyle=":", linewidth=1)
    ax.set_xticks([j + width * (len(result) - 1) / 2 for j in range(len(sets))], sets)
    ax.set_ylabel("tokens per target forward (bars); est. speedup (marks)")
    ax.set_title(f"Prompt lookup on greedy answers (c = {draft_token_cost:.2f})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """Greedy answers, the measured draft-token cost, the replays; writes lookup.md, lookup.json and lookup.png."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, default=Path("out/default/engines/target"), help="target engine directory")
    p.add_argument("--tokenizer", type=Path, default=Path("models/SmolLM2-135M-Instruct"))
    p.add_argument("--prompts", default="chat,code,summarize", help="built-in prompt sets or JSONL files")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=5, help="draft tokens per round of the served policy")
    p.add_argument("--ngram", default="1,3", help="min_ngram,max_ngram of the lookup")
    p.add_argument("--min-token-prob", type=float, default=0.4,
                   help="the served lookup's cut (speculative.ngram.min_token_prob; examples/default.yaml's 0.4)")
    p.add_argument("--min-acceptance-rate", type=float, default=0.1,
                   help="the spec's switch-off floor (the bar is the larger of it and the measured cost)")
    p.add_argument("--repo", type=Path, help="a model repository (make repo) whose engine's own lookup policy is "
                   "replayed as well (the reference toolchain's: prompt lookup inside the engine)")
    p.add_argument("--out", type=Path, default=Path("out/bench-lookup"))
    args = p.parse_args(argv)
    try:
        min_ngram, max_ngram = (int(x) for x in args.ngram.split(","))
    except ValueError:
        p.error(f"--ngram {args.ngram!r}: give min_ngram,max_ngram, e.g. --ngram 1,3")
    if not args.engine.is_dir():
        p.error(f"--engine {args.engine}: no such engine directory (build it: make engines)")
    from pipeline.apps.bench_engine import served_lookup_parameters
    from pipeline.reference.step_cost import engine_draft_token_costs

    served = served_lookup_parameters(args.repo) if args.repo is not None else None

    print(f"greedy answers of {args.engine} (max {args.max_tokens} tokens) ...", flush=True)
    answers = greedy_answers(args.engine, args.tokenizer, args.prompts.split(","), args.max_tokens)
    (((_, cost),),) = engine_draft_token_costs(args.engine, None, (args.k,))
    print(f"measured cost of a draft token: {cost:.2f} plain steps (K={args.k}, batch 1)", flush=True)
    result = evaluate(answers, policies(args.k, max(args.min_acceptance_rate, cost), min_ngram, max_ngram,
                                        args.min_token_prob))
    if served is not None:
        result = {**replay_repository(served, args.engine, answers), **result}
    markdown = render_markdown(result, cost, f"# Prompt lookup on {args.engine}'s greedy answers (ngram {min_ngram}-{max_ngram})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lookup.md").write_text(markdown)
    (args.out / "lookup.json").write_text(json.dumps(
        {"draft_token_cost": cost, "policies": {policy: {s: vars(r) for s, r in by_set.items()}
                                                 for policy, by_set in result.items()}}, indent=1))
    write_plot(result, cost, args.out / "lookup.png")
    print(markdown)
    print(f"wrote {args.out}/lookup.md, lookup.json, lookup.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
