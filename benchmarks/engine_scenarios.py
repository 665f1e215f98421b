"""The prefix-reuse, memory-bound and high-concurrency scenarios of `benchmarks.engine_bench`.

- (a) `prefix_ttft`: TTFT of a chat request whose long system prompt is already cached vs one never seen;
- (b) `shared_prefix_level`: 16 users behind one 1,000-token system prompt (run once per server: prefix
  reuse on, then off);
- (c) `memory_bandwidth`, `runner_weight_bytes`: what a batch-1 decode step must read and how fast this
  machine reads it;
- (d) `build_c64_engine`, `sampled_level`: 64 concurrent requests in the KV memory of 32 full-length
  sequences, with the engine's Prometheus metrics sampled during the level;
- (w) `quality_tokens`, `logits_over`, `compare_logits`: the int8 engine's logits against float32's over
  a fixed token set (top-1 agreement, max logit error); its speed is measured in engine_bench;
- (l) `attention_timer`: what the decode-attention kernel takes of plain decode steps at long contexts, and
  how fast it reads the K/V rows; the steps are measured in engine_bench.

Except (w) and (l), everything here measures through the same OpenAI endpoint as the stack levels (`loadgen`),
and reads the engine's metrics from Triton's metrics port, tolerating metrics the engine does not publish ("n/a").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
import torch

from benchmarks.loadgen import LevelResult, Messages, run_conversations_level
from benchmarks.servers import REPO_ROOT, repository_parameter
from benchmarks.workload import WORDS

ENGINE_MODEL = "tensorrt_llm"
REUSE_KEY = "enable_kv_cache_reuse"
# The KV pool's size in tokens as the rendered repository names it (the CPU engine's own key, or
# TensorRT-LLM's); `kv_cache_tokens` in engine_config.json otherwise.

# The engine's metrics these scenarios read (label model="tensorrt_llm"); any may be missing.
ENGINE_METRICS = (
    "cpu_engine_kv_cache_blocks_used",
    "cpu_engine_kv_cache_blocks_total",
    "cpu_engine_requests_running",
    "cpu_engine_requests_waiting",
    "cpu_engine_prefix_cache_hits_tokens_total",
    "cpu_engine_prefix_cache_queries_tokens_total",
    "cpu_engine_preemptions_total",
)
# Older names for the same things, sampled too so a peak shows even where the new names are missing.
LEGACY_METRICS = ("cpu_engine_active_slots", "cpu_engine_queued_requests", "cpu_engine_kv_cache_used_tokens")


# ----- prompts --------------------------------------------------------------------------------------------
def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text`, without the tokenizer's warning about texts longer than the model's context
    (the ids are cut afterwards)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    finally:
        hf_logging.set_verbosity(verbosity)


def _body_ids(tokenizer: Any, seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return _encode(tokenizer, " ".join(rng.choice(WORDS) for _ in range(tokens * 2)))


def system_prompt(tokenizer: Any, tokens: int, nonce: str, seed: int = 7) -> str:
    """A system prompt of about `tokens` tokens: `nonce` first (so prompts with different nonces share
    nothing a prefix cache could reuse), then the same seeded text, cut so the whole is `tokens` long."""
    head = f"Session {nonce}. You are a helpful assistant; read these notes first."
    body_ids = _body_ids(tokenizer, seed, tokens)
    cut = max(tokens - len(_encode(tokenizer, head)), 0)
    text = head
    for _ in range(4):  # the join may merge or split a token or two: nudge the cut until the length is right
        text = head + " " + tokenizer.decode(body_ids[:cut], skip_special_tokens=True,
                                             clean_up_tokenization_spaces=False)
        length = len(_encode(tokenizer, text))
        if length == tokens or cut <= 0:
            break
        cut += tokens - length
    return text


def user_turn(index: int, salt: str = "") -> str:
    rng = random.Random(f"{salt}{index}")
    return f"Question {salt}{index}: " + " ".join(rng.choice(WORDS) for _ in range(10)) + "?"


def conversation(system: str, user: str) -> Messages:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def fit_prompt(wanted: int, max_seq_len: int, reserve: int) -> int:
    """`wanted` tokens, or fewer if the engine's max_seq_len leaves no room for the rest (`reserve`: the
    chat template, the user's turn and the output)."""
    return max(16, min(wanted, max_seq_len - reserve))


