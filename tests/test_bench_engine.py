"""`make bench-engine`'s speedups (pipeline/apps/bench_engine.py): each round's run against the same round's plain run.

On the shared development machines the speed moves 1.5x within minutes; a ratio of two best-of-rounds numbers can
pair a quiet minute with a loaded one. The served lookup's parameters come from an assembled repository.
"""

import pathlib
import subprocess

import pytest

from pipeline.apps.bench_engine import (Rates, goals, paired_speedup, render_markdown, run_rounds,
                                       served_lookup_parameters, speedups)


def test_a_run_as_fast_as_its_rounds_plain_run_is_1x_whatever_the_machine_did():
    plain = [100.0, 160.0, 120.0]  # the machine got faster in round 2
    spec = [100.0, 150.0, 120.0]  # never faster than plain in its own round
    assert max(spec) / max(plain) < 1.0  # best over best: 0.94
    assert paired_speedup(spec, plain) == (1.0, 150.0 / 160.0, 1.0)
    quiet_spec = [160.0, 100.0, 120.0]  # the speculative run caught the quiet minute instead
    assert max(quiet_spec) / max(plain) == 1.0 and paired_speedup(quiet_spec, plain)[0] == 1.0
    assert paired_speedup([160.0, 100.0, 121.0], plain)[0] > 1.0


def test_goals_against_our_plain_use_the_paired_speedup_and_show_the_rounds():
    def row(method, tok_s, speedup=None, k=0, batch=1, decode=1.0):
        r = {"pair": "smollm2-ngram", "engine": "ours", "method": method, "batch": batch, "k": k, "tok_s": tok_s,
             "cpu_tok_s": tok_s}
        if speedup is not None:
            r.update(speedup_vs_our_plain=speedup[0], speedup_range=list(speedup[1:]),
                     cpu_speedup_vs_our_plain=speedup[0], decode_speedup_vs_our_plain=decode,
                     decode_speedup_range=[decode, decode])
        return r

    rows = [row("plain", 160.0, (1.0, 1.0, 1.0)), row("ngram", 150.0, (1.7, 1.6, 1.9), k=4, decode=2.1),
            {"pair": "smollm2-ngram", "engine": "transformers", "method": "generate", "batch": 1, "k": 0, "tok_s": 20.0}]
    speedups(rows)
    assert rows[2]["speedup_vs_our_plain"] == 0.125  # transformers: its tok/s over our plain's
    [(goal, text, met)] = [g for g in goals(rows) if g[0].startswith("smollm2-ngram: n-gram >= 1.6x")]
    assert met and text.startswith("1.70x (K=4), rounds 1.60-1.90")  # not 150 / 160
    assert text.endswith("; decode steps 2.10x")  # the prompts' prefill left out: shown, not judged


def test_the_roofline_goal_pairs_each_plain_run_with_the_bandwidth_read_before_it():
    """The bandwidth probe moved 26-61 GB/s within an hour on these machines: best over best could pair a quiet
    read with a loaded run. The share is each round's plain tok/s over that round's roofline, median over rounds."""
    plain_runs, rooflines = [150.0, 100.0, 120.0], [200.0, 400.0, 160.0]  # round 2: a fast read, a slow run
    share, low, high = paired_speedup(plain_runs, rooflines)
    assert (share, low, high) == (0.75, 0.25, 0.75) and max(plain_runs) / max(rooflines) == 0.375
    rows = [{"pair": "smollm2-draft", "engine": "ours", "method": "plain", "batch": 1, "k": 0, "tok_s": 150.0,
             "speedup_vs_our_plain": 1.0, "speedup_range": [1.0, 1.0], "cpu_speedup_vs_our_plain": 1.0},
            {"pair": "smollm2-draft", "engine": "roofline", "method": "weights/bandwidth", "batch": 1, "k": 0,
             "tok_s": 200.0, "plain_share": share, "plain_share_range": [low, high]}]
    speedups(rows)
    [(_, text, met)] = [g for g in goals(rows) if "of the roofline" in g[0]]
    assert met and text.startswith("0.75, rounds 0.25-0.75")


def scheduled_rounds(plain_before_each: bool):
    """run_rounds over plain and speculative jobs at two batch sizes, each run returning its own call number as its
    tok/s (so every run is told apart) -> (Rounds, the calls in order as (batch, speculative))."""
    calls = []

    def run(batch, prompts, proposer):
        calls.append((batch, proposer() is not None))
        return Rates(float(len(calls)), len(calls) + 0.5, len(calls) + 0.25), {"run": len(calls)}

    spec = lambda: object()  # noqa: E731 - a stand-in proposer factory
    jobs = [("plain", 1, 0, [], lambda: None), ("draft", 1, 2, [], spec), ("draft", 1, 4, [], spec),
            ("plain", 8, 0, [], lambda: None), ("draft", 8, 2, [], spec)]
    loads = iter([0.5, 1.5])
    return run_rounds(jobs, 2, run, plain_before_each, read_bandwidth=lambda: 1.0, read_load=lambda: next(loads)), calls


