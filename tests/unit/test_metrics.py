"""benchmarks/metrics.py on synthetic timestamps with hand-computed answers, and the perf_analyzer export
parser on a small hand-written export; the frontend's relay of Triton's metrics (frontend/observability/metrics.py) against
a local HTTP server."""

from __future__ import annotations

import asyncio
import http.server
import inspect
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from benchmarks import loadgen
from benchmarks.metrics import RequestTiming, parse_pa_export, parse_pa_request, percentile, summarize
from benchmarks.workload import DEFAULT, QUICK, Workload, load_workload

approx = pytest.approx


def synthetic() -> list[RequestTiming]:
    return [
        # TTFT 0.1, E2E 0.4, ITL (0.4 - 0.1) / 3 = 0.1
        RequestTiming(start=0.0, token_times=[0.1, 0.2, 0.3, 0.4], output_tokens=4, input_tokens=10),
        # a response may carry several tokens: TTFT 0.3, E2E 0.8, ITL (0.8 - 0.3) / 1 = 0.5
        RequestTiming(start=0.5, token_times=[0.8, 1.3], output_tokens=2, input_tokens=20),
        # one token: TTFT = E2E = 0.2, no ITL
        RequestTiming(start=1.0, token_times=[1.2], output_tokens=1, input_tokens=30),
        # failed: counted as an error, not in any figure
        RequestTiming(start=1.1, error="boom"),
    ]


def test_per_request_figures():
    a, b, c, d = synthetic()
    assert (a.ttft, a.e2e, a.itl) == (approx(0.1), approx(0.4), approx(0.1))
    assert (b.ttft, b.e2e, b.itl) == (approx(0.3), approx(0.8), approx(0.5))
    assert (c.ttft, c.e2e, c.itl) == (approx(0.2), approx(0.2), None)
    assert not d.ok


def test_summary_hand_computed():
    s = summarize(synthetic())
    assert s["requests"] == 3 and s["errors"] == 1
    assert s["duration_s"] == approx(1.3)  # first sent (0.0) -> last token (1.3)
    assert s["output_tokens"] == 7 and s["input_tokens"] == 60
    assert s["output_tokens_per_request"] == approx(7 / 3)
    assert s["output_tok_per_s"] == approx(7 / 1.3)
    assert s["req_per_s"] == approx(3 / 1.3)
    # TTFT sorted 0.1, 0.2, 0.3: p50 0.2; p90 rank 1.8 -> 0.2 + 0.8 * 0.1; p99 rank 1.98
    assert s["ttft_ms"] == {"p50": approx(200), "p90": approx(280), "p99": approx(298), "mean": approx(200)}
    # ITL 0.1, 0.5: p50 rank 0.5 -> 0.3; p90 -> 0.1 + 0.9 * 0.4; p99 -> 0.1 + 0.99 * 0.4
    assert s["itl_ms"] == {"p50": approx(300), "p90": approx(460), "p99": approx(496), "mean": approx(300)}
    # E2E sorted 0.2, 0.4, 0.8: p90 rank 1.8 -> 0.4 + 0.8 * 0.4
    assert s["e2e_ms"] == {"p50": approx(400), "p90": approx(720), "p99": approx(792), "mean": approx(1400 / 3)}


def test_summary_explicit_duration_and_empty():
    assert summarize(synthetic(), duration_s=2.0)["output_tok_per_s"] == approx(3.5)
    empty = summarize([])
    assert empty["requests"] == 0 and empty["output_tok_per_s"] is None and empty["ttft_ms"]["p50"] is None


def test_percentile_matches_numpy_linear():
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for p in (0, 10, 50, 90, 99, 100):
        assert percentile(values, p) == approx(float(np.percentile(values, p)))
    assert percentile([4.0], 99) == 4.0


