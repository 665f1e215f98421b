"""Clients that stop reading cost the frontend bounded memory, through the TensorRT-LLM contract double, whose
streamed responses each carry the log-probs of every token so far (tests/trtllm_contract/rules.py
ResponseShaper): held whole, 16 streams of 2,000 tokens with `logprobs` would be ~130 MB of responses.

The double runs an engine of its own here (the session's tiny checkpoint given 4,096 positions: RoPE needs no
table; a 2,200-token context, 17 sequences at once), so that 16 paused streams and one reading stream run
together. The clients are raw sockets with a 4 KB receive buffer that read
nothing; on loopback the frontend's socket may still take up to tcp_wmem's maximum (4 MB) of a stream before
its writes wait, so benchmarks/backpressure_bench.py, which can shrink that buffer, is where the old reader's
O(n^2) shows most (+165 MB there). Everything waits on the engine's gauges, never on a clock; the reading
stream's worst gaps are printed, not asserted (a busy machine's hiccup is not the frontend's): the benchmark
measures their ratio.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from launcher.ports import find_free_port
from tests.integration.conftest import (REPO_ROOT, Stack, engine_metrics, start_frontend, stop_process, wait_engine,
                                        wait_http_ok)
from tests.trtllm_contract.double import add_contract_double

pytestmark = pytest.mark.integration

LONG_MODEL = "tensorrt_llm_contract_long"
PAUSED, TOKENS = 16, 2000


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def long_frontend(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """A frontend over the double on an engine with room for 16 + 1 streams of 2,000 tokens: (root URL, pid)."""
    out = tmp_path_factory.mktemp("build_long")
    checkpoint = out / "checkpoint"
    shutil.copytree(stack.checkpoint_dir, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (checkpoint / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    subprocess.run([sys.executable, "-m", "build_engine", "--model", str(checkpoint), "--output-dir", str(out),
                    "--max-batch-size", str(PAUSED + 1), "--max-seq-len", "2200"], check=True, cwd=REPO_ROOT)
    add_contract_double(stack.repository, LONG_MODEL, out / "engine", test_step_delay_s=0.005)
    httpx.post(f"{stack.triton_http_url}/v2/repository/models/{LONG_MODEL}/load", headers=stack.triton_control,
               timeout=300).raise_for_status()
    port = find_free_port()
    process = start_frontend(stack.triton_grpc_url, port, tmp_path_factory.mktemp("backpressure") / "frontend.log",
                             ENGINE_MODEL=LONG_MODEL, SERVED_MODEL_NAME=stack.model, FRONTEND_WORKERS="1")
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health/ready", 120, process)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        stop_process(process)


async def silent_client(port: int, body: dict, sent: asyncio.Event, resume: asyncio.Event) -> bytes:
    """POST a stream and read nothing until `resume`; then all of it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    payload = json.dumps(body).encode()
    await loop.sock_sendall(sock, f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                  f"application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                                  .encode() + payload)
    sent.set()
    await resume.wait()  # nothing is read from the socket meanwhile (an asyncio stream would read ahead)
    received = b""
    while chunk := await loop.sock_recv(sock, 1 << 16):
        received += chunk
    sock.close()
    return received


async def worst_gap_beside(url: str, clients: int, paused: bool, stack: Stack, pid: int) -> tuple[float, int]:
    """A reading stream's worst gap between chunks while `clients` streams of TOKENS tokens with logprobs run
    beside it, their clients reading (the baseline) or not; and the frontend's peak RSS growth meanwhile."""
    port = int(url.rsplit(":", 1)[1])
    body = {"model": stack.model, "messages": [{"role": "user", "content": "go"}], "max_tokens": TOKENS,
            "ignore_eos": True, "stream": True, "logprobs": True, "temperature": 0}
    before_tokens = engine_metrics(stack.triton_metrics_url, LONG_MODEL).get("generated_tokens_total", 0.0)
    before, peak = rss_bytes(pid), rss_bytes(pid)
    resume = asyncio.Event()
    if not paused:
        resume.set()
    sent = [asyncio.Event() for _ in range(clients)]
    tasks = [asyncio.create_task(silent_client(port, body, event, resume)) for event in sent]
    for event in sent:
        await event.wait()
    arrivals: list[float] = []
    async with httpx.AsyncClient(timeout=600) as http:
        async with http.stream("POST", f"{url}/v1/chat/completions",
                               json={**body, "logprobs": False, "max_tokens": TOKENS - 100}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    peak = max(peak, rss_bytes(pid))
    # every paused stream generated to its end (the engine's own count), while its client read nothing
    await asyncio.to_thread(wait_engine, stack.triton_metrics_url, LONG_MODEL,
                            lambda v: v["generated_tokens_total"] - before_tokens >= clients * TOKENS + TOKENS - 100,
                            "the paused streams' tokens", 600)
    peak = max(peak, rss_bytes(pid))
    resume.set()
    answers = await asyncio.gather(*tasks)
    for answer in answers:  # each ended: completed once read, or ended by the buffer budget with a clear error
        assert b"data: [DONE]" in answer or b"client_too_slow" in answer, answer[-300:]
    return max(b - a for a, b in zip(arrivals[5:], arrivals[6:])), peak - before


async def test_clients_that_read_nothing_cost_bounded_memory_and_do_not_stall_others(
        stack: Stack, long_frontend: tuple[str, int]) -> None:
    url, pid = long_frontend
    reading_gap, _ = await worst_gap_beside(url, PAUSED, False, stack, pid)
    paused_gap, grown = await worst_gap_beside(url, PAUSED, True, stack, pid)
    print(f"\n{PAUSED} paused streams of {TOKENS} tokens with logprobs: frontend RSS +{grown / 2**20:.1f} MB; "
          f"a reading stream's worst gap {paused_gap * 1000:.0f} ms beside them, {reading_gap * 1000:.0f} ms beside "
          f"as many reading streams ({paused_gap / reading_gap:.2f}x)")
    assert grown < 40 * 2**20
