"""Request bodies parsed as JSON without stalling the event loop.

FastAPI parses a JSON body with `json.loads` on the event loop before a route runs. A body at the size
limit (4 MB) can hold two million numbers (a token-id prompt) or a hundred thousand tiny chat messages:
~60-150 ms of C code that holds the GIL from start to end. Running that in a worker thread alone would not
help: the loop could not take the GIL back until the parse ends, and every open stream would pause that long.

So a large body is parsed in a worker thread, with its numbers and objects made by Python-level functions.
Between two of them the interpreter may switch threads (every `sys.getswitchinterval()`, 5 ms), so the loop
keeps serving streams while the parse runs. There is one such thread, and large bodies wait their turn for it:
with several parsing threads the GIL passes among them too, and the loop can wait for it for several
turns (hundreds of ms with three 4 MB bodies at once). Before, the event loop parsed them one at a time
anyway. A small body (nearly all of them) is parsed at once, at C speed.
The routes then refuse what can never run by its length alone before validating it
(routes.token_prompts_fit, routes.lists_fit): validation runs on the loop, and costs a Python step per
list item, so what it is given is bounded first.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.routing import APIRoute

# Below this, a parse takes at most a few ms at C speed: done at once, without a thread hop.
OFF_LOOP_BYTES = 64 * 1024
# The one thread that parses large bodies (see the module's docstring); not tied to any event loop.
_PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="json-body")


def _int(text: str) -> int:
    """json's parse_int, at Python level so that a long parse yields the GIL (see the module's docstring)."""
    return int(text)


def _float(text: str) -> float:
    """json's parse_float, likewise."""
    return float(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook, likewise: a body of many small objects and no numbers yields too."""
    return dict(pairs)


def parse_json(body: bytes) -> Any:
    """The body as JSON, as `json.loads` parses it (same values, same errors), yielding the GIL between
    numbers and objects: to be run in a worker thread."""
    return json.loads(body, parse_int=_int, parse_float=_float, object_pairs_hook=_object)


class OffLoopJSONRequest(Request):
    """A request whose JSON body, if large, is parsed in the parser thread (FastAPI calls `json()` for a
    body declared JSON, before it solves the route's dependencies)."""

    _parsed: Any = None
    _is_parsed = False

    async def json(self) -> Any:
        if not self._is_parsed:
            body = await self.body()
            if len(body) < OFF_LOOP_BYTES:
                self._parsed = json.loads(body)
            else:
                self._parsed = await asyncio.get_running_loop().run_in_executor(_PARSER, parse_json, body)
            self._is_parsed = True
        return self._parsed

    def parsed_json(self) -> Any:
        """The body as FastAPI parsed it, or None if it was not parsed (not declared JSON: FastAPI's to refuse).
        It never parses."""
        return self._parsed if self._is_parsed else None


def parsed_json(request: Request) -> Any:
    """The request's body as already parsed JSON, or None (see OffLoopJSONRequest.parsed_json)."""
    return request.parsed_json() if isinstance(request, OffLoopJSONRequest) else None


class OffLoopJSONRoute(APIRoute):
    """The routes' class (`APIRouter(route_class=...)`): their requests are OffLoopJSONRequests."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(OffLoopJSONRequest(request.scope, request.receive))

        return handle
