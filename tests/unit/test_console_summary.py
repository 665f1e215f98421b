"""The console's chart data (frontend/observability/console.py) from exposition texts with hand-computed answers,
and from a real Metrics registry; the page's security headers and the CONSOLE switch (frontend/http/console.py)."""

from __future__ import annotations


import pytest

from frontend.observability.console import ConsoleSummary, quantile, snapshot
from frontend.observability.metrics import Metrics

TEXT = """\
# TYPE tritonllm_completion_tokens counter
tritonllm_completion_tokens_total{{route="/v1/chat/completions",model="a",version=""}} {a}
tritonllm_completion_tokens_total{{route="/v1/completions",model="a",version=""}} {a}
tritonllm_completion_tokens_total{{route="/v1/chat/completions",model="b",version="2"}} {b}
# TYPE tritonllm_time_to_first_token_seconds histogram
tritonllm_time_to_first_token_seconds_bucket{{route="/v1/chat/completions",le="0.1"}} {fast}
tritonllm_time_to_first_token_seconds_bucket{{route="/v1/chat/completions",le="1.0"}} {all}
tritonllm_time_to_first_token_seconds_bucket{{route="/v1/chat/completions",le="+Inf"}} {all}
tritonllm_time_to_first_token_seconds_count{{route="/v1/chat/completions"}} {all}
tritonllm_time_to_first_token_seconds_sum{{route="/v1/chat/completions"}} 1.0
# TYPE tritonllm_requests_in_flight gauge
tritonllm_requests_in_flight {flight}
# TYPE tritonllm_requests_waiting gauge
tritonllm_requests_waiting 3
# TYPE cpu_engine_kv_cache_usage_ratio gauge
cpu_engine_kv_cache_usage_ratio{{model="tensorrt_llm",version="1"}} 0.25
"""


def text(a: float, b: float, fast: int, all: int, flight: int) -> bytes:
    return TEXT.format(a=a, b=b, fast=fast, all=all, flight=flight).encode()


def test_rates_gauges_and_quantiles_between_snapshots() -> None:
    now = [1000.0]
    console = ConsoleSummary(min_spacing_s=1.0, quantile_window_s=30.0, clock=lambda: now[0])
    console.add(text(0, 0, 0, 0, 0))
    assert not console.wants_sample()
    now[0] += 2.0
    assert console.wants_sample()
    console.add(text(10, 4, 2, 4, 5))  # a: 20 tokens (two routes), b: 4 in 2 s; 4 TTFTs, 2 under 0.1 s
    s = console.summary()
    assert s["t"] == [1002.0]
    assert s["tokens_per_s"] == {"a": [10.0], "b": [2.0]}
    assert s["in_flight"] == [5] and s["waiting"] == [3] and s["queued"] == [0]
    assert s["kv_cache_usage"] == {"tensorrt_llm v1": [0.25]}
    assert s["ttft_s"]["p50"] == [pytest.approx(0.1)]  # rank 2 of 4: the top of the first bucket
    assert s["ttft_s"]["p95"] == [pytest.approx(0.1 + 0.9 * (3.8 - 2) / 2)]
    assert s["itl_s"]["p50"] == [None]  # no inter-token latency observed


TWO_MODELS = """\
# TYPE tritonllm_time_to_first_token_seconds histogram
tritonllm_time_to_first_token_seconds_bucket{{route="/v1/chat/completions",model="fast",le="0.1"}} {fast}
tritonllm_time_to_first_token_seconds_bucket{{route="/v1/chat/completions",model="fast",le="1.0"}} {fast}
tritonllm_time_to_first_token_seconds_bucket{{route="/v1/chat/completions",model="fast",le="+Inf"}} {fast}
tritonllm_time_to_first_token_seconds_bucket{{route="/v1/completions",model="fast",le="0.1"}} {fast}
tritonllm_time_to_first_token_seconds_bucket{{route="/v1/completions",model="fast",le="1.0"}} {fast}
tritonllm_time_to_first_token_seconds_bucket{{route="/v1/completions",model="fast",le="+Inf"}} {fast}
tritonllm_time_to_first_token_seconds_bucket{{route="/v1/chat/completions",model="slow",le="0.1"}} 0
tritonllm_time_to_first_token_seconds_bucket{{route="/v1/chat/completions",model="slow",le="1.0"}} {slow}
tritonllm_time_to_first_token_seconds_bucket{{route="/v1/chat/completions",model="slow",le="+Inf"}} {slow}
# TYPE tritonllm_inter_token_latency_seconds histogram
tritonllm_inter_token_latency_seconds_bucket{{route="/v1/chat/completions",model="slow",le="0.01"}} 0
tritonllm_inter_token_latency_seconds_bucket{{route="/v1/chat/completions",model="slow",le="0.1"}} {slow}
tritonllm_inter_token_latency_seconds_bucket{{route="/v1/chat/completions",model="slow",le="+Inf"}} {slow}
"""


