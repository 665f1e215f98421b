"""The Responses serving class: a request made into the chat request the chat pipeline runs, its run in
the foreground or the background, and the stored responses' endpoints.

The HTTP router (frontend/http/responses_routes.py) picks the model, plans and admits the chat request
with the chat route's own steps, and hands the generation over; everything Responses-specific is here.

Stored responses belong to the API key that created them (`owner`: its key id, "" on an open server):
every read, delete and cancel is scoped to it in the store, so another key's id is a 404, never content.

Background responses run in this process's task group, after the HTTP request has returned; a cancel
(from any worker process: it is a flag in the store) is seen by the run, which polls for it every
`poll_s` and then saves its stream's new events too (so that another process can follow the stream).
On shutdown the runs still going are cancelled and stored as failed.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import anyio
from anyio.abc import TaskGroup
from sqlalchemy.engine import make_url

from frontend.generation.serving import Generation
from frontend.openai.errors import OpenAIError, invalid_request
from frontend.openai.schemas import ChatCompletionRequest, ChatMessage, JsonSchemaFormat, ResponseFormat
from frontend.responses.conversation import conversation_messages, stored_item
from frontend.responses.events import Event
from frontend.responses.objects import TERMINAL_STATUSES, deleted_object, item_list, new_id, now, request_echo
from frontend.responses.output import TokenStrings
from frontend.responses.request import ResponsesRequest
from frontend.responses.run import Prepared, ResponseRun
from frontend.responses.store import ChainTooLong, ResponseStore, ResponseTooLarge
from frontend.responses.tools import chat_tools
from frontend.settings import Settings

log = logging.getLogger("frontend")

POLL_S = 0.2  # a background run's cancel check (and a follower's check for new events of another process's run)
PURGE_INTERVAL_S = 3600.0
MAX_CONVERSATION_ITEMS = 4096  # a previous_response_id chain's items and this request's, together

# The chat pipeline names chat fields in its errors; a Responses client sent these instead.
RESPONSES_PARAMS = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens",
                    "max_completion_tokens": "max_output_tokens", "logprobs": "include",
                    "guided_regex": "tools", "guided_grammar": "tools"}


@contextlib.contextmanager
def responses_params() -> Iterator[None]:
    """Errors of the chat pipeline, naming the Responses field that caused them."""
    try:
        yield
    except OpenAIError as exc:
        exc.param = RESPONSES_PARAMS.get(exc.param or "", exc.param)
        raise


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id[:128]}' not found.", "invalid_request_error", None,
                       "not_found")


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request the chat pipeline plans (tools, guides, parsers) and samples from."""
    text_format = req.format
    response_format = None
    if text_format.type == "json_object":
        response_format = ResponseFormat(type="json_object")
    elif text_format.type == "json_schema":
        response_format = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat.model_validate({
            "name": text_format.name, "description": text_format.description, "schema": text_format.schema_,
            "strict": text_format.strict}))
    with responses_params():
        return ChatCompletionRequest(
            model=req.model,
            messages=[ChatMessage(role="user", content="")],  # rendered from `messages` (the template input)
            **chat_tools(req),  # tools, tool_choice (and a forced custom tool's regex): frontend/responses/tools.py
            parallel_tool_calls=req.parallel_tool_calls,
            response_format=response_format,
            max_completion_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            logprobs=req.wants_logprobs,
            top_logprobs=req.top_logprobs if req.wants_logprobs else None,
            user=req.user,
        )


