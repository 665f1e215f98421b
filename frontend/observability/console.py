"""The console's live charts (GET /console/summary.json): a small JSON summary of the last minutes, computed from
the frontend's own metrics (the exposition GET /metrics serves: the prometheus-client registry, every worker's
with FRONTEND_WORKERS > 1, then Triton's relayed text), not from a second metrics system.

Each call of `ConsoleSummary.summary` takes a snapshot of the exposition (at most one per `min_spacing_s`, so a
crowd of open pages costs what one does) and keeps `window_s` of them; series are the differences between
snapshots: tokens/s per served model (tritonllm_completion_tokens), requests in flight, queued and waiting
(the admission gauges), TTFT and inter-token latency percentiles over the last `quantile_window_s` (from the
histograms' buckets, as Prometheus' histogram_quantile estimates them), and KV-cache use per engine model
(Triton's cpu_engine_kv_cache_usage_ratio or TensorRT-LLM's nv_trt_llm_kv_cache_block_metrics fraction; only
with triton_metrics_url).

The latency percentiles come twice: `ttft_s` and `itl_s` for the whole server (every route and model), and
`ttft_s_by_model` and `itl_s_by_model` per served model (the histograms' `model` label; "(none)" for requests
that named no model the server knows), {model: {"p50": [...], "p95": [...], "p99": [...]}}, one point per
snapshot like every other series. Counters are the server's totals, so with several workers any worker's snapshots
give the right rates: each worker keeps its own history, filled while pages poll it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from prometheus_client.parser import text_string_to_metric_families

from frontend.observability.metrics import PREFIX

QUANTILES = (0.5, 0.95, 0.99)


@dataclass
class Snapshot:
    t: float  # wall-clock seconds (the charts' x axis)
    tokens: dict[str, float] = field(default_factory=dict)  # served model -> completion tokens so far
    ttft: dict[float, float] = field(default_factory=dict)  # bucket upper bound -> cumulative count, all routes
    itl: dict[float, float] = field(default_factory=dict)  # and models
    ttft_by_model: dict[str, dict[float, float]] = field(default_factory=dict)  # served model -> its buckets
    itl_by_model: dict[str, dict[float, float]] = field(default_factory=dict)
    in_flight: float = 0.0
    queued: float = 0.0
    waiting: float = 0.0
    kv_cache: dict[str, float] = field(default_factory=dict)  # engine model -> used fraction (0..1)


def snapshot(text: str, t: float) -> Snapshot:
    """The values the charts need, read from one exposition text."""
    snap = Snapshot(t)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == f"{PREFIX}_completion_tokens_total":
                model = labels.get("model") or "(none)"
                snap.tokens[model] = snap.tokens.get(model, 0.0) + value
            elif name in (f"{PREFIX}_time_to_first_token_seconds_bucket", f"{PREFIX}_inter_token_latency_seconds_bucket"):
                ttft = "first_token" in name
                bound = float(labels["le"])
                model = labels.get("model") or "(none)"
                for buckets in ((snap.ttft, snap.ttft_by_model.setdefault(model, {})) if ttft
                                else (snap.itl, snap.itl_by_model.setdefault(model, {}))):
                    buckets[bound] = buckets.get(bound, 0.0) + value
            elif name == f"{PREFIX}_requests_in_flight":
                snap.in_flight = value
            elif name == f"{PREFIX}_requests_queued":
                snap.queued = value
            elif name == f"{PREFIX}_requests_waiting":
                snap.waiting = value
            elif name == "cpu_engine_kv_cache_usage_ratio":
                key = labels.get("model", "") + (f" v{labels['version']}" if labels.get("version") else "")
                snap.kv_cache[key] = value
            elif name == "nv_trt_llm_kv_cache_block_metrics" and labels.get("kv_cache_block_type") == "fraction":
                key = labels.get("model", "") + (f" v{labels['version']}" if labels.get("version") else "")
                snap.kv_cache[key] = value
    return snap


def quantile(q: float, newer: dict[float, float], older: dict[float, float]) -> float | None:
    """histogram_quantile(q) of the observations between two cumulative bucket snapshots (None: none)."""
    bounds = sorted(newer)
    counts = [newer[b] - older.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if math.isinf(bound):
                return previous_bound  # past the last finite bound: the best estimate Prometheus gives too
            if count == previous_count:
                return bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / (count - previous_count)
        previous_bound, previous_count = bound, count
    return previous_bound


class ConsoleSummary:
    def __init__(self, window_s: float = 300.0, min_spacing_s: float = 1.0, quantile_window_s: float = 30.0,
                 clock: Callable[[], float] = time.time):
        self.window_s = window_s
        self.min_spacing_s = min_spacing_s
        self.quantile_window_s = quantile_window_s
        self._clock = clock
        self.snapshots: deque[Snapshot] = deque()

    def wants_sample(self) -> bool:
        return not self.snapshots or self._clock() - self.snapshots[-1].t >= self.min_spacing_s

    def add(self, exposition: bytes) -> None:
        now = self._clock()
        self.snapshots.append(snapshot(exposition.decode("utf-8", "replace"), now))
        while self.snapshots and now - self.snapshots[0].t > self.window_s:
            self.snapshots.popleft()

    def summary(self) -> dict[str, Any]:
        """The series, one point per snapshot after the first (rates need two)."""
        snaps = list(self.snapshots)

        def percentiles() -> dict[str, list[float | None]]:
            return {f"p{round(q * 100)}": [] for q in QUANTILES}

        models = sorted({m for s in snaps for m in s.tokens})
        engines = sorted({m for s in snaps for m in s.kv_cache})
        ttft_models = sorted({m for s in snaps for m in s.ttft_by_model})
        itl_models = sorted({m for s in snaps for m in s.itl_by_model})
        out: dict[str, Any] = {"window_s": self.window_s, "t": [], "tokens_per_s": {}, "in_flight": [], "queued": [],
                               "waiting": [], "kv_cache_usage": {}, "ttft_s": percentiles(), "itl_s": percentiles(),
                               "ttft_s_by_model": {m: percentiles() for m in ttft_models},
                               "itl_s_by_model": {m: percentiles() for m in itl_models}}
        out["tokens_per_s"] = {m: [] for m in models}
        out["kv_cache_usage"] = {m: [] for m in engines}
        base = 0  # the oldest snapshot within quantile_window_s of the current one
        for i in range(1, len(snaps)):
            new, old = snaps[i], snaps[i - 1]
            while snaps[i].t - snaps[base].t > self.quantile_window_s and base < i - 1:
                base += 1
            span = max(new.t - old.t, 1e-9)
            out["t"].append(round(new.t, 3))
            for m in models:
                out["tokens_per_s"][m].append(round(max(new.tokens.get(m, 0.0) - old.tokens.get(m, 0.0), 0.0) / span, 3))
            out["in_flight"].append(new.in_flight)
            out["queued"].append(new.queued)
            out["waiting"].append(new.waiting)
            for m in engines:
                out["kv_cache_usage"][m].append(new.kv_cache.get(m))
            for q in QUANTILES:
                key = f"p{round(q * 100)}"
                out["ttft_s"][key].append(quantile(q, new.ttft, snaps[base].ttft))
                out["itl_s"][key].append(quantile(q, new.itl, snaps[base].itl))
                for m in ttft_models:
                    out["ttft_s_by_model"][m][key].append(quantile(q, new.ttft_by_model.get(m, {}),
                                                                   snaps[base].ttft_by_model.get(m, {})))
                for m in itl_models:
                    out["itl_s_by_model"][m][key].append(quantile(q, new.itl_by_model.get(m, {}),
                                                                  snaps[base].itl_by_model.get(m, {})))
        return out


async def live_summary(console: ConsoleSummary, exposition: Callable[[], Any]) -> dict[str, Any]:
    """GET /console/summary.json: a new snapshot of `exposition()` (the /metrics text) if the last one is old
    enough, then the series."""
    if console.wants_sample():
        console.add(await exposition())
    return console.summary()
