"""perf_analyzer's streaming gRPC concurrency sweep over the same workload (benchmarks/workload.py).

For each model (`tensorrt_llm`: token ids; `ensemble`: text) and each concurrency, one perf_analyzer run
with `--request-count` (the workload's requests per level) and `--profile-export-file` (per-response
timestamps); the exports are read by benchmarks/metrics.py, so TTFT/ITL/E2E/throughput are defined
exactly as for our load generator. perf_analyzer's own printed latency is the whole stream, not TTFT.

    benchmarks/perf_analyzer/run_sweep.sh                    # installs perf_analyzer, starts Triton, sweeps
    python -m benchmarks.pa_sweep --grpc-url 127.0.0.1:8001 --tokenizer build/checkpoints/demo-small
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import servers
from benchmarks.metrics import parse_pa_export
from benchmarks.report import write_results
from benchmarks.workload import load_tokenizer, load_workload, write_pa_inputs

MODELS = ("tensorrt_llm", "ensemble")
ENSEMBLE_SHAPES = ("text_input:1", "max_tokens:1", "min_tokens:1", "end_id:1", "stream:1")


def pa_command(model: str, grpc_url: str, input_data: Path, concurrency: int, requests: int,
               export: Path | None, csv: Path | None) -> list[str]:
    cmd = ["perf_analyzer", "-m", model, "-i", "grpc", "-u", grpc_url, "--async", "--streaming",
           "--input-data", str(input_data), "--concurrency-range", str(concurrency),
           "--request-count", str(requests), "--max-threads", str(max(4, concurrency))]
    if model == "ensemble":
        for shape in ENSEMBLE_SHAPES:
            cmd += ["--shape", shape]
    if export is not None:
        cmd += ["--profile-export-file", str(export)]
    if csv is not None:
        cmd += ["-f", str(csv)]
    return cmd


def run_pa(cmd: list[str], pa_env: Path, log: Path) -> None:
    """perf_analyzer with PATH/LD_LIBRARY_PATH from install.sh's env.sh; its output goes to `log`."""
    script = f"source {shlex.quote(str(pa_env))} && exec {shlex.join(cmd)}"
    with log.open("a") as out:
        out.write(f"$ {shlex.join(cmd)}\n")
        out.flush()
        done = subprocess.run(["bash", "-c", script], stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"perf_analyzer exited with {done.returncode}:\n{tail}")


def run_and_parse(command: list[str], export: Path, pa_env: Path, log: Path, attempts: int = 2) -> list[dict]:
    """Run one level and parse its export. perf_analyzer 2.51 once left a c16 export cut at exactly 64 KiB
    with exit status 0 (not reproduced in two reruns); such a level runs again rather than failing the sweep."""
    for _ in range(attempts):
        export.unlink(missing_ok=True)  # perf_analyzer refuses to overwrite one (a rerun on the same day)
        run_pa(command, pa_env, log)
        try:
            return parse_pa_export(export)
        except json.JSONDecodeError as exc:
            error = exc
            print(f"perf_analyzer left an unreadable {export.name} ({export.stat().st_size} bytes: {exc})",
                  flush=True)
    raise RuntimeError(f"perf_analyzer wrote an unreadable {export} {attempts} times; its output is in {log}") \
        from error


def sweep(grpc_url: str, tokenizer_dir: Path, models: list[str], workload, out_dir: Path, pa_env: Path,
          concurrencies: list[int] | None = None) -> list[dict]:
    inputs = write_pa_inputs(workload, load_tokenizer(tokenizer_dir), out_dir / "inputs")
    log = out_dir / "perf_analyzer.log"
    results = []
    for model in models:
        if workload.warmup_requests:
            run_pa(pa_command(model, grpc_url, inputs[model], 1, workload.warmup_requests, None, None), pa_env, log)
        for c in concurrencies or workload.concurrencies:
            n = workload.requests_at(c)
            export = out_dir / f"export_{model}_c{c}.json"
            print(f"perf_analyzer {model} concurrency {c}: {n} requests", flush=True)
            command = pa_command(model, grpc_url, inputs[model], c, n, export, out_dir / f"pa_{model}_c{c}.csv")
            for summary in run_and_parse(command, export, pa_env, log):
                results.append({"target": f"pa:{model}", "concurrency": summary.pop("value"), **summary})
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc-url", help="a running Triton; else one is started from --model-repository")
    parser.add_argument("--tokenizer", type=Path, help="checkpoint dir (default: from the repository)")
    parser.add_argument("--model-repository", type=Path, default=Path("build/bench/model_repository"))
    parser.add_argument("--work-dir", type=Path, default=Path("build/bench"))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--quick", action="store_true", default=os.environ.get("QUICK", "") not in ("", "0"))
    parser.add_argument("--workload", help="JSON of Workload fields overriding the preset")
    parser.add_argument("--concurrency", help="comma-separated, overrides the workload's")
    parser.add_argument("--pa-dir", type=Path, default=servers.REPO_ROOT / "build" / "perf_analyzer",
                        help="where benchmarks/perf_analyzer/install.sh put perf_analyzer")
    parser.add_argument("--results-dir", type=Path, help="default: benchmarks/results/<date>-pa[-quick]")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    t0 = time.monotonic()
    pa_env = args.pa_dir / "env.sh"
    if not pa_env.is_file():
        parser.error(f"{pa_env} missing: run benchmarks/perf_analyzer/install.sh first")
    workload = load_workload(args.quick, args.workload)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    concurrencies = [int(c) for c in args.concurrency.split(",")] if args.concurrency else None
    out_dir = args.results_dir or (servers.REPO_ROOT / "benchmarks" / "results" /
                                   f"{dt.date.today().isoformat()}-pa{'-quick' if args.quick else ''}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "perf_analyzer.log").write_text("")
    tokenizer = args.tokenizer or Path(servers.repository_parameter(args.model_repository, "preprocessing",
                                                                     "tokenizer_dir") or "")
    with contextlib.ExitStack() as stack:
        grpc_url = args.grpc_url
        if grpc_url is None:
            log_dir = args.work_dir / "bench_logs"
            log_dir.mkdir(parents=True, exist_ok=True)
            grpc_url = stack.enter_context(servers.triton(args.model_repository, args.work_dir, log_dir)).grpc_url
            print(f"triton ready at {grpc_url} ({time.monotonic() - t0:.0f} s)", flush=True)
        results = sweep(grpc_url, tokenizer, models, workload, out_dir, pa_env, concurrencies)
    meta = {
        "title": f"perf_analyzer sweep ({workload.name})",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "workload": workload.to_dict(),
        "wall_s": time.monotonic() - t0,
        "notes": ["perf_analyzer 2.51 (tritonclient 2.51.0 wheel), gRPC streaming, `--request-count` per level; "
                  "figures recomputed from `--profile-export-file` by benchmarks/metrics.py "
                  "(exports and CSVs in this folder, commands in perf_analyzer.log).",
                  "`pa:tensorrt_llm` sends the chat-templated token ids; `pa:ensemble` sends the raw prompt text "
                  "(its preprocessing applies no chat template), so its prompts are a few tokens shorter."],
    }
    paths = write_results(out_dir, meta, results, [("pa:ensemble", "pa:tensorrt_llm")], plots=not args.no_plots)
    print(paths["md"].read_text())
    print(f"results: {out_dir} ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