def test_each_model_has_its_own_latency_percentiles_and_the_server_wide_ones_take_both() -> None:
    now = [0.0]
    console = ConsoleSummary(clock=lambda: now[0])
    console.add(TWO_MODELS.format(fast=0, slow=0).encode())
    now[0] += 1.0
    console.add(TWO_MODELS.format(fast=2, slow=4).encode())  # fast: 4 TTFTs <= 0.1 s (two routes); slow: 4 in 0.1..1
    s = console.summary()
    assert sorted(s["ttft_s_by_model"]) == ["fast", "slow"] and list(s["itl_s_by_model"]) == ["slow"]
    by_model = s["ttft_s_by_model"]
    assert by_model["fast"]["p50"] == [pytest.approx(0.05)]  # rank 2 of 4 in 0..0.1
    assert by_model["slow"]["p50"] == [pytest.approx(0.1 + 0.9 * 2 / 4)]  # rank 2 of 4 in 0.1..1
    assert by_model["fast"]["p99"] == [pytest.approx(0.099)] and by_model["slow"]["p99"] == [pytest.approx(0.991)]
    # the server's: the 8 together (rank 4 of 8 is the top of the first bucket; rank 7.6 the slow model's)
    assert s["ttft_s"]["p50"] == [pytest.approx(0.1)]
    assert s["ttft_s"]["p95"] == [pytest.approx(0.1 + 0.9 * (7.6 - 4) / 4)]
    assert s["itl_s"]["p50"] == s["itl_s_by_model"]["slow"]["p50"] == [pytest.approx(0.01 + 0.09 * 2 / 4)]
    now[0] += 1.0
    console.add(TWO_MODELS.format(fast=2, slow=4).encode())  # one point per snapshot, as every series
    s = console.summary()
    assert len(s["t"]) == len(s["ttft_s_by_model"]["fast"]["p95"]) == len(s["itl_s_by_model"]["slow"]["p99"]) == 2


def test_a_model_that_appears_later_has_no_value_before() -> None:
    now = [0.0]
    console = ConsoleSummary(clock=lambda: now[0])
    console.add(b"")
    now[0] += 1.0
    console.add(b"")
    now[0] += 1.0
    console.add(TWO_MODELS.format(fast=1, slow=0).encode())
    s = console.summary()
    assert s["ttft_s_by_model"]["fast"]["p50"][0] is None and s["ttft_s_by_model"]["fast"]["p50"][1] is not None
    assert s["ttft_s_by_model"]["slow"]["p50"] == [None, None]  # buckets without observations


def test_old_snapshots_leave_the_window() -> None:
    now = [0.0]
    console = ConsoleSummary(window_s=10.0, clock=lambda: now[0])
    for step in range(20):
        console.add(text(step, 0, 0, 0, 0))
        now[0] += 1.0
    assert len(console.snapshots) == 11
    assert console.summary()["tokens_per_s"]["a"] == [2.0] * 10


def test_quantile_past_the_last_bound_and_without_observations() -> None:
    assert quantile(0.5, {1.0: 0, float("inf"): 4}, {}) == 1.0  # the last finite bound, as Prometheus
    assert quantile(0.5, {1.0: 2, float("inf"): 2}, {1.0: 2, float("inf"): 2}) is None


def test_a_real_registry_is_read() -> None:
    metrics = Metrics()
    metrics.completion_tokens.labels("/v1/chat/completions", "demo", "").inc(7)
    metrics.ttft.labels("/v1/chat/completions", "demo").observe(0.03)
    metrics.ttft.labels("/v1/completions", "other").observe(2.0)
    metrics.live.in_flight = 2
    snap = snapshot(metrics.render().decode(), 0.0)
    assert snap.tokens == {"demo": 7.0} and snap.in_flight == 2
    assert snap.ttft[0.05] == 1 and snap.ttft[0.025] == 0 and snap.ttft[2.5] == 2
    assert snap.ttft_by_model["demo"][0.05] == 1 and snap.ttft_by_model["demo"][2.5] == 1
    assert snap.ttft_by_model["other"][0.05] == 0 and snap.ttft_by_model["other"][2.5] == 1


def test_the_page_headers_and_the_switch() -> None:
    from fastapi.testclient import TestClient

    from frontend.http.app import create_app
    from frontend.http.console import CONTENT_SECURITY_POLICY
    from frontend.settings import Settings

    app = create_app(Settings(api_keys="secret-key"))
    client = TestClient(app)  # no lifespan: the page and its files need no engine
    page = client.get("/")
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "<script>" not in page.text and "onclick" not in page.text  # nothing inline
    script = client.get("/console/static/console.js")
    assert script.status_code == 200 and script.headers["x-content-type-options"] == "nosniff"
    assert "innerHTML" not in script.text and "localStorage" not in script.text
    for escape in ("/console/static/../../settings.py", "/console/static/..%2f..%2fsettings.py"):
        assert client.get(escape).status_code in (401, 404)  # nothing outside the static folder
    assert client.get("/v1/models").status_code == 401  # the API still wants its key
    off = TestClient(create_app(Settings(console=False)))
    assert off.get("/").status_code == 404 and off.get("/console/static/console.js").status_code == 404
