"""Stored responses of `/v1/responses`: one async data layer over SQLite or PostgreSQL.

What is stored: for each response with `store: true`, the response object as last returned, this turn's
input items, its output items (the next turn's `previous_response_id` rebuilds the conversation from them)
and, when kept, the stream's events (so a background response's stream can be resumed). The database is
the source of truth shared by every worker process and replica: status, cancellation and deletion are
rows and columns, never process memory, so a cancel that reaches worker A stops the generation running in
worker B (B polls `cancel_requested`).

Backends. SQLite (one file, the embedded default) runs in WAL mode with a busy timeout, so that several
worker processes on one machine can share the file: readers never block, writers queue for the lock
instead of failing. PostgreSQL is for several replicas (or many workers). Both go through SQLAlchemy's
async engine (aiosqlite, asyncpg), with SQL that both dialects accept: one code path, tested against both.

Isolation. Every row has an owner (the caller's API key identity; "" when the server has no keys). Every
read, delete and cancel filters on it inside the SQL statement, so another owner's id behaves exactly as a
missing id: None or False, never content, never a different error. The owner string must be stable across
processes and restarts (a per-process salted key id would orphan every stored response on restart).

Retention. A response is visible while `created_at > now - ttl`: expiry takes effect at once in every
query, and `purge_expired()` (which the app calls periodically) reclaims the rows. A stored response may
not exceed `max_bytes` of JSON (response + input items + events, UTF-8): over it, `ResponseTooLarge`.

Stream events are rows of their own, `(response_id, seq)`, appended as a run makes them: a background run
writes only its new events each poll, and a follower in another process reads only `seq > after` (one
JSON column rewritten whole every poll was O(n^2) bytes per run). A v1 row's events stay in its `events`
column (a JSON array); new rows keep `'[]'` there, which says "a stream is kept" (NULL: none is).

Dead runs. A running (queued, in_progress) response's process refreshes `heartbeat_at_ms` (`heartbeat`,
and every `update`). If that process dies (kill -9, the OOM killer: nothing marks the row), the heartbeat
goes stale; a reader that finds it older than `stale_after_s` turns the row `failed` with one conditional
UPDATE (still running, still stale), so GET and stream followers end instead of polling for 30 days. A
process that was only silent (stopped, starved, cut off from the database) and writes again finds its run
ended: `update` writes over running or cancelled rows only, and `cancel_requested` tells it to stop.

Chains. `chain_bytes` is a response's input and output items' JSON bytes plus its previous response's
`chain_bytes`, so the size of a whole previous_response_id chain is one row's column: the API refuses
past a bound before loading anything, and `conversation(max_bytes=...)` reads newest first and stops.

Migrations: a small versioned schema table (`stored_responses_schema`) and an ordered list of DDL steps in
this module, applied under a lock at `open()`, rather than Alembic. The schema is four tables owned by
this one module; Alembic would add a dependency, a migrations directory and an env.py to ship and run
programmatically, to buy autogeneration and downgrades that four tables do not need. The lock makes
concurrent opens safe (every worker opens the store, at start or at first use): `pg_advisory_xact_lock` on PostgreSQL,
`BEGIN IMMEDIATE` on SQLite; both dialects run DDL inside the transaction, so a step applies wholly or
not at all. A database migrated by a newer frontend (a higher version than this module knows) is refused
rather than used with a schema this code does not understand.

No read-modify-write. Every change is one conditional statement (status transitions in SQL `CASE`s, the
size cap in the `WHERE` clause), so two processes racing on one row cannot lose an update, and SQLite
never has to upgrade a read lock to a write lock (which fails at once, busy timeout or not). The status
column is authoritative: `get` writes it into the returned response object, so a cancel needs no rewrite
of the stored JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sqlalchemy import (BigInteger, Boolean, Column, Integer, MetaData, Table, Text, and_, case, delete,
                        event, exists, func, insert, select, text, update)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

log = logging.getLogger("frontend")

STATUSES = frozenset({"queued", "in_progress", "completed", "incomplete", "failed", "cancelled"})
CANCELLABLE = ("queued", "in_progress")  # request_cancel turns these into "cancelled"
# What a run's `update` may still write over: its own running states, and a cancel (the partial output at the
# cancel is kept). Never an ended one, least of all a run found dead ("failed"): its process was only silent.
WRITABLE = CANCELLABLE + ("cancelled",)

# A previous_response_id chain longer than this is refused (ChainTooLong): rebuilding it is one query, but
# its items all go to the model in one prompt, which no context window holds at this length anyway.
MAX_CHAIN_LENGTH = 1000

POSTGRES_CONNECT_TIMEOUT_S = 5.0  # a server that does not answer: the request gets a 503 after this, not a hang
SQLITE_BUSY_TIMEOUT_S = 30.0  # a writer waits this long for another process's write lock before failing
SCHEMA_LOCK_KEY = 0x7265_7370  # "resp": the PostgreSQL advisory lock held while migrating
_FOREVER = -(2**62)  # the expiry cutoff when ttl_days is infinite (fits a BIGINT)
_NO_LIMIT = 2**62  # conversation()'s byte budget when there is none


class ResponseTooLarge(ValueError):
    """A stored response (response + input items + events, as JSON) would exceed the store's max_bytes."""


