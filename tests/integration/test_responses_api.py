"""`/v1/responses` on the real stack, through the official `openai` client (which parses every object and
event into its typed models): plain and streamed responses, the event sequence, a forced function call and
its output answered over `previous_response_id` (token-identical to the chat prompt: the engine's prefix
cache finds the first turn), `text.format` json_schema, the stored responses' endpoints, owner isolation,
background responses with cancel, and a stored response surviving a frontend restart.

The demo weights are random: tests compare the stack with itself (streamed vs not, Responses vs chat, at
temperature 0), never with expected words.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest

from tests.integration.conftest import (ENGINE_WAIT_S, SLOW_MODEL, Stack, engine_settled, frontend_on,
                                        wait_until)

pytestmark = pytest.mark.integration

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                               "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER_TOOL = {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}
KEY_A, KEY_B = "resp-test-key-a", "resp-test-key-b"
MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done", "response.output_item.done"]


def collapse(types: list[str]) -> list[str]:
    """Event types with each run of one repeated delta type as one entry."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


def test_a_plain_response_streamed_is_the_non_streamed_one(stack: Stack, client: openai.OpenAI) -> None:
    asked: dict[str, Any] = dict(model=stack.model, input="Tell me about ships.", max_output_tokens=24,
                                 temperature=0, instructions="Answer briefly.", metadata={"case": "plain"})
    whole = client.responses.create(**asked)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete") and whole.model == stack.model
    message = whole.output[-1]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert whole.output_text == message.content[0].text and whole.output_text
    assert whole.metadata == {"case": "plain"} and whole.instructions == "Answer briefly."
    assert whole.temperature == 0 and whole.max_output_tokens == 24 and whole.store is True
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens" and whole.usage.output_tokens == 24
    # The prompt is the chat prompt of the same conversation (instructions as its system message).
    chat = client.chat.completions.create(model=stack.model, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Tell me about ships."}])
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens

    events = list(client.responses.create(**asked, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert collapse([e.type for e in events]) == ["response.created", "response.in_progress", *MESSAGE_EVENTS,
                                                  f"response.{whole.status}"]
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage == whole.usage and final.status == whole.status
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


def test_the_stream_is_event_frames_ending_with_the_terminal_event(stack: Stack) -> None:
    """OpenAI's framing: `event: <type>` then `data: <json>` of the same type; no `[DONE]`."""
    with httpx.stream("POST", f"{stack.base_url}/responses", timeout=120, json={
            "model": stack.model, "input": "Hi", "max_output_tokens": 4, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        frames = [frame for frame in response.read().decode().split("\n\n") if frame]
    for frame in frames:
        event_line, data_line = frame.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[len("data: "):])["type"] == event_line[len("event: "):]
    assert frames[-1].startswith("event: response.incomplete") or frames[-1].startswith("event: response.completed")
    assert "[DONE]" not in "".join(frames)


def test_a_forced_function_call_then_its_output_answers_over_previous_response_id(
        stack: Stack, client: openai.OpenAI) -> None:
    call = client.responses.create(model=stack.model, input="What is the weather in Oslo?", temperature=0,
                                   tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "get_weather"},
                                   max_output_tokens=64)
    assert call.status == "completed"
    function_call = call.output[-1]
    assert function_call.type == "function_call" and function_call.name == "get_weather"
    assert function_call.call_id.startswith("call_") and function_call.id.startswith("fc_")
    arguments = json.loads(function_call.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["parameters"])

    idle = engine_settled(stack.triton_metrics_url, "tensorrt_llm")
    hits_before = idle["prefix_cache_hits_tokens_total"]
    answer = client.responses.create(model=stack.model, previous_response_id=call.id, temperature=0,
                                     tools=[WEATHER_TOOL], max_output_tokens=16, input=[
                                         {"type": "function_call_output", "call_id": function_call.call_id,
                                          "output": "Sunny, 21 C"}])
    assert answer.status in ("completed", "incomplete") and answer.output
    assert answer.previous_response_id == call.id
    # The engine found the first turn's prompt: every full block of it but the last (the rendered history may
    # tokenize its boundary differently from the generation prompt).
    assert wait_until(lambda: stack.engine_metric("prefix_cache_hits_tokens_total") - hits_before
                      >= ((call.usage.input_tokens - 1) // 16 - 1) * 16 > 0, ENGINE_WAIT_S)

    # Token-identical to the chat prompt of the whole conversation: same length, same greedy answer.
    chat = client.chat.completions.create(model=stack.model, temperature=0, max_tokens=16, tools=[CHAT_WEATHER_TOOL],
                                          messages=[
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": function_call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": function_call.arguments}}]},
        {"role": "tool", "tool_call_id": function_call.call_id, "content": "Sunny, 21 C"}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    message = chat.choices[0].message
    assert answer.output_text == (message.content or "")
    assert [(o.name, o.arguments) for o in answer.output if o.type == "function_call"] == \
           [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_a_forced_function_call_streams_its_arguments(stack: Stack, client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=stack.model, input="Weather in Rome?", temperature=0, stream=True,
                                          tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False,
                                          max_output_tokens=64))
    assert collapse([e.type for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == done.arguments
    assert events[-1].response.output[0].arguments == done.arguments


def test_json_schema_answers_parse_and_validate(stack: Stack, client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "sunny": {"type": "boolean"},
                                               "sky": {"enum": ["clear", "cloudy", "rain"]}},
              "required": ["city", "sunny", "sky"], "additionalProperties": False}
    answers = set()
    for seed in range(20):
        response = client.responses.create(model=stack.model, input="Describe the weather as JSON.",
                                           extra_body={"seed": seed},
                                           max_output_tokens=64, text={"format": {
                                               "type": "json_schema", "name": "weather", "schema": schema,
                                               "strict": True}})
        assert response.status == "completed", response.incomplete_details
        jsonschema.validate(json.loads(response.output_text), schema)
        assert response.text.format.type == "json_schema"
        answers.add(response.output_text)
    assert len(answers) > 1  # seeded samples, not one answer repeated


def test_stored_response_round_trip_input_items_and_delete(stack: Stack, client: openai.OpenAI) -> None:
    created = client.responses.create(model=stack.model, max_output_tokens=4, metadata={"k": "v"}, input=[
        {"role": "developer", "content": "Be short."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"},
                                                         {"type": "input_text", "text": " there"}]}])
    fetched = client.responses.retrieve(created.id)
    assert fetched.model_dump() == created.model_dump()
    items = client.responses.input_items.list(created.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [("message", "developer"), ("message", "user")]
    assert [c.text for c in items.data[1].content] == ["Hello", " there"]
    first = client.responses.input_items.list(created.id, limit=1)  # newest first, as OpenAI lists
    assert [i.id for i in first.data] == [items.data[1].id] and first.has_more
    rest = client.responses.input_items.list(created.id, limit=1, after=first.data[-1].id)
    assert rest.data[0].id == items.data[0].id and not rest.has_more

    assert client.responses.delete(created.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)
    unstored = client.responses.create(model=stack.model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_bad_input_is_a_400_naming_the_field(stack: Stack, client: openai.OpenAI) -> None:
    cases = [({"input": "x", "include": ["no_such.value"]}, "include"),
             ({"input": "x", "tools": [{"type": "no_such_tool"}]}, "tools.0.type"),
             ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
              "input.0.content.0"),
             ({"input": "x", "background": True, "store": False}, "background"),
             ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
              "input.0.arguments"),
             ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=stack.model, **extra)
        assert refused.value.param == param, (extra, refused.value.body)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=stack.model, input="x", previous_response_id="resp_missing")
    assert missing.value.param == "previous_response_id"


# ----- a frontend of our own: two API keys, the slow engine, its own database, restarted ------------------------
class OwnFrontend:
    def __init__(self, stack: Stack, log_dir: Path):
        self.stack, self.log_dir = stack, log_dir
        self.db_url = f"sqlite:///{log_dir / 'responses.sqlite3'}"
        self._context: Any = None
        self.url = ""

    def start(self) -> None:
        self._context = frontend_on(self.stack, SLOW_MODEL, self.log_dir, API_KEYS=f"{KEY_A},{KEY_B}",
                                    RESPONSES_DB_URL=self.db_url)
        self.url = self._context.__enter__()

    def stop(self) -> None:
        self._context.__exit__(None, None, None)

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def own(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnFrontend]:
    frontend = OwnFrontend(stack, tmp_path_factory.mktemp("responses_frontend"))
    frontend.start()
    try:
        yield frontend
    finally:
        frontend.stop()


def test_another_key_gets_a_404_for_a_stored_response(stack: Stack, own: OwnFrontend) -> None:
    a, b = own.client(KEY_A), own.client(KEY_B)
    created = a.responses.create(model=stack.model, input="Hello", max_output_tokens=2)
    for attempt in (lambda: b.responses.retrieve(created.id), lambda: b.responses.input_items.list(created.id),
                    lambda: b.responses.delete(created.id), lambda: b.responses.cancel(created.id),
                    lambda: b.responses.create(model=stack.model, input="Hi", max_output_tokens=2,
                                               previous_response_id=created.id)):
        with pytest.raises(openai.NotFoundError) as refused:
            attempt()
        assert "Hello" not in json.dumps(refused.value.body)
    assert a.responses.retrieve(created.id).id == created.id  # untouched by b's delete


def wait_status(client: openai.OpenAI, response_id: str, statuses: tuple[str, ...]) -> Any:
    """Poll the stored response until its status is one of `statuses` (a hang guard, not a speed)."""
    deadline = time.monotonic() + ENGINE_WAIT_S
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in statuses:
            return response
        assert time.monotonic() < deadline, f"still {response.status}, waiting for {statuses}"
        time.sleep(0.05)


def test_a_background_response_runs_after_the_request_returns(stack: Stack, own: OwnFrontend) -> None:
    a = own.client(KEY_A)
    # Greedy and past EOS: six tokens whatever the random weights make of "Hello" (a sampled EOS ended one run
    # with no text at all).
    queued = a.responses.create(model=stack.model, input="Hello", max_output_tokens=6, background=True,
                                temperature=0, extra_body={"ignore_eos": True})
    assert queued.status in ("queued", "in_progress") and queued.background is True and not queued.output
    done = wait_status(a, queued.id, ("incomplete",))
    assert done.output_text and done.usage.output_tokens == 6
    assert done.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.BadRequestError):  # only a running background response can be cancelled
        a.responses.cancel(queued.id)


def test_a_background_response_is_cancelled_while_in_progress(stack: Stack, own: OwnFrontend) -> None:
    a = own.client(KEY_A)
    # The slow engine takes >= 50 ms a token: 400 tokens are >= 20 s, far longer than the cancel takes.
    queued = a.responses.create(model=stack.model, input="Write a long story.", max_output_tokens=400,
                                background=True, extra_body={"ignore_eos": True})
    wait_status(a, queued.id, ("in_progress",))
    cancelled = a.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert a.responses.cancel(queued.id).status == "cancelled"  # idempotent
    # The run saw the cancel and stored what it had when it stopped (usage is set once it has ended).
    assert wait_until(lambda: a.responses.retrieve(queued.id).usage is not None, ENGINE_WAIT_S)
    stopped = a.responses.retrieve(queued.id)
    assert stopped.status == "cancelled" and stopped.usage.output_tokens < 400
    engine_settled(stack.triton_metrics_url, SLOW_MODEL)  # and the engine request is gone


def test_a_background_stream_is_followed_and_replayed(stack: Stack, own: OwnFrontend) -> None:
    a = own.client(KEY_A)
    live = list(a.responses.create(model=stack.model, input="Hi", max_output_tokens=5, background=True, stream=True))
    assert live[0].type == "response.created" and live[0].response.status == "queued"
    assert live[-1].type in ("response.completed", "response.incomplete")
    response_id = live[0].response.id
    replayed = list(a.responses.retrieve(response_id, stream=True, starting_after=2))
    assert [e.model_dump() for e in replayed] == [e.model_dump() for e in live[3:]]


def test_a_stored_response_survives_a_frontend_restart(stack: Stack, own: OwnFrontend) -> None:
    created = own.client(KEY_A).responses.create(model=stack.model, input="Remember me", max_output_tokens=3)
    own.stop()
    own.start()
    fetched = own.client(KEY_A).responses.retrieve(created.id)
    assert fetched.model_dump() == created.model_dump()
    follow_up = own.client(KEY_A).responses.create(model=stack.model, input="And now?", max_output_tokens=2,
                                                   previous_response_id=created.id)
    assert follow_up.status in ("completed", "incomplete")