def new_nonce(rng: random.Random) -> str:
    return f"{rng.randrange(10**7, 10**8)}"


# ----- the engine's metrics -------------------------------------------------------------------------------
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')


def parse_prometheus(text: str, model: str = ENGINE_MODEL) -> dict[str, float]:
    """name -> value for every sample labelled model="<model>" (or without a model label)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        model_label = re.search(r'model="([^"]*)"', labels or "")
        if model_label and model_label.group(1) != model:
            continue
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


async def read_metrics(client: httpx.AsyncClient, metrics_url: str | None) -> dict[str, float]:
    if not metrics_url:
        return {}
    try:
        response = await client.get(metrics_url, timeout=5)
        response.raise_for_status()
    except httpx.HTTPError:
        return {}
    return parse_prometheus(response.text)


def fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def hit_rate(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Prefix-cache tokens looked up and found between two readings (None where not published)."""
    hits_name = "cpu_engine_prefix_cache_hits_tokens_total"
    queries_name = "cpu_engine_prefix_cache_queries_tokens_total"
    if hits_name not in after or queries_name not in after:
        return {"prefix_hit_tokens": None, "prefix_query_tokens": None, "prefix_hit_rate": None}
    hits = after[hits_name] - before.get(hits_name, 0.0)
    queries = after[queries_name] - before.get(queries_name, 0.0)
    return {"prefix_hit_tokens": int(hits), "prefix_query_tokens": int(queries),
            "prefix_hit_rate": round(hits / queries, 3) if queries else None}


@dataclass
class MetricsSampler:
    """Reads the metrics port every `interval_s` while a level runs; keeps each metric's peak and last."""

    metrics_url: str | None
    interval_s: float = 0.2
    peaks: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    samples: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient() as client:
            while not stop.is_set():
                values = await read_metrics(client, self.metrics_url)
                if values:
                    self.samples += 1
                    self.last = values
                    for name in (*ENGINE_METRICS, *LEGACY_METRICS):
                        if name in values:
                            self.peaks[name] = max(self.peaks.get(name, float("-inf")), values[name])
                try:
                    await asyncio.wait_for(stop.wait(), self.interval_s)
                except asyncio.TimeoutError:
                    pass


def _metric(values: dict[str, float], name: str) -> int | None:
    return int(values[name]) if name in values else None


# ----- (a) cached vs cold system prompt ---------------------------------------------------------------------
async def first_token_chat(client: httpx.AsyncClient, base_url: str, model: str,
                           messages: Messages) -> tuple[float, int]:
    """TTFT of a one-token streaming chat request: sent -> the response carrying its token (content, or
    the finish when the token has no text of its own yet), and the prompt's length from the usage chunk."""
    body = {"model": model, "messages": messages, "max_tokens": 1, "min_tokens": 1, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start, first, prompt_tokens = time.perf_counter(), None, 0
    async with client.stream("POST", f"{base_url}/chat/completions", json=body) as response:
        if response.is_error:
            await response.aread()
            response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"stream failed: {chunk['error'].get('message')}")
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
            for choice in chunk.get("choices") or []:
                if first is None and (choice.get("delta", {}).get("content") or choice.get("finish_reason")):
                    first = now
    if first is None:
        raise RuntimeError("no token came back")
    return first - start, prompt_tokens


