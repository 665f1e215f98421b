"""The Responses service over a real store (a SQLite file) and a scripted generation: a foreground run is
stored before its terminal event; background runs go queued -> in_progress -> completed, and a cancel
through the store (as from another worker) stops one and keeps what it had; the stream of a stored
response replays and follows; another owner gets 404s; the previous response's items come back first."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
import pytest

from frontend.generation.serving import TextDelta, UsageCounter
from frontend.api_types.errors import OpenAIError
from frontend.responses_api.request import ResponsesRequest
from frontend.responses_api.run import ResponseRun
from frontend.responses_api.service import LazyStore, ResponsesService, database_url, store_description
from frontend.settings import Settings
from tests.conftest import PostgreSQLServer
from frontend.responses_api.store import ResponseStore

class ScriptedGeneration:
    """The serving layer's Generation as the run uses it: deltas, then (optionally) a wait that only a
    cancel ends, or a failure."""

    def __init__(self, deltas: list[TextDelta], hold: bool = False, fail: OpenAIError | None = None):
        self.usage = UsageCounter(prompt_tokens=5)
        self.deltas, self.hold, self.fail = deltas, hold, fail
        self.started = anyio.Event()

    async def run(self, on_delta: Callable[[int, TextDelta], Awaitable[None]]) -> None:
        self.started.set()
        for delta in self.deltas:
            self.usage.completion_tokens += 1
            await on_delta(0, delta)
        if self.hold:
            await anyio.sleep_forever()
        if self.fail is not None:
            raise self.fail


@contextlib.asynccontextmanager
async def opened(tmp_path: Path) -> AsyncIterator[ResponsesService]:
    """The service over a fresh store, its background runs in a task group of the test's own task."""
    store = await ResponseStore.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    try:
        async with anyio.create_task_group() as group:
            yield ResponsesService(store, group, poll_s=0.01)
            group.cancel_scope.cancel()
    finally:
        await store.close()


async def new_run(service: ResponsesService, owner: str = "alice", **fields: Any) -> tuple[ResponseRun, Any]:
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})
    prepared, chat, messages = await service.prepare(req, owner)
    return service.run(prepared, "m", None), messages


async def start_held(service: ResponsesService, run: ResponseRun) -> anyio.Event:
    """Run `run` in the background on a generation that says "partial" and then holds until cancelled; once
    it is in_progress, the event its end sets (when it gives back what it held)."""
    released = anyio.Event()
    generation = ScriptedGeneration([TextDelta("partial", None)], hold=True)

    async def start() -> Any:
        return generation

    await service.start_background(run, start, released.set)
    await wait_status(service, run.id, "in_progress")
    return released


async def test_a_foreground_run_is_stored_before_its_terminal_event(tmp_path: Path) -> None:
    async with opened(tmp_path) as service:
        run, _ = await new_run(service, stream=True)
        run.begin()
        seen_at_terminal: list[Any] = []

        async def flush() -> None:
            if run.events[-1]["type"] == "response.completed":
                seen_at_terminal.append(await service.store.get("alice", run.id))

        final = await run.execute(ScriptedGeneration([TextDelta("Hel", None), TextDelta("lo", "stop")]), flush,
                                  lambda: service.save_final(run))
        assert final["status"] == "completed" and final["usage"]["output_tokens"] == 2
        assert seen_at_terminal == [] or seen_at_terminal[0] is not None
        stored = await service.store.get("alice", run.id)
        assert stored.response == final and stored.events == run.events
        assert [e["sequence_number"] for e in stored.events] == list(range(len(stored.events)))
        assert stored.input_items[0]["content"] == [{"type": "input_text", "text": "hi"}]


async def test_a_failed_foreground_run_is_stored_as_failed_with_its_error_event(tmp_path: Path) -> None:
    async with opened(tmp_path) as service:
        run, _ = await new_run(service, stream=True)
        run.begin()
        with pytest.raises(OpenAIError):
            await run.execute(ScriptedGeneration([TextDelta("Hal", None)], fail=OpenAIError(500, "engine died")),
                              save=lambda: service.save_final(run))
        assert [e["type"] for e in run.events[-2:]] == ["error", "response.failed"]
        stored = await service.store.get("alice", run.id)
        assert stored.status == "failed" and stored.response["error"]["message"] == "engine died"
        assert stored.response["output"][0]["status"] == "incomplete"


async def wait_status(service: ResponsesService, response_id: str, status: str) -> dict[str, Any]:
    with anyio.fail_after(10):
        while (record := await service.store.get("alice", response_id)).status != status:
            await anyio.sleep(0.01)
    return record.response


