"""`make demo` end to end on the tiny exact pair: a real Triton server, streamed runs, the median speedup."""

import socket

import pytest

from pipeline.apps.demo import DEMO_PROMPTS, run_demo
from pipeline.spec import load_spec
from tests.triton_fixtures import write_spec


def test_demo_times_alternating_pairs_and_stops_the_server(tmp_path, exact_pair):
    target, draft = exact_pair
    spec = load_spec(write_spec(tmp_path, target, draft, **{"engine.max_input_len": 200, "engine.max_seq_len": 320}))
    lines = []
    results = run_demo(spec, log=lines.append, repeats=2)

    assert [r.question for r in results] == DEMO_PROMPTS
    for result in results:
        assert len(result.pairs) == 2
        assert result.identical  # greedy: speculation changes the speed, never the text
        for plain, speculative in result.pairs:
            assert plain.total_draft_tokens == 0
            # the exact pair's draft is the target, but the draft engine runs its output layer on 16-bit weights
            # (linear.draft_output_layer), whose near ties on this random model can fall the other way: 71 of 74
            # accepted where that layer is bf16 (AMD Zen4), every one where it is fp16 (Zen3)
            assert speculative.total_draft_tokens > 0
            assert speculative.total_accepted_draft_tokens >= 0.9 * speculative.total_draft_tokens
        assert sorted(result.ratios)[0] <= result.speedup <= sorted(result.ratios)[-1]
    summary = lines[-1].strip()
    assert summary.startswith("summary: acceptance") and "identical text: yes" in summary
    assert "server stopped" in summary
    grpc_port = int(next(line for line in lines if line.startswith("Triton ready")).split(":")[2].split()[0])
    with pytest.raises(ConnectionRefusedError):  # the demo's server is gone: nothing listens on its port
        socket.create_connection(("127.0.0.1", grpc_port), timeout=5)
