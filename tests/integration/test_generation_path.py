"""The generation path under real clients, on the real stack (tritonserver, the CPU engine, the frontend;
the official `openai` client and raw HTTP): stop strings that stop the engine whether or not the client
streams, request ids that cannot cancel other clients, clients that leave before their first token,
n > 1 with a failing choice, an engine thread that dies.

Where a test needs an engine slower than any machine, or one that fails on cue, it uses the session
Triton's test copies of the engine model (conftest.KNOB_MODELS), through a frontend of its own; it
synchronises on the engine's gauges, never on sleeps."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import openai
import pytest

from launcher.ports import find_free_port
from tests.integration.conftest import (CRASH_MODEL, CRASH_SEED, FAIL_SEED, FAULTY_MODEL, HELD_MODEL, SLOW_MODEL,
                                        Stack, start_frontend, stop_process, wait_http_ok)

pytestmark = pytest.mark.integration


def wait_until(condition: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def idle(stack: Stack, model: str) -> bool:
    return stack.engine_metric("active_slots", model) == 0 and stack.engine_metric("queued_requests", model) == 0


def settled(stack: Stack, counter: str, model: str = "tensorrt_llm") -> float:
    """An engine counter once the engine is idle and the counter has stopped moving (the engine publishes
    its metrics at least every 0.1 s)."""
    assert wait_until(lambda: idle(stack, model), 60)
    previous = stack.engine_metric(counter, model)
    while True:
        time.sleep(0.3)
        current = stack.engine_metric(counter, model)
        if current == previous:
            return current
        previous = current


@pytest.fixture(scope="module")
def frontends(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A frontend per test engine model: model name -> base URL (http://.../v1)."""
    logs = tmp_path_factory.mktemp("generation_path")
    processes, urls = [], {}
    try:
        for model in (SLOW_MODEL, HELD_MODEL, FAULTY_MODEL):
            port = find_free_port()
            process = start_frontend(stack.triton_grpc_url, port, logs / f"{model}.log", ENGINE_MODEL=model,
                                     SERVED_MODEL_NAME=stack.model)
            processes.append(process)
            wait_http_ok(f"http://127.0.0.1:{port}/health/ready", 120, process)
            urls[model] = f"http://127.0.0.1:{port}/v1"
        yield urls
    finally:
        for process in processes:
            stop_process(process)


