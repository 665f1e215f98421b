"""`make bench`: one workload, three targets, the same load generator.

Starts Triton (the rendered repository) on free ports, then the frontend, and runs the workload's
concurrency sweep against raw Triton gRPC (`tensorrt_llm`, token ids) and the OpenAI frontend (SSE);
stops them, then runs the same sweep against the naive baseline (transformers `generate` under a lock).
Writes benchmarks/results/<date>[-quick]/: results.json, summary.md (with the ratios frontend/triton and
frontend/naive), throughput.png, ttft.png, itl.png.

    python -m benchmarks.stack_bench --model-repository build/bench/model_repository --work-dir build/bench [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks import servers
from benchmarks.loadgen import OpenAITarget, TritonTarget, percentile, run_sweep
from benchmarks.report import write_results
from benchmarks.workload import load_tokenizer, load_workload

TARGETS = ("triton", "frontend", "naive")
RATIOS = [("frontend", "triton"), ("frontend", "naive"), ("triton", "naive")]


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=servers.REPO_ROOT, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


async def paired_overhead(triton: TritonTarget, frontend: OpenAITarget, prompts: Sequence[str],
                          pairs: int) -> dict[str, Any]:
    """What the frontend adds to the time to first token, free of the load's queueing noise: one request
    at a time, the same prompt through raw Triton and through the frontend back to back, alternating
    which goes first (so a drift in machine speed cancels), and percentiles of the per-pair differences.
    Use one-token requests: the frontend holds back a token that ends inside a UTF-8 character until
    the next one completes it (frequent with random weights), which would count a decode step as
    frontend time; the last token always goes out at once."""
    await triton.open(1)
    await frontend.open(1)
    added = []
    try:
        for i in range(pairs):
            prompt = prompts[i % len(prompts)]
            order = (triton, frontend) if i % 2 == 0 else (frontend, triton)
            runs = {target.label: await target.request(prompt) for target in order}
            direct, through = runs[triton.label], runs[frontend.label]
            if direct.ok and through.ok:
                added.append(through.ttft - direct.ttft)
    finally:
        await triton.close()
        await frontend.close()
    return {"pairs": len(added), "ttft_added_p50_ms": percentile(added, 50) * 1000,
            "ttft_added_p90_ms": percentile(added, 90) * 1000}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", default=os.environ.get("QUICK", "") not in ("", "0"),
                        help="the QUICK workload (also: QUICK=1 in the environment)")
    parser.add_argument("--workload", help="JSON of Workload fields overriding the preset")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset of " + ",".join(TARGETS))
    parser.add_argument("--results-dir", type=Path, help="default: benchmarks/results/<date>[-quick]")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)

    # SIGTERM unwinds like Ctrl-C, so every server started here is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    workload = load_workload(args.quick, args.workload)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets: {sorted(unknown)}")
    today = dt.date.today().isoformat()
    out_dir = args.results_dir or servers.REPO_ROOT / "benchmarks" / "results" / (today + ("-quick" if args.quick else ""))
    log_dir = args.work_dir / "bench_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    repo = args.model_repository
    checkpoint = Path(servers.repository_parameter(repo, "preprocessing", "tokenizer_dir") or "")
    served = servers.repository_parameter(repo, "tensorrt_llm", "served_model_name") or checkpoint.name
    tokenizer = load_tokenizer(checkpoint)
    prompts = workload.prompts(tokenizer)
    print(f"workload {workload.name}: {len(prompts)} prompts x {workload.input_tokens} tokens, "
          f"{workload.output_tokens} output tokens, concurrency {list(workload.concurrencies)}; "
          f"targets {targets}; logs in {log_dir}", flush=True)

    results = []
    overhead = None
    with contextlib.ExitStack() as outer:
        naive = None
        if "naive" in targets:  # loads while Triton starts; measured after Triton and the frontend stop
            naive = outer.enter_context(servers.naive_server(checkpoint, served, log_dir))
        if {"triton", "frontend"} & set(targets):
            with contextlib.ExitStack() as inner:
                endpoints = inner.enter_context(servers.triton(repo, args.work_dir, log_dir))
                print(f"triton ready at {endpoints.grpc_url} ({time.monotonic() - t0:.0f} s)", flush=True)
                if "triton" in targets:
                    target = TritonTarget(endpoints.grpc_url, tokenizer, workload.output_tokens, label="triton")
                    results += asyncio.run(run_sweep(target, workload, prompts))
                if "frontend" in targets:
                    base_url = inner.enter_context(servers.frontend(endpoints.grpc_url, log_dir))
                    print(f"frontend ready at {base_url} ({time.monotonic() - t0:.0f} s)", flush=True)
                    target = OpenAITarget(base_url, served, workload.output_tokens, label="frontend")
                    results += asyncio.run(run_sweep(target, workload, prompts))
                    if "triton" in targets:
                        overhead = asyncio.run(paired_overhead(
                            TritonTarget(endpoints.grpc_url, tokenizer, 1, label="triton"),
                            OpenAITarget(base_url, served, 1, label="frontend"), prompts, workload.overhead_pairs))
        if naive is not None:
            base_url = naive.wait_ready()
            print(f"naive baseline ready at {base_url} ({time.monotonic() - t0:.0f} s)", flush=True)
            target = OpenAITarget(base_url, served, workload.output_tokens, label="naive")
            results += asyncio.run(run_sweep(target, workload, prompts, naive=True))

    meta = {
        "title": f"Stack benchmark ({workload.name})",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "git_commit": _git_commit(),
        "model": served,
        "checkpoint": str(checkpoint),
        "model_repository": str(repo),
        "workload": workload.to_dict(),
        "wall_s": time.monotonic() - t0,
        "notes": [
            "Targets: `triton` = ModelStreamInfer on `tensorrt_llm` with the chat-templated token ids; "
            "`frontend` = our OpenAI endpoint, streaming chat (SSE); `naive` = transformers `generate` "
            "under a lock (benchmarks/naive_server.py). All from benchmarks/loadgen.py, one process, "
            "on the same machine as the servers.",
            "Definitions (benchmarks/metrics.py): TTFT = sent -> first token-carrying response; "
            "E2E = sent -> last token; ITL = (E2E - TTFT)/(tokens - 1); throughput over first sent -> last token.",
        ],
    }
    if overhead is not None:
        meta["frontend_overhead_paired"] = overhead
        meta["notes"].append(
            f"Frontend overhead, paired ({overhead['pairs']} one-token requests at concurrency 1, each through "
            f"raw Triton and through the frontend back to back): TTFT {overhead['ttft_added_p50_ms']:+.1f} ms "
            f"p50, {overhead['ttft_added_p90_ms']:+.1f} ms p90.")
    paths = write_results(out_dir, meta, results, RATIOS, plots=not args.no_plots)
    print(paths["md"].read_text())
    print(f"results: {out_dir} ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
