"""The admission gate counts engine requests: a request with n choices over k prompts takes n x k slots,
first come first served, and a large request is neither overtaken nor able to deadlock the gate."""

from __future__ import annotations

import asyncio

import pytest

from frontend.policy.admission import AdmissionGate, Rejected, slots_for


async def test_a_request_takes_one_slot_per_engine_request() -> None:
    gate = AdmissionGate(max_in_flight=4, max_queued=0)
    assert await gate.acquire(1, slots=slots_for(3, gate.max_in_flight)) == 0 and gate.in_flight == 3
    with pytest.raises(Rejected) as refused:  # 3 + 2 > 4 and no queue
        await gate.acquire(1, slots=2)
    assert refused.value.reason == "queue_full"
    assert await gate.acquire(1, slots=1) == 0 and gate.in_flight == 4
    gate.release(slots=3)
    gate.release(slots=1)
    assert gate.in_flight == 0


async def test_a_request_larger_than_the_gate_runs_alone_rather_than_never() -> None:
    gate = AdmissionGate(max_in_flight=4, max_queued=2)
    assert slots_for(16, 4) == 4 and slots_for(0, 4) == 1
    await gate.acquire(1, slots=1)
    big = asyncio.create_task(gate.acquire(10, slots=slots_for(16, gate.max_in_flight)))
    await asyncio.sleep(0)
    assert gate.queued == 1 and not big.done()
    gate.release(slots=1)
    await asyncio.wait_for(big, 1)
    assert gate.in_flight == 4


async def test_first_come_first_served_a_large_waiter_is_not_overtaken() -> None:
    gate = AdmissionGate(max_in_flight=4, max_queued=4)
    await gate.acquire(1, slots=3)
    large = asyncio.create_task(gate.acquire(10, slots=4))
    await asyncio.sleep(0)
    small = asyncio.create_task(gate.acquire(10, slots=1))  # would fit now, but waits behind `large`
    await asyncio.sleep(0)
    assert not small.done() and gate.queued == 2
    gate.release(slots=3)
    await asyncio.wait_for(large, 1)
    assert not small.done()
    gate.release(slots=4)
    await asyncio.wait_for(small, 1)
    assert gate.in_flight == 1


async def test_a_large_waiter_that_gives_up_lets_the_ones_behind_it_in() -> None:
    gate = AdmissionGate(max_in_flight=4, max_queued=4)
    await gate.acquire(1, slots=3)
    large = asyncio.create_task(gate.acquire(10, slots=4))
    await asyncio.sleep(0)
    small = asyncio.create_task(gate.acquire(10, slots=1))
    await asyncio.sleep(0)
    large.cancel()
    await asyncio.gather(large, return_exceptions=True)
    await asyncio.wait_for(small, 1)
    assert gate.in_flight == 4 and gate.queued == 0
