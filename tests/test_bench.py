"""The serving benchmark against the real Triton server for a few seconds: every number present and consistent."""

import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from clients.bench import (BenchConfig, PromptSet, add_speedups, compare, recommend, run_bench, supported_ks,
                           write_report)
from clients.client import AsyncTritonClient, ClientError
from pipeline.server import free_ports

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 12  # >= min_new_tokens_for_speculation (8), short enough for the draft's 64-token limit
CONCURRENCY = [1, 2]
KS = [0, 2]


@pytest.fixture(scope="module")
def report(triton_server, tmp_path_factory):
    """One small sweep: 1 prompt set x C 1,2 x K 0,2, 2 requests per cell and repeat, 2 repeats (a few seconds)."""
    folder = tmp_path_factory.mktemp("bench")
    prompts = folder / "tiny.jsonl"
    prompts.write_text("\n".join(json.dumps(item) for item in (
        {"prompt": "The class statement creates"},
        {"prompt": "A function definition defines", "max_tokens": 10},
        {"messages": [{"role": "user", "content": "hello"}]},
    )) + "\n")
    cfg = BenchConfig(url=triton_server.grpc_url, prompt_sets=[str(prompts)], concurrency=CONCURRENCY, ks=KS,
                      requests_per_cell=2, repeats=2, max_tokens=MAX_TOKENS, metrics_url=triton_server.metrics_url)
    result = asyncio.run(run_bench(cfg, show_progress=False))
    paths = write_report(result, folder / "out")
    return result, paths


def cells(result, **match):
    return [c for c in result["cells"] if all(c[k] == v for k, v in match.items())]


def test_every_cell_ran_and_counts_add_up(report):
    result, _ = report
    assert [(c["concurrency"], c["k"]) for c in result["cells"]] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    for c in result["cells"]:
        assert c["prompt_set"] == "tiny" and c["errors"] == 0
        assert c["requests"] == len(c["records"]) == 2 * max(2, c["concurrency"])
        counted = [r["num_output_tokens"] for r in c["records"]]
        assert all(0 < n <= MAX_TOKENS for n in counted)
        assert c["output_tokens"] == sum(counted)  # tokens counted = tokens the server says it sent
        assert c["output_tokens_per_s"] == pytest.approx(c["output_tokens"] / c["wall_s"])
        # pooled over the repeats: each repeat's rate brackets the pooled one
        per_repeat = c["repeat_tokens_per_s"]
        assert len(per_repeat) == 2 and min(per_repeat) <= c["output_tokens_per_s"] * (1 + 1e-9)
        assert max(per_repeat) >= c["output_tokens_per_s"] * (1 - 1e-9)
        assert c["requests_per_s"] == pytest.approx(c["requests"] / c["wall_s"])
        assert c["responses"] >= c["requests"] and all(r["text_chars"] > 0 for r in c["records"])
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms"):
            p = c[metric]
            assert None not in p.values() and 0 < p["p50"] <= p["p90"] <= p["p99"], metric
        assert c["ttft_ms"]["p50"] <= c["latency_ms"]["p50"]


def test_the_load_average_is_read_before_every_cells_run_and_printed(report):
    result, paths = report
    loads = [s["load"] for s in result["schedule"]] + [result["load_at_end"]]
    assert len(loads) == 9 and all(isinstance(x, float) and x >= 0 for x in loads)
    markdown = next(p for p in paths if p.suffix == ".md").read_text()
    line = next(x for x in markdown.splitlines() if x.startswith("Load average"))
    assert f"median {statistics.median(loads[:-1]):.2f}, {min(loads[:-1]):.2f}-{max(loads[:-1]):.2f}" in line
    assert json.loads(next(p for p in paths if p.suffix == ".json").read_text())["schedule"][0]["load"] == loads[0]


