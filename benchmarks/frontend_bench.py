"""`make bench-frontend`: what the frontend costs per streamed token, against an engine that costs nothing.

Starts tritonserver on a copy of a rendered demo model repository with the null engine added next to the
real models (benchmarks/null_engine: the TensorRT-LLM tensor interface, decoupled, one token per response
as fast as the Python backend carries them), then the real frontend (`python -m frontend`) with
ENGINE_MODEL=null_engine, so the whole path is real (HTTP + SSE, the frontend, gRPC, Triton, the Python
backend) except the model. After a warm-up it runs, per concurrency (1, 16, 64, 256), streaming chat
requests (benchmarks/loadgen.py's OpenAITarget: greedy, `max_tokens` fixed, a short prompt) until about
`--tokens-per-level` output tokens (whole rounds of `concurrency` requests), and reads each process's CPU
time (user + system, /proc/<pid>/stat) before and after the level:

- `frontend`: the frontend process and its children (workers, when there are several);
- `tritonserver`: the tritonserver process (gRPC server, the Python backend's server side);
- `engine`: the null engine's Python-backend stub (`triton_python_backend_stub`, a child of tritonserver);
- `other_models`: the other models' stubs (the idle CPU engine, pre/postprocessing);
- `loadgen`: this process (the load generator: httpx, SSE parsing).

Reports output tokens/s, CPU µs per output token of each, and the cores each kept busy, in the same
results.json / summary.md / PNG form as `make bench`, in benchmarks/results/<date>[-quick]/frontend/
(or $BENCH_OUT, or --results-dir); cpu_per_token.png next to make bench's plots.

    python -m benchmarks.frontend_bench --model-repository build/bench-frontend/model_repository \\
        --work-dir build/bench-frontend [--quick] [--concurrency 1,16] [--max-tokens 256] [--tokens-per-level 32768]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import platform
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from benchmarks import servers
from benchmarks.loadgen import OpenAITarget, run_workload_level
from benchmarks.metrics import summarize
from benchmarks.null_engine import NULL_MODEL, add_null_engine, plain_token_ids
from benchmarks.report import write_results
from benchmarks.stack_bench import _git_commit
from benchmarks.workload import Workload, load_tokenizer

CONCURRENCIES = (1, 16, 64, 256)
MAX_TOKENS = 256
TOKENS_PER_LEVEL = 32768
QUICK_MAX_TOKENS = 64
QUICK_TOKENS_PER_LEVEL = 4096
WARMUP_REQUESTS = 8
PROMPTS, PROMPT_TOKENS = 16, 16
# Process groups, in report order, and what each holds.
GROUPS = {
    "frontend": "the frontend process and its children (workers)",
    "tritonserver": "the tritonserver process (gRPC, the Python backend's server side)",
    "engine": "the null engine's Python-backend stub (triton_python_backend_stub)",
    "other_models": "the other models' stubs, idle (CPU engine, pre/postprocessing)",
    "loadgen": "the load generator (this process: httpx, SSE parsing)",
}
STACK = ("frontend", "tritonserver", "engine")  # what a server pays per token; `stack` in the report
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ----- /proc -----------------------------------------------------------------------------------------------
def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (index 0 = state), or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of every thread of `pid`, dead threads included (utime + stime)."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / CLK_TCK


def _parents() -> dict[int, int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                parents[int(entry.name)] = int(fields[1])
    return parents


def descendants(pid: int, parents: dict[int, int] | None = None) -> list[int]:
    parents = _parents() if parents is None else parents
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return sorted(found)


def process_args(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process (VmRSS), None once it has gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(match.group(1)) / 1024 if match else None


def triton_pid(grpc_url: str) -> int:
    """The tritonserver serving gRPC on `grpc_url`'s port (found by its command line)."""
    flag = f"--grpc-port={grpc_url.rsplit(':', 1)[1]}"
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            args = process_args(int(entry.name))
            if args and Path(args[0]).name == "tritonserver" and flag in args:
                return int(entry.name)
    raise RuntimeError(f"no tritonserver process with {flag}")


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine spent busy (not idle, not waiting on I/O) since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / CLK_TCK  # user..steal, less idle and iowait


