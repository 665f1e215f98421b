"""The stored responses of /v1/responses (frontend/responses_api/store.py), against both backends.

Every test runs on a SQLite file and on a real PostgreSQL database (tests/conftest.py starts the server;
each test gets a fresh database). Time is an injected clock, never a sleep; "several workers" are several
ResponseStore instances on one database, and once a separate Python process.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import uuid
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from frontend.responses_api.store import (MAX_CHAIN_LENGTH, MIGRATIONS, SCHEMA_VERSION, STALE_ERROR, ChainTooLong,
                                      ResponseStore, ResponseTooLarge, StoredResponse, _dumps, json_size,
                                      normalize_url)

REPO_ROOT = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000  # created_at of the records below
DAY = 86400


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["sqlite", "postgresql"])
async def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A fresh, empty database of each backend, as the plain (non-async-driver) URL an operator writes."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'responses.db'}"
        return
    server_url = make_url(request.getfixturevalue("postgresql_url"))
    name = f"t_{uuid.uuid4().hex}"
    admin = create_async_engine(server_url.set(drivername="postgresql+asyncpg"), isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as conn:
            await conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield server_url.set(database=name).render_as_string(hide_password=False)
        async with admin.connect() as conn:
            await conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    finally:
        await admin.dispose()


StoreFactory = Callable[..., Awaitable[ResponseStore]]


@pytest.fixture
async def open_store(db_url: str) -> AsyncIterator[StoreFactory]:
    """Opens stores on the test's database (as many as a test wants: one per simulated worker)."""
    stores: list[ResponseStore] = []

    async def opener(**kwargs: object) -> ResponseStore:
        kwargs.setdefault("clock", Clock())
        store = await ResponseStore.open(db_url, **kwargs)  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield opener
    for store in stores:
        await store.close()


@pytest.fixture
async def store(open_store: StoreFactory) -> ResponseStore:
    return await open_store()


def record(response_id: str = "resp_1", *, owner: str = "alice", status: str = "completed",
           previous: str | None = None, created_at: int = T0, inputs: int = 2,
           events: list[dict] | None = None) -> StoredResponse:
    input_items = [{"id": f"{response_id}_in{i}", "type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": f"{response_id} input {i}"}]} for i in range(inputs)]
    output = [{"id": f"{response_id}_out", "type": "message", "role": "assistant",
               "content": [{"type": "output_text", "text": f"{response_id} answer"}]}]
    return StoredResponse(
        id=response_id, owner=owner, status=status,
        response={"id": response_id, "object": "response", "status": status, "output": output},
        input_items=input_items, output_items=output, previous_response_id=previous, created_at=created_at,
        events=events)


# ----- create / get -----

async def test_create_then_get_returns_every_field(store: ResponseStore) -> None:
    events = [{"type": "response.created", "sequence_number": 0},
              {"type": "response.completed", "sequence_number": 1}]
    stored = record(previous=None, events=events)
    await store.create(stored)
    assert await store.get("alice", "resp_1") == stored


async def test_get_of_an_unknown_id_is_none(store: ResponseStore) -> None:
    assert await store.get("alice", "resp_nope") is None


async def test_create_refuses_a_duplicate_id_and_an_unknown_status(store: ResponseStore) -> None:
    await store.create(record())
    with pytest.raises(ValueError, match="already stored"):
        await store.create(record())
    with pytest.raises(ValueError, match="unknown response status"):
        await store.create(record("resp_2", status="done"))
    assert await store.get("alice", "resp_2") is None


async def test_text_outside_ascii_and_lone_surrogates_round_trip(store: ResponseStore) -> None:
    stored = record()
    stored.response["instructions"] = "日本語 \u0000 \ud800 é"
    await store.create(stored)
    assert (await store.get("alice", "resp_1")).response["instructions"] == "日本語 \u0000 \ud800 é"


# ----- owner isolation -----

