"""Per-request deadlines, and ending every request early when the server shuts down.

A `Deadline` runs awaitables (the wait for admission, a whole generation, streamed or not) in an anyio
cancel scope that expires with the request, so it nests with the task groups under and around it (the
client-gone watch of frontend/http/generation_response.py); `abort()` (the shutdown grace period is over) cancels those
scopes at once. Cancelling the awaitable cancels the Triton requests under it; the caller gets an
`OpenAIError` (504 `timeout`, or 503 `service_unavailable` for shutdown) to answer with, or to end its
stream with as an error event before [DONE]. A cancel from outside stays a cancel.
"""

from __future__ import annotations

import asyncio
import math
from typing import Awaitable, TypeVar

import anyio

from frontend.api_types.errors import OpenAIError, request_timeout, service_unavailable

T = TypeVar("T")


class Deadline:
    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s
        self.at = math.inf if timeout_s is None else anyio.current_time() + timeout_s
        self.reason: str | None = None  # "timeout" or "shutdown", once it has fired
        self._scopes: set[anyio.CancelScope] = set()

    def remaining(self) -> float | None:
        return None if self.at == math.inf else max(0.0, self.at - anyio.current_time())

    def error(self) -> OpenAIError:
        if self.reason == "shutdown":
            return service_unavailable("the server is shutting down; the request was cancelled")
        return request_timeout(f"the request did not finish within its timeout of {self.timeout_s:g} s")

    def abort(self, reason: str = "shutdown") -> None:
        """Fire now: every awaitable running under this deadline is cancelled, later ones fail at once."""
        self.reason = self.reason or reason
        self.at = anyio.current_time()
        for scope in self._scopes:
            scope.cancel()

    async def run(self, awaitable: Awaitable[T]) -> T:
        """`await awaitable`, cancelled when the deadline passes; raises `self.error()` then."""
        if self.reason is None and anyio.current_time() < self.at:
            with anyio.CancelScope(deadline=self.at) as scope:  # swallows only its own cancellation
                self._scopes.add(scope)
                try:
                    return await awaitable
                finally:
                    self._scopes.discard(scope)
        elif asyncio.iscoroutine(awaitable):  # expired already: not started at all
            awaitable.close()
        self.reason = self.reason or "timeout"
        raise self.error()


class Deadlines(set["Deadline"]):
    """The deadlines of the requests in progress (`add`, `discard`), so that shutdown can end them all."""

    def abort_all(self, reason: str = "shutdown") -> int:
        for deadline in list(self):
            deadline.abort(reason)
        return len(self)
