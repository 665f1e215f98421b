"""The HTTP responses of /v1/responses: a run in the foreground (SSE events or one JSON body), and a stored
stream followed (SSE), each watching its client from the first byte.

As on chat (frontend/http/watched_response.py), a client that leaves cancels the foreground generation
and its engine request at once, and a stream's status is sent with its first output, so that a failure
before any token is a real HTTP error; after that a failure is an `error` event and then `response.failed`.
A follower that leaves stops following only: the response it follows runs on.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.types import Send

from frontend.generation.serving import Generation
from frontend.api_types.errors import OpenAIError
from frontend.http.watched_response import WatchedResponse
from frontend.responses_api.events import Event, sse_frame
from frontend.responses_api.run import ResponseRun

def json_body(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class ForegroundResponse(WatchedResponse):
    """Runs the response when sent: its events as SSE (`stream`), or its final object as JSON."""

    def __init__(self, run: ResponseRun, generation: Generation, save: Callable[[], Awaitable[None]], *,
                 request_id: str):
        super().__init__(request_id)
        self.run = run
        self.generation = generation
        self.save = save
        self._sent = 0  # events written

    async def send_body(self, send: Send) -> None:
        if self.run.prepared.request.stream:
            await self._stream(send)
            return
        try:
            final = await self.run.execute(self.generation, save=self.save)
        except OpenAIError as exc:
            await self.send_json(send, exc.status, exc.json_bytes(), exc.headers)
            return
        await self.send_json(send, 200, json_body(final))

    async def _flush(self, send: Send) -> None:
        await self.start_stream(send)
        new = self.run.events[self._sent:]
        self._sent += len(new)
        if new:
            await send({"type": "http.response.body", "body": b"".join(map(sse_frame, new)), "more_body": True})

    async def _stream(self, send: Send) -> None:
        try:
            await self.run.execute(self.generation, lambda: self._flush(send), self.save)
        except OpenAIError as exc:
            if not self.started:
                await self.send_json(send, exc.status, exc.json_bytes(), exc.headers)
                return
        await self._flush(send)  # the end: the terminal event (after `error`, if it failed)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class FollowResponse(WatchedResponse):
    """A stored stream's events as SSE, replayed and then followed (GET ?stream=true, background streams)."""

    def __init__(self, events: AsyncIterator[Event], *, request_id: str):
        super().__init__(request_id)
        self.events = events

    async def send_body(self, send: Send) -> None:
        await self.start_stream(send)
        async for event in self.events:
            await send({"type": "http.response.body", "body": sse_frame(event), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
