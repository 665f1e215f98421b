"""`make bench-aiperf` / `make bench-guidellm`: NVIDIA AIPerf or GuideLLM on `make bench`'s workload.

Starts Triton and the frontend as `make bench` does (benchmarks/servers.py), writes the workload's own prompts
(benchmarks/workload.py: the same seeded texts, exactly `input_tokens` tokens each) to a JSONL file the tool reads,
and runs the tool once per concurrency level: closed loop at that concurrency, the workload's requests per level,
streaming chat completions with exactly `output_tokens` output tokens (max_tokens = min_tokens, ignore_eos), the
workload's warm-up requests (sent by our own client) before the first level. The tool's own JSON export of each
level is parsed (`parse_aiperf_export`, `parse_guidellm_export`) into the figures `make bench` reports (tokens/s,
requests/s, TTFT/ITL/E2E p50/p90/p99), and written in the same report format (benchmarks/report.py) to
benchmarks/results/<date>[-quick]/<tool>/ (the tool's raw artifacts under raw/), next to `make bench`'s. When that
folder already holds `make bench`'s results.json, its `frontend` rows (our load generator, same endpoint) go into
the same tables and plots as `loadgen`, with the ratios <tool>/loadgen, and the tool's rows are added to `make
bench`'s own report (results.json, summary.md, plots) too.

    python -m benchmarks.external_bench --tool aiperf --tool-bin build/aiperf-venv/bin/aiperf \
        --model-repository build/bench/model_repository --work-dir build/bench [--quick]
    python -m benchmarks.external_bench --tool guidellm --url http://127.0.0.1:9000/v1 --quick   # a running stack
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import servers
from benchmarks.loadgen import OpenAITarget, run_workload_level
from benchmarks.report import write_results
from benchmarks.workload import Workload, load_tokenizer, load_workload

TOOLS = ("aiperf", "guidellm")
PCTS = ("p50", "p90", "p99")
# Units a tool may give a latency in, to milliseconds.
_TO_MS = {"ms": 1.0, "millisecond": 1.0, "milliseconds": 1.0, "s": 1e3, "sec": 1e3, "second": 1e3,
          "seconds": 1e3, "us": 1e-3, "µs": 1e-3, "ns": 1e-6, "nanoseconds": 1e-6}


# ----- AIPerf ----------------------------------------------------------------------------------------------
def aiperf_command(tool_bin: str, base_url: str, model: str, tokenizer_dir: Path, prompts_file: Path,
                   workload: Workload, concurrency: int, requests: int, artifact_dir: Path) -> list[str]:
    n = workload.output_tokens
    cmd = [tool_bin, "profile", "-m", model, "--endpoint-type", "chat", "--streaming",
           "--url", base_url.removesuffix("/v1"), "--tokenizer", str(tokenizer_dir),
           "--input-file", str(prompts_file), "--custom-dataset-type", "single_turn",
           "--osl", str(n), "--osl-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{n}",
           "--extra-inputs", "temperature:0", "--use-server-token-count",
           "--concurrency", str(concurrency), "--request-count", str(requests),
           "--random-seed", str(workload.seed), "--ui-type", "none", "--artifact-dir", str(artifact_dir)]
    return cmd


def _aiperf_metric(export: dict[str, Any], name: str) -> dict[str, Any] | None:
    for holder in (export, export.get("records") or {}, export.get("metrics") or {}):
        value = holder.get(name)
        if isinstance(value, dict):
            return value
    return None


def _scaled(metric: dict[str, Any] | None, stat: str, default_unit: str = "ms") -> float | None:
    if not metric or metric.get(stat) is None:
        return None
    return float(metric[stat]) * _TO_MS.get(str(metric.get("unit") or default_unit).lower(), 1.0)


def _latency(metric: dict[str, Any] | None, default_unit: str = "ms") -> dict[str, float | None]:
    out = {p: _scaled(metric, p, default_unit) for p in PCTS}
    out["mean"] = _scaled(metric, "avg", default_unit) if metric and "avg" in metric else _scaled(metric, "mean",
                                                                                                   default_unit)
    return out


def _plain(metric: dict[str, Any] | None, stat: str = "avg") -> float | None:
    return None if not metric or metric.get(stat) is None else float(metric[stat])


def parse_aiperf_export(export: dict[str, Any] | str | Path, concurrency: int | None = None) -> dict[str, Any]:
    """AIPerf's profile_export_aiperf.json (one run, one concurrency) -> one results row (report.py's shape).
    ITL is AIPerf's per-request (E2E - TTFT)/(output tokens - 1), its percentiles over requests."""
    if not isinstance(export, dict):
        export = json.loads(Path(export).read_text())
    requests = _plain(_aiperf_metric(export, "request_count"))
    errors = _plain(_aiperf_metric(export, "error_request_count")) or 0
    osl = _aiperf_metric(export, "output_sequence_length")
    isl = _aiperf_metric(export, "input_sequence_length")
    duration = _scaled(_aiperf_metric(export, "benchmark_duration"), "avg", "sec")
    if concurrency is None:
        loadgen = (export.get("input_config") or {}).get("loadgen") or {}
        concurrency = loadgen.get("concurrency")
    n = int(requests or 0)
    return {
        "concurrency": int(concurrency) if concurrency is not None else None,
        "requests": n,
        "errors": int(errors),
        "duration_s": duration / 1e3 if duration is not None else None,
        "input_tokens": round(_plain(isl) * n) if _plain(isl) is not None else None,
        "output_tokens": round(_plain(osl) * n) if _plain(osl) is not None else None,
        "output_tokens_per_request": _plain(osl),
        "output_tok_per_s": _plain(_aiperf_metric(export, "output_token_throughput")),
        "req_per_s": _plain(_aiperf_metric(export, "request_throughput")),
        "ttft_ms": _latency(_aiperf_metric(export, "time_to_first_token")),
        "itl_ms": _latency(_aiperf_metric(export, "inter_token_latency")),
        "e2e_ms": _latency(_aiperf_metric(export, "request_latency")),
    }


