"""`make bench-overhead`: the stack where the engine is cheap and the per-token overhead is what counts.

The real stack (the frontend, tritonserver, the CPU engine model `tensorrt_llm` in its Python-backend stub) on
the `tiny` demo engine, 32 streaming chats at a time, 64 output tokens each (greedy, `min_tokens` = 64), warm:
a forward pass costs little, so tokens/s is set by what every process spends per token. Reports output
tokens/s and the CPU µs per output token of each process (frontend_bench's groups, /proc/<pid>/stat):
`frontend`, `tritonserver`, `engine` (the `tensorrt_llm` stub), `other_models` (pre/postprocessing stubs),
`loadgen` (this process).

Several stacks can run side by side for an interleaved comparison (`--stack LABEL=ROOT[:MODEL_REPOSITORY]`,
e.g. a `git worktree` of an older commit with its own `python -m build_engine --preset tiny` output): each is
started from its own checkout (its launcher's TritonServer with that launcher's environment, its frontend, its
engine code: PYTHONPATH=ROOT), all of them before the first level; then every round measures one level on each
stack, in an order that rotates from round to round, while the other stacks sit idle. Medians over the rounds.

    python -m benchmarks.overhead_bench --model-repository build/bench-overhead/model_repository \\
        --work-dir build/bench-overhead [--rounds 3] [--requests 256] \\
        [--stack old=/tmp/old:/tmp/old/build/bench-overhead/model_repository]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from benchmarks import servers
from benchmarks.frontend_bench import Processes, cpu_table, idle_cores, measure_level, triton_pid
from benchmarks.loadgen import OpenAITarget, run_workload_level
from benchmarks.report import write_results
from benchmarks.stack_bench import _git_commit
from benchmarks.workload import Workload, load_tokenizer
from launcher.ports import find_free_port

ENGINE_MODEL = "tensorrt_llm"
CONCURRENCY, MAX_TOKENS, REQUESTS, ROUNDS = 32, 64, 256, 3
WARMUP_REQUESTS = 64
PROMPTS, PROMPT_TOKENS = 16, 16
GROUPS = ("frontend", "tritonserver", "engine", "other_models", "loadgen", "stack")

# Runs in the stack's own checkout: its launcher starts tritonserver (with its own environment defaults) and
# stops it on SIGTERM.
_TRITON_HELPER = """
import signal, sys, threading
from pathlib import Path
from launcher.tritonserver import TritonServer
repo, work, log, http, grpc, metrics = sys.argv[1:7]
server = TritonServer(Path(repo), http_port=int(http), grpc_port=int(grpc), metrics_port=int(metrics),
                      log_file=Path(log), work_dir=Path(work))
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: done.set())
server.start()
try:
    server.wait_ready(300)
    print("ready", flush=True)
    while not done.wait(1):
        if server.poll() is not None:
            sys.exit("tritonserver exited")
finally:
    server.stop()