@dataclass
class Processes:
    """The pids of each group (GROUPS), resolved once, after the servers have started."""

    groups: dict[str, list[int]]

    @classmethod
    def resolve(cls, frontend_pid: int, tritonserver_pid: int, engine_model: str = NULL_MODEL) -> "Processes":
        parents = _parents()
        stubs = descendants(tritonserver_pid, parents)
        instance = re.compile(rf"{re.escape(engine_model)}_\d+_\d+")  # the stub's instance-name argument
        engine = [pid for pid in stubs if any(instance.fullmatch(arg) for arg in process_args(pid))]
        if not engine:
            raise RuntimeError(f"no Python-backend stub of {engine_model!r} under tritonserver {tritonserver_pid}")
        return cls({"frontend": [frontend_pid, *descendants(frontend_pid, parents)],
                    "tritonserver": [tritonserver_pid], "engine": engine,
                    "other_models": [pid for pid in stubs if pid not in engine], "loadgen": [os.getpid()]})

    def snapshot(self) -> dict[int, float | None]:
        return {pid: cpu_seconds(pid) for pids in self.groups.values() for pid in pids}

    def spent(self, before: dict[int, float | None], after: dict[int, float | None]) -> dict[str, float]:
        """CPU seconds per group between two snapshots (a process gone meanwhile counts nothing)."""
        return {group: sum(after[pid] - before[pid] for pid in pids
                           if before.get(pid) is not None and after.get(pid) is not None)
                for group, pids in self.groups.items()}


# ----- the levels ------------------------------------------------------------------------------------------
def requests_per_level(concurrency: int, tokens_per_level: int, max_tokens: int) -> int:
    """At least `tokens_per_level` output tokens, in whole rounds of `concurrency` requests."""
    wanted = math.ceil(tokens_per_level / max_tokens)
    return concurrency * math.ceil(wanted / concurrency)


async def measure_level(target: OpenAITarget, prompts: Sequence[str], concurrency: int, requests: int,
                        processes: Processes, offset: int = 0, progress: bool = True) -> dict[str, Any]:
    """One closed-loop level, with every group's CPU time over it: summarize()'s figures plus `cpu_s`,
    `cpu_us_per_token` (and its `stack` sum), `cpu_cores` (CPU s / wall s) and `machine_busy_cores`."""
    before, busy_before, start = processes.snapshot(), machine_busy_seconds(), time.perf_counter()
    timings, _ = await run_workload_level(target, prompts, concurrency, requests, progress=progress, offset=offset)
    wall = time.perf_counter() - start
    spent, busy = processes.spent(before, processes.snapshot()), machine_busy_seconds() - busy_before
    row: dict[str, Any] = {"target": target.label, "concurrency": concurrency, **summarize(timings)}
    errors = [t.error for t in timings if t.error]
    if errors:
        row["first_error"] = errors[0]
    tokens = row["output_tokens"]
    per_token = {group: (seconds / tokens * 1e6 if tokens else None) for group, seconds in spent.items()}
    per_token["stack"] = sum(per_token[g] for g in STACK) if tokens else None
    row.update({"wall_s": wall, "cpu_s": spent, "cpu_us_per_token": per_token,
                "cpu_cores": {group: seconds / wall for group, seconds in spent.items()},
                "machine_busy_cores": busy / wall})
    return row


async def idle_cores(processes: Processes, seconds: float = 2.0) -> dict[str, float]:
    """Each group's CPU with no load (cores), so a reader can tell background from per-token cost."""
    before, busy_before = processes.snapshot(), machine_busy_seconds()
    await asyncio.sleep(seconds)
    spent = processes.spent(before, processes.snapshot())
    return {**{group: s / seconds for group, s in spent.items()},
            "machine": (machine_busy_seconds() - busy_before) / seconds}


