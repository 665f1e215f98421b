"""The CPU engine's paged KV cache and prefix reuse through the whole stack (official client, real Triton).

The session engine (`tensorrt_llm`) reuses prefixes (the default); a copy of it loaded here
(`tensorrt_llm_no_reuse`) has reuse off and a KV cache of 256 tokens, less than its 512-token context, so
that a request can fit the context and still need more blocks than the engine has; another
(`tensorrt_llm_kv_bfloat16`) keeps its KV cache in bfloat16 (`cpu_kv_cache_dtype`).
"""

from __future__ import annotations

import re
import shutil
from typing import Iterator

import httpx
import openai
import pytest

from benchmarks.servers import stop_process, wait_http_ok
from cpu_engine import paged_attention
from launcher.ports import find_free_port
from tests.integration.conftest import (ENGINE_WAIT_S, Stack, engine_settled, frontend_on, set_parameter,
                                        start_frontend, wait_until)

pytestmark = pytest.mark.integration

NO_REUSE_MODEL = "tensorrt_llm_no_reuse"
BFLOAT16_KV_MODEL = "tensorrt_llm_kv_bfloat16"
NO_REUSE_KV_TOKENS = 256
# About 120 tokens with the chat template: seven full 16-token blocks for a request that repeats it to find.
SYSTEM = ("You are a careful assistant for a shipping company. Answer in one short paragraph, name the "
          "order number you were given, never invent tracking numbers, and say so when you do not know. "
          "Policies: returns within 30 days, refunds within 5 business days, express shipping on weekdays "
          "only, and no deliveries on public holidays in any region we serve.")


def engine_copy(stack: Stack, name: str, **parameters: str) -> None:
    """A copy of the session engine model named `name`, with `parameters` changed, loaded into the running
    Triton (explicit model control)."""
    target = stack.repository / name
    shutil.copytree(stack.repository / "tensorrt_llm", target, ignore=shutil.ignore_patterns("__pycache__"))
    config = target / "config.pbtxt"
    config.write_text(re.sub(r'^name:\s*"[^"]*"', f'name: "{name}"', config.read_text(), count=1, flags=re.M))
    for key, value in parameters.items():
        set_parameter(target, key, value)
    httpx.post(f"{stack.triton_http_url}/v2/repository/models/{name}/load", headers=stack.triton_control,
               timeout=300).raise_for_status()


