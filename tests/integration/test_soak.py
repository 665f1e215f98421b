"""Soak (`make soak`, marked slow, not part of `make test`): 32 concurrent streams for 3 minutes against a
frontend of its own: zero errors, and the frontend's RSS at the end within 10% of its RSS after warm-up.
Triton's RSS (tritonserver, and its Python-backend stubs) is reported too, not bounded: on a GPU the
TensorRT-LLM backend runs inside tritonserver, where stop words on every request may leak host memory
(TensorRT-LLM #5509; audit round 3, R7), so the GPU soak reads it there.
SOAK_SECONDS overrides the duration (e.g. for a quick try)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from launcher.ports import find_free_port
from tests.integration.conftest import Stack, start_frontend, stop_process, wait_http_ok

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONCURRENCY = 32
DURATION_S = float(os.environ.get("SOAK_SECONDS", "180"))
WARMUP_S = 20.0


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def triton_rss_kib(stack: Stack) -> tuple[int, int]:
    """RSS of the stack's tritonserver (found by its gRPC port on its command line) and of its children (the
    Python-backend stubs)."""
    port = stack.triton_grpc_url.rsplit(":", 1)[1].encode()
    parents: dict[int, int] = {}
    server = 0
    for proc in Path("/proc").iterdir():
        try:
            pid = int(proc.name)
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            parents[pid] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if argv[0].endswith(b"tritonserver") and port in b" ".join(argv):
                server = pid
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
    def rss_or_0(pid: int) -> int:
        try:
            return rss_kib(pid)
        except (OSError, RuntimeError):  # gone meanwhile
            return 0

    stubs = sum(rss_or_0(pid) for pid, parent in parents.items() if server and parent == server)
    return (rss_or_0(server) if server else 0), stubs


@pytest.mark.timeout(DURATION_S + 300)
async def test_soak_32_streams(stack: Stack, tmp_path: Path) -> None:
    port = find_free_port()
    process = start_frontend(stack.triton_grpc_url, port, tmp_path / "frontend.log", ACCESS_LOG="false")
    root = f"http://127.0.0.1:{port}"
    completed = errors = tokens = 0
    failures: list[str] = []
    try:
        wait_http_ok(f"{root}/health/ready", 120, process)
        started = time.monotonic()
        stop_at = started + DURATION_S
        warm_rss: int | None = None

        async def worker(client: httpx.AsyncClient, i: int) -> None:
            nonlocal completed, errors, tokens
            n = 0
            while time.monotonic() < stop_at:
                n += 1
                chat = (i + n) % 2 == 0
                body = {"model": stack.model, "max_tokens": 16 + (i * 7 + n) % 48, "stream": True,
                        "stream_options": {"include_usage": True}, "temperature": 0.8, "seed": i * 1000 + n}
                if chat:
                    body["messages"] = [{"role": "user", "content": f"soak {i} {n} " * (1 + n % 5)}]
                else:
                    body["prompt"] = f"soak prompt {i} {n} " * (1 + n % 7)
                url = f"{root}/v1/{'chat/completions' if chat else 'completions'}"
                try:
                    async with client.stream("POST", url, json=body) as response:
                        raw = (await response.aread()).decode()
                    payloads = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
                    errored = any("error" in json.loads(p) for p in payloads[:-1])  # not text that says "error"
                    if response.status_code != 200 or not payloads or payloads[-1] != "[DONE]" or errored:
                        raise AssertionError(f"{response.status_code}: {raw[-300:]}")
                    tokens += json.loads(payloads[-2])["usage"]["completion_tokens"]
                    completed += 1
                except Exception as exc:  # counted, reported at the end
                    errors += 1
                    failures.append(f"{type(exc).__name__}: {exc}"[:300])

        limits = httpx.Limits(max_connections=CONCURRENCY + 4, max_keepalive_connections=CONCURRENCY + 4)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            workers = [asyncio.create_task(worker(client, i)) for i in range(CONCURRENCY)]
            await asyncio.sleep(min(WARMUP_S, DURATION_S / 4))
            warm_rss = rss_kib(process.pid)
            warm_triton = triton_rss_kib(stack)
            warm_completed = completed
            await asyncio.gather(*workers)
        end_rss = rss_kib(process.pid)
        end_triton = triton_rss_kib(stack)
        took = time.monotonic() - started
        growth = (end_rss - warm_rss) / warm_rss
        print(f"\nsoak: {CONCURRENCY} concurrent streams for {took:.0f} s: {completed} completed "
              f"({completed - warm_completed} after warm-up), {errors} errors, {tokens} tokens "
              f"({tokens / took:.0f} tok/s); frontend RSS {warm_rss / 1024:.1f} MiB after warm-up -> "
              f"{end_rss / 1024:.1f} MiB at the end ({growth:+.1%}); tritonserver RSS {warm_triton[0] / 1024:.1f} -> "
              f"{end_triton[0] / 1024:.1f} MiB, its Python-backend stubs {warm_triton[1] / 1024:.1f} -> "
              f"{end_triton[1] / 1024:.1f} MiB")
        assert errors == 0, failures[:5]
        assert completed > CONCURRENCY
        assert abs(growth) <= 0.10, f"RSS grew {growth:+.1%}"
        assert httpx.get(f"{root}/health/ready", timeout=10).status_code == 200
    finally:
        stop_process(process)