async def run_levels(base_url: str, model: str, prompts: Sequence[str], processes: Processes,
                     concurrencies: Sequence[int] = CONCURRENCIES, max_tokens: int = MAX_TOKENS,
                     tokens_per_level: int = TOKENS_PER_LEVEL, warmup_requests: int = WARMUP_REQUESTS,
                     progress: bool = True, idle_s: float = 2.0) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Warm-up (not measured), an idle sample, then one measured level per concurrency. Returns the rows
    and the idle sample."""
    target = OpenAITarget(base_url, model, max_tokens, label="frontend")
    if warmup_requests:
        await run_workload_level(target, prompts, min(4, warmup_requests), warmup_requests, progress=False)
    idle = await idle_cores(processes, idle_s)
    rows, offset = [], 0
    for c in concurrencies:
        n = requests_per_level(c, tokens_per_level, max_tokens)
        rows.append(await measure_level(target, prompts, c, n, processes, offset=offset, progress=progress))
        offset += n
    return rows, idle


# ----- the report ------------------------------------------------------------------------------------------
def _f(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def cpu_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| conc | requests | out tokens | out tok/s | frontend | tritonserver | engine | **stack** | loadgen | "
             "other models | cores busy: ours / machine |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        us, cores = r["cpu_us_per_token"], r["cpu_cores"]
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['output_tokens']} | {_f(r['output_tok_per_s'])} | "
                     f"{_f(us['frontend'])} | {_f(us['tritonserver'])} | {_f(us['engine'])} | **{_f(us['stack'])}** | "
                     f"{_f(us['loadgen'])} | {_f(us['other_models'])} | "
                     f"{_f(sum(cores.values()), 2)} / {_f(r['machine_busy_cores'], 2)} |")
    return "\n".join(lines)


def plot_cpu(rows: list[dict[str, Any]], out_dir: Path) -> Path:
    """CPU µs per output token of each group vs concurrency (report.plot's style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r["concurrency"])
    cs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for group in ("stack", *STACK, "loadgen"):
        ax.plot(cs, [r["cpu_us_per_token"][group] or float("nan") for r in rows], marker="o", label=group,
                linestyle="--" if group in ("stack", "loadgen") else "-")
    ax.set(xscale="log", xlabel="concurrency", ylabel="CPU µs per output token",
           title="CPU per streamed token, by process (null engine)")
    ax.set_xticks(cs, labels=[str(c) for c in cs])
    ax.set_ylim(bottom=0)
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = out_dir / "cpu_per_token.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _end_ids(checkpoint: Path) -> list[int]:
    """The checkpoint's end ids (generation_config.json), which the null engine must never send."""
    try:
        value = json.loads((checkpoint / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value]) if v is not None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", type=Path, required=True, help="a rendered demo model repository")
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", default=os.environ.get("QUICK", "") not in ("", "0"),
                        help=f"max_tokens {QUICK_MAX_TOKENS}, {QUICK_TOKENS_PER_LEVEL} tokens per level "
                             "(also: QUICK=1 in the environment)")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCIES)), help="comma-separated")
    parser.add_argument("--max-tokens", type=int, help=f"output tokens per request (default {MAX_TOKENS})")
    parser.add_argument("--tokens-per-level", type=int,
                        help=f"at least this many output tokens per level, in whole rounds (default {TOKENS_PER_LEVEL})")
    parser.add_argument("--results-dir", type=Path,
                        default=Path(os.environ["BENCH_OUT"]) if os.environ.get("BENCH_OUT") else None,
                        help="default: $BENCH_OUT, else benchmarks/results/<date>[-quick]/frontend")
    parser.add_argument("--frontend-workers", type=int, default=1,
                        help="FRONTEND_WORKERS of the frontend under test (default 1)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    concurrencies = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
    max_tokens = args.max_tokens or (QUICK_MAX_TOKENS if args.quick else MAX_TOKENS)
    tokens_per_level = args.tokens_per_level or (QUICK_TOKENS_PER_LEVEL if args.quick else TOKENS_PER_LEVEL)
    today = dt.date.today().isoformat()
    out_dir = args.results_dir or (servers.REPO_ROOT / "benchmarks" / "results" / (today + ("-quick" if args.quick else ""))
                                   / "frontend")
    log_dir = args.work_dir / "bench_frontend_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = Path(servers.repository_parameter(args.model_repository, "preprocessing", "tokenizer_dir") or "")
    tokenizer = load_tokenizer(checkpoint)
    workload = Workload(name="frontend" + ("-quick" if args.quick else ""), num_prompts=PROMPTS,
                        input_tokens=PROMPT_TOKENS, output_tokens=max_tokens, concurrencies=concurrencies, rounds=0,
                        min_requests=0, warmup_requests=WARMUP_REQUESTS, naive_max_requests=0, overhead_pairs=0,
                        extra={"tokens_per_level": tokens_per_level,
                               "requests_per_level": {str(c): requests_per_level(c, tokens_per_level, max_tokens)
                                                      for c in concurrencies}})
    prompts = workload.prompts(tokenizer)
    print(f"frontend benchmark: null engine, concurrency {list(concurrencies)}, max_tokens {max_tokens}, "
          f">= {tokens_per_level} tokens per level; logs in {log_dir}", flush=True)

    with contextlib.ExitStack() as stack:
        repo = stack.enter_context(servers.repository_copy(args.model_repository, "tensorrt_llm", {}))
        add_null_engine(repo, plain_token_ids(tokenizer), end_ids=_end_ids(checkpoint))
        served = servers.repository_parameter(repo, NULL_MODEL, "served_model_name") or checkpoint.name
        endpoints = stack.enter_context(servers.triton(repo, args.work_dir, log_dir))
        print(f"triton ready at {endpoints.grpc_url} ({time.monotonic() - t0:.0f} s)", flush=True)
        # MAX_IN_FLIGHT: every stream of the highest level runs at once (the default, 64, would queue the rest).
        base_url, process = stack.enter_context(servers.frontend_process(
            endpoints.grpc_url, log_dir, env={"ENGINE_MODEL": NULL_MODEL, "MAX_IN_FLIGHT": str(max(concurrencies)),
                                              "FRONTEND_WORKERS": str(args.frontend_workers)}))
        print(f"frontend ready at {base_url} ({time.monotonic() - t0:.0f} s)", flush=True)
        processes = Processes.resolve(process.pid, triton_pid(endpoints.grpc_url))
        rows, idle = asyncio.run(run_levels(base_url, served, prompts, processes, concurrencies, max_tokens,
                                            tokens_per_level))
        rss = {pid: rss_mib(pid) for pid in processes.groups["frontend"]}

    meta = {
        "title": f"Frontend benchmark, null engine ({workload.name})",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "git_commit": _git_commit(),
        "model": served,
        "engine_model": NULL_MODEL,
        "checkpoint": str(checkpoint),
        "model_repository": str(args.model_repository),
        "workload": workload.to_dict(),
        "wall_s": time.monotonic() - t0,
        "process_groups": GROUPS,
        "processes": processes.groups,
        "idle_cores": idle,
        "frontend_workers": args.frontend_workers,
        "frontend_rss_mib": rss,
        "notes": [
            "CPU µs per output token = the process group's user + system CPU time over the level (/proc/<pid>/stat, "
            f"{1e3 / CLK_TCK:.0f} ms ticks) / the level's output tokens (the usage chunks' count). `stack` = frontend "
            "+ tritonserver + engine: what serving a token costs. Groups: "
            + "; ".join(f"`{g}` = {d}" for g, d in GROUPS.items()) + ".",
            "The engine is benchmarks/null_engine (TensorRT-LLM tensor interface, one token per response, no "
            "model), so all the CPU is the serving path's. The frontend runs with its defaults but MAX_IN_FLIGHT = "
            "the highest concurrency. Tokens/s depends on the machine's cores, shared with the load generator; "
            "CPU µs per token is the figure to compare across machines.",
            "Idle, before the levels (cores): " + ", ".join(f"{g} {v:.3f}" for g, v in idle.items()) + ".",
            f"FRONTEND_WORKERS={args.frontend_workers}; resident memory of the frontend's processes after the "
            "levels (MiB; with workers: the supervisor, its helper processes, then each worker): "
            + ", ".join(f"{pid} {mib:.0f}" for pid, mib in rss.items() if mib is not None) + ".",
        ],
    }
    sections = ["CPU µs per output token, by process (cores busy = CPU s / wall s of the level, ours = every group "
                "above; machine = every process on the machine):", "", cpu_table(rows)]
    if not args.no_plots and rows:
        out_dir.mkdir(parents=True, exist_ok=True)
        plot_cpu(rows, out_dir)
        sections += ["", "![CPU per token](cpu_per_token.png)"]
    paths = write_results(out_dir, meta, rows, [], plots=not args.no_plots, sections=["\n".join(sections)])
    print(paths["md"].read_text())
    print(f"results: {out_dir} ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
