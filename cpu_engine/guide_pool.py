"""Guided-decoding guides compiled off Triton's execute() thread (used by the CPU engine's Triton glue,
model_repository/tensorrt_llm/1/model.py).

Triton runs a model instance's `execute()` on one thread, and every request's submission to the engine
goes through it. Compiling a guide there (xgrammar: from milliseconds to seconds for a large JSON schema)
made one client with distinct, expensive schemas hold up every other client's requests. So the glue asks
`GuidePool.guide()`:

* a guide in the compiler's cache comes back at once, and the glue submits the request itself, as it
  does every request without a guide;
* an uncached guide is compiled on the pool's threads (`threads`, 2 by default) and `guide()` returns
  None at once; when the compile ends, `then(compiled, None)` or `then(None, message)` runs on that
  thread, exactly once per request, and the glue submits the request or answers its error. A request
  that arrives while its (type, guide) is already compiling joins that compile.

xgrammar releases the GIL while it compiles (measured: a 0.6 s compile on a pool thread kept the main
thread's 1 ms sleeps within 6 ms), so a compile holds up neither execute() nor the engine thread.

Bounds: at most `max_compiles` distinct guides compiling or waiting to compile (16 by default) and at
most `max_waiting` requests waiting for their guides (256). Past either, `guide()` refuses a request that
needs a compile at once with a RequestError whose text holds "queue is full" (the frontend's 429 with
Retry-After, as for the engine's own queue); cached guides are never refused.

`stop(request_id, message)` (TensorRT-LLM's `stop` input) answers the requests with that id still waiting
for a compile with `message`; the glue calls it before the engine's `cancel_by_id`, and it never runs while
a finished compile is being delivered, so each such request is either stopped here or already submitted
(and then cancelled by the engine). `close()` (the model's finalize()) answers every request whose compile
has not started with an error; a compile that is running when the pool closes answers its requests with
the same error when it ends (never a submission to a stopped engine, never a hang).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

from cpu_engine.types import RequestError

log = logging.getLogger(__name__)

COMPILE_THREADS = 2
MAX_COMPILES = 16
MAX_WAITING = 256
SHUT_DOWN = "the model is being unloaded: the request's guide was still compiling and the request did not run"

# then(compiled guide, None) when the guide compiled, then(None, error message) otherwise.
Then = Callable[[object | None, str | None], None]
Key = tuple[str | None, str | None]


class Compiler(Protocol):
    """What the pool needs of cpu_engine.guided.GuideCompiler."""

    def cached(self, guide_type: str | None, guide: str | None) -> object | None:
        """The compiled guide when it is cached, else None (never compiles); RequestError for inputs that
        name no guide."""

    def compile(self, guide_type: str | None, guide: str | None) -> object:
        """The compiled guide; RequestError (GuideError) for a guide that does not compile."""


@dataclass(eq=False)
class _Waiter:
    request_id: str
    then: Then


@dataclass(eq=False)
class _Compile:
    """One distinct (type, guide) compiling or waiting to, and the requests waiting for it."""
    waiters: list[_Waiter] = field(default_factory=list)
    future: Future | None = None


class GuidePool:
    def __init__(self, compiler: Compiler, threads: int = COMPILE_THREADS, max_compiles: int = MAX_COMPILES,
                 max_waiting: int = MAX_WAITING):
        self._compiler = compiler
        self.max_compiles = max_compiles
        self.max_waiting = max_waiting
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="guide-compile")
        self._lock = threading.Lock()  # _compiles, _waiting, _closed
        # Held while a finished compile's requests are delivered (submitted), by stop() and by close(): a
        # stop never misses a request on its way into the engine, and nothing is submitted after close().
        self._delivery = threading.Lock()
        self._compiles: dict[Key, _Compile] = {}
        self._waiting = 0
        self._closed = False

    @property
    def compiling(self) -> int:
        """Distinct guides compiling or waiting to compile."""
        with self._lock:
            return len(self._compiles)

    @property
    def waiting(self) -> int:
        """Requests waiting for their guides."""
        with self._lock:
            return self._waiting

    def guide(self, guide_type: str | None, guide: str | None, request_id: str, then: Then) -> object | None:
        """The compiled guide when the compiler has it cached (`then` is never called); else None, and `then`
        runs once on a pool thread when the compile ends. Raises RequestError for inputs that name no guide,
        when the compile queue is full, and once the pool is closed."""
        with self._lock:
            if self._closed:
                raise RequestError(SHUT_DOWN)
            compiled = self._compiler.cached(guide_type, guide)
            if compiled is not None:
                return compiled
            if self._waiting >= self.max_waiting:
                raise RequestError(f"the guide compile queue is full ({self._waiting} requests waiting for their "
                                   f"guides to compile); retry later")
            key = (guide_type, guide)
            entry = self._compiles.get(key)
            if entry is None:
                if len(self._compiles) >= self.max_compiles:
                    raise RequestError(f"the guide compile queue is full ({len(self._compiles)} guides compiling "
                                       f"or waiting to compile); retry later")
                entry = self._compiles[key] = _Compile()
                entry.future = self._executor.submit(self._run, key, entry)
            entry.waiters.append(_Waiter(request_id, then))
            self._waiting += 1
        return None

    def stop(self, request_id: str, message: str) -> int:
        """Answer every request with this id still waiting for its guide with `message` (on this thread);
        returns how many. A compile nobody waits for any more is dropped if it has not started."""
        stopped: list[_Waiter] = []
        with self._delivery, self._lock:
            for key, entry in list(self._compiles.items()):
                keep = [w for w in entry.waiters if w.request_id != request_id]
                stopped += [w for w in entry.waiters if w.request_id == request_id]
                entry.waiters = keep
                if not keep and entry.future.cancel():
                    del self._compiles[key]
            self._waiting -= len(stopped)
        for waiter in stopped:
            _deliver(waiter, None, message)
        return len(stopped)

    def close(self) -> None:
        """No more compiles: the requests whose compile has not started get the SHUT_DOWN error now, those
        whose compile is running get it when it ends. Returns without waiting for running compiles."""
        dropped: list[_Waiter] = []
        with self._delivery, self._lock:
            self._closed = True
            for key, entry in list(self._compiles.items()):
                if entry.future.cancel():
                    dropped += entry.waiters
                    self._waiting -= len(entry.waiters)
                    del self._compiles[key]
        self._executor.shutdown(wait=False)
        for waiter in dropped:
            _deliver(waiter, None, SHUT_DOWN)

    def _run(self, key: Key, entry: _Compile) -> None:
        compiled, error = None, None
        try:
            compiled = self._compiler.compile(*key)
        except RequestError as exc:
            error = str(exc)
        except Exception as exc:  # not the guide's fault; its requests must still get an answer
            log.exception("compiling a guide of type %r failed", key[0])
            error = f"compiling the guided_decoding_guide failed: {type(exc).__name__}: {exc}"
        with self._delivery:
            with self._lock:
                if self._compiles.get(key) is entry:
                    del self._compiles[key]
                waiters, entry.waiters = entry.waiters, []
                self._waiting -= len(waiters)
                if self._closed:
                    compiled, error = None, SHUT_DOWN
            for waiter in waiters:
                _deliver(waiter, compiled, error)


def _deliver(waiter: _Waiter, compiled: object | None, error: str | None) -> None:
    try:
        waiter.then(compiled, error)
    except Exception:  # one request's answer must not keep the others from theirs
        log.exception("answering request %r after its guide compile raised", waiter.request_id)
