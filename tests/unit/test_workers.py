"""The coordinator holds the server's limits for every worker (frontend/workers/): two links on one real Unix
socket stand for two worker processes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from frontend.policy.admission import NeverFits, Rejected, TokenDemand
from frontend.settings import Settings
from frontend.workers.coordinator import Coordinator
from frontend.workers.shared import CoordinatorLink, SharedFleet, SharedLimits


class Worker:
    """One worker's link, with the fleet commands it received."""

    def __init__(self, path: str, settings: Settings):
        self.link = CoordinatorLink(path)
        self.limits = SharedLimits(self.link, settings.max_in_flight, settings.rate_limit_tpm)
        self.fleet = SharedFleet(self.link)
        self.commands: list[dict[str, Any]] = []
        self.answer: dict[str, Any] = {"drained": True}

    async def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        self.commands.append(command)
        return self.answer

    async def __aenter__(self) -> "Worker":
        await self.link.connect(self.handle)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.link.close()


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[tuple[Coordinator, str, Settings]]:
    settings = Settings(max_in_flight=2, max_queued=4, rate_limit_rpm=3, rate_limit_tpm=1000)
    coordinator = Coordinator(settings)
    path = str(tmp_path / "c.sock")
    server = await coordinator.serve(path)
    yield coordinator, path, settings
    server.close()


async def until(condition: Any) -> None:
    """Wait for a state the coordinator reaches once it has read messages already sent (no timing)."""
    while not condition():
        await asyncio.sleep(0)


async def test_requests_per_minute_hold_across_workers(coordinator: Any) -> None:
    _, path, settings = coordinator
    async with Worker(path, settings) as a, Worker(path, settings) as b:
        await a.limits.check_request("key")
        await b.limits.check_request("key")
        await a.limits.check_request("key")
        for worker in (a, b):  # the 4th in the minute, whichever worker it reaches
            with pytest.raises(Rejected) as refused:
                await worker.limits.check_request("key")
            assert refused.value.reason == "requests_per_minute" and refused.value.retry_after_s > 0
        await b.limits.check_request("another key")


async def test_tokens_per_minute_hold_across_workers_and_settle_back(coordinator: Any) -> None:
    _, path, settings = coordinator
    async with Worker(path, settings) as a, Worker(path, settings) as b:
        first = await a.limits.reserve("key", TokenDemand(100, 500))
        with pytest.raises(Rejected):
            await b.limits.reserve("key", TokenDemand(100, 500))
        a.limits.settle(first, 10)  # used 10 of 600: 590 back
        assert (await b.limits.reserve("key", TokenDemand(100, 500))).reserved == 600
        with pytest.raises(NeverFits):
            await b.limits.reserve("key", TokenDemand(100, 5000))


async def test_admission_is_one_queue_for_all_workers(coordinator: Any) -> None:
    server, path, settings = coordinator
    async with Worker(path, settings) as a, Worker(path, settings) as b:
        held = await a.limits.admit(5, 2)
        waiting = asyncio.create_task(b.limits.admit(5, 1))
        await until(lambda: server.gate.queued == 1)
        assert await b.limits.occupancy() == (2, 1)
        a.limits.release(held, 0.1)
        granted = await waiting
        assert granted.slots == 1 and await a.limits.occupancy() == (1, 0)
        b.limits.release(granted, 0.1)
        await until(lambda: server.gate.in_flight == 0)


async def test_a_request_that_leaves_the_queue_takes_nothing(coordinator: Any) -> None:
    server, path, settings = coordinator
    async with Worker(path, settings) as a, Worker(path, settings) as b:
        held = await a.limits.admit(5, 2)
        waiting = asyncio.create_task(b.limits.admit(5, 1))
        await until(lambda: server.gate.queued == 1)
        waiting.cancel()  # its deadline, or its client gone
        await until(lambda: server.gate.queued == 0)
        a.limits.release(held, 0.1)
        await until(lambda: server.gate.in_flight == 0)


async def test_a_worker_that_dies_gives_back_its_slots_and_its_place_in_the_queue(coordinator: Any) -> None:
    server, path, settings = coordinator
    async with Worker(path, settings) as survivor:
        async with Worker(path, settings) as doomed:
            await doomed.limits.admit(5, 2)
            queued = asyncio.create_task(doomed.limits.admit(5, 1))
            await until(lambda: server.gate.queued == 1)
        await until(lambda: server.workers == 1 and server.gate.in_flight == 0 and server.gate.queued == 0)
        with pytest.raises(Exception):
            await queued  # its worker is gone: it never gets an answer other than an error
        granted = await survivor.limits.admit(5, 2)
        assert granted.slots == 2


async def test_a_rollout_step_reaches_every_other_worker_and_one_rollout_runs_at_a_time(coordinator: Any) -> None:
    server, path, settings = coordinator
    async with Worker(path, settings) as a, Worker(path, settings) as b, Worker(path, settings) as c:
        assert await a.fleet.begin("assistant")
        assert not await b.fleet.begin("assistant")  # server-wide: 409 whichever worker is asked
        assert await b.fleet.begin("coder")
        c.answer = {"drained": False}
        assert not await a.fleet.switch("assistant", "2", "1", 30.0)  # one worker still had requests on 1
        step = {"op": "switch", "name": "assistant", "version": "2", "retire": "1", "grace_s": 30.0}
        assert b.commands == [step] and c.commands == [step] and a.commands == []
        a.fleet.end("assistant")
        await until(lambda: "assistant" not in server._rolling)
        assert await c.fleet.begin("assistant")
    await until(lambda: server.workers == 0)
    assert not server._rolling  # a worker that dies mid-rollout frees its model