@pytest.fixture(scope="module")
def no_reuse_client(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """A frontend over a copy of the session engine with prefix reuse off and a 256-token KV cache, loaded
    into the running Triton (explicit model control)."""
    engine_copy(stack, NO_REUSE_MODEL, enable_kv_cache_reuse="false", cpu_kv_cache_tokens=str(NO_REUSE_KV_TOKENS))
    port = find_free_port()
    process = start_frontend(stack.triton_grpc_url, port, tmp_path_factory.mktemp("no_reuse") / "frontend.log",
                             ENGINE_MODEL=NO_REUSE_MODEL)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health/ready", 120, process)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        stop_process(process)
        httpx.post(f"{stack.triton_http_url}/v2/repository/models/{NO_REUSE_MODEL}/unload", headers=stack.triton_control,
                   timeout=60)


@pytest.fixture(scope="module")
def bfloat16_kv_client(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """A frontend over a copy of the session engine whose KV cache is bfloat16."""
    if paged_attention.bfloat16_kernel() is None:
        pytest.skip("a bfloat16 KV cache needs AVX-512 (F, BW, DQ) and a C compiler; the engine keeps float32")
    engine_copy(stack, BFLOAT16_KV_MODEL, cpu_kv_cache_dtype="bfloat16")
    try:
        with frontend_on(stack, BFLOAT16_KV_MODEL, tmp_path_factory.mktemp("kv_bfloat16")) as url:
            yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    finally:
        httpx.post(f"{stack.triton_http_url}/v2/repository/models/{BFLOAT16_KV_MODEL}/unload",
                   headers=stack.triton_control, timeout=60)


def ask(client: openai.OpenAI, model: str, question: str, stream: bool = False) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    if stream:
        chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                                stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    return response.choices[0].message.content


def test_a_cached_system_prompt_is_found_and_answers_exactly_as_without_reuse(
        stack: Stack, client: openai.OpenAI, no_reuse_client: openai.OpenAI) -> None:
    idle = engine_settled(stack.triton_metrics_url, "tensorrt_llm")
    cold = ask(client, stack.model, "Where is order 1182?")
    # counted once `cold` is (the engine publishes its metrics late: a read right now could still miss its hits)
    hits_before = engine_settled(stack.triton_metrics_url, "tensorrt_llm",
                                 after=idle)["prefix_cache_hits_tokens_total"]
    warm = ask(client, stack.model, "Where is order 1182?")
    # Every full block but the one holding the prompt's last token (which is always computed) was found.
    prompt_tokens = client.chat.completions.create(
        model=stack.model, max_tokens=1, messages=[{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": "Where is order 1182?"}]
    ).usage.prompt_tokens
    expected_hits = 2 * ((prompt_tokens - 1) // 16 * 16)  # `warm` and this third request
    assert prompt_tokens > 100
    assert wait_until(lambda: stack.engine_metric("prefix_cache_hits_tokens_total") - hits_before == expected_hits,
                      ENGINE_WAIT_S), (stack.engine_metric("prefix_cache_hits_tokens_total") - hits_before,
                                       expected_hits)
    warm_streamed = ask(client, stack.model, "Where is order 1182?", stream=True)
    other_question = ask(client, stack.model, "Can I return a lamp?")  # shares the system prompt only

    assert ask(no_reuse_client, stack.model, "Where is order 1182?") == cold == warm == warm_streamed
    assert ask(no_reuse_client, stack.model, "Can I return a lamp?") == other_question
    assert wait_until(lambda: stack.engine_metric("prefix_cache_queries_tokens_total", NO_REUSE_MODEL) > 0,
                      ENGINE_WAIT_S)  # published late, like every engine metric
    assert stack.engine_metric("prefix_cache_hits_tokens_total", NO_REUSE_MODEL) == 0


def test_kv_cache_gauges_describe_the_pool(stack: Stack, no_reuse_client: openai.OpenAI) -> None:
    assert stack.engine_metric("kv_cache_blocks_total", NO_REUSE_MODEL) == NO_REUSE_KV_TOKENS // 16
    assert stack.engine_metric("kv_cache_capacity_tokens", NO_REUSE_MODEL) == NO_REUSE_KV_TOKENS
    # Idle: nothing held, whatever the prefix cache keeps (cached blocks are free until reused).
    assert wait_until(lambda: stack.engine_metric("kv_cache_blocks_used") == 0
                      and stack.engine_metric("kv_cache_usage_ratio") == 0
                      and stack.engine_metric("requests_running") == 0
                      and stack.engine_metric("requests_waiting") == 0, ENGINE_WAIT_S)


def test_a_request_needing_more_blocks_than_the_cache_has_is_a_400_at_once(
        stack: Stack, no_reuse_client: openai.OpenAI) -> None:
    prompt = "word " * 200  # within the 512-token context with max_tokens 100, beyond the 256-token cache
    before = engine_settled(stack.triton_metrics_url, NO_REUSE_MODEL)
    with pytest.raises(openai.BadRequestError) as refused:
        no_reuse_client.completions.create(model=stack.model, prompt=prompt, max_tokens=100)
    assert refused.value.status_code == 400
    assert "exceeds the engine's KV cache" in refused.value.message
    assert refused.value.code == "invalid_engine_request"
    # Nothing was taken: the engine answers the next request, and holds no block afterwards.
    answer = no_reuse_client.completions.create(model=stack.model, prompt="word " * 20, max_tokens=8)
    assert answer.choices[0].finish_reason in ("length", "stop")
    # once idle after that request (not a stale idle reading from before it)
    assert engine_settled(stack.triton_metrics_url, NO_REUSE_MODEL, after=before)["kv_cache_blocks_used"] == 0


def test_a_bfloat16_kv_cache_answers_alike_streamed_or_not_and_from_reused_prefixes(
        stack: Stack, bfloat16_kv_client: openai.OpenAI) -> None:
    """The engine says it keeps K/V in bfloat16 (its start-up line in Triton's log); its greedy answer is the same
    cold, from the prefix cache, and streamed."""
    assert "bfloat16 KV cache" in stack.triton_log.read_text(errors="replace")
    idle = engine_settled(stack.triton_metrics_url, BFLOAT16_KV_MODEL)
    cold = ask(bfloat16_kv_client, stack.model, "Where is order 1182?")
    warm = ask(bfloat16_kv_client, stack.model, "Where is order 1182?")
    streamed = ask(bfloat16_kv_client, stack.model, "Where is order 1182?", stream=True)
    assert cold == warm == streamed and cold
    hits = engine_settled(stack.triton_metrics_url, BFLOAT16_KV_MODEL, after=idle)["prefix_cache_hits_tokens_total"]
    assert hits >= 2 * 6 * 16  # `warm` and `streamed` each found the system prompt's full blocks
