"""Prometheus metrics of the speculative BLS, through Triton's custom metrics API (pb_utils.MetricFamily).

Modelled on vLLM's spec_decode metrics, labelled by model. The MetricFamily objects are kept on
the instance: a family that is garbage-collected makes every later update fail.
"""

from __future__ import annotations

import time

import triton_python_backend_utils as pb_utils

from pipeline.names import (ACCEPTANCE_LENGTH_METRIC, ACCEPTED_PER_POSITION_METRIC, ACCEPTED_TOKENS_METRIC,
                            DRAFT_TOKENS_METRIC, ENGINE_STEP_SECONDS_METRIC, ENGINE_STEPS_METRIC, FALLBACKS_METRIC,
                            IN_FLIGHT_METRIC, METRICS_FLUSH_S, MODEL_UP_METRIC, ROUNDS_METRIC)
from pipeline.spec_stats import SpecStats


class SpecMetrics:
    """Counters, the acceptance-length histogram, whether each called model is up and the requests in flight,
    for one model (implements bls.SpecMetricsSink)."""

    def __init__(self, model: str, max_draft_len: int, callees: list[str]):
        labels = {"model": model}
        counter, histogram = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.HISTOGRAM
        gauge = pb_utils.MetricFamily.GAUGE
        self.families = {
            DRAFT_TOKENS_METRIC: pb_utils.MetricFamily(DRAFT_TOKENS_METRIC, "Draft tokens proposed for verification", counter),
            ACCEPTED_TOKENS_METRIC: pb_utils.MetricFamily(ACCEPTED_TOKENS_METRIC, "Draft tokens the target accepted", counter),
            ACCEPTED_PER_POSITION_METRIC: pb_utils.MetricFamily(
                ACCEPTED_PER_POSITION_METRIC, "Draft tokens accepted at each draft position (1-based)", counter),
            ACCEPTANCE_LENGTH_METRIC: pb_utils.MetricFamily(
                ACCEPTANCE_LENGTH_METRIC, "Accepted draft tokens per speculative round", histogram),
            ROUNDS_METRIC: pb_utils.MetricFamily(ROUNDS_METRIC, "Speculative rounds (propose + verify)", counter),
            FALLBACKS_METRIC: pb_utils.MetricFamily(
                FALLBACKS_METRIC, "Requests that fell back to the target alone after a draft failure", counter),
            MODEL_UP_METRIC: pb_utils.MetricFamily(
                MODEL_UP_METRIC, "1 while the model this BLS calls (callee) answers, 0 once its stub died", gauge),
            IN_FLIGHT_METRIC: pb_utils.MetricFamily(IN_FLIGHT_METRIC, "Requests this model is serving now", gauge),
        }
        self.draft_tokens = self.families[DRAFT_TOKENS_METRIC].Metric(labels=labels)
        self.accepted_tokens = self.families[ACCEPTED_TOKENS_METRIC].Metric(labels=labels)
        self.rounds = self.families[ROUNDS_METRIC].Metric(labels=labels)
        self.fallbacks = self.families[FALLBACKS_METRIC].Metric(labels=labels)
        self.model_up = {callee: self.families[MODEL_UP_METRIC].Metric(labels={**labels, "callee": callee})
                         for callee in callees}
        for metric in self.model_up.values():
            metric.set(1)
        self.in_flight = self.families[IN_FLIGHT_METRIC].Metric(labels=labels)
        buckets = [float(b) for b in range(max(max_draft_len, 1) + 1)]
        self.acceptance_length = self.families[ACCEPTANCE_LENGTH_METRIC].Metric(labels=labels, buckets=buckets)
        self.per_position = [self.families[ACCEPTED_PER_POSITION_METRIC].Metric(labels={**labels, "position": str(i + 1)})
                             for i in range(max(max_draft_len, 1))]
        # speculation not sent yet (`round`, `speculated`): totals, and each round's accepted tokens for the histogram
        self._unsent, self._lengths, self._sent = SpecStats(), [], time.monotonic()

    def round(self, proposed: int, accepted: int) -> None:
        """Count one verified round, sent with the others within METRICS_FLUSH_S or when no request is in flight
        (`set_in_flight`): each update is a round trip to the server process, made in the BLS's event loop, and a
        round's 4 + accepted of them held every request of this instance."""
        self._unsent.record_step(proposed, proposed, accepted, accepted + 1)
        self._lengths.append(accepted)
        if time.monotonic() - self._sent >= METRICS_FLUSH_S:
            self.flush()

    def set_in_flight(self, requests: int) -> None:
        """Set the requests-in-flight gauge; with none left, send the rounds counted (before the last request's
        final response, which the BLS sends on the event loop's next turn)."""
        self.in_flight.set(requests)
        if requests == 0:
            self.flush()

    def speculated(self, stats: SpecStats) -> None:
        """Count a reference engine's finished request's speculation (its rounds are the steps that verified a draft;
        totals, so the acceptance-length histogram stays), sent with the engine's counters (EngineMetrics.flush)."""
        self._unsent.add(stats)

    def flush(self) -> None:
        """Send the speculation counted since the last flush (each update a round trip: zero counts are not sent)."""
        if self._unsent.spec_steps:
            self.rounds.increment(self._unsent.spec_steps)
            self.draft_tokens.increment(self._unsent.draft_tokens)
            self.accepted_tokens.increment(self._unsent.accepted_tokens)
            for counter, accepted in zip(self.per_position, self._unsent.accepted_by_position):
                if accepted:
                    counter.increment(accepted)
            for accepted in self._lengths:
                self.acceptance_length.observe(accepted)
        self._unsent, self._lengths, self._sent = SpecStats(), [], time.monotonic()

    def count(self, counts) -> None:
        """Add speculation counted elsewhere (iteration_stats.SpecDecodeCounts: the LLM API's iteration stats,
        which carry totals, not single rounds: the acceptance-length histogram and per-position counters stay)."""
        self.rounds.increment(counts.rounds)
        self.draft_tokens.increment(counts.drafted)
        self.accepted_tokens.increment(counts.accepted)

    def fallback(self) -> None:
        """Count a request that lost its draft model."""
        self.fallbacks.increment(1)

    def down(self, callee: str) -> None:
        """Record that a called model is down."""
        self.model_up[callee].set(0)


