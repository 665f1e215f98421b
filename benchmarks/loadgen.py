"""A closed-loop load generator: N concurrent streaming requests, through either transport.

- The OpenAI endpoint (our frontend, or the naive baseline), streaming chat with SSE: `OpenAITarget`.
- Triton gRPC directly: `TritonTarget`, ModelStreamInfer on the engine model `tensorrt_llm` with the token
  ids the frontend would send (the checkpoint's tokenizer and chat template), one stream per request.

Every request asks for exactly the workload's output length (OpenAI: `ignore_eos` + `min_tokens`; engine:
`min_tokens` + an `end_id` outside the vocabulary), so tokens/s compare fairly across targets. Times come
from our own clock per token-carrying response; token counts from the server (the usage chunk, or the
engine's `output_ids`). Figures are computed by `benchmarks.metrics`, the same code that reads
perf_analyzer's export.

    python -m benchmarks.loadgen openai --url http://127.0.0.1:9000/v1 --model demo-small --quick
    python -m benchmarks.loadgen triton --grpc-url 127.0.0.1:8001 --tokenizer build/checkpoints/demo-small

`run_level`, `LevelResult`, `stream_chat`, `percentile` and `RequestRecord` are the original API (OpenAI
path only) and keep their signatures; `stream_messages` and `run_conversations_level` are the same for
whole conversations (a system prompt and the user's turn: `benchmarks.engine_bench`'s prefix scenarios).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

import httpx

from benchmarks.metrics import RequestTiming, percentile, summarize
from benchmarks.workload import NEVER_END_ID, Workload, chat_ids, load_tokenizer, load_workload

__all__ = ["RequestRecord", "LevelResult", "percentile", "stream_chat", "run_level", "DEFAULT_PROMPTS",
           "stream_messages", "run_conversations_level",
           "OpenAITarget", "TritonTarget", "run_workload_level", "run_sweep"]


# ----- the original API (OpenAI path) -------------------------------------------------------------------
@dataclass
class RequestRecord:
    start: float
    first_token: float | None = None
    end: float = 0.0
    completion_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0

    @property
    def ttft(self) -> float:
        return (self.first_token or self.end) - self.start

    @property
    def itl(self) -> float | None:
        if self.completion_tokens < 2 or self.first_token is None:
            return None
        return (self.end - self.first_token) / (self.completion_tokens - 1)

    def timing(self) -> RequestTiming:
        """As `benchmarks.metrics` counts it: E2E ends at the last content chunk, not the stream's close."""
        return RequestTiming(start=self.start, token_times=list(self.chunk_times),
                             output_tokens=self.completion_tokens, input_tokens=self.prompt_tokens)


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    duration_s: float
    output_tokens: int
    ttft_s: list[float]
    itl_s: list[float]
    e2e_s: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)  # per request, from the usage chunk (0: none)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.duration_s

    def summary(self) -> dict[str, float]:
        out = {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "output_tok_per_s": round(self.tokens_per_s, 1),
            "ttft_p50_ms": round(percentile(self.ttft_s, 50) * 1000, 1),
            "ttft_p99_ms": round(percentile(self.ttft_s, 99) * 1000, 1),
            "itl_p50_ms": round(percentile(self.itl_s, 50) * 1000, 2),
            "itl_p99_ms": round(percentile(self.itl_s, 99) * 1000, 2),
        }
        if self.e2e_s:
            out["req_per_s"] = round(self.requests_per_s, 3)
            out["e2e_p50_ms"] = round(percentile(self.e2e_s, 50) * 1000, 1)
            out["e2e_p99_ms"] = round(percentile(self.e2e_s, 99) * 1000, 1)
        return out


Messages = list[dict[str, Any]]


