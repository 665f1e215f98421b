"""Prometheus metrics of the frontend, served at GET /metrics (prometheus-client text format).

One registry per app (not the global one), so several apps in one process do not collide. Triton's own
metrics (`nv_inference_*`, and the CPU engine's `cpu_engine_*` gauges) are on Triton's metrics port; with
`triton_metrics_url` set, GET /metrics relays them after the frontend's own (`TritonMetrics`, cached), so
that one port carries the engine's gauges (Kubernetes: Triton listens on the pod's loopback only).
"""

from __future__ import annotations

import asyncio
import http.client
import os
import re
import time
import urllib.request
from bisect import bisect_left
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the route)

PREFIX = "tritonllm"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_FLUSH_TOKENS = 64  # inter-token latencies reach /metrics at least this often per stream
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by route, status code and finish reason "
                                "(finish_reason: stop, length, error, timeout, shutdown, cancelled, none)",
                                ["route", "status", "finish_reason", "model", "version"], registry=r)
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "requests refused before generation, by reason "
                                "(unauthorized, body_too_large, queue_full, queue_timeout, requests_per_minute, "
                                "tokens_per_minute, shutting_down, body_timeout)", ["reason"], registry=r)
        # model: the served model id; version: the engine model version that served it ("" when not versioned)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of generation requests",
                                     ["route", "model", "version"], registry=r)
        self.completion_tokens = Counter(f"{PREFIX}_completion_tokens", "generated tokens", ["route", "model", "version"],
                                         registry=r)
        self.duration = Histogram(f"{PREFIX}_request_duration_seconds", "end-to-end request time, arrival to "
                                  "the last byte", ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(f"{PREFIX}_request_queue_time_seconds", "time waiting for admission (an "
                                    "in-flight slot)", ["route"], buckets=LATENCY_BUCKETS, registry=r)
        # model: the served model id, as on requests ("" when unknown)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "arrival to the first generated token (queue time included)",
                              ["route", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "time between generated tokens, per "
                             "token, after the first", ["route", "model"], buckets=TOKEN_BUCKETS, registry=r)
        self.live = LiveGauges()
        r.register(self.live)

    def render(self) -> bytes:
        """The text exposition. With several worker processes (PROMETHEUS_MULTIPROC_DIR, set by the supervisor
        before any worker imports prometheus_client), every worker's counters and histograms, summed: any
        worker answers GET /metrics with the server's totals."""
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(self.live)
        return generate_latest(registry)


class LiveGauges(Collector):
    """The admission gauges, set just before each scrape from the server's limits (`Limits.occupancy`: this
    process's gate, or the coordinator's for all workers) and Triton's metrics. Not prometheus Gauges: in
    multiprocess mode those are stored per process, and these values are the server's, not a worker's."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.queued = 0
        self.engine_waiting = 0.0
        # () -> (max_lora, running adapters, waiting adapters), set by the app when it serves LoRA adapters.
        self.lora: Callable[[], tuple[int, list[str], list[str]]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.lora is not None:
            # vLLM's LoRA-affinity gauge, as the Gateway API Inference Extension's model-server protocol reads it:
            # the adapters in the labels, the time of the observation as the value.
            max_lora, running, waiting = self.lora()
            info = GaugeMetricFamily("vllm:lora_requests_info", "running and waiting LoRA adapters (this "
                                     "frontend process's requests)",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(max_lora), ",".join(running), ",".join(waiting)], time.time())
            yield info
        yield GaugeMetricFamily(f"{PREFIX}_requests_in_flight", "generation requests holding a slot",
                                value=self.in_flight)
        yield GaugeMetricFamily(f"{PREFIX}_requests_queued", "generation requests waiting for a slot",
                                value=self.queued)
        # The endpoint picker's queue signal (deploy/kubernetes/base/endpoint-picker.yaml): its metric spec
        # names one series, and a request queued here waits as surely as one queued in the engine.
        yield GaugeMetricFamily(f"{PREFIX}_requests_waiting", "requests waiting to run: queued here for a slot "
                                "(requests_queued) plus waiting in the engine (Triton's nv_trt_llm_request_metrics"
                                "{request_type=waiting} or cpu_engine_requests_waiting, as last fetched; that part "
                                "is 0 without triton_metrics_url)", value=self.queued + self.engine_waiting)


# Triton's gauges of requests waiting in the engine: (family, labels a sample must have), per engine.
ENGINE_WAITING = (("nv_trt_llm_request_metrics", {"request_type": "waiting"}),  # TensorRT-LLM backend
                  ("cpu_engine_requests_waiting", {}))  # the CPU engine
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def engine_waiting(text: str) -> float:
    """Requests waiting in the engine according to Triton's metrics text: the samples of ENGINE_WAITING,
    summed (every model and version Triton serves)."""
    total = 0.0
    prefixes = tuple(name for name, _ in ENGINE_WAITING)
    for line in text.splitlines():
        if not line.startswith(prefixes):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        for name, labels in ENGINE_WAITING:
            if match.group(1) == name and labels.items() <= dict(_LABEL.findall(match.group(2) or "")).items():
                try:
                    total += float(match.group(3))
                except ValueError:
                    pass
    return total


class TritonMetrics:
    """Triton's metrics text (nv_*, cpu_engine_*), relayed after the frontend's own on GET /metrics; the two
    sets share no family name.

    Fetched from `url` (on loopback) in a worker thread, never on the event loop, and reused for `max_age_s`:
    however many scrapers there are (the endpoint picker, Prometheus) and however often they come, Triton is
    asked at most about once per `max_age_s`, and scrapes that find the text stale while a fetch is under way
    wait for that one fetch instead of starting their own. Triton itself refreshes most of its gauges only
    every 2 s (--metrics-interval-ms). While Triton does not answer: a comment saying so (reused likewise).
    """

    def __init__(self, url: str | None, timeout_s: float, max_age_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.url = url
        self.timeout_s = timeout_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._text = b""
        self._fetched_at: float | None = None
        self._fetching: asyncio.Future[None] | None = None
        self.engine_waiting = 0.0  # from the last text fetched (ENGINE_WAITING)
        self.fetches = 0

    async def text(self) -> bytes:
        if self.url is None:
            return b""
        if self._fetched_at is not None and self._clock() - self._fetched_at < self.max_age_s:
            return self._text
        if self._fetching is None:
            self._fetching = asyncio.ensure_future(self._refresh())
        await asyncio.shield(self._fetching)  # a scraper that goes away does not cancel the others' fetch
        return self._text

    async def _refresh(self) -> None:
        try:
            self._text, self.engine_waiting = await asyncio.to_thread(self._fetch)
            self._fetched_at = self._clock()
        finally:
            self._fetching = None

    def _fetch(self) -> tuple[bytes, float]:
        """In a worker thread: the text and the engine's waiting count read from it."""
        assert self.url is not None
        self.fetches += 1
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:
                text = response.read()
        except (OSError, ValueError, http.client.HTTPException) as exc:
            return f"# Triton's metrics at {self.url} are unavailable: {type(exc).__name__}\n".encode(), 0.0
        return text, engine_waiting(text.decode("utf-8", "replace"))


async def exposition(metrics: Metrics, triton: TritonMetrics, occupancy: tuple[int, int]) -> bytes:
    """GET /metrics: the frontend's metrics, then Triton's. Triton's are fetched (or taken from the cache)
    first: the requests_waiting gauge adds the engine's waiting count read from them."""
    engine = await triton.text()
    metrics.live.in_flight, metrics.live.queued = occupancy
    metrics.live.engine_waiting = triton.engine_waiting
    return metrics.render() + engine


class TokenTiming:
    """Time to first token and inter-token latency of one engine request (one choice), under its route and
    served model.

    Inter-token latencies are counted into a local copy of the histogram's buckets and added to the shared
    histogram every ITL_FLUSH_TOKENS tokens and when the request ends (`close`): a Histogram.observe per
    token measured 2-4 us (more in multiprocess mode, where each is a write to a memory-mapped file), the
    largest single item of the frontend's per-token cost after gRPC and the socket. The labelled children
    are looked up once per TokenTiming (at its first use), not per flush."""

    def __init__(self, started: float, metrics: Metrics | None, route: str, model: str,
                 on_first: Callable[[float], None] | None = None):
        self.started = started
        self._on_first = on_first
        self._metrics = metrics
        self._route = route
        self._model = model
        self._itl: Histogram | None = None  # metrics.itl's child for (route, model), once first needed
        self._last: float | None = None
        self._counts = [0] * (len(TOKEN_BUCKETS) + 1)  # per bucket (the last: +Inf), not yet in the histogram
        self._sum = 0.0
        self._pending = 0
        self.ttft_s: float | None = None

    def tokens(self, count: int) -> None:
        """Called when `count` new tokens arrive from the engine."""
        if count <= 0:
            return
        now = time.monotonic()
        if self._last is None:
            self.ttft_s = now - self.started
            if self._metrics is not None:
                self._metrics.ttft.labels(self._route, self._model).observe(self.ttft_s)
            if self._on_first is not None:
                self._on_first(self.ttft_s)
        elif self._metrics is not None:
            per_token = (now - self._last) / count
            count = min(count, 64)
            self._counts[bisect_left(TOKEN_BUCKETS, per_token)] += count  # observe()'s bucket: value <= bound
            self._sum += per_token * count
            self._pending += count
            if self._pending >= ITL_FLUSH_TOKENS:
                self.close()
        self._last = now

    def close(self) -> None:
        """Add the counted latencies to the shared histogram: what `observe` would have, one call per bucket."""
        if not self._pending or self._metrics is None:
            return
        if self._itl is None:
            self._itl = self._metrics.itl.labels(self._route, self._model)
        add_observations(self._itl, self._counts, self._sum)
        self._counts = [0] * len(self._counts)
        self._sum, self._pending = 0.0, 0


def add_observations(histogram: Histogram, counts: list[int], total: float) -> None:
    """`counts[i]` observations in bucket i (non-cumulative, as observe() keeps them) summing to `total`.
    prometheus-client has no public bulk observe; these are the two fields observe() itself increments
    (pinned in pyproject.toml; tests/unit/test_metrics.py checks the result equals observe() one by one)."""
    histogram._sum.inc(total)
    for bucket, count in zip(histogram._buckets, counts):
        if count:
            bucket.inc(count)