class ResponsesService:
    def __init__(self, store: ResponseStore, group: TaskGroup | None = None, poll_s: float = POLL_S):
        self.store = store
        self.poll_s = poll_s
        self._group = group
        self.runs: dict[str, ResponseRun] = {}  # background runs of this process, by id

    @classmethod
    @contextlib.asynccontextmanager
    async def running(cls, settings: Settings) -> AsyncIterator["ResponsesService"]:
        """Open the store, purge expired responses hourly, run background responses; close all at the end."""
        store = await ResponseStore.open(settings.responses_db_url, ttl_days=settings.responses_ttl_days,
                                         max_bytes=settings.responses_max_bytes)
        log.info("stored responses: %s (kept %g days)", store_description(settings.responses_db_url),
                 settings.responses_ttl_days)
        try:
            async with anyio.create_task_group() as group:
                service = cls(store, group)
                group.start_soon(service._purge_forever)
                try:
                    yield service
                finally:
                    group.cancel_scope.cancel()
        finally:
            await store.close()

    async def _purge_forever(self) -> None:
        while True:
            try:
                purged = await self.store.purge_expired()
            except Exception:  # a database hiccup: try again at the next round
                log.exception("purging expired responses failed")
            else:
                if purged:
                    log.info("purged %d expired stored response(s)", purged)
            await anyio.sleep(PURGE_INTERVAL_S)

    # ----- creating a response ----------------------------------------------------------------------------
    async def prepare(self, req: ResponsesRequest, owner: str) -> tuple[Prepared, ChatCompletionRequest,
                                                                        list[dict[str, Any]]]:
        """The request ready to run: stored input items, the chat request, and the chat template's messages
        (the previous responses' items first). 404 for a previous_response_id this owner cannot see."""
        chain: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            try:
                found = await self.store.conversation(owner, req.previous_response_id)
            except ChainTooLong as exc:
                raise invalid_request(str(exc), "previous_response_id") from None
            if found is None:
                raise OpenAIError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                                  "invalid_request_error", "previous_response_id", "previous_response_not_found")
            chain = found
        items = [stored_item(item) for item in req.items]
        if not chain and not items:
            raise invalid_request("input is required (or a previous_response_id to continue)", "input")
        if len(chain) + len(items) > MAX_CONVERSATION_ITEMS:
            raise invalid_request(f"the conversation would hold {len(chain) + len(items)} items, more than this "
                                  f"server's limit of {MAX_CONVERSATION_ITEMS}", "input")
        messages = conversation_messages(chain, items, req.instructions)
        prepared = Prepared(req, new_id("resp"), now(), owner, items, request_echo(req))
        return prepared, chat_request(req, messages), messages

    def run(self, prepared: Prepared, model: str, strings: TokenStrings | None) -> ResponseRun:
        return ResponseRun(prepared, model, self.store, strings)

    async def save_final(self, run: ResponseRun) -> None:
        """A foreground run's one write (when stored), before its last event or its body is sent."""
        if run.prepared.request.store:
            await run.create_final()

    async def start_background(self, run: ResponseRun, start: Callable[[], Awaitable[Generation]],
                               release: Callable[[], None]) -> None:
        """Store the run as queued and run it in the background: `start` takes what it holds (admission),
        `release` gives it back at the end, however it ends."""
        assert self._group is not None, "background runs need the service running (ResponsesService.running)"
        run.begin()
        try:
            await run.create()
        except ResponseTooLarge as exc:
            release()
            raise invalid_request(f"input: too large to store ({exc})", "input") from None
        except BaseException:
            release()
            raise
        self.runs[run.id] = run
        self._group.start_soon(self._background, run, start, release)

    async def _background(self, run: ResponseRun, start: Callable[[], Awaitable[Generation]],
                          release: Callable[[], None]) -> None:
        cancelled = False
        try:
            async with anyio.create_task_group() as group:
                async def watch() -> None:
                    nonlocal cancelled
                    cancelled = await self._watch(run)
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                try:
                    generation = await start()
                except OpenAIError as exc:
                    run.fail(exc)
                else:
                    run.start()
                    await run.update()
                    with contextlib.suppress(OpenAIError):  # the run says how it failed
                        await run.execute(generation)
                group.cancel_scope.cancel()
            if cancelled and not run.done:
                run.cancel()
        except anyio.get_cancelled_exc_class():  # shutdown: the run ends here, and says so
            if not run.done:
                run.fail(OpenAIError(503, "the server shut down before the response was complete", "server_error"))
            raise
        except Exception:  # a bug of ours (or the database): this run fails, the others go on
            log.exception("background response %s failed", run.id)
            if not run.done:
                run.fail(OpenAIError(500, "internal error", "server_error"))
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await run.update()
                except Exception:
                    log.exception("response %s: storing its end failed", run.id)
                release()
                self.runs.pop(run.id, None)

    async def _watch(self, run: ResponseRun) -> bool:
        """Until a cancel is requested (True): poll for it, and save the stream's new events each time."""
        saved = len(run.events)
        while True:
            await anyio.sleep(self.poll_s)
            try:
                if await self.store.cancel_requested(run.id):
                    return True
                if run.keep_events and len(run.events) > saved and not run.done:
                    saved = len(run.events)
                    await run.update()
            except Exception:  # the database: the run goes on, and the next poll tries again
                log.exception("response %s: polling the store failed", run.id)

    # ----- stored responses -------------------------------------------------------------------------------
    async def get(self, owner: str, response_id: str) -> dict[str, Any]:
        record = await self.store.get(owner, response_id)
        if record is None:
            raise not_found(response_id)
        return record.response

    async def follow(self, owner: str, response_id: str, starting_after: int | None) -> AsyncIterator[Event]:
        """A stored stream's events past `starting_after`: replayed, then followed while the response runs
        (here, or in another process through the store). 400 if it was not created with stream=true."""
        record = await self.store.get(owner, response_id)
        if record is None:
            raise not_found(response_id)
        if record.events is None:
            raise invalid_request("this response was not created with stream=true: it has no stream to replay",
                                  "stream")
        return self._follow(owner, response_id, -1 if starting_after is None else starting_after, record.events,
                            record.status)

    async def _follow(self, owner: str, response_id: str, after: int, stored: list[Event],
                      status: str) -> AsyncIterator[Event]:
        while True:
            local = self.runs.get(response_id)
            if local is not None:  # running here: its events as they come
                async for event in local.follow(after):
                    yield event
                return
            for event in stored[after + 1:]:
                after = event["sequence_number"]
                yield event
            if status in TERMINAL_STATUSES:
                return
            await anyio.sleep(self.poll_s)
            record = await self.store.get(owner, response_id)
            if record is None:
                return
            stored, status = record.events or [], record.status

    async def input_items(self, owner: str, response_id: str, after: str | None, limit: int,
                          order: str) -> dict[str, Any]:
        page = await self.store.input_items(owner, response_id, after=after, limit=limit, order=order)
        if page is None:
            raise not_found(response_id)
        return item_list(*page)

    async def delete(self, owner: str, response_id: str) -> dict[str, Any]:
        if not await self.store.delete(owner, response_id):
            raise not_found(response_id)
        return deleted_object(response_id)

    async def cancel(self, owner: str, response_id: str) -> dict[str, Any]:
        """Cancel a background response (idempotent); its run, wherever it is, stops at its next poll."""
        record = await self.store.get(owner, response_id)
        if record is None:
            raise not_found(response_id)
        if not record.response.get("background"):
            raise invalid_request("only background responses can be cancelled", "response_id")
        if record.status in ("completed", "incomplete", "failed"):
            raise invalid_request(f"cannot cancel a response whose status is {record.status}", "response_id")
        cancelled = await self.store.request_cancel(owner, response_id)
        if cancelled is None:
            raise not_found(response_id)
        return cancelled.response


def store_description(url: str) -> str:
    """The database's URL without its password, for the log."""
    return make_url(url).render_as_string(hide_password=True)
