"""One response while it is generated: its output (output.py), its numbered events, its final object, and
what is stored of it.

The same run serves every mode: a foreground response (streamed or not) is stored once, when it ends and
before its last event or its body is sent, so that a client that chains `previous_response_id` on the
answer it just got always finds it; a background response is stored when queued and updated as it goes
(frontend/responses_api/service.py). However the generation ends (done, failed, cancelled, its client gone),
the run's object says so and that is what is stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio

from frontend.generation.serving import Generation, UsageCounter
from frontend.api_types.errors import OpenAIError
from frontend.responses_api import events
from frontend.responses_api.events import Event
from frontend.responses_api.objects import TERMINAL_STATUSES, error_object, response_object, usage_object
from frontend.responses_api.output import OutputAssembler, TokenStrings
from frontend.responses_api.request import ResponsesRequest
from frontend.responses_api.store import ResponseStore, ResponseTooLarge, StoredResponse

log = logging.getLogger("frontend")


@dataclass(frozen=True)
class Prepared:
    """A request made ready to run: its id, owner, stored input items and the echo of its parameters."""

    request: ResponsesRequest
    response_id: str
    created_at: int
    owner: str
    input_items: list[dict[str, Any]]
    echo: dict[str, Any]


class ResponseRun:
    def __init__(self, prepared: Prepared, model: str, store: ResponseStore, strings: TokenStrings | None = None):
        req = prepared.request
        self.prepared = prepared
        self.model = model
        self.store = store
        self.assembler = OutputAssembler(strings, (req.top_logprobs or 0) if req.wants_logprobs else None)
        self.keep_events = req.stream  # a stored stream can be replayed (GET ?stream=true)
        self.events: list[Event] = []
        self._written = 0  # events already in the store (they are appended, never rewritten)
        self._drop_events = False  # too large with them: the next write drops the stored ones
        self.status = "queued" if req.background else "in_progress"
        self.final: dict[str, Any] | None = None
        self.usage: UsageCounter | None = None
        self._changed = anyio.Event()

    @property
    def id(self) -> str:
        return self.prepared.response_id

    @property
    def done(self) -> bool:
        return self.final is not None

    # ----- the object and its events ------------------------------------------------------------------
    def response(self, status: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        status = status or self.status
        usage = None
        if self.usage is not None and status in TERMINAL_STATUSES:
            usage = usage_object(self.usage.prompt_tokens, self.usage.completion_tokens,
                                 self.assembler.reasoning_tokens)
        return response_object(self.prepared.echo, response_id=self.id, created_at=self.prepared.created_at,
                               model=self.model, status=status, output=self.assembler.items, usage=usage,
                               error=error, incomplete_reason="max_output_tokens" if status == "incomplete" else None)

    def emit(self, new: list[Event]) -> None:
        for event in new:
            self.events.append(events.numbered(event, len(self.events)))
        if new:
            self._changed.set()
            self._changed = anyio.Event()

    def begin(self) -> None:
        """`response.created` (as it stands: queued in the background) and, once it runs, `in_progress`."""
        self.emit([events.response_event("created", self.response())])
        if self.status == "in_progress":
            self.emit([events.response_event("in_progress", self.response())])

    def start(self) -> None:
        """A background run leaves the queue."""
        self.status = "in_progress"
        self.emit([events.response_event("in_progress", self.response())])

    def _end(self, status: str, error: OpenAIError | None = None) -> dict[str, Any]:
        self.emit(self.assembler.interrupted())
        self.status = status
        self.final = self.response(status, error_object(error.message) if error is not None else None)
        return self.final

    def complete(self) -> dict[str, Any]:
        if self.assembler.finish_reason is None:  # the serving layer always ends with a finish reason
            self.emit(self.assembler.finish("stop"))
        self.status = "incomplete" if self.assembler.finish_reason == "length" else "completed"
        self.final = self.response()
        self.emit([events.response_event(self.status, self.final)])
        return self.final

    def fail(self, error: OpenAIError) -> dict[str, Any]:
        final = self._end("failed", error)
        self.emit([events.error_event(error.message, error.code, error.param),
                   events.response_event("failed", final)])
        return final

    def cancel(self) -> dict[str, Any]:
        """Cancelled, or its foreground client left: no terminal event (nobody, or a cancel, asked for it)."""
        return self._end("cancelled")

    # ----- running it ------------------------------------------------------------------------------------
    async def execute(self, generation: Generation, flush: Callable[[], Awaitable[None]] | None = None,
                      save: Callable[[], Awaitable[None]] | None = None) -> dict[str, Any]:
        """Generate; `flush` is awaited after each delta's events (a stream writes them), `save` once the
        run has ended, before its terminal event is flushed. Returns the final object; raises the
        OpenAIError it failed with; a cancel (its client gone) ends it as cancelled and propagates."""
        self.usage = generation.usage

        async def on_delta(index: int, delta: Any) -> None:
            self.emit(self.assembler.feed(delta))
            if flush is not None:
                await flush()

        try:
            try:
                await generation.run(on_delta)
            except OpenAIError:
                raise
            except Exception as exc:  # a bug of ours still ends the run properly, logged
                log.exception("response generation failed")
                raise OpenAIError(500, f"internal error: {type(exc).__name__}", "server_error") from exc
        except OpenAIError as exc:
            self.fail(exc)
            await self._saved(save)
            raise
        except anyio.get_cancelled_exc_class():
            self.cancel()
            await self._saved(save)
            raise
        final = self.complete()
        await self._saved(save)
        return final

    @staticmethod
    async def _saved(save: Callable[[], Awaitable[None]] | None) -> None:
        if save is not None:
            with anyio.CancelScope(shield=True):  # also when the run itself was cancelled
                await save()

    async def follow(self, after: int) -> AsyncIterator[Event]:
        """The run's events numbered past `after`, as they come, until it has ended."""
        while True:
            changed = self._changed
            while after + 1 < len(self.events):
                after += 1
                yield self.events[after]
            if self.done:
                return
            await changed.wait()

    # ----- storing it ------------------------------------------------------------------------------------
    def record(self) -> StoredResponse:
        response = self.final if self.final is not None else self.response()
        return StoredResponse(id=self.id, owner=self.prepared.owner, status=response["status"], response=response,
                              input_items=self.prepared.input_items, output_items=response["output"],
                              previous_response_id=self.prepared.request.previous_response_id,
                              created_at=self.prepared.created_at,
                              events=self.events if self.keep_events else None)

    async def create(self) -> None:
        """The run's first write (a foreground run's only one, once it has ended); ResponseTooLarge only if
        not even a failed record without output fits (its input alone is over the cap)."""
        await self._save(create=True)

    async def update(self) -> None:
        """Write the run as it stands: the response, and the stream's events not written yet."""
        await self._save(create=False)

    async def create_final(self) -> None:
        """A foreground run's one write, once it has ended."""
        try:
            await self.create()
        except ResponseTooLarge as exc:  # the API refuses such input up front: not expected here
            log.warning("response %s was not stored: %s", self.id, exc)

    async def _save(self, create: bool) -> None:
        """Too large to store whole, the response is kept without its stream events (no replay, but GET
        and previous_response_id find it); if even that is over the cap, as failed without its output
        (what a later GET or chain finds is then honest)."""
        try:
            await self._write(self.record(), create)
            return
        except ResponseTooLarge as exc:
            if not self.keep_events:
                log.warning("response %s: %s; stored as failed", self.id, exc)
            else:
                log.warning("response %s: %s; stored without its stream events", self.id, exc)
                self.keep_events, self._drop_events = False, True
                try:
                    await self._write(self.record(), create)
                    return
                except ResponseTooLarge as again:
                    log.warning("response %s: %s; stored as failed", self.id, again)
        failed = self.response("failed", error_object("the response is too large to store"))
        record = self.record()
        record.status, record.response, record.output_items = "failed", {**failed, "output": []}, []
        await self._write(record, create)

    async def _write(self, record: StoredResponse, create: bool) -> None:
        if create:
            await self.store.create(record)
        else:
            await self.store.update(record.owner, record.id, status=record.status, response=record.response,
                                    output_items=record.output_items, drop_events=self._drop_events,
                                    new_events=record.events[self._written:] if record.events is not None else None)
        self._written, self._drop_events = len(self.events), False
