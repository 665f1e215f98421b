"""Per-request deadlines, and ending every request early when the server shuts down.

A `Deadline` runs awaitables (the wait for admission, each step of a stream, a whole non-streamed
generation) so that they are cancelled when the request's time is up or when `abort()` is called (the
shutdown grace period is over). Cancelling the awaitable cancels the Triton requests under it; the caller
gets an `OpenAIError` (504 `timeout`, or 503 `service_unavailable` for shutdown) to answer with, or to end
its stream with as an error event before [DONE]. Works on Python 3.10 (no `asyncio.timeout`).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

from frontend.errors import OpenAIError, request_timeout, service_unavailable

T = TypeVar("T")


class Deadline:
    def __init__(self, timeout_s: float | None, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop or asyncio.get_running_loop()
        self.timeout_s = timeout_s
        self.at: float | None = None if timeout_s is None else self._loop.time() + timeout_s
        self.reason: str | None = None  # "timeout" or "shutdown", once it has fired
        self._running: set[Callable[[], None]] = set()

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - self._loop.time())

    def expired(self) -> bool:
        return self.reason is not None or (self.at is not None and self._loop.time() >= self.at)

    def error(self) -> OpenAIError:
        if self.reason == "shutdown":
            return service_unavailable("the server is shutting down; the request was cancelled")
        return request_timeout(f"the request did not finish within its timeout of {self.timeout_s:g} s")

    def abort(self, reason: str = "shutdown") -> None:
        """Fire now: every awaitable running under this deadline is cancelled, later ones fail at once."""
        if self.reason is None:
            self.reason = reason
        self.at = self._loop.time()
        for fire in list(self._running):
            self._loop.call_soon(fire)

    async def run(self, awaitable: Awaitable[T]) -> T:
        """`await awaitable`, cancelled when the deadline passes; raises `self.error()` then."""
        if self.expired():
            if self.reason is None:
                self.reason = "timeout"
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            raise self.error()
        task = asyncio.current_task()
        assert task is not None
        fired = False

        def fire() -> None:
            nonlocal fired
            if not fired and fire in self._running:
                fired = True
                if self.reason is None:
                    self.reason = "timeout"
                task.cancel()

        handle = None if self.at is None else self._loop.call_at(self.at, fire)
        self._running.add(fire)
        try:
            return await awaitable
        except asyncio.CancelledError:
            if not fired:
                raise
            # Ours: turn it into the error, unless someone else cancelled the task as well.
            if hasattr(task, "uncancel") and task.uncancel() > 0:
                raise
            raise self.error() from None
        finally:
            self._running.discard(fire)
            if handle is not None:
                handle.cancel()


class Deadlines:
    """The deadlines of the requests in progress, so that shutdown can end them all."""

    def __init__(self) -> None:
        self._active: set[Deadline] = set()

    def add(self, deadline: Deadline) -> None:
        self._active.add(deadline)

    def discard(self, deadline: Deadline) -> None:
        self._active.discard(deadline)

    def abort_all(self, reason: str = "shutdown") -> int:
        active = list(self._active)
        for deadline in active:
            deadline.abort(reason)
        return len(active)
