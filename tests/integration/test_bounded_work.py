"""Bounded work per request, on the real stack: a request may start at most MAX_ENGINE_REQUESTS generations
(prompts x n), admission counts engine requests (not HTTP requests), a body that stops arriving is cut
off, and megabyte-long tokenizer work does not stall live streams.

The admission and stall tests run on the slow test engine (>= 50 ms a step: conftest.SLOW_MODEL), so
that a stream's pace is set by the test, not by this machine."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
from typing import Awaitable, Callable, Iterator, TypeVar

import httpx
import pytest

from launcher.ports import find_free_port
from tests.integration.conftest import SLOW_MODEL, Stack, engine_settled, start_frontend, stop_process, wait_http_ok

pytestmark = pytest.mark.integration
T = TypeVar("T")


@pytest.fixture(scope="module")
def slow_frontend_process(stack: Stack, tmp_path_factory: pytest.TempPathFactory
                          ) -> Iterator[tuple[str, subprocess.Popen]]:
    """A frontend on the slow engine with room for 4 engine requests and no queue; bodies must arrive in 1 s."""
    log = tmp_path_factory.mktemp("bounded_work") / "frontend.log"
    port = find_free_port()
    # One process whatever FRONTEND_WORKERS says: the tests measure its event-loop thread's CPU.
    process = start_frontend(stack.triton_grpc_url, port, log, ENGINE_MODEL=SLOW_MODEL, MAX_IN_FLIGHT="4",
                             MAX_QUEUED="0", BODY_READ_TIMEOUT_S="1", FRONTEND_WORKERS="1")
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health/ready", 120, process)
        yield f"http://127.0.0.1:{port}", process
    finally:
        stop_process(process)


@pytest.fixture(scope="module")
def slow_frontend(slow_frontend_process: tuple[str, subprocess.Popen]) -> str:
    return slow_frontend_process[0]


def test_thousands_of_prompts_are_refused_at_once(stack: Stack) -> None:
    """Refused before any of it reaches the engine: what the engine generated says so, not a stopwatch."""
    body = {"model": stack.model, "prompt": [[1]] * 3000, "max_tokens": 2}
    before = engine_settled(stack.triton_metrics_url, "tensorrt_llm")
    response = httpx.post(f"{stack.base_url}/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "too_many_generations" and "3000" in error["message"]
    n_times_prompts = httpx.post(f"{stack.base_url}/completions", timeout=60,
                                 json={**body, "prompt": ["a", "b", "c", "d", "e"], "n": 4})
    assert n_times_prompts.status_code == 400 and n_times_prompts.json()["error"]["param"] == "prompt"
    # one request that is served, then the engine's count: its one token, nothing of the 6,040 refused
    served = httpx.post(f"{stack.base_url}/completions", timeout=60,
                        json={**body, "prompt": [[1]], "max_tokens": 1, "ignore_eos": True})
    assert served.json()["usage"]["completion_tokens"] == 1
    after = engine_settled(stack.triton_metrics_url, "tensorrt_llm", after=before)
    assert after["generated_tokens_total"] - before["generated_tokens_total"] == 1


async def test_admission_counts_engine_requests_not_http_requests(slow_frontend: str) -> None:
    url = f"{slow_frontend}/v1/completions"
    four = {"model": "demo-tiny", "prompt": "four choices", "n": 4, "max_tokens": 200, "ignore_eos": True,
            "stream": True}  # 200 steps of >= 50 ms: running for >= 10 s
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", url, json=four) as running:
            assert running.status_code == 200
            lines = running.aiter_lines()  # kept referenced: a collected line iterator closes the response
            async for line in lines:
                if line.startswith("data: {"):
                    break
            # the 4 choices hold all 4 slots: one more engine request is refused at once (no queue)
            refused = await http.post(url, json={"model": "demo-tiny", "prompt": "one", "max_tokens": 1})
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "overloaded", refused.text
            assert int(refused.headers["Retry-After"]) >= 1
        # leaving frees the 4 slots
        deadline = time.monotonic() + 60
        while (again := await http.post(url, json={"model": "demo-tiny", "prompt": "one", "max_tokens": 1})
               ).status_code == 429:
            assert time.monotonic() < deadline, again.text
            await asyncio.sleep(0.1)
        assert again.status_code == 200


def test_a_body_that_stops_arriving_is_cut_off(slow_frontend: str) -> None:
    host, port = slow_frontend.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200\r\n\r\n{\"model\": \"demo-tiny\", \"prompt\": \"half")
        started = time.monotonic()
        received = b""
        while chunk := conn.recv(65536):  # the server answers, then closes the connection
            received += chunk
        took = time.monotonic() - started
    assert received.startswith(b"HTTP/1.1 408"), received[:200]
    assert json.loads(received.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"
    assert took < 30  # BODY_READ_TIMEOUT_S is 1 (generous: the 408 body_timeout already says which limit cut it)


async def test_megabyte_tokenizer_work_is_never_done(stack: Stack,
                                                    slow_frontend_process: tuple[str, subprocess.Popen]) -> None:
    """Three 3 MB prompts to /tokenize are refused by their length alone (they cannot fit the context), so no
    tokenizer ever runs on them: the frontend spends less CPU on all three than one tokenization of one costs
    (measured here, on this machine: both scale with its speed; CPU time, not wall time, so a busy machine
    does not change the comparison)."""
    from transformers import AutoTokenizer

    url, process = slow_frontend_process
    text = "The quick brown fox jumps over the lazy dog. " * 70_000
    big = json.dumps({"model": "demo-tiny", "prompt": text}).encode()  # encoded once, here
    tokenizer = AutoTokenizer.from_pretrained(str(stack.checkpoint_dir))
    started = time.process_time()
    tokenizer.encode(text, add_special_tokens=False)
    one_tokenization = time.process_time() - started
    before = cpu_seconds(process.pid)
    async with httpx.AsyncClient(timeout=60) as http:
        answers = await asyncio.gather(*(http.post(f"{url}/tokenize", content=big,
                                                   headers={"Content-Type": "application/json"}) for _ in range(3)))
    spent = cpu_seconds(process.pid) - before
    print(f"\nfrontend CPU for 3 x 3 MB /tokenize: {spent:.2f} s; one tokenization here: {one_tokenization:.2f} s")
    assert all(a.status_code == 400 and a.json()["error"]["code"] == "context_length_exceeded" for a in answers)
    assert spent < one_tokenization


async def test_a_4mb_token_id_prompt_does_not_stall_a_live_stream(
        slow_frontend_process: tuple[str, subprocess.Popen]) -> None:
    """1.9 M token ids, the most a 4 MB body holds: parsed off the event loop, and refused (longer than the
    context) by its length alone, before anything looks at each id."""
    url, process = slow_frontend_process
    # encoded here once: the test's own event loop reads the stream and must not be busy with it
    big = json.dumps({"model": "demo-tiny", "prompt": [i % 10 for i in range(1_900_000)], "max_tokens": 1},
                     separators=(",", ":")).encode()
    assert 3_500_000 < len(big) <= 4 * 1024 * 1024  # under MAX_BODY_BYTES: parsed, not a 413
    stream_body = {"model": "demo-tiny", "prompt": "live", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def big_prompts(http: httpx.AsyncClient) -> list[httpx.Response]:
        return await asyncio.gather(*(http.post(f"{url}/v1/completions", content=big,
                                                headers={"Content-Type": "application/json"}) for _ in range(3)))

    answers = await off_the_loop_beside_a_live_stream(url, process.pid, stream_body, big_prompts)
    for answer in answers:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "prompt",
                                                                  "context_length_exceeded")
        assert "1900000 tokens" in error["message"]


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU time of a process (all its threads) or of one of its threads, from /proc."""
    path = f"/proc/{pid}/task/{thread}/stat" if thread is not None else f"/proc/{pid}/stat"
    with open(path) as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int, thread: int | None = None) -> int:
    """cpu_seconds in the kernel's own unit (SC_CLK_TCK ticks): differences of them are exact."""
    path = f"/proc/{pid}/task/{thread}/stat" if thread is not None else f"/proc/{pid}/stat"
    with open(path) as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


