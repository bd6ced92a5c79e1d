"""`make bench`: a load generator against the running Triton service, sweeping concurrency and K.

    python -m clients.bench run --url localhost:8001 --out out/bench            # default (small) sweep
    python -m clients.bench run --full                                          # concurrency 1,4,8,16 x K 0..8
    python -m clients.bench run --prompts my_prompts.jsonl --k 0,4 --concurrency 1,8
    python -m clients.bench compare out/bench/bench.json other/bench.json

For every prompt set x concurrency C x K (K = num_draft_tokens, 0 = speculation off) it runs a
closed loop of C streaming clients over the set's prompts and reports:
- TTFT (time to first streamed text), TPOT (time per output token after the first:
  (latency - TTFT) / (tokens - 1)), ITL (gaps between streamed responses; with speculation one
  response carries one round's tokens), end-to-end latency: mean, p50, p90, p99;
- output tokens/s and requests/s over the cell's wall time;
- acceptance rate (accepted / drafted tokens, from the per-request outputs), mean accepted length
  (tokens per verify round = 1 + accepted per round) and acceptance by draft position, both from
  the server's Prometheus counters (spec_decode_*) when the metrics endpoint answers;
- speedup = output tokens/s over the same prompt set and concurrency with K=0, and (on reference engines,
  whose counters say how many target steps ran and how long step() took) its split into tokens per target
  step, the cost of a target step and the share of wall time inside it.
Each (prompt set, concurrency) group's K cells run `repeats` times, the K order rotated every time
(0,2,5 then 2,5,0 ...), each repeat on the next prompts of the set, so load drift on a shared machine and
the order of cells hit every K alike; a cell pools its repeats (tokens over summed wall time) and also
keeps each repeat's output tokens/s and speedup, whose spread shows the noise and how much the repeats' prompts
differ (a speculative cell's repeats measure different prompts; the pooled value measures the set).
The machine's 1-minute load average is read before every cell's run (the schedule keeps it) and at the end, and
the report prints its median and range: on a shared host it says which cells ran on a busy machine.
It writes bench.json, bench.md (tables + the best K per prompt set and concurrency) and plots (speedup_split.png:
the three factors of each speedup).

Prompt sets are JSONL files, one request per line: {"prompt": "..."} (sent as is) or
{"messages": [{"role": "user", "content": "..."}]} (chat template applied), optionally
"max_tokens". Built-in sets: chat, code (code editing), summarize (summaries of a given text).
Before measuring, every prompt is sent once with max_tokens=1, so every cell sees the same warm
prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from clients.bench_args import (BUILTIN_SETS, DEFAULT_CONCURRENCY, DEFAULT_KS, DEFAULT_MAX_TOKENS, FULL_CONCURRENCY,
                                FULL_KS, add_run_arguments)
from clients.chat import ChatTemplate
from clients.client import AsyncTritonClient, ClientError, Completion, GenerateRequest, SamplingParams, tokenizer_dir_of

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
PERCENTILES = (50, 90, 99)
METRIC_RE = re.compile(r'^((?:spec_decode|reference_engine)_\w+?)(?:\{([^}]*)\})?\s+([0-9.eE+-]+)$')
# Counters of a reference engine model (its step count and seconds inside step()), labelled by model: the
# target's and the draft's, which split a cell's wall time into forwards and everything else.
ENGINE_STEPS_METRIC = "reference_engine_steps_total"
ENGINE_STEP_SECONDS_METRIC = "reference_engine_step_seconds_total"
TARGET_MODEL = "tensorrt_llm"
DRAFT_MODEL = "tensorrt_llm_draft"
SPEEDUP_MARGIN = 1.02  # a K must beat K=0 by this factor to be recommended


@dataclass
class BenchConfig:
    """What to run. Lists are swept as a grid."""

    url: str = "localhost:8001"
    protocol: str = "grpc"
    model: str = "ensemble"
    prompt_sets: list[str] = field(default_factory=lambda: list(BUILTIN_SETS))
    concurrency: list[int] = field(default_factory=lambda: list(DEFAULT_CONCURRENCY))
    ks: list[int] = field(default_factory=lambda: list(DEFAULT_KS))
    requests_per_cell: int = 4  # at least `concurrency` requests per cell and repeat
    repeats: int = 2  # sweeps of each group's K cells, the K order rotated each time
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    seed: int = 0
    metrics_url: str | None = None  # Triton's /metrics, for acceptance by position
    timeout_s: float = 300.0
    tokenizer: str | None = None  # chat template source (default: the server's tokenizer)


@dataclass
class PromptSet:
    """A named list of requests ({"prompt"} or {"messages"}, optional "max_tokens")."""

    name: str
    items: list[dict]

    @classmethod
    def load(cls, name_or_path: str) -> "PromptSet":
        """A built-in set by name, or a JSONL file."""
        path = PROMPTS_DIR / f"{name_or_path}.jsonl" if name_or_path in BUILTIN_SETS else Path(name_or_path)
        if not path.is_file():
            raise ClientError("invalid_request", f"prompt set '{name_or_path}' is neither a built-in set "
                              f"({', '.join(BUILTIN_SETS)}) nor a JSONL file")
        items = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ClientError("invalid_request", f"{path}:{number}: not JSON ({exc.msg})") from None
            if not isinstance(item, dict) or not ({"prompt", "messages"} & item.keys()):
                raise ClientError("invalid_request", f"{path}:{number}: needs a 'prompt' or 'messages' field")
            items.append(item)
        if not items:
            raise ClientError("invalid_request", f"{path}: no prompts")
        return cls(path.stem if name_or_path not in BUILTIN_SETS else name_or_path, items)

    def requests(self, template: ChatTemplate, max_tokens: int, k: int, sampling: SamplingParams) -> list[GenerateRequest]:
        """One GenerateRequest per item (chat items rendered with `template`)."""
        out = []
        for item in self.items:
            chat = "messages" in item
            prompt = template.render(item["messages"]) if chat else item["prompt"]
            out.append(GenerateRequest(prompt=prompt, max_tokens=int(item.get("max_tokens", max_tokens)),
                                       sampling=sampling, num_draft_tokens=k,
                                       stop_words=list(template.stop_words) if chat else []))
        return out


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean/p50/p90/p99 of `values` (seconds -> milliseconds by default); None when empty."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values) * scale
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def scrape_counters(url: str | None) -> dict[str, float] | None:
    """The server's counters this bench reads: spec_decode_* summed over models, keyed by name (+ '@position');
    reference_engine_* keyed by name + '@model'. None when the endpoint does not answer."""
    if url is None:
        return None
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return None
    counters: dict[str, float] = {}
    for line in text.splitlines():
        match = METRIC_RE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        label = r'model="([^"]*)"' if name.startswith("reference_engine_") else r'position="(\d+)"'
        qualifier = re.search(label, labels or "")
        key = f"{name}@{qualifier.group(1)}" if qualifier else name
        counters[key] = counters.get(key, 0.0) + float(value)
    return counters


def request_record(done: Completion) -> dict:
    """What the report keeps of one finished request."""
    gaps = np.diff(done.response_times_s).tolist() if len(done.response_times_s) > 1 else []
    n = done.num_output_tokens or 0
    return {"ttft_s": done.ttft_s, "latency_s": done.latency_s, "num_input_tokens": done.num_input_tokens,
            "num_output_tokens": done.num_output_tokens, "responses": len(done.response_times_s),
            "text_chars": len(done.text), "gaps_s": gaps,
            "tpot_s": (done.latency_s - done.ttft_s) / (n - 1) if n > 1 else None,
            "total_draft_tokens": done.total_draft_tokens,
            "total_accepted_draft_tokens": done.total_accepted_draft_tokens, "finish_reason": done.finish_reason}


def counter_delta(before: dict | None, after: dict | None) -> dict | None:
    """How much each counter grew between two scrapes (None if either failed)."""
    if before is None or after is None:
        return None
    return {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}


def summarize_cell(records: list[dict], errors: list[str], wall_s: float, k: int, delta: dict | None) -> dict:
    """Aggregate one (prompt set, concurrency, K) cell; `delta`: the server's counters' growth over it."""
    ok = [r for r in records if r["num_output_tokens"] is not None]
    tokens = sum(r["num_output_tokens"] for r in ok)
    drafted = sum(r["total_draft_tokens"] for r in ok)
    accepted = sum(r["total_accepted_draft_tokens"] for r in ok)
    cell = {
        "requests": len(records), "errors": len(errors), "error_samples": errors[:3], "wall_s": wall_s,
        "requests_per_s": len(records) / wall_s if wall_s else 0.0,
        "output_tokens": tokens, "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "input_tokens": sum(r["num_input_tokens"] or 0 for r in ok),
        "responses": sum(r["responses"] for r in records),
        "ttft_ms": percentiles([r["ttft_s"] for r in records]),
        "tpot_ms": percentiles([r["tpot_s"] for r in records if r["tpot_s"] is not None]),
        "itl_ms": percentiles([g for r in records for g in r["gaps_s"]]),
        "latency_ms": percentiles([r["latency_s"] for r in records]),
        "total_draft_tokens": drafted, "total_accepted_draft_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "rounds": None, "rounds_source": None, "accepted_per_round": None, "mean_accepted_length": None,
        "acceptance_by_position": None, "server_draft_tokens": None, "server_accepted_tokens": None,
        "target_steps": None, "tokens_per_target_step": None, "target_step_ms": None, "target_busy_share": None,
        "draft_busy_share": None,
    }
    if delta is not None:
        cell["server_draft_tokens"] = int(delta.get("spec_decode_draft_tokens_total", 0))
        cell["server_accepted_tokens"] = int(delta.get("spec_decode_accepted_tokens_total", 0))
        rounds = int(delta.get("spec_decode_rounds_total", 0))
        if rounds:
            cell["rounds"], cell["rounds_source"] = rounds, "server"
            cell["acceptance_by_position"] = [delta.get(f"spec_decode_accepted_tokens_per_position_total@{p}", 0.0)
                                              / rounds for p in range(1, k + 1)]
        add_time_split(cell, delta)
    if cell["rounds"] is None and drafted and k:
        # Without the server's counters: every round but a request's last drafts K tokens.
        cell["rounds"] = sum(math.ceil(r["total_draft_tokens"] / k) for r in ok)
        cell["rounds_source"] = "estimated"
    if cell["rounds"]:
        cell["accepted_per_round"] = accepted / cell["rounds"]
        cell["mean_accepted_length"] = 1.0 + cell["accepted_per_round"]
    cell["records"] = records
    return cell


def add_time_split(cell: dict, delta: dict) -> None:
    """Where a cell's wall time went, from the reference engines' counters (absent on other backends):
    output tokens/s = tokens per target step x steps per second of target step() x target step() share of wall,
    so a speedup over K=0 is the product of the three ratios (see speedup_factors)."""
    steps = delta.get(f"{ENGINE_STEPS_METRIC}@{TARGET_MODEL}")
    busy = delta.get(f"{ENGINE_STEP_SECONDS_METRIC}@{TARGET_MODEL}")
    if not steps or not busy or not cell["wall_s"]:
        return
    cell["target_steps"] = int(steps)
    cell["tokens_per_target_step"] = cell["output_tokens"] / steps
    cell["target_step_ms"] = 1000.0 * busy / steps
    cell["target_busy_share"] = busy / cell["wall_s"]
    cell["draft_busy_share"] = delta.get(f"{ENGINE_STEP_SECONDS_METRIC}@{DRAFT_MODEL}", 0.0) / cell["wall_s"]


def speedup_factors(cell: dict, base: dict) -> dict | None:
    """A cell's speedup over its K=0 cell split into three ratios whose product it is (None without the split):
    forwards: tokens per target step (acceptance and prompt-lookup hits); step_cost: how much cheaper a target
    step is (below 1: verify rows cost); busy_share: how much more of the wall the target's step() fills (below 1:
    draft forwards, orchestration and transport take the rest)."""
    if cell.get("tokens_per_target_step") is None or base.get("tokens_per_target_step") is None:
        return None
    return {"forwards": cell["tokens_per_target_step"] / base["tokens_per_target_step"],
            "step_cost": base["target_step_ms"] / cell["target_step_ms"],
            "busy_share": cell["target_busy_share"] / base["target_busy_share"]}


async def run_cell(client: AsyncTritonClient, requests: list[GenerateRequest], concurrency: int, count: int,
                   progress: tqdm, first: int = 0) -> tuple[list[dict], list[str], float]:
    """Send `count` requests (cycling through `requests` from index `first`) from `concurrency` streaming workers."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(first, first + count):
        queue.put_nowait(i)
    records, errors = [], []

    async def worker():
        while not queue.empty():
            i = queue.get_nowait()
            template = requests[i % len(requests)]
            request = GenerateRequest(**{**vars(template), "request_id": ""})
            try:
                records.append({"prompt_index": i % len(requests),
                                **request_record(await client.stream_completion(request))})
            except ClientError as exc:
                if exc.kind == "unavailable":
                    raise
                errors.append(str(exc))
            progress.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, errors, time.perf_counter() - start


