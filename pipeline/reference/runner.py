"""EngineRunner: one background thread owns an LLMEngine and steps it while work exists.

Callers on any thread `submit` requests and read `RequestOutput`s from a per-request queue; the
request joins the running batch at the next step (in-flight batching across callers). Bad input
raises EngineInputError from `submit` itself. If a step raises, the requests in that step get a
final output with finish_reason "error" and the runner keeps serving the others.

Regathering (`regather_s`): a caller that runs its work as a chain of short requests (the BLS: one
request per speculative round or plain chunk) sends the next one a few milliseconds after the last
finished. Stepping at once would run the requests that are back without those still on their way,
and the chains would stay split over two steps from then on (measured: 2.5 sequences per step instead
of 3.6 with 4 BLS requests in flight). So a caller names each request's chain (`submit`'s chain: the
BLS's calls for one client request), and a chained request that a step finished at its length (a
round's end; not at end_id, a stop word, a cancel or an error) leaves a debt that its chain's next
request pays. The next step waits while a debt younger than regather_s is unpaid. Waiting instead for
as many arrivals as the last step finished counted other chains' requests: a new chain's first
request, or one back late from an earlier step, took the place of one still on its way, and under
load the slowest chain stayed one step behind for good (4 chains on a busy host: steps of 1, 1, 3, 3,
3, ... sequences in 2 of 8 runs).
"""

from __future__ import annotations

import queue
import threading
import time

from pipeline.reference.engine import EngineInputError, LLMEngine, Request, RequestOutput


class EngineRunner:
    """Thread-safe front of an LLMEngine (see the module docstring). Only the runner thread touches the engine."""

    def __init__(self, engine: LLMEngine, regather_s: float = 0.0):
        self.engine = engine
        self.regather_s = regather_s  # see the module docstring; 0 = step at once
        self._queues: dict[str, queue.Queue[RequestOutput]] = {}  # unfinished requests
        self._inbox: list[Request] = []
        self._chains: dict[str, str] = {}  # unfinished chained request id -> its chain
        self._debts: dict[str, float] = {}  # chain -> when its unpaid debt was made, oldest first (module docstring)
        self._cancels: list[str] = []
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="engine-runner", daemon=True)
        self._thread.start()

    def submit(self, request: Request, chain: str = "") -> queue.Queue[RequestOutput]:
        """Queue a request; returns the queue its outputs arrive on (the last one has finished=True). chain: the
        caller's chain of requests it continues and may be continued in ("": none; not kept with regather_s 0; see
        the module docstring).

        Raises EngineInputError for bad input, RuntimeError once closed.
        """
        self.engine.validate(request)
        out: queue.Queue[RequestOutput] = queue.Queue()
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine runner is closed")
            if request.request_id in self._queues:
                raise EngineInputError("request_id", f"{request.request_id!r} is already running; use a unique id")
            self._queues[request.request_id] = out
            self._inbox.append(request)
            if chain and self.regather_s:
                self._chains[request.request_id] = chain
                self._debts.pop(chain, None)  # paid
            self._cond.notify()
        return out

    def cancel(self, request_id: str) -> bool:
        """Cancel a request (its queue gets a final "cancelled" output); False if it is unknown or done."""
        with self._cond:
            if request_id not in self._queues:
                return False
            self._cancels.append(request_id)
            self._cond.notify()
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread after the current step; unfinished requests get a final "cancelled" output."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _unpaid_for(self) -> float:
        """Seconds until the youngest unpaid regathering debt expires (0: none is unpaid), expired ones dropped;
        called holding the lock."""
        now = time.monotonic()
        for chain, made in list(self._debts.items()):  # oldest first
            if made + self.regather_s > now:
                break
            del self._debts[chain]
        return next(reversed(self._debts.values())) + self.regather_s - now if self._debts else 0.0

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._inbox or self._cancels or self.engine.has_unfinished()):
                    self._cond.wait()
                while not self._closed and (unpaid_for := self._unpaid_for()) > 0:
                    self._cond.wait(unpaid_for)
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                closed = self._closed
                if closed:
                    cancels += [rid for rid in self._queues if rid not in cancels]
            outputs: list[RequestOutput] = []
            for request in inbox:
                try:
                    self.engine.add_request(request)
                except EngineInputError as exc:
                    outputs.append(RequestOutput(request.request_id, [], True, "error", str(exc)))
            for request_id in cancels:
                self.engine.cancel(request_id)
            try:
                outputs += self.engine.step()
            except Exception as exc:  # deliver to the requests of the failed step, keep serving
                outputs += self.engine.abort_running(f"{type(exc).__name__}: {exc}")
            with self._cond:
                now = time.monotonic()
                for out in outputs:
                    chain = self._chains.pop(out.request_id, None) if out.finished else None
                    if chain is not None and out.finish_reason == "length":
                        self._debts.pop(chain, None)  # (a chain's debts stay in the order they were made)
                        self._debts[chain] = now  # its next request pays it
            self._deliver(outputs)
            if closed:
                return

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._cond:
            for out in outputs:
                target = self._queues.get(out.request_id)
                if target is None:
                    continue
                target.put(out)
                if out.finished:
                    del self._queues[out.request_id]
