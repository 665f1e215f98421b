"""One engine request's stream, from its call's first response to its end: read by a task of its own, bounded
while its consumer does not take (a queue of at most `stream_queue` chunks, the request's BufferBudget), and
ended by the stall watch when the engine model's process dies under it.

The reader is what `TritonEngine` (triton_engine.py) hands each request's chunks through: the consumer awaits
the queue, never the call, so that cancelling the consumer never cancels the call (see `OpenStream`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import tritonclient.grpc.aio as grpcclient

from frontend.generation.engine import BufferBudget, SamplingOptions, TokenChunk
from frontend.generation.triton_errors import buffer_exceeded, client_message
from frontend.generation.trtllm_tensors import new_log_probs, new_tokens, top_alternatives
from frontend.api_types.errors import OpenAIError, service_unavailable


@dataclass(frozen=True)
class Ended:
    """The last thing a stream's reader hands on: the call ended, normally (error None) or not."""

    error: BaseException | None = None


# What a stream's queue holds per response at most (TritonEngine's `stream_queue`): a consumer that stops
# taking (its client stopped reading) stops the reader there, and gRPC's flow control holds the rest.
STREAM_QUEUE = 64


def chunk_bytes(chunk: TokenChunk) -> int:
    """About what a TokenChunk holds in memory (CPython objects), for the request's BufferBudget."""
    top = sum(map(len, chunk.top)) if chunk.top is not None else 0
    return 100 + 40 * len(chunk.token_ids) + (32 * len(chunk.logprobs) if chunk.logprobs is not None else 0) \
        + 120 * top


@dataclass(eq=False)
class OpenStream:
    """One engine request's call, read by a task of its own into `responses`.

    The consumer of `generate` awaits the queue, never the call: a consumer cancelled while it waits (a
    client gone, a deadline, a sibling choice failed) must not cancel the call, and grpc.aio cancels a call
    whose reading task is cancelled (`_StreamResponseMixin._read`).

    What waits for the consumer is bounded (a client that stops reading stops its consumer): the reader hands
    on each response as a TokenChunk, not the response itself, since a TensorRT-LLM response carries the
    log-probs of every token so far (`new_log_probs`: O(n^2) bytes for a stream held whole); it waits while
    `limit` chunks wait, so that gRPC's flow control holds the call; and every chunk waiting is charged to the
    request's BufferBudget, past which the request ends (`failure`) and its engine request is stopped. A
    stream its consumer left (`discard`) is still read to its end, keeping nothing: the stop-by-id path."""

    model: str
    version: str
    request_id: str
    call: Any  # the gRPC call, cancelled when the engine behind it is found dead or ignores a stop
    heard_at: float  # time.monotonic() of its last response (or of its start)
    options: SamplingOptions = field(default_factory=lambda: SamplingOptions(max_tokens=1))
    buffer: BufferBudget | None = None
    limit: int = STREAM_QUEUE
    on_overflow: Callable[[], None] | None = None  # stops the engine request once the budget is passed
    scheduled: bool = False  # a response came: the engine has taken it into its batch (streamed: one per step)
    failure: OpenAIError | None = None  # why the watch (or the budget) ended it
    responses: asyncio.Queue = field(default_factory=asyncio.Queue)  # (chunk | None, error) ... then Ended
    room: asyncio.Event = field(default_factory=asyncio.Event)  # set when the consumer took, or left
    reader: asyncio.Task | None = None
    discard: bool = False  # the consumer left, or the budget was passed: what comes is read and dropped
    waiting: bool = False  # the reader waits for room in `responses`

    def start_reading(self) -> None:
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def next(self) -> Any:
        """The consumer's next item; its bytes go back to the request's budget."""
        item = self._taken(await self.responses.get())
        self.room.set()
        return item

    def _taken(self, item: Any) -> Any:
        if self.buffer is not None and isinstance(item, tuple) and item[0] is not None:
            self.buffer.give(chunk_bytes(item[0]))
        return item

    def leave(self) -> None:
        """The consumer has left: drop what waits and all that comes (a waiting reader wakes up)."""
        self.discard = True
        while not self.responses.empty():
            self._taken(self.responses.get_nowait())
        self.room.set()

    def _chunk(self, result: grpcclient.InferResult) -> TokenChunk | None:
        """A response's new tokens with only their log-probs, or None when it has no tokens."""
        token_ids = new_tokens(result)
        if not token_ids:
            return None
        count, options = len(token_ids), self.options
        return TokenChunk(token_ids,
                          new_log_probs(result, count) if options.logprobs or options.top_logprobs else None,
                          top_alternatives(result, count) if options.top_logprobs else None)

    async def _hand_on(self, chunk: TokenChunk | None, error: Any) -> None:
        while self.responses.qsize() >= self.limit and not self.discard:
            self.room.clear()
            self.waiting = True  # on its consumer, not on the engine: no stall (StallWatch)
            await self.room.wait()
            self.waiting = False
            self.heard_at = time.monotonic()
        if self.discard:
            return
        if chunk is not None and self.buffer is not None and not self.buffer.take(chunk_bytes(chunk)):
            self.failure = buffer_exceeded(self.buffer.limit)
            self.discard = True
            self.responses.put_nowait(Ended())  # after what waits: the consumer then raises `failure`
            if self.on_overflow is not None:
                self.on_overflow()
            return
        self.responses.put_nowait((chunk, error))

    async def _read(self) -> None:
        ended = Ended()
        try:
            async for result, error in self.call:
                self.heard_at = time.monotonic()
                self.scheduled = True
                if self.discard:
                    continue
                chunk = self._chunk(result) if error is None else None
                if chunk is not None or error is not None:
                    await self._hand_on(chunk, error)
        except asyncio.CancelledError as exc:  # the call was cancelled (grpc.aio says so this way), or this task
            self.responses.put_nowait(Ended(exc))
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            return
        except Exception as exc:  # grpc.RpcError, InferenceServerException: handed on, raised by the consumer
            ended = Ended(exc)
        self.responses.put_nowait(ended)


