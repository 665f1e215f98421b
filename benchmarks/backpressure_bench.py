"""What clients that stop reading, and a body of a hundred thousand tiny messages, cost the frontend's process.

No Triton: the real app (routes, SSE, the real `TritonEngine` and its stream reader) runs in a child process
under uvicorn, and its gRPC client is replaced by one that answers as TensorRT-LLM's backend does: one
response per step, `step_ms` apart, each carrying the log-probs of EVERY token so far (rules.ResponseShaper in
tests/trtllm_contract). What Triton and gRPC themselves would buffer is not part of this measurement.

- `paused`: a reading stream alone (its worst gap between chunks); then `--paused` streams with `logprobs`
  whose clients read nothing (a 4 KB receive buffer, so the frontend's writes back up at once) while each
  would generate `--tokens` tokens, beside that reading stream again (20% longer: the pause ends with it).
  Reports the frontend's RSS growth (peak VmRSS during, minus before), the reading stream's worst gap (and
  its ratio to the gap alone), and how each paused request ended once its client read again ([DONE], or
  the `client_too_slow` error).
- `big_body`: a 3.7 MiB chat body of 110k one-character messages, posted beside a live stream: the time to
  its answer (status and param), and the stream's worst gap with it against its worst gap alone.

    python -m benchmarks.backpressure_bench [--tree PATH] [--paused 16] [--tokens 2000] [--step-ms 5]

`--tree`: run the frontend of another checkout (e.g. the previous commit, `git archive`d) for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "m"
TOKEN = ord("a") + 1  # the byte tokenizer's id of "a"


# ----- the child: the app over a TensorRT-LLM-shaped fake gRPC client -------------------------------------------
class PacedCall:
    """One ModelStreamInfer call: a response every `step_s`, TensorRT-LLM's streamed shape; ends at
    request_output_len tokens or at a stop for its id."""

    def __init__(self, triton: "PacedTriton", requests: AsyncIterator[dict[str, Any]]):
        self.triton, self.requests, self.stopped = triton, requests, False

    def __aiter__(self) -> AsyncIterator[tuple[Any, Any]]:
        return self._responses()

    def cancel(self) -> None:
        self.stopped = True

    async def _responses(self) -> AsyncIterator[tuple[Any, Any]]:
        import numpy as np

        from tests.unit.test_triton_engine import Result

        request = [r async for r in self.requests][0]
        inputs = {tensor.name(): tensor for tensor in request["inputs"]}
        if "stop" in inputs:
            for call in self.triton.calls.pop(request["request_id"], []):
                call.stopped = True
            return
        self.triton.calls.setdefault(request["request_id"], []).append(self)
        length = int(np.frombuffer(inputs["request_output_len"]._raw_content, dtype=np.int32)[0])
        log_probs = "return_log_probs" in inputs
        for n in range(1, length + 1):
            await asyncio.sleep(self.triton.step_s)
            if self.stopped:
                return
            arrays = {"output_ids": np.array([[[TOKEN]]], dtype=np.int32),
                      "sequence_length": np.array([[1]], dtype=np.int32)}
            if log_probs:
                arrays["output_log_probs"] = np.full((1, 1, n), -0.25, dtype=np.float32)
            yield Result(**arrays), None


class PacedTriton:
    def __init__(self, step_s: float):
        self.step_s = step_s
        self.calls: dict[str, list[PacedCall]] = {}

    def stream_infer(self, requests: AsyncIterator[dict[str, Any]]) -> PacedCall:
        return PacedCall(self, requests)

    async def close(self) -> None:
        pass


def serve(port: int, step_ms: float, sndbuf: int) -> None:
    import uvicorn

    from frontend.generation.triton_engine import TritonEngine
    from frontend.http.app import create_app
    from frontend.models.registry import ModelContext, VersionEngine
    from frontend.settings import Settings
    from tests.unit.test_chat_plan import OneModel
    from tests.unit.test_serving import ByteTokenizer

    settings = Settings(max_in_flight=64, rate_limit_rpm=0)
    app = create_app(settings)
    triton = TritonEngine("127.0.0.1:1", "tensorrt_llm")
    triton._client = PacedTriton(step_ms / 1000)  # type: ignore[assignment]
    tokenizer = ByteTokenizer()
    tokenizer.vocab_size = 257  # type: ignore[attr-defined]
    tokenizer.chat_template = "stand-in"  # type: ignore[attr-defined]
    tokenizer.certainly_longer_than = lambda text, tokens: False  # type: ignore[attr-defined]
    tokenizer.apply_chat_template = lambda messages, tools=None: tokenizer.encode(  # type: ignore[attr-defined]
        "".join(m["content"] for m in messages))
    app.state.models = OneModel(ModelContext(MODEL, 1 << 20, tokenizer, 0,  # type: ignore[arg-type]
                                             engine=VersionEngine(triton, None)))
    # A small send buffer on the listening socket (accepted ones inherit it): on loopback the kernel would
    # otherwise take megabytes of a client's unread stream (tcp_wmem) before the frontend's writes wait at all,
    # which a client across a network that stopped reading (a zero window) does not give.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    listener.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False))
    server.run(sockets=[listener])


# ----- the parent: clients, measured ---------------------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class RssPeak:
    """The child's peak RSS, sampled every 20 ms until stopped (a sampler, not a synchronisation)."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, rss_bytes(pid)

    async def run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes(self.pid))
            await asyncio.sleep(0.02)


