"""Structured output and tool calling on the real stack, with the official `openai` client, on two model
families: the Llama demo (ChatML, Llama 3.1-style JSON tool calls) and the Qwen2 demo (Hermes-style
`<tool_call>` markup). The weights are random, so nothing here is about meaning: every answer a grammar
guides must be valid (strict `json.loads`, the schema), streamed answers must equal non-streamed ones for
the same seed, and what a client can get wrong is a 400 naming the field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterator

from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from benchmarks.servers import stop_process, wait_http_ok
from build_engine.demo_checkpoint import CHATML_TEMPLATE
from launcher.ports import find_free_port
from tests.integration.conftest import QWEN_SERVED_NAME, Stack, start_frontend

pytestmark = pytest.mark.integration

PLAN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "priority": {"enum": ["low", "medium", "high"]},
        "effort": {"type": "integer", "minimum": 1, "maximum": 5},
        "done": {"type": "boolean"},
        "steps": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "kind": {"enum": ["a", "b"]}},
            "required": ["id", "kind"], "additionalProperties": False}},
        "owner": {"type": "object", "properties": {"team": {"enum": ["red", "blue"]}},
                  "required": ["team"], "additionalProperties": False},
    },
    "required": ["title", "priority", "effort", "done", "steps", "owner"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "Plan my day, and check the weather."}]
SAMPLES = 20  # seeded samples per check: SEEDS requests of N choices
N = 5


@pytest.fixture(scope="module", params=["llama", "qwen"])
def family(request: pytest.FixtureRequest, stack: Stack) -> Iterator[tuple[openai.OpenAI, str]]:
    """The official client on one model family, and that model's name."""
    if request.param == "llama":
        base_url, model = stack.base_url, stack.model
    else:
        base_url, model = request.getfixturevalue("qwen_url"), QWEN_SERVED_NAME
    yield openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300), model


def streamed_choices(stream: Iterator[Any]) -> dict[int, dict[str, Any]]:
    """Each choice of a chat stream assembled: content, tool calls (by index) and finish reason."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            whole = choices.setdefault(choice.index, {"content": "", "calls": {}, "finish": None})
            whole["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = whole["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                if call.id:
                    assert entry["id"] is None, "a call's id comes once, first"
                    entry["id"], entry["name"] = call.id, call.function.name
                entry["arguments"] += call.function.arguments or ""
            whole["finish"] = choice.finish_reason or whole["finish"]
    return choices


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_seeded_json_schema_answer_parses_and_validates(family: tuple[openai.OpenAI, str], stream: bool) -> None:
    client, model = family
    validator = jsonschema.Draft202012Validator(PLAN_SCHEMA)
    response_format = {"type": "json_schema", "json_schema": {"name": "plan", "schema": PLAN_SCHEMA, "strict": True}}
    answers = []
    for seed in range(SAMPLES // N):
        kwargs = dict(model=model, messages=MESSAGES, n=N, seed=seed, temperature=1.0, max_tokens=400,
                      response_format=response_format)
        whole = client.chat.completions.create(**kwargs)
        texts = [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)]
        assert all(c.finish_reason == "stop" for c in whole.choices)
        if stream:
            chunks = streamed_choices(client.chat.completions.create(stream=True, **kwargs))
            assert [chunks[i]["content"] for i in range(N)] == texts  # same seed, same answers
            assert all(chunks[i]["finish"] == "stop" for i in range(N))
        answers += texts
    assert len(answers) == SAMPLES
    for text in answers:
        validator.validate(json.loads(text))  # strict: no raw control characters, no NaN


def test_json_object_answers_are_json_objects(family: tuple[openai.OpenAI, str]) -> None:
    """Any object: its strings and keys are free, and random weights often write them past any max_tokens
    (OpenAI's JSON mode answers "length" with a cut document too). Every answer the grammar let end parses."""
    client, model = family
    whole = client.chat.completions.create(model=model, messages=MESSAGES, n=8, seed=11, temperature=1.0,
                                           max_tokens=300, response_format={"type": "json_object"})
    ended = [c for c in whole.choices if c.finish_reason == "stop"]
    assert len(ended) >= 2 and all(c.finish_reason in ("stop", "length") for c in whole.choices)
    for choice in ended:
        assert isinstance(json.loads(choice.message.content), dict)


def check_call(call: Any, allowed: set[str]) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in allowed
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_required_and_named_tool_choices_give_valid_calls_streamed_as_whole(
        family: tuple[openai.OpenAI, str], tool_choice: Any) -> None:
    client, model = family
    allowed = {"get_time"} if isinstance(tool_choice, dict) else set(SCHEMAS)
    # One call each (random weights may add calls to an open array until max_tokens); the grammar still
    # ranges over every tool.
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, n=4, seed=3,
                  temperature=1.0, max_tokens=200, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs)
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call, allowed)
    streamed = streamed_choices(client.chat.completions.create(stream=True, **kwargs))
    for choice in whole.choices:
        assembled = streamed[choice.index]
        assert assembled["finish"] == "tool_calls" and assembled["content"] == ""
        assert [(c["name"], c["arguments"]) for c in assembled["calls"].values()] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_a_conversation_with_calls_and_results_renders_and_answers(family: tuple[openai.OpenAI, str]) -> None:
    client, model = family
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_abc", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 3}'}]
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens > 50  # the tools, the call and its result are all in the prompt


def test_auto_tool_choice_answers(family: tuple[openai.OpenAI, str]) -> None:
    """Random weights almost never write a call; what matters is that auto is served (the family's parser is
    recognised from the chat template) and that no call markup leaks into content."""
    client, model = family
    answer = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=16, seed=1)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert "<tool_call>" not in (choice.message.content or "")