def test_repeats_rotate_the_k_order_and_move_on_through_the_prompts(report):
    result, _ = report
    order = [(s["concurrency"], s["k"], s["repeat"]) for s in result["schedule"]]
    assert order == [(1, 0, 0), (1, 2, 0), (1, 2, 1), (1, 0, 1), (2, 0, 0), (2, 2, 0), (2, 2, 1), (2, 0, 1)]
    for c in result["cells"]:  # 3 prompts, 2 requests per repeat: prompts 0,1 then 2,0
        by_repeat = [sorted(r["prompt_index"] for r in c["records"] if r["repeat"] == i) for i in (0, 1)]
        assert by_repeat == [[0, 1], [0, 2]]
        ref = cells(result, k=0, concurrency=c["concurrency"])[0]
        assert c["repeat_speedups"] == pytest.approx([a / b for a, b in zip(c["repeat_tokens_per_s"], ref["repeat_tokens_per_s"])])


def test_speculation_off_cells(report):
    result, _ = report
    for c in cells(result, k=0):
        assert c["total_draft_tokens"] == 0 and c["acceptance_rate"] is None and c["speedup"] == 1.0
        assert c["server_draft_tokens"] == 0 and c["mean_accepted_length"] is None


def test_acceptance_matches_the_server_counters(report):
    result, _ = report
    for c in cells(result, k=2):
        drafted, accepted = c["total_draft_tokens"], c["total_accepted_draft_tokens"]
        assert drafted > 0 and c["acceptance_rate"] == pytest.approx(accepted / drafted)
        # per-request outputs summed by the client == the BLS's Prometheus counters over the cell
        assert (c["server_draft_tokens"], c["server_accepted_tokens"]) == (drafted, accepted)
        assert c["rounds_source"] == "server" and drafted <= 2 * c["rounds"]
        assert c["mean_accepted_length"] == pytest.approx(1 + accepted / c["rounds"])
        by_position = c["acceptance_by_position"]
        assert len(by_position) == 2 and 1 >= by_position[0] >= by_position[1] >= 0
        assert sum(by_position) * c["rounds"] == pytest.approx(accepted)  # each accepted token has one position
        assert c["speedup"] == pytest.approx(
            c["output_tokens_per_s"] / cells(result, k=0, concurrency=c["concurrency"])[0]["output_tokens_per_s"])


def test_speedup_splits_into_forwards_step_cost_and_busy_share(report):
    """The reference engines' counters split each cell's wall time: the target's steps and step() seconds, the
    draft's step() seconds; the three factors multiply back to the measured speedup."""
    result, paths = report
    for c in result["cells"]:
        assert c["target_steps"] > 0
        assert c["tokens_per_target_step"] == pytest.approx(c["output_tokens"] / c["target_steps"])
        assert c["target_step_ms"] > 0 and 0 < c["target_busy_share"] <= 1
        if c["concurrency"] == 1:  # one request at a time: the draft and the target never run together
            assert c["target_busy_share"] + c["draft_busy_share"] <= 1
            if c["k"] == 0:  # a step decodes one token (the prefill step too): never more tokens than steps
                assert c["tokens_per_target_step"] <= 1
        if c["k"] == 0:
            assert c["draft_busy_share"] == 0  # speculation off: the BLS never calls the draft
        else:
            assert c["draft_busy_share"] > 0
        f = c["speedup_factors"]
        assert f["forwards"] * f["step_cost"] * f["busy_share"] == pytest.approx(c["speedup"])
        if c["k"] and c["total_accepted_draft_tokens"] > 0 and c["concurrency"] == 1:
            assert f["forwards"] > 1  # accepted drafts: fewer target steps for the same tokens
    split = (paths[0].parent / "bench.md").read_text().split("## Where the time went")[1]
    for c in cells(result, k=2):
        f = c["speedup_factors"]
        assert f"{c['speedup']:.2f} = {f['forwards']:.2f} x {f['step_cost']:.2f} x {f['busy_share']:.2f}" in split


def test_speculation_is_lossless_in_the_bench(report):
    result, _ = report
    by_k = {k: {r["prompt_index"]: (r["num_output_tokens"], r["text_chars"]) for c in cells(result, k=k)
                for r in c["records"]} for k in KS}
    assert by_k[0] == by_k[2] and len(by_k[0]) == 3


def test_http_protocol_gives_the_same_tokens(report, triton_server):
    result, _ = report
    cfg = BenchConfig(**{**result["config"], "url": triton_server.http_url, "protocol": "http",
                         "concurrency": [2], "ks": [2]})
    http = asyncio.run(run_bench(cfg, show_progress=False))
    (cell,) = http["cells"]
    grpc_cell = cells(result, concurrency=2, k=2)[0]
    def tokens(c):
        return sorted((r["prompt_index"], r["num_output_tokens"], r["text_chars"]) for r in c["records"])

    assert cell["errors"] == 0 and tokens(cell) == tokens(grpc_cell)
    assert cell["total_draft_tokens"] == grpc_cell["total_draft_tokens"] == cell["server_draft_tokens"]


