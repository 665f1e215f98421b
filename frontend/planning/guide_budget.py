"""A bound on the distinct guides a TensorRT-LLM model meets per minute (audit round 3, R3).

TensorRT-LLM compiles a guide it has not seen inside its executor loop (guidedDecoder.cpp GuidedDecoder::build),
with the full-vocabulary token-mask cache, while every stream of the model waits; and it keeps every distinct
compiled grammar for the life of the process (xgrammar GrammarCompiler defaults: cache_enabled, max_memory_bytes
-1). Measured with `python -m benchmarks.guide_compile_cost --vocab 128256` (README, "Guided decoding on
TensorRT-LLM"): a test tool schema takes ~0.1 s and keeps ~0.2-0.4 MB. A guide the engine has seen costs
nothing more, so only NEW guides count: at most `limit` per model per `window_s`; past that, 429 with
Retry-After (the client may retry; the engine meanwhile serves everyone else). The CPU engine compiles on
threads of its own with a bounded cache: not bounded here.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Callable

KNOWN_PER_MODEL = 65536  # guides remembered as seen per model (hashes): beyond, the oldest may count again


class NewGuideBudget:
    """Per model: the guides it has seen (LRU of keys) and when each new one arrived within the window."""

    def __init__(self, limit: int, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self._known: dict[str, OrderedDict[str, None]] = {}
        self._arrivals: dict[str, deque[float]] = {}

    def admit(self, model: str, key: str) -> float | None:
        """None: the guide may go to the engine (seen before, or within the budget, then counted); else the
        seconds until a new guide fits again. `limit` 0 admits everything."""
        known = self._known.setdefault(model, OrderedDict())
        if self.limit <= 0 or key in known:
            if key in known:
                known.move_to_end(key)
            return None
        now = self.clock()
        arrivals = self._arrivals.setdefault(model, deque())
        while arrivals and now - arrivals[0] >= self.window_s:
            arrivals.popleft()
        if len(arrivals) >= self.limit:
            return max(0.0, arrivals[0] + self.window_s - now)
        arrivals.append(now)
        known[key] = None
        while len(known) > KNOWN_PER_MODEL:
            known.popitem(last=False)
        return None
