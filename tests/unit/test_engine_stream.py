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

from frontend.generation import engine_stream, triton_engine
from frontend.generation.engine import BufferBudget, EngineRequest, SamplingOptions, TokenChunk
from frontend.generation.triton_engine import TritonEngine
from frontend.api_types.errors import OpenAIError
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


# ----- what waits for a consumer that stops taking (a client that stops reading) is bounded ----------------
async def settle() -> None:
    """Let every task that can run do so (all here is in-process: no time passes, nothing is slept on)."""
    for _ in range(50):
        await asyncio.sleep(0)


def trtllm_token(call: FakeCall, token_id: int, so_far: int) -> None:
    """A streamed TensorRT-LLM response: its one new token, and the log-probs of all `so_far` tokens."""
    call.responses.put_nowait((Result(output_ids=np.array([[[token_id]]], dtype=np.int32),
                                      sequence_length=np.array([[1]], dtype=np.int32),
                                      output_log_probs=np.full((1, 1, so_far), -0.5, dtype=np.float32)), None))


def open_stream(engine: TritonEngine) -> engine_stream.OpenStream:
    (stream,) = engine._stalls._streams
    return stream


async def test_a_consumer_that_stops_taking_stops_the_reader_and_only_new_log_probs_wait() -> None:
    fake = FakeTriton()
    engine = engine_on(fake)
    engine._stream_queue = 4
    tokens = engine.generate(EngineRequest("req-1", [1], SamplingOptions(max_tokens=100, logprobs=True)))
    reading = asyncio.ensure_future(tokens.__anext__())
    call = await started(fake)
    for i in range(1, 21):
        trtllm_token(call, i, so_far=i * 1000)  # log-probs of far more tokens than the response carries
    first = await reading
    assert first.token_ids == [1] and first.logprobs == [-0.5]
    await settle()
    stream = open_stream(engine)
    waiting = [item for item in stream.responses._queue]  # type: ignore[attr-defined]
    assert len(waiting) == 4  # the bound; the reader holds one more, waiting for room
    assert call.responses.qsize() == 20 - 1 - 4 - 1  # the rest is left in the call (gRPC's flow control)
    assert all(len(chunk.logprobs) == 1 for chunk, _ in waiting)  # only the new token's of 2,000+
    call.end()
    rest = [chunk async for chunk in tokens]  # the consumer takes again: every token, in order
    assert [t for chunk in [first, *rest] for t in chunk.token_ids] == list(range(1, 21))
    assert not engine._ending and fake.stops == []


async def test_a_consumer_that_leaves_while_the_reader_waits_for_room_still_has_its_call_read_to_the_end() -> None:
    fake = FakeTriton()
    engine = engine_on(fake)
    engine._stream_queue = 2
    engine2, tokens, call = engine, engine.generate(request()), None
    reading = asyncio.ensure_future(tokens.__anext__())
    call = await started(fake)
    for i in range(10):
        call.token(i)
    await reading
    await settle()  # the reader waits for room
    await tokens.aclose()
    await asyncio.wait_for(asyncio.gather(*engine2._ending), 5)
    assert fake.stops == ["req-1"] and call.ended and not call.cancelled and call.responses.empty()


async def test_output_past_the_requests_buffer_budget_ends_it_with_a_clear_error() -> None:
    """Two choices of one request share its budget; a client that reads nothing makes the waiting output pass
    it: the engine request is stopped by id (its call read to the end), and the consumer, once it takes
    again, gets what waited, then a 503 `client_too_slow`; the budget is all given back."""
    fake = FakeTriton()
    engine = engine_on(fake)
    budget = BufferBudget(limit=10 * engine_stream.chunk_bytes(TokenChunk([1], [0.0])))
    options = SamplingOptions(max_tokens=100, logprobs=True)
    tokens = engine.generate(EngineRequest("req-1", [1], options, buffer=budget))
    other = engine.generate(EngineRequest("req-2", [1], options, buffer=budget))
    reading, other_reading = asyncio.ensure_future(tokens.__anext__()), asyncio.ensure_future(other.__anext__())
    while len(fake.calls) < 2:
        await started(fake)
    call, other_call = sorted(fake.calls, key=lambda c: c.request["request_id"])
    for i in range(4):
        trtllm_token(other_call, i, so_far=i + 1)
    await other_reading
    await settle()
    for i in range(40):
        trtllm_token(call, i, so_far=i + 1)
    await reading
    await asyncio.wait_for(asyncio.gather(*engine._ending), 5)
    assert fake.stops == ["req-1"] and call.ended and not call.cancelled  # stopped by id, read to the end
    taken = 1
    with pytest.raises(OpenAIError) as raised:
        async for _ in tokens:
            taken += 1
    assert 1 < taken < 12 and raised.value.status == 503 and raised.value.code == "client_too_slow"
    assert "too slowly" in raised.value.message
    other_call.end()
    assert len([chunk async for chunk in other]) == 3
    assert budget.held == 0
