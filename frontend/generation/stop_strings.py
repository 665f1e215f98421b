"""Stop strings matched on the detokenized text, never leaking a single character of a stop string.

Text that might be the start of a stop string is held back until the next delta shows it is not; when a
stop string completes, everything before it is released and generation ends.

Matching is linear in the text: each stop string has a Knuth-Morris-Pratt automaton fed one character at
a time, whose state is the length of the longest prefix of that stop that ends the text seen so far. The
held-back text is the longest such state, so finding it costs nothing extra, and no delta ever rescans
the held-back text (a 1,000-character stop string against adversarial text would otherwise cost up to
a million character comparisons per token).
"""

from __future__ import annotations

from collections import deque


def _failure_function(pattern: str) -> list[int]:
    """KMP: failure[k] is the length of the longest proper prefix of pattern[:k + 1] that is also its
    suffix."""
    failure = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = failure[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        failure[i] = k
    return failure


class _StopAutomaton:
    """One stop string's KMP matcher; `state` is how many of its first characters end the text fed."""

    __slots__ = ("stop", "failure", "state")

    def __init__(self, stop: str):
        self.stop = stop
        self.failure = _failure_function(stop)
        self.state = 0

    def step(self, char: str) -> bool:
        """Advance by one character; True when the stop string has just been completed. Amortized O(1):
        the failure links followed never exceed the characters fed."""
        stop, state = self.stop, self.state
        if state == len(stop):  # after a full match, continue as KMP does (overlapping occurrences)
            state = self.failure[state - 1]
        while state and stop[state] != char:
            state = self.failure[state - 1]
        if stop[state] == char:
            state += 1
        self.state = state
        return state == len(stop)


class StopStringMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._automata = [_StopAutomaton(s) for s in dict.fromkeys(self.stops)]
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held: deque[str] = deque()  # the held-back characters: never longer than the longest stop

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was found).

        When a stop string completes, the text before the earliest-starting stop string in the held-back
        text plus `text` is released (as `str.find` over that buffer would give), and matching starts
        afresh."""
        if not self.stops:
            return text, False
        held = len(self._held)
        first_start: int | None = None  # in the buffer held + text
        for i, char in enumerate(text):
            position = held + i
            if first_start is not None and position - first_start >= self._longest:
                break  # no stop string still to complete can start before the one found
            for automaton in self._automata:
                if automaton.step(char):
                    start = position - len(automaton.stop) + 1
                    if first_start is None or start < first_start:
                        first_start = start
        if first_start is not None:
            buffer = "".join(self._held) + text
            self._reset()
            return buffer[:first_start], True
        keep = max(automaton.state for automaton in self._automata)
        release = held + len(text) - keep
        if release >= held:  # every character held from earlier deltas goes out (the common case: none)
            safe = "".join(self._held) + text[: release - held]
            self._held = deque(text[release - held:])
            return safe, False
        popleft = self._held.popleft  # still a partial match: release from the front, O(released)
        safe = "".join([popleft() for _ in range(release)])
        self._held.extend(text)
        return safe, False

    def flush(self) -> str:
        """At the end of generation, held-back text was not a stop string after all."""
        held = "".join(self._held)
        self._reset()
        return held

    def _reset(self) -> None:
        self._held.clear()
        for automaton in self._automata:
            automaton.state = 0