async def live_stream(port: int, tokens: int, started: asyncio.Event | None = None) -> float:
    """Stream `tokens` tokens; the worst gap between two chunks after the first five (seconds)."""
    import httpx

    arrivals: list[float] = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "live"}], "max_tokens": tokens,
            "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 5 and started is not None:
                        started.set()
    gaps = [b - a for a, b in zip(arrivals[5:], arrivals[6:])]
    if not gaps:
        raise RuntimeError(f"the stream ended after {len(arrivals)} chunks (status {response.status_code})")
    return max(gaps)


def http_request(port: int, body: bytes) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


async def paused_client(port: int, tokens: int, sent: asyncio.Event, resume: asyncio.Event) -> str:
    """A stream whose client reads nothing until `resume`: how it ended ("done", "client_too_slow", or what
    came)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window from the start
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
                       "ignore_eos": True, "stream": True, "logprobs": True}).encode()
    await loop.sock_sendall(sock, http_request(port, body))
    sent.set()
    await resume.wait()  # nothing is read from the socket meanwhile (an asyncio stream would read ahead)
    received = b""
    while chunk := await loop.sock_recv(sock, 1 << 16):
        received += chunk
    sock.close()
    if b"client_too_slow" in received:
        return "client_too_slow"
    return "done" if received.rstrip().endswith(b"0") and b"data: [DONE]" in received else received[-200:].decode()


async def paused_scenario(port: int, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    # The reading stream outlasts the paused ones' generation (same pace, 20% more tokens): the pause ends
    # when it does, by which time a frontend that reads everything holds all of theirs.
    live_tokens = int(args.tokens * 1.2)
    alone = await live_stream(port, live_tokens)
    before = rss_bytes(pid)
    sampler = RssPeak(pid)
    sampling = asyncio.create_task(sampler.run())
    resume = asyncio.Event()
    sent = [asyncio.Event() for _ in range(args.paused)]
    clients = [asyncio.create_task(paused_client(port, args.tokens, s, resume)) for s in sent]
    for event in sent:
        await event.wait()
    worst = await live_stream(port, live_tokens)  # beside the paused clients
    resume.set()
    endings = await asyncio.gather(*clients)
    sampling.cancel()
    grown = sampler.peak - before  # the peak over the pause and the paused clients' reading
    return {"paused": args.paused, "tokens": args.tokens, "live_tokens": live_tokens,
            "rss_growth_mb": round(grown / 2**20, 1), "worst_gap_alone_ms": round(alone * 1000, 1),
            "worst_gap_ms": round(worst * 1000, 1), "gap_ratio": round(worst / alone, 2),
            "endings": {e: endings.count(e) for e in set(endings)}}


async def big_body_scenario(port: int, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 110_000,
                       "max_tokens": 1}).encode()
    tokens = max(100, int(3000 / args.step_ms))
    alone = await live_stream(port, tokens)
    started = asyncio.Event()
    stream = asyncio.create_task(live_stream(port, tokens, started))
    await started.wait()
    async with httpx.AsyncClient(timeout=120) as http:
        t0 = time.monotonic()
        answer = await http.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=body,
                                 headers={"Content-Type": "application/json"})
        took = time.monotonic() - t0
    worst = await stream
    error = answer.json().get("error", {}) if answer.headers.get("content-type", "").startswith("application/json") \
        else {}
    return {"body_mib": round(len(body) / 2**20, 2), "status": answer.status_code, "param": error.get("param"),
            "answer_ms": round(took * 1000, 1), "worst_gap_alone_ms": round(alone * 1000, 1),
            "worst_gap_ms": round(worst * 1000, 1), "gap_ratio": round(worst / alone, 2)}


async def measure(args: argparse.Namespace) -> None:
    from launcher.ports import find_free_port
    from benchmarks.servers import stop_process, wait_http_ok

    tree = Path(args.tree).resolve() if args.tree else REPO_ROOT
    port = find_free_port()
    env = {**os.environ, "PYTHONPATH": f"{tree}:{REPO_ROOT}"}  # the tree's frontend; this repo's test fakes
    child = subprocess.Popen([sys.executable, __file__, "serve", "--port", str(port),
                              "--step-ms", str(args.step_ms), "--sndbuf", str(args.sndbuf)], cwd=tree, env=env,
                             start_new_session=True)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health/live", 60, child)
        await live_stream(port, 20)  # warm up
        if "paused" in args.scenarios:
            print(json.dumps({"scenario": "paused", "tree": str(tree), **await paused_scenario(port, child.pid, args)}))
        if "big_body" in args.scenarios:
            print(json.dumps({"scenario": "big_body", "tree": str(tree), **await big_body_scenario(port, args)}))
    finally:
        stop_process(child)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", default="measure", choices=["measure", "serve"])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tree", default=None)
    parser.add_argument("--paused", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--scenarios", default="paused,big_body")
    parser.add_argument("--sndbuf", type=int, default=16384, help="the frontend's socket send buffer (bytes)")
    args = parser.parse_args()
    if args.mode == "serve":
        serve(args.port, args.step_ms, args.sndbuf)
    else:
        asyncio.run(measure(args))


if __name__ == "__main__":
    main()
