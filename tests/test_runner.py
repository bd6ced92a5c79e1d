"""EngineRunner: concurrent submitters batch in flight, cancel, bad input, failing steps, close."""

import queue
import threading
import time

import pytest

from pipeline.reference.engine import EngineConfig, EngineInputError, LLMEngine, Request, SamplingParams
from pipeline.reference.model import LlamaModel
from pipeline.reference.runner import EngineRunner
from tests.test_engine import prompts, run


@pytest.fixture(scope="module")
def model(tiny_llama):
    return LlamaModel.from_hf(tiny_llama)


def engine_for(model, proposer=None, engine_class=LLMEngine, **overrides) -> LLMEngine:
    return engine_class(model, EngineConfig(**{"tokens_per_block": 16, "batch_invariant": True, **overrides}), proposer)


def drain(q: queue.Queue, timeout: float = 60.0) -> tuple[list[int], str, str | None]:
    """Read one request's outputs until the final one: (tokens, finish_reason, error)."""
    tokens = []
    while True:
        out = q.get(timeout=timeout)
        tokens += out.new_token_ids
        if out.finished:
            return tokens, out.finish_reason, out.error


def test_concurrent_submitters_are_batched_and_exact(model):
    ps = prompts(6, seed=20)
    expected = run(engine_for(model), {0: [Request(str(i), p, max_new_tokens=12) for i, p in enumerate(ps)]})
    engine = engine_for(model)
    runner = EngineRunner(engine)
    results = {}

    def client(i):
        results[str(i)] = drain(runner.submit(Request(str(i), ps[i], max_new_tokens=12)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    runner.close()
    assert {k: v[0] for k, v in results.items()} == {k: v["tokens"] for k, v in expected.items()}
    assert all(reason == "length" for _, reason, _ in results.values())
    assert engine.stats.steps < 6 * 12  # requests shared steps


def test_cancel_bad_input_and_close(model):
    runner = EngineRunner(engine_for(model, max_input_len=64))
    long = runner.submit(Request("long", prompts(1, seed=21)[0], max_new_tokens=500))
    assert long.get(timeout=60).new_token_ids  # running
    with pytest.raises(EngineInputError, match="prompt_ids"):
        runner.submit(Request("bad", [], max_new_tokens=4))
    with pytest.raises(EngineInputError, match="request_id"):
        runner.submit(Request("long", [1, 2], max_new_tokens=4))
    assert runner.cancel("long") and not runner.cancel("nobody")
    assert drain(long)[1] == "cancelled"
    ok = drain(runner.submit(Request("ok", [1, 2, 3], max_new_tokens=3)))
    assert len(ok[0]) == 3 and ok[1] == "length"
    pending = runner.submit(Request("pending", [4, 5, 6], max_new_tokens=500))
    runner.close()
    assert drain(pending)[1] == "cancelled"
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit(Request("late", [1], max_new_tokens=1))


class FailsOnceEngine(LLMEngine):
    """An LLMEngine whose second step raises, as a failing forward would (a raising proposer no longer fails a step:
    tests/test_engine.py)."""

    steps_seen = 0

    def step(self):
        self.steps_seen += 1
        if self.steps_seen == 2:
            raise RuntimeError("forward crashed")
        return super().step()


def test_failing_step_errors_its_requests_and_runner_keeps_serving(model):
    runner = EngineRunner(engine_for(model, engine_class=FailsOnceEngine))
    first = runner.submit(Request("first", [1, 2, 3], max_new_tokens=5))
    tokens, reason, error = drain(first)
    assert reason == "error" and "forward crashed" in error
    second = drain(runner.submit(Request("second", [1, 2, 3], max_new_tokens=5)))
    assert second[1] == "length" and len(second[0]) == 5
    runner.close()


class BatchLog(LLMEngine):
    """An LLMEngine that records how many sequences each forward ran."""

    def _schedule(self):
        batch = super()._schedule()
        if batch:
            self.batches.append(len(batch))
        return batch


@pytest.mark.parametrize("chain, max_new, waits", [("a", 1, True), ("", 1, False), ("a", None, False)])
def test_only_a_chained_request_finished_at_its_length_holds_the_next_step(model, chain, max_new, waits):
    """A long request runs beside a short one. Where the short one is chained and ends at its length (a BLS round's
    end), the next step waits regather_s for its chain's next request, which never comes; an unchained request, or
    one that ends at end_id (its answer is over), holds nothing."""
    regather_s = 3.0
    runner = EngineRunner(engine_for(model), regather_s=regather_s)
    p = prompts(1, seed=5)[0]
    start = time.monotonic()
    long = runner.submit(Request("long", p, max_new_tokens=6))
    if max_new is None:  # ends at end_id: its first token
        first = drain(runner.submit(Request("probe", p, max_new_tokens=1)))[0]
        short = runner.submit(Request("short", p, max_new_tokens=4, sampling=SamplingParams(end_id=first[0])),
                              chain=chain)
    else:
        short = runner.submit(Request("short", p, max_new_tokens=max_new), chain=chain)
    assert drain(short)[1] == ("length" if max_new else "end_id")
    assert len(drain(long)[0]) == 6
    runner.close()
    assert (time.monotonic() - start >= regather_s) == waits


@pytest.mark.parametrize("regather_s", [0.0, 5.0])
def test_regathering_keeps_chained_requests_in_one_step(model, regather_s):
    """Four callers each run a chain of one-token requests, naming its chain, sending the next one 2-8 ms after the last
    finished (as the BLS does per round): with regathering the chains share every step once gathered (callers
    late for the first steps stay one request behind until they catch up); without it they spread over more
    steps. The tokens are the same either way."""
    engine = BatchLog(model, EngineConfig(tokens_per_block=16, batch_invariant=True))
    engine.batches = []
    runner = EngineRunner(engine, regather_s=regather_s)
    ps, results = prompts(4, seed=22), {}

    def chain(i):
        seq = list(ps[i])
        for r in range(6):
            seq += drain(runner.submit(Request(f"{i}-{r}", seq, max_new_tokens=1), chain=str(i)))[0]
            time.sleep(0.002 * (i + 1))
        results[i] = seq[len(ps[i]):]

    threads = [threading.Thread(target=chain, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    runner.close()
    alone = run(engine_for(model), {0: [Request(str(i), p, max_new_tokens=6) for i, p in enumerate(ps)]})
    assert results == {i: alone[str(i)]["tokens"] for i in range(4)}
    if regather_s:  # a loaded start may run 3 steps before the four chains gather; from then on they step together:
        assert 4 in engine.batches, engine.batches
        gathered = engine.batches.index(4)  # steps before all four ran together (CI on a Zen3 host: [1, 1, 3, 4, ...])
        # the first chain has 6 - gathered rounds left then, and all four share them
        assert gathered <= 3 and engine.batches[gathered:6].count(4) == 6 - gathered, engine.batches
        assert len(engine.batches) <= 6 + 3, engine.batches
    else:
        assert len(engine.batches) > 6 + 2
