"""The HTTP response of a generation: SSE or one JSON body, with the client watched from the first byte.

A route returns a `GenerationResponse`; running it runs the generation. It listens for the client's
disconnect from the start (also while the first token is still coming, and for non-streamed requests):
a client that leaves cancels every engine request of its generation at once, instead of when the next
write fails. A stream's HTTP status is sent with its first delta, so a failure before any token still
gets a real status (JSON error); after that, a failure ends the stream with an error event and [DONE].
"""

from __future__ import annotations

import logging
from typing import Awaitable, TypeVar

import anyio
from anyio import CancelScope
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from frontend.api_types.errors import OpenAIError
from frontend.http.renderers import Renderer
from frontend.generation.serving import Generation, TextDelta
from frontend.http.sse import DONE, sse_json

log = logging.getLogger("frontend")
T = TypeVar("T")

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
CLIENT_CLOSED_REQUEST = 499  # nginx's code: nobody reads it, but the access log and metrics show it


async def _internal_errors_as_500(awaitable: Awaitable[T]) -> T:
    """A bug of ours still ends the response properly (a 500, or an error event and [DONE]), logged."""
    try:
        return await awaitable
    except OpenAIError:
        raise
    except Exception as exc:
        log.exception("generation failed")
        raise OpenAIError(500, f"internal error: {type(exc).__name__}", "server_error") from exc


class GenerationResponse(Response):
    """A Starlette Response (so FastAPI passes it through untouched) that runs the generation when sent."""

    def __init__(self, generation: Generation, renderer: Renderer, *, stream: bool, include_usage: bool,
                 request_id: str):
        super().__init__()
        self.generation = generation
        self.renderer = renderer
        self.stream = stream
        self.include_usage = include_usage
        self.request_id = request_id
        self.client_gone = False
        self._started = False  # the response's status and headers are sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(self._watch, receive, group.cancel_scope)
            if self.stream:
                await self._stream(send)
            else:
                await self._body(send)
            group.cancel_scope.cancel()  # done: stop watching
        if self.client_gone and not self._started:
            await self._send_json(send, CLIENT_CLOSED_REQUEST, b"")

    async def _watch(self, receive: Receive, scope: CancelScope) -> None:
        """Cancel the generation (and with it every engine request) when the client disconnects."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self.client_gone = True
        scope.cancel()

    def _headers(self, content_type: bytes | None = None) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-request-id", self.request_id.encode("latin-1"))]
        return headers + ([(b"content-type", content_type)] if content_type else [])

    async def _send_json(self, send: Send, status: int, body: bytes,
                         extra_headers: dict[str, str] | None = None) -> None:
        headers = self._headers(b"application/json") + [(b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (extra_headers or {}).items()]
        self._started = True
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _body(self, send: Send) -> None:
        try:
            results = await _internal_errors_as_500(self.generation.collect())
        except OpenAIError as exc:
            await self._send_json(send, exc.status, exc.json_bytes(), exc.headers)
            return
        body = self.renderer.body(results, self.generation.usage)
        await self._send_json(send, 200, body.model_dump_json().encode("utf-8"))

    async def _stream(self, send: Send) -> None:
        async def write(frames: list[bytes]) -> None:
            """One ASGI message for the frames of one delta (each message costs a trip through every
            middleware and a transport write)."""
            if frames:
                body = frames[0] if len(frames) == 1 else b"".join(frames)
                await send({"type": "http.response.body", "body": body, "more_body": True})

        async def deliver(index: int, delta: TextDelta) -> None:
            if not self._started:
                self._started = True
                await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + self._headers()})
                await write(self.renderer.stream_start())
            await write(self.renderer.stream_delta(index, delta))

        lock = anyio.Lock(fast_acquire=True)

        async def deliver_locked(index: int, delta: TextDelta) -> None:
            async with lock:
                await deliver(index, delta)

        # Choices deliver concurrently; frames must not interleave. One choice (the usual case) needs no lock:
        # even an uncontended anyio lock costs several microseconds per token (current_task() lookups and a
        # cancellation check).
        on_delta = deliver_locked if len(self.generation.jobs) > 1 else deliver
        try:
            await _internal_errors_as_500(self.generation.run(on_delta))
            if self.include_usage:
                await write([self.renderer.stream_usage(self.generation.usage)])
        except OpenAIError as exc:
            if not self._started:
                await self._send_json(send, exc.status, exc.json_bytes(), exc.headers)
                return
            await write([sse_json(exc.body())])
        await send({"type": "http.response.body", "body": DONE, "more_body": False})
