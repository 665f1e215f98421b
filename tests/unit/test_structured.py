"""From OpenAI request fields to the engine's guide (frontend/planning/structured.py): the schemas checked before
anything reaches the engine, one guide per request, tool_choice as a grammar over the tools."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from frontend.api_types.errors import OpenAIError
from frontend.api_types.request_bodies import ChatCompletionRequest, CompletionRequest
from frontend.planning.structured import chat_guide, extension_guide

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {}}}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def refused(build, param: str) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        build()
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    return caught.value


def test_response_formats() -> None:
    assert chat_guide(chat()) is None
    assert chat_guide(chat(response_format={"type": "text"})) is None
    any_object = chat_guide(chat(response_format={"type": "json_object"}))
    assert (any_object.type, json.loads(any_object.text)) == ("json_schema", {"type": "object"})
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "additionalProperties": False}
    guide = chat_guide(chat(response_format={"type": "json_schema",
                                             "json_schema": {"name": "x", "schema": schema, "strict": True}}))
    assert (guide.type, json.loads(guide.text), guide.param) == ("json_schema", schema, "response_format")


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {"minimum": "zero"}}}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": "a"}}},
])
def test_a_schema_that_is_not_one_is_a_400_naming_response_format(response_format: dict) -> None:
    error = refused(lambda: chat_guide(chat(response_format=response_format)), "response_format")
    assert "not a valid JSON schema" in error.message


def test_response_format_shapes_are_checked_by_the_request_schema() -> None:
    refused(lambda: chat(response_format={"type": "json_schema"}), "response_format")


def test_named_tool_choice_guides_the_arguments_of_that_tool() -> None:
    guide = chat_guide(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert json.loads(guide.text) == WEATHER["function"]["parameters"] and guide.param == "tool_choice"
    empty = chat_guide(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert json.loads(empty.text) == {"type": "object"}  # no parameters: any object


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_a_grammar_over_every_tool_not_the_first(parallel: bool) -> None:
    guide = chat_guide(chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel))
    schema = json.loads(guide.text)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "get_weather", "parameters": {"city": "Oslo"}}])
    assert validator.is_valid([{"name": "get_time", "parameters": {}}])
    assert not validator.is_valid([])  # at least one call
    assert not validator.is_valid([{"name": "get_weather", "parameters": {}}])  # its schema holds
    assert not validator.is_valid([{"name": "nope", "parameters": {}}])
    two = [{"name": "get_time", "parameters": {}}] * 2
    assert validator.is_valid(two) is parallel


def test_tool_choice_mistakes_are_400s() -> None:
    refused(lambda: chat(tool_choice="required"), "tool_choice")  # no tools
    refused(lambda: chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice")
    refused(lambda: chat(tools=[WEATHER, WEATHER]), "tools")
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}
    refused(lambda: chat_guide(chat(tools=[bad], tool_choice="required")), "tools.0.function.parameters")


def test_two_guides_at_once_are_refused() -> None:
    refused(lambda: chat_guide(chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})),
            "tool_choice")
    refused(lambda: chat(guided_regex="a+", guided_grammar="root ::= \"a\""), "guided_grammar")


def test_vllm_extensions_for_completions() -> None:
    assert extension_guide(CompletionRequest(model="m", prompt="p")) is None
    regex = extension_guide(CompletionRequest(model="m", prompt="p", guided_regex=r"\d{3}"))
    assert (regex.type, regex.text, regex.param) == ("regex", r"\d{3}", "guided_regex")
    grammar = extension_guide(CompletionRequest(model="m", prompt="p", guided_grammar='root ::= "yes" | "no"'))
    assert grammar.type == "ebnf_grammar"
    schema = extension_guide(CompletionRequest(model="m", prompt="p", guided_json={"type": "integer"}))
    assert (schema.type, schema.param) == ("json_schema", "guided_json")


def test_conversation_with_calls_renders_calls_as_objects() -> None:
    req = chat(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=[WEATHER])
    assistant, tool = (m.as_template_input() for m in req.messages[1:])
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    refused(lambda: chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]), "messages")
