"""What one Python gRPC message costs the frontend's process, apart from everything else the frontend does.

`make bench-frontend` says what the whole frontend spends per streamed token (HTTP, SSE, detokenizing, and the
gRPC read of each token's response). This benchmark measures only the last part, the floor any Python frontend
built on Triton's gRPC stream pays with one response per token, to say how far per-token work in the frontend
can go down before the transport itself is what is left. Against the null engine (benchmarks/null_engine: one
token per response, as fast as Triton carries them), per round, each mode in a fresh child process (once
grpc.aio has started its poller thread in a process, that thread keeps costing CPU there):

- `engine`: the frontend's own client, `TritonEngine.generate` (grpc.aio, one ModelStreamInfer call per
  request, the response read through tritonclient), `--concurrency` requests at a time, nothing done with the
  tokens but counting them;
- `sync_stream`: tritonclient's synchronous client, ONE stream carrying every request (Triton tells them
  apart by request id; `enable_empty_final_response` marks each one's end), read by tritonclient's reader
  thread, no event loop: the least a Python process can spend per message with grpcio.

Reports per mode, medians over interleaved rounds: CPU µs per token of the client process (all its threads),
of tritonserver and of the null engine's stub (from /proc), and tokens/s.

    python -m benchmarks.grpc_client_bench --model-repository build/bench-frontend/model_repository \\
        --work-dir build/bench-frontend [--rounds 3] [--concurrency 64] [--requests 256] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from benchmarks import servers
from benchmarks.frontend_bench import Processes, _end_ids, triton_pid
from benchmarks.null_engine import NULL_MODEL, add_null_engine, plain_token_ids
from benchmarks.report import markdown_table
from benchmarks.workload import load_tokenizer

MODES = ("engine", "sync_stream")
PROMPT = [1, 2, 3, 4]


def _options(max_tokens: int):
    from frontend.generation.engine import SamplingOptions

    return SamplingOptions(max_tokens=max_tokens)


async def _engine_mode(url: str, concurrency: int, requests: int, max_tokens: int) -> int:
    from frontend.generation.engine import EngineRequest
    from frontend.generation.triton_engine import TritonEngine

    engine = TritonEngine(url, NULL_MODEL)
    slots, tokens = asyncio.Semaphore(concurrency), 0

    async def one() -> None:
        nonlocal tokens
        async with slots:
            async for chunk in engine.generate(EngineRequest(uuid.uuid4().hex, PROMPT, _options(max_tokens))):
                tokens += len(chunk.token_ids)

    try:
        await asyncio.gather(*(one() for _ in range(requests)))
    finally:
        await engine.close()
    return tokens


def _sync_stream_mode(url: str, concurrency: int, requests: int, max_tokens: int) -> int:
    import tritonclient.grpc as grpcclient

    from frontend.generation.trtllm_tensors import build_inputs, new_tokens, requested_outputs

    options = _options(max_tokens)
    outputs = [grpcclient.InferRequestedOutput(name) for name in requested_outputs(options)]
    ended: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
    tokens = 0

    def on_response(result, error) -> None:  # tritonclient's reader thread
        nonlocal tokens
        if error is not None:
            ended.put(error)
            return
        tokens += len(new_tokens(result))
        if result.get_response().parameters["triton_final_response"].bool_param:
            ended.put(None)

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=on_response)

    def send() -> None:
        client.async_stream_infer(NULL_MODEL, build_inputs(PROMPT, options), outputs=outputs,
                                  request_id=uuid.uuid4().hex, enable_empty_final_response=True)

    try:
        for _ in range(min(concurrency, requests)):
            send()
        for sent in range(min(concurrency, requests), requests + min(concurrency, requests)):
            error = ended.get(timeout=120)
            if error is not None:
                raise error
            if sent < requests:
                send()
    finally:
        client.stop_stream()
        client.close()
    return tokens


def child(mode: str, url: str, concurrency: int, requests: int, max_tokens: int) -> None:
    """One measurement in this (fresh) process; prints {"tokens", "cpu_s", "wall_s"} as JSON."""
    for warm in (True, False):  # the first pass warms imports, channels and Triton's side
        cpu, wall = time.process_time(), time.monotonic()
        count = min(requests, concurrency) if warm else requests
        if mode == "engine":
            tokens = asyncio.run(_engine_mode(url, concurrency, count, max_tokens))
        else:
            tokens = _sync_stream_mode(url, concurrency, count, max_tokens)
    print(json.dumps({"tokens": tokens, "cpu_s": time.process_time() - cpu, "wall_s": time.monotonic() - wall}))


def measure(mode: str, url: str, processes: Processes, args: argparse.Namespace) -> dict[str, float]:
    before = processes.snapshot()
    done = subprocess.run([sys.executable, "-m", "benchmarks.grpc_client_bench", "--child", mode, "--url", url,
                           "--concurrency", str(args.concurrency), "--requests", str(args.requests),
                           "--max-tokens", str(args.max_tokens)], capture_output=True, text=True, check=True,
                          timeout=900)
    spent = processes.spent(before, processes.snapshot())
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    # The child's own warm-up ran inside the /proc window too: tritonserver's and the stub's shares are per
    # token of both passes, which is what they carried.
    warm_tokens = min(args.requests, args.concurrency) * args.max_tokens
    server_tokens = figures["tokens"] + warm_tokens
    return {"client": figures["cpu_s"] / figures["tokens"] * 1e6,
            "tritonserver": spent["tritonserver"] / server_tokens * 1e6,
            "engine": spent["engine"] / server_tokens * 1e6,
            "tokens_per_s": figures["tokens"] / figures["wall_s"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", type=Path, help="a rendered demo model repository")
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256, help="requests per measurement")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.url, args.concurrency, args.requests, args.max_tokens)
        return
    if args.model_repository is None or args.work_dir is None:
        parser.error("--model-repository and --work-dir are required")
    log_dir = args.work_dir / "bench_grpc_client_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = Path(servers.repository_parameter(args.model_repository, "preprocessing", "tokenizer_dir") or "")
    rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with contextlib.ExitStack() as stack:
        repo = stack.enter_context(servers.repository_copy(args.model_repository, "tensorrt_llm", {}))
        add_null_engine(repo, plain_token_ids(load_tokenizer(checkpoint)), end_ids=_end_ids(checkpoint))
        endpoints = stack.enter_context(servers.triton(repo, args.work_dir, log_dir))
        processes = Processes.resolve(-1, triton_pid(endpoints.grpc_url))  # no frontend: the children are clients
        for round_ in range(args.rounds):
            for mode in MODES:
                row = measure(mode, endpoints.grpc_url, processes, args)
                rows[mode].append(row)
                print(f"round {round_ + 1} {mode:12s} client {row['client']:6.1f} µs/token, tritonserver "
                      f"{row['tritonserver']:6.1f}, engine {row['engine']:6.1f}, {row['tokens_per_s']:,.0f} tok/s",
                      flush=True)
    columns = {"client": "client µs/token", "tritonserver": "tritonserver µs/token", "engine": "engine µs/token",
               "tokens_per_s": "tok/s"}
    print(f"\nmedians of {args.rounds} interleaved rounds, concurrency {args.concurrency}, {args.requests} requests x "
          f"{args.max_tokens} tokens, CPU µs per token by process:\n")
    print(markdown_table([("mode", "l"), *((title, "r") for title in columns.values())],
                         [[mode, *(f"{statistics.median(r[c] for r in rows[mode]):,.0f}" for c in columns)]
                          for mode in MODES]))


if __name__ == "__main__":
    main()