async def test_a_background_run_completes_and_gives_back_what_it_held(tmp_path: Path) -> None:
    async with opened(tmp_path) as service:
        run, _ = await new_run(service, background=True)
        released = anyio.Event()
        generation = ScriptedGeneration([TextDelta("done", "stop")])

        async def start() -> Any:
            return generation

        await service.start_background(run, start, released.set)
        assert (await service.store.get("alice", run.id)).status in ("queued", "in_progress", "completed")
        final = await wait_status(service, run.id, "completed")
        assert final["output"][0]["content"][0]["text"] == "done" and final["background"] is True
        with anyio.fail_after(10):
            await released.wait()
        assert run.id not in service.runs
        with pytest.raises(OpenAIError) as refused:
            await service.cancel("alice", run.id)
        assert refused.value.status == 400


async def test_a_cancel_through_the_store_stops_a_background_run(tmp_path: Path) -> None:
    async with opened(tmp_path) as service:
        run, _ = await new_run(service, background=True, stream=True)
        released = await start_held(service, run)
        cancelled = await service.cancel("alice", run.id)
        assert cancelled["status"] == "cancelled"
        with anyio.fail_after(10):
            await released.wait()  # the run saw the flag, ended and gave back its slot
        record = await service.store.get("alice", run.id)
        assert record.status == "cancelled" and record.response["output"][0]["content"][0]["text"] == "partial"
        assert record.response["usage"]["output_tokens"] == 1
        assert (await service.cancel("alice", run.id))["status"] == "cancelled"  # idempotent


async def test_a_failed_start_fails_the_background_run(tmp_path: Path) -> None:
    async with opened(tmp_path) as service:
        run, _ = await new_run(service, background=True)
        released = anyio.Event()

        async def start() -> Any:
            raise OpenAIError(429, "busy", "server_error")

        await service.start_background(run, start, released.set)
        final = await wait_status(service, run.id, "failed")
        assert final["error"]["message"] == "busy"


async def test_a_stored_stream_replays_and_a_running_one_is_followed(tmp_path: Path) -> None:
    async with opened(tmp_path) as service:
        run, _ = await new_run(service, background=True, stream=True)
        generation = ScriptedGeneration([TextDelta("a", None), TextDelta("b", None)], hold=True)
        gate = anyio.Event()

        async def start() -> Any:
            await gate.wait()
            return generation

        released = anyio.Event()
        await service.start_background(run, start, released.set)
        followed: list[dict[str, Any]] = []

        async def follow() -> None:
            async for event in await service.follow("alice", run.id, 0):
                followed.append(event)

        async with anyio.create_task_group() as group:
            group.start_soon(follow)
            gate.set()
            await wait_status(service, run.id, "in_progress")
            await service.cancel("alice", run.id)
        assert [e["sequence_number"] for e in followed] == list(range(1, len(run.events)))
        assert "response.output_text.delta" in [e["type"] for e in followed]
        with anyio.fail_after(10):
            await released.wait()  # the run has ended and stored its last events
        replayed = [e async for e in await service.follow("alice", run.id, 3)]  # from the store
        assert replayed == (await service.store.get("alice", run.id)).events[4:]


async def test_another_owner_gets_404s_and_a_chain_starts_with_the_previous_items(tmp_path: Path) -> None:
    async with opened(tmp_path) as service:
        run, _ = await new_run(service, instructions="first instructions")
        run.begin()
        await run.execute(ScriptedGeneration([TextDelta("answer", "stop")]), save=lambda: service.save_final(run))
        for attempt in (service.get("bob", run.id), service.delete("bob", run.id), service.cancel("bob", run.id),
                        service.input_items("bob", run.id, None, 20, "desc"),
                        new_run(service, "bob", previous_response_id=run.id)):
            with pytest.raises(OpenAIError) as refused:
                await attempt
            assert refused.value.status == 404
        _, messages = await new_run(service, previous_response_id=run.id, input="next")
        # Instructions are not carried over from the previous response.
        assert [(m["role"], m["content"]) for m in messages] == [("user", "hi"), ("assistant", "answer"),
                                                                 ("user", "next")]
        assert (await service.delete("alice", run.id))["deleted"] is True


# ----- the store unavailable; limits on what is stored (issue 50) -------------------------------------------

