"""The request's budget (frontend/http/request_budget.py): its admission slots, its tokens-per-minute reservation
and its model version lease are each given back exactly once, after the response's last byte, however the
request ended: normally, with an engine error after the first byte, with the client gone, or at its
deadline. Through the real app (edge middleware, chat route, serving layer) over a scripted fake engine."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

import pytest

from frontend.http.app import create_app
from frontend.generation.engine import EngineRequest, TokenChunk
from frontend.api_types.errors import engine_error
from frontend.models.registry import ModelContext
from frontend.settings import Settings
from tests.unit.test_chat_plan import MESSAGES, MODEL, THINKING_TOKENIZER, LeasedFakeEngine, OneModel
from tests.unit.test_serving import tokens_of

FOREVER = 3600.0


@dataclass
class CountingEngine(LeasedFakeEngine):
    leases: int = 0
    releases: int = 0

    def lease(self) -> None:
        self.leases += 1

    def release(self) -> None:
        self.releases += 1


def one_token_then(after: str) -> Any:
    """A script: one token, then an engine error ("error") or nothing more for an hour ("hang")."""

    async def script(request: EngineRequest) -> AsyncIterator[TokenChunk]:
        yield TokenChunk(THINKING_TOKENIZER.encode("a"), None, None)
        if after == "error":
            raise engine_error("the engine died")
        await asyncio.sleep(FOREVER)

    return script


class Spies:
    """The app over `engine`, with every slot release and token settlement counted."""

    def __init__(self, engine: CountingEngine):
        self.engine = engine
        self.app = create_app(Settings(rate_limit_tpm=1_000_000, max_in_flight=4, max_queued=4))
        self.app.state.models = OneModel(ModelContext(MODEL, 4096, THINKING_TOKENIZER, 0,  # type: ignore[arg-type]
                                                      None, None, engine))  # type: ignore[arg-type]
        self.edge = self.app.state.edge
        self.slot_releases: list[int] = []
        self.settlements: list[Any] = []
        gate, limiter = self.edge.limits.gate, self.edge.limits.limiter
        real_release, real_settle = gate.release, limiter.settle

        def release(held_s: float | None = None, slots: int = 1) -> None:
            self.slot_releases.append(slots)
            real_release(held_s, slots)

        def settle(reservation: Any, used: int) -> None:
            self.settlements.append(reservation)
            real_settle(reservation, used)

        gate.release, limiter.settle = release, settle

    async def post(self, body: dict[str, Any], headers: dict[str, str] | None = None,
                   leave_after_first_byte: bool = False) -> tuple[int, bytes]:
        """POST /v1/chat/completions straight through ASGI; the client may leave after the first byte."""
        raw = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 50, **body}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "root_path": "", "client": ("test", 1), "server": ("test", 80),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
                 + [(k.encode(), v.encode()) for k, v in (headers or {}).items()]}
        first_byte = asyncio.Event()
        requested = False
        status = 0
        body_parts: list[bytes] = []

        async def receive() -> dict[str, Any]:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": raw, "more_body": False}
            if leave_after_first_byte:
                await first_byte.wait()
                return {"type": "http.disconnect"}
            await asyncio.sleep(FOREVER)
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message.get("body"):
                body_parts.append(message["body"])
                first_byte.set()

        await asyncio.wait_for(self.app(scope, receive, send), 10)
        return status, b"".join(body_parts)

    def assert_each_given_back_once(self) -> None:
        assert (self.engine.leases, self.engine.releases) == (1, 1)
        assert self.slot_releases == [1] and self.edge.limits.gate.in_flight == 0
        assert len(self.settlements) == 1 and self.settlements[0].settled


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_that_ends_normally_gives_back_each_resource_once(stream: bool) -> None:
    spies = Spies(CountingEngine(tokens_of("hello")))
    status, body = await spies.post({"stream": stream})
    assert status == 200 and (body.endswith(b"data: [DONE]\n\n") if stream else b"hello" in body)
    spies.assert_each_given_back_once()


async def test_an_engine_error_after_the_first_byte_gives_back_each_resource_once() -> None:
    spies = Spies(CountingEngine(one_token_then("error")))
    status, body = await spies.post({"stream": True})
    assert status == 200 and b"the engine died" in body and body.endswith(b"data: [DONE]\n\n")
    spies.assert_each_given_back_once()


async def test_a_client_that_leaves_mid_stream_gives_back_each_resource_once() -> None:
    engine = CountingEngine(one_token_then("hang"))
    spies = Spies(engine)
    status, _ = await spies.post({"stream": True}, leave_after_first_byte=True)
    assert status == 200 and len(engine.cancelled) == 1  # the engine request was cancelled
    spies.assert_each_given_back_once()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_past_its_deadline_gives_back_each_resource_once(stream: bool) -> None:
    engine = CountingEngine(one_token_then("hang"))
    spies = Spies(engine)
    status, body = await spies.post({"stream": stream}, headers={"x-request-timeout": "0.3"})
    assert status == (200 if stream else 504) and b"timeout" in body and len(engine.cancelled) == 1
    spies.assert_each_given_back_once()


async def test_a_request_refused_by_admission_holds_nothing_afterwards() -> None:
    spies = Spies(CountingEngine(tokens_of("hello")))
    spies.edge.limits.gate.in_flight = spies.edge.limits.gate.max_in_flight
    spies.edge.limits.gate.max_queued = 0
    status, _ = await spies.post({})
    assert status == 429
    assert (spies.engine.leases, spies.engine.releases) == (1, 1)
    assert spies.slot_releases == [] and len(spies.settlements) == 1  # no slot taken; tokens given back


def latency_series(histogram: Any) -> dict[tuple[str, str], float]:
    """(route, model) -> how many observations"""
    return {(s.labels["route"], s.labels["model"]): s.value for s in histogram.collect()[0].samples
            if s.name.endswith("_count")}


async def test_the_token_timing_is_labelled_with_the_served_model_the_route_picked() -> None:
    spies = Spies(CountingEngine(tokens_of("hello there, how are you")))
    status, _ = await spies.post({"stream": True})
    assert status == 200
    metrics = spies.edge.metrics
    assert latency_series(metrics.ttft) == {("/v1/chat/completions", MODEL): 1}
    (itl,) = latency_series(metrics.itl).items()
    assert itl[0] == ("/v1/chat/completions", MODEL) and itl[1] > 0


async def test_a_background_response_times_its_tokens_under_the_model_too() -> None:
    """A background run has a record of its own (responses_routes.detached): it carries the model the
    request picked, so its token timing is labelled like a foreground one's."""
    from starlette.requests import Request

    from frontend.http.middleware import RequestContext
    from frontend.http.responses_routes import detached
    from frontend.http.routes import request_budget

    app = create_app(Settings())
    ctx = RequestContext("rid", "/v1/responses", "POST", 0.0, model=MODEL, model_version="3")
    request = Request({"type": "http", "app": app, "state": {"ctx": ctx}})
    background, release = detached(request, ModelContext(MODEL, 4096, THINKING_TOKENIZER, 0,  # type: ignore[arg-type]
                                                         None, None, None))
    try:
        timer = request_budget(background).timer()
        assert timer is not None
        timer.tokens(1)
        assert latency_series(app.state.edge.metrics.ttft) == {("/v1/responses", MODEL): 1}
        assert (background.state.ctx.model, background.state.ctx.model_version) == (MODEL, "3")
    finally:
        release()