async def test_another_owner_sees_nothing_and_changes_nothing(store: ResponseStore) -> None:
    await store.create(record("resp_1", status="in_progress"))
    await store.create(record("resp_2", previous="resp_1"))
    for other in ("mallory", "", "ALICE"):
        assert await store.get(other, "resp_1") is None
        assert await store.input_items(other, "resp_1") is None
        assert await store.conversation(other, "resp_2") is None
        assert await store.request_cancel(other, "resp_1") is None
        assert await store.update(other, "resp_1", status="failed", response={"hijacked": True},
                                  output_items=[]) is False
        assert await store.delete(other, "resp_1") is False
    still = await store.get("alice", "resp_1")
    assert still == record("resp_1", status="in_progress") and not still.cancel_requested
    assert await store.cancel_requested("resp_1") is False


async def test_a_chain_through_another_owners_response_is_not_visible(store: ResponseStore) -> None:
    await store.create(record("resp_1", owner="mallory"))
    await store.create(record("resp_2", previous="resp_1"))
    assert await store.conversation("alice", "resp_2") is None
    assert await store.conversation("mallory", "resp_2") is None
    assert await store.get("alice", "resp_2") is not None


async def test_an_over_the_cap_update_by_another_owner_is_just_missing(open_store: StoreFactory) -> None:
    store = await open_store(max_bytes=2000)
    await store.create(record(inputs=1))
    assert await store.update("mallory", "resp_1", status="completed", response={"x": "y" * 5000},
                              output_items=[]) is False


# ----- update -----

async def test_update_replaces_the_response_and_output(store: ResponseStore) -> None:
    events = [{"type": "response.created", "sequence_number": 0}]
    await store.create(record(status="in_progress", events=events))
    done = record(status="completed")
    done.output_items.append({"id": "extra", "type": "reasoning"})
    assert await store.update("alice", "resp_1", status="completed", response=done.response,
                              output_items=done.output_items) is True
    got = await store.get("alice", "resp_1")
    assert got.status == "completed" and got.response == done.response
    assert got.output_items == done.output_items
    assert got.events == events  # no new_events leaves the stored events as they were
    more = [{"type": "response.completed", "sequence_number": 1}]
    assert await store.update("alice", "resp_1", status="completed", response=done.response,
                              output_items=done.output_items, new_events=more) is False  # it has ended
    assert (await store.get("alice", "resp_1")).events == events


async def test_update_of_a_missing_or_deleted_response_is_false(store: ResponseStore) -> None:
    assert await store.update("alice", "resp_1", status="completed", response={}, output_items=[]) is False
    await store.create(record())
    assert await store.delete("alice", "resp_1")
    assert await store.update("alice", "resp_1", status="completed", response={}, output_items=[]) is False
    assert await store.get("alice", "resp_1") is None


async def test_update_refuses_an_unknown_status(store: ResponseStore) -> None:
    await store.create(record())
    with pytest.raises(ValueError, match="unknown response status"):
        await store.update("alice", "resp_1", status="done", response={}, output_items=[])


# ----- cancel -----

@pytest.mark.parametrize("status", ["queued", "in_progress"])
async def test_cancel_of_a_running_response_cancels_it(store: ResponseStore, status: str) -> None:
    await store.create(record(status=status))
    assert await store.cancel_requested("resp_1") is False
    cancelled = await store.request_cancel("alice", "resp_1")
    assert cancelled.status == "cancelled" and cancelled.response["status"] == "cancelled"
    assert cancelled.cancel_requested and await store.cancel_requested("resp_1") is True
    assert await store.get("alice", "resp_1") == cancelled


@pytest.mark.parametrize("status", ["completed", "incomplete", "failed", "cancelled"])
async def test_cancel_of_a_finished_response_keeps_its_status(store: ResponseStore, status: str) -> None:
    await store.create(record(status=status))
    after = await store.request_cancel("alice", "resp_1")
    assert after.status == status and after.response["status"] == status and after.cancel_requested