async def test_an_unavailable_store_is_a_503_with_retry_after_until_it_opens(tmp_path: Path) -> None:
    """The database cannot be opened (its folder is a file here): every call needing it is a 503 with
    Retry-After, one open attempt per retry period; once it can be opened, the next call after that opens it."""
    blocker = tmp_path / "db"
    blocker.write_text("not a folder")
    attempts = 0

    async def opener() -> ResponseStore:
        nonlocal attempts
        attempts += 1
        return await ResponseStore.open(f"sqlite:///{blocker / 'r.sqlite3'}")

    stores = LazyStore(opener, "test", retry_s=0.2)
    service = ResponsesService(stores)
    try:
        for call in (lambda: service.get("alice", "resp_x"), lambda: new_run(service),
                     lambda: service.input_items("alice", "resp_x", None, 20, "desc")):
            with pytest.raises(OpenAIError) as refused:
                await call()
            assert refused.value.status == 503 and int(refused.value.headers["Retry-After"]) >= 1
        assert attempts == 1  # the later calls, within the retry period, did not try again
        run, _ = await new_run(service, store=False)  # a response that stores nothing needs no store
        blocker.unlink()
        with anyio.fail_after(10):
            while True:
                try:
                    await service.get("alice", "resp_x")
                except OpenAIError as exc:
                    if exc.status == 404:
                        break
                    assert exc.status == 503
                await anyio.sleep(0.05)
        assert stores.current is not None and attempts >= 2
    finally:
        await stores.close()


async def test_input_too_large_to_store_is_refused_before_it_runs(tmp_path: Path) -> None:
    store = await ResponseStore.open(f"sqlite:///{tmp_path / 'r.sqlite3'}", max_bytes=2000)
    try:
        service = ResponsesService(store)
        with pytest.raises(OpenAIError) as refused:
            await new_run(service, input="x" * 3000)
        assert refused.value.status == 400 and refused.value.param == "input"
        run, _ = await new_run(service, input="x" * 3000, store=False)  # not stored: fine
    finally:
        await store.close()


async def test_a_chain_past_the_byte_bound_is_a_400_naming_previous_response_id(tmp_path: Path) -> None:
    async with opened(tmp_path) as service:
        service.max_chain_bytes = 1500
        previous = None
        for turn in range(20):
            fields = {"input": f"turn {turn} " + "y" * 200}
            if previous is not None:
                fields["previous_response_id"] = previous
            try:
                run, _ = await new_run(service, **fields)
            except OpenAIError as exc:
                assert exc.status == 400 and exc.param == "previous_response_id" and exc.code == "chain_too_large"
                assert turn > 1  # a few turns fit first
                break
            run.begin()
            await run.execute(ScriptedGeneration([TextDelta("ok", "stop")]), save=lambda: service.save_final(run))
            previous = run.id
        else:
            raise AssertionError("the chain was never refused")


@pytest.mark.parametrize("background", [False, True])
async def test_a_response_over_the_size_cap_is_kept_without_its_events(tmp_path: Path, background: bool) -> None:
    """Its events (one per token here) pass the cap; the response and its output do not: it is stored,
    completed, without its stream (a replay is a 400); a follower of the background run still ends."""
    store = await ResponseStore.open(f"sqlite:///{tmp_path / 'r.sqlite3'}", max_bytes=6000)
    deltas = [TextDelta("w", None) for _ in range(60)] + [TextDelta(".", "stop")]
    try:
        async with anyio.create_task_group() as group:
            service = ResponsesService(store, group, poll_s=0.01)
            run, _ = await new_run(service, stream=True, background=background)
            if background:
                async def start() -> Any:
                    return ScriptedGeneration(deltas)

                released = anyio.Event()
                await service.start_background(run, start, released.set)
                with anyio.fail_after(10):
                    await released.wait()
            else:
                run.begin()
                await run.execute(ScriptedGeneration(deltas), save=lambda: service.save_final(run))
            stored = await store.get("alice", run.id)
            assert stored.status == "completed" and stored.events is None
            assert stored.response["output"][0]["content"][0]["text"] == "w" * 60 + "."
            with pytest.raises(OpenAIError) as refused:
                await service.follow("alice", run.id, None)
            assert refused.value.status == 400
            group.cancel_scope.cancel()
    finally:
        await store.close()


async def test_a_follower_of_a_run_whose_process_died_ends_failed(tmp_path: Path) -> None:
    """A background stream left in_progress by a process that died (as kill -9 leaves it: no heartbeat
    since): a follower in another process ends with `response.failed` once the heartbeat is stale."""
    store = await ResponseStore.open(f"sqlite:///{tmp_path / 'r.sqlite3'}", stale_after_s=0.3)
    try:
        async with anyio.create_task_group() as group:
            dead = ResponsesService(store, group, poll_s=0.01)
            run, _ = await new_run(dead, background=True, stream=True)
            run.begin()
            run.start()
            await run.create()  # and then its process "dies": nothing more is written
            follower = ResponsesService(store, poll_s=0.01)  # another process's service: not running it
            with anyio.fail_after(10):
                followed = [e async for e in await follower.follow("alice", run.id, None)]
            assert [e["type"] for e in followed] == ["response.created", "response.in_progress", "response.failed"]
            assert followed[-1]["response"]["error"]["code"] == "server_error"
            assert (await follower.get("alice", run.id))["status"] == "failed"
            group.cancel_scope.cancel()
    finally:
        await store.close()


