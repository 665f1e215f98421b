"""The Responses store when things go wrong, on the real stack (issue 50): a PostgreSQL that is down costs
`/v1/responses` only (503 + Retry-After) and is found again by itself; a background response whose worker is
killed (kill -9) reads as failed and its stream followers end; a chain past the byte bound is a 400 naming
`previous_response_id`; a response over the size cap is kept without its stream events.

Every wait is a poll of the state the test needs, with a deadline; none is a fixed sleep.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from tests.conftest import PostgreSQLServer
from tests.integration.conftest import SLOW_MODEL, Stack, frontend_on, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WAIT_S = 120  # a bound for a hung stack, not a speed


def poll(what: Callable[[], Any], until: Callable[[Any], bool], within_s: float) -> Any:
    """Call `what` until its result satisfies `until`; that result, or an assertion error after `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        result = what()
        if until(result):
            return result
        assert time.monotonic() < deadline, f"not there after {within_s} s: last {result!r}"
        time.sleep(0.05)


def test_a_stopped_postgresql_costs_only_the_responses_api(stack: Stack, tmp_path: Path) -> None:
    database = PostgreSQLServer()
    try:
        database.stop()
        with frontend_on(stack, "tensorrt_llm", tmp_path, RESPONSES_DB_URL=database.url) as url:
            def chat() -> httpx.Response:
                return httpx.post(f"{url}/chat/completions", timeout=WAIT_S, json={
                    "model": stack.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})

            def respond() -> httpx.Response:
                return httpx.post(f"{url}/responses", timeout=WAIT_S,
                                  json={"model": stack.model, "input": "Hi", "max_output_tokens": 2})

            # Started with the database down: the server is up, chat serves, /v1/responses is a 503.
            assert chat().status_code == 200
            refused = respond()
            assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["type"] == "server_error"
            assert chat().status_code == 200
            assert "stored responses unavailable" in (tmp_path / "frontend.log").read_text()
            # The database comes back: within 10 s, with nobody acting, /v1/responses is served again.
            database.start()
            created = poll(respond, lambda r: r.status_code != 503, 10)
            assert created.status_code == 200, created.text
            stored = httpx.get(f"{url}/responses/{created.json()['id']}", timeout=WAIT_S)
            assert stored.status_code == 200 and stored.json()["id"] == created.json()["id"]
            # Down again once open: 503s (never a 500), chat unaffected; back up: found again in 10 s.
            database.stop()
            refused = respond()
            assert refused.status_code == 503 and "Retry-After" in refused.headers, refused.text
            assert chat().status_code == 200
            database.start()
            assert poll(respond, lambda r: r.status_code != 503, 10).status_code == 200
    finally:
        database.close()


def runner_pid(log: Path, response_id: str) -> int | None:
    """The pid of the worker that runs a background response (its log line says so; every line has a pid)."""
    match = re.search(rf"\[(\d+)\]: background response {response_id} runs in this process", log.read_text())
    return int(match.group(1)) if match else None


def test_a_killed_workers_background_response_reads_failed_and_its_followers_end(stack: Stack,
                                                                                  tmp_path: Path) -> None:
    log = tmp_path / "frontend.log"
    with frontend_on(stack, SLOW_MODEL, tmp_path, FRONTEND_WORKERS="2", RESPONSES_STALE_AFTER_S="5") as url:
        # The slow engine takes >= 50 ms a token: 400 tokens are >= 20 s, far longer than the test needs.
        with httpx.stream("POST", f"{url}/responses", timeout=WAIT_S, json={
                "model": stack.model, "input": "Write a long story.", "max_output_tokens": 400, "background": True,
                "stream": True, "ignore_eos": True}) as live:
            assert live.status_code == 200
            payloads = (json.loads(line[len("data: "):]) for line in live.iter_lines() if line.startswith("data: "))
            response_id = next(payloads)["response"]["id"]
            next(e for e in payloads if e["type"] == "response.output_text.delta")  # it runs: a token is out
        pid = runner_pid(log, response_id)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()

        def status() -> str:
            return httpx.get(f"{url}/responses/{response_id}", timeout=WAIT_S).json()["status"]

        # A follower of its stream (on a live worker: the dead one accepts nothing) ends, failed.
        with httpx.stream("GET", f"{url}/responses/{response_id}", params={"stream": "true"},
                          timeout=WAIT_S) as follower:
            assert follower.status_code == 200
            events = [json.loads(line[len("data: "):]) for line in follower.iter_lines() if line.startswith("data: ")]
        assert events[-1]["type"] == "response.failed" and events[-1]["response"]["error"]["code"] == "server_error"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert status() == "failed" and time.monotonic() - started < 60
        assert wait_until(lambda: f"(pid {pid}) exited" in log.read_text(), WAIT_S)  # the supervisor saw it die


def test_a_long_chain_is_refused_and_a_big_response_is_kept_without_its_events(stack: Stack, tmp_path: Path) -> None:
    with frontend_on(stack, "tensorrt_llm", tmp_path, RESPONSES_MAX_CHAIN_BYTES="2000",
                     RESPONSES_MAX_BYTES="20000") as url:
        # Each turn stores ~350 bytes of input and a short output: the bound is passed within a few turns.
        previous = None
        for turn in range(12):
            body: dict[str, Any] = {"model": stack.model, "input": f"Turn {turn}: " + "words " * 40,
                                    "max_output_tokens": 2, "truncation": "auto"}
            if previous is not None:
                body["previous_response_id"] = previous
            answer = httpx.post(f"{url}/responses", json=body, timeout=WAIT_S)
            if answer.status_code == 400:
                error = answer.json()["error"]
                assert error["param"] == "previous_response_id" and error["type"] == "invalid_request_error"
                assert turn >= 2, error
                break
            assert answer.status_code == 200, answer.text
            previous = answer.json()["id"]
        else:
            raise AssertionError("the chain was never refused")

        # ~170 bytes of event JSON a token: 200 tokens of stream pass the 20,000-byte cap; the response does not.
        with httpx.stream("POST", f"{url}/responses", timeout=WAIT_S, json={
                "model": stack.model, "input": "Hi", "max_output_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True}) as live:
            assert live.status_code == 200
            events = [json.loads(line[len("data: "):]) for line in live.iter_lines() if line.startswith("data: ")]
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.incomplete" and final["usage"]["output_tokens"] == 200
        stored = httpx.get(f"{url}/responses/{final['id']}", timeout=WAIT_S)
        assert stored.status_code == 200 and stored.json()["output"] == final["output"]
        replay = httpx.get(f"{url}/responses/{final['id']}", params={"stream": "true"}, timeout=WAIT_S)
        assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"  # kept without its events
        follow_up = httpx.post(f"{url}/responses", timeout=WAIT_S, json={
            "model": stack.model, "input": "And?", "max_output_tokens": 2, "previous_response_id": final["id"]})
        assert follow_up.status_code == 200, follow_up.text