def test_report_files_and_recommendations(report):
    result, paths = report
    names = sorted(p.name for p in paths)
    assert names == ["acceptance_by_position.png", "bench.json", "bench.md", "latency_vs_concurrency.png",
                     "speedup_split.png", "speedup_vs_k.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    assert json.loads(paths[0].parent.joinpath("bench.json").read_text())["cells"] == json.loads(json.dumps(result["cells"]))
    markdown = paths[0].parent.joinpath("bench.md").read_text()
    # a row per cell in the results and in the time split, one per concurrency in the recommendations
    assert markdown.count("\n| tiny |") == 2 * len(result["cells"]) + len(CONCURRENCY)
    recs = result["recommendations"]
    assert [(r["prompt_set"], r["concurrency"]) for r in recs] == [("tiny", 1), ("tiny", 2)]
    for r in recs:
        best = max(cells(result, concurrency=r["concurrency"]), key=lambda c: c["output_tokens_per_s"])
        assert r["k"] == (best["k"] if best["speedup"] >= 1.02 else 0)


def test_compare_side_by_side(report, tmp_path):
    result, paths = report
    other = json.loads(json.dumps(result))
    for c in other["cells"]:
        c["output_tokens_per_s"] *= 2
    table = compare(result, other)
    rows = [line for line in table.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 4 and all("| 2.00 |" in row for row in rows)
    b = tmp_path / "b.json"
    b.write_text(json.dumps(other))
    out = subprocess.run([sys.executable, "-m", "clients.bench", "compare", str(paths[0].parent / "bench.json"), str(b)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.count("| tiny |") == 4


def test_ks_beyond_the_servers_max_draft_len_are_skipped(triton_server, capsys):
    async def check():
        async with AsyncTritonClient(triton_server.grpc_url) as client:
            return await supported_ks(client, [0, 2, 4, 5, 8])

    assert asyncio.run(check()) == [0, 2, 4]  # the fixture's engines have max_draft_len 4
    assert "skipping K=5,8" in capsys.readouterr().err


def test_bench_errors_are_one_line(tmp_path):
    (port,) = free_ports(1)
    out = subprocess.run([sys.executable, "-m", "clients.bench", "run", "--url", f"127.0.0.1:{port}", "--out",
                          str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 1 and out.stderr.startswith("error: cannot reach Triton") and out.stderr.count("\n") == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ClientError, match="bad.jsonl:1: needs a 'prompt' or 'messages' field"):
        PromptSet.load(str(bad))
    with pytest.raises(ClientError, match="neither a built-in set"):
        PromptSet.load("no-such-set")


def test_recommend_picks_the_fastest_k_that_beats_speculation_off():
    def cell(name, conc, k, tok_s):
        return {"prompt_set": name, "concurrency": conc, "k": k, "output_tokens_per_s": tok_s, "acceptance_rate": 0.5}

    grid = [cell("code", 1, 0, 10.0), cell("code", 1, 3, 14.0), cell("code", 1, 5, 12.0),
            cell("code", 8, 0, 40.0), cell("code", 8, 3, 40.5), cell("chat", 1, 0, 10.0), cell("chat", 1, 2, 8.0)]
    add_speedups(grid)
    recs = {(r["prompt_set"], r["concurrency"]): r for r in recommend(grid)}
    assert recs["code", 1]["k"] == 3 and recs["code", 1]["speedup"] == pytest.approx(1.4)
    assert recs["code", 8]["k"] == 0  # 1.0125x is inside the 2% margin
    assert recs["chat", 1]["k"] == 0 and "no K beat" in recs["chat", 1]["reason"]


def test_builtin_prompt_sets_load():
    for name in ("chat", "code", "summarize"):
        prompt_set = PromptSet.load(name)
        assert prompt_set.name == name and len(prompt_set.items) >= 8
        assert all(item["messages"][0]["content"] for item in prompt_set.items)
