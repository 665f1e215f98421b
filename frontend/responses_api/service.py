"""The Responses serving class: a request made into the chat request the chat pipeline runs, its run in
the foreground or the background, and the stored responses' endpoints.

The HTTP router (frontend/http/responses_routes.py) picks the model, plans and admits the chat request
with the chat route's own steps, and hands the generation over; everything Responses-specific is here.

Stored responses belong to the API key that created them (`owner`: its key id, "" on an open server):
every read, delete and cancel is scoped to it in the store, so another key's id is a 404, never content.

Background responses run in this process's task group, after the HTTP request has returned; a cancel
(from any worker process: it is a flag in the store) is seen by the run, which polls for it every
`poll_s` and then saves its stream's new events too (so that another process can follow the stream).
On shutdown the runs still going are cancelled and stored as failed; a run whose process dies without
shutting down (kill -9, OOM) stops refreshing its heartbeat, and readers find it failed (store.py).

The store never takes the server down (`LazyStore`): it is opened on first need, not at start-up, and a
database that is down, unreachable or misconfigured makes /v1/responses answer 503 with Retry-After while
chat and completions serve as usual; it is opened again (or reconnects) by itself once the database is back.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import anyio
from anyio.abc import TaskGroup
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError

from frontend.generation.serving import Generation
from frontend.api_types.errors import OpenAIError, invalid_request
from frontend.api_types.request_bodies import ChatCompletionRequest, ChatMessage, JsonSchemaFormat, ResponseFormat
from frontend.responses_api.conversation import conversation_messages, stored_item
from frontend.responses_api import events
from frontend.responses_api.events import Event
from frontend.responses_api.objects import TERMINAL_STATUSES, deleted_object, item_list, new_id, now, request_echo
from frontend.responses_api.output import TokenStrings
from frontend.responses_api.request import ResponsesRequest
from frontend.responses_api.run import Prepared, ResponseRun
from frontend.responses_api.store import ChainTooLong, ResponseStore, ResponseTooLarge, StoredResponse, json_size
from frontend.responses_api.tools import chat_tools
from frontend.settings import Settings

log = logging.getLogger("frontend")

POLL_S = 0.2  # a background run's cancel check (and a follower's check for new events of another process's run)
PURGE_INTERVAL_S = 3600.0
MAX_CONVERSATION_ITEMS = 4096  # a previous_response_id chain's items and this request's, together
STORE_RETRY_S = 2.0  # an unavailable store is tried again this long after a failed open (Retry-After)
# With `truncation: auto`, the chain is read newest first until it holds this many JSON bytes per token of
# context: far more than any prompt that fits (a token is a few bytes of text; its item JSON adds a little),
# so only history that could never fit is left unread. drop_oldest_turns then cuts it exactly.
CHAIN_BYTES_PER_CONTEXT_TOKEN = 32
# Whatever a query on the database raises when the database itself fails (connection refused or lost, a
# server shutting down, a timeout): a 503, never a 500. Errors of our own SQL would be DBAPIErrors too,
# but the unit tests run every statement on both backends.
DATABASE_ERRORS = (DBAPIError, OSError, TimeoutError)

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
            **chat_tools(req),  # tools, tool_choice (and a forced custom tool's regex): frontend/responses_api/tools.py
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


def store_unavailable(retry_after_s: float) -> OpenAIError:
    return OpenAIError(503, "stored responses are unavailable right now (the database cannot be reached); "
                       "try again later", "server_error", None, "service_unavailable",
                       {"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class LazyStore:
    """The store, opened by the first caller that needs it and again after a failure (module docstring).

    One open at a time (a lock); a failed one is not retried before `retry_s` (each caller meanwhile gets
    a 503 whose Retry-After says when), so a down database costs one connection attempt per `retry_s`,
    not one per request. Each distinct reason is logged once, with what it means for the server."""

    def __init__(self, opener: Callable[[], Awaitable[ResponseStore]], description: str,
                 retry_s: float = STORE_RETRY_S) -> None:
        self._opener, self.description, self.retry_s = opener, description, retry_s
        self.current: ResponseStore | None = None
        self._lock = anyio.Lock()
        self._next_try = -math.inf
        self._logged: str | None = None

    async def get(self) -> ResponseStore:
        if self.current is not None:
            return self.current
        async with self._lock:
            if self.current is None:
                wait = self._next_try - anyio.current_time()
                if wait > 0:
                    raise store_unavailable(wait)
                try:
                    self.current = await self._opener()
                except Exception as exc:
                    self._next_try = anyio.current_time() + self.retry_s
                    self.failed(exc)
                    raise store_unavailable(self.retry_s) from None
                log.info("stored responses: %s%s", self.description, " (available again)" if self._logged else "")
                self._logged = None
        return self.current

    @classmethod
    def of(cls, store: ResponseStore) -> "LazyStore":
        """One already open (tests, tools)."""
        async def opener() -> ResponseStore:
            return store

        lazy = cls(opener, "already open")
        lazy.current = store
        return lazy

    def failed(self, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        if reason != self._logged:
            self._logged = reason
            log.error("stored responses unavailable (%s): %s; /v1/responses answers 503 until the database is "
                      "back (retried every %g s); chat and completions are not affected",
                      self.description, reason, self.retry_s)

    def working(self) -> None:
        """A use succeeded: after a failure, say so (and log the next failure again)."""
        if self._logged is not None:
            self._logged = None
            log.info("stored responses: %s (available again)", self.description)

    async def close(self) -> None:
        if self.current is not None:
            await self.current.close()


class ResponsesService:
    def __init__(self, store: ResponseStore | LazyStore, group: TaskGroup | None = None, poll_s: float = POLL_S,
                 max_chain_bytes: int = 16 * 1024 * 1024):
        self.stores = LazyStore.of(store) if isinstance(store, ResponseStore) else store
        self.poll_s = poll_s
        self.max_chain_bytes = max_chain_bytes
        self._group = group
        self.runs: dict[str, ResponseRun] = {}  # background runs of this process, by id

    @property
    def store(self) -> ResponseStore:
        """The store if it is open (tests; the service itself awaits `database()`)."""
        assert self.stores.current is not None, "the store is not open"
        return self.stores.current

    @contextlib.asynccontextmanager
    async def database(self) -> AsyncIterator[ResponseStore]:
        """The store, for one use: opened if need be; unavailable, or failing on the database: a 503."""
        store = await self.stores.get()
        try:
            yield store
        except DATABASE_ERRORS as exc:
            self.stores.failed(exc)
            raise store_unavailable(self.stores.retry_s) from None
        self.stores.working()

    @classmethod
    @contextlib.asynccontextmanager
    async def running(cls, settings: Settings) -> AsyncIterator["ResponsesService"]:
        """Purge expired responses hourly (opening the store, in the background, right away) and run
        background responses; close all at the end. Nothing here waits for the database."""
        url = database_url(settings)

        async def opener() -> ResponseStore:
            return await ResponseStore.open(url, ttl_days=settings.responses_ttl_days,
                                            max_bytes=settings.responses_max_bytes,
                                            stale_after_s=settings.responses_stale_after_s)

        stores = LazyStore(opener, f"{store_description(url)}, kept {settings.responses_ttl_days:g} days")
        try:
            async with anyio.create_task_group() as group:
                service = cls(stores, group, max_chain_bytes=settings.responses_max_chain_bytes)
                group.start_soon(service._purge_forever)
                try:
                    yield service
                finally:
                    group.cancel_scope.cancel()
        finally:
            await stores.close()

    async def _purge_forever(self) -> None:
        while True:
            try:
                async with self.database() as store:
                    purged = await store.purge_expired()
            except OpenAIError:  # unavailable: logged; tried again at the next round or request
                pass
            except Exception:  # a database hiccup: try again at the next round
                log.exception("purging expired responses failed")
            else:
                if purged:
                    log.info("purged %d expired stored response(s)", purged)
            await anyio.sleep(PURGE_INTERVAL_S)

    # ----- creating a response ----------------------------------------------------------------------------
    async def prepare(self, req: ResponsesRequest, owner: str, context_length: int | None = None,
                      ) -> tuple[Prepared, ChatCompletionRequest, list[dict[str, Any]]]:
        """The request ready to run: stored input items, the chat request, and the chat template's messages
        (the previous responses' items first). 404 for a previous_response_id this owner cannot see; 400
        for input too large to store, or a chain past max_chain_bytes; 503 if the store is needed and
        unavailable. With `truncation: auto` and the model's `context_length`, only the newest part of a
        long chain is read (CHAIN_BYTES_PER_CONTEXT_TOKEN)."""
        items = [stored_item(item) for item in req.items]
        chain: list[dict[str, Any]] = []
        if req.store or req.previous_response_id is not None:
            async with self.database() as store:
                input_bytes = sum(json_size(item) for item in items)
                if req.store and input_bytes > store.max_bytes:
                    raise invalid_request(f"input: {input_bytes} bytes of JSON, too large to store (the limit is "
                                          f"{store.max_bytes}); send it with store: false", "input")
                if req.previous_response_id is not None:
                    chain = await self._chain(store, req, owner, input_bytes, context_length)
                elif not req.background:  # a foreground response writes only once it has run: is it reachable?
                    await store.ping()
        if not chain and not items:
            raise invalid_request("input is required (or a previous_response_id to continue)", "input")
        if len(chain) + len(items) > MAX_CONVERSATION_ITEMS:
            raise invalid_request(f"the conversation would hold {len(chain) + len(items)} items, more than this "
                                  f"server's limit of {MAX_CONVERSATION_ITEMS}", "input")
        messages = conversation_messages(chain, items, req.instructions)
        prepared = Prepared(req, new_id("resp"), now(), owner, items, request_echo(req))
        return prepared, chat_request(req, messages), messages

    async def _chain(self, store: ResponseStore, req: ResponsesRequest, owner: str, input_bytes: int,
                     context_length: int | None) -> list[dict[str, Any]]:
        previous = req.previous_response_id
        assert previous is not None
        chain_bytes = await store.chain_bytes(owner, previous)
        found = None
        if chain_bytes is not None:
            if chain_bytes + input_bytes > self.max_chain_bytes:
                raise invalid_request(f"the previous_response_id chain holds {chain_bytes} bytes of items; with this "
                                      f"input it would pass this server's limit of {self.max_chain_bytes}: start "
                                      "a new conversation (or send the history you need as input)",
                                      "previous_response_id", "chain_too_large")
            budget = (context_length * CHAIN_BYTES_PER_CONTEXT_TOKEN
                      if req.truncation == "auto" and context_length else None)
            try:
                found = await store.conversation(owner, previous, max_bytes=budget)
            except ChainTooLong as exc:
                raise invalid_request(str(exc), "previous_response_id") from None
        if found is None:
            raise OpenAIError(404, f"Previous response with id '{previous[:128]}' not found.",
                              "invalid_request_error", "previous_response_id", "previous_response_not_found")
        return found

    def run(self, prepared: Prepared, model: str, strings: TokenStrings | None) -> ResponseRun:
        """The run of a prepared request; its store is the open one if it needs it (prepare opened it)."""
        return ResponseRun(prepared, model, self.stores.current, strings)  # type: ignore[arg-type]


    async def save_final(self, run: ResponseRun) -> None:
        """A foreground run's one write (when stored), before its last event or its body is sent."""
        if run.prepared.request.store:
            try:
                await run.create_final()
            except DATABASE_ERRORS as exc:  # the answer is sent all the same; it is not stored
                self.stores.failed(exc)
                log.error("response %s was not stored: the database failed", run.id)

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
        except DATABASE_ERRORS as exc:
            release()
            self.stores.failed(exc)
            raise store_unavailable(self.stores.retry_s) from None
        except BaseException:
            release()
            raise
        log.info("background response %s runs in this process", run.id)  # the pid is in every log line
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
        """Until a cancel is requested (True; or the run was found dead meanwhile: `cancel_requested`): poll
        for it, and each time save the stream's new events (which refreshes the heartbeat), or else refresh
        the heartbeat when a third of the stale window has passed. A database that fails is logged once per
        reason (LazyStore.failed), not once per poll, and once when it works again."""
        saved = len(run.events)
        beat_s = run.store.stale_after_s / 3
        last_beat = anyio.current_time()
        while True:
            await anyio.sleep(self.poll_s)
            try:
                if await run.store.cancel_requested(run.id):
                    return True
                if run.keep_events and len(run.events) > saved and not run.done:
                    saved = len(run.events)
                    await run.update()
                    last_beat = anyio.current_time()
                elif anyio.current_time() - last_beat >= beat_s:
                    await run.store.heartbeat(run.id)
                    last_beat = anyio.current_time()
            except DATABASE_ERRORS as exc:  # the run goes on, and the next poll tries again
                self.stores.failed(exc)
                continue
            except Exception:  # a bug of ours: logged, and the next poll tries again
                log.exception("response %s: polling the store failed", run.id)
                continue
            self.stores.working()

    # ----- stored responses -------------------------------------------------------------------------------
    async def get(self, owner: str, response_id: str) -> dict[str, Any]:
        async with self.database() as store:
            record = await store.get(owner, response_id)
        if record is None:
            raise not_found(response_id)
        return record.response

    async def follow(self, owner: str, response_id: str, starting_after: int | None) -> AsyncIterator[Event]:
        """A stored stream's events past `starting_after`: replayed, then followed while the response runs
        (here, or in another process through the store). 400 if it was not created with stream=true."""
        after = -1 if starting_after is None else starting_after
        async with self.database() as store:
            record = await store.get(owner, response_id, events_after=after, items=False)
        if record is None:
            raise not_found(response_id)
        if record.events is None:
            raise invalid_request("this response was not created with stream=true: it has no stream to replay",
                                  "stream")
        return self._follow(store, owner, response_id, after, record)

    async def _follow(self, store: ResponseStore, owner: str, response_id: str, after: int,
                      record: StoredResponse) -> AsyncIterator[Event]:
        """Each poll reads only the events past the last one sent. A stream whose events were dropped as too
        large while it ran (another process's run) ends with a terminal event made from the stored response."""
        while True:
            local = self.runs.get(response_id)
            if local is not None:  # running here: its events as they come
                async for event in local.follow(after):
                    yield event
                return
            for event in record.events or []:
                after = event["sequence_number"]
                yield event
            if record.status in TERMINAL_STATUSES:
                if record.events is None and record.status != "cancelled":
                    yield events.numbered(events.response_event(record.status, record.response), after + 1)
                return
            await anyio.sleep(self.poll_s)
            try:
                found = await store.get(owner, response_id, events_after=after, items=False)
            except DATABASE_ERRORS as exc:
                self.stores.failed(exc)
                return
            if found is None:
                return
            record = found

    async def input_items(self, owner: str, response_id: str, after: str | None, limit: int,
                          order: str) -> dict[str, Any]:
        async with self.database() as store:
            page = await store.input_items(owner, response_id, after=after, limit=limit, order=order)
        if page is None:
            raise not_found(response_id)
        return item_list(*page)

    async def delete(self, owner: str, response_id: str) -> dict[str, Any]:
        async with self.database() as store:
            deleted = await store.delete(owner, response_id)
        if not deleted:
            raise not_found(response_id)
        return deleted_object(response_id)

    async def cancel(self, owner: str, response_id: str) -> dict[str, Any]:
        """Cancel a background response (idempotent); its run, wherever it is, stops at its next poll."""
        async with self.database() as store:
            record = await store.get(owner, response_id, items=False)
            if record is None:
                raise not_found(response_id)
            if not record.response.get("background"):
                raise invalid_request("only background responses can be cancelled", "response_id")
            if record.status in ("completed", "incomplete", "failed"):
                raise invalid_request(f"cannot cancel a response whose status is {record.status}", "response_id")
            cancelled = await store.request_cancel(owner, response_id)
        if cancelled is None:
            raise not_found(response_id)
        return cancelled.response


def database_url(settings: Settings) -> URL:
    """RESPONSES_DB_URL with the password from RESPONSES_DB_PASSWORD_FILE or RESPONSES_DB_PASSWORD when one
    is set (so a Kubernetes or compose secret holds it, not the manifest). Read once per process start."""
    url = make_url(settings.responses_db_url)
    if settings.responses_db_password_file is not None:
        password = settings.responses_db_password_file.read_text(encoding="utf-8").strip()
    elif settings.responses_db_password is not None:
        password = settings.responses_db_password.get_secret_value()
    else:
        return url
    return url.set(password=password)


def store_description(url: str | URL) -> str:
    """The database's URL without its password, for the log."""
    return make_url(url).render_as_string(hide_password=True)
