"""A worker's side of the coordinator (frontend/workers/coordinator.py): its connection, the server-wide limits
as a `Limits`, and the rollout `Fleet` through which a rollout run by one worker reaches the others."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Awaitable, Callable

from frontend.api_types.errors import service_unavailable
from frontend.policy.admission import (Admitted, NeverFits, Rejected, TokenDemand, TokenReservation,
                                       tokens_to_reserve)
from frontend.workers.wire import Message, receive, send

log = logging.getLogger("frontend.workers")

CommandHandler = Callable[[Message], Awaitable[Any]]


class CoordinatorLink:
    """One connection to the coordinator: requests answered by id (`call`), one-way messages (`tell`), and
    the coordinator's fleet commands, run by `handle` and answered."""

    def __init__(self, path: str):
        self.path = path
        self._handle: CommandHandler | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    async def connect(self, handle: CommandHandler) -> None:
        self._handle = handle
        reader, self._writer = await asyncio.open_unix_connection(self.path, limit=1 << 20)
        self._reading = asyncio.get_running_loop().create_task(self._read(reader))

    async def close(self) -> None:
        self._closing = True
        if self._reading is not None:
            self._reading.cancel()
        if self._writer is not None:
            self._writer.close()

    def next_id(self) -> int:
        return next(self._ids)

    def tell(self, message: Message) -> None:
        if self._writer is not None:
            send(self._writer, message)

    async def call(self, message: Message, ident: int | None = None) -> Message:
        """Send `message` and wait for its answer (503 if the coordinator is gone: the supervisor is down)."""
        if self._writer is None or self._writer.is_closing():
            raise service_unavailable("this frontend worker lost its supervisor; retry the request")
        ident = self.next_id() if ident is None else ident
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        try:
            send(self._writer, {**message, "id": ident})
            return await future
        finally:
            self._pending.pop(ident, None)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while (message := await receive(reader)) is not None:
                if "cid" in message:
                    task = asyncio.get_running_loop().create_task(self._command(message))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    continue
                future = self._pending.get(message.get("id"))  # type: ignore[arg-type]
                if future is not None and not future.done():
                    future.set_result(message)
        finally:
            if not self._closing:
                log.error("the connection to the supervisor's coordinator closed")
            if self._writer is not None:
                self._writer.close()
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(service_unavailable("this frontend worker lost its supervisor; retry"))

    async def _command(self, message: Message) -> None:
        try:
            assert self._handle is not None
            result = await self._handle(message["command"])
        except Exception as exc:  # answered, so that the worker running the rollout does not wait forever
            log.exception("fleet command %s failed", message["command"].get("op"))
            result = {"error": str(exc)}
        self.tell({"cid": message["cid"], "result": result})


def _raise_refusal(answer: Message) -> None:
    if "rejected" in answer:
        r = answer["rejected"]
        raise Rejected(r["reason"], r["message"], r["retry_after_s"])
    if "never_fits" in answer:
        raise NeverFits(answer["never_fits"]["message"], answer["never_fits"]["param"])


class SharedLimits:
    """The server-wide `Limits` (frontend/policy/admission.py), held by the coordinator."""

    def __init__(self, link: CoordinatorLink, max_in_flight: int, tokens_per_minute: int):
        self._link = link
        self.max_in_flight = max_in_flight
        self._tpm = tokens_per_minute  # the same settings as the coordinator's: what to reserve is computed here

    async def check_request(self, key: str) -> None:
        _raise_refusal(await self._link.call({"op": "check_request", "key": key}))

    async def reserve(self, key: str, demand: TokenDemand) -> TokenReservation:
        if self._tpm <= 0:
            return TokenReservation(key, 0)
        answer = await self._link.call({"op": "reserve", "key": key, "tokens": tokens_to_reserve(demand, self._tpm)})
        _raise_refusal(answer)
        return TokenReservation(key, answer["reserved"])

    def settle(self, reservation: TokenReservation, used: int) -> None:
        if reservation.settled or reservation.reserved <= 0:
            return
        reservation.settled = True
        self._link.tell({"op": "settle", "key": reservation.key, "reserved": reservation.reserved, "used": used})

    async def admit(self, timeout_s: float | None, slots: int) -> Admitted:
        ticket = self._link.next_id()
        try:
            answer = await self._link.call({"op": "acquire", "timeout_s": timeout_s, "slots": slots}, ticket)
        except asyncio.CancelledError:  # the deadline, or the client gone: out of the queue, or give them back
            self._link.tell({"op": "abandon", "id": ticket})
            raise
        _raise_refusal(answer)
        return Admitted(slots, answer["waited_s"], ticket)

    def release(self, admitted: Admitted, held_s: float) -> None:
        self._link.tell({"op": "release", "id": admitted.ticket, "held_s": held_s})

    async def occupancy(self) -> tuple[int, int]:
        answer = await self._link.call({"op": "occupancy"})
        return answer["in_flight"], answer["queued"]


class SharedFleet:
    """The rollout `Fleet` (frontend/models/rollout.py) of a worker among several: each step is run by every
    other worker through the coordinator, and answered once all have."""

    def __init__(self, link: CoordinatorLink):
        self._link = link

    async def begin(self, name: str) -> bool:
        return bool((await self._link.call({"op": "begin_rollout", "name": name}))["ok"])

    def end(self, name: str) -> None:
        self._link.tell({"op": "end_rollout", "name": name})

    async def _everyone(self, command: Message) -> list[Any]:
        return list((await self._link.call({"op": "fleet", "command": command}))["results"])

    async def switch(self, name: str, version: str, retire: str | None, grace_s: float) -> bool:
        results = await self._everyone({"op": "switch", "name": name, "version": version, "retire": retire,
                                        "grace_s": grace_s})
        return all(r is None or r.get("drained", False) for r in results)

    async def hold(self, name: str, grace_s: float) -> bool:
        results = await self._everyone({"op": "hold", "name": name, "grace_s": grace_s})
        return all(r is None or r.get("drained", False) for r in results)

    async def unhold(self, name: str) -> None:
        await self._everyone({"op": "unhold", "name": name})