async def test_update_never_uncancels(store: ResponseStore) -> None:
    await store.create(record(status="in_progress"))
    await store.request_cancel("alice", "resp_1")
    partial = record(status="completed")  # the generating process finishing after the cancel
    for status in ("completed", "in_progress", "failed"):
        assert await store.update("alice", "resp_1", status=status, response=partial.response,
                                  output_items=partial.output_items) is True
        got = await store.get("alice", "resp_1")
        assert got.status == "cancelled" and got.response["status"] == "cancelled" and got.cancel_requested
        assert got.output_items == partial.output_items  # the output at the cancel is kept


async def test_cancel_requested_is_true_once_the_response_is_gone(store: ResponseStore) -> None:
    await store.create(record(status="in_progress"))
    assert await store.cancel_requested("resp_1") is False
    await store.delete("alice", "resp_1")
    assert await store.cancel_requested("resp_1") is True
    assert await store.request_cancel("alice", "resp_1") is None


# ----- delete -----

async def test_delete_removes_the_response_and_its_items(store: ResponseStore) -> None:
    await store.create(record("resp_1"))
    await store.create(record("resp_2", previous="resp_1"))
    assert await store.delete("alice", "resp_1") is True
    assert await store.delete("alice", "resp_1") is False
    assert await store.get("alice", "resp_1") is None and await store.input_items("alice", "resp_1") is None
    assert await store.conversation("alice", "resp_2") is None  # an ancestor is gone
    async with store._engine.connect() as conn:
        left = (await conn.execute(text("SELECT response_id FROM stored_response_input_items"))).scalars().all()
    assert set(left) == {"resp_2"}


# ----- retention -----

async def test_expired_responses_are_invisible_at_once_then_purged(open_store: StoreFactory) -> None:
    clock = Clock(T0)
    store = await open_store(ttl_days=2, clock=clock)
    await store.create(record("resp_old", created_at=T0))
    await store.create(record("resp_new", created_at=T0 + DAY, previous="resp_old"))
    clock.now = T0 + 2 * DAY - 1  # the last second of resp_old's life
    assert (await store.get("alice", "resp_old")) is not None
    assert len(await store.conversation("alice", "resp_new")) == 6
    clock.now = T0 + 2 * DAY
    assert await store.get("alice", "resp_old") is None
    assert await store.input_items("alice", "resp_old") is None
    assert await store.request_cancel("alice", "resp_old") is None
    assert await store.delete("alice", "resp_old") is False
    assert await store.update("alice", "resp_old", status="completed", response={}, output_items=[]) is False
    assert await store.conversation("alice", "resp_new") is None  # an ancestor expired
    assert await store.get("alice", "resp_new") is not None
    assert await store.purge_expired() == 1
    assert await store.purge_expired() == 0
    clock.now = T0  # back in time: the rows are gone, not just hidden
    assert await store.get("alice", "resp_old") is None
    async with store._engine.connect() as conn:
        items = (await conn.execute(text("SELECT DISTINCT response_id FROM stored_response_input_items")))
        assert set(items.scalars().all()) == {"resp_new"}


async def test_an_infinite_ttl_keeps_everything(open_store: StoreFactory) -> None:
    clock = Clock(T0)
    store = await open_store(ttl_days=math.inf, clock=clock)
    await store.create(record(created_at=0))
    clock.now = T0 * 10
    assert await store.get("alice", "resp_1") is not None
    assert await store.purge_expired() == 0


async def test_open_refuses_nonsense_limits(db_url: str) -> None:
    for kwargs in ({"ttl_days": 0}, {"ttl_days": -1}, {"max_bytes": 0}, {"max_chain_length": 0}):
        with pytest.raises(ValueError):
            await ResponseStore.open(db_url, **kwargs)  # type: ignore[arg-type]


def stored_size(stored: StoredResponse) -> int:
    """What the cap counts: the JSON of response, input items and events."""
    return (_dumps(stored.response)[1] + sum(_dumps(item)[1] for item in stored.input_items)
            + (_dumps(stored.events)[1] if stored.events is not None else 0))


