"""How `TritonEngine` reads an engine request's call (by a task of its own) and ends a request early: a
TensorRT-LLM `stop` for its id, then its call read to the end, and the gRPC call cancelled only when the
engine does not end the request (tritonserver 2.51 can leak a stream whose cancellation meets the
request's end: server PR #8078). The fake call behaves as grpc.aio's
does where that matters: a task cancelled while it reads the call cancels the call."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator, AsyncIterator

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from frontend.generation import triton_engine
from frontend.generation.engine import EngineRequest, SamplingOptions, TokenChunk
from frontend.generation.triton_engine import TritonEngine
from frontend.openai.errors import OpenAIError
from tests.unit.test_triton_engine import Result

END, CANCELLED = object(), object()


class FakeCall:
    def __init__(self, request: dict[str, Any]):
        self.request = request
        self.responses: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.ended = False

    def __aiter__(self) -> AsyncIterator[tuple[Any, Any]]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[tuple[Any, Any]]:
        while True:
            try:
                item = await self.responses.get()
            except asyncio.CancelledError:  # grpc.aio: a reading task cancelled cancels the call
                self.cancel()
                raise
            if item is END:
                self.ended = True
                return
            if item is CANCELLED:
                raise asyncio.CancelledError()
            yield item

    def token(self, token_id: int) -> None:
        self.responses.put_nowait((Result(output_ids=np.array([[[token_id]]], dtype=np.int32),
                                          sequence_length=np.array([[1]], dtype=np.int32)), None))

    def end(self) -> None:
        self.responses.put_nowait(END)

    def cancel(self) -> None:
        if not self.cancelled and not self.ended:
            self.cancelled = True
            self.responses.put_nowait(CANCELLED)


class FakeTriton:
    """Stands in for the gRPC client: generation calls are scripted by the test; a `stop` is answered with an
    empty FINAL response and, when `honour_stops`, ends the call of the request with that id."""

    def __init__(self, honour_stops: bool = True):
        self.honour_stops = honour_stops
        self.calls: list[FakeCall] = []
        self.stops: list[str] = []
        self.stop_times: list[float] = []
        self.new_call = asyncio.Event()

    def stream_infer(self, requests: AsyncIterator[dict[str, Any]]) -> FakeCall:
        call = FakeCall({})
        asyncio.get_running_loop().create_task(self._take(requests, call))
        return call

    async def _take(self, requests: AsyncIterator[dict[str, Any]], call: FakeCall) -> None:
        async for request in requests:
            call.request = request
        names = {tensor.name() for tensor in call.request["inputs"]}
        if "stop" in names:
            self.stops.append(call.request["request_id"])
            self.stop_times.append(asyncio.get_running_loop().time())
            if self.honour_stops:
                for running in self.calls:
                    if running.request["request_id"] == call.request["request_id"]:
                        running.end()
            call.end()
        else:
            self.calls.append(call)
            self.new_call.set()

    async def close(self) -> None:
        pass


async def started(fake: FakeTriton) -> FakeCall:
    await fake.new_call.wait()
    fake.new_call.clear()
    return fake.calls[-1]


def engine_on(fake: FakeTriton) -> TritonEngine:
    engine = TritonEngine("127.0.0.1:1", "tensorrt_llm")
    engine._client = fake  # type: ignore[assignment]
    return engine


def request(request_id: str = "req-1") -> EngineRequest:
    return EngineRequest(request_id, [1, 2, 3], SamplingOptions(max_tokens=8))


async def first_token_read(fake: FakeTriton, request_id: str = "req-1"
                           ) -> tuple[TritonEngine, AsyncGenerator[TokenChunk, None], FakeCall]:
    """An engine on `fake`, one request's tokens, and its call, once the consumer has read token 5."""
    engine = engine_on(fake)
    tokens = engine.generate(request(request_id))
    reading = asyncio.ensure_future(tokens.__anext__())
    call = await started(fake)
    call.token(5)
    assert (await reading).token_ids == [5]
    return engine, tokens, call


