"""benchmarks/external_bench.py: the parsers of AIPerf's and GuideLLM's JSON exports, on exports recorded from
`make bench-aiperf QUICK=1` / `make bench-guidellm QUICK=1` (trimmed to the fields read), and the commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import external_bench as eb
from benchmarks.report import results_table
from benchmarks.workload import QUICK

DATA = Path(__file__).parent / "data" / "external_bench"


def test_aiperf_export() -> None:
    row = eb.parse_aiperf_export(DATA / "aiperf_profile_export.json", concurrency=1)
    assert row["concurrency"] == 1
    assert row["requests"] == 4 and row["errors"] == 0
    assert row["output_tokens_per_request"] == 8.0
    assert row["output_tokens"] == 32 and row["input_tokens"] == 4 * 42
    assert row["duration_s"] == pytest.approx(3.148817408)
    assert row["output_tok_per_s"] == pytest.approx(10.146189954319535)
    assert row["req_per_s"] == pytest.approx(1.2682737442899419)  # AIPerf's own request_throughput
    assert row["ttft_ms"]["p50"] == pytest.approx(293.035153)
    assert row["ttft_ms"]["p99"] == pytest.approx(373.16676797)
    assert row["ttft_ms"]["mean"] == pytest.approx(287.88820949999996)
    assert 60 < row["itl_ms"]["p50"] < 80
    assert row["e2e_ms"]["p50"] > row["ttft_ms"]["p50"]
    assert "| aiperf | 1 | 4 | 0 | 10.1 | 1.27 | 293 / " in results_table([{"target": "aiperf", **row}])


def test_aiperf_units_and_nesting() -> None:
    """A latency in another unit is converted to ms; metrics under `records` (older exports) are found."""
    export = {"records": {"time_to_first_token": {"unit": "ns", "avg": 2e6, "p50": 1e6, "p90": 3e6, "p99": 4e6},
                          "request_count": {"unit": "requests", "avg": 2},
                          "benchmark_duration": {"unit": "sec", "avg": 1.5}}}
    row = eb.parse_aiperf_export(export, concurrency=4)
    assert row["ttft_ms"] == {"p50": 1.0, "p90": 3.0, "p99": 4.0, "mean": 2.0}
    assert row["requests"] == 2 and row["duration_s"] == 1.5
    assert row["itl_ms"] == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_guidellm_export() -> None:
    rows = eb.parse_guidellm_export(DATA / "guidellm_benchmarks.json")
    assert len(rows) == 1
    row = rows[0]
    raw = json.loads((DATA / "guidellm_benchmarks.json").read_text())["benchmarks"][0]
    assert row["concurrency"] == 4  # from the strategy's streams
    assert row["requests"] == 5 and row["errors"] == 0
    assert row["output_tokens"] == 40 and row["output_tokens_per_request"] == 8.0
    assert row["duration_s"] == pytest.approx(raw["duration"])
    assert row["output_tok_per_s"] == pytest.approx(40 / raw["duration"])  # totals over the duration
    assert row["req_per_s"] == pytest.approx(5 / raw["duration"])
    ttft = raw["metrics"]["time_to_first_token_ms"]["successful"]
    assert row["ttft_ms"]["p50"] == pytest.approx(ttft["percentiles"]["p50"])
    assert row["ttft_ms"]["mean"] == pytest.approx(ttft["mean"])
    itl = raw["metrics"]["inter_token_latency_ms"]["successful"]["percentiles"]
    assert row["itl_ms"]["p90"] == pytest.approx(itl["p90"])  # ITL, not TPOT (which includes the TTFT)
    latency = raw["metrics"]["request_latency"]["successful"]["percentiles"]
    assert row["e2e_ms"]["p99"] == pytest.approx(latency["p99"] * 1000)  # seconds -> ms


def test_guidellm_concurrency_override_and_empty() -> None:
    assert eb.parse_guidellm_export(DATA / "guidellm_benchmarks.json", concurrency=16)[0]["concurrency"] == 16
    assert eb.parse_guidellm_export({"benchmarks": []}) == []


def test_commands(tmp_path: Path) -> None:
    tok, prompts = tmp_path / "tok", tmp_path / "p.jsonl"
    aiperf = eb.aiperf_command("aiperf", "http://127.0.0.1:9000/v1", "demo-small", tok, prompts, QUICK, 4, 5,
                               tmp_path / "c4")
    assert aiperf[:2] == ["aiperf", "profile"]
    joined = " ".join(aiperf)
    assert "--url http://127.0.0.1:9000 " in joined and "--concurrency 4" in joined and "--request-count 5" in joined
    assert "--osl 8" in joined and "min_tokens:8" in joined and "--use-server-token-count" in joined
    assert "--streaming" in aiperf and "--warmup-request-count" not in aiperf

    guidellm = eb.guidellm_command("guidellm", "http://127.0.0.1:9000/v1", "demo-small", tok, prompts, QUICK, 16,
                                   16, tmp_path / "c16")
    options = dict(zip(guidellm[2::2], guidellm[3::2]))
    assert guidellm[:2] == ["guidellm", "run"]
    assert json.loads(options["--profile"]) == {"kind": "concurrent", "streams": [16]}
    assert json.loads(options["--constraint"]) == {"kind": "max_requests", "count": 16}
    backend = json.loads(options["--backend"])
    assert backend["target"] == "http://127.0.0.1:9000" and backend["extras"]["body"]["min_tokens"] == 8
    assert json.loads(options["--output"])["path"].endswith("c16/benchmarks.json")


def test_prompts_file(tmp_path: Path) -> None:
    path = eb.write_prompts(["one", "two"], 8, tmp_path / "p.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"text": "one", "output_length": 8, "output_tokens_count": 8},
                     {"text": "two", "output_length": 8, "output_tokens_count": 8}]


def test_tool_env_offline(tmp_path: Path) -> None:
    assert eb.tool_env("guidellm", tmp_path)["HF_HUB_OFFLINE"] == "1"
    assert "HF_HUB_OFFLINE" not in eb.tool_env("aiperf", tmp_path)  # 0.13.0 fails on a local path with it set
    assert eb.tool_env("aiperf", tmp_path)["HF_HOME"] == str(tmp_path / "hf-home")


def test_bench_report_merge(tmp_path: Path) -> None:
    """The tool's rows join `make bench`'s report (a rerun replaces them), and loadgen's rows are read back."""
    row = {"concurrency": 1, "requests": 4, "errors": 0, "output_tok_per_s": 10.0, "req_per_s": 1.0,
           "ttft_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0}, "itl_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0},
           "e2e_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0}, "output_tokens_per_request": 8.0}
    bench = {"title": "Stack benchmark (quick)", "workload": {"name": "quick"}, "notes": ["n"],
             "results": [{"target": "frontend", **row}, {"target": "triton", **row}],
             "ratios": [{"of": "frontend/triton", "concurrency": 1}]}
    (tmp_path / "results.json").write_text(json.dumps(bench))
    assert [r["target"] for r in eb.loadgen_rows(tmp_path)] == ["loadgen"]
    for _ in range(2):
        assert eb.add_to_bench_report(tmp_path, "aiperf", [{"target": "aiperf", **row, "output_tok_per_s": 5.0}],
                                      "`aiperf` = ...", plots=False)
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["target"] for r in data["results"]] == ["frontend", "triton", "aiperf"]
    assert [r["of"] for r in data["ratios"]] == ["frontend/triton", "aiperf/frontend"]
    eb.add_to_bench_report(tmp_path, "guidellm", [{"target": "guidellm", **row}], "`guidellm` = ...", plots=False)
    ratios = [r["of"] for r in json.loads((tmp_path / "results.json").read_text())["ratios"]]
    assert ratios == ["frontend/triton", "aiperf/frontend", "guidellm/frontend"]  # each pair once
    assert data["notes"] == ["n", "`aiperf` = ..."]
    assert "| aiperf | 1 |" in (tmp_path / "summary.md").read_text()
    assert not eb.add_to_bench_report(tmp_path / "none", "aiperf", [], "", plots=False)