async def test_the_size_cap_on_create(open_store: StoreFactory) -> None:
    exact = record(events=[{"type": "response.created", "sequence_number": 0}])
    store = await open_store(max_bytes=stored_size(exact))
    await store.create(exact)  # exactly at the cap: stored
    big = record("resp_big", events=exact.events)
    big.response["padding"] = "x"
    with pytest.raises(ResponseTooLarge, match=r"resp_big would store \d+ bytes .* over the \d+-byte cap"):
        await store.create(big)
    assert isinstance(ResponseTooLarge("x"), ValueError)
    assert await store.get("alice", "resp_big") is None


async def test_the_size_cap_on_update(open_store: StoreFactory) -> None:
    first = record(status="in_progress")
    store = await open_store(max_bytes=stored_size(first) + 100)
    await store.create(first)
    grown = record(status="completed")
    grown.response["padding"] = "x" * 200
    with pytest.raises(ResponseTooLarge, match="resp_1"):
        await store.update("alice", "resp_1", status="completed", response=grown.response, output_items=[])
    # events count as well, the stored ones included when the update leaves them as they are
    with pytest.raises(ResponseTooLarge):
        await store.update("alice", "resp_1", status="completed", response=first.response, output_items=[],
                           new_events=[{"type": "x" * 200, "sequence_number": 0}])
    assert await store.get("alice", "resp_1") == first  # nothing changed
    small_events = [{"type": "e", "sequence_number": 0}]
    assert await store.update("alice", "resp_1", status="completed", response=first.response,
                              output_items=first.output_items, new_events=small_events)


# ----- the chain -----

async def test_conversation_rebuilds_the_chain_oldest_first(store: ResponseStore) -> None:
    first, second, third = (record("resp_a", inputs=2), record("resp_b", previous="resp_a", inputs=1),
                            record("resp_c", previous="resp_b", inputs=3))
    for stored in (third, first, second):  # the insertion order does not matter
        await store.create(stored)
    expected = [item for stored in (first, second, third) for item in stored.input_items + stored.output_items]
    assert await store.conversation("alice", "resp_c") == expected
    assert await store.conversation("alice", "resp_a") == first.input_items + first.output_items
    assert await store.conversation("alice", "resp_nope") is None


async def test_conversation_of_a_missing_ancestor_is_none(store: ResponseStore) -> None:
    await store.create(record("resp_b", previous="resp_never_stored"))
    assert await store.conversation("alice", "resp_b") is None


async def test_conversation_uses_the_latest_output(store: ResponseStore) -> None:
    await store.create(record("resp_a", status="in_progress"))
    final = [{"id": "final", "type": "message"}]
    await store.update("alice", "resp_a", status="completed", response={"output": final}, output_items=final)
    assert (await store.conversation("alice", "resp_a"))[-1] == final[0]


async def test_a_chain_longer_than_the_limit_is_refused(open_store: StoreFactory) -> None:
    store = await open_store(max_chain_length=3)
    await store.create(record("resp_0", inputs=1))
    for i in range(1, 5):
        await store.create(record(f"resp_{i}", previous=f"resp_{i - 1}", inputs=1))
    assert len(await store.conversation("alice", "resp_2")) == 6  # 3 responses: at the limit
    with pytest.raises(ChainTooLong, match="longer than 3 responses"):
        await store.conversation("alice", "resp_3")
    with pytest.raises(ChainTooLong):
        await store.conversation("alice", "resp_4")
    assert MAX_CHAIN_LENGTH >= 100


async def test_a_loop_in_the_chain_is_refused_not_followed_forever(store: ResponseStore) -> None:
    await store.create(record("resp_a", previous="resp_b"))
    await store.create(record("resp_b", previous="resp_a"))
    with pytest.raises(ChainTooLong):
        await store.conversation("alice", "resp_b")


# ----- input items -----

