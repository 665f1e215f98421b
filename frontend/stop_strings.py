"""Stop strings matched on the detokenized text, never leaking a single character of a stop string.

Text that might be the start of a stop string is held back until the next delta shows it is not; when a
stop string completes, everything before it is released and generation ends.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was found)."""
        if not self.stops:
            return text, False
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buffer[: min(hits)], True
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """At the end of generation, held-back text was not a stop string after all."""
        held, self._held = self._held, ""
        return held

    def _longest_partial_suffix(self, buffer: str) -> int:
        best = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:size]):
                    best = size
                    break
        return best