MEASURABLE_TICKS = 40  # the work is repeated until the frontend has spent this much CPU on it (0.4 s at 100 Hz)
MAX_REPEATS = 20


async def off_the_loop_beside_a_live_stream(url: str, pid: int, stream_body: dict,
                                            work: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    """Run `work` while a stream is live, and check that the frontend did it off its event loop: of the CPU
    time the frontend process spent meanwhile, the event-loop thread (the process's main thread) took at most
    a third, and the stream went on delivering. Work done on the loop would show as the loop thread's CPU
    time, on any machine and under any load; a wall-clock gap in the stream would also grow with a busy
    machine, which says nothing about where the work ran. The kernel counts CPU time in ticks (10 ms), and one
    run of the work may cost only a few: it is repeated until it has cost MEASURABLE_TICKS, so that the third
    is decided on enough ticks; the last run's result is returned."""
    arrivals: list[float] = []
    async with httpx.AsyncClient(timeout=60) as http:
        async def live() -> None:
            async with http.stream("POST", url + "/v1/completions", json=stream_body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())

        stream = asyncio.create_task(live())
        while len(arrivals) < 5:  # the stream is live (or it failed: say why instead of waiting for ever)
            if stream.done():
                await stream
                raise AssertionError(f"the stream ended after {len(arrivals)} chunks, before the work started")
            await asyncio.sleep(0.05)
        started = len(arrivals)
        loop_before, all_before = cpu_ticks(pid, pid), cpu_ticks(pid)
        for repeats in range(1, MAX_REPEATS + 1):
            result = await work(http)
            loop_cpu, all_cpu = cpu_ticks(pid, pid) - loop_before, cpu_ticks(pid) - all_before
            if all_cpu >= MEASURABLE_TICKS:
                break
        during = len(arrivals) - started
        await stream
    print(f"\nfrontend CPU during {repeats} run(s) of the work: {all_cpu} ticks, event-loop thread {loop_cpu}; "
          f"{during} stream chunks meanwhile")
    assert all_cpu >= MEASURABLE_TICKS, "the work cost the frontend too little CPU to tell where it ran"
    assert 3 * loop_cpu <= all_cpu, (loop_cpu, all_cpu)
    assert len(arrivals) > started, "the stream delivered nothing more"
    return result


async def test_a_chat_body_of_110k_messages_is_refused_by_their_number_beside_a_live_stream(
        slow_frontend_process: tuple[str, subprocess.Popen]) -> None:
    """3.7 MB of one-character messages: parsed off the event loop (yielding between objects), then refused by
    their number alone (MAX_MESSAGES) before pydantic would spend seconds of the loop validating them. Where
    the work ran is decided on CPU time (off_the_loop_beside_a_live_stream); the answer's time and the stream's
    worst gap are printed, not asserted tightly (benchmarks/backpressure_bench.py measures them)."""
    url, process = slow_frontend_process
    big = json.dumps({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}] * 110_000}).encode()
    assert 3_500_000 < len(big) <= 4 * 1024 * 1024
    stream_body = {"model": "demo-tiny", "prompt": "live", "max_tokens": 200, "ignore_eos": True, "stream": True}
    took: list[float] = []

    async def big_chat(http: httpx.AsyncClient) -> httpx.Response:
        started = time.monotonic()
        answer = await http.post(f"{url}/v1/chat/completions", content=big,
                                 headers={"Content-Type": "application/json"})
        took.append(time.monotonic() - started)
        return answer

    answer = await off_the_loop_beside_a_live_stream(url, process.pid, stream_body, big_chat)
    print(f"\n3.7 MB chat body of 110k messages answered in {took[0] * 1000:.0f} ms")
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == ("messages", "array_above_max_length") and "110000" in error["message"]
    assert took[0] < 30  # a hang guard only