async def prefix_ttft(base_url: str, model: str, tokenizer: Any, system_tokens: int, repetitions: int,
                      metrics_url: str | None, seed: int | None = None) -> dict[str, Any]:
    """Per repetition: a request with a system prompt never seen before (cold: a fresh nonce at its
    start), then the same system prompt with another short user turn (cached). Medians and their ratio."""
    rng = random.Random(seed if seed is not None else time.time_ns())
    cold, cached, prompt_lengths = [], [], []
    async with httpx.AsyncClient(timeout=600) as client:
        warm = system_prompt(tokenizer, system_tokens, new_nonce(rng))  # the long-prompt path, not measured
        for user in ("warm-up a", "warm-up b"):
            await first_token_chat(client, base_url, model, conversation(warm, user))
        before = await read_metrics(client, metrics_url)
        for i in range(repetitions):
            system = system_prompt(tokenizer, system_tokens, new_nonce(rng))
            ttft, length = await first_token_chat(client, base_url, model, conversation(system, user_turn(i, "A")))
            cold.append(ttft)
            prompt_lengths.append(length)
            ttft, _ = await first_token_chat(client, base_url, model, conversation(system, user_turn(i, "B")))
            cached.append(ttft)
            print(f"  (a) rep {i + 1}: cold {cold[-1] * 1000:.1f} ms, cached {cached[-1] * 1000:.1f} ms "
                  f"({length} prompt tokens)", flush=True)
        after = await read_metrics(client, metrics_url)
    cold_ms, cached_ms = statistics.median(cold) * 1000, statistics.median(cached) * 1000
    return {"system_prompt_tokens": system_tokens, "prompt_tokens_p50": int(statistics.median(prompt_lengths)),
            "repetitions": repetitions, "cold_ttft_ms_p50": round(cold_ms, 1),
            "cached_ttft_ms_p50": round(cached_ms, 1), "ratio_cached_to_cold": round(cached_ms / cold_ms, 3),
            "cold_ttft_ms": [round(t * 1000, 1) for t in cold], "cached_ttft_ms": [round(t * 1000, 1) for t in cached],
            **hit_rate(before, after)}


# ----- (b) many users behind one system prompt ----------------------------------------------------------------
async def shared_prefix_level(base_url: str, model: str, tokenizer: Any, system_tokens: int, users: int,
                              output_tokens: int, rounds: int, runs: int, metrics_url: str | None) -> dict[str, Any]:
    """`users` concurrent users, each with its own short question behind the same system prompt, `rounds`
    requests each, `output_tokens` each; the best (highest tokens/s) of `runs` runs. One request with the
    system prompt goes first, unmeasured, as a system prompt in service has been seen before."""
    system = system_prompt(tokenizer, system_tokens, "shared")
    requests = users * rounds
    async with httpx.AsyncClient(timeout=600) as client:
        await first_token_chat(client, base_url, model, conversation(system, "warm-up"))
        before = await read_metrics(client, metrics_url)
    best: dict[str, Any] | None = None
    for run in range(runs):
        conversations = [conversation(system, user_turn(i, f"r{run}u")) for i in range(requests)]
        result = await run_conversations_level(base_url, model, users, requests, output_tokens, conversations)
        row = {**result.summary(), "prompt_tokens_p50": _p50(result.prompt_tokens)}
        print(f"    run {run + 1}: {row}", flush=True)
        if best is None or row["output_tok_per_s"] > best["output_tok_per_s"]:
            best = row
    async with httpx.AsyncClient(timeout=600) as client:
        after = await read_metrics(client, metrics_url)
    assert best is not None
    return {**best, "system_prompt_tokens": system_tokens, **hit_rate(before, after)}


def _p50(values: list[int]) -> int | None:
    values = [v for v in values if v]
    return int(statistics.median(values)) if values else None


