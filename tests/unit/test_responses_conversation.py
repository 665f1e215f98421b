"""Responses items as the chat template's messages: exactly the messages a chat client would send for the
same conversation (so the prompt is token-identical), with calls grouped into their assistant turn, tool
outputs as tool messages, reasoning on the turn it preceded, and `instructions` first; stored items in the
shapes the official client lists."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses.response_item import ResponseItem
from pydantic import TypeAdapter

from frontend.api_types.errors import OpenAIError
from frontend.api_types.request_bodies import ChatMessage
from frontend.responses_api.conversation import (chat_messages, conversation_messages, drop_oldest_turns, stored_item,
                                            turn_starts)
from frontend.responses_api.request import ResponsesRequest

ITEM = TypeAdapter(ResponseItem)


def items_of(input_: Any) -> list[dict[str, Any]]:
    return [stored_item(item) for item in ResponsesRequest(model="m", input=input_).items]


def as_chat(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the chat route renders for these chat messages."""
    return [ChatMessage.model_validate(message).as_template_input() for message in messages]


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    assert conversation_messages([], items_of("Hello"), "Be brief.") == as_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])


def test_a_tool_round_is_the_chat_conversation_of_it() -> None:
    previous = items_of([{"role": "user", "content": "Weather in Oslo and Rome?"}]) + [
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "w", "arguments": '{"c": "Oslo"}',
         "status": "completed"},
        {"id": "fc_2", "type": "function_call", "call_id": "call_2", "name": "w", "arguments": '{"c": "Rome"}',
         "status": "completed"}]
    new = items_of([{"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                    {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text",
                                                                                      "text": "rain"}]}])
    assert conversation_messages(previous, new, None) == as_chat([
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"c": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "w", "arguments": '{"c": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"}])


def test_a_call_after_a_tool_output_opens_a_new_assistant_turn_with_no_content() -> None:
    messages = chat_messages([
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "1"},
        {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"}], None, ["input.0", "input.1", "input.2"])
    assert [(m["role"], m["content"], len(m.get("tool_calls", []))) for m in messages] == [
        ("assistant", "", 1), ("tool", "1", 0), ("assistant", "", 1)]


def test_reasoning_goes_with_the_assistant_turn_after_it_and_nowhere_else() -> None:
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}]},
             {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "orphan"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "again"}]}]
    messages = chat_messages(items, None, [f"input.{i}" for i in range(len(items))])
    assert [m.get("reasoning_content") for m in messages] == [None, "think", None]


def test_bad_call_arguments_name_the_item() -> None:
    with pytest.raises(OpenAIError) as refused:
        conversation_messages([], items_of([{"type": "function_call", "call_id": "a", "name": "f",
                                             "arguments": "not json"}]), None)
    assert refused.value.param == "input.0.arguments"
    stored_call = {"type": "function_call", "call_id": "a", "name": "f", "arguments": "[]"}
    with pytest.raises(OpenAIError) as refused:
        conversation_messages([stored_call], [], None)
    assert refused.value.param == "previous_response_id.arguments"


def test_stored_items_have_ids_and_the_listed_shapes() -> None:
    stored = items_of([
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "id": "fc_given"},
        {"type": "function_call_output", "call_id": "c", "output": "done"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}],
         "content": [{"type": "reasoning_text", "text": "r"}]}])
    assert [item["type"] for item in stored] == ["message", "message", "function_call", "function_call_output",
                                                 "reasoning"]
    assert stored[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert stored[1]["content"][0]["type"] == "output_text" and stored[2]["id"] == "fc_given"
    assert len({item["id"] for item in stored}) == 5
    for item in stored:
        assert ITEM.validate_python(item).type == item["type"]


async def test_truncation_auto_drops_the_oldest_whole_turns_that_make_it_fit() -> None:
    messages = [{"role": "system", "content": "sys"}] + [
        message for turn in range(5) for message in (
            {"role": "user", "content": f"q{turn}"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": f"c{turn}"}]},
            {"role": "tool", "content": "x" * 10, "tool_call_id": f"c{turn}"})]
    assert turn_starts(messages) == [4, 7, 10, 13]
    renders: list[int] = []

    async def render(kept: list[dict[str, Any]]) -> int:  # a "prompt" as long as its messages' text
        renders.append(len(kept))
        return sum(len(m["content"]) for m in kept)

    kept, length = await drop_oldest_turns(messages, render, lambda n: n <= 40)
    assert [m["content"] for m in kept if m["role"] == "user"] == ["q2", "q3", "q4"] and length == 39
    assert kept[0]["role"] == "system" and len(renders) <= 3  # bisection, not one render per turn
    assert await drop_oldest_turns(messages, render, lambda n: n <= 5) is None
