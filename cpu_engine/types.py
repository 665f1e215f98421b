"""Types the scheduler, guided decoding and the guide compile pool share, in a module of their own that
imports nothing of cpu_engine, so none of those modules has to import another just for them (the
import graph of cpu_engine stays acyclic: tests/unit/test_import_graph.py)."""

from __future__ import annotations

import enum


class GuideStatus(enum.Enum):
    """What a guided sequence's grammar allows after its mask is filled (cpu_engine.guided.GuideState.fill)."""

    OPEN = "open"  # more tokens may follow
    COMPLETE = "complete"  # the grammar can only end here: the sequence ends
    DEAD = "dead"  # no token is allowed and the grammar cannot end (a grammar the vocabulary cannot finish)


class RequestError(ValueError):
    """A request the engine refuses; the message goes back to the client as is."""
