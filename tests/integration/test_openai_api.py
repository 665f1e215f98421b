"""The OpenAI API end to end: official `openai` client (sync and async) and raw HTTP/SSE, against the
real frontend, real tritonserver and the CPU engine (tiny demo checkpoint, random weights)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.integration.conftest import Stack

pytestmark = pytest.mark.integration


def sse_events(body: str) -> list[str]:
    """Split a raw SSE body on blank lines, checking every event is exactly one `data: ` line."""
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [event[len("data: "):] for event in events]


def test_models_lists_the_served_model_with_its_context_length(client: openai.OpenAI, stack: Stack) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [stack.model]
    assert models[0].model_extra["max_model_len"] == stack.context_length


def test_chat_non_streaming_reports_length_and_exact_usage(client: openai.OpenAI, stack: Stack) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    reply = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=7, temperature=0)
    choice = reply.choices[0]
    tokenizer = AutoTokenizer.from_pretrained(stack.checkpoint_dir)
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == 7
    assert reply.usage.total_tokens == len(prompt_ids) + 7


@pytest.mark.parametrize("prompt", ["Tell me about lighthouses.", "你好，世界！🌍😀 emoji and 中文 mixed"])
def test_chat_streamed_text_equals_non_streamed_text(client: openai.OpenAI, stack: Stack, prompt: str) -> None:
    messages = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=40, temperature=0)
    stream = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=40,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert "".join(pieces) == whole.choices[0].message.content
    assert finishes == [whole.choices[0].finish_reason]
    assert usage == whole.usage


def test_cjk_and_emoji_prompt_round_trips_through_the_tokenizer(client: openai.OpenAI, stack: Stack) -> None:
    text = "日本語と中文、한국어 😀👍🏽🇯🇵"
    tokenizer = AutoTokenizer.from_pretrained(stack.checkpoint_dir)
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    reply = client.completions.create(model=stack.model, prompt=text, max_tokens=5, temperature=0)
    assert reply.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    by_ids = client.completions.create(model=stack.model, max_tokens=5, temperature=0,
                                       prompt=tokenizer.encode(text, add_special_tokens=False))
    assert by_ids.choices[0].text == reply.choices[0].text


def test_raw_sse_framing_for_chat(stack: Stack) -> None:
    # Greedy past EOS: six tokens whatever the random weights make of "hi" (an EOS may be sampled first).
    body = {"model": stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "unknown_field": {"x": 1}}
    response = httpx.post(f"{stack.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish_positions = [i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish_positions) == 1
    assert chunks[finish_positions[0]]["choices"][0]["delta"] == {}
    usage_positions = [i for i, c in enumerate(chunks) if c["usage"] is not None]
    assert usage_positions == [len(chunks) - 1] and finish_positions[0] < usage_positions[0]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    middle = chunks[1:finish_positions[0]]
    assert middle and all(set(c["choices"][0]["delta"]) == {"content"} for c in middle)


def test_raw_sse_without_include_usage_sends_no_usage(stack: Stack) -> None:
    body = {"model": stack.model, "prompt": "abc", "max_tokens": 4, "stream": True, "temperature": 0,
            "ignore_eos": True}
    response = httpx.post(f"{stack.base_url}/completions", json=body, timeout=60)
    events = sse_events(response.text)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]


async def test_async_completions_streamed_equals_non_streamed(async_client: openai.AsyncOpenAI,
                                                             stack: Stack) -> None:
    whole = await async_client.completions.create(model=stack.model, prompt="Once upon a time",
                                                  max_tokens=30, temperature=0)
    stream = await async_client.completions.create(model=stack.model, prompt="Once upon a time",
                                                   max_tokens=30, temperature=0, stream=True)
    pieces, finishes = [], []
    async for chunk in stream:
        pieces.append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason:
            finishes.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == whole.choices[0].text
    assert finishes == ["length"] == [whole.choices[0].finish_reason]


async def test_eight_concurrent_streams_match_their_solo_runs(async_client: openai.AsyncOpenAI,
                                                             stack: Stack) -> None:
    prompts = [f"Request number {i}: " + "word " * (3 * i) for i in range(8)]

    async def solo(prompt: str) -> str:
        reply = await async_client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0)
        return reply.choices[0].message.content

    async def streamed(prompt: str) -> tuple[str, list[str]]:
        stream = await async_client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": prompt}], max_tokens=24,
            temperature=0, stream=True)
        pieces, finishes = [], []
        async for chunk in stream:
            delta = chunk.choices[0]
            pieces.append(delta.delta.content or "")
            if delta.finish_reason:
                finishes.append(delta.finish_reason)
        return "".join(pieces), finishes

    expected = [await solo(p) for p in prompts]
    results = await asyncio.gather(*(streamed(p) for p in prompts))
    for (text, finishes), want in zip(results, expected):
        assert finishes == ["length"]
        assert text == want


def test_seeded_sampling_is_reproducible_through_the_api(client: openai.OpenAI, stack: Stack) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=stack.model, prompt="seeded", max_tokens=16, temperature=1.0,
                                         top_p=0.9, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_stop_string_ends_generation_without_leaking(client: openai.OpenAI, stack: Stack) -> None:
    messages = [{"role": "user", "content": "stop test"}]
    full = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=30,
                                          temperature=0).choices[0].message.content
    stop = full[10:14]
    assert len(stop) == 4
    expected = full[: full.index(stop)]
    whole = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=30,
                                           temperature=0, stop=[stop])
    assert whole.choices[0].message.content == expected and whole.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=stack.model, messages=messages, max_tokens=30, temperature=0, stop=stop, stream=True)]
    assert "".join(pieces) == expected
    assert all(stop not in p for p in pieces)