class StallWatch:
    """Ends the streams of an engine model whose process died, instead of leaving them to hang.

    Only streams that have heard nothing for `stall_s` cost anything: for each model with such a stream, one
    probe (`stop_inputs`) at a time; a dead answer fails every stream open on that model version with a 503
    at once. A probe that gets no answer proves nothing (a busy engine), so nothing is ended on a timeout.
    """

    def __init__(self, probe: Callable[[str, str], Awaitable[str | None]], stall_s: float) -> None:
        self._probe = probe
        self.stall_s = stall_s
        self._streams: set[OpenStream] = set()
        self._task: asyncio.Task[None] | None = None

    def open(self, stream: OpenStream) -> None:
        self._streams.add(stream)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def close(self, stream: OpenStream) -> None:
        self._streams.discard(stream)

    def streams_of(self, model: str, version: str) -> list[OpenStream]:
        return [s for s in self._streams if (s.model, s.version) == (model, version)]

    async def _watch(self) -> None:
        try:
            while self._streams:
                await asyncio.sleep(self.stall_s / 2)
                now = time.monotonic()
                silent = {(s.model, s.version) for s in self._streams
                          if not s.waiting and now - s.heard_at >= self.stall_s}
                for model, version in sorted(silent):
                    dead = await self._probe(model, version)
                    if dead is not None:
                        self._fail(model, version, dead)
        finally:
            self._task = None

    def _fail(self, model: str, version: str, reason: str) -> None:
        for stream in [s for s in self._streams if (s.model, s.version) == (model, version)]:
            stream.failure = service_unavailable(
                f"the engine model {model!r} stopped serving ({client_message(reason)}); retry the request")
            stream.call.cancel()
