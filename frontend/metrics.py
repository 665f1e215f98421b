"""Prometheus metrics of the frontend, served at GET /metrics (prometheus-client text format).

One registry per app (not the global one), so several apps in one process do not collide. Triton's own
metrics (`nv_inference_*`, and the CPU engine's `cpu_engine_*` gauges) are on Triton's metrics port.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the route)

PREFIX = "tritonllm"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
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
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "arrival to the first generated token (queue time included)",
                              ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "time between generated tokens, per "
                             "token, after the first", ["route"], buckets=TOKEN_BUCKETS, registry=r)
        self.in_flight = Gauge(f"{PREFIX}_requests_in_flight", "generation requests holding a slot", registry=r)
        self.queued = Gauge(f"{PREFIX}_requests_queued", "generation requests waiting for a slot", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TokenTiming:
    """Time to first token and inter-token latency of one engine request (one choice)."""

    def __init__(self, started: float, metrics: Metrics | None, route: str,
                 on_first: Callable[[float], None] | None = None):
        self.started = started
        self._on_first = on_first
        self._metrics = metrics
        self._route = route
        self._last: float | None = None
        self._itl = None  # this route's inter-token histogram, looked up once
        self.ttft_s: float | None = None

    def tokens(self, count: int) -> None:
        """Called when `count` new tokens arrive from the engine."""
        if count <= 0:
            return
        now = time.monotonic()
        if self._last is None:
            self.ttft_s = now - self.started
            if self._metrics is not None:
                self._metrics.ttft.labels(self._route).observe(self.ttft_s)
            if self._on_first is not None:
                self._on_first(self.ttft_s)
        elif self._metrics is not None:
            per_token = (now - self._last) / count
            histogram = self._itl
            if histogram is None:
                histogram = self._itl = self._metrics.itl.labels(self._route)
            for _ in range(min(count, 64)):
                histogram.observe(per_token)
        self._last = now
