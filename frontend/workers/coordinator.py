"""What several frontend workers share, held in one place: the supervisor's coordinator.

With FRONTEND_WORKERS=N, each worker is its own process (its own event loop, tokenizers, gRPC channel), but
the server's limits are the server's, not a worker's: MAX_IN_FLIGHT, the admission queue and the per-key
requests and tokens per minute must hold whichever worker a connection lands on. So they live here, in the
supervisor's process, in the very same `AdmissionGate` and `RateLimiter` a single process uses, and workers
ask over a Unix socket (frontend/workers/shared.py): a few round trips per request, none per token.

What a worker holds is tracked by its connection: a worker that dies gives back its admission slots (and
stops waiting in the queue) when its socket closes, so a crash leaks no slot. A rollout through one worker
reaches the others through `fleet` messages: the coordinator forwards the command to every other worker and
answers once each has (frontend/models/rollout.py, `Fleet`). One rollout per model at a time, server-wide.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from frontend.policy.admission import AdmissionGate, NeverFits, RateLimiter, Rejected, TokenReservation
from frontend.settings import Settings
from frontend.workers.wire import Message, receive, send

log = logging.getLogger("frontend.workers")


def rejection(exc: Rejected) -> Message:
    return {"rejected": {"reason": exc.reason, "message": exc.message, "retry_after_s": exc.retry_after_s}}


class _Worker:
    """One connected worker: what it holds, and the commands sent to it that it has not answered yet."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.waiting: dict[int, asyncio.Task[None]] = {}  # admission requests still in the queue, by id
        self.granted: dict[int, int] = {}  # admission id -> slots held
        self.rollouts: set[str] = set()  # models whose rollout it runs
        self.commands: dict[int, asyncio.Future[Any]] = {}


class Coordinator:
    def __init__(self, settings: Settings):
        self.gate = AdmissionGate(settings.max_in_flight, settings.max_queued)
        self.limiter = RateLimiter(settings.rate_limit_rpm, settings.rate_limit_tpm)
        self.queue_wait_s = settings.max_queue_wait_s
        self._workers: set[_Worker] = set()
        self._rolling: set[str] = set()
        self._command_ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def workers(self) -> int:
        return len(self._workers)

    async def serve(self, path: str) -> asyncio.AbstractServer:
        return await asyncio.start_unix_server(self._connected, path=path, limit=1 << 20)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        worker = _Worker(writer)
        self._workers.add(worker)
        try:
            while (message := await receive(reader)) is not None:
                self._dispatch(worker, message)
        except ValueError:
            log.error("a worker sent a message that is not JSON; dropping its connection")
        finally:
            self._gone(worker)
            writer.close()

    def _gone(self, worker: _Worker) -> None:
        """A worker's connection closed (it exited, or died): everything it held is given back."""
        self._workers.discard(worker)
        for task in worker.waiting.values():
            task.cancel()
        slots = sum(worker.granted.values())
        worker.granted.clear()
        if slots:
            log.warning("a worker left holding %d admission slot(s); released", slots)
            self.gate.release(slots=slots)
        self._rolling -= worker.rollouts
        for future in worker.commands.values():
            if not future.done():
                future.set_result(None)

    def _spawn(self, coroutine: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _dispatch(self, worker: _Worker, message: Message) -> None:
        op = message.get("op")
        ident = message.get("id")
        reply = lambda **fields: send(worker.writer, {"id": ident, **fields})  # noqa: E731
        if op == "acquire":
            worker.waiting[ident] = self._spawn(self._acquire(worker, ident, message["timeout_s"], message["slots"]))
        elif op == "abandon":  # the request went away: out of the queue, or give back what it was granted
            task = worker.waiting.pop(ident, None)
            if task is not None:
                task.cancel()
            elif ident in worker.granted:
                self.gate.release(slots=worker.granted.pop(ident))
        elif op == "release":
            self.gate.release(message.get("held_s"), worker.granted.pop(ident, 0))
        elif op == "check_request":
            try:
                self.limiter.check_request(message["key"])
                reply()
            except Rejected as exc:
                reply(**rejection(exc))
        elif op == "reserve":
            try:
                reply(reserved=self.limiter.reserve_tokens(message["key"], message["tokens"]).reserved)
            except NeverFits as exc:
                reply(never_fits={"message": exc.message, "param": exc.param})
            except Rejected as exc:
                reply(**rejection(exc))
        elif op == "settle":
            self.limiter.settle(TokenReservation(message["key"], message["reserved"]), message["used"])
        elif op == "occupancy":
            reply(in_flight=self.gate.in_flight, queued=self.gate.queued)
        elif op == "begin_rollout":
            name = message["name"]
            free = name not in self._rolling
            if free:
                self._rolling.add(name)
                worker.rollouts.add(name)
            reply(ok=free)
        elif op == "end_rollout":
            self._rolling.discard(message["name"])
            worker.rollouts.discard(message["name"])
        elif op == "fleet":
            self._spawn(self._fleet(worker, ident, message["command"]))
        elif "cid" in message:  # a worker's answer to a fleet command
            future = worker.commands.pop(message["cid"], None)
            if future is not None and not future.done():
                future.set_result(message.get("result"))
        else:
            log.error("unknown coordinator message %r", op)

    async def _acquire(self, worker: _Worker, ident: int, timeout_s: float, slots: int) -> None:
        try:
            waited = await self.gate.acquire(timeout_s, slots)
        except Rejected as exc:
            send(worker.writer, {"id": ident, **rejection(exc)})
            return
        finally:
            worker.waiting.pop(ident, None)
        if worker not in self._workers:  # it died while the slots were being granted
            self.gate.release(slots=slots)
            return
        worker.granted[ident] = slots
        send(worker.writer, {"id": ident, "waited_s": waited})

    async def _fleet(self, origin: _Worker, ident: int, command: Message) -> None:
        """Run `command` on every worker but `origin`; answer `origin` with their results (None for a worker
        that left before it answered: its requests left with it)."""
        results = await asyncio.gather(*(self._command(worker, command) for worker in list(self._workers)
                                         if worker is not origin))
        send(origin.writer, {"id": ident, "results": list(results)})

    async def _command(self, worker: _Worker, command: Message) -> Any:
        cid = next(self._command_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        worker.commands[cid] = future
        send(worker.writer, {"cid": cid, "command": command})
        return await future