async def test_input_items_pages_like_openai(store: ResponseStore) -> None:
    stored = record(inputs=5)
    await store.create(stored)
    ids = [item["id"] for item in stored.input_items]

    async def page(**kwargs: object) -> tuple[list[str], bool]:
        items, has_more = await store.input_items("alice", "resp_1", **kwargs)  # type: ignore[misc, arg-type]
        return [item["id"] for item in items], has_more

    assert await page() == (ids[::-1], False)  # default: desc, 20
    assert await page(limit=2) == ([ids[4], ids[3]], True)
    assert await page(limit=2, after=ids[3]) == ([ids[2], ids[1]], True)
    assert await page(limit=2, after=ids[1]) == ([ids[0]], False)
    assert await page(after=ids[0]) == ([], False)
    assert await page(order="asc", limit=2) == (ids[:2], True)
    assert await page(order="asc", limit=2, after=ids[1]) == (ids[2:4], True)
    assert await page(order="asc", limit=1, after=ids[3]) == ([ids[4]], False)
    assert await page(order="asc", limit=5) == (ids, False)
    assert await page(after="not_an_item") == ([], False)
    assert (await store.input_items("alice", "resp_1", limit=1))[0] == [stored.input_items[4]]  # whole items
    for bad in ({"limit": 0}, {"limit": 101}, {"order": "up"}):
        with pytest.raises(ValueError):
            await store.input_items("alice", "resp_1", **bad)  # type: ignore[arg-type]


async def test_a_response_without_input_items_has_an_empty_page(store: ResponseStore) -> None:
    await store.create(record(inputs=0))
    assert await store.input_items("alice", "resp_1") == ([], False)


# ----- several workers on one database -----

async def test_two_stores_on_one_database_see_each_others_writes(open_store: StoreFactory) -> None:
    worker_a, worker_b = await open_store(), await open_store()
    await worker_a.create(record(status="in_progress"))
    assert (await worker_b.get("alice", "resp_1")).status == "in_progress"
    assert (await worker_b.request_cancel("alice", "resp_1")).status == "cancelled"
    assert await worker_a.cancel_requested("resp_1") is True  # the generating worker sees it
    assert await worker_a.update("alice", "resp_1", status="completed", response={"output": []},
                                 output_items=[]) is True
    assert (await worker_b.get("alice", "resp_1")).status == "cancelled"
    assert await worker_b.delete("alice", "resp_1") is True
    assert await worker_a.get("alice", "resp_1") is None


async def test_concurrent_writers_on_one_database_all_land(open_store: StoreFactory) -> None:
    worker_a, worker_b = await open_store(), await open_store()
    await asyncio.gather(*(worker.create(record(f"resp_{name}_{i}", status="in_progress"))
                           for i in range(15) for name, worker in (("a", worker_a), ("b", worker_b))))
    await asyncio.gather(*(worker.update("alice", f"resp_{name}_{i}", status="completed", response={},
                                         output_items=[])
                           for i in range(15) for name, worker in (("b", worker_a), ("a", worker_b))))
    for i in range(15):
        for name in "ab":
            assert (await worker_a.get("alice", f"resp_{name}_{i}")).status == "completed"


async def test_another_process_cancels_what_this_one_runs(store: ResponseStore, db_url: str) -> None:
    await store.create(record(status="in_progress"))
    script = ("import asyncio, sys\n"
              "from frontend.responses_api.store import ResponseStore\n"
              "async def main():\n"
              "    store = await ResponseStore.open(sys.argv[1], clock=lambda: 1_800_000_000)\n"
              "    cancelled = await store.request_cancel('alice', 'resp_1')\n"
              "    await store.close()\n"
              "    print(cancelled.status)\n"
              "asyncio.run(main())\n")
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", script, db_url, cwd=REPO_ROOT,
                                                   stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    assert out.decode().strip() == "cancelled"
    assert await store.cancel_requested("resp_1") is True


# ----- dead runs: heartbeats (migration 2) -----