def test_guided_answers_are_content_and_calls_when_the_template_opens_think(stack: Stack, tmp_path: Path) -> None:
    """A reasoning parser on and a chat template whose generation prompt ends with `<think>` (Qwen3-2507
    thinking, QwQ): the grammar holds from the first token, so a guided answer has no reasoning and no
    `</think>`; the JSON is the content and the named call is a call, not `reasoning_content`."""
    template = tmp_path / "thinking.jinja"
    generation_prompt = "<|im_start|>assistant\n{% endif %}"
    assert CHATML_TEMPLATE.endswith(generation_prompt)
    template.write_text(CHATML_TEMPLATE.replace(generation_prompt, "<|im_start|>assistant\n<think>\n{% endif %}"))
    port = find_free_port()
    frontend = start_frontend(stack.triton_grpc_url, port, tmp_path / "frontend.log",
                              TOKENIZER_DIR=str(stack.checkpoint_dir), CHAT_TEMPLATE=str(template),
                              REASONING_PARSER="think")
    try:
        root = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{root}/health/ready", 120, frontend)
        ids = httpx.post(f"{root}/tokenize", json={"model": stack.model, "messages": MESSAGES}, timeout=60).json()
        prompt = httpx.post(f"{root}/detokenize", json={"model": stack.model, "tokens": ids["tokens"]}, timeout=60)
        assert prompt.json()["prompt"].endswith("<think>\n")  # the template opens the reasoning
        client = openai.OpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0, timeout=300)

        response_format = {"type": "json_schema",
                           "json_schema": {"name": "plan", "schema": PLAN_SCHEMA, "strict": True}}
        answers = client.chat.completions.create(model=stack.model, messages=MESSAGES, n=4, seed=7, temperature=1.0,
                                                 max_tokens=400, response_format=response_format)
        for choice in answers.choices:
            assert choice.finish_reason == "stop" and not getattr(choice.message, "reasoning_content", None)
            jsonschema.Draft202012Validator(PLAN_SCHEMA).validate(json.loads(choice.message.content))

        named = {"type": "function", "function": {"name": "get_time"}}
        calls = client.chat.completions.create(model=stack.model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                               n=4, seed=3, temperature=1.0, max_tokens=200)
        for choice in calls.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert not getattr(choice.message, "reasoning_content", None)
            [call] = choice.message.tool_calls
            check_call(call, {"get_time"})
    finally:
        stop_process(frontend)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
      "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"extra_body": {"guided_grammar": "root ::= ("}}, "guided_grammar"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
])
def test_what_a_client_gets_wrong_is_a_400_naming_the_field(stack: Stack, body: dict[str, Any], param: str) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=4, **body)
    assert caught.value.body["param"] == param, caught.value.body


def test_guided_regex_and_grammar_for_completions(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)
    regex = client.completions.create(model=stack.model, prompt="Order number:", n=4, seed=5, max_tokens=40,
                                      extra_body={"guided_regex": "[0-9]{3}-[a-z]{2,4}"})
    for choice in regex.choices:
        assert choice.finish_reason == "stop"
        assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", choice.text), choice.text
    grammar = client.completions.create(model=stack.model, prompt="Answer:", n=4, seed=6, max_tokens=10,
                                        extra_body={"guided_grammar": 'root ::= "yes" | "no" | "maybe"'})
    assert {c.text for c in grammar.choices} <= {"yes", "no", "maybe"}


CONST_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"answer": {"const": "yes"},
                                                                  "mood": {"enum": ["calm", "busy"]}},
                                "required": ["answer", "mood"], "additionalProperties": False}


def test_guided_top_logprobs_are_real_tokens_with_finite_logprobs(stack: Stack) -> None:
    """Where the grammar allows fewer tokens than top_logprobs (a const: nearly every position), there are
    fewer alternatives, never filler (token id 0 with logprob -inf, which JSON carries as null)."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": CONST_SCHEMA, "strict": True}}
    for stream in (False, True):
        answer = client.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=60, seed=3,
                                                logprobs=True, top_logprobs=5, response_format=response_format,
                                                stream=stream)
        chunks = list(answer) if stream else [answer]
        entries = [entry for chunk in chunks for choice in chunk.choices
                   for entry in (choice.logprobs.content or [] if choice.logprobs else [])]
        text = "".join(entry.token for entry in entries)
        assert json.loads(text)["answer"] == "yes", text
        assert entries and all(isinstance(e.logprob, float) and math.isfinite(e.logprob) for e in entries)
        for entry in entries:
            assert 1 <= len(entry.top_logprobs) <= 5, entry
            assert all(isinstance(alt.logprob, float) and math.isfinite(alt.logprob) for alt in entry.top_logprobs)
            assert len({alt.token for alt in entry.top_logprobs}) == len(entry.top_logprobs)  # no filler repeats
        assert any(len(entry.top_logprobs) < 5 for entry in entries)
    legacy = client.completions.create(model=stack.model, prompt="Mood:", max_tokens=20, seed=4, logprobs=5,
                                       extra_body={"guided_json": CONST_SCHEMA})
    top = legacy.choices[0].logprobs.top_logprobs
    assert all(math.isfinite(value) for alternatives in top for value in alternatives.values())
    assert any(len(alternatives) < 5 for alternatives in top)
    assert all(math.isfinite(value) for value in legacy.choices[0].logprobs.token_logprobs)
