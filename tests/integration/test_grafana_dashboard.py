"""The Grafana dashboard (deploy/monitoring/grafana/dashboards/tritonllm.json) queries only series the stack
exports: every metric name in its PromQL (panels and template variables) is in the real frontend's /metrics or
the real Triton's metrics port (CPU engine), after some traffic, and every label its queries select, group by or
list values of is on that metric's samples. The TensorRT-LLM backend's own families cannot appear on the CPU
engine: they are listed here, and only they are let through."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import REPO_ROOT, Stack

MONITORING = REPO_ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "tritonllm.json"
METRIC = re.compile(r"\b((?:tritonllm|nv|cpu_engine)_[a-zA-Z0-9_:]+)")
SELECTOR = re.compile(r"\b((?:tritonllm|nv|cpu_engine)_[a-zA-Z0-9_:]+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)")
TARGET_LABELS = {"job", "instance"}  # Prometheus adds them when it scrapes
# The TensorRT-LLM backend's families (Triton's TensorRT-LLM metrics); frontend/observability/metrics.py reads
# nv_trt_llm_request_metrics too. Never exported by the CPU engine this test runs.
TRTLLM_ONLY = {"nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_request_metrics"}


def dashboard_metrics(path: Path) -> set[str]:
    names: set[str] = set()
    for panel in json.loads(path.read_text())["panels"]:
        for target in panel["targets"]:
            found = set(METRIC.findall(target["expr"]))
            assert found, f"panel {panel['title']!r}: a query with no metric of ours: {target['expr']}"
            names |= found
    for variable in json.loads(path.read_text())["templating"]["list"]:
        names |= set(METRIC.findall(variable_query(variable)))
    return names


def variable_query(variable: dict[str, Any]) -> str:
    query = variable.get("query", "")
    return query.get("query", "") if isinstance(query, dict) else str(query) if variable["type"] == "query" else ""


def dashboard_labels(path: Path) -> dict[str, set[str]]:
    """metric -> the labels the dashboard's queries select on, group by or list the values of (not the target
    labels Prometheus adds). A `by (...)` is taken as every metric's of its query."""
    dashboard = json.loads(path.read_text())
    wanted: dict[str, set[str]] = {}
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for expr in queries:
        grouped = {label.strip() for group in GROUPING.findall(expr) for label in group.split(",") if label.strip()}
        for metric, matchers in SELECTOR.findall(expr):
            wanted.setdefault(metric, set()).update(grouped - {"le"}, MATCHER.findall(matchers))
    for variable in dashboard["templating"]["list"]:
        for metric, label in LABEL_VALUES.findall(variable_query(variable)):
            wanted.setdefault(metric, set()).add(label)
    return {metric: labels - TARGET_LABELS for metric, labels in wanted.items()}


def exported(text: str) -> set[str]:
    """Every sample name, and every family's (a labelled counter with no child yet has no sample: its family
    `x` is exported as `x_total` once counted)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names |= {sample.name for sample in family.samples} | {family.name}
        if family.type == "counter":
            names.add(family.name + "_total")
    return names


def exported_labels(text: str) -> dict[str, dict[str, set[str]]]:
    """sample name -> label -> the values seen"""
    labels: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for label, value in sample.labels.items():
                labels.setdefault(sample.name, {}).setdefault(label, set()).add(value)
    return labels


def test_every_dashboard_metric_is_exported_by_the_stack(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    for stream in (False, True):  # every histogram of the frontend observed at least once
        response = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=4, stream=stream)
        if stream:
            list(response)
    names = dashboard_metrics(DASHBOARD)
    texts = [httpx.get(f"{stack.root_url}/metrics", timeout=30).text, httpx.get(stack.triton_metrics_url, timeout=30).text]
    available = exported(texts[0]) | exported(texts[1])
    missing = sorted(names - available - TRTLLM_ONLY)
    assert not missing, f"the dashboard queries series the stack does not export: {missing}"
    assert TRTLLM_ONLY <= names  # the exemptions are the dashboard's, not stale
    assert {"tritonllm_completion_tokens_total", "cpu_engine_kv_cache_usage_ratio", "nv_inference_request_success"} <= names
    # The labels: checked on every metric with samples (a labelled counter never counted yet has none to show).
    labels = exported_labels(texts[0]) | exported_labels(texts[1])
    wanted = dashboard_labels(DASHBOARD)
    unknown = sorted((metric, label) for metric, want in wanted.items() if metric in labels
                     for label in want if label not in labels[metric])
    assert not unknown, f"the dashboard queries labels the stack's series do not have: {unknown}"
    per_model = ("tritonllm_time_to_first_token_seconds_bucket", "tritonllm_inter_token_latency_seconds_bucket")
    for metric in per_model:  # the latency panels and the Model variable: per served model
        assert "model" in wanted[metric] and stack.model in labels[metric]["model"], (metric, labels.get(metric))


def test_the_provisioning_and_the_scrape_config_name_the_stack() -> None:
    prometheus = yaml.safe_load((MONITORING / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert targets == {"frontend:9000", "triton:8002"}
    provider = yaml.safe_load((MONITORING / "grafana" / "provisioning" / "dashboards" / "tritonllm.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    compose = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())
    for service in ("prometheus", "grafana"):
        assert compose["services"][service]["profiles"] == ["monitoring"]
        image = compose["services"][service]["image"]
        assert re.fullmatch(r"[a-z/]+:v?\d+\.\d+\.\d+", image), f"{service}: pin the image ({image})"
