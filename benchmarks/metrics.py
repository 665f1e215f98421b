"""One definition of every load-test figure, used for our own timestamps and perf_analyzer's export alike.

Definitions (genai-perf / AIPerf / vLLM conventions; see benchmarks/README.md):
- TTFT: request sent -> first response that carries at least one output token.
- E2E latency: request sent -> last response that carries an output token.
- ITL (= vLLM's TPOT): (E2E - TTFT) / (output tokens - 1), per request; undefined for 1 token.
- Benchmark duration: first request sent -> last token-carrying response received, over all requests.
- Output tokens/s = total output tokens / duration; requests/s = completed requests / duration.
- Percentiles: linear interpolation between closest ranks (numpy's default), p50/p90/p99.
All times are seconds on one monotonic clock; the perf_analyzer parser converts its nanoseconds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class RequestTiming:
    """One request as a client saw it: when it was sent, when each token-carrying response arrived, and
    how many output tokens it produced (the server's count where it gives one)."""

    start: float
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    input_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.start

    @property
    def end(self) -> float:
        return self.token_times[-1]

    @property
    def itl(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _stats(values: list[float], scale: float) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        v = percentile(values, p)
        out[f"p{p}"] = None if math.isnan(v) else v * scale
    out["mean"] = (sum(values) / len(values) * scale) if values else None
    return out


def summarize(timings: Iterable[RequestTiming], duration_s: float | None = None) -> dict[str, Any]:
    """Every figure for one (target, concurrency) cell. Latencies in ms. `duration_s` defaults to the
    span from the first request sent to the last token received."""
    timings = list(timings)
    done = [t for t in timings if t.ok]
    if duration_s is None:
        duration_s = (max(t.end for t in done) - min(t.start for t in done)) if done else 0.0
    output_tokens = sum(t.output_tokens for t in done)
    itls = [t.itl for t in done if t.itl is not None]
    return {
        "requests": len(done),
        "errors": len(timings) - len(done),
        "duration_s": duration_s,
        "input_tokens": sum(t.input_tokens for t in done),
        "output_tokens": output_tokens,
        "output_tokens_per_request": (output_tokens / len(done)) if done else None,
        "output_tok_per_s": output_tokens / duration_s if duration_s > 0 else None,
        "req_per_s": len(done) / duration_s if duration_s > 0 else None,
        "ttft_ms": _stats([t.ttft for t in done], 1e3),
        "itl_ms": _stats(itls, 1e3),
        "e2e_ms": _stats([t.e2e for t in done], 1e3),
    }


# ----- perf_analyzer --profile-export-file ---------------------------------------------------------------
def _response_tokens(output: Any) -> int | None:
    """Output tokens in one exported response: len(output_ids) when the export carries them; 1 for an
    ensemble `text_output` (one response per token); for an OpenAI SSE event 1 if it has content; 0 for
    an empty response (a bare final flag); None when the export says nothing about it."""
    if not isinstance(output, dict) or not output:
        return 0 if output == {} else None
    if "output_ids" in output:
        ids = output["output_ids"]
        if isinstance(ids, dict):  # {"content": [...], "shape": [...]} form
            ids = ids.get("content", [])
        return len(_flatten(ids))
    if "text_output" in output:  # the ensemble: one streamed response per token, even one that decodes to ""
        return 1
    if "response" in output:  # OpenAI service kind: raw SSE text; 1 if any event carries content
        return 1 if _sse_has_content(str(output["response"])) else 0
    return None


def _sse_has_content(text: str) -> bool:
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        try:
            chunk = json.loads(line[len("data:"):])
        except ValueError:
            continue
        for choice in chunk.get("choices") or []:
            if (choice.get("delta") or {}).get("content") or choice.get("text"):
                return True
    return False


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, list):
        return [x for v in value for x in _flatten(v)]
    return [value]


def _input_tokens(inputs: dict[str, Any]) -> int:
    if "input_lengths" in inputs:
        return int(_flatten(inputs["input_lengths"])[0])
    if "input_ids" in inputs:
        return len(_flatten(inputs["input_ids"]))
    return 0


def parse_pa_request(record: dict[str, Any]) -> RequestTiming:
    """One `experiments[].requests[]` record (ns timestamps) as a RequestTiming (seconds).

    Responses that carry no token (empty outputs, a final-flag-only response) are dropped before timing,
    as genai-perf does; when the export has no outputs, every response counts as one token."""
    start = record["timestamp"] / 1e9
    times = [t / 1e9 for t in record.get("response_timestamps", [])]
    outputs = record.get("response_outputs")
    timing = RequestTiming(start=start, input_tokens=_input_tokens(record.get("request_inputs") or {}))
    if outputs is None or len(outputs) != len(times):
        timing.token_times = times
        timing.output_tokens = len(times)
        return timing
    for t, output in zip(times, outputs):
        n = _response_tokens(output)
        n = 1 if n is None else n
        if n > 0:
            timing.token_times.append(t)
            timing.output_tokens += n
    return timing


def parse_pa_export(export: dict[str, Any] | str | Path) -> list[dict[str, Any]]:
    """A perf_analyzer profile export -> one summary per experiment, with its mode and value
    (e.g. concurrency 4). Duration runs from the first request sent to the last token received."""
    if not isinstance(export, dict):
        export = json.loads(Path(export).read_text())
    results = []
    for experiment in export.get("experiments", []):
        info = experiment.get("experiment", {})
        timings = [parse_pa_request(r) for r in experiment.get("requests", [])]
        summary = summarize(timings)
        summary["mode"] = info.get("mode")
        summary["value"] = info.get("value")
        results.append(summary)
    return results