def find_aiperf_export(artifact_dir: Path) -> Path:
    found = sorted(artifact_dir.rglob("profile_export_aiperf.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no profile_export_aiperf.json under {artifact_dir}")
    return found[-1]


# ----- GuideLLM --------------------------------------------------------------------------------------------
def guidellm_command(tool_bin: str, base_url: str, model: str, tokenizer_dir: Path, prompts_file: Path,
                     workload: Workload, concurrency: int, requests: int, artifact_dir: Path) -> list[str]:
    """GuideLLM 0.8's CLI: each option a registry config as JSON ({"kind": ...}). The output length comes from
    the data (`output_tokens_count`: max_completion_tokens + ignore_eos); min_tokens is added to the body."""
    def js(value: dict[str, Any]) -> str:
        return json.dumps(value, separators=(",", ":"))

    backend = {"kind": "openai_http", "target": base_url.removesuffix("/v1"), "model": model,
               "request_format": "/v1/chat/completions", "stream": True,
               "api_routes": {"/health": "health/ready"},  # its start-up check GETs /health, ours is /health/ready
               "extras": {"body": {"min_tokens": workload.output_tokens, "temperature": 0}}}
    profile = {"kind": "concurrent", "streams": [concurrency]}
    return [tool_bin, "run",
            "--backend", js(backend), "--profile", js(profile),
            "--constraint", js({"kind": "max_requests", "count": requests}),
            "--tokenizer", js({"kind": "huggingface_auto", "model": str(tokenizer_dir)}),
            "--data", js({"kind": "json_file", "path": str(prompts_file)}),
            "--seed", js({"kind": "static", "value": workload.seed}),
            "--output", js({"kind": "json", "path": str(artifact_dir / "benchmarks.json")}),
            "--disable-console-interactive"]


def _guidellm_dist(metrics: dict[str, Any], names: tuple[str, ...]) -> tuple[dict[str, Any] | None, str]:
    """(the `successful` distribution, its unit) of the first metric present among `names`."""
    for name in names:
        metric = metrics.get(name)
        if isinstance(metric, dict):
            dist = metric.get("successful", metric)
            unit = "s" if name in ("request_latency", "request_latency_s") else "ms"
            return dist, unit
    return None, "ms"


def _guidellm_latency(metrics: dict[str, Any], *names: str) -> dict[str, float | None]:
    dist, unit = _guidellm_dist(metrics, names)
    scale = _TO_MS[unit]
    if not dist:
        return {**{p: None for p in PCTS}, "mean": None}
    pcts = dist.get("percentiles") or {}
    out = {p: (float(pcts[p]) * scale if pcts.get(p) is not None else None) for p in PCTS}
    out["mean"] = float(dist["mean"]) * scale if dist.get("mean") is not None else None
    return out


def _guidellm_concurrency(benchmark: dict[str, Any]) -> int | None:
    for holder in (benchmark.get("config") or {}, benchmark.get("args") or {}, benchmark):
        strategy = holder.get("strategy") or {}
        for key in ("streams", "concurrency", "max_concurrency"):
            if isinstance(strategy, dict) and strategy.get(key) is not None:
                return int(strategy[key])
    return None


def parse_guidellm_export(export: dict[str, Any] | str | Path, concurrency: int | None = None) -> list[dict[str, Any]]:
    """GuideLLM's benchmarks.json -> one results row per benchmark (one per concurrency)."""
    if not isinstance(export, dict):
        export = json.loads(Path(export).read_text())
    rows = []
    for benchmark in export.get("benchmarks", []):
        metrics = benchmark.get("metrics") or {}
        totals = benchmark.get("request_totals") or {}
        if not totals:
            totals = {k: (metrics.get("request_totals") or {}).get(k) for k in ("successful", "errored")}
        done = int(totals.get("successful") or 0)
        out_dist, _ = _guidellm_dist(metrics, ("output_token_count",))
        in_dist, _ = _guidellm_dist(metrics, ("prompt_token_count",))
        tok_s, _ = _guidellm_dist(metrics, ("output_tokens_per_second",))
        req_s, _ = _guidellm_dist(metrics, ("requests_per_second",))
        duration = benchmark.get("duration")
        if duration is None and benchmark.get("end_time") is not None and benchmark.get("start_time") is not None:
            duration = benchmark["end_time"] - benchmark["start_time"]
        output_tokens = (out_dist or {}).get("total_sum")
        rows.append({
            "concurrency": concurrency if concurrency is not None else _guidellm_concurrency(benchmark),
            "requests": done,
            "errors": int(totals.get("errored") or 0) + int(totals.get("incomplete") or 0),
            "duration_s": duration,
            "input_tokens": (in_dist or {}).get("total_sum"),
            "output_tokens": output_tokens,
            "output_tokens_per_request": (out_dist or {}).get("mean"),
            # GuideLLM's rate means are over time windows; total/duration is make bench's definition.
            "output_tok_per_s": (output_tokens / duration) if output_tokens and duration
            else (tok_s or {}).get("mean"),
            "req_per_s": (done / duration) if done and duration else (req_s or {}).get("mean"),
            "ttft_ms": _guidellm_latency(metrics, "time_to_first_token_ms"),
            "itl_ms": _guidellm_latency(metrics, "inter_token_latency_ms"),
            "e2e_ms": _guidellm_latency(metrics, "request_latency"),
        })
    return rows


def find_guidellm_export(artifact_dir: Path) -> Path:
    found = sorted(artifact_dir.rglob("benchmarks.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no benchmarks.json under {artifact_dir}")
    return found[-1]


COMMANDS = {"aiperf": aiperf_command, "guidellm": guidellm_command}


def parse_level(tool: str, artifact_dir: Path, concurrency: int) -> dict[str, Any]:
    if tool == "aiperf":
        return parse_aiperf_export(find_aiperf_export(artifact_dir), concurrency)
    rows = parse_guidellm_export(find_guidellm_export(artifact_dir), concurrency)
    if not rows:
        raise RuntimeError(f"GuideLLM's export under {artifact_dir} holds no benchmark")
    return rows[-1]


# ----- the run ---------------------------------------------------------------------------------------------
def write_prompts(prompts: list[str], output_tokens: int, path: Path) -> Path:
    """One JSON object per line: AIPerf's `single_turn` custom dataset reads `text` and `output_length`
    (max_tokens); GuideLLM reads the `text` column as the prompt and `output_tokens_count` as the output length.
    Neither reads the other's field."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = ({"text": p, "output_length": output_tokens, "output_tokens_count": output_tokens} for p in prompts)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def tool_env(tool: str, work: Path) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    if tool == "aiperf":
        # AIPerf 0.13.0 sends even a local tokenizer path through snapshot_download when HF_HUB_OFFLINE is set
        # and fails (shared/research/bench_tools.md); without it the local directory loads with no network.
        env.pop("HF_HUB_OFFLINE")
        env.pop("TRANSFORMERS_OFFLINE")
    env["HF_HOME"] = str(work / "hf-home")  # nothing from the user's cache, nothing written there
    return env


def warm_up(base_url: str, model: str, workload: Workload, prompts: list[str]) -> None:
    """`make bench`'s warm-up, from our own client: the workload's warm-up requests at concurrency 1, before the
    first level, not measured. (AIPerf's --warmup-request-count would do the same; GuideLLM 0.8's warm-up phase
    ends when its first request is *sent*, so it excludes nothing in a closed-loop run this short.)"""
    if workload.warmup_requests:
        target = OpenAITarget(base_url, model, workload.output_tokens, label="warm-up")
        asyncio.run(run_workload_level(target, prompts, 1, workload.warmup_requests, progress=False))


def run_tool(tool: str, tool_bin: str, base_url: str, model: str, tokenizer_dir: Path, workload: Workload,
             prompts_file: Path, raw_dir: Path, log: Path, concurrencies: list[int]) -> list[dict[str, Any]]:
    rows = []
    env = tool_env(tool, raw_dir)
    for c in concurrencies:
        n = workload.requests_at(c)
        artifact_dir = raw_dir / f"c{c}"
        shutil.rmtree(artifact_dir, ignore_errors=True)
        cmd = COMMANDS[tool](tool_bin, base_url, model, tokenizer_dir, prompts_file, workload, c, n, artifact_dir)
        print(f"{tool} concurrency {c}: {n} requests", flush=True)
        t0 = time.monotonic()
        with log.open("a") as out:
            out.write(f"$ {subprocess.list2cmdline(cmd)}\n")
            out.flush()
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=raw_dir)
        if done.returncode != 0:
            tail = "\n".join(log.read_text().splitlines()[-25:])
            raise RuntimeError(f"{tool} exited with {done.returncode} at concurrency {c}:\n{tail}")
        row = {"target": tool, **parse_level(tool, artifact_dir, c)}
        print(f"  {time.monotonic() - t0:.0f} s: {row['output_tok_per_s'] or 0:.1f} tok/s, "
              f"TTFT p50 {row['ttft_ms']['p50'] or 0:.0f} ms, ITL p50 {row['itl_ms']['p50'] or 0:.1f} ms", flush=True)
        rows.append(row)
    return rows


def loadgen_rows(bench_dir: Path) -> list[dict[str, Any]]:
    """`make bench`'s frontend rows (our load generator against the same endpoint), relabelled `loadgen`."""
    path = bench_dir / "results.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    return [{**r, "target": "loadgen"} for r in data.get("results", []) if r.get("target") == "frontend"]


def add_to_bench_report(bench_dir: Path, tool: str, rows: list[dict[str, Any]], note: str, plots: bool) -> bool:
    """Put the tool's rows into `make bench`'s own report (replacing an earlier run's), ratio <tool>/frontend."""
    path = bench_dir / "results.json"
    if not path.is_file():
        return False
    data = json.loads(path.read_text())
    results = [r for r in data.pop("results", []) if r.get("target") != tool] + rows
    old_ratios = data.pop("ratios", [])
    pairs = list(dict.fromkeys(tuple(r["of"].split("/", 1)) for r in old_ratios
                               if r["of"].split("/", 1)[0] not in TOOLS))
    for other in TOOLS:
        if any(r["target"] == other for r in results):
            pairs.append((other, "frontend"))
    data["notes"] = [n for n in data.get("notes", []) if not n.startswith(f"`{tool}`")] + [note]
    write_results(bench_dir, data, results, pairs, plots=plots)
    return True


def tool_version(tool_bin: str) -> str | None:
    venv_python = Path(tool_bin).parent / "python"
    try:
        code = f"import importlib.metadata as m; print(m.version('{Path(tool_bin).name}'))"
        return subprocess.run([str(venv_python), "-c", code], capture_output=True, text=True, check=True,
                              timeout=60).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


NOTES = {
    "aiperf": "`aiperf` = NVIDIA AIPerf {version} (`aiperf profile --endpoint-type chat --streaming`, the "
              "workload's prompts as a `single_turn` input file, `--use-server-token-count`), one run per "
              "concurrency; figures from its profile_export_aiperf.json. TTFT: sent -> first SSE chunk with "
              "content; ITL per request = (E2E - TTFT)/(tokens - 1), tokens from the usage chunk; throughput "
              "over its benchmark duration.",
    "guidellm": "`guidellm` = GuideLLM {version} (`guidellm run --profile concurrent`, chat completions, the "
                "workload's prompts as a JSONL file), one run per concurrency; figures from its benchmarks.json. "
                "TTFT: sent -> first token-carrying chunk; ITL per request = (E2E - TTFT)/(tokens - 1); E2E to "
                "the stream's close; output tokens from the usage chunk; tok/s and req/s recomputed as totals "
                "over the benchmark's duration (GuideLLM's own rates are means over time windows).",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", choices=TOOLS, required=True)
    parser.add_argument("--tool-bin", help="the tool's executable (default: build/<tool>-venv/bin/<tool>)")
    parser.add_argument("--model-repository", type=Path, default=Path("build/bench/model_repository"))
    parser.add_argument("--work-dir", type=Path, default=Path("build/bench"))
    parser.add_argument("--quick", action="store_true", default=os.environ.get("QUICK", "") not in ("", "0"))
    parser.add_argument("--workload", help="JSON of Workload fields overriding the preset")
    parser.add_argument("--concurrency", help="comma-separated, overrides the workload's")
    parser.add_argument("--url", help="a running frontend's base URL (http://HOST:PORT/v1); else the stack is started")
    parser.add_argument("--results-dir", type=Path,
                        help="make bench's folder (default: benchmarks/results/<date>[-quick]); ours is <it>/<tool>/")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    t0 = time.monotonic()
    tool_bin = str(Path(args.tool_bin).absolute()) if args.tool_bin else \
        str(servers.REPO_ROOT / "build" / f"{args.tool}-venv" / "bin" / args.tool)
    if not Path(tool_bin).is_file():
        parser.error(f"{tool_bin} missing: `make bench-{args.tool}` installs it")
    workload = load_workload(args.quick, args.workload)
    concurrencies = [int(c) for c in args.concurrency.split(",")] if args.concurrency else list(workload.concurrencies)
    bench_dir = args.results_dir or (servers.REPO_ROOT / "benchmarks" / "results" /
                                     (dt.date.today().isoformat() + ("-quick" if args.quick else "")))
    out_dir = bench_dir / args.tool
    raw_dir = (out_dir / "raw").resolve()
    raw_dir.mkdir(parents=True, exist_ok=True)
    log = raw_dir / f"{args.tool}.log"
    log.write_text("")
    repo = args.model_repository
    checkpoint = Path(servers.repository_parameter(repo, "preprocessing", "tokenizer_dir") or "").resolve()
    served = servers.repository_parameter(repo, "tensorrt_llm", "served_model_name") or checkpoint.name
    prompts = workload.prompts(load_tokenizer(checkpoint))
    prompts_file = write_prompts(prompts, workload.output_tokens, raw_dir / "prompts.jsonl")
    version = tool_version(tool_bin)
    print(f"{args.tool} {version}: workload {workload.name}, {workload.num_prompts} prompts x {workload.input_tokens} "
          f"tokens, {workload.output_tokens} output tokens, concurrency {concurrencies}; log {log}", flush=True)

    with contextlib.ExitStack() as stack:
        base_url = args.url
        if base_url is None:
            log_dir = args.work_dir / "bench_logs"
            log_dir.mkdir(parents=True, exist_ok=True)
            endpoints = stack.enter_context(servers.triton(repo, args.work_dir, log_dir))
            print(f"triton ready at {endpoints.grpc_url} ({time.monotonic() - t0:.0f} s)", flush=True)
            base_url = stack.enter_context(servers.frontend(endpoints.grpc_url, log_dir))
            print(f"frontend ready at {base_url} ({time.monotonic() - t0:.0f} s)", flush=True)
        warm_up(base_url, served, workload, prompts)
        rows = run_tool(args.tool, tool_bin, base_url, served, checkpoint, workload, prompts_file, raw_dir, log,
                        concurrencies)

    note = NOTES[args.tool].format(version=version or "?")
    ours = loadgen_rows(bench_dir)
    meta = {
        "title": f"{args.tool} {version or ''} against the frontend ({workload.name})",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "model": served, "checkpoint": str(checkpoint), "model_repository": str(repo),
        "tool": args.tool, "tool_version": version, "workload": workload.to_dict(),
        "wall_s": time.monotonic() - t0,
        "notes": [note,
                  ("`loadgen` = `make bench`'s `frontend` rows from ../results.json (benchmarks/loadgen.py, same "
                   "endpoint, same prompts; run at another time, so compare ratios, not single figures)."
                   if ours else "No `make bench` results in ../results.json: run `make bench` (same QUICK) for "
                   "the loadgen comparison."),
                  "Commands: raw/" + log.name + "; the tool's own exports: raw/c<concurrency>/."],
    }
    paths = write_results(out_dir, meta, rows + ours, [(args.tool, "loadgen")], plots=not args.no_plots)
    if add_to_bench_report(bench_dir, args.tool, rows, note, plots=not args.no_plots):
        print(f"added to {bench_dir / 'summary.md'}")
    print(paths["md"].read_text())
    print(f"results: {out_dir} ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