async def test_a_running_response_whose_heartbeat_is_stale_reads_as_failed(open_store: StoreFactory) -> None:
    clock = Clock(T0)
    store = await open_store(clock=clock, stale_after_s=30)
    events = [{"type": "response.created", "sequence_number": 0}]
    for response_id, status in (("resp_run", "in_progress"), ("resp_queued", "queued"), ("resp_done", "completed")):
        await store.create(record(response_id, status=status, events=events))
    clock.now = T0 + 20
    await store.heartbeat("resp_queued")  # its process is alive
    assert (await store.update("alice", "resp_run", status="in_progress", response=record("resp_run", status="in_progress").response,
                               output_items=[]))  # a write is a sign of life too
    clock.now = T0 + 45  # 25 s after the last signs of life: both still running
    assert [(await store.get("alice", i)).status for i in ("resp_run", "resp_queued")] == ["in_progress", "queued"]
    clock.now = T0 + 51  # resp_run's process has been silent for 31 s; resp_queued's for 31 s too
    dead = await store.get("alice", "resp_run")
    assert dead.status == "failed" and dead.response["status"] == "failed"
    assert dead.response["error"] == STALE_ERROR
    # Its stream ends as a failed one does, for followers and replays alike.
    assert dead.events[:-1] == events and dead.events[-1]["type"] == "response.failed"
    assert dead.events[-1]["sequence_number"] == 1 and dead.events[-1]["response"] == dead.response
    followed = await store.get("alice", "resp_queued", events_after=0, items=False)
    assert followed.status == "failed" and [e["type"] for e in followed.events] == ["response.failed"]
    assert (await store.get("alice", "resp_done")).status == "completed"  # a finished one is never stale
    # Persisted: another process (a fresh store, whatever its window) reads failed from the column.
    other = await open_store(clock=clock, stale_after_s=10**6)
    assert (await other.get("alice", "resp_run")).status == "failed"
    await store.heartbeat("resp_run")  # a late heartbeat does not revive it
    assert (await other.get("alice", "resp_run")).status == "failed"


async def test_a_run_found_dead_stays_failed_when_its_silent_process_writes_again(open_store: StoreFactory) -> None:
    """A process that was only silent past the window (stopped, starved) comes back: its writes change nothing,
    the failed stream its followers ended on stands, and it is told to stop."""
    clock = Clock(T0)
    store = await open_store(clock=clock, stale_after_s=30)
    await store.create(record(status="in_progress", events=[{"type": "response.created", "sequence_number": 0}]))
    assert await store.cancel_requested("resp_1") is False
    clock.now = T0 + 31
    failed = await store.get("alice", "resp_1")
    assert failed.status == "failed" and [e["type"] for e in failed.events] == ["response.created", "response.failed"]
    late = [{"type": "response.completed", "sequence_number": 1}]
    assert not await store.update("alice", "resp_1", status="completed", response=record(status="completed").response,
                                  output_items=[], new_events=late)
    assert await store.get("alice", "resp_1") == failed
    assert await store.cancel_requested("resp_1") is True


async def test_a_heartbeat_between_the_read_and_the_update_keeps_the_run(open_store: StoreFactory) -> None:
    """The failing UPDATE re-checks staleness itself: a run that beat after the reader saw it stale stays."""
    clock = Clock(T0)
    store = await open_store(clock=clock, stale_after_s=30)
    await store.create(record(status="in_progress"))
    clock.now = T0 + 31
    found = await store._read("alice", "resp_1", -1, True)
    assert found is not None and found[1]  # the reader sees it stale...
    await store.heartbeat("resp_1")  # ...its process beats...
    await store._fail_if_stale("alice", "resp_1")  # ...and the conditional UPDATE changes nothing
    assert (await store.get("alice", "resp_1")).status == "in_progress"


# ----- stream events: append-only rows (migration 2) -----

async def test_events_are_appended_and_followers_read_only_the_new(store: ResponseStore) -> None:
    first = [{"type": "response.created", "sequence_number": 0}, {"type": "response.in_progress", "sequence_number": 1}]
    await store.create(record(status="in_progress", events=first))
    later = [{"type": "response.output_text.delta", "sequence_number": 2, "delta": "hi"}]
    assert await store.update("alice", "resp_1", status="in_progress", response=record().response, output_items=[],
                              new_events=later)
    assert (await store.get("alice", "resp_1")).events == first + later
    assert (await store.get("alice", "resp_1", events_after=1, items=False)).events == later
    assert (await store.get("alice", "resp_1", events_after=2)).events == []
    async with store._engine.connect() as conn:
        rows = (await conn.execute(text("SELECT events FROM stored_responses"))).scalars().all()
    assert rows == ["[]"]  # nothing rewritten in the row: the events are rows of their own
    # Dropped (too large to keep them): no stream any more, and the rows are gone.
    assert await store.update("alice", "resp_1", status="completed", response=record().response, output_items=[],
                              drop_events=True)
    assert (await store.get("alice", "resp_1")).events is None
    async with store._engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM stored_response_events"))).scalar() == 0