# ----- perf_analyzer --profile-export-file -----------------------------------------------------------------
S = 1_000_000_000  # ns per second
EXPORT = {
    "version": "2.51.0", "service_kind": "triton", "endpoint": "",
    "experiments": [
        {"experiment": {"mode": "concurrency", "value": 1},
         "window_boundaries": [S, 3 * S],
         "requests": [
             # tensorrt_llm: output_ids per response (a scalar or a list); a bare final response {} is dropped
             {"timestamp": S,
              "request_inputs": {"input_ids": [1, 2, 3, 4, 5], "input_lengths": 5, "streaming": True},
              "response_timestamps": [S + 100_000_000, S + 150_000_000, S + 200_000_000, S + 300_000_000],
              "response_outputs": [{"output_ids": 11}, {"output_ids": [12, 13]}, {"output_ids": 14}, {}]},
             {"timestamp": 2 * S,
              "request_inputs": {"input_ids": [1, 2, 3], "input_lengths": [3]},
              "response_timestamps": [2 * S + 400_000_000, 2 * S + 500_000_000],
              "response_outputs": [{"output_ids": 21}, {"output_ids": 22}]},
         ]},
        {"experiment": {"mode": "concurrency", "value": 2},
         "window_boundaries": [],
         "requests": [
             # ensemble: one text response per token, even one that decodes to "" (half a UTF-8 character)
             {"timestamp": 10 * S, "request_inputs": {"text_input": "hi"},
              "response_timestamps": [10 * S + 50_000_000, 10 * S + 80_000_000, 10 * S + 110_000_000],
              "response_outputs": [{"text_output": "a"}, {"text_output": ""}, {"text_output": "b"}]},
             # an export without outputs (older perf_analyzer): every response is one token
             {"timestamp": 10 * S, "request_inputs": {},
              "response_timestamps": [10 * S + 70_000_000, 10 * S + 130_000_000]},
         ]},
    ],
}


def test_pa_request_hand_computed():
    t = parse_pa_request(EXPORT["experiments"][0]["requests"][0])
    assert t.start == approx(1.0) and t.token_times == [approx(1.1), approx(1.15), approx(1.2)]
    assert t.output_tokens == 4 and t.input_tokens == 5
    assert (t.ttft, t.e2e, t.itl) == (approx(0.1), approx(0.2), approx(0.1 / 3))


def test_pa_export_hand_computed(tmp_path):
    path = tmp_path / "export.json"
    path.write_text(json.dumps(EXPORT))
    one, two = parse_pa_export(path)
    assert (one["mode"], one["value"]) == ("concurrency", 1)
    # requests: (TTFT 0.1, E2E 0.2, 4 tokens), (TTFT 0.4, E2E 0.5, 2 tokens); span 1.0 s -> 2.5 s
    assert one["requests"] == 2 and one["output_tokens"] == 6 and one["input_tokens"] == 8
    assert one["duration_s"] == approx(1.5)
    assert one["output_tok_per_s"] == approx(4.0) and one["req_per_s"] == approx(2 / 1.5)
    assert one["ttft_ms"]["p50"] == approx(250) and one["e2e_ms"]["p50"] == approx(350)
    # ITL: 0.1 / 3 and 0.1 / 1
    assert one["itl_ms"]["p50"] == approx((100 / 3 + 100) / 2)
    # ensemble request: 3 tokens, TTFT 50 ms, ITL 30 ms; bare request: 2 tokens, TTFT 70 ms, ITL 60 ms
    assert two["value"] == 2 and two["output_tokens"] == 5
    assert two["ttft_ms"]["p50"] == approx(60) and two["itl_ms"]["p50"] == approx(45)
    assert two["duration_s"] == approx(0.13)
    assert parse_pa_export(EXPORT) == [one, two]  # a dict works as well as a path


def test_pa_openai_sse_responses():
    record = {"timestamp": 0, "response_timestamps": [10, 20, 30, 40],
              "response_outputs": [
                  {"response": 'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'},
                  {"response": 'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n'},
                  {"response": 'data: {"choices":[{"delta":{"content":"lo"}}]}\n\n'},
                  {"response": "data: [DONE]\n\n"}]}
    t = parse_pa_request(record)
    assert t.output_tokens == 2 and t.token_times == [approx(20e-9), approx(30e-9)]


