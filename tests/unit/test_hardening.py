"""Pure pieces of the production hardening: API key store, token buckets, admission gate, deadlines."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from frontend.policy import auth
from frontend.policy.admission import (AdmissionGate, NeverFits, RateLimiter, Rejected, TokenBucket, TokenDemand,
                                tokens_to_charge, tokens_to_reserve)
from frontend.policy.auth import KeyStore, bearer_token
from frontend.policy.deadlines import Deadline, Deadlines
from frontend.api_types.errors import OpenAIError, install_error_handlers
from frontend.http.middleware import Edge, EdgeMiddleware, route_label
from frontend.generation.serving import UsageCounter
from frontend.settings import Settings


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ----- keys -----------------------------------------------------------------------------------------------
def test_keys_from_env_and_file_are_stored_as_digests_only(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# ops keys\nsk-file-one\n\n  sk-file-two  \n")
    store = KeyStore("sk-env-one, sk-env-two,", keys_file)
    assert len(store) == 4 and store.enabled
    ids = {store.verify(key) for key in ("sk-env-one", "sk-env-two", "sk-file-one", "sk-file-two")}
    assert len(ids) == 4 and None not in ids  # one salted id per key (see tests/unit/test_tls_and_keys.py)
    assert all(len(i) == auth.KEY_ID_HEX_DIGITS for i in ids)
    assert store.verify("sk-env-one") != hashlib.sha256(b"sk-env-one").hexdigest()[:auth.KEY_ID_HEX_DIGITS]
    for wrong in ("sk-env-on", "sk-env-one ", "", "# ops keys", "sk-file-one\n"):
        assert store.verify(wrong) is None
    assert store.verify(None) is None
    stored = vars(store)
    assert not any("sk-" in repr(value) for value in stored.values()), "plaintext keys must not be kept"


def test_reload_revokes_and_adds_keys_and_keeps_env_keys(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("old-key\n")
    store = KeyStore("env-key", keys_file)
    keys_file.write_text("new-key\n")
    assert store.verify("old-key") is not None  # nothing changes before the reload
    assert store.reload()
    assert store.verify("old-key") is None and store.verify("new-key") is not None
    assert store.verify("env-key") is not None
    keys_file.unlink()
    assert not store.reload()  # unreadable: the keys loaded before stay
    assert store.verify("new-key") is not None


def test_no_keys_means_disabled_but_an_empty_keys_file_means_nobody_gets_in(tmp_path: Path) -> None:
    assert not KeyStore(None, None).enabled and not KeyStore(" , ", None).enabled
    empty = tmp_path / "keys"
    empty.write_text("\n")
    store = KeyStore(None, empty)
    assert store.enabled and store.verify("anything") is None
    with pytest.raises(FileNotFoundError):
        KeyStore(None, tmp_path / "missing")


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer   abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None and bearer_token("") is None


def test_compare_is_constant_time_on_fixed_length_digests_against_every_key() -> None:
    store = KeyStore("k1-" + "a" * 40 + ",k2-" + "b" * 40 + ",k3-" + "c" * 40)
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    with mock.patch.object(auth.hmac, "compare_digest", side_effect=spy):
        for presented in ("k1-" + "a" * 40, "k1-" + "a" * 39 + "x", "x", "z" * 1000):
            calls.clear()
            store.verify(presented)
            assert len(calls) == 3  # every stored key, whether or not one matched (no early exit)
            assert all(isinstance(a, bytes) and len(a) == 32 and len(b) == 32 for a, b in calls)


def test_wrong_key_timing_does_not_depend_on_the_matching_prefix() -> None:
    """Coarse: a wrong key sharing 63 of 64 characters with a real key takes as long as one sharing none."""
    real_key = "sk-" + "q" * 61
    store = KeyStore(real_key)
    near, far = real_key[:-1] + "x", "x" * len(real_key)

    def batch_ns(key: str) -> int:  # this thread's CPU time: time spent waiting for a core is not the check's
        start = time.thread_time_ns()
        for _ in range(2000):
            store.verify(key)
        return time.thread_time_ns() - start

    batch_ns(near), batch_ns(far)  # warm up
    near_ns, far_ns = [], []
    for _ in range(9):  # interleaved, so that noise from other processes hits both alike
        near_ns.append(batch_ns(near))
        far_ns.append(batch_ns(far))
    ratio = min(near_ns) / min(far_ns)
    assert 0.5 < ratio < 2.0, ratio  # the digests differ from the first byte either way


# ----- rate limits ----------------------------------------------------------------------------------------
def test_token_bucket_refills_continuously_and_says_when_to_retry() -> None:
    clock = FakeClock()
    bucket = TokenBucket(60, 1.0, clock)
    assert bucket.take(60) == 0
    assert bucket.take(1) == pytest.approx(1.0)
    clock.advance(0.5)
    assert bucket.take(1) == pytest.approx(0.5)
    clock.advance(0.5)
    assert bucket.take(1) == 0
    assert math.isinf(bucket.take(61))
    clock.advance(1000)
    assert bucket.tokens == 60  # never above capacity
    bucket.give_back(10)
    assert bucket.tokens == 60


def test_requests_per_minute_per_key() -> None:
    clock = FakeClock()
    limiter = RateLimiter(requests_per_minute=3, clock=clock)
    for _ in range(3):
        limiter.check_request("a")
    with pytest.raises(Rejected) as raised:
        limiter.check_request("a")
    assert raised.value.reason == "requests_per_minute" and raised.value.retry_after_s == pytest.approx(20)
    limiter.check_request("b")  # another key has its own bucket
    clock.advance(20)
    limiter.check_request("a")


def test_tokens_per_minute_reserve_up_front_and_settle_with_actual_usage() -> None:
    clock = FakeClock()
    limiter = RateLimiter(tokens_per_minute=1000, clock=clock)
    first = limiter.reserve_tokens("k", 600)  # prompt 100 + max_tokens 500
    with pytest.raises(Rejected) as raised:
        limiter.reserve_tokens("k", 600)
    assert raised.value.reason == "tokens_per_minute"
    assert raised.value.retry_after_s == pytest.approx(200 / (1000 / 60))
    limiter.settle(first, 150)  # it used 150: 450 come back
    limiter.settle(first, 150)  # settling twice gives nothing more
    second = limiter.reserve_tokens("k", 800)
    assert second.reserved == 800
    with pytest.raises(NeverFits) as too_big:  # more than the bucket ever holds: no retry can help
        limiter.reserve_tokens("other", 1001)
    assert "Request too large" in too_big.value.message and too_big.value.param == "max_tokens"


def test_an_explicit_max_tokens_past_the_token_budget_is_a_400_naming_it_not_a_retried_429() -> None:
    assert tokens_to_reserve(TokenDemand(100, 900), 1000) == 1000
    with pytest.raises(NeverFits) as raised:
        tokens_to_reserve(TokenDemand(100, 901), 1000)
    assert raised.value.param == "max_tokens"
    assert "max_tokens 901" in raised.value.message and "1000 tokens per minute" in raised.value.message
    assert "at most 900" in raised.value.message
    with pytest.raises(NeverFits) as choices:  # n=4: 4 x 300 on top of the prompt
        tokens_to_reserve(TokenDemand(100, 1200, engine_requests=4), 1000)
    assert "max_tokens 300 x 4 generations" in choices.value.message and "at most 225" in choices.value.message


def test_a_defaulted_max_tokens_reserves_at_most_what_the_bucket_holds() -> None:
    """max_tokens omitted (the openai SDK's default): the rest of a 32k context under a 10k limit would never
    fit, so the reservation is capped at the limit and the request runs."""
    assert tokens_to_reserve(TokenDemand(100, 32_668, max_tokens_given=False), 10_000) == 10_000
    assert tokens_to_reserve(TokenDemand(100, 400, max_tokens_given=False), 10_000) == 500  # fits: all of it
    with pytest.raises(NeverFits) as prompt:  # the prompt alone leaves no room for a token: shorten it
        tokens_to_reserve(TokenDemand(10_000, 22_768, max_tokens_given=False), 10_000)
    assert prompt.value.param == "prompt" and "10000 tokens" in prompt.value.message
    with pytest.raises(NeverFits) as explicit:  # the same prompt with max_tokens given: still the prompt's fault
        tokens_to_reserve(TokenDemand(9_999, 2, engine_requests=2), 10_000)
    assert explicit.value.param == "prompt"


def test_use_beyond_a_capped_reservation_is_a_debt_the_next_requests_wait_out() -> None:
    clock = FakeClock()
    limiter = RateLimiter(tokens_per_minute=1000, clock=clock)
    reservation = limiter.reserve("k", TokenDemand(100, 3000, max_tokens_given=False))
    assert reservation.reserved == 1000
    limiter.settle(reservation, 1600)  # it ran to 1600 tokens: 600 owed
    with pytest.raises(Rejected) as waiting:
        limiter.reserve("k", TokenDemand(10, 10))
    assert waiting.value.retry_after_s == pytest.approx(620 / (1000 / 60))
    clock.advance(620 / (1000 / 60))
    assert limiter.reserve("k", TokenDemand(10, 10)).reserved == 20


@pytest.mark.parametrize(("admitted", "status", "completion", "charged"), [
    (True, 200, 50, 150),  # ran: prompt + generated
    (True, 200, 0, 100),  # ran (a stream the client left after its status): the prompt was processed
    (True, 500, 7, 107),  # failed after generating: what it used
    (True, 504, 3, 103),  # timed out mid-generation: what it used
    (False, 429, 0, 0),  # admission: queue_full or queue_timeout
    (True, 429, 0, 0),  # the engine's queue was full
    (True, 503, 0, 0),  # the engine model is not loaded, or the engine has failed
    (True, 400, 0, 0),  # the engine refused what the client sent
    (False, 400, 0, 0),  # refused before admission
    (True, 499, 0, 0),  # the client left before the first token
])
def test_only_requests_that_ran_are_charged(admitted: bool, status: int, completion: int, charged: int) -> None:
    assert tokens_to_charge(admitted, status, 100, completion) == charged


def test_a_refused_request_gives_back_its_whole_reservation() -> None:
    clock = FakeClock()
    limiter = RateLimiter(tokens_per_minute=1000, clock=clock)
    refused = limiter.reserve("k", TokenDemand(400, 600))
    limiter.settle(refused, tokens_to_charge(False, 429, 400, 0))
    assert limiter.reserve("k", TokenDemand(400, 600)).reserved == 1000  # the whole minute's budget, at once


def tpm_client(tpm: int) -> tuple[TestClient, Edge]:
    """The edge middleware in front of a stand-in generation route that does what routes.new_generation does
    with the budget (reserve, then admission) and then answers as its body says: tokens generated or an
    engine error's status."""
    edge = Edge(Settings(rate_limit_tpm=tpm, max_in_flight=1, max_queued=0))
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        ctx = request.state.ctx
        await ctx.reserve_tokens(TokenDemand(body["prompt_tokens"], body.get("max_tokens") or 5000, 1,
                                             max_tokens_given="max_tokens" in body), "prompt")
        ctx.prompt_tokens = body["prompt_tokens"]
        ctx.usage = UsageCounter(body["prompt_tokens"])
        await ctx.admit(1)
        if "engine_status" in body:
            raise OpenAIError(body["engine_status"], "the engine said no", "server_error")
        ctx.usage.completion_tokens = body["generated"]
        return {}

    app.add_middleware(EdgeMiddleware, edge=edge)
    return TestClient(app), edge


def test_requests_refused_by_admission_or_the_engine_cost_no_tokens() -> None:
    client, edge = tpm_client(1000)
    edge.limits.gate.in_flight = 1  # every slot taken and no queue: admission answers queue_full
    for _ in range(5):
        answer = client.post("/v1/completions", json={"prompt_tokens": 300, "max_tokens": 100})
        assert answer.status_code == 429 and answer.json()["error"]["code"] == "overloaded"
    edge.limits.gate.in_flight = 0
    for status in (429, 503, 400):
        answer = client.post("/v1/completions", json={"prompt_tokens": 300, "max_tokens": 100,
                                                      "engine_status": status})
        assert answer.status_code == status
    # none of the 8 refusals was charged: the whole minute's budget is still there
    assert client.post("/v1/completions", json={"prompt_tokens": 500, "max_tokens": 500,
                                                "generated": 500}).status_code == 200
    # and what ran was charged: prompt + generated, nothing is left
    limited = client.post("/v1/completions", json={"prompt_tokens": 1, "max_tokens": 1, "generated": 1})
    assert limited.status_code == 429 and limited.json()["error"]["type"] == "tokens"


def test_a_request_that_can_never_fit_the_token_budget_is_a_400_unless_max_tokens_was_defaulted() -> None:
    client, _ = tpm_client(1000)
    answer = client.post("/v1/completions", json={"prompt_tokens": 300, "max_tokens": 800, "generated": 1})
    assert answer.status_code == 400 and "Retry-After" not in answer.headers
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "max_tokens"
    assert error["code"] == "tokens_per_minute_exceeded" and "1000 tokens per minute" in error["message"]
    too_long = client.post("/v1/completions", json={"prompt_tokens": 1000, "generated": 1})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
    # max_tokens left out (the rest of the context, 5000 here): it runs, with the whole budget reserved
    assert client.post("/v1/completions", json={"prompt_tokens": 300, "generated": 100}).status_code == 200


def test_no_limits_configured_never_rejects() -> None:
    limiter = RateLimiter()
    for _ in range(10_000):
        limiter.check_request("k")
    limiter.settle(limiter.reserve_tokens("k", 10**9), 5)


# ----- admission gate -------------------------------------------------------------------------------------
async def test_gate_admits_queues_in_order_and_refuses_past_the_queue() -> None:
    gate = AdmissionGate(max_in_flight=2, max_queued=2)
    assert await gate.acquire(1) == 0 and await gate.acquire(1) == 0
    order: list[int] = []

    async def waiter(i: int) -> None:
        await gate.acquire(5)
        order.append(i)

    waiters = [asyncio.create_task(waiter(i)) for i in range(2)]
    await asyncio.sleep(0.01)
    assert gate.in_flight == 2 and gate.queued == 2
    with pytest.raises(Rejected) as raised:
        await gate.acquire(5)
    assert raised.value.reason == "queue_full" and raised.value.retry_after_s >= 1
    gate.release(0.1)
    gate.release(0.1)
    await asyncio.gather(*waiters)
    assert order == [0, 1] and gate.in_flight == 2 and gate.queued == 0
    gate.release()
    gate.release()
    assert gate.in_flight == 0


async def test_gate_queue_wait_is_bounded_and_a_cancelled_waiter_gives_its_place_back() -> None:
    gate = AdmissionGate(max_in_flight=1, max_queued=4)
    await gate.acquire(None)
    with pytest.raises(Rejected) as raised:
        await gate.acquire(0.05)
    assert raised.value.reason == "queue_timeout" and gate.queued == 0
    cancelled = asyncio.create_task(gate.acquire(10))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    assert gate.queued == 0
    later = asyncio.create_task(gate.acquire(10))
    await asyncio.sleep(0.01)
    gate.release()
    assert await later == pytest.approx(0, abs=0.5)
    gate.release()
    assert gate.in_flight == 0


async def test_gate_slot_handed_to_a_waiter_that_is_cancelled_at_once_is_not_lost() -> None:
    gate = AdmissionGate(max_in_flight=1, max_queued=1)
    await gate.acquire(None)
    waiter = asyncio.create_task(gate.acquire(10))
    await asyncio.sleep(0.01)
    gate.release()  # handed over to the waiter...
    waiter.cancel()  # ...which is cancelled before it runs
    await asyncio.gather(waiter, return_exceptions=True)
    assert gate.in_flight == 0 and gate.queued == 0
    assert await gate.acquire(0.1) == 0


# ----- deadlines ------------------------------------------------------------------------------------------
async def test_deadline_cancels_the_work_and_raises_a_timeout_error() -> None:
    cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    deadline = Deadline(0.05)
    with pytest.raises(OpenAIError) as raised:
        await deadline.run(slow())
    assert cancelled.is_set()
    assert raised.value.status == 504 and raised.value.code == "timeout"
    with pytest.raises(OpenAIError):  # once expired, later work fails at once
        await deadline.run(asyncio.sleep(0))
    assert await Deadline(None).run(asyncio.sleep(0, "ok")) == "ok"
    assert await Deadline(5).run(asyncio.sleep(0, "ok")) == "ok"


async def test_abort_all_ends_running_work_with_a_shutdown_error() -> None:
    registry = Deadlines()
    deadline = Deadline(60)
    registry.add(deadline)
    task = asyncio.create_task(deadline.run(asyncio.sleep(10)))
    await asyncio.sleep(0.01)
    assert registry.abort_all() == 1
    with pytest.raises(OpenAIError) as raised:
        await task
    assert raised.value.status == 503 and raised.value.code == "service_unavailable"


async def test_a_cancel_from_outside_is_not_turned_into_a_timeout() -> None:
    task = asyncio.create_task(Deadline(60).run(asyncio.sleep(10)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_route_labels_are_bounded() -> None:
    assert route_label("/v1/chat/completions") == "/v1/chat/completions"
    assert route_label("/v1/models/demo-tiny") == "/v1/models/{model_id}"
    assert route_label("/random/" + "x" * 100) == "unmatched"


def test_launcher_forwards_sighup_to_the_frontend_and_keeps_running(monkeypatch) -> None:
    import signal
    import subprocess
    import sys

    from launcher import processes
    child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                              "signal.signal(signal.SIGHUP, lambda *a: sys.exit(7))\n"
                              "print('ready', flush=True)\ntime.sleep(30)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ready"
        monkeypatch.setattr(processes, "_frontend_pid", child.pid)
        processes.forward_hup(signal.SIGHUP, None)  # no _Shutdown raised: the launcher keeps going
        assert child.wait(10) == 7
        monkeypatch.setattr(processes, "_frontend_pid", None)
        processes.forward_hup(signal.SIGHUP, None)  # before the frontend exists: nothing happens
    finally:
        child.kill()
        child.wait()
