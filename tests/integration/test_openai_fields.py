"""Every request field the frontend supports, through the official client (sync and async) and raw SSE:
n, logprobs, echo, prompt shapes, sampling extensions, stop strings across tokens, disconnects,
model/tokenizer helpers, request ids and chat templates."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from launcher.ports import find_free_port
from tests.integration.conftest import (SLOW_MODEL, Stack, engine_is_idle, engine_settled, start_frontend,
                                        stop_process, wait_engine, wait_http_ok)
from tests.integration.test_openai_api import sse_events

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def slow_url(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A frontend (base URL) on the slow test engine (>= 50 ms a step: conftest.SLOW_MODEL): a 450-token request
    there lasts >= 22.5 s however fast this machine is, so a client can leave while it runs."""
    port = find_free_port()
    process = start_frontend(stack.triton_grpc_url, port, tmp_path_factory.mktemp("fields_slow") / "frontend.log",
                             ENGINE_MODEL=SLOW_MODEL, SERVED_MODEL_NAME=stack.model)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health/ready", 120, process)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_process(process)


def running_since(before: dict[str, float]):
    """A request runs, and the engine generated since `before` (its settled metrics before the request was sent):
    what only that request can have caused (a slot gauge alone can still show an earlier request)."""
    return lambda now: now["active_slots"] >= 1 and now["generated_tokens_total"] > before["generated_tokens_total"]


def cancelled_since(before: dict[str, float]):
    """The engine cancelled one request since `before`, and is idle."""
    return lambda now: (now["cancelled_requests_total"] == before["cancelled_requests_total"] + 1
                        and engine_is_idle(now))


# ----- n ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_n3_raw_sse_framing_and_streamed_equals_non_streamed(stack: Stack, endpoint: str) -> None:
    body = {"model": stack.model, "max_tokens": 8, "n": 3, "seed": 11, "temperature": 1.0}
    if endpoint == "completions":
        body["prompt"] = "three choices"
    else:
        body["messages"] = [{"role": "user", "content": "three choices"}]
    whole = httpx.post(f"{stack.base_url}/{endpoint}", json=body, timeout=60).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert whole["usage"]["completion_tokens"] == 24
    response = httpx.post(f"{stack.base_url}/{endpoint}", timeout=60,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    texts, finishes = {0: "", 1: "", 2: ""}, {0: [], 1: [], 2: []}
    for chunk in chunks[:-1]:
        assert chunk["usage"] is None and len(chunk["choices"]) == 1
        choice = chunk["choices"][0]
        texts[choice["index"]] += choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    for choice in whole["choices"]:
        expected = choice["message"]["content"] if "message" in choice else choice["text"]
        assert texts[choice["index"]] == expected
    assert len({c["message"]["content"] if "message" in c else c["text"] for c in whole["choices"]}) > 1
    if endpoint == "chat/completions":
        roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
        assert sorted(roles) == [0, 1, 2]


# ----- logprobs -----------------------------------------------------------------------------------
def test_chat_logprobs_with_top_alternatives(client: openai.OpenAI, stack: Stack) -> None:
    kwargs = dict(model=stack.model, messages=[{"role": "user", "content": "logprobs"}], max_tokens=6,
                  temperature=0, logprobs=True, top_logprobs=3)
    reply = client.chat.completions.create(**kwargs)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-5
        assert entry.bytes == list(entry.token.encode("utf-8"))
    streamed = [e for chunk in client.chat.completions.create(**kwargs, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


async def test_completion_logprobs_async(async_client: openai.AsyncOpenAI, stack: Stack) -> None:
    reply = await async_client.completions.create(model=stack.model, prompt="offsets", max_tokens=5,
                                                  temperature=0, logprobs=2)
    lp = reply.choices[0].logprobs
    assert "".join(lp.tokens) == reply.choices[0].text
    assert len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(alts) == 2 for alts in lp.top_logprobs)


# ----- completions prompt shapes and echo -----------------------------------------------------------
def test_completion_prompt_shapes_and_echo(client: openai.OpenAI, stack: Stack) -> None:
    tokenizer = AutoTokenizer.from_pretrained(stack.checkpoint_dir)
    single = client.completions.create(model=stack.model, prompt="alpha", max_tokens=4, temperature=0)
    as_list = client.completions.create(model=stack.model, prompt=["alpha", "beta"], max_tokens=4, temperature=0)
    beta = client.completions.create(model=stack.model, prompt="beta", max_tokens=4, temperature=0)
    assert [c.text for c in as_list.choices] == [single.choices[0].text, beta.choices[0].text]
    assert as_list.usage.prompt_tokens == single.usage.prompt_tokens + beta.usage.prompt_tokens
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in ("alpha", "beta")]
    as_ids = client.completions.create(model=stack.model, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in as_ids.choices] == [c.text for c in as_list.choices]
    echoed = client.completions.create(model=stack.model, prompt="alpha", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "alpha" + single.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=stack.model, prompt="alpha", max_tokens=4, temperature=0, echo=True, stream=True))
    assert streamed == echoed.choices[0].text