STALE_ERROR = {"code": "server_error",
               "message": "the server process running this response stopped before it was complete"}


class ChainTooLong(ValueError):
    """The previous_response_id chain has more than MAX_CHAIN_LENGTH responses (or loops)."""


@dataclass
class StoredResponse:
    id: str  # "resp_…"
    owner: str
    status: str  # queued | in_progress | completed | incomplete | failed | cancelled
    response: dict  # the full response object as last returned to the client
    input_items: list[dict]  # this turn's input items (each with its "id"), in order
    output_items: list[dict]  # the response's output items (copy of response["output"], kept for the chain)
    previous_response_id: str | None
    created_at: int  # unix seconds
    events: list[dict] | None = None  # the stream's events in order (each has "sequence_number"), when stored
    cancel_requested: bool = False


# The latest schema, for building statements; MIGRATIONS below is what creates and evolves it.
_metadata = MetaData()
responses_table = Table(
    "stored_responses", _metadata,
    Column("id", Text, primary_key=True),
    Column("owner", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("previous_response_id", Text),
    Column("created_at", BigInteger, nullable=False),
    Column("cancel_requested", Boolean, nullable=False),
    Column("response", Text, nullable=False),
    Column("output_items", Text, nullable=False),
    Column("events", Text),
    # Sizes in bytes of the JSON above, so that `update` checks the cap without reading the row:
    Column("input_bytes", BigInteger, nullable=False),
    Column("response_bytes", BigInteger, nullable=False),
    Column("events_bytes", BigInteger, nullable=False),
    # Migration 2:
    Column("heartbeat_at_ms", BigInteger),  # unix ms of the running process's last sign of life
    Column("chain_bytes", BigInteger, nullable=False),  # this response's items + its ancestors' (docstring)
)
input_items_table = Table(
    "stored_response_input_items", _metadata,
    Column("response_id", Text, primary_key=True),
    Column("seq", Integer, primary_key=True),  # the item's place in the turn's input, from 0
    Column("item_id", Text),
    Column("item", Text, nullable=False),
)
events_table = Table(
    "stored_response_events", _metadata,
    Column("response_id", Text, primary_key=True),
    Column("seq", Integer, primary_key=True),  # the event's sequence_number
    Column("event", Text, nullable=False),
)

# Each step takes the schema from version i to i + 1. Append; never edit a step that has shipped.
MIGRATIONS: list[list[str]] = [
    [
        """CREATE TABLE stored_responses (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            status TEXT NOT NULL,
            previous_response_id TEXT,
            created_at BIGINT NOT NULL,
            cancel_requested BOOLEAN NOT NULL DEFAULT FALSE,
            response TEXT NOT NULL,
            output_items TEXT NOT NULL,
            events TEXT,
            input_bytes BIGINT NOT NULL,
            response_bytes BIGINT NOT NULL,
            events_bytes BIGINT NOT NULL
        )""",
        "CREATE INDEX stored_responses_created_at ON stored_responses (created_at)",
        """CREATE TABLE stored_response_input_items (
            response_id TEXT NOT NULL REFERENCES stored_responses (id) ON DELETE CASCADE,
            seq INTEGER NOT NULL,
            item_id TEXT,
            item TEXT NOT NULL,
            PRIMARY KEY (response_id, seq)
        )""",
        "CREATE INDEX stored_response_input_items_item_id ON stored_response_input_items (response_id, item_id)",
    ],
    [  # 2: heartbeats of running responses, chain sizes, append-only stream events (module docstring)
        "ALTER TABLE stored_responses ADD COLUMN heartbeat_at_ms BIGINT",
        "ALTER TABLE stored_responses ADD COLUMN chain_bytes BIGINT NOT NULL DEFAULT 0",
        """CREATE TABLE stored_response_events (
            response_id TEXT NOT NULL REFERENCES stored_responses (id) ON DELETE CASCADE,
            seq INTEGER NOT NULL,
            event TEXT NOT NULL,
            PRIMARY KEY (response_id, seq)
        )""",
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)

# Every item of a chain in one statement (one snapshot, one round trip): the responses from `id` back
# through previous_response_id, each with its depth (0 = `id`), bounded by :max_depth and by :budget (an
# older response is read only while the newer ones hold fewer than :budget bytes, from chain_bytes); then,
# oldest first, each one's input items (part 0, in order) and its output items (part 1, one JSON array).
_CHAIN_SQL = text("""
WITH RECURSIVE chain (id, prev, depth, output_items, top) AS (
    SELECT id, previous_response_id, 0, output_items, chain_bytes FROM stored_responses
     WHERE id = :id AND owner = :owner AND created_at > :cutoff
    UNION ALL
    SELECT r.id, r.previous_response_id, c.depth + 1, r.output_items, c.top
      FROM stored_responses r JOIN chain c ON r.id = c.prev
     WHERE r.owner = :owner AND r.created_at > :cutoff AND c.depth < :max_depth
       AND c.top - r.chain_bytes < :budget
)
SELECT depth, 1 AS part, 0 AS seq, prev, output_items AS body FROM chain
UNION ALL
SELECT c.depth, 0 AS part, i.seq, NULL AS prev, i.item AS body
  FROM chain c JOIN stored_response_input_items i ON i.response_id = c.id
ORDER BY depth DESC, part, seq
""")


def normalize_url(url: str | URL) -> URL:
    """The async-driver URL for a configured one: sqlite[+aiosqlite]:///path, postgres[ql][+asyncpg]://…"""
    parsed = make_url(url)
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "sqlite" and driver in ("", "aiosqlite"):
        if not parsed.database or parsed.database == ":memory:" or parsed.database.startswith("file:"):
            raise ValueError("the responses store needs a SQLite file path (sqlite:///path/to/file.db), "
                             "shared by every worker; an in-memory database is not")
        return parsed.set(drivername="sqlite+aiosqlite")
    if backend in ("postgresql", "postgres") and driver in ("", "asyncpg"):
        return parsed.set(drivername="postgresql+asyncpg")
    raise ValueError(f"unsupported responses database URL scheme {parsed.drivername!r}: use "
                     "sqlite:///path, sqlite+aiosqlite:///path, postgresql://… or postgresql+asyncpg://…")


def _dumps(value: Any) -> tuple[str, int]:
    """Compact JSON and its size in UTF-8 bytes (the size the cap counts).

    Non-ASCII text is kept as is (not \\u-escaped, which would count CJK text six times over), unless the
    value holds lone surrogates (valid in a JSON escape, not in UTF-8): then escaped, which stores them.
    """
    try:
        dumped = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        return dumped, len(dumped.encode("utf-8"))
    except UnicodeEncodeError:
        dumped = json.dumps(value, separators=(",", ":"))
        return dumped, len(dumped)


class ResponseStore:
    """The stored responses of one database; one instance per process, safe to share between tasks."""

    def __init__(self, engine: AsyncEngine, *, ttl_days: float, max_bytes: int,
                 clock: Callable[[], float], max_chain_length: int, stale_after_s: float) -> None:
        self._engine = engine
        self.ttl_seconds = ttl_days * 86400.0
        self.max_bytes = max_bytes
        self.max_chain_length = max_chain_length
        self.stale_after_s = stale_after_s
        self._clock = clock

    @classmethod
    async def open(cls, url: str | URL, *, ttl_days: float = 30.0, max_bytes: int = 4 * 1024 * 1024,
                   clock: Callable[[], float] = time.time, max_chain_length: int = MAX_CHAIN_LENGTH,
                   stale_after_s: float = 30.0) -> "ResponseStore":
        """Connect and create or migrate the schema. `ttl_days` may be math.inf (keep until deleted);
        `clock` (unix seconds) is for tests; a running response whose heartbeat is older than
        `stale_after_s` reads as failed."""
        if not ttl_days > 0:
            raise ValueError(f"ttl_days must be positive (math.inf keeps responses until deleted), got {ttl_days}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if max_chain_length < 1:
            raise ValueError(f"max_chain_length must be positive, got {max_chain_length}")
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be positive, got {stale_after_s}")
        async_url = normalize_url(url)
        if async_url.get_backend_name() == "sqlite":
            Path(async_url.database).parent.mkdir(parents=True, exist_ok=True)
            engine = create_async_engine(async_url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})
            event.listen(engine.sync_engine, "connect", _sqlite_on_connect)
        else:
            # pre_ping: a connection the server (or a failover) dropped while pooled is replaced, not used;
            # the connect timeout bounds how long a request waits on a server that does not answer.
            engine = create_async_engine(async_url, pool_pre_ping=True,
                                         connect_args={"timeout": POSTGRES_CONNECT_TIMEOUT_S})
        store = cls(engine, ttl_days=ttl_days, max_bytes=max_bytes, clock=clock,
                    max_chain_length=max_chain_length, stale_after_s=stale_after_s)
        try:
            if async_url.get_backend_name() == "sqlite":
                await _use_write_ahead_log(engine)
            await store._migrate()
        except BaseException:
            await engine.dispose()
            raise
        return store

    async def close(self) -> None:
        await self._engine.dispose()

    async def ping(self) -> None:
        """One round trip; raises what the database raises when it cannot be reached."""
        async with self._engine.connect() as conn:
            await conn.execute(text("SELECT 1"))

    async def _migrate(self) -> None:
        """Apply the steps past the database's version, one transaction under a lock (see the docstring)."""
        async with self._engine.connect() as conn:
            sqlite = self._engine.dialect.name == "sqlite"
            if sqlite:
                # The driver's own transaction handling would start a deferred transaction (no lock until
                # the first write); take the write lock up front instead, so two opens cannot interleave.
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                await conn.exec_driver_sql("BEGIN IMMEDIATE")
            else:
                await conn.begin()
                await conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
            try:
                await self._apply_migrations(conn)
            except BaseException:
                await (conn.exec_driver_sql("ROLLBACK") if sqlite else conn.rollback())
                raise
            await (conn.exec_driver_sql("COMMIT") if sqlite else conn.commit())

    async def _apply_migrations(self, conn: AsyncConnection) -> None:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS stored_responses_schema (version INTEGER NOT NULL)"))
        version = (await conn.execute(text("SELECT version FROM stored_responses_schema"))).scalar()
        if version is None:
            version = 0
            await conn.execute(text("INSERT INTO stored_responses_schema (version) VALUES (0)"))
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"the responses database has schema version {version}, newer than this "
                               f"frontend's {SCHEMA_VERSION}: it was migrated by a newer release")
        for step in MIGRATIONS[version:]:
            for statement in step:
                await conn.execute(text(statement))
        if version < SCHEMA_VERSION:
            await conn.execute(text("UPDATE stored_responses_schema SET version = :version"),
                               {"version": SCHEMA_VERSION})

    # ----- visibility -----

    def _cutoff(self) -> int:
        """Rows with created_at at or below this have expired (created_at is whole seconds)."""
        if math.isinf(self.ttl_seconds):
            return _FOREVER
        return math.floor(self._clock() - self.ttl_seconds)

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _visible(self, owner: str, response_id: str) -> Any:
        """The WHERE clause of every owner-scoped statement: this id, this owner, not expired."""
        t = responses_table
        return and_(t.c.id == response_id, t.c.owner == owner, t.c.created_at > self._cutoff())

    def _stale(self) -> Any:
        """Running, and its process silent for longer than stale_after_s (a v1 row: since its creation)."""
        t = responses_table
        last_seen = func.coalesce(t.c.heartbeat_at_ms, t.c.created_at * 1000)
        return and_(t.c.status.in_(CANCELLABLE), last_seen < self._now_ms() - int(self.stale_after_s * 1000))

    # ----- writes -----

    async def create(self, record: StoredResponse) -> None:
        """Store a new response. ValueError for an id already stored, ResponseTooLarge over the cap."""
        _check_status(record.status)
        t = responses_table
        response_json, response_bytes = _dumps(record.response)
        output_json, output_bytes = _dumps(record.output_items)
        items = [_dumps(item) for item in record.input_items]
        input_bytes = sum(size for _, size in items)
        events = [_dumps(e) for e in record.events or []]
        events_bytes = sum(size for _, size in events)
        self._check_size(record.id, input_bytes + response_bytes + events_bytes)
        previous_bytes = select(t.c.chain_bytes).where(t.c.id == record.previous_response_id).scalar_subquery()
        try:
            async with self._engine.begin() as conn:
                await conn.execute(insert(t).values(
                    id=record.id, owner=record.owner, status=record.status,
                    previous_response_id=record.previous_response_id, created_at=int(record.created_at),
                    cancel_requested=record.cancel_requested, response=response_json,
                    output_items=output_json, events=None if record.events is None else "[]",
                    input_bytes=input_bytes, response_bytes=response_bytes, events_bytes=events_bytes,
                    heartbeat_at_ms=self._now_ms(),
                    chain_bytes=func.coalesce(previous_bytes, 0) + input_bytes + output_bytes))
                if items:
                    await conn.execute(insert(input_items_table), [
                        {"response_id": record.id, "seq": seq, "item_id": _item_id(item), "item": dumped}
                        for seq, (item, (dumped, _)) in enumerate(zip(record.input_items, items))])
                await self._append_events(conn, record.id, record.events or [], events)
        except IntegrityError as exc:
            raise ValueError(f"response {record.id} is already stored") from exc

    @staticmethod
    async def _append_events(conn: AsyncConnection, response_id: str, new: list[dict],
                             dumped: list[tuple[str, int]]) -> None:
        if new:
            await conn.execute(insert(events_table), [
                {"response_id": response_id, "seq": int(e["sequence_number"]), "event": json_text}
                for e, (json_text, _) in zip(new, dumped)])

    async def update(self, owner: str, response_id: str, *, status: str, response: dict,
                     output_items: list[dict], new_events: list[dict] | None = None,
                     drop_events: bool = False) -> bool:
        """Replace the response and its output items, append `new_events` to its stream (or, with
        `drop_events`, keep no stream any more); False if it is not visible or has ended (WRITABLE: a run
        found dead keeps its failed status and stream). Refreshes the heartbeat.

        Never un-cancels: once cancelled, the status stays "cancelled" whatever `status` says (the content
        is still replaced, so the partial output at the cancel is kept). ResponseTooLarge over the cap.
        """
        _check_status(status)
        t = responses_table
        response_json, response_bytes = _dumps(response)
        output_json, _ = _dumps(output_items)
        events = [_dumps(e) for e in new_events or []]
        values: dict[str, Any] = {
            "status": case((t.c.status == "cancelled", "cancelled"), else_=status),
            "response": response_json, "response_bytes": response_bytes, "output_items": output_json,
            "heartbeat_at_ms": self._now_ms()}
        if drop_events:
            values["events"], values["events_bytes"] = None, 0
            new_size = t.c.input_bytes + response_bytes
        else:
            if events:  # a stream is kept from now on (module docstring), if it was not already
                values["events"] = func.coalesce(t.c.events, "[]")
            values["events_bytes"] = t.c.events_bytes + sum(size for _, size in events)
            new_size = t.c.input_bytes + values["events_bytes"] + response_bytes
        visible = and_(self._visible(owner, response_id), t.c.status.in_(WRITABLE))
        async with self._engine.begin() as conn:
            result = await conn.execute(update(t).where(visible, new_size <= self.max_bytes).values(**values))
            if result.rowcount:
                if drop_events:
                    await conn.execute(delete(events_table).where(events_table.c.response_id == response_id))
                await self._append_events(conn, response_id, new_events or [], events)
                return True
            # Not updated: over the cap, or not visible or ended (the size is only read for the caller's own row).
            size = (await conn.execute(select(new_size).where(visible))).scalar()
        if size is None:
            return False
        self._check_size(response_id, size)
        return False  # unreachable unless the row changed in between; then it is as if it were gone

    async def heartbeat(self, response_id: str) -> None:
        """The running process is alive (module docstring: dead runs); only while the response runs."""
        t = responses_table
        async with self._engine.begin() as conn:
            await conn.execute(update(t).where(t.c.id == response_id, t.c.status.in_(CANCELLABLE))
                               .values(heartbeat_at_ms=self._now_ms()))

    async def _fail_if_stale(self, owner: str, response_id: str) -> None:
        """One conditional UPDATE: failed, if it still runs and its heartbeat is still stale; then, in the
        same transaction, its kept stream gets the `response.failed` event its run never wrote, so that
        followers and replays end as a failed stream does. Its own transaction, after the read that saw it
        stale (SQLite cannot upgrade a read lock; module docstring)."""
        t, e = responses_table, events_table
        async with self._engine.begin() as conn:
            result = await conn.execute(update(t).where(
                self._visible(owner, response_id), self._stale()).values(status="failed"))
            if not result.rowcount:
                return
            row = (await conn.execute(select(t.c.response, t.c.events).where(t.c.id == response_id))).one()
            if row.events is not None:
                last = (await conn.execute(select(func.max(e.c.seq)).where(e.c.response_id == response_id))).scalar()
                seq = max([-1 if last is None else last] + [ev["sequence_number"] for ev in json.loads(row.events)]) + 1
                response = {**json.loads(row.response), "status": "failed", "error": dict(STALE_ERROR)}
                failed = {"type": "response.failed", "response": response, "sequence_number": seq}
                dumped = _dumps(failed)
                await self._append_events(conn, response_id, [failed], [dumped])
                await conn.execute(update(t).where(t.c.id == response_id)
                                   .values(events_bytes=t.c.events_bytes + dumped[1]))
        log.warning("response %s: the process running it has not been heard from for %g s: failed",
                    response_id, self.stale_after_s)

    async def delete(self, owner: str, response_id: str) -> bool:
        """Delete the response, its input items and its events; False if it is not visible."""
        async with self._engine.begin() as conn:
            deleted = await conn.execute(delete(responses_table).where(self._visible(owner, response_id)))
            if not deleted.rowcount:
                return False
            for child in (input_items_table, events_table):
                await conn.execute(delete(child).where(child.c.response_id == response_id))
        return True

    async def request_cancel(self, owner: str, response_id: str) -> StoredResponse | None:
        """Mark the response cancel-requested; a queued or in_progress one becomes "cancelled" at once.

        The process generating it (any process) sees `cancel_requested` and stops; its later `update`
        cannot undo the cancel. Returns the record after the change, None if it is not visible.
        """
        t = responses_table
        async with self._engine.begin() as conn:
            result = await conn.execute(update(t).where(self._visible(owner, response_id)).values(
                cancel_requested=True,
                status=case((t.c.status.in_(CANCELLABLE), "cancelled"), else_=t.c.status)))
        if not result.rowcount:
            return None
        return await self.get(owner, response_id)

    async def purge_expired(self) -> int:
        """Delete every expired response, its input items and events; returns how many responses went."""
        cutoff = self._cutoff()
        t = responses_table
        async with self._engine.begin() as conn:
            for child in (input_items_table, events_table):
                await conn.execute(delete(child).where(
                    child.c.response_id.in_(select(t.c.id).where(t.c.created_at <= cutoff))))
            result = await conn.execute(delete(t).where(t.c.created_at <= cutoff))
        return result.rowcount

    # ----- reads -----

    async def get(self, owner: str, response_id: str, *, events_after: int = -1,
                  items: bool = True) -> StoredResponse | None:
        """The stored response, its input items (unless not `items`: a follower polling needs none) and its
        stream's events numbered past `events_after` (all by default; a follower asks only for the new).
        A running one whose process is gone (stale heartbeat) is made failed first, so the caller sees it
        end."""
        found = await self._read(owner, response_id, events_after, items)
        if found is not None and found[1]:
            await self._fail_if_stale(owner, response_id)
            found = await self._read(owner, response_id, events_after, items)
        return found[0] if found is not None else None

    async def _read(self, owner: str, response_id: str, after: int,
                    with_items: bool) -> tuple[StoredResponse, bool] | None:
        t = responses_table
        async with self._engine.connect() as conn:
            row = (await conn.execute(select(t, self._stale().label("stale"))
                                      .where(self._visible(owner, response_id)))).first()
            if row is None:
                return None
            items = (await conn.execute(
                select(input_items_table.c.item).where(input_items_table.c.response_id == response_id)
                .order_by(input_items_table.c.seq))).scalars().all() if with_items else []
            events = None
            if row.events is not None:  # a stream is kept: a v1 row's in its column, the others' as rows
                e = events_table
                events = [event for event in json.loads(row.events) if event["sequence_number"] > after]
                events += [json.loads(event) for event in (await conn.execute(
                    select(e.c.event).where(e.c.response_id == response_id, e.c.seq > after)
                    .order_by(e.c.seq))).scalars().all()]
        response = json.loads(row.response)
        if row.status == "failed" and response.get("status") in CANCELLABLE:  # found dead, not failed by its run
            response["error"] = dict(STALE_ERROR)
        response["status"] = row.status  # the column is authoritative (a cancel does not rewrite the JSON)
        return StoredResponse(
            id=row.id, owner=row.owner, status=row.status, response=response,
            input_items=[json.loads(item) for item in items], output_items=json.loads(row.output_items),
            previous_response_id=row.previous_response_id, created_at=row.created_at, events=events,
            cancel_requested=bool(row.cancel_requested)), bool(row.stale)

    async def input_items(self, owner: str, response_id: str, *, after: str | None = None, limit: int = 20,
                          order: str = "desc") -> tuple[list[dict], bool] | None:
        """One page of the response's input items and whether more follow; None if it is not visible.

        OpenAI's list semantics: `order` "desc" lists the last item first, "asc" the first; `after` is an
        item id, and the page starts just past it in that order (an id not among the items gives an empty
        page). `limit` is 1..100; the API layer validates it, a bad value here is a ValueError.
        """
        if order not in ("asc", "desc"):
            raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")
        if not 1 <= limit <= 100:
            raise ValueError(f"limit must be between 1 and 100, got {limit}")
        items = input_items_table
        of_response = items.c.response_id == response_id
        async with self._engine.connect() as conn:
            if not (await conn.execute(select(exists().where(self._visible(owner, response_id))))).scalar():
                return None
            query = select(items.c.item).where(of_response)
            if after is not None:
                start = (await conn.execute(select(items.c.seq).where(of_response, items.c.item_id == after)
                                            .order_by(items.c.seq).limit(1))).scalar()
                if start is None:
                    return [], False
                query = query.where(items.c.seq > start if order == "asc" else items.c.seq < start)
            query = query.order_by(items.c.seq.asc() if order == "asc" else items.c.seq.desc()).limit(limit + 1)
            page = (await conn.execute(query)).scalars().all()
        return [json.loads(item) for item in page[:limit]], len(page) > limit

    async def cancel_requested(self, response_id: str) -> bool:
        """Whether the process generating this response should stop: a cancel was requested, the response
        is gone (deleted or purged: nobody can read what it would store), or it was found dead (failed while
        its process was silent: nothing it writes is kept). Not owner-scoped: the caller is the generating
        process, which already holds the id."""
        t = responses_table
        async with self._engine.connect() as conn:
            row = (await conn.execute(select(t.c.cancel_requested, t.c.status).where(t.c.id == response_id))).first()
        return row is None or bool(row.cancel_requested) or row.status == "failed"

    async def chain_bytes(self, owner: str, response_id: str) -> int | None:
        """The JSON bytes of the items of the chain ending at response_id (one row read: the module
        docstring); None if it is not visible."""
        t = responses_table
        async with self._engine.connect() as conn:
            return (await conn.execute(select(t.c.chain_bytes).where(self._visible(owner, response_id)))).scalar()

    async def conversation(self, owner: str, response_id: str, *, max_bytes: int | None = None) -> list[dict] | None:
        """Every item of the chain ending at response_id, oldest first: for each response (following
        previous_response_id), its input items then its output items. None if it or any ancestor is not
        visible (another owner's, deleted, expired); ChainTooLong past max_chain_length responses.

        With `max_bytes` (truncation: auto), older responses are read only while the newer ones hold fewer
        bytes than that, and the items then start at the first user message left (a turn's start: no call
        without its assistant turn); ancestors past that point are not read, so not checked either."""
        async with self._engine.connect() as conn:
            rows = (await conn.execute(_CHAIN_SQL, {
                "id": response_id, "owner": owner, "cutoff": self._cutoff(),
                "max_depth": self.max_chain_length, "budget": _NO_LIMIT if max_bytes is None else max_bytes,
            })).all()
            chain = [row for row in rows if row.part == 1]  # one per response, oldest (deepest) first
            if not chain:
                return None
            if chain[0].depth >= self.max_chain_length:
                raise ChainTooLong(f"the previous_response_id chain of {response_id} is longer than "
                                   f"{self.max_chain_length} responses")
            truncated = False
            if chain[0].prev is not None:  # the oldest response read has an ancestor: too far, or not visible
                if max_bytes is None or not (await conn.execute(
                        select(exists().where(self._visible(owner, chain[0].prev))))).scalar():
                    return None
                truncated = True
        conversation: list[dict] = []
        for row in rows:
            if row.part == 0:
                conversation.append(json.loads(row.body))
            else:
                conversation.extend(json.loads(row.body))
        if truncated:
            start = next((i for i, item in enumerate(conversation)
                          if item.get("type", "message") == "message" and item.get("role") == "user"),
                         len(conversation))
            conversation = conversation[start:]
        return conversation

    def _check_size(self, response_id: str, size: int) -> None:
        if size > self.max_bytes:
            raise ResponseTooLarge(f"response {response_id} would store {size} bytes of JSON (response, input "
                                   f"items and events), over the {self.max_bytes}-byte cap per stored response")


def json_size(value: Any) -> int:
    """The bytes `value` counts towards the size cap."""
    return _dumps(value)[1]


def _check_status(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"unknown response status {status!r}; one of {sorted(STATUSES)}")


def _item_id(item: dict) -> str | None:
    item_id = item.get("id")
    return item_id if isinstance(item_id, str) else None


async def _use_write_ahead_log(engine: AsyncEngine) -> None:
    """Put the SQLite file in WAL mode, so readers never block the writer and processes can share it.

    WAL is a property of the file, so this is done once per open, not per connection. Switching needs
    the file to itself, and SQLite answers "database is locked" at once, without its busy wait, while
    another connection holds it: several workers opening the store together do exactly that. So the
    switch is retried (asynchronously: a blocking wait here would stall the event loop) for as long as
    any other lock is waited for, SQLITE_BUSY_TIMEOUT_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SQLITE_BUSY_TIMEOUT_S
    while True:
        try:
            async with engine.connect() as conn:
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                await conn.exec_driver_sql("PRAGMA journal_mode = WAL")
            return
        except OperationalError as error:
            if "locked" not in str(error.orig) or loop.time() >= deadline:
                raise
            await asyncio.sleep(0.01)


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    """Each new SQLite connection: wait for locks instead of failing, cascading foreign keys (off by
    default). (WAL mode belongs to the file: `_use_write_ahead_log` sets it once.)"""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cursor.execute("PRAGMA synchronous = NORMAL")  # durable at each checkpoint; safe in WAL mode
        cursor.execute("PRAGMA foreign_keys = ON")
    finally:
        cursor.close()