def sse_payloads(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


# ----- stop strings stop the engine ---------------------------------------------------------------------
def test_a_non_streamed_stop_string_stops_the_engine_and_counts_what_the_stream_counts(
        client: openai.OpenAI, stack: Stack) -> None:
    base = dict(model=stack.model, prompt="Hello", seed=1234, temperature=1.0, extra_body={"ignore_eos": True})
    text = client.completions.create(**base, max_tokens=120).choices[0].text
    k = next(i for i in range(12, len(text) - 2) if text.index(text[i:i + 2]) == i)
    stop = text[k:k + 2]  # first seen at k: generation must end there, far from max_tokens
    before = settled(stack, "generated_tokens_total")
    whole = client.completions.create(**base, max_tokens=450, stop=[stop])
    assert whole.choices[0].text == text[:k] and whole.choices[0].finish_reason == "stop"
    # the engine let go of the request at the stop, not after max_tokens
    assert wait_until(lambda: stack.engine_metric("active_slots") == 0, 1.0)
    generated = settled(stack, "generated_tokens_total") - before
    used = whole.usage.completion_tokens
    assert used < 120 and used <= generated < (used + 450) / 2, (used, generated)

    chunks = list(client.completions.create(**base, max_tokens=450, stop=[stop], stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[:k]
    assert chunks[-1].usage.completion_tokens == used


def test_logprobs_end_at_the_stop_with_one_entry_per_completion_token(client: openai.OpenAI, stack: Stack) -> None:
    base = dict(model=stack.model, messages=[{"role": "user", "content": "logprobs"}], seed=99, max_tokens=80)
    text = client.chat.completions.create(**base).choices[0].message.content
    k = next(i for i in range(8, len(text) - 2) if text.index(text[i:i + 2]) == i)
    stopped = client.chat.completions.create(**base, stop=[text[k:k + 2]], logprobs=True, top_logprobs=2)
    choice = stopped.choices[0]
    assert choice.message.content == text[:k] and choice.finish_reason == "stop"
    assert len(choice.logprobs.content) == stopped.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)


# ----- request ids ---------------------------------------------------------------------------------------
async def test_a_reused_request_id_cannot_cancel_another_clients_stream(frontends: dict[str, str]) -> None:
    url = f"{frontends[SLOW_MODEL]}/completions"
    body = {"model": "demo-tiny", "prompt": "same id", "max_tokens": 60, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"X-Request-Id": "shared-id"}
    async with httpx.AsyncClient(timeout=120) as http:
        async def first_client() -> list[dict]:
            async with http.stream("POST", url, json=body, headers=headers) as response:
                assert response.status_code == 200 and response.headers["x-request-id"] == "shared-id"
                raw = (await response.aread()).decode()
            payloads = sse_payloads(raw)
            assert payloads[-1] == "[DONE]"
            return [json.loads(p) for p in payloads[:-1]]

        first = asyncio.create_task(first_client())
        async with http.stream("POST", url, json=body, headers=headers) as second:  # same id, leaves early
            async for line in second.aiter_lines():
                if line.startswith("data: {"):
                    break
        assert not first.done()  # 60 tokens take >= 3 s on the slow engine: it was running when the second left
        chunks = await asyncio.wait_for(first, 60)
    assert not any("error" in chunk for chunk in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["length"] and chunks[-1]["usage"]["completion_tokens"] == 60


# ----- clients that leave ----------------------------------------------------------------------------------
async def test_streams_dropped_before_their_first_token_leave_the_engine_idle_within_a_second(
        stack: Stack, frontends: dict[str, str]) -> None:
    url = f"{frontends[HELD_MODEL]}/completions"
    body = {"model": "demo-tiny", "prompt": "no first token yet", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    limits = httpx.Limits(max_connections=20, max_keepalive_connections=20)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        async def wait_for_headers() -> None:
            async with http.stream("POST", url, json=body):
                raise AssertionError("the held engine sent a first token")

        streams = [asyncio.create_task(wait_for_headers()) for _ in range(12)]
        # 8 running (the engine's batch) + 4 waiting, none has a token out yet
        full = await asyncio.to_thread(wait_until, lambda: stack.engine_metric("active_slots", HELD_MODEL) == 8
                                       and stack.engine_metric("queued_requests", HELD_MODEL) == 4, 60)
        assert full and not any(s.done() for s in streams)
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        left = time.monotonic()
        assert await asyncio.to_thread(wait_until, lambda: idle(stack, HELD_MODEL), 1.0), \
            "the engine kept working for clients that had left"
        print(f"\n12 streams dropped before their first token: engine idle after {time.monotonic() - left:.2f} s")


def test_n3_with_one_failing_choice_cancels_the_other_two_engine_requests(
        stack: Stack, frontends: dict[str, str]) -> None:
    url = f"{frontends[FAULTY_MODEL]}/completions"
    body = {"model": "demo-tiny", "prompt": "three choices", "n": 3, "seed": FAIL_SEED - 1, "max_tokens": 400,
            "ignore_eos": True}  # choice 1 gets seed FAIL_SEED; 400 tokens take >= 8 s on this engine
    cancelled = settled(stack, "cancelled_requests_total", FAULTY_MODEL)
    response = httpx.post(url, json=body, timeout=60)
    assert response.status_code == 500 and "injected" in response.json()["error"]["message"], response.text
    assert wait_until(lambda: idle(stack, FAULTY_MODEL), 2.0)  # the siblings did not run to their 400 tokens
    assert settled(stack, "cancelled_requests_total", FAULTY_MODEL) - cancelled == 2

    streamed = httpx.post(url, json={**body, "stream": True}, timeout=60)
    payloads = sse_payloads(streamed.text)
    assert streamed.status_code == 200 and payloads[-1] == "[DONE]"
    assert "injected" in json.loads(payloads[-2])["error"]["message"]
    assert wait_until(lambda: idle(stack, FAULTY_MODEL), 2.0)


# ----- an engine that dies ----------------------------------------------------------------------------------
async def test_an_engine_thread_that_dies_fails_open_streams_and_turns_readiness_off(
        stack: Stack, tmp_path: Path) -> None:
    port = find_free_port()
    process = start_frontend(stack.triton_grpc_url, port, tmp_path / "frontend.log", ENGINE_MODEL=CRASH_MODEL)
    root = f"http://127.0.0.1:{port}"
    body = {"model": "demo-tiny", "prompt": "crash", "max_tokens": 400, "ignore_eos": True}
    try:
        wait_http_ok(f"{root}/health/ready", 120, process)
        async with httpx.AsyncClient(timeout=60) as http:
            async def bystander(started: asyncio.Event) -> list[str]:
                async with http.stream("POST", f"{root}/v1/completions", json={**body, "stream": True}) as response:
                    payloads = []
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            payloads.append(line[6:])
                            started.set()
                    return payloads

            started = asyncio.Event()
            open_stream = asyncio.create_task(bystander(started))  # 400 tokens: >= 4 s on this engine
            await asyncio.wait_for(started.wait(), 30)
            crash = await http.post(f"{root}/v1/completions", json={**body, "seed": CRASH_SEED, "max_tokens": 5})
            assert crash.status_code == 500 and "engine" in crash.json()["error"]["message"], crash.text
            payloads = await asyncio.wait_for(open_stream, 30)  # ended with an error, not left hanging
            assert payloads[-1] == "[DONE]" and "engine failed" in json.loads(payloads[-2])["error"]["message"]

            deadline = time.monotonic() + 30
            while (await http.get(f"{root}/health/ready")).status_code != 503:
                assert time.monotonic() < deadline, "still ready with a dead engine"
                await asyncio.sleep(0.1)
            refused_at = time.monotonic()
            later = await http.post(f"{root}/v1/completions", json={**body, "max_tokens": 2})
            assert later.status_code == 503 and time.monotonic() - refused_at < 5, later.text
    finally:
        stop_process(process)
        # Triton's strict readiness is false while a model unloads: leave the session's server ready
        assert wait_until(lambda: httpx.get(f"{stack.triton_http_url}/v2/health/ready").status_code == 200, 30)
