"""Keeping BLS calls' pb_utils objects alive past Triton 2.51's python stub (used by pipeline.serving.bls_calls).

No Triton import: the objects are held as opaque Python objects, so this module runs (and is tested) anywhere.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Callable

HOLD_S = 5.0  # how long a finished call's pb_utils objects stay referenced (StubObjectKeeper)


@dataclass
class CallObjects:
    """The pb_utils objects of one BLS call, and its last exec()/next() on the pool (None before the first)."""

    objects: list = field(default_factory=list)
    pending: asyncio.Future | None = None


class StubObjectKeeper:
    """Keeps finished calls' pb_utils objects referenced from Python for `hold_s`, and longer while an
    abandoned call's exec()/next() still runs on the pool.

    Why: in Triton 2.51 (python_backend r24.10) a PbTensor's destructor drops its numpy arrays without
    taking the GIL (fixed in r24.12 by commit b771f4f, "Hold GIL when deleting numpy array"). A decoupled
    call's ResponseIterator holds every response; the stub keeps one reference to it in a map that its
    stub-to-parent thread erases (Stub::SendCleanupId) some time after the last response. When Python had
    already let go, that C++ thread freed the responses' numpy arrays while another thread ran Python:
    pymalloc's free lists broke (`segfault at 1 ... _PyObject_Malloc`, `malloc(): unaligned fastbin chunk`).
    Holding the objects until the stub surely dropped its own references makes Python's the last one, so
    they are freed under the GIL."""

    def __init__(self, hold_s: float = HOLD_S, clock: Callable[[], float] = time.monotonic):
        self.hold_s = hold_s
        self.clock = clock
        self.held: collections.deque[tuple[float, CallObjects]] = collections.deque()  # (release time, call)

    def hold(self, call: CallObjects) -> None:
        """Keep `call`'s objects for hold_s from now."""
        self.held.append((self.clock() + self.hold_s, call))

    def release_expired(self) -> None:
        """Let go of the calls held past their time whose pool work has ended; a call still running on the pool
        is held hold_s more."""
        now = self.clock()
        while self.held and self.held[0][0] <= now:
            _, call = self.held.popleft()
            if call.pending is not None and not call.pending.done():
                self.hold(call)