async def test_deleting_and_purging_remove_the_events(open_store: StoreFactory) -> None:
    clock = Clock(T0)
    store = await open_store(ttl_days=1, clock=clock)
    events = [{"type": "response.created", "sequence_number": 0}]
    await store.create(record("resp_1", events=events))
    await store.create(record("resp_2", events=events))
    assert await store.delete("alice", "resp_1")
    clock.now = T0 + DAY
    assert await store.purge_expired() == 1
    async with store._engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM stored_response_events"))).scalar() == 0


async def test_a_version_1_database_is_migrated_and_its_rows_still_read(db_url: str, open_store: StoreFactory) -> None:
    """Migration 1 only (a database of the previous release) with a row as that release wrote it."""
    engine = create_async_engine(normalize_url(db_url))
    legacy_events = [{"type": "response.created", "sequence_number": 0}]
    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE stored_responses_schema (version INTEGER NOT NULL)"))
            await conn.execute(text("INSERT INTO stored_responses_schema (version) VALUES (1)"))
            for statement in MIGRATIONS[0]:
                await conn.execute(text(statement))
            await conn.execute(text(
                "INSERT INTO stored_responses (id, owner, status, created_at, cancel_requested, response, output_items,"
                " events, input_bytes, response_bytes, events_bytes) VALUES ('resp_old', 'alice', 'in_progress', "
                ":created, FALSE, :response, '[]', :events, 0, 10, 10)"),
                {"created": T0, "response": '{"id":"resp_old","status":"in_progress"}',
                 "events": json.dumps(legacy_events)})
    finally:
        await engine.dispose()
    clock = Clock(T0 + 10)
    store = await open_store(clock=clock, stale_after_s=30)
    old = await store.get("alice", "resp_old")
    assert old.events == legacy_events and old.status == "in_progress"
    assert await store.update("alice", "resp_old", status="in_progress", response={"id": "resp_old"},
                              output_items=[], new_events=[{"type": "x", "sequence_number": 1}])
    assert [e["sequence_number"] for e in (await store.get("alice", "resp_old")).events] == [0, 1]
    assert await store.chain_bytes("alice", "resp_old") == 0  # not known for a v1 row: counted as nothing
    async with store._engine.connect() as conn:
        assert (await conn.execute(text("SELECT version FROM stored_responses_schema"))).scalar() == SCHEMA_VERSION


# ----- chain sizes (migration 2) -----

def own_bytes(stored: StoredResponse) -> int:
    return sum(json_size(item) for item in stored.input_items) + json_size(stored.output_items)


async def test_chain_bytes_add_up_along_the_chain(store: ResponseStore) -> None:
    first, second = record("resp_a", inputs=2), record("resp_b", previous="resp_a", inputs=1)
    await store.create(first)
    await store.create(second)
    assert await store.chain_bytes("alice", "resp_a") == own_bytes(first)
    assert await store.chain_bytes("alice", "resp_b") == own_bytes(first) + own_bytes(second)
    assert await store.chain_bytes("mallory", "resp_b") is None and await store.chain_bytes("alice", "x") is None