# ----- (c) the memory-bandwidth bound of a batch-1 step ----------------------------------------------------------
def memory_bandwidth(gib: float = 1.5, runs: int = 5) -> float:
    """Bytes/s this machine reads, best of `runs`: one sum over a `gib` GiB float32 tensor (all threads)."""
    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    data.sum()  # fault the pages in, warm the threads
    best = 0.0
    for _ in range(runs):
        start = time.perf_counter()
        data.sum()
        best = max(best, data.numel() * data.element_size() / (time.perf_counter() - start))
    del data
    return best


def _tensor_bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def runner_weight_bytes(runner: Any) -> dict[str, int]:
    """What one decode step reads of the runner's weights: every projection (its `nbytes`: the packed copy its
    kernel reads, ours or oneDNN's, else the weight, int8 with its scales for an int8 engine; biases too) in every
    layer, the norms, and the LM head. The embedding is not counted: a step gathers only its tokens' rows."""
    def projection(p: Any) -> int:
        return p.nbytes

    def norm(module: Any) -> int:
        return 0 if module is None else _tensor_bytes(module.weight)

    layers = sum(projection(layer.qkv) + projection(layer.o_proj) + projection(layer.gate_up) + projection(layer.down)
                 + norm(layer.input_norm) + norm(layer.post_norm) + norm(getattr(layer, "q_norm", None))
                 + norm(getattr(layer, "k_norm", None))
                 for layer in runner.layers)
    head = projection(runner.lm_head) + norm(getattr(runner, "norm", None))
    return {"layers": layers, "lm_head": head, "total": layers + head}


# ----- (d) 64 concurrent requests in the KV memory of 32 ----------------------------------------------------------
def kv_cache_tokens_of(build_dir: Path) -> int:
    """The KV pool's size in tokens of a build, as its Triton config sets it."""
    return int(repository_parameter(build_dir / "model_repository", ENGINE_MODEL, "cpu_kv_cache_tokens") or 0)


def build_c64_engine(base_engine_dir: Path, out_dir: Path, max_batch_size: int, kv_cache_tokens: int) -> dict[str, Any]:
    """An engine of the base engine's checkpoint (`--model`: the very same weights), dtype, weight format,
    max_seq_len and max_num_tokens with `max_batch_size` slots and a KV pool of `kv_cache_tokens` tokens, in
    `out_dir`. Built every time: it writes the config (and quantizes, for int8) and renders the repository,
    and a repository rendered earlier would carry a copy of an older model.py."""
    base = json.loads((base_engine_dir / "engine" / "engine_config.json").read_text())
    command = [sys.executable, "-m", "build_engine", "--model", base["checkpoint_dir"], "--output-dir", str(out_dir),
               "--dtype", base["dtype"], "--weights", base.get("weights", "float32"),
               "--max-batch-size", str(max_batch_size),
               "--max-seq-len", str(base["max_seq_len"]), "--max-num-tokens", str(base["max_num_tokens"]),
               "--kv-cache-tokens", str(kv_cache_tokens)]
    print(f"  (d) building: {' '.join(command[1:])}", flush=True)
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"build_engine failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    built = json.loads((out_dir / "engine" / "engine_config.json").read_text())
    return {"engine_dir": str(out_dir), "max_batch_size": built["max_batch_size"],
            "max_seq_len": built["max_seq_len"], "served_model_name": built["served_model_name"],
            "kv_cache_tokens": kv_cache_tokens_of(out_dir)}