def test_each_speculative_run_pairs_with_the_plain_run_right_before_it_where_asked():
    rounds, calls = scheduled_rounds(plain_before_each=True)
    assert len(calls) == 2 * (2 + 2 * 3)  # per round: 2 plain jobs, 3 speculative ones with a plain run each
    for i in (1, 2, 4):
        for r in range(2):
            run = int(rounds.runs[i][r].wall)
            assert calls[run - 1][1] and calls[run - 2] == (calls[run - 1][0], False)  # a plain run of its batch first
            assert rounds.baselines[i][r] == (run - 1, run - 0.5, run - 0.75)
    assert rounds.baselines[0] == rounds.runs[0] and rounds.bandwidths == [1.0, 1.0]
    assert rounds.loads == [0.5, 1.5]  # read with each round's bandwidth
    assert rounds.summaries[4] == {"run": int(rounds.runs[4][1].wall)}  # the last round's


def test_otherwise_a_speculative_run_pairs_with_its_rounds_plain_run_of_its_batch():
    rounds, calls = scheduled_rounds(plain_before_each=False)
    assert len(calls) == 2 * 5
    assert rounds.baselines[1] == rounds.baselines[2] == rounds.runs[0]  # batch 1: the round's first run
    assert rounds.baselines[4] == rounds.runs[3]  # batch 8's plain run


def test_the_served_lookup_comes_from_a_repository_whose_engine_runs_prompt_lookup(tmp_path, capsys):
    config = tmp_path / "tensorrt_llm" / "config.pbtxt"
    config.parent.mkdir()
    with pytest.raises(SystemExit, match="no .*config.pbtxt; assemble the repository with `make repo`"):
        served_lookup_parameters(tmp_path)
    param = 'parameters {{ key: "{}" value {{ string_value: "{}" }} }}\n'
    config.write_text('name: "tensorrt_llm"\n' + param.format("speculative_mode", "draft_model"))
    assert served_lookup_parameters(tmp_path) is None  # the rest of the benchmark runs
    assert "speculative_mode 'draft_model'): the served lookup is not measured" in capsys.readouterr().err
    config.write_text('name: "tensorrt_llm"\n' + param.format("speculative_mode", "ngram")
                      + param.format("num_draft_tokens", "5"))
    assert served_lookup_parameters(tmp_path) == {"speculative_mode": "ngram", "num_draft_tokens": "5"}


def test_the_report_prints_the_load_average_read_with_each_bandwidth():
    roofline = {"pair": "smollm2-draft", "engine": "roofline", "method": "weights/bandwidth", "batch": 1, "k": 0,
                "tok_s": 200.0, "speedup_vs_our_plain": 1.3, "bandwidth_gbs": 35.0, "bandwidth_range": [34.0, 60.0],
                "load_average": 1.25, "load_range": [0.5, 2.0]}
    result = {"date": "2026-12-05 16:00 UTC", "dtype": "float32", "threads": 2, "seconds": 1.0,
              "command": "python -m pipeline.apps.bench_engine", "goals": [], "rows": [roofline]}
    header = render_markdown(result).splitlines()[0]
    assert "read bandwidth GB/s" in header and "smollm2-draft 35.0 (34.0-60.0)" in header
    assert "1-minute load average (median and range, read with them): smollm2-draft 1.25 (0.50-2.00)" in header
    assert "Command: `python -m pipeline.apps.bench_engine` (`make bench-engine` builds the engines" in header


def test_make_bench_engine_builds_the_default_engines_before_it_assembles_their_repository():
    """On a fresh checkout `pipeline repo` refuses a spec whose engines were not built (it names `make engines`)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    commands = subprocess.run(["make", "-n", "bench-engine"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.splitlines()
    step = {c.split(" -m pipeline ")[1].split()[0]: i for i, c in enumerate(commands)
            if " -m pipeline " in c and "examples/default.yaml" in c}
    assert step.get("engines", len(commands)) < step["repo"], commands


def test_the_decode_rate_leaves_out_the_steps_until_every_prompt_has_its_first_token(monkeypatch, tiny_llama):
    """A run's `decode` rate counts the tokens after the step that gave the last prompt its first token, over the time
    after it; `wall` counts every token over the whole run. A clock that only engine steps move: the prompts' step
    takes 100 s, every later step 1 s."""
    from pipeline.apps import bench_engine
    from pipeline.reference.model import LlamaModel

    now = [0.0]

    class TimedEngine(bench_engine.LLMEngine):
        def step(self):
            now[0] += 1.0 if now[0] else 100.0
            return super().step()

    monkeypatch.setattr(bench_engine, "LLMEngine", TimedEngine)
    monkeypatch.setattr(bench_engine.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(bench_engine, "NEW_TOKENS", 8)
    rates, stats = bench_engine.run_ours(LlamaModel.from_hf(tiny_llama), [[1, 2, 3, 4, 5], [6, 7, 8]])
    # both prompts prefill in the first step (1 token each), then 7 steps of 2 tokens
    assert rates.wall == 16 / 107 and rates.decode == 14 / 7