async def test_a_byte_budget_reads_the_chain_newest_first_from_a_turn_start(store: ResponseStore) -> None:
    chain = [record(f"resp_{i}", previous=f"resp_{i - 1}" if i else None, inputs=1) for i in range(6)]
    # resp_4's input answers a call (no user message): a truncated chain must not start there.
    chain[4].input_items = [{"id": "fco_4", "type": "function_call_output", "call_id": "c", "output": "4"}]
    for stored in chain:
        await store.create(stored)
    whole = await store.conversation("alice", "resp_5")
    assert len(whole) == 12
    per_response = own_bytes(chain[5])
    # Room for resp_5 and resp_4 (both read, then one more: the one that crosses the budget), not resp_1.
    budget = 2 * per_response + 1
    read = await store.conversation("alice", "resp_5", max_bytes=budget)
    assert read == chain[3].input_items + chain[3].output_items + chain[4].input_items + chain[4].output_items \
        + chain[5].input_items + chain[5].output_items
    tight = await store.conversation("alice", "resp_5", max_bytes=1)  # resp_5 and resp_4 read; resp_4 is a call's output
    assert tight == chain[5].input_items + chain[5].output_items
    # Ancestors past the budget are not read, so an expired or deleted one there does not matter...
    await store.delete("alice", "resp_0")
    assert await store.conversation("alice", "resp_5", max_bytes=budget) == read
    assert await store.conversation("alice", "resp_5") is None  # ...but does without a budget
    # A missing ancestor within the budget still makes the chain not found.
    assert await store.conversation("alice", "resp_1", max_bytes=10**9) is None


# ----- schema and URLs -----

async def test_open_is_idempotent_and_records_the_schema_version(open_store: StoreFactory) -> None:
    # Workers starting together (on SQLite they race to switch the new file to WAL mode).
    stores = await asyncio.gather(*(open_store() for _ in range(6)))
    await stores[0].create(record())
    again = await open_store()
    assert await again.get("alice", "resp_1") is not None
    async with again._engine.connect() as conn:
        versions = (await conn.execute(text("SELECT version FROM stored_responses_schema"))).scalars().all()
    assert versions == [SCHEMA_VERSION]


async def test_a_database_from_a_newer_release_is_refused(open_store: StoreFactory, db_url: str) -> None:
    store = await open_store()
    async with store._engine.begin() as conn:
        await conn.execute(text("UPDATE stored_responses_schema SET version = 999"))
    with pytest.raises(RuntimeError, match="schema version 999"):
        await ResponseStore.open(db_url)


async def test_the_async_driver_urls_open_the_same_database(open_store: StoreFactory, db_url: str) -> None:
    await (await open_store()).create(record())
    explicit = normalize_url(db_url).render_as_string(hide_password=False)
    assert "+aiosqlite://" in explicit or "+asyncpg://" in explicit
    store = await ResponseStore.open(explicit, clock=Clock())
    try:
        assert await store.get("alice", "resp_1") is not None
    finally:
        await store.close()


def test_urls_normalise_to_the_async_drivers() -> None:
    assert str(normalize_url("sqlite:///data/r.db")) == "sqlite+aiosqlite:///data/r.db"
    assert str(normalize_url("sqlite+aiosqlite:////abs/r.db")) == "sqlite+aiosqlite:////abs/r.db"
    assert str(normalize_url("postgresql://u@db:5432/r")) == "postgresql+asyncpg://u@db:5432/r"
    assert str(normalize_url("postgres://u@db/r")) == "postgresql+asyncpg://u@db/r"
    assert str(normalize_url("postgresql+asyncpg://u@db/r")) == "postgresql+asyncpg://u@db/r"
    for bad in ("mysql://u@db/r", "postgresql+psycopg2://u@db/r", "sqlite://", "sqlite:///:memory:"):
        with pytest.raises(ValueError):
            normalize_url(bad)


async def test_sqlite_runs_in_wal_mode_with_a_busy_timeout(tmp_path: Path) -> None:
    store = await ResponseStore.open(f"sqlite:///{tmp_path / 'sub' / 'r.db'}")  # the folder is made
    try:
        async with store._engine.connect() as conn:
            assert (await conn.execute(text("PRAGMA journal_mode"))).scalar() == "wal"
            assert (await conn.execute(text("PRAGMA busy_timeout"))).scalar() >= 1000
    finally:
        await store.close()
