"""The metrics deploy/kubernetes scales and routes on exist, under those names, on a running CPU stack's
frontend /metrics.

In a pod, Triton listens on 127.0.0.1 only and the frontend's GET /metrics (port 9000) is what the endpoint
picker and Prometheus scrape: with TRITON_METRICS_URL set, as the manifests and `make serve` set it, it
serves the frontend's own metrics followed by Triton's. The session stack's frontend runs without that
setting, so this module starts a second frontend in front of the same Triton, with TRITON_METRICS_URL = the
stack's Triton metrics URL, and scrapes that frontend only.

The names are read from the rendered CPU overlay (the endpoint picker's engine config for its pods, the
HPA's metrics through the prometheus-adapter rules), not restated here: a manifest naming a metric that the
frontend's /metrics does not carry fails this test. The GPU overlays' nv_trt_llm_* names need TensorRT-LLM
and cannot be scraped here; tests/unit/test_kubernetes_manifests.py checks they are the extension's
protocol names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from benchmarks.servers import stop_process, wait_http_ok
from launcher.ports import find_free_port
from tests.integration.conftest import Stack, start_frontend
from tests.unit.test_kubernetes_manifests import (
    autoscaler_metrics,
    container,
    env_of,
    picker_metrics,
    render,
    server_pod,
)

pytestmark = pytest.mark.integration


def series(text: str, name: str, labels: dict[str, str]) -> list[float]:
    """Values of the samples of `name` whose labels include `labels`."""
    values = []
    for match in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        sample_labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if labels.items() <= sample_labels.items():
            values.append(float(match.group(2)))
    return values


def metric_type(text: str, name: str) -> str | None:
    match = re.search(rf"^# TYPE {re.escape(name)} (\w+)$", text, re.M)
    return match.group(1) if match else None


@pytest.fixture(scope="module")
def pod_frontend(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A frontend configured as the pod's: TRITON_METRICS_URL pointing at Triton's metrics on loopback."""
    # The manifests give the frontend the pod's Triton metrics URL; here the same setting, on the stack's port.
    pod_url = env_of(container(server_pod(render("cpu")), "frontend"))["TRITON_METRICS_URL"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", pod_url), pod_url
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", stack.triton_metrics_url), stack.triton_metrics_url
    port = find_free_port()
    process = start_frontend(stack.triton_grpc_url, port, tmp_path_factory.mktemp("k8s_metrics") / "frontend.log",
                             TRITON_METRICS_URL=stack.triton_metrics_url)
    try:
        root = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{root}/health/ready", 120, process)
        yield root
    finally:
        stop_process(process)


@pytest.fixture(scope="module")
def scrape(pod_frontend: str) -> str:
    """The frontend's GET /metrics: what the endpoint picker and the PodMonitor read from a pod."""
    response = httpx.get(f"{pod_frontend}/metrics", timeout=10)
    response.raise_for_status()
    assert "are unavailable" not in response.text, "the frontend could not fetch Triton's metrics"
    return response.text


def test_frontend_metrics_carry_tritons(scrape: str, stack: Stack) -> None:
    # Its own and Triton's, each family once (the two sets share no name).
    assert len(series(scrape, "tritonllm_requests_queued", {})) == 1
    assert series(scrape, "nv_inference_request_success", {"model": "tensorrt_llm"}), "Triton's metrics missing"
    families = re.findall(r"^# TYPE (\S+) ", scrape, re.M)
    assert len(families) == len(set(families)), "a metric family appears twice"
    # Without TRITON_METRICS_URL (the session stack's frontend) only the frontend's own are there.
    plain = httpx.get(f"{stack.root_url}/metrics", timeout=10).text
    assert not series(plain, "nv_inference_request_success", {})


def test_endpoint_picker_metrics_are_on_the_frontends_metrics(scrape: str) -> None:
    wanted = picker_metrics(render("cpu"))
    assert {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"} <= wanted.keys()
    for field, (name, labels) in wanted.items():
        values = series(scrape, name, labels)
        assert len(values) == 1, f"{field}: {name}{labels} on the frontend's /metrics: {values}"
        # The model-server protocol asks for gauges (current values, not counters).
        assert metric_type(scrape, name) == "gauge", name
    name, labels = wanted["kvUsageSpec"]
    assert 0.0 <= series(scrape, name, labels)[0] <= 1.0, "KV-cache use is a fraction"


def test_autoscaler_metrics_are_on_the_frontends_metrics(scrape: str) -> None:
    wanted = autoscaler_metrics(render("cpu"))
    assert "tritonllm_requests_queued" in wanted and len(wanted) == 2
    for custom_name, (name, labels) in wanted.items():
        values = series(scrape, name, labels)
        assert values, f"the HPA's {custom_name} comes from {name}{labels}, not on the frontend's /metrics"
        assert metric_type(scrape, name) == "gauge", name
