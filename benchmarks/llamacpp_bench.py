"""`make bench-llamacpp`: our stack side by side with llama.cpp's `llama-server` on the same checkpoint.

For each weight format, the CPU engine built from a checkpoint (`python -m build_engine`, default weights
float32, or `--weights int8`) against llama-server serving a GGUF conversion of the very same checkpoint
directory (the one the engine was built from, read from its `engine_config.json`):

| ours | llama.cpp |
|---|---|
| float32 (`make engine`) | f32 GGUF (`convert_hf_to_gguf.py --outtype f32`) |
| int8 (`make engine WEIGHTS=int8`: int8 weights, a scale per output channel; int8 activations on x86) | q8_0 GGUF (`llama-quantize`) |

Both get the same streaming chat requests (benchmarks/loadgen.py's OpenAITarget: the same user messages,
rendered by each server with the checkpoint's chat template: ours by the tokenizer's, llama-server with
`--jinja` by the template the GGUF carries; greedy, `ignore_eos`, `max_tokens` 64 (ours also `min_tokens`,
which llama-server ignores; `ignore_eos` alone fixes its length), `stream_options.include_usage`; one
connection per request, see fresh_connection_target). Output tokens are counted from each server's usage
chunk, and every request is checked to have produced exactly `max_tokens`. For each format, our stack
(tritonserver + the engine's Python-backend stub + the frontend, as overhead_bench starts it) and
llama-server run side by side; each round measures every concurrency on both, who goes first alternating,
while the other sits idle. Medians over the rounds, and ours/llama.cpp ratios.
Each level also reads every process's CPU time (/proc/<pid>/stat, as frontend_bench does): `frontend`,
`tritonserver`, `engine` (the `tensorrt_llm` stub), `other_models` (idle pre/postprocessing stubs) and
`server` = their sum for ours; `llama-server` (`server`) for llama.cpp; `loadgen` (this process) for both.

The llama-server binary: --llama-server, else $LLAMA_SERVER, else `llama-server` on PATH, else the one
`make llama-cpp` built (build/llama.cpp/bin). The converter is the one llama.cpp ships
(build/llama.cpp/llama.cpp/convert_hf_to_gguf.py from the pinned sdist, `--llama-cpp-dir` for another), run
with its own gguf-py on the path (not a project dependency).

    python -m benchmarks.llamacpp_bench --work-dir build/bench-llamacpp \\
        --engine float32=build/bench-llamacpp/float32/model_repository \\
        --engine int8=build/bench-llamacpp/int8/model_repository [--rounds 3] [--concurrency 1,16]
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
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from benchmarks import report, servers

DEFAULT_LLAMA_CPP = servers.REPO_ROOT / "build" / "llama.cpp"
CONCURRENCIES = (1, 16)
MAX_TOKENS = 64
ROUNDS = 3
TOKENS_PER_LEVEL = 768  # at least this many output tokens per level: requests = whole waves of `concurrency`
MIN_WAVES = 2  # and at least two waves of `concurrency` requests, so a level is not one synchronized batch
PROMPTS, PROMPT_TOKENS = 16, 64
WARMUP_REQUESTS = 16
LLAMA_THREADS = 2
LLAMA_PARALLEL = 16
LLAMA_CTX_PER_SLOT = 1024
# A level is "quiet" when the rest of the machine kept fewer than this many cores busy meanwhile (others' cores):
# on a shared 2-core box, llama-server's 2 threads (which spin at barriers) lose several-fold when a neighbour
# takes a core, so the summary also gives the medians of the quiet levels alone.
QUIET_CORES = 0.25
# Our weight format -> the GGUF type it is compared with.
GGUF_TYPES = {"float32": "f32", "int8": "q8_0"}
OURS, LLAMA = "ours", "llama.cpp"
OUR_GROUPS = ("frontend", "tritonserver", "engine", "other_models")
LLAMA_GROUPS = ("llama-server",)

# convert_hf_to_gguf.py from this llama.cpp imports mistral_common at its top (used only for Mistral-format
# checkpoints) and sentencepiece in its SentencePiece vocabulary path before it looks for tokenizer.model
# (and, finding none, falls through to the BPE one): neither is a project dependency, so stand-ins take their
# place when missing (the module names with None, and the tokenizer.model check first). Its BPE pre-tokenizer
# is recognised by a hash of known models' tokenizations; an unknown
# hash whose tokenizer.json pre-tokenizer is plain GPT-2 ByteLevel (the regex, no prefix space: the demo
# tokenizer) is mapped to llama.cpp's `gpt-2` pre-tokenizer, which is that regex. Anything else still fails.
_CONVERT_HELPER = r"""
import importlib.util, json, sys, types
from pathlib import Path
import transformers  # first: its optional-package checks must not see the stand-ins below
llama_dir = Path(sys.argv[1])
STUBS = {
    "mistral_common.tokens.tokenizers.base": {"TokenizerVersion": None},
    "mistral_common.tokens.tokenizers.multimodal": {"DATASET_MEAN": None, "DATASET_STD": None},
    "mistral_common.tokens.tokenizers.tekken": {"Tekkenizer": None},
    "mistral_common.tokens.tokenizers.sentencepiece": {"SentencePieceTokenizer": None},
}
if importlib.util.find_spec("mistral_common") is None:
    for name, attrs in STUBS.items():
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        for key, value in attrs.items():
            setattr(sys.modules[name], key, value)