async def sampled_level(base_url: str, model: str, concurrency: int, requests: int, output_tokens: int,
                        conversations: list[Messages], metrics_url: str | None) -> tuple[LevelResult, dict[str, Any]]:
    """One level with the engine's metrics sampled every 0.2 s: the level's result and the readings
    (peaks while it ran, and the values after it)."""
    async with httpx.AsyncClient() as client:
        before = await read_metrics(client, metrics_url)
    sampler, stop = MetricsSampler(metrics_url), asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop))
    try:
        result = await run_conversations_level(base_url, model, concurrency, requests, output_tokens, conversations)
    finally:
        stop.set()
        await sampling
    async with httpx.AsyncClient() as client:
        after = await read_metrics(client, metrics_url)
    readings = {
        "samples": sampler.samples,
        "requests_running_peak": _metric(sampler.peaks, "cpu_engine_requests_running"),
        "requests_waiting_peak": _metric(sampler.peaks, "cpu_engine_requests_waiting"),
        "kv_cache_blocks_used_peak": _metric(sampler.peaks, "cpu_engine_kv_cache_blocks_used"),
        "active_slots_peak": _metric(sampler.peaks, "cpu_engine_active_slots"),  # the older name
        "kv_cache_used_tokens_peak": _metric(sampler.peaks, "cpu_engine_kv_cache_used_tokens"),
        "after": {name.removeprefix("cpu_engine_"): _metric(after, name) for name in ENGINE_METRICS},
        "during": {**hit_rate(before, after),
                   "preemptions": (int(after["cpu_engine_preemptions_total"]
                                       - before.get("cpu_engine_preemptions_total", 0.0))
                                   if "cpu_engine_preemptions_total" in after else None)},
    }
    return result, readings


# ----- (w) int8 weights against float32 -------------------------------------------------------------------
def quality_tokens(vocab_size: int, count: int) -> list[int]:
    """A fixed token set: the same `count` ids on every run and machine, spread over the vocabulary."""
    return [(7919 * i) % (vocab_size - 1) + 1 for i in range(count)]


@torch.inference_mode()
def logits_over(runner: Any, tokens: list[int]) -> torch.Tensor:
    """The runner's logits at every position of `tokens`, read as one prompt chunk from position 0 (the
    first blocks of the pool; a runner used for this is then used for nothing else)."""
    from cpu_engine.runner import Chunk

    table = list(range(-(-len(tokens) // runner.block_size)))
    return runner.forward(tokens, [], [], [Chunk(table, 0, len(tokens))], list(range(len(tokens))))


def compare_logits(reference: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """How far `other` is from `reference` ([positions, vocab] each): the share of positions whose top-1
    token is the same, the largest absolute logit error, and that error over the largest reference logit."""
    error = (other - reference).abs().max().item()
    scale = reference.abs().max().item()
    return {"positions": reference.shape[0],
            "top1_agreement": (other.argmax(-1) == reference.argmax(-1)).float().mean().item(),
            "max_abs_logit_error": error, "max_abs_logit": scale, "relative_max_error": error / scale}


# ----- (l) decode attention at long contexts ------------------------------------------------------------------
@contextlib.contextmanager
def attention_timer() -> Iterator[dict[str, float]]:
    """While open, every in-place decode-attention call of a runner (cpu_engine.runner's
    `paged_decode_attention`; a bfloat16 runner gathers instead and makes none, and a runner on our float32 or
    VNNI kernel attends inside its one-call decode-only steps, cpu_engine.fused_step, untimed) is timed: yields running
    totals {"calls", "seconds", "bytes"}, bytes being the K and V rows the calls read (sum of the rows'
    lengths x 2 x kv_heads x head_dim x element size)."""
    import cpu_engine.runner as runner_module

    kernel = runner_module.paged_decode_attention
    totals = {"calls": 0, "seconds": 0.0, "bytes": 0}

    def timed(q, k_pool, v_pool, tables, lengths, block_size, scale):  # noqa: ANN001, ANN202: the kernel's
        start = time.perf_counter()
        out = kernel(q, k_pool, v_pool, tables, lengths, block_size, scale)
        totals["seconds"] += time.perf_counter() - start
        totals["calls"] += 1
        totals["bytes"] += int(lengths.sum()) * 2 * k_pool.shape[1] * k_pool.shape[2] * k_pool.element_size()
        return out

    runner_module.paged_decode_attention = timed
    try:
        yield totals
    finally:
        runner_module.paged_decode_attention = kernel