# ----- the workload and the original load-generator API -----------------------------------------------------
def test_workload_is_deterministic_and_sized():
    assert Workload().prompts() == Workload().prompts()
    assert Workload(seed=1).prompts() != Workload(seed=2).prompts()
    assert len(DEFAULT.prompts()) == DEFAULT.num_prompts
    assert all(len(p.split()) == QUICK.input_tokens for p in QUICK.prompts())
    assert DEFAULT.concurrencies == (1, 4, 16, 32)
    assert DEFAULT.requests_at(32) >= 32 and DEFAULT.requests_at(1) == DEFAULT.min_requests
    assert DEFAULT.requests_at(32, naive=True) >= 32  # at least one request per concurrent client
    assert load_workload(quick=True) == QUICK


def test_workload_json_override(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"output_tokens": 7, "concurrencies": [2, 3]}))
    w = load_workload(path=path)
    assert w.output_tokens == 7 and w.concurrencies == (2, 3) and w.seed == DEFAULT.seed


def test_loadgen_public_api_unchanged():
    assert list(inspect.signature(loadgen.run_level).parameters) == [
        "base_url", "model", "concurrency", "requests", "max_tokens", "prompts"]
    assert list(inspect.signature(loadgen.stream_chat).parameters) == [
        "client", "base_url", "model", "prompt", "max_tokens"]
    assert loadgen.percentile is percentile
    result = loadgen.LevelResult(4, 2, 2.0, 64, [0.1, 0.3], [0.01, 0.03])
    assert result.tokens_per_s == 32.0
    assert result.summary() == {"concurrency": 4, "requests": 2, "output_tok_per_s": 32.0, "ttft_p50_ms": 200.0,
                                "ttft_p99_ms": 298.0, "itl_p50_ms": 20.0, "itl_p99_ms": 29.8}


def test_pa_level_with_a_truncated_export_runs_again(tmp_path, monkeypatch):
    from benchmarks import pa_sweep

    export, runs = tmp_path / "export.json", []
    full = json.dumps(EXPORT)

    def fake_run_pa(command, pa_env, log):
        assert not export.exists()  # perf_analyzer refuses to overwrite an export
        runs.append(command)
        export.write_text(full[:64] if len(runs) == 1 else full)  # first: cut short, as 2.51 once did

    monkeypatch.setattr(pa_sweep, "run_pa", fake_run_pa)
    assert pa_sweep.run_and_parse(["pa"], export, tmp_path / "env.sh", tmp_path / "log") == parse_pa_export(EXPORT)
    assert len(runs) == 2
    monkeypatch.setattr(pa_sweep, "run_pa", lambda *args: export.write_text("{"))
    with pytest.raises(RuntimeError, match="unreadable"):
        pa_sweep.run_and_parse(["pa"], export, tmp_path / "env.sh", tmp_path / "log")


# ----- the frontend's relay of Triton's metrics (GET /metrics with TRITON_METRICS_URL) ---------------------
TRITON_TEXT = """# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 3
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 8
# TYPE cpu_engine_requests_waiting gauge
cpu_engine_requests_waiting{model="tensorrt_llm",version="1"} 2
cpu_engine_requests_waiting{model="tensorrt_llm",version="2"} 1.5
cpu_engine_requests_waiting_other{model="tensorrt_llm"} 100
"""


class FakeTriton(http.server.ThreadingHTTPServer):
    """Triton's metrics port: counts the GETs, answers TRITON_TEXT after `delay_s`."""

    def __init__(self) -> None:
        self.hits = 0
        self.delay_s = 0.0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                server.hits += 1
                time.sleep(server.delay_s)
                body = TRITON_TEXT.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/metrics"


@pytest.fixture
def triton() -> Iterator[FakeTriton]:
    server = FakeTriton()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_engine_waiting_sums_the_engines_waiting_gauges() -> None:
    from frontend.observability.metrics import engine_waiting

    assert engine_waiting(TRITON_TEXT) == 3 + 2 + 1.5  # not `scheduled`, not a longer name
    assert engine_waiting("") == 0.0