async def test_a_consumer_cancelled_while_it_waits_stops_the_request_and_the_call_is_read_to_its_end() -> None:
    fake = FakeTriton()
    engine = engine_on(fake)
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(request()):
            first.set()

    consumer = asyncio.create_task(consume())
    call = await started(fake)
    call.token(5)
    await first.wait()  # the consumer now waits for the next token: a client that leaves cancels it there
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    await asyncio.wait_for(asyncio.gather(*engine._ending), 5)
    assert fake.stops == ["req-1"] and call.ended and not call.cancelled
    await engine.close()


async def test_a_generator_closed_early_stops_its_request_by_id() -> None:
    fake = FakeTriton()
    engine, tokens, call = await first_token_read(fake, "req-7")
    await tokens.aclose()  # a stop string found: the consumer has all it wants
    await asyncio.wait_for(asyncio.gather(*engine._ending), 5)
    assert fake.stops == ["req-7"] and call.ended and not call.cancelled


async def test_a_request_read_to_its_end_is_neither_stopped_nor_cancelled() -> None:
    fake = FakeTriton()
    engine, tokens, call = await first_token_read(fake)
    call.end()
    with pytest.raises(StopAsyncIteration):
        await tokens.__anext__()
    assert not engine._ending and fake.stops == [] and not call.cancelled


async def test_an_engine_that_ignores_the_stop_gets_it_again_then_its_call_is_cancelled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_engine, "STOP_RESEND_S", 0.01)
    monkeypatch.setattr(triton_engine, "STOP_RESEND_MAX_S", 0.02)
    monkeypatch.setattr(triton_engine, "STOP_GRACE_S", 0.2)
    fake = FakeTriton(honour_stops=False)
    engine, tokens, call = await first_token_read(fake, "req-3")
    await tokens.aclose()
    await asyncio.wait_for(asyncio.gather(*engine._ending), 5)
    assert len(fake.stops) >= 2 and set(fake.stops) == {"req-3"} and call.cancelled


async def test_a_stop_is_resent_ever_less_often_and_a_queued_request_gets_the_longer_grace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit round 3, R2: the TensorRT-LLM backend remembers a stop for a request it holds and ends the request
    once it is scheduled, so resending only helps while the request may still be queued in Triton (backing off),
    and a request with no token yet (queued) gets STOP_GRACE_QUEUED_S before its call is cancelled."""
    monkeypatch.setattr(triton_engine, "STOP_RESEND_S", 0.01)
    monkeypatch.setattr(triton_engine, "STOP_RESEND_MAX_S", 0.04)
    monkeypatch.setattr(triton_engine, "STOP_GRACE_S", 0.05)
    monkeypatch.setattr(triton_engine, "STOP_GRACE_QUEUED_S", 0.3)
    fake = FakeTriton(honour_stops=False)
    engine = engine_on(fake)
    consumer = asyncio.create_task(anext(engine.generate(request("queued")), None))
    call = await started(fake)  # no token: the request is still queued
    began = asyncio.get_running_loop().time()
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)
    await asyncio.wait_for(asyncio.gather(*engine._ending), 5)
    assert call.cancelled and asyncio.get_running_loop().time() - began >= 0.3  # the queued grace, not 0.05
    gaps = [b - a for a, b in zip(fake.stop_times, fake.stop_times[1:])]
    assert len(gaps) >= 3 and all(gap >= min(0.01 * 2 ** i, 0.04) * 0.9 for i, gap in enumerate(gaps)), gaps
    await engine.close()


async def test_closing_the_engine_cancels_the_calls_of_requests_still_being_stopped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_engine, "CLOSE_GRACE_S", 0.05)
    fake = FakeTriton(honour_stops=False)
    engine, tokens, call = await first_token_read(fake)
    await tokens.aclose()
    await engine.close()
    assert call.cancelled and not engine._ending


async def test_tokens_before_an_error_response_reach_the_consumer_before_the_error() -> None:
    fake = FakeTriton()
    engine, tokens, call = await first_token_read(fake)
    call.responses.put_nowait((None, InferenceServerException(msg="the engine failed and cannot serve requests")))
    call.end()
    with pytest.raises(OpenAIError) as raised:
        await tokens.__anext__()
    assert raised.value.status == 500 and "the engine failed" in raised.value.message
