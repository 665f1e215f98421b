"""A closed-loop load generator for the OpenAI endpoint: N concurrent streaming chat requests.

Every request asks for exactly `max_tokens` tokens (`ignore_eos`), so tokens/s compare fairly across
runs; token counts come from the server's usage chunk, times from our own clock per SSE chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestRecord:
    start: float
    first_token: float | None = None
    end: float = 0.0
    completion_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return (self.first_token or self.end) - self.start

    @property
    def itl(self) -> float | None:
        if self.completion_tokens < 2 or self.first_token is None:
            return None
        return (self.end - self.first_token) / (self.completion_tokens - 1)


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    duration_s: float
    output_tokens: int
    ttft_s: list[float]
    itl_s: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s

    def summary(self) -> dict[str, float]:
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "output_tok_per_s": round(self.tokens_per_s, 1),
            "ttft_p50_ms": round(percentile(self.ttft_s, 50) * 1000, 1),
            "ttft_p99_ms": round(percentile(self.ttft_s, 99) * 1000, 1),
            "itl_p50_ms": round(percentile(self.itl_s, 50) * 1000, 2),
            "itl_p99_ms": round(percentile(self.itl_s, 99) * 1000, 2),
        }


def percentile(values: list[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def stream_chat(client: httpx.AsyncClient, base_url: str, model: str, prompt: str,
                      max_tokens: int) -> RequestRecord:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0}
    record = RequestRecord(start=time.perf_counter())
    async with client.stream("POST", f"{base_url}/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            now = time.perf_counter()
            if chunk.get("usage"):
                record.completion_tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                record.first_token = record.first_token or now
                record.chunk_times.append(now)
    record.end = time.perf_counter()
    return record


async def run_level(base_url: str, model: str, concurrency: int, requests: int, max_tokens: int,
                    prompts: list[str]) -> LevelResult:
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
            records.append(await stream_chat(client, base_url, model, prompts[i % len(prompts)], max_tokens))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        duration = time.perf_counter() - start
    return LevelResult(concurrency, len(records), duration, sum(r.completion_tokens for r in records),
                       [r.ttft for r in records], [r.itl for r in records if r.itl is not None])


DEFAULT_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash map works.",
    "List five facts about the moon.",
    "What is in-flight batching?",
]