async def test_a_run_found_dead_while_its_process_was_silent_stops_and_stays_failed(tmp_path: Path) -> None:
    """A worker silent past the window (stopped, starved) whose run another reader found dead: its run is told
    to stop at its next poll, gives back what it held, and what it would still write changes nothing."""
    now = [1_000_000.0]
    store = await ResponseStore.open(f"sqlite:///{tmp_path / 'r.sqlite3'}", clock=lambda: now[0], stale_after_s=30)
    try:
        async with anyio.create_task_group() as group:
            service = ResponsesService(store, group, poll_s=0.01)
            run, _ = await new_run(service, background=True, stream=True)
            released = await start_held(service, run)
            now[0] += 31  # silent for longer than the window, as far as the database can tell
            follower = ResponsesService(store, poll_s=0.01)  # another process's service
            assert (await follower.get("alice", run.id))["status"] == "failed"
            with anyio.fail_after(10):
                await released.wait()
            assert run.id not in service.runs
            stored = await store.get("alice", run.id)
            assert stored.status == "failed" and stored.response["error"]["code"] == "server_error"
            assert stored.events is not None and stored.events[-1]["type"] == "response.failed"
            group.cancel_scope.cancel()
    finally:
        await store.close()


async def test_a_database_outage_under_a_background_run_is_logged_once(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    async with opened(tmp_path) as service:
        run, _ = await new_run(service, background=True)
        released = await start_held(service, run)
        failures, enough = 0, anyio.Event()

        async def unreachable(response_id: str) -> bool:
            nonlocal failures
            failures += 1
            if failures >= 20:
                enough.set()
            raise OSError("connection refused")

        with caplog.at_level(logging.INFO, logger="frontend"):
            service.store.cancel_requested = unreachable  # type: ignore[method-assign]
            with anyio.fail_after(10):
                await enough.wait()  # 20 polls failed
            del service.store.cancel_requested  # back
            assert (await service.cancel("alice", run.id))["status"] == "cancelled"
            with anyio.fail_after(10):
                await released.wait()
        lines = [record.getMessage() for record in caplog.records]
        assert sum("stored responses unavailable" in line for line in lines) == 1, lines
        assert sum("available again" in line for line in lines) == 1, lines
        assert not [line for line in lines if "polling the store failed" in line], lines


def test_the_database_password_comes_from_a_file_or_the_environment(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Kubernetes or compose secret holds the password (a mounted file, or an env var from a secretKeyRef);
    the URL in the manifest has none. The log never shows it."""
    dsn = "postgresql+asyncpg://app@db:5432/responses"
    monkeypatch.setenv("RESPONSES_DB_URL", dsn)
    secret = tmp_path / "password"
    secret.write_text("p@ss:w/rd\n")
    monkeypatch.setenv("RESPONSES_DB_PASSWORD_FILE", str(secret))
    url = database_url(Settings())
    assert url.password == "p@ss:w/rd" and url.host == "db" and url.database == "responses"
    assert "p@ss" not in store_description(url)
    monkeypatch.delenv("RESPONSES_DB_PASSWORD_FILE")
    monkeypatch.setenv("RESPONSES_DB_PASSWORD", "from-env")
    settings = Settings()
    assert database_url(settings).password == "from-env" and "from-env" not in repr(settings)
    monkeypatch.setenv("RESPONSES_DB_PASSWORD_FILE", str(secret))
    with pytest.raises(ValueError, match="not both"):
        Settings()
    monkeypatch.delenv("RESPONSES_DB_PASSWORD_FILE")
    monkeypatch.delenv("RESPONSES_DB_PASSWORD")
    assert database_url(Settings()).render_as_string(hide_password=False) == dsn  # none set: the URL as given
    monkeypatch.delenv("RESPONSES_DB_URL")
    default = database_url(Settings())  # never relative to the working directory
    assert default.get_backend_name() == "sqlite" and Path(default.database).is_absolute()


async def test_a_postgresql_that_stops_is_a_503_and_is_used_again_once_back(tmp_path: Path) -> None:
    """The store is open; its server stops: what needs it (a stored response before it runs, a GET) is a
    503 with Retry-After, never a 500 or an answer that is then not stored; the server back, all works."""
    server = PostgreSQLServer()
    store = None
    try:
        store = await ResponseStore.open(server.url)
        service = ResponsesService(store)
        await new_run(service)
        server.stop()
        for call in (lambda: new_run(service), lambda: service.get("alice", "resp_x"),
                     lambda: new_run(service, previous_response_id="resp_x")):
            with pytest.raises(OpenAIError) as refused:
                await call()
            assert refused.value.status == 503 and "Retry-After" in refused.value.headers
        server.start()
        await new_run(service)
        with pytest.raises(OpenAIError) as missing:
            await service.get("alice", "resp_x")
        assert missing.value.status == 404
    finally:
        if store is not None:
            await store.close()
        server.close()