async def test_triton_metrics_are_fetched_once_for_concurrent_scrapes_and_cached(triton: FakeTriton) -> None:
    from frontend.observability.metrics import TritonMetrics

    now = [100.0]
    relay = TritonMetrics(triton.url, timeout_s=5, max_age_s=1.0, clock=lambda: now[0])
    triton.delay_s = 0.3
    ticks = 0

    async def ticker() -> None:  # runs all along: the fetch never blocks the event loop
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    beat = asyncio.create_task(ticker())
    try:
        texts = await asyncio.gather(*(relay.text() for _ in range(20)))
    finally:
        beat.cancel()
    assert triton.hits == 1 and relay.fetches == 1
    assert ticks >= 10, ticks
    assert texts == [TRITON_TEXT.encode()] * 20
    assert relay.engine_waiting == 6.5
    triton.delay_s = 0.0
    now[0] += 0.9  # younger than max_age_s: the cached text
    assert await relay.text() == TRITON_TEXT.encode() and triton.hits == 1
    now[0] += 0.2  # older: fetched again, once
    await asyncio.gather(relay.text(), relay.text())
    assert triton.hits == 2


async def test_a_scraper_that_goes_away_does_not_cancel_the_fetch(triton: FakeTriton) -> None:
    from frontend.observability.metrics import TritonMetrics

    relay = TritonMetrics(triton.url, timeout_s=5, max_age_s=10)
    triton.delay_s = 0.2
    first = asyncio.create_task(relay.text())
    await asyncio.sleep(0.05)
    second = asyncio.create_task(relay.text())
    await asyncio.sleep(0)
    first.cancel()
    assert await second == TRITON_TEXT.encode()
    assert triton.hits == 1


async def test_triton_unavailable_is_a_comment_and_is_cached_too() -> None:
    from frontend.observability.metrics import TritonMetrics

    server = FakeTriton()  # bound, then closed: nothing listens on its port
    url = server.url
    server.server_close()
    relay = TritonMetrics(url, timeout_s=2, max_age_s=60)
    text = await relay.text()
    assert re.fullmatch(rb"# Triton's metrics at \S+ are unavailable: \w+\n", text), text
    assert await relay.text() == text and relay.fetches == 1
    assert relay.engine_waiting == 0.0
    assert await TritonMetrics(None, timeout_s=2, max_age_s=1).text() == b""


async def test_metrics_page_counts_the_frontends_queue_and_the_engines_as_waiting(triton: FakeTriton) -> None:
    from frontend.observability.metrics import exposition
    from frontend.http.middleware import Edge
    from frontend.settings import Settings

    edge = Edge(Settings(triton_metrics_url=triton.url, triton_metrics_cache_s=5, max_in_flight=1))
    await edge.limits.gate.acquire(5, 1)
    waiters = [asyncio.create_task(edge.limits.gate.acquire(5, 1)) for _ in range(2)]
    await asyncio.sleep(0.01)
    try:
        text = (await exposition(edge.metrics, edge.triton_metrics, await edge.limits.occupancy())).decode()
    finally:
        for waiter in waiters:
            waiter.cancel()
    assert re.search(r"^tritonllm_requests_queued 2\.0$", text, re.M)
    assert re.search(r"^tritonllm_requests_waiting 8\.5$", text, re.M)  # 2 here + 6.5 in the engine
    assert text.index("tritonllm_requests_waiting") < text.index("nv_trt_llm_request_metrics")
    assert text.endswith(TRITON_TEXT)