class EngineMetrics:
    """Busy time of a reference engine (seconds inside step()), its step count and, for an engine that drafts itself,
    its finished requests' speculation (`spec`), labelled by model.

    Every update of a Triton metric is a round trip to the server process, made on the engine's thread: the two
    updates of each step took about 0.4 ms each under `make bench`'s code prompts, a tenth of the step's time on top
    of it (py-spy on the served model's process; docs/benchmarks.md), and a finished request's speculation 3 + K more.
    So they are summed here and sent at most every METRICS_FLUSH_S while the engine works, and whenever it goes
    idle (`flush`, before the outputs of its last step reach their clients: a client that got its answer reads
    counters that include it)."""

    def __init__(self, model: str, spec: SpecMetrics | None = None):
        labels = {"model": model}
        counter = pb_utils.MetricFamily.COUNTER
        self.families = [pb_utils.MetricFamily(ENGINE_STEP_SECONDS_METRIC, "Seconds the reference engine spent in step()", counter),
                         pb_utils.MetricFamily(ENGINE_STEPS_METRIC, "Scheduler steps of the reference engine", counter)]
        self.seconds = self.families[0].Metric(labels=labels)
        self.steps = self.families[1].Metric(labels=labels)
        self.spec = spec  # its finished requests' speculation (SpecMetrics.speculated), sent with the steps
        self._seconds, self._steps, self._sent = 0.0, 0, time.monotonic()  # not sent yet

    def step(self, seconds: float) -> None:
        """Count one step (sent with the others within METRICS_FLUSH_S)."""
        self._seconds += seconds
        self._steps += 1
        if time.monotonic() - self._sent >= METRICS_FLUSH_S:
            self.flush()

    def flush(self) -> None:
        """Send what was counted since the last flush."""
        if self._steps:
            self.seconds.increment(self._seconds)
            self.steps.increment(self._steps)
        if self.spec is not None:
            self.spec.flush()
        self._seconds, self._steps, self._sent = 0.0, 0, time.monotonic()