"""


@dataclass
class Stack:
    label: str
    root: Path
    model_repository: Path
    base_url: str = ""
    processes: Processes | None = None
    served: str = ""


def parse_stack(spec: str) -> Stack:
    label, _, rest = spec.partition("=")
    root, _, repository = rest.partition(":")
    if not label or not root:
        raise argparse.ArgumentTypeError(f"--stack LABEL=ROOT[:MODEL_REPOSITORY], got {spec!r}")
    root_path = Path(root).resolve()
    return Stack(label, root_path, Path(repository).resolve() if repository
                 else root_path / "build" / "bench-overhead" / "model_repository")


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}


@contextlib.contextmanager
def _process(args: list[str], root: Path, log_file: Path, env: dict[str, str] | None = None,
             stdout: Any = None) -> Iterator[subprocess.Popen]:
    with open(log_file, "w") as log:
        process = subprocess.Popen([sys.executable, *args], cwd=root, env={**_env(root), **(env or {})},
                                   stdout=stdout or log, stderr=log, start_new_session=True, text=True)
    try:
        yield process
    finally:
        servers.stop_process(process)


@contextlib.contextmanager
def start_stack(stack: Stack, work_dir: Path, log_dir: Path, max_in_flight: int) -> Iterator[Stack]:
    """tritonserver (through the stack's launcher) and the frontend, both from the stack's checkout."""
    ports = [find_free_port() for _ in range(3)]
    stack_dir = work_dir / f"stack-{stack.label}"
    stack_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as exits:
        helper = exits.enter_context(_process(
            ["-c", _TRITON_HELPER, str(stack.model_repository), str(stack_dir),
             str(log_dir / f"{stack.label}-triton.log"), *map(str, ports)],
            stack.root, log_dir / f"{stack.label}-triton-helper.log", stdout=subprocess.PIPE))
        line = helper.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"{stack.label}: tritonserver did not start (logs in {log_dir})")
        grpc_url = f"127.0.0.1:{ports[1]}"
        port = find_free_port()
        frontend = exits.enter_context(_process(
            ["-m", "frontend"], stack.root, log_dir / f"{stack.label}-frontend.log",
            env={"FRONTEND_HOST": "127.0.0.1", "FRONTEND_PORT": str(port), "TRITON_GRPC_URL": grpc_url,
                 "MAX_IN_FLIGHT": str(max_in_flight)}))
        servers.wait_http_ok(f"http://127.0.0.1:{port}/health/ready", 180, frontend)
        stack.base_url = f"http://127.0.0.1:{port}/v1"
        stack.processes = Processes.resolve(frontend.pid, triton_pid(grpc_url), ENGINE_MODEL)
        stack.served = servers.repository_parameter(stack.model_repository, ENGINE_MODEL, "served_model_name") or ""
        yield stack


async def run_rounds(stacks: list[Stack], prompts: list[str], concurrency: int, max_tokens: int, requests: int,
                     rounds: int, warmup: int) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    idle = {}
    for stack in stacks:
        target = OpenAITarget(stack.base_url, stack.served, max_tokens, label=stack.label)
        await run_workload_level(target, prompts, concurrency, warmup, progress=False)
    for stack in stacks:
        idle[stack.label] = await idle_cores(stack.processes)
    rows = []
    for r in range(rounds):
        for k in range(len(stacks)):
            stack = stacks[(r + k) % len(stacks)]
            target = OpenAITarget(stack.base_url, stack.served, max_tokens, label=stack.label)
            row = await measure_level(target, prompts, concurrency, requests, stack.processes, offset=r * requests,
                                      progress=False)
            row["round"] = r
            rows.append(row)
            us = row["cpu_us_per_token"]
            print(f"round {r} {stack.label:>8}: {row['output_tok_per_s']:7.0f} tok/s, errors {row['errors']}; "
                  "µs/token " + ", ".join(f"{g} {us[g]:.0f}" for g in GROUPS if us.get(g) is not None), flush=True)
    return rows, idle


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for label in dict.fromkeys(r["target"] for r in rows):
        mine = [r for r in rows if r["target"] == label]
        out.append({"target": label, "rounds": len(mine),
                    "output_tok_per_s": statistics.median(r["output_tok_per_s"] for r in mine),
                    "output_tok_per_s_all": [round(r["output_tok_per_s"]) for r in mine],
                    "cpu_us_per_token": {g: statistics.median(r["cpu_us_per_token"][g] for r in mine) for g in GROUPS},
                    "errors": sum(r["errors"] for r in mine)})
    return out


def median_table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]["output_tok_per_s"]
    lines = ["| stack | rounds | out tok/s (median) | every round | vs first | frontend | tritonserver | engine | "
             "**stack** | other models | loadgen |", "|---|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        us = r["cpu_us_per_token"]
        lines.append(f"| {r['target']} | {r['rounds']} | {r['output_tok_per_s']:.0f} | "
                     f"{', '.join(map(str, r['output_tok_per_s_all']))} | {r['output_tok_per_s'] / base:.2f}x | "
                     f"{us['frontend']:.0f} | {us['tritonserver']:.0f} | {us['engine']:.0f} | **{us['stack']:.0f}** | "
                     f"{us['other_models']:.0f} | {us['loadgen']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", type=Path, required=True,
                        help="this checkout's rendered tiny repository")
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--stack", type=parse_stack, action="append", default=[],
                        help="another stack to measure side by side: LABEL=ROOT[:MODEL_REPOSITORY] (a checkout and "
                             "its rendered repository; default ROOT/build/bench-overhead/model_repository)")
    parser.add_argument("--label", default="this", help="this checkout's label (default: this)")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests per level (each stack, each round)")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--warmup", type=int, default=WARMUP_REQUESTS, help="requests per stack before the rounds")
    parser.add_argument("--results-dir", type=Path,
                        default=Path(os.environ["BENCH_OUT"]) if os.environ.get("BENCH_OUT") else None,
                        help="default: $BENCH_OUT, else benchmarks/results/<date>/overhead")
    args = parser.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    stacks = [Stack(args.label, servers.REPO_ROOT, args.model_repository.resolve()), *args.stack]
    out_dir = args.results_dir or (servers.REPO_ROOT / "benchmarks" / "results" / dt.date.today().isoformat()
                                   / "overhead")
    log_dir = args.work_dir / "bench_overhead_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = Path(servers.repository_parameter(args.model_repository, "preprocessing", "tokenizer_dir") or "")
    workload = Workload(name="overhead", num_prompts=PROMPTS, input_tokens=PROMPT_TOKENS,
                        output_tokens=args.max_tokens, concurrencies=(args.concurrency,), rounds=args.rounds,
                        min_requests=args.requests, warmup_requests=args.warmup, naive_max_requests=0,
                        overhead_pairs=0)
    prompts = workload.prompts(load_tokenizer(checkpoint))
    print(f"overhead benchmark: {', '.join(s.label for s in stacks)}; concurrency {args.concurrency}, "
          f"{args.max_tokens} tokens, {args.requests} requests per level, {args.rounds} rounds; logs in {log_dir}",
          flush=True)
    with contextlib.ExitStack() as exits:
        for stack in stacks:
            exits.enter_context(start_stack(stack, args.work_dir, log_dir, args.concurrency))
            print(f"{stack.label} ready ({stack.root}, {time.monotonic() - t0:.0f} s)", flush=True)
        rows, idle = asyncio.run(run_rounds(stacks, prompts, args.concurrency, args.max_tokens, args.requests,
                                            args.rounds, args.warmup))
    summary = medians(rows)
    meta = {
        "title": (f"Stacks side by side: {stacks[0].served or 'engine'} ({stacks[0].model_repository}), "
                  f"c={args.concurrency}, {args.max_tokens} tokens, streaming chat"),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "git_commit": _git_commit(),
        "stacks": {s.label: {"root": str(s.root), "model_repository": str(s.model_repository),
                             "processes": s.processes.groups if s.processes else None} for s in stacks},
        "workload": workload.to_dict(), "wall_s": time.monotonic() - t0, "idle_cores": idle, "medians": summary,
        "notes": ["CPU µs per output token: each process group's user + system CPU time over the level "
                  "(/proc/<pid>/stat) / the level's output tokens; `stack` = frontend + tritonserver + engine "
                  "(the `tensorrt_llm` stub). Rounds interleave the stacks (rotating order); the other stacks "
                  "sit idle meanwhile. Idle cores before the rounds: "
                  + "; ".join(f"{k}: " + ", ".join(f"{g} {v:.3f}" for g, v in i.items()) for k, i in idle.items())],
    }
    sections = ["Medians over the rounds (CPU µs per output token, by process):", "", median_table(summary), "",
                "Every level:", "", cpu_table(rows)]
    paths = write_results(out_dir, meta, rows, [], plots=False, sections=["\n".join(sections)])
    print(median_table(summary))
    print(f"results: {paths['md']} ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