def _chat_body(model: str, prompt: str | Messages, max_tokens: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return {"model": model, "messages": messages, "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "min_tokens": max_tokens, "temperature": 0}


async def stream_chat(client: httpx.AsyncClient, base_url: str, model: str, prompt: str,
                      max_tokens: int) -> RequestRecord:
    return await stream_messages(client, base_url, model, [{"role": "user", "content": prompt}], max_tokens)


async def stream_messages(client: httpx.AsyncClient, base_url: str, model: str, messages: Messages,
                          max_tokens: int) -> RequestRecord:
    """`stream_chat` for a whole conversation (e.g. a system prompt, then the user's turn)."""
    body = _chat_body(model, messages, max_tokens)
    record = RequestRecord(start=time.perf_counter())
    async with client.stream("POST", f"{base_url}/chat/completions", json=body) as response:
        if response.is_error:
            await response.aread()
            response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            now = time.perf_counter()
            if "error" in chunk:
                raise RuntimeError(f"stream failed: {chunk['error'].get('message')}")
            if chunk.get("usage"):
                record.completion_tokens = chunk["usage"]["completion_tokens"]
                record.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                record.first_token = record.first_token or now
                record.chunk_times.append(now)
    record.end = time.perf_counter()
    return record


async def run_level(base_url: str, model: str, concurrency: int, requests: int, max_tokens: int,
                    prompts: list[str]) -> LevelResult:
    return await run_conversations_level(base_url, model, concurrency, requests, max_tokens,
                                         [[{"role": "user", "content": prompt}] for prompt in prompts])


async def run_conversations_level(base_url: str, model: str, concurrency: int, requests: int, max_tokens: int,
                                  conversations: list[Messages]) -> LevelResult:
    """`run_level` with whole conversations: request i sends conversations[i % len(conversations)]."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    records: list[RequestRecord] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            records.append(await stream_messages(client, base_url, model, conversations[i % len(conversations)],
                                                 max_tokens))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        duration = time.perf_counter() - start
    return LevelResult(concurrency, len(records), duration, sum(r.completion_tokens for r in records),
                       [r.ttft for r in records], [r.itl for r in records if r.itl is not None],
                       [r.end - r.start for r in records], [r.prompt_tokens for r in records])


DEFAULT_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash map works.",
    "List five facts about the moon.",
    "What is in-flight batching?",
]


# ----- targets: one request in, one RequestTiming out ---------------------------------------------------
class Target(Protocol):
    label: str

    async def open(self, concurrency: int) -> None: ...

    async def close(self) -> None: ...

    async def request(self, prompt: str) -> RequestTiming: ...


class OpenAITarget:
    """Streaming chat completions with SSE (our frontend, or any OpenAI-compatible server)."""

    def __init__(self, base_url: str, model: str, output_tokens: int, label: str = "frontend"):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.output_tokens = output_tokens
        self.label = label
        self._client: httpx.AsyncClient | None = None

    async def open(self, concurrency: int) -> None:
        await self.close()
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10),
                                         limits=httpx.Limits(max_connections=concurrency + 4))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def request(self, prompt: str) -> RequestTiming:
        assert self._client is not None, "open() first"
        record = await stream_chat(self._client, self.base_url, self.model, prompt, self.output_tokens)
        return record.timing()


class TritonTarget:
    """ModelStreamInfer on the engine model with the token ids the frontend would send for the prompt."""

    def __init__(self, grpc_url: str, tokenizer: Any, output_tokens: int, model_name: str = "tensorrt_llm",
                 label: str = "triton"):
        self.grpc_url = grpc_url
        self.tokenizer = tokenizer
        self.output_tokens = output_tokens
        self.model_name = model_name
        self.label = label
        self._ids: dict[str, list[int]] = {}
        self._client = None

    async def open(self, concurrency: int) -> None:
        import tritonclient.grpc.aio as grpcclient

        await self.close()
        self._client = grpcclient.InferenceServerClient(url=self.grpc_url)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def _inputs(self, ids: list[int]) -> list[Any]:
        import numpy as np
        import tritonclient.grpc.aio as grpcclient

        def tensor(name: str, value: np.ndarray, datatype: str):
            t = grpcclient.InferInput(name, list(value.shape), datatype)
            t.set_data_from_numpy(value)
            return t

        def scalar(name: str, value: Any, dtype: type, datatype: str):
            return tensor(name, np.array([[value]], dtype=dtype), datatype)

        n = self.output_tokens
        return [
            tensor("input_ids", np.array([ids], dtype=np.int32), "INT32"),
            scalar("input_lengths", len(ids), np.int32, "INT32"),
            scalar("request_output_len", n, np.int32, "INT32"),
            scalar("min_tokens", n, np.int32, "INT32"),
            scalar("end_id", NEVER_END_ID, np.int32, "INT32"),
            scalar("streaming", True, np.bool_, "BOOL"),
            scalar("exclude_input_in_output", True, np.bool_, "BOOL"),
            # greedy, as the frontend sends temperature 0
            scalar("temperature", 1.0, np.float32, "FP32"),
            scalar("runtime_top_k", 1, np.int32, "INT32"),
        ]

    async def request(self, prompt: str) -> RequestTiming:
        ids = self._ids.get(prompt)
        if ids is None:
            ids = self._ids[prompt] = chat_ids(self.tokenizer, prompt)
        return await self.request_ids(ids)

    async def request_ids(self, ids: list[int]) -> RequestTiming:
        """One streaming request for these prompt token ids; one timestamp per token the engine sends."""
        import tritonclient.grpc.aio as grpcclient

        assert self._client is not None, "open() first"
        request = {"model_name": self.model_name, "inputs": self._inputs(ids),
                   "outputs": [grpcclient.InferRequestedOutput("output_ids")]}

        async def one_request():
            yield request

        timing = RequestTiming(start=time.perf_counter(), input_tokens=len(ids))
        async for result, error in self._client.stream_infer(one_request()):
            now = time.perf_counter()
            if error is not None:
                raise RuntimeError(f"engine error: {error}")
            out = result.as_numpy("output_ids")
            if out is None or out.size == 0:
                continue
            timing.token_times.append(now)
            timing.output_tokens += int(out.size)
        return timing


# ----- driving a workload ---------------------------------------------------------------------------------
async def run_workload_level(target: Target, prompts: Sequence[str], concurrency: int, requests: int,
                             progress: bool = True, offset: int = 0) -> tuple[list[RequestTiming], float]:
    """`requests` requests, `concurrency` at a time (closed loop); prompt i is prompts[(offset+i) % n].
    Failed requests come back with `error` set. Returns the timings and the wall time of the level."""
    from tqdm import tqdm

    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    timings: list[RequestTiming] = []
    bar = tqdm(total=requests, desc=f"{target.label:>9} c={concurrency:<3}", unit="req", file=sys.stderr,
               disable=not progress, dynamic_ncols=True, leave=True)

    async def worker() -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            start = time.perf_counter()
            try:
                timings.append(await target.request(prompts[(offset + i) % len(prompts)]))
            except Exception as exc:  # counted, not fatal: a level reports its errors
                timings.append(RequestTiming(start=start, error=f"{type(exc).__name__}: {exc}"))
            bar.update(1)

    await target.open(concurrency)
    try:
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - start
    finally:
        bar.close()
        await target.close()
    return timings, duration


async def run_sweep(target: Target, workload: Workload, prompts: Sequence[str], naive: bool = False,
                    progress: bool = True, concurrencies: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Warm-up, then one level per concurrency. One summary (benchmarks.metrics.summarize) per level,
    with `target`, `concurrency` and the first error seen, if any."""
    if workload.warmup_requests:
        await run_workload_level(target, prompts, 1, workload.warmup_requests, progress=False)
    results = []
    offset = 0
    for c in concurrencies or workload.concurrencies:
        n = workload.requests_at(c, naive=naive)
        timings, _ = await run_workload_level(target, prompts, c, n, progress=progress, offset=offset)
        offset += n
        summary = {"target": target.label, "concurrency": c, **summarize(timings)}
        errors = [t.error for t in timings if t.error]
        if errors:
            summary["first_error"] = errors[0]
        results.append(summary)
    return results


def format_rows(results: list[dict[str, Any]]) -> str:
    head = "| target | conc | req | err | out tok/s | req/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | E2E p50/p99 ms |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]

    def f(v: Any, nd: int = 1) -> str:
        return "-" if v is None else f"{v:.{nd}f}"

    for r in results:
        t, i, e = r["ttft_ms"], r["itl_ms"], r["e2e_ms"]
        lines.append(f"| {r['target']} | {r['concurrency']} | {r['requests']} | {r['errors']} | "
                     f"{f(r['output_tok_per_s'])} | {f(r['req_per_s'], 2)} | "
                     f"{f(t['p50'], 0)} / {f(t['p90'], 0)} / {f(t['p99'], 0)} | "
                     f"{f(i['p50'])} / {f(i['p90'])} / {f(i['p99'])} | {f(e['p50'], 0)} / {f(e['p99'], 0)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Closed-loop load generator (benchmarks/workload.py).")
    parser.add_argument("transport", choices=["openai", "triton"])
    parser.add_argument("--url", help="OpenAI base URL, e.g. http://127.0.0.1:9000/v1")
    parser.add_argument("--model", help="OpenAI model id")
    parser.add_argument("--grpc-url", help="Triton gRPC host:port")
    parser.add_argument("--engine-model", default="tensorrt_llm")
    parser.add_argument("--tokenizer", help="checkpoint dir (required for triton; exact prompt lengths)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workload", help="JSON of Workload fields overriding the preset")
    parser.add_argument("--concurrency", help="comma-separated, overrides the workload's")
    parser.add_argument("--label")
    parser.add_argument("--output", help="write the results JSON here")
    args = parser.parse_args(argv)
    workload = load_workload(args.quick, args.workload)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    prompts = workload.prompts(tokenizer)
    if args.transport == "openai":
        if not (args.url and args.model):
            parser.error("openai needs --url and --model")
        target: Target = OpenAITarget(args.url, args.model, workload.output_tokens, label=args.label or "openai")
    else:
        if not (args.grpc_url and tokenizer is not None):
            parser.error("triton needs --grpc-url and --tokenizer")
        target = TritonTarget(args.grpc_url, tokenizer, workload.output_tokens, args.engine_model,
                              label=args.label or "triton")
    concurrencies = [int(c) for c in args.concurrency.split(",")] if args.concurrency else None
    results = asyncio.run(run_sweep(target, workload, prompts, concurrencies=concurrencies))
    print(format_rows(results))
    if args.output:
        Path(args.output).write_text(json.dumps({"workload": workload.to_dict(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