def test_token_timing_counts_what_observe_would_have(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inter-token latencies are counted locally and added to the histogram in bulk (every ITL_FLUSH_TOKENS
    tokens and at close): the histogram then holds exactly what one observe() per token gives, and the bulk
    add uses prometheus-client's private fields, which this catches if an upgrade renames them."""
    from prometheus_client import CollectorRegistry, Histogram

    from frontend.observability import metrics as frontend_metrics

    clock = iter(np.cumsum([0.5, 0.2, 0.001, 0.0025, 0.003, 7.0] + [0.004] * 200 + [0.02, 0.1]).tolist())
    monkeypatch.setattr(frontend_metrics.time, "monotonic", lambda: next(clock))
    server_metrics = frontend_metrics.Metrics()
    first: list[float] = []
    timing = frontend_metrics.TokenTiming(0.0, server_metrics, "/v1/chat/completions", "demo", first.append)
    expected = Histogram("expected", "", buckets=frontend_metrics.TOKEN_BUCKETS, registry=CollectorRegistry())
    for count in [1, 1, 1, 2, 1, 3] + [1] * 200 + [2, 1]:
        before = timing._last
        timing.tokens(count)
        if before is not None:
            for _ in range(count):
                expected.observe((timing._last - before) / count)
    assert first == [pytest.approx(0.5)]
    flushed = {s.labels.get("le"): s.value for s in server_metrics.itl.collect()[0].samples
               if s.name.endswith("_bucket")}
    assert sum(flushed.values()) > 0  # 200 tokens: flushed at 64, 128 and 192 before the end
    timing.close()
    timing.close()  # nothing pending: a no-op

    def samples(histogram: Histogram) -> dict[tuple[str, str | None], float]:
        return {(s.name.rsplit("_", 1)[-1], s.labels.get("le")): s.value for s in histogram.collect()[0].samples
                if not s.name.endswith("_created")}

    got, want = samples(server_metrics.itl), samples(expected)
    assert got.keys() == want.keys()
    assert all(got[key] == pytest.approx(want[key]) for key in want), (got, want)


def test_token_timing_observes_under_its_route_and_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """TTFT and inter-token latency are labelled with the served model: two models' streams land in two
    series, each with its own latencies; the labelled child is looked up once per stream, not per flush."""
    from frontend.observability import metrics as frontend_metrics

    now = [0.0]
    monkeypatch.setattr(frontend_metrics.time, "monotonic", lambda: now[0])
    server_metrics = frontend_metrics.Metrics()
    lookups: list[tuple[str, ...]] = []
    real_labels = server_metrics.itl.labels
    monkeypatch.setattr(server_metrics.itl, "labels", lambda *names: lookups.append(names) or real_labels(*names))
    for model, ttft, step in (("fast", 0.02, 0.002), ("slow", 3.0, 0.2)):
        now[0] = 0.0
        timing = frontend_metrics.TokenTiming(0.0, server_metrics, "/v1/chat/completions", model)
        now[0] = ttft
        timing.tokens(1)
        for _ in range(2 * frontend_metrics.ITL_FLUSH_TOKENS + 1):  # two flushes on the way, one at close
            now[0] += step
            timing.tokens(1)
        timing.close()
    assert lookups == [("/v1/chat/completions", "fast"), ("/v1/chat/completions", "slow")]

    def series(histogram: Any) -> dict[tuple[str, str], tuple[float, float]]:
        """(route, model) -> (count, sum)"""
        samples = histogram.collect()[0].samples
        return {(s.labels["route"], s.labels["model"]): (
            next(c.value for c in samples if c.name.endswith("_count") and c.labels == s.labels), s.value)
            for s in samples if s.name.endswith("_sum")}

    assert series(server_metrics.ttft) == {("/v1/chat/completions", "fast"): (1, pytest.approx(0.02)),
                                           ("/v1/chat/completions", "slow"): (1, pytest.approx(3.0))}
    tokens = 2 * frontend_metrics.ITL_FLUSH_TOKENS + 1
    assert series(server_metrics.itl) == {("/v1/chat/completions", "fast"): (tokens, pytest.approx(tokens * 0.002)),
                                          ("/v1/chat/completions", "slow"): (tokens, pytest.approx(tokens * 0.2))}
    from prometheus_client.parser import text_string_to_metric_families

    buckets = {(s.labels["model"], s.labels["le"]): s.value
               for family in text_string_to_metric_families(server_metrics.render().decode())
               for s in family.samples if s.name == "tritonllm_time_to_first_token_seconds_bucket"}
    assert buckets[("fast", "0.025")] == 1 and buckets[("slow", "0.025")] == 0 and buckets[("slow", "5.0")] == 1
