"""The load generator against the real stack, a few requests through each transport: raw Triton gRPC
(`tensorrt_llm`, token ids) and the OpenAI endpoint (SSE). The figures must be sane and the token counts
exact, so the two paths measure the same work."""

from __future__ import annotations

import shutil

import httpx
import pytest

from benchmarks.frontend_bench import GROUPS, STACK, Processes, run_levels, triton_pid
from benchmarks.loadgen import OpenAITarget, TritonTarget, run_sweep, run_workload_level
from benchmarks.metrics import summarize
from benchmarks.null_engine import add_null_engine, plain_token_ids
from benchmarks.servers import frontend_process
from benchmarks.stack_bench import paired_overhead
from benchmarks.workload import Workload, load_tokenizer
from tests.integration.conftest import Stack

pytestmark = pytest.mark.integration

SMOKE = Workload(name="smoke", seed=7, num_prompts=3, input_tokens=12, output_tokens=6, concurrencies=(2,),
                 rounds=1, min_requests=3, warmup_requests=1)


@pytest.fixture(scope="module")
def tokenizer(stack: Stack):
    return load_tokenizer(stack.checkpoint_dir)


def targets(stack: Stack, tokenizer) -> dict[str, object]:
    return {"triton": TritonTarget(stack.triton_grpc_url, tokenizer, SMOKE.output_tokens),
            "frontend": OpenAITarget(stack.base_url, stack.model, SMOKE.output_tokens)}


def assert_sane(timings, expected: int) -> None:
    assert len(timings) == expected
    for t in timings:
        assert t.error is None, t.error
        assert t.output_tokens == SMOKE.output_tokens  # fixed output length, as counted by the server
        assert t.input_tokens > SMOKE.input_tokens  # the prompt plus the chat template
        assert 0 < t.ttft <= t.e2e
        assert t.token_times == sorted(t.token_times)
        assert t.itl is not None and t.itl >= 0


async def test_both_transports_same_work(stack: Stack, tokenizer):
    prompts = SMOKE.prompts(tokenizer)
    per_target = {}
    for name, target in targets(stack, tokenizer).items():
        timings, wall = await run_workload_level(target, prompts, concurrency=2, requests=3, progress=False)
        assert_sane(timings, 3)
        summary = summarize(timings)
        assert summary["requests"] == 3 and summary["errors"] == 0
        assert summary["output_tokens"] == 3 * SMOKE.output_tokens
        assert 0 < summary["duration_s"] <= wall
        assert summary["output_tok_per_s"] > 0 and summary["req_per_s"] > 0
        assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
        per_target[name] = timings
    # Same prompts in the same order: the raw path sends exactly the ids the frontend renders
    # (the usage chunk's prompt_tokens on the OpenAI side, len(input_ids) on the Triton side).
    assert [t.input_tokens for t in per_target["triton"]] == [t.input_tokens for t in per_target["frontend"]]


async def test_sweep_reports_every_level(stack: Stack, tokenizer):
    prompts = SMOKE.prompts(tokenizer)
    for target in targets(stack, tokenizer).values():
        (row,) = await run_sweep(target, SMOKE, prompts, progress=False)
        assert row["target"] == target.label and row["concurrency"] == 2
        assert row["requests"] == 3 and row["errors"] == 0 and "first_error" not in row
        assert row["output_tokens_per_request"] == SMOKE.output_tokens
        assert row["ttft_ms"]["p99"] <= row["e2e_ms"]["p99"]


async def test_paired_overhead_pairs_every_request(stack: Stack, tokenizer):
    prompts = SMOKE.prompts(tokenizer)
    overhead = await paired_overhead(TritonTarget(stack.triton_grpc_url, tokenizer, 1),
                                     OpenAITarget(stack.base_url, stack.model, 1), prompts, pairs=4)
    assert overhead["pairs"] == 4
    # A difference of two TTFTs of the same prompt, each well under a few seconds on the tiny model.
    assert abs(overhead["ttft_added_p50_ms"]) < 5000
    assert overhead["ttft_added_p50_ms"] <= overhead["ttft_added_p90_ms"]


# ----- make bench-frontend (benchmarks/frontend_bench.py) at a tiny size -------------------------------------
async def test_frontend_bench_reports_cpu_per_token(stack: Stack, tmp_path):
    """The null engine loaded into the session Triton, a frontend of its own in front of it, two short levels:
    every figure of the report is there, and the frontend and the server paid CPU for the tokens. No timing
    assertion: CPU times are read in 10 ms ticks, so only totals over both levels are asked to be positive."""
    name = "null_engine_smoke"
    tokenizer = load_tokenizer(stack.checkpoint_dir)
    model_dir = add_null_engine(stack.repository, plain_token_ids(tokenizer), name=name, end_ids=[2, 3])
    load = f"{stack.triton_http_url}/v2/repository/models/{name}"
    try:
        httpx.post(f"{load}/load", headers=stack.triton_control, timeout=120).raise_for_status()
        with frontend_process(stack.triton_grpc_url, tmp_path, env={"ENGINE_MODEL": name}) as (base_url, process):
            async with httpx.AsyncClient(timeout=60) as client:  # plain words, never an end of sequence
                answer = (await client.post(f"{base_url}/chat/completions", json={
                    "model": stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                    "temperature": 0})).json()
            assert answer["choices"][0]["finish_reason"] == "length"
            assert answer["usage"]["completion_tokens"] == 12
            assert sum(c.isalpha() for c in answer["choices"][0]["message"]["content"]) >= 12
            processes = Processes.resolve(process.pid, triton_pid(stack.triton_grpc_url), name)
            rows, idle = await run_levels(base_url, stack.model, SMOKE.prompts(tokenizer), processes,
                                          concurrencies=(1, 4), max_tokens=100, tokens_per_level=200,
                                          warmup_requests=1, progress=False, idle_s=0.1)
    finally:
        httpx.post(f"{load}/unload", headers=stack.triton_control, timeout=60)
        shutil.rmtree(model_dir, ignore_errors=True)
    assert set(idle) == {*GROUPS, "machine"}
    assert [r["concurrency"] for r in rows] == [1, 4]
    for row, requests in zip(rows, (2, 4)):
        assert row["requests"] == requests and row["errors"] == 0
        assert row["output_tokens"] == requests * 100 and row["output_tok_per_s"] > 0
        assert set(row["cpu_us_per_token"]) == {*GROUPS, "stack"}
        assert all(v is not None and v >= 0 for v in row["cpu_us_per_token"].values())
        assert row["cpu_us_per_token"]["frontend"] > 0
        assert row["wall_s"] > 0 and row["machine_busy_cores"] > 0
    for group in STACK:
        assert sum(r["cpu_s"][group] for r in rows) > 0, group
