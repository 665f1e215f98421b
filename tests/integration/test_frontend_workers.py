"""FRONTEND_WORKERS=2: two worker processes on one port, and what must stay the whole server's (README,
"Frontend workers"): the per-key rate limits, key rotation by SIGHUP, the /metrics totals, admission slots
when a worker dies, and the drain on SIGTERM. (The rollout under load with two workers is in
test_model_versions.py.)

Which worker a connection lands on is the kernel's choice; each test opens a fresh connection per request,
so its requests spread over both workers, and asserts what must hold whichever worker each one reached.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from benchmarks.servers import stop_process, wait_http_ok
from launcher.ports import find_free_port
from launcher.tritonserver import group_alive
from tests.integration.conftest import Stack, start_frontend, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# Requests per minute per key: a bucket of 2 that refills one request every 30 s, so a test's requests come
# well within one refill; each test has keys of its own and uses each at most twice.
RPM = 2
METRICS_KEYS = [f"sk-metrics-{i}" for i in range(4)]
STREAM_KEYS = [f"sk-stream-{i}" for i in range(4)]
KEYS = ["sk-rate", "sk-other", "sk-rotated-out", *METRICS_KEYS, *STREAM_KEYS]
NEW_KEY = "sk-rotated-in"
WAIT_S = 120  # a bound for a hung server, not a speed


@dataclass
class Workers:
    root: str
    process: subprocess.Popen[bytes]  # the supervisor
    log: Path
    keys_file: Path
    model: str

    def worker_pids(self) -> dict[int, int]:
        """Worker index -> pid of the latest worker started in that place."""
        return {int(i): int(p) for i, p in re.findall(r"worker (\d+) started \(pid (\d+)\)", self.log.read_text())}

    def chat(self, key: str, **body: object) -> httpx.Response:
        """One chat request on a connection of its own."""
        return httpx.post(f"{self.root}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": self.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                "temperature": 0, **body}, timeout=WAIT_S)

    def metrics(self) -> str:
        return httpx.get(f"{self.root}/metrics", timeout=WAIT_S).text


@contextmanager
def two_workers(stack: Stack, log_dir: Path, **env: str) -> Iterator[Workers]:
    keys_file = log_dir / "api_keys"
    keys_file.write_text("\n".join(KEYS) + "\n")
    port = find_free_port()
    log = log_dir / "frontend.log"
    process = start_frontend(stack.triton_grpc_url, port, log, FRONTEND_WORKERS="2", API_KEYS_FILE=str(keys_file),
                             RATE_LIMIT_RPM=str(RPM), TRITON_METRICS_URL=stack.triton_metrics_url, **env)
    workers = Workers(f"http://127.0.0.1:{port}", process, log, keys_file, stack.model)
    try:
        wait_http_ok(f"{workers.root}/health/ready", WAIT_S, process)
        assert wait_until(lambda: len(re.findall(r"Application startup complete", log.read_text())) == 2, WAIT_S)
        yield workers
    finally:
        stop_process(process)


@pytest.fixture(scope="module")
def workers(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    with two_workers(stack, tmp_path_factory.mktemp("workers"), MAX_IN_FLIGHT="4", MAX_QUEUED="0") as served:
        yield served


def requests_total(metrics: str, status: str) -> float:
    return sum(float(v) for v in re.findall(
        rf'^tritonllm_requests_total{{[^}}]*route="/v1/chat/completions"[^}}]*status="{status}"[^}}]*}} (\S+)$',
        metrics, re.M))


def test_a_keys_requests_per_minute_hold_across_both_workers(workers: Workers) -> None:
    statuses = [workers.chat("sk-rate").status_code for _ in range(RPM)]  # on fresh connections
    assert statuses == [200] * RPM
    # Past the limit, whichever worker each fresh connection reaches: one bucket per key for the server.
    refused = [workers.chat("sk-rate") for _ in range(6)]
    assert [r.status_code for r in refused] == [429] * 6
    assert refused[0].json()["error"]["code"] == "rate_limit_exceeded" and int(refused[0].headers["retry-after"]) >= 1
    assert workers.chat("sk-other").status_code == 200  # another key has its own bucket


def test_metrics_are_the_totals_of_both_workers(workers: Workers) -> None:
    before = requests_total(workers.metrics(), "200")
    served = [workers.chat(key).status_code for key in METRICS_KEYS for _ in range(2)]
    assert served == [200] * 8
    text = workers.metrics()
    assert requests_total(text, "200") == before + 8  # any worker's scrape: both workers' requests, once each
    assert not re.search(r'pid="', text)  # summed, not one series per process
    assert re.search(r"^tritonllm_requests_in_flight 0\.0$", text, re.M)
    assert re.search(r"^cpu_engine_", text, re.M)  # Triton's metrics relayed after the frontend's


def test_sighup_rotates_the_keys_of_both_workers(workers: Workers) -> None:
    pids = set(workers.worker_pids().values())
    assert len(pids) == 2
    workers.keys_file.write_text("\n".join([k for k in KEYS if k != "sk-rotated-out"] + [NEW_KEY]) + "\n")
    reloads = lambda: {int(p) for p in re.findall(r"\[(\d+)\]: API keys reloaded", workers.log.read_text())}  # noqa: E731
    os.kill(workers.process.pid, signal.SIGHUP)  # to the supervisor, as `kill -HUP` / the launcher sends it
    assert wait_until(lambda: pids <= reloads(), WAIT_S), workers.log.read_text()[-3000:]
    for _ in range(RPM):
        assert workers.chat(NEW_KEY).status_code == 200
    for _ in range(4):
        assert workers.chat("sk-rotated-out").status_code == 401


async def stream(workers: Workers, key: str, max_tokens: int, started: asyncio.Event) -> str:
    """One streamed chat: 'done' at [DONE], else what broke it."""
    body = {"model": workers.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    try:
        async with httpx.AsyncClient(timeout=WAIT_S) as client:
            async with client.stream("POST", f"{workers.root}/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {key}"}) as response:
                if response.status_code != 200:
                    return str(response.status_code)
                async for line in response.aiter_lines():
                    started.set()
                    if line == "data: [DONE]":
                        return "done"
                    if line.startswith("data: ") and "error" in json.loads(line[len("data: "):]):
                        return "error event"
        return "no [DONE]"
    except httpx.HTTPError as exc:
        return type(exc).__name__


async def test_a_dead_worker_is_replaced_and_its_admission_slots_come_back(workers: Workers) -> None:
    """MAX_IN_FLIGHT=4, no queue: slots leaked by a killed worker would turn the later streams into 429s."""
    before = workers.worker_pids()
    started = [asyncio.Event() for _ in range(4)]
    streams = [asyncio.create_task(stream(workers, key, 400, event)) for key, event in zip(STREAM_KEYS, started)]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), WAIT_S)
    os.kill(before[0], signal.SIGKILL)
    outcomes = await asyncio.gather(*streams)
    assert set(outcomes) <= {"done", "RemoteProtocolError", "no [DONE]", "ReadError"}, outcomes
    assert await asyncio.to_thread(wait_until, lambda: workers.worker_pids()[0] != before[0], WAIT_S)
    assert f"worker 0 (pid {before[0]}) exited" in workers.log.read_text()
    assert await asyncio.to_thread(wait_until, lambda: re.search(r"^tritonllm_requests_in_flight 0\.0$",
                                                                  workers.metrics(), re.M) is not None, WAIT_S)
    again = [asyncio.Event() for _ in range(4)]
    outcomes = await asyncio.gather(*(stream(workers, key, 8, event) for key, event in zip(STREAM_KEYS, again)))
    assert outcomes == ["done"] * 4  # all four slots are free again, whichever worker each stream reached


async def test_sigterm_drains_every_worker_and_leaves_no_process(stack: Stack,
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    with two_workers(stack, tmp_path_factory.mktemp("drain"), SHUTDOWN_GRACE_S="120") as served:
        pids = list(served.worker_pids().values())
        started = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.create_task(stream(served, key, 200, event)) for key, event in zip(STREAM_KEYS, started)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), WAIT_S)
        served.process.send_signal(signal.SIGTERM)
        assert await asyncio.gather(*streams) == ["done"] * 4  # within the grace period: every stream finishes
        assert await asyncio.to_thread(served.process.wait, WAIT_S) == 0
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        # Nothing of the supervisor's is left in its group either (multiprocessing's resource tracker was).
        assert not group_alive(served.process.pid)