async def supported_ks(client: AsyncTritonClient, ks: list[int]) -> list[int]:
    """The Ks the server accepts: those up to the BLS's max_draft_len (all of them when it is not readable)."""
    try:
        params = (await client.model_config("tensorrt_llm_bls")).get("parameters", {})
        limit = int(params["max_draft_len"]["string_value"])
    except (ClientError, KeyError, ValueError):
        return ks
    skipped = [k for k in ks if k > limit]
    if skipped:
        print(f"note: the server's max_draft_len is {limit}; skipping K={','.join(map(str, skipped))}", file=sys.stderr)
    return [k for k in ks if k <= limit]


async def warm_up(client: AsyncTritonClient, prompt_set: PromptSet, template: ChatTemplate,
                  sampling: SamplingParams) -> None:
    """Send every prompt once with max_tokens=1; a prompt the server refuses stops the bench here."""
    for number, request in enumerate(prompt_set.requests(template, 1, 0, sampling), 1):
        try:
            await client.generate(request)
        except ClientError as exc:
            raise ClientError(exc.kind, f"prompt set '{prompt_set.name}', prompt {number}: {exc}") from None


async def run_bench(cfg: BenchConfig, show_progress: bool = True) -> dict:
    """Run the whole sweep and return the report dict (see write_report)."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    sets = [PromptSet.load(name) for name in cfg.prompt_sets]
    client = AsyncTritonClient(cfg.url, cfg.protocol, cfg.model, timeout_s=cfg.timeout_s)
    try:
        await client.model_inputs()  # a down server or unknown model fails here, in one line
        if cfg.tokenizer:
            template = ChatTemplate.from_tokenizer_dir(cfg.tokenizer)
        else:
            directory = tokenizer_dir_of(await client.model_config("preprocessing"))
            template = ChatTemplate.from_tokenizer_dir(directory) if directory and Path(directory).is_dir() else ChatTemplate()
        ks = await supported_ks(client, cfg.ks)
        sampling = SamplingParams(temperature=cfg.temperature, seed=cfg.seed)
        counts = {c: max(cfg.requests_per_cell, c) for c in cfg.concurrency}
        total = len(sets) * len(ks) * sum(counts.values()) * cfg.repeats
        cells, schedule = [], []
        for prompt_set in sets:
            await warm_up(client, prompt_set, template, sampling)
        with tqdm(total=total, desc="bench", unit="req", disable=not show_progress, file=sys.stderr) as progress:
            for prompt_set in sets:
                for concurrency in cfg.concurrency:
                    runs: dict[int, list] = {k: [] for k in ks}  # k -> [(records, errors, wall, counter delta)]
                    for repeat in range(cfg.repeats):
                        for k in ks[repeat % len(ks):] + ks[:repeat % len(ks)]:
                            progress.set_description(f"{prompt_set.name} C={concurrency} K={k} repeat {repeat + 1}")
                            requests = prompt_set.requests(template, cfg.max_tokens, k, sampling)
                            before, load = scrape_counters(cfg.metrics_url), os.getloadavg()[0]
                            records, errors, wall = await run_cell(client, requests, concurrency, counts[concurrency],
                                                                   progress, first=repeat * counts[concurrency])
                            runs[k].append((records, errors, wall, counter_delta(before, scrape_counters(cfg.metrics_url))))
                            schedule.append({"prompt_set": prompt_set.name, "concurrency": concurrency, "k": k,
                                             "repeat": repeat, "load": load})
                    cells += [{"prompt_set": prompt_set.name, "concurrency": concurrency, "k": k, **pool_repeats(runs[k], k)}
                              for k in ks]
    finally:
        await client.close()
    add_speedups(cells)
    return {"config": asdict(cfg), "started": started, "schedule": schedule,
            "load_at_end": os.getloadavg()[0], "cells": cells, "recommendations": recommend(cells)}


def pool_repeats(runs: list[tuple[list[dict], list[str], float, dict | None]], k: int) -> dict:
    """One cell from its repeats: records and errors joined, wall times and server counters summed; each repeat's
    output tokens/s kept in `repeat_tokens_per_s`."""
    records = [dict(r, repeat=i) for i, run in enumerate(runs) for r in run[0]]
    deltas = [run[3] for run in runs]
    delta = None if None in deltas else {key: sum(d.get(key, 0.0) for d in deltas) for key in set().union(*deltas)}
    cell = summarize_cell(records, [e for run in runs for e in run[1]], sum(run[2] for run in runs), k, delta)
    cell["repeat_tokens_per_s"] = [sum(r["num_output_tokens"] or 0 for r in run[0]) / run[2] if run[2] else 0.0
                                   for run in runs]
    return cell


def add_speedups(cells: list[dict]) -> None:
    """speedup = output tokens/s over the K=0 cell of the same prompt set and concurrency (None without one);
    speedup_factors: its split (speedup_factors()); repeat_speedups: the same per repeat (the repeats of one
    group ran the same prompts)."""
    base = {(c["prompt_set"], c["concurrency"]): c for c in cells if c["k"] == 0}
    for c in cells:
        ref = base.get((c["prompt_set"], c["concurrency"]))
        c["speedup"] = c["output_tokens_per_s"] / ref["output_tokens_per_s"] if ref and ref["output_tokens_per_s"] else None
        c["speedup_factors"] = speedup_factors(c, ref) if ref else None
        c["repeat_speedups"] = ([x / y if y else None for x, y in zip(c.get("repeat_tokens_per_s", []), ref["repeat_tokens_per_s"])]
                                if ref and "repeat_tokens_per_s" in ref else None)


def recommend(cells: list[dict]) -> list[dict]:
    """The best K per prompt set and concurrency: the highest output tokens/s, if it beats K=0 by 2%."""
    out = []
    for key in sorted({(c["prompt_set"], c["concurrency"]) for c in cells}, key=lambda x: (x[0], x[1])):
        group = [c for c in cells if (c["prompt_set"], c["concurrency"]) == key]
        best = max(group, key=lambda c: c["output_tokens_per_s"])
        speculative = best["k"] > 0 and (best["speedup"] is None or best["speedup"] >= SPEEDUP_MARGIN)
        k = best["k"] if speculative else 0
        chosen = next(c for c in group if c["k"] == k) if any(c["k"] == k for c in group) else best
        why = (f"K={k}: {chosen['speedup']:.2f}x output tokens/s vs K=0" if speculative and chosen["speedup"]
               else f"K={k}: no K beat speculation off by {SPEEDUP_MARGIN - 1:.0%}" if k == 0
               else f"K={k}: fastest (no K=0 run to compare)")
        out.append({"prompt_set": key[0], "concurrency": key[1], "k": k, "speedup": chosen["speedup"],
                    "acceptance_rate": chosen["acceptance_rate"], "reason": why})
    return out


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _spread(values: list[float | None] | None) -> str:
    """' (1.10/1.21)': each repeat's value, when there is more than one."""
    return f" ({'/'.join(_fmt(v, '.2f') for v in values)})" if values and len(values) > 1 else ""