# ----- sampling fields ----------------------------------------------------------------------------------
def test_sampling_extensions_change_what_they_should(client: openai.OpenAI, stack: Stack) -> None:
    def text(**kwargs) -> str:
        return client.completions.create(model=stack.model, prompt="sampling", max_tokens=24, **kwargs).choices[0].text

    greedy = text(temperature=0)
    assert text(temperature=1.0, extra_body={"top_k": 1}) == greedy  # top_k 1 is greedy
    assert text(temperature=0, frequency_penalty=2.0) != greedy  # the random model repeats itself
    assert text(temperature=0, presence_penalty=2.0) != greedy
    assert text(temperature=0, extra_body={"repetition_penalty": 3.0}) != greedy
    assert text(temperature=0, user="someone", extra_body={"min_tokens": 5, "ignore_eos": True}) == greedy
    assert text(temperature=0.7, top_p=0.5, seed=3) == text(temperature=0.7, top_p=0.5, seed=3)


def test_max_completion_tokens_wins_and_default_fills_the_context(client: openai.OpenAI, stack: Stack) -> None:
    messages = [{"role": "user", "content": "limits"}]
    reply = client.chat.completions.create(model=stack.model, messages=messages, max_completion_tokens=3,
                                           max_tokens=9, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    unbounded = client.chat.completions.create(model=stack.model, messages=messages, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert unbounded.usage.total_tokens == stack.context_length
    assert unbounded.choices[0].finish_reason == "length"


# ----- stop strings across tokens -------------------------------------------------------------------
def test_stop_string_split_across_several_tokens_never_streams(client: openai.OpenAI, stack: Stack) -> None:
    base = dict(model=stack.model, prompt="a stop string across tokens", max_tokens=40, temperature=0)
    probe = client.completions.create(**base, logprobs=0)
    tokens = probe.choices[0].logprobs.tokens
    k = next(i for i in range(3, 30) if tokens[i] and len(tokens[i + 1]) >= 1 and tokens[i + 2])
    stop = tokens[k][-1] + tokens[k + 1] + tokens[k + 2][0]  # spans three tokens, mid-stream
    full = probe.choices[0].text
    expected = full[: full.index(stop)]
    whole = client.completions.create(**base, stop=[stop, "never-seen"])
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(**base, stop=[stop], stream=True)]
    assert "".join(pieces) == expected  # nothing of the stop string was streamed, not even a prefix
    assert all(stop not in piece for piece in pieces)


# ----- disconnects ------------------------------------------------------------------------------------
def test_client_disconnect_frees_the_engine_slot(stack: Stack, slow_url: str) -> None:
    metrics = stack.triton_metrics_url
    body = {"model": stack.model, "prompt": "long", "max_tokens": 450, "stream": True, "ignore_eos": True}
    short = {"model": stack.model, "prompt": "speed", "max_tokens": 4, "ignore_eos": True}
    before = engine_settled(metrics, SLOW_MODEL)
    with httpx.stream("POST", f"{slow_url}/completions", json=body, timeout=60) as response:
        received = 0
        for line in response.iter_lines():
            received += line.startswith("data: {")
            if received == 5:
                wait_engine(metrics, SLOW_MODEL, running_since(before), "the request to run")
                break  # closing the line iterator closes the connection
    # the engine cancelled it (>= 22.5 s of steps: it could not have ended by itself) and let go of its slot
    after = wait_engine(metrics, SLOW_MODEL, cancelled_since(before), "the engine to cancel the request")
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < 450
    # and serves the next request in full
    assert httpx.post(f"{slow_url}/completions", json=short, timeout=60).json()["usage"]["completion_tokens"] == 4


async def test_non_streaming_disconnect_cancels_generation(stack: Stack, slow_url: str) -> None:
    metrics = stack.triton_metrics_url
    body = {"model": stack.model, "prompt": "long", "max_tokens": 450, "ignore_eos": True}
    before = await asyncio.to_thread(engine_settled, metrics, SLOW_MODEL)
    async with httpx.AsyncClient(timeout=60) as http:
        waiting = asyncio.create_task(http.post(f"{slow_url}/completions", json=body))
        await asyncio.to_thread(wait_engine, metrics, SLOW_MODEL, running_since(before), "the request to run")
        waiting.cancel()  # the client gives up: its connection closes
        await asyncio.gather(waiting, return_exceptions=True)
    after = await asyncio.to_thread(wait_engine, metrics, SLOW_MODEL, cancelled_since(before),
                                    "the engine to cancel the request after the client left")
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < 450


# ----- models, tokenizer helpers, request ids ---------------------------------------------------------
def test_model_by_id_tokenize_detokenize_and_request_id(client: openai.OpenAI, stack: Stack) -> None:
    model = client.models.retrieve(stack.model)
    assert model.id == stack.model and model.model_extra["max_model_len"] == stack.context_length
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    tokens = httpx.post(f"{stack.root_url}/tokenize", json={"prompt": "hi 世界"}, timeout=10).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == stack.context_length
    text = httpx.post(f"{stack.root_url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=10).json()
    assert text == {"prompt": "hi 世界"}
    chat_tokens = httpx.post(f"{stack.root_url}/tokenize", timeout=10,
                             json={"messages": [{"role": "user", "content": "hi"}]}).json()
    reply = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=1)
    assert chat_tokens["count"] == reply.usage.prompt_tokens
    response = httpx.post(f"{stack.base_url}/completions", headers={"X-Request-Id": "trace-me-123"}, timeout=60,
                          json={"model": stack.model, "prompt": "x", "max_tokens": 1})
    assert response.headers["x-request-id"] == "trace-me-123"
    generated = httpx.post(f"{stack.base_url}/completions", timeout=60,
                           json={"model": stack.model, "prompt": "x", "max_tokens": 1})
    assert len(generated.headers["x-request-id"]) >= 16


# ----- chat templates ----------------------------------------------------------------------------------
def test_missing_chat_template_is_a_clear_400_unless_one_is_given(stack: Stack, tmp_path: Path) -> None:
    plain = tmp_path / "no-template"
    shutil.copytree(stack.checkpoint_dir, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    body = {"model": stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra, expect in (({}, 400), ({"CHAT_TEMPLATE": str(template)}, 200)):
        port = find_free_port()
        frontend = start_frontend(stack.triton_grpc_url, port, tmp_path / f"frontend{port}.log",
                                  TOKENIZER_DIR=str(plain), **extra)
        try:
            wait_http_ok(f"http://127.0.0.1:{port}/health/ready", 120, frontend)
            response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == expect, response.text
            if expect == 400:
                error = response.json()["error"]
                assert error["code"] == "chat_template_missing" and "--chat-template" in error["message"]
                completion = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                                        json={"model": stack.model, "prompt": "hi", "max_tokens": 2})
                assert completion.status_code == 200
        finally:
            stop_process(frontend)