sys.path[:0] = [str(llama_dir / "gguf-py"), str(llama_dir)]
import convert_hf_to_gguf as convert
if importlib.util.find_spec("sentencepiece") is None:
    create = convert.TextModel._create_vocab_sentencepiece
    def _create_vocab_sentencepiece(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
        return create(self)
    convert.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece
original = convert.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        pre = json.loads((self.dir_model / "tokenizer.json").read_text(encoding="utf-8")).get("pre_tokenizer") or {}
        if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
            print("llamacpp_bench: BPE pre-tokenizer hash unknown to convert_hf_to_gguf.py; tokenizer.json's is "
                  "plain ByteLevel (the GPT-2 regex): tokenizer.ggml.pre = gpt-2", file=sys.stderr)
            return "gpt-2"
        raise
convert.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [str(llama_dir / "convert_hf_to_gguf.py"), *sys.argv[2:]]
convert.main()
"""


# ----- pure parts: arguments, commands, medians, ratios -------------------------------------------------------
def parse_engine(spec: str) -> tuple[str, Path]:
    """`FORMAT=MODEL_REPOSITORY` (FORMAT float32 or int8): a rendered repository of the CPU engine."""
    fmt, sep, path = spec.partition("=")
    if not sep or fmt not in GGUF_TYPES or not path:
        raise argparse.ArgumentTypeError(f"--engine FORMAT=MODEL_REPOSITORY with FORMAT one of "
                                         f"{', '.join(GGUF_TYPES)}, got {spec!r}")
    return fmt, Path(path)


def parse_concurrencies(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None
    if not values or any(c < 1 for c in values):
        raise argparse.ArgumentTypeError(f"concurrencies must be >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", type=parse_engine, action="append", default=[], metavar="FORMAT=REPO",
                        help="a rendered CPU-engine model repository and its weight format (float32 -> f32 GGUF, "
                             "int8 -> q8_0 GGUF); repeat for both")
    parser.add_argument("--work-dir", type=Path, help="GGUFs, logs and the stacks' work folders (required)")
    parser.add_argument("--llama-server", help="the llama-server binary (default: $LLAMA_SERVER, else PATH, else "
                                               "build/llama.cpp/bin/llama-server)")
    parser.add_argument("--llama-cpp-dir", type=Path, default=DEFAULT_LLAMA_CPP,
                        help="where `make llama-cpp` put llama.cpp: its llama.cpp/ (convert_hf_to_gguf.py, gguf-py) "
                             "and bin/ (llama-quantize)")
    parser.add_argument("--concurrency", type=parse_concurrencies, default=CONCURRENCIES,
                        help="comma-separated (default 1,16)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--tokens-per-level", type=int, default=TOKENS_PER_LEVEL,
                        help="at least this many output tokens per level (whole waves, at least two)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="user text per prompt")
    parser.add_argument("--warmup", type=int, default=WARMUP_REQUESTS, help="requests per server before round 0")
    parser.add_argument("--threads", type=int, default=LLAMA_THREADS, help="llama-server -t / -tb")
    parser.add_argument("--parallel", type=int, default=0,
                        help="llama-server -np (default: the highest concurrency, at least 1)")
    parser.add_argument("--ctx-per-slot", type=int, default=LLAMA_CTX_PER_SLOT,
                        help="llama-server context per slot (-c = this x -np)")
    parser.add_argument("--quiet-cores", type=float, default=QUIET_CORES,
                        help="a level is quiet when the rest of the machine kept fewer cores busy (default 0.25)")
    parser.add_argument("--llama-arg", action="append", default=[],
                        help="one more llama-server argument, with `=`: --llama-arg=-fa (repeat)")
    parser.add_argument("--tables-from", type=Path, metavar="RESULTS_JSON",
                        help="only print the tables of an earlier run's results.json (with --quiet-cores)")
    parser.add_argument("--results-dir", type=Path,
                        default=Path(os.environ["BENCH_OUT"]) if os.environ.get("BENCH_OUT") else None,
                        help="default: $BENCH_OUT, else benchmarks/results/<date>/llamacpp")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tables_from:
        return args
    if not args.engine or args.work_dir is None:
        parser.error("--engine FORMAT=REPO (at least one) and --work-dir are required")
    formats = [fmt for fmt, _ in args.engine]
    if len(set(formats)) != len(formats):
        parser.error(f"--engine: one repository per format, got {', '.join(formats)}")
    if args.rounds < 1 or args.max_tokens < 1:
        parser.error("--rounds and --max-tokens must be >= 1")
    args.parallel = args.parallel or max(args.concurrency)
    return args


def resolve_llama_server(explicit: str | None, env: Mapping[str, str], which: Any = shutil.which,
                         built: Path = DEFAULT_LLAMA_CPP / "bin" / "llama-server") -> Path | None:
    """--llama-server, else $LLAMA_SERVER, else PATH, else what `make llama-cpp` built; None if nothing is there.
    An explicit choice (flag or variable) that names nothing is an error, not a fallback."""
    for chosen, origin in ((explicit, "--llama-server"), (env.get("LLAMA_SERVER"), "LLAMA_SERVER")):
        if chosen:
            found = which(chosen) if os.sep not in chosen else (chosen if Path(chosen).is_file() else None)
            if not found:
                raise FileNotFoundError(f"{origin}={chosen}: no such executable")
            return Path(found).resolve()
    on_path = which("llama-server")
    if on_path:
        return Path(on_path).resolve()
    return built if built.is_file() else None


def find_quantize(llama_server: Path, llama_cpp_dir: Path, which: Any = shutil.which) -> Path | None:
    """llama-quantize next to llama-server, else on PATH, else in `make llama-cpp`'s bin/."""
    for candidate in (llama_server.parent / "llama-quantize", which("llama-quantize"),
                      llama_cpp_dir / "bin" / "llama-quantize"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def convert_command(python: str, llama_dir: Path, checkpoint: Path, outfile: Path, outtype: str) -> list[str]:
    """convert_hf_to_gguf.py (through _CONVERT_HELPER) on a Hugging Face checkpoint directory."""
    return [python, "-c", _CONVERT_HELPER, str(llama_dir), str(checkpoint), "--outtype", outtype,
            "--outfile", str(outfile)]


def quantize_command(quantize: Path, source: Path, outfile: Path, gguf_type: str, threads: int) -> list[str]:
    return [str(quantize), str(source), str(outfile), gguf_type.upper(), str(threads)]


def llama_server_command(binary: Path, gguf: Path, port: int, threads: int = LLAMA_THREADS,
                         parallel: int = LLAMA_PARALLEL, ctx_per_slot: int = LLAMA_CTX_PER_SLOT,
                         extra: Sequence[str] = ()) -> list[str]:
    """llama-server as measured: continuous batching over `parallel` slots of `ctx_per_slot` tokens each,
    `threads` for generation and batches, the GGUF's own chat template (--jinja), no web UI."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-cb",
            "-c", str(parallel * ctx_per_slot), "--jinja", "--no-webui", *extra]


def requests_for(concurrency: int, tokens_per_level: int, max_tokens: int, min_waves: int = MIN_WAVES) -> int:
    """Whole waves of `concurrency` requests: at least `tokens_per_level` output tokens and `min_waves` waves
    (concurrency 1 is a closed loop of single requests: no wave minimum)."""
    waves = math.ceil(math.ceil(tokens_per_level / max_tokens) / concurrency)
    return concurrency * max(waves, min_waves if concurrency > 1 else 1)


def round_order(round_index: int, level_index: int, systems: Sequence[str] = (OURS, LLAMA)) -> list[str]:
    """Who runs first alternates from level to level and from round to round."""
    k = (round_index + level_index) % len(systems)
    return [*systems[k:], *systems[:k]]


def medians(rows: Sequence[Mapping[str, Any]], quiet_cores: float = QUIET_CORES) -> list[dict[str, Any]]:
    """One row per (format, system, concurrency): median tok/s and CPU µs/token per group over the rounds, and
    the median tok/s of the quiet levels alone (others' cores < `quiet_cores`; None when there is none)."""
    keys = list(dict.fromkeys((r["format"], r["system"], r["concurrency"]) for r in rows))
    out = []
    for fmt, system, c in keys:
        mine = [r for r in rows if (r["format"], r["system"], r["concurrency"]) == (fmt, system, c)]
        groups = list(dict.fromkeys(g for r in mine for g in r["cpu_us_per_token"]))
        out.append({
            "format": fmt, "system": system, "target": mine[0]["target"], "concurrency": c, "rounds": len(mine),
            "output_tok_per_s": statistics.median(r["output_tok_per_s"] or 0.0 for r in mine),
            "output_tok_per_s_all": [r["output_tok_per_s"] for r in mine],
            "cpu_us_per_token": {g: _median_or_none(r["cpu_us_per_token"].get(g) for r in mine) for g in groups},
            "ttft_p50_ms": _median_or_none(r["ttft_ms"]["p50"] for r in mine),
            "itl_p50_ms": _median_or_none(r["itl_ms"]["p50"] for r in mine),
            "errors": sum(r["errors"] for r in mine),
            "wrong_length": sum(r["wrong_length"] for r in mine),
            "loadavg_1m": _median_or_none(r["loadavg_1m"] for r in mine),
            "machine_busy_cores": _median_or_none(r["machine_busy_cores"] for r in mine),
            "others_cores": _median_or_none(r.get("others_cores") for r in mine),
            "quiet_levels": len(quiet := [r for r in mine if (r.get("others_cores") or 0.0) < quiet_cores]),
            "quiet_tok_per_s": _median_or_none(r["output_tok_per_s"] for r in quiet),
        })
    return out


def _median_or_none(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratios(summary: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """ours / llama.cpp per (format, concurrency): of the median tok/s, of the median server CPU µs per token,
    and every round's own tok/s ratio (the two ran back to back in that round)."""
    by = {(m["format"], m["system"], m["concurrency"]): m for m in summary}
    out = []
    for (fmt, system, c), ours in by.items():
        theirs = by.get((fmt, LLAMA, c))
        if system != OURS or theirs is None:
            continue
        per_round = []
        for r in sorted({row["round"] for row in rows if row["format"] == fmt and row["concurrency"] == c}):
            pair = {row["system"]: row for row in rows
                    if (row["format"], row["concurrency"], row["round"]) == (fmt, c, r)}
            if OURS in pair and LLAMA in pair and pair[LLAMA]["output_tok_per_s"]:
                per_round.append(pair[OURS]["output_tok_per_s"] / pair[LLAMA]["output_tok_per_s"])
        ours_cpu, their_cpu = ours["cpu_us_per_token"].get("server"), theirs["cpu_us_per_token"].get("server")
        out.append({
            "format": fmt, "gguf": GGUF_TYPES[fmt], "concurrency": c,
            "ours_tok_per_s": ours["output_tok_per_s"], "llama_tok_per_s": theirs["output_tok_per_s"],
            "tok_per_s_ratio": (ours["output_tok_per_s"] / theirs["output_tok_per_s"]
                                if theirs["output_tok_per_s"] else None),
            "tok_per_s_ratio_per_round": per_round,
            "ours_cpu_us_per_token": ours_cpu, "llama_cpu_us_per_token": their_cpu,
            "cpu_per_token_ratio": ours_cpu / their_cpu if ours_cpu is not None and their_cpu else None,
            "quiet_levels": (ours.get("quiet_levels", 0), theirs.get("quiet_levels", 0)),
            "quiet_ratio": (ours["quiet_tok_per_s"] / theirs["quiet_tok_per_s"]
                            if ours.get("quiet_tok_per_s") and theirs.get("quiet_tok_per_s") else None),
        })
    return out


def _f(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def ratio_table(rows: Sequence[Mapping[str, Any]]) -> str:
    columns = [("ours vs llama.cpp", "l"), ("conc", "r"), ("ours tok/s", "r"), ("llama.cpp tok/s", "r"),
               ("**ratio**", "r"), ("ratio each round", "l"), ("ours CPU µs/token", "r"),
               ("llama.cpp CPU µs/token", "r"), ("CPU ratio", "r"),
               ("quiet levels: ratio (ours, llama.cpp levels)", "r")]
    return report.markdown_table(columns, (
        [f"{r['format']} vs {r['gguf']}", str(r["concurrency"]), _f(r["ours_tok_per_s"], 1),
         _f(r["llama_tok_per_s"], 1), f"**{_f(r['tok_per_s_ratio'], 2)}**",
         ", ".join(f"{x:.2f}" for x in r["tok_per_s_ratio_per_round"]), _f(r["ours_cpu_us_per_token"]),
         _f(r["llama_cpu_us_per_token"]), _f(r["cpu_per_token_ratio"], 2),
         f"{_f(r.get('quiet_ratio'), 2)} ({', '.join(map(str, r.get('quiet_levels', ())))})"]
        for r in rows))


def median_table(summary: Sequence[Mapping[str, Any]]) -> str:
    columns = [("target", "l"), ("conc", "r"), ("rounds", "r"), ("tok/s (median)", "r"), ("every round", "l"),
               *((title, "r") for title in ("TTFT p50 ms", "ITL p50 ms", "frontend", "tritonserver", "engine",
                                            "other models", "llama-server", "**server**", "loadgen", "load avg 1m",
                                            "others' cores", "quiet levels: tok/s (n)", "errors / wrong length"))]
    rows = []
    for m in summary:
        us = m["cpu_us_per_token"]
        rows.append([m["target"], str(m["concurrency"]), str(m["rounds"]), _f(m["output_tok_per_s"], 1),
                     ", ".join(_f(x, 1) for x in m["output_tok_per_s_all"]), _f(m["ttft_p50_ms"]),
                     _f(m["itl_p50_ms"], 1), _f(us.get("frontend")), _f(us.get("tritonserver")),
                     _f(us.get("engine")), _f(us.get("other_models")), _f(us.get("llama-server")),
                     f"**{_f(us.get('server'))}**", _f(us.get("loadgen")), _f(m["loadavg_1m"], 1),
                     _f(m.get("others_cores"), 2), f"{_f(m.get('quiet_tok_per_s'), 1)} ({m.get('quiet_levels', 0)})",
                     f"{m['errors']} / {m['wrong_length']}"])
    return report.markdown_table(columns, rows)


def cpu_description(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU model and the vector flags that decide these kernels (lscpu's `Model name` and `Flags`)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = platform.processor() or platform.machine(), set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
    return {"model": model, "cpus": os.cpu_count(), "flags": [f for f in wanted if f in flags]}


# ----- GGUF files ---------------------------------------------------------------------------------------------
def engine_checkpoint(model_repository: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory the engine of a rendered repository was built from, and its engine record."""
    engine_dir = servers.repository_parameter(model_repository, "tensorrt_llm", "gpt_model_path")
    candidates = [Path(engine_dir)] if engine_dir else []
    candidates.append(model_repository.parent / "engine")
    for candidate in candidates:
        record_path = candidate / "engine_config.json"
        if record_path.is_file():
            record = json.loads(record_path.read_text())
            return Path(record["checkpoint_dir"]), record
    raise FileNotFoundError(f"no engine_config.json for {model_repository} (looked in "
                            f"{', '.join(map(str, candidates))})")


def _fresh(target: Path, source: Path) -> bool:
    return target.is_file() and target.stat().st_mtime >= source.stat().st_mtime


def ensure_gguf(checkpoint: Path, gguf_type: str, out_dir: Path, llama_dir: Path, quantize: Path | None,
                threads: int, log_dir: Path) -> tuple[Path, str]:
    """The checkpoint as a GGUF of `gguf_type` (f32, or q8_0 quantized from the f32 one), converted unless a
    file newer than the checkpoint's weights is already there. Returns the path and how it was made."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = checkpoint / "model.safetensors"
    if not weights.is_file():
        weights = checkpoint / "config.json"
    f32 = out_dir / f"{checkpoint.name}-f32.gguf"
    if not _fresh(f32, weights):
        _run(convert_command(sys.executable, llama_dir, checkpoint, f32, "f32"), log_dir / "convert-f32.log")
    if gguf_type == "f32":
        return f32, "convert_hf_to_gguf.py --outtype f32"
    target = out_dir / f"{checkpoint.name}-{gguf_type}.gguf"
    how = (f"llama-quantize {gguf_type.upper()} from the f32 GGUF" if quantize
           else f"convert_hf_to_gguf.py --outtype {gguf_type}")
    if not _fresh(target, f32):
        command = (quantize_command(quantize, f32, target, gguf_type, threads) if quantize
                   else convert_command(sys.executable, llama_dir, checkpoint, target, gguf_type))
        _run(command, log_dir / f"convert-{gguf_type}.log")
    return target, how


def _run(command: list[str], log_file: Path) -> None:
    print(f"  {' '.join(command[:2] if command[1] == '-c' else command)}{' ...' if command[1] == '-c' else ''} "
          f"(log {log_file})", flush=True)
    with open(log_file, "w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=servers.REPO_ROOT)
    if result.returncode:
        tail = log_file.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{command[0]} failed ({result.returncode}); last lines of {log_file}:\n"
                           + "\n".join(tail))


# ----- the servers --------------------------------------------------------------------------------------------
@dataclass
class Server:
    system: str
    fmt: str
    target: str
    base_url: str
    model: str
    processes: Any  # frontend_bench.Processes
    server_groups: tuple[str, ...]
    info: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def start_llama_server(binary: Path, gguf: Path, fmt: str, args: argparse.Namespace, log_dir: Path
                       ) -> Iterator[Server]:
    from benchmarks.frontend_bench import Processes
    from launcher.ports import find_free_port

    port = find_free_port()
    command = llama_server_command(binary, gguf, port, args.threads, args.parallel, args.ctx_per_slot,
                                   args.llama_arg)
    log_file = log_dir / f"llama-server-{fmt}.log"
    with open(log_file, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        servers.wait_http_ok(f"http://127.0.0.1:{port}/health", 300, process)
        processes = Processes({"llama-server": [process.pid], "loadgen": [os.getpid()]})
        yield Server(LLAMA, fmt, f"llama.cpp-{GGUF_TYPES[fmt]}", f"http://127.0.0.1:{port}/v1", gguf.stem,
                     processes, LLAMA_GROUPS, {"command": command, "log": str(log_file)})
    finally:
        servers.stop_process(process)


@contextlib.contextmanager
def start_our_stack(fmt: str, model_repository: Path, args: argparse.Namespace, log_dir: Path) -> Iterator[Server]:
    from benchmarks.overhead_bench import Stack, start_stack

    stack = Stack(f"ours-{fmt}", servers.REPO_ROOT, model_repository.resolve())
    with start_stack(stack, args.work_dir.resolve(), log_dir, max(args.concurrency)) as started:
        yield Server(OURS, fmt, f"ours-{fmt}", started.base_url, started.served, started.processes, OUR_GROUPS,
                     {"model_repository": str(model_repository), "processes": started.processes.groups})


def llama_server_version(binary: Path) -> str:
    try:
        result = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    return " ".join((result.stdout + result.stderr).split())


def llama_system_info(log_file: Path) -> str:
    """llama-server's `system_info` line (the CPU features ggml was built with and uses)."""
    with contextlib.suppress(OSError):
        for line in Path(log_file).read_text(errors="replace").splitlines():
            if "system_info" in line:
                return line.split("system_info:", 1)[-1].strip()
    return ""


# ----- the levels ---------------------------------------------------------------------------------------------
def fresh_connection_target(base_url: str, model: str, max_tokens: int, label: str) -> Any:
    """loadgen's OpenAITarget on a client that keeps no connection alive: one TCP connection per request.

    llama-server (this version) ends each stream with its content provider returning false after the last
    chunk, which cpp-httplib treats as a failed write: it closes the connection after a complete response
    that said nothing about closing. A keep-alive client that sends its next request on that connection
    before the close arrives gets "Server disconnected without sending a response"; here that happened on
    a few requests per run, more when the machine is busy. Both servers get the same client, so the one
    loopback connect per request (~0.1 ms against a request of a second or more) is paid on both sides."""
    import httpx

    from benchmarks.loadgen import OpenAITarget

    class FreshConnectionTarget(OpenAITarget):
        async def open(self, concurrency: int) -> None:
            await self.close()
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10),
                                             limits=httpx.Limits(max_connections=concurrency + 4,
                                                                 max_keepalive_connections=0))

    return FreshConnectionTarget(base_url, model, max_tokens, label=label)


async def measure(server: Server, prompts: Sequence[str], concurrency: int, requests: int, max_tokens: int,
                  offset: int) -> dict[str, Any]:
    """One closed-loop level on one server, with each process group's CPU time over it (frontend_bench's
    /proc readings) and the load average when it began."""
    from benchmarks.frontend_bench import machine_busy_seconds
    from benchmarks.loadgen import run_workload_level
    from benchmarks.metrics import summarize

    target = fresh_connection_target(server.base_url, server.model, max_tokens, server.target)
    load = os.getloadavg()[0]
    before, busy_before, start = server.processes.snapshot(), machine_busy_seconds(), time.perf_counter()
    timings, _ = await run_workload_level(target, prompts, concurrency, requests, progress=False, offset=offset)
    wall = time.perf_counter() - start
    spent = server.processes.spent(before, server.processes.snapshot())
    busy = machine_busy_seconds() - busy_before
    row: dict[str, Any] = {"target": server.target, "system": server.system, "format": server.fmt,
                           "concurrency": concurrency, **summarize(timings)}
    errors = [t.error for t in timings if t.error]
    if errors:
        row["first_error"] = errors[0]
    lengths = [t.output_tokens for t in timings if t.error is None]
    tokens = row["output_tokens"]
    per_token = {g: (s / tokens * 1e6 if tokens else None) for g, s in spent.items()}
    per_token["server"] = sum(per_token[g] for g in server.server_groups) if tokens else None
    row.update({"wall_s": wall, "cpu_s": spent, "cpu_us_per_token": per_token,
                "cpu_cores": {g: s / wall for g, s in spent.items()}, "machine_busy_cores": busy / wall,
                # what the rest of the machine kept busy meanwhile (other people's work: contention)
                "others_cores": max(0.0, (busy - sum(spent.values())) / wall),
                "loadavg_1m": load, "wrong_length": sum(n != max_tokens for n in lengths),
                "output_tokens_min": min(lengths, default=None), "output_tokens_max": max(lengths, default=None),
                "prompt_tokens": sorted({t.input_tokens for t in timings if t.error is None})})
    return row


async def run_pair(pair: Sequence[Server], prompts: Sequence[str], args: argparse.Namespace,
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Warm-up on both (and the prompt lengths each counted), then the interleaved rounds."""
    from benchmarks.frontend_bench import idle_cores
    from benchmarks.loadgen import run_workload_level

    warm: dict[str, Any] = {}
    for server in pair:
        target = fresh_connection_target(server.base_url, server.model, args.max_tokens, server.target)
        timings, _ = await run_workload_level(target, prompts, min(max(args.concurrency), args.warmup or 1),
                                              args.warmup, progress=False)
        bad = [t.error for t in timings if t.error]
        if bad:
            raise RuntimeError(f"{server.target}: warm-up failed: {bad[0]}")
        warm[server.target] = {"prompt_tokens": sorted({t.input_tokens for t in timings}),
                               "output_tokens": sorted({t.output_tokens for t in timings}),
                               "idle_cores": await idle_cores(server.processes)}
        print(f"  {server.target}: warm; prompt tokens {warm[server.target]['prompt_tokens']}, output tokens "
              f"{warm[server.target]['output_tokens']}", flush=True)
    rows = []
    by_system = {s.system: s for s in pair}
    for r in range(args.rounds):
        for ci, c in enumerate(args.concurrency):
            n = requests_for(c, args.tokens_per_level, args.max_tokens)
            for system in round_order(r, ci, [s.system for s in pair]):
                row = await measure(by_system[system], prompts, c, n, args.max_tokens, offset=r * n)
                row["round"] = r
                rows.append(row)
                us = row["cpu_us_per_token"]
                print(f"  round {r} {row['target']:>16} c={c:<3} {row['output_tok_per_s'] or 0:8.1f} tok/s  "
                      f"errors {row['errors']}  wrong length {row['wrong_length']}  load {row['loadavg_1m']:.1f}  "
                      f"others' cores {row['others_cores']:.2f}  "
                      "µs/token " + ", ".join(f"{g} {v:.0f}" for g, v in us.items() if v is not None), flush=True)
    return rows, warm


def tables(rows: Sequence[Mapping[str, Any]], quiet_cores: float = QUIET_CORES
           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """The medians, the ratios and both tables (Markdown) of a run's rows."""
    summary = medians(rows, quiet_cores)
    ratio_rows = ratios(summary, rows)
    return summary, ratio_rows, "\n".join(["## ours / llama.cpp (medians over the rounds)", "", ratio_table(ratio_rows),
                                           "", "## Medians (CPU µs per output token, by process)", "",
                                           median_table(summary)])


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tables_from:
        print(tables(json.loads(args.tables_from.read_text())["results"], args.quiet_cores)[2])
        return
    from benchmarks.report import write_results
    from benchmarks.stack_bench import _git_commit
    from benchmarks.workload import Workload, load_tokenizer

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    binary = resolve_llama_server(args.llama_server, os.environ)
    if binary is None:
        sys.exit("no llama-server: give --llama-server or LLAMA_SERVER=, put one on PATH, or `make llama-cpp`")
    llama_dir = args.llama_cpp_dir / "llama.cpp"
    if not (llama_dir / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"no {llama_dir}/convert_hf_to_gguf.py: `make llama-cpp` (SOURCE_ONLY=1 to skip compiling)")
    quantize = find_quantize(binary, args.llama_cpp_dir)
    work_dir = args.work_dir.resolve()
    log_dir = work_dir / "bench_llamacpp_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    out_dir = args.results_dir or (servers.REPO_ROOT / "benchmarks" / "results" / dt.date.today().isoformat()
                                   / "llamacpp")
    cpu = cpu_description()
    version = llama_server_version(binary)
    print(f"llama.cpp benchmark: {binary} ({version}); {cpu['model']}, {cpu['cpus']} CPUs, "
          f"{' '.join(cpu['flags'])}; load average {os.getloadavg()[0]:.1f}", flush=True)

    rows: list[dict[str, Any]] = []
    pairs_info: dict[str, Any] = {}
    workload = None
    for fmt, repository in args.engine:
        checkpoint, record = engine_checkpoint(repository)
        if record.get("weights", "float32") != fmt:
            sys.exit(f"{repository}: its engine has {record.get('weights')} weights, not {fmt}")
        print(f"{fmt}: engine {repository} <- checkpoint {checkpoint}", flush=True)
        gguf, how = ensure_gguf(checkpoint, GGUF_TYPES[fmt], work_dir / "gguf", llama_dir, quantize, args.threads,
                                log_dir)
        tokenizer = load_tokenizer(checkpoint)
        workload = Workload(name="llamacpp", num_prompts=PROMPTS, input_tokens=args.prompt_tokens,
                            output_tokens=args.max_tokens, concurrencies=tuple(args.concurrency), rounds=args.rounds,
                            min_requests=0, warmup_requests=args.warmup, naive_max_requests=0, overhead_pairs=0)
        prompts = workload.prompts(tokenizer)
        with contextlib.ExitStack() as exits:
            ours = exits.enter_context(start_our_stack(fmt, repository, args, log_dir))
            print(f"  {ours.target} ready ({time.monotonic() - t0:.0f} s)", flush=True)
            theirs = exits.enter_context(start_llama_server(binary, gguf, fmt, args, log_dir))
            print(f"  {theirs.target} ready ({time.monotonic() - t0:.0f} s): {' '.join(theirs.info['command'])}",
                  flush=True)
            pair_rows, warm = asyncio.run(run_pair([ours, theirs], prompts, args))
        rows += pair_rows
        pairs_info[fmt] = {"checkpoint": str(checkpoint), "engine": record, "model_repository": str(repository),
                           "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "gguf_made_by": how,
                           "warmup": warm, "ours": ours.info, "llama_server": theirs.info,
                           "llama_system_info": llama_system_info(Path(theirs.info["log"]))}
        counted = {t: w["prompt_tokens"] for t, w in warm.items()}
        if len({tuple(v) for v in counted.values()}) > 1:
            print(f"  NOTE: the two count different prompt lengths: {counted}", flush=True)

    summary, ratio_rows, markdown = tables(rows, args.quiet_cores)
    meta = {
        "title": f"Our stack vs llama.cpp llama-server: streaming chat, {args.max_tokens} output tokens, "
                 f"concurrency {', '.join(map(str, args.concurrency))}",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{cpu['model']}, {cpu['cpus']} CPUs ({', '.join(cpu['flags'])}), "
                   f"Python {platform.python_version()}",
        "cpu": cpu, "git_commit": _git_commit(), "llama_server": str(binary), "llama_server_version": version,
        "workload": workload.to_dict() if workload else {}, "wall_s": time.monotonic() - t0,
        "loadavg_end": os.getloadavg(), "pairs": pairs_info, "medians": summary, "ours_vs_llama": ratio_rows,
        "notes": ["Ratios: ours / llama.cpp, of the medians over the rounds (tok/s: > 1 means ours is faster; "
                  "CPU µs per output token: > 1 means ours spends more). `server` CPU = frontend + tritonserver + "
                  "engine stub + the idle pre/postprocessing stubs for ours, the llama-server process for "
                  "llama.cpp; `loadgen` is this process. Within a format both servers are up; each level runs on "
                  "one while the other idles, who goes first alternating. `others' cores`: the cores the rest of "
                  "the machine kept busy during the level (/proc/stat less every process measured here): "
                  "contention from other work; `quiet levels`: the medians of the levels where that stayed under "
                  f"{args.quiet_cores} cores (n = how many)."],
    }
    paths = write_results(out_dir, meta, rows, [], plots=False, sections=[markdown])
    print(markdown)
    print(f"load average at the end {os.getloadavg()[0]:.1f}; results: {paths['md']} ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
