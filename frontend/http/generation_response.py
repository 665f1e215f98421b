"""The HTTP response of a chat or text completion: SSE or one JSON body, with the client watched from the
first byte (watched_response.py).

A route returns a `GenerationResponse`; sending it runs the generation. A client that leaves cancels every
engine request of its generation at once. A stream's HTTP status is sent with its first delta, so a failure
before any token still gets a real status (JSON error); after that, a failure ends the stream with an error
event and [DONE].
"""

from __future__ import annotations

import logging
from typing import Awaitable, TypeVar

import anyio
from starlette.types import Send

from frontend.api_types.errors import OpenAIError
from frontend.http.renderers import Renderer
from frontend.generation.serving import Generation, TextDelta
from frontend.http.sse import DONE, sse_json
from frontend.http.watched_response import WatchedResponse

log = logging.getLogger("frontend")
T = TypeVar("T")


async def _internal_errors_as_500(awaitable: Awaitable[T]) -> T:
    """A bug of ours still ends the response properly (a 500, or an error event and [DONE]), logged."""
    try:
        return await awaitable
    except OpenAIError:
        raise
    except Exception as exc:
        log.exception("generation failed")
        raise OpenAIError(500, f"internal error: {type(exc).__name__}", "server_error") from exc


class GenerationResponse(WatchedResponse):
    """Runs the generation when sent: its deltas as SSE (`stream`), or its choices as one JSON body."""

    def __init__(self, generation: Generation, renderer: Renderer, *, stream: bool, include_usage: bool,
                 request_id: str):
        super().__init__(request_id)
        self.generation = generation
        self.renderer = renderer
        self.stream = stream
        self.include_usage = include_usage

    async def send_body(self, send: Send) -> None:
        if self.stream:
            await self._stream(send)
        else:
            await self._body(send)

    async def _body(self, send: Send) -> None:
        try:
            results = await _internal_errors_as_500(self.generation.collect())
        except OpenAIError as exc:
            await self.send_json(send, exc.status, exc.json_bytes(), exc.headers)
            return
        body = self.renderer.body(results, self.generation.usage)
        await self.send_json(send, 200, body.model_dump_json().encode("utf-8"))

    async def _stream(self, send: Send) -> None:
        async def write(frames: list[bytes]) -> None:
            """One ASGI message for the frames of one delta (each message costs a trip through every
            middleware and a transport write)."""
            if frames:
                body = frames[0] if len(frames) == 1 else b"".join(frames)
                await send({"type": "http.response.body", "body": body, "more_body": True})

        async def deliver(index: int, delta: TextDelta) -> None:
            if not self.started:
                await self.start_stream(send)
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
            if not self.started:
                await self.send_json(send, exc.status, exc.json_bytes(), exc.headers)
                return
            await write([sse_json(exc.body())])
        await send({"type": "http.response.body", "body": DONE, "more_body": False})