def _load_line(report: dict) -> list[str]:
    """This machine's 1-minute load average over the run, read before every cell's run and at the end (reports
    written before it was recorded have none)."""
    loads = [s["load"] for s in report.get("schedule", []) if "load" in s]
    if not loads:
        return []
    return [f"Load average (1 min, the machine running the benchmark) before each cell's run: median "
            f"{statistics.median(loads):.2f}, {min(loads):.2f}-{max(loads):.2f}; {report['load_at_end']:.2f} at the end."]


def render_markdown(report: dict) -> str:
    """The report as markdown: one row per cell, then the recommendations."""
    cfg = report["config"]
    lines = [f"# Serving benchmark ({report['started']})", "",
             f"Server {cfg['url']} ({cfg['protocol']}, model {cfg['model']}), max_tokens {cfg['max_tokens']}, "
             f"temperature {cfg['temperature']}, at least {cfg['requests_per_cell']} requests per cell and repeat, "
             f"{cfg.get('repeats', 1)} repeats in rotated K order (speedup: pooled, then each repeat's), streaming.",
             *_load_line(report), "",
             "| prompt set | C | K | req/s | out tok/s | speedup | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms "
             "| ITL p50/p99 ms | acceptance | accepted len | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in report["cells"]:
        t, p, i = c["ttft_ms"], c["tpot_ms"], c["itl_ms"]
        lines.append(
            f"| {c['prompt_set']} | {c['concurrency']} | {c['k']} | {c['requests_per_s']:.2f} "
            f"| {c['output_tokens_per_s']:.1f} | {_fmt(c['speedup'], '.2f')}{_spread(c.get('repeat_speedups'))} "
            f"| {_fmt(t['p50'], '.0f')}/{_fmt(t['p90'], '.0f')}/{_fmt(t['p99'], '.0f')} "
            f"| {_fmt(p['p50'])}/{_fmt(p['p90'])}/{_fmt(p['p99'])} | {_fmt(i['p50'])}/{_fmt(i['p99'])} "
            f"| {_fmt(c['acceptance_rate'], '.0%')} | {_fmt(c['mean_accepted_length'], '.2f')} | {c['errors']} |")
    split = [c for c in report["cells"] if c.get("target_steps")]
    if split:
        lines += ["", "## Where the time went (reference engines' counters)", "",
                  "| prompt set | C | K | target steps | tokens per step | ms per step | target step() share of wall "
                  "| draft step() share | speedup = forwards x step cost x busy share |", "|---|---|---|---|---|---|---|---|---|"]
        for c in split:
            f = c.get("speedup_factors")
            factors = (f"{_fmt(c['speedup'], '.2f')} = {f['forwards']:.2f} x {f['step_cost']:.2f} x {f['busy_share']:.2f}"
                       if f and c["k"] else "-")
            lines.append(f"| {c['prompt_set']} | {c['concurrency']} | {c['k']} | {c['target_steps']} "
                         f"| {c['tokens_per_target_step']:.2f} | {c['target_step_ms']:.1f} | {c['target_busy_share']:.0%} "
                         f"| {c['draft_busy_share']:.0%} | {factors} |")
        lines += ["", "forwards: tokens per target step over K=0's (what acceptance and lookup hits bring); step cost: "
                  "K=0's ms per target step over this cell's (below 1: the verify rows' cost); busy share: this cell's "
                  "share of wall time inside the target's step() over K=0's (below 1: draft forwards, orchestration "
                  "and transport)."]
    lines += ["", "## Recommended K", "", "| prompt set | C | K | speedup | acceptance | why |", "|---|---|---|---|---|---|"]
    for r in report["recommendations"]:
        lines.append(f"| {r['prompt_set']} | {r['concurrency']} | {r['k']} | {_fmt(r['speedup'], '.2f')} "
                     f"| {_fmt(r['acceptance_rate'], '.0%')} | {r['reason']} |")
    lines += ["", "speedup: output tokens/s vs K=0 at the same prompt set and concurrency. accepted len: tokens "
              "per verify round (1 + accepted draft tokens per round). TPOT: (latency - TTFT) / (tokens - 1). "
              "ITL: gaps between streamed responses.", ""]
    return "\n".join(lines)


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    """speedup_vs_k.png, acceptance_by_position.png, latency_vs_concurrency.png, and speedup_split.png when the
    server's engines reported their steps (reference engines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    sets = list(dict.fromkeys(c["prompt_set"] for c in cells))
    concurrencies = sorted({c["concurrency"] for c in cells})
    ks = sorted({c["k"] for c in cells})
    paths = []

    fig, axes = plt.subplots(1, len(sets), figsize=(4.5 * len(sets), 3.6), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], sets):
        for conc in concurrencies:
            pts = sorted((c["k"], c["speedup"]) for c in cells
                         if c["prompt_set"] == name and c["concurrency"] == conc and c["speedup"] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"C={conc}")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(title=name, xlabel="K (draft tokens per round)", ylabel="speedup vs K=0 (output tok/s)", xticks=ks)
        ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "speedup_vs_k.png"))

    fig, axes = plt.subplots(1, len(sets), figsize=(4.5 * len(sets), 3.6), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], sets):
        for k in ks:
            group = [c for c in cells if c["prompt_set"] == name and c["k"] == k and c["acceptance_by_position"]]
            rounds = sum(c["rounds"] for c in group)
            if k == 0 or not rounds:
                continue
            rates = [sum(c["acceptance_by_position"][p] * c["rounds"] for c in group) / rounds for p in range(k)]
            ax.plot(range(1, k + 1), rates, marker="o", label=f"K={k}")
        ax.set(title=name, xlabel="draft position", ylabel="accepted per round", ylim=(0, 1.05),
               xticks=range(1, max(ks) + 1))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "server reported no per-position counts", ha="center", transform=ax.transAxes)
    paths.append(_save(fig, out_dir / "acceptance_by_position.png"))

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, metric, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for k, color in zip(ks, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3):
            for p, style in zip(PERCENTILES, ("-", "--", ":")):
                ys = []
                for conc in concurrencies:
                    values = [r[metric] for c in cells if c["k"] == k and c["concurrency"] == conc
                              for r in c["records"] if r[metric] is not None]
                    ys.append(np.percentile(values, p) * 1000 if values else np.nan)
                ax.plot(concurrencies, ys, ls=style, color=color, marker="o", ms=3, label=f"K={k} p{p}")
        ax.set(title=f"{title} (all prompt sets)", xlabel="concurrency", ylabel="ms", xticks=concurrencies)
        ax.legend(fontsize=6, ncol=2)
    paths.append(_save(fig, out_dir / "latency_vs_concurrency.png"))

    split = [c for c in cells if c["k"] and c.get("speedup_factors")]
    if split:  # the reference engines' counters were there: each speedup as its three factors
        fig, axes = plt.subplots(1, len(sets), figsize=(4.5 * len(sets), 3.6), squeeze=False, sharey=True)
        factors = ("forwards", "step_cost", "busy_share")
        for ax, name in zip(axes[0], sets):
            group = [c for c in split if c["prompt_set"] == name]
            for i, factor in enumerate(factors):
                ax.bar([j + (i - 1) * 0.25 for j in range(len(group))], [c["speedup_factors"][factor] for c in group],
                       0.25, label=factor.replace("_", " "))
            ax.plot(range(len(group)), [c["speedup"] for c in group], "k_", markersize=18, mew=2, label="speedup")
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_xticks(range(len(group)), [f"C={c['concurrency']} K={c['k']}" for c in group], fontsize=7)
            ax.set(title=name, ylabel="factor vs K=0 (speedup = product)")
            ax.legend(fontsize=7)
        paths.append(_save(fig, out_dir / "speedup_split.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_report(report: dict, out_dir: Path) -> list[Path]:
    """bench.json, bench.md and the plots under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "bench.json", out_dir / "bench.md"
    json_path.write_text(json.dumps(report, indent=1))
    md_path.write_text(render_markdown(report))
    return [json_path, md_path, *write_plots(report, out_dir)]


def compare(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> str:
    """Two reports side by side (cells matched by prompt set, concurrency and K) as markdown."""
    index_b = {(c["prompt_set"], c["concurrency"], c["k"]): c for c in b["cells"]}
    na, nb = names
    lines = [f"A = {na}", f"B = {nb}", "",
             "| prompt set | C | K | out tok/s A | out tok/s B | B/A | TTFT p50 A | TTFT p50 B | TPOT p50 A "
             "| TPOT p50 B | acceptance A | acceptance B |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    matched = 0
    for ca in a["cells"]:
        key = (ca["prompt_set"], ca["concurrency"], ca["k"])
        cb = index_b.get(key)
        if cb is None:
            continue
        matched += 1
        ratio = cb["output_tokens_per_s"] / ca["output_tokens_per_s"] if ca["output_tokens_per_s"] else None
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {ca['output_tokens_per_s']:.1f} | {cb['output_tokens_per_s']:.1f} "
                     f"| {_fmt(ratio, '.2f')} | {_fmt(ca['ttft_ms']['p50'], '.0f')} | {_fmt(cb['ttft_ms']['p50'], '.0f')} "
                     f"| {_fmt(ca['tpot_ms']['p50'])} | {_fmt(cb['tpot_ms']['p50'])} "
                     f"| {_fmt(ca['acceptance_rate'], '.0%')} | {_fmt(cb['acceptance_rate'], '.0%')} |")
    only = len(a["cells"]) + len(b["cells"]) - 2 * matched
    if only:
        lines.append(f"\n{only} cells appear in only one report.")
    return "\n".join(lines) + "\n"


def config_from_args(args: argparse.Namespace, url: str, metrics_url: str | None) -> BenchConfig:
    """A BenchConfig from parsed `run` arguments."""
    return BenchConfig(url=url, protocol=args.protocol, model=args.model,
                       prompt_sets=[s.strip() for s in args.prompts.split(",") if s.strip()],
                       concurrency=args.concurrency or list(FULL_CONCURRENCY if args.full else DEFAULT_CONCURRENCY),
                       ks=args.k or list(FULL_KS if args.full else DEFAULT_KS), requests_per_cell=args.requests, repeats=args.repeats,
                       max_tokens=args.max_tokens, temperature=args.temperature, metrics_url=metrics_url,
                       timeout_s=args.timeout, tokenizer=args.tokenizer)


def run_and_report(cfg: BenchConfig, out_dir: Path) -> int:
    """Run, write the report, print where it is; one error line and exit 1 on failure."""
    try:
        report = asyncio.run(run_bench(cfg))
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    paths = write_report(report, out_dir)
    print(render_markdown(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m clients.bench run|compare ...`."""
    parser = argparse.ArgumentParser(prog="python -m clients.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the sweep against a running server")
    run.add_argument("--url", default="localhost:8001", help="Triton host:port (gRPC 8001 / HTTP 8000)")
    run.add_argument("--metrics-url", default=None,
                     help="Triton metrics endpoint (default http://<host>:8002/metrics)")
    add_run_arguments(run)
    cmp_ = sub.add_parser("compare", help="show two bench.json reports side by side")
    cmp_.add_argument("a", type=Path)
    cmp_.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "compare":
        try:
            a, b = (json.loads(p.read_text()) for p in (args.a, args.b))
        except (OSError, json.JSONDecodeError) as exc:
            print(f"error: cannot read report: {exc}", file=sys.stderr)
            return 1
        print(compare(a, b, (str(args.a), str(args.b))))
        return 0
    metrics_url = args.metrics_url or f"http://{args.url.rsplit(':', 1)[0]}:8002/metrics"
    return run_and_report(config_from_args(args, args.url, metrics_url), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
