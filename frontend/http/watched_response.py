"""The ASGI response every generation is sent through (chat and completions: generation_response.py; the
Responses API: responses_asgi.py): the client is watched from the first byte, and the status goes out with the
first output.

A client that leaves cancels the sending at once (and with it the generation and its engine requests),
instead of when the next write fails, also while the first token is still coming and for JSON answers. The
status line waits for the first output, so a failure before any token is still a real HTTP error (JSON); a
stream that has started can only end with an error event. A client gone before anything was sent is logged
as 499 (nginx's code: nobody reads it, but the access log and metrics show it).
"""

from __future__ import annotations

import anyio
from anyio import CancelScope
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
CLIENT_CLOSED_REQUEST = 499


class WatchedResponse(Response):
    """A Starlette Response (so FastAPI passes it through untouched) that sends its body (`send_body`, for
    subclasses) while watching for the client's disconnect."""

    def __init__(self, request_id: str):
        super().__init__()
        self.request_id = request_id
        self.client_gone = False
        self.started = False  # the response's status and headers are sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(self._watch, receive, group.cancel_scope)
            await self.send_body(send)
            group.cancel_scope.cancel()  # done: stop watching
        if self.client_gone and not self.started:
            await self.send_json(send, CLIENT_CLOSED_REQUEST, b"")

    async def send_body(self, send: Send) -> None:
        raise NotImplementedError

    async def _watch(self, receive: Receive, scope: CancelScope) -> None:
        """Cancel the sending (and what it awaits) when the client disconnects."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self.client_gone = True
        scope.cancel()

    async def start_stream(self, send: Send) -> None:
        """The SSE status line and headers, once."""
        if not self.started:
            self.started = True
            await send({"type": "http.response.start", "status": 200,
                        "headers": SSE_HEADERS + [(b"x-request-id", self.request_id.encode("latin-1"))]})

    async def send_json(self, send: Send, status: int, body: bytes, extra_headers: dict[str, str] | None = None) -> None:
        """A whole JSON answer (or an error before the stream started), with its status."""
        headers = [(b"x-request-id", self.request_id.encode("latin-1")), (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (extra_headers or {}).items()]
        self.started = True
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
