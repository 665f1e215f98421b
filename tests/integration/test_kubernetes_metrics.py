"""The metrics deploy/kubernetes scales and routes on exist, under those names, on a running CPU stack.

The names are read from the rendered CPU overlay (the endpoint picker's engine config for its pods, the
HPA's metrics through the prometheus-adapter rules), not restated here: a manifest naming a metric that
the stack does not export fails this test. The endpoint picker scrapes Triton's metrics port, so its names
must be there; the autoscaler's series may come from either /metrics (the PodMonitor scrapes both).
The GPU overlays' nv_trt_llm_* names need TensorRT-LLM and cannot be scraped here;
tests/unit/test_kubernetes_manifests.py checks they are the extension's protocol names.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.integration.conftest import Stack
from tests.unit.test_kubernetes_manifests import autoscaler_metrics, picker_metrics, render

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
def scrapes(stack: Stack) -> dict[str, str]:
    return {"triton": httpx.get(stack.triton_metrics_url, timeout=10).text,
            "frontend": httpx.get(f"{stack.root_url}/metrics", timeout=10).text}


def test_endpoint_picker_metrics_are_on_tritons_metrics_port(scrapes: dict[str, str]) -> None:
    wanted = picker_metrics(render("cpu"))
    assert {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"} <= wanted.keys()
    for field, (name, labels) in wanted.items():
        values = series(scrapes["triton"], name, labels)
        assert len(values) == 1, f"{field}: {name}{labels} on Triton's metrics port: {values}"
        # The model-server protocol asks for gauges (current values, not counters).
        assert metric_type(scrapes["triton"], name) == "gauge", name
    name, labels = wanted["kvUsageSpec"]
    assert 0.0 <= series(scrapes["triton"], name, labels)[0] <= 1.0, "KV-cache use is a fraction"


def test_autoscaler_metrics_are_exported(scrapes: dict[str, str]) -> None:
    wanted = autoscaler_metrics(render("cpu"))
    for custom_name, (name, labels) in wanted.items():
        found = {where: series(text, name, labels) for where, text in scrapes.items()}
        assert any(found.values()), f"the HPA's {custom_name} comes from {name}{labels}, exported by neither"
        assert all(metric_type(scrapes[where], name) == "gauge" for where, values in found.items() if values)
    # The frontend's admission queue is the frontend's own metric.
    assert len(series(scrapes["frontend"], "tritonllm_requests_queued", {})) == 1
