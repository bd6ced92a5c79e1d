"""OpenAI stop strings on streamed text: matched on the decoded text, across token boundaries.

The served models stop on token ids; OpenAI's `stop` is text: generation ends where the text first
contains one of the strings, and the string itself is not returned. `TextStops.feed` takes each text
delta as it arrives and returns what is safe to send: everything before a match, and never a tail
that could still grow into a stop string (that tail waits for the next delta or for `flush`).
"""

from __future__ import annotations


class TextStops:
    """Finds the first of `stops` in a stream of text deltas (see the module docstring)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""  # text received but not released: it may be the start of a stop string
        self.matched: str | None = None  # the stop string found, once found

    def feed(self, text: str) -> str:
        """Add a delta; return the text that can be sent now (empty once a stop string matched)."""
        if self.matched is not None:
            return ""
        self.held += text
        hits = [(self.held.find(s), s) for s in self.stops]
        hits = [(at, s) for at, s in hits if at >= 0]
        if hits:
            at, self.matched = min(hits)
            out, self.held = self.held[:at], ""
            return out
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(self.held)), 0, -1)
                    if self.held.endswith(s[:n])), default=0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        """The held-back text at the end of generation (no stop string matched it)."""
        out, self.held = self.held, ""
        return out
