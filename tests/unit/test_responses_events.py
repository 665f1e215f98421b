"""The Responses stream's events and output items, without servers: each renderer's shape parses into the
official client's typed event, the SSE framing, and the assembler's order of events for text, reasoning,
tool calls, a cut-off answer and an interrupted one; streamed and non-streamed output are the same items."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response
from openai.types.responses.response_stream_event import ResponseStreamEvent
from pydantic import TypeAdapter

from frontend.generation.serving import TextDelta, TokenInfo
from frontend.parsing.tool_parsers import ToolCallDelta
from frontend.responses_api import events
from frontend.responses_api.objects import message_item, output_text_part, request_echo, response_object, usage_object
from frontend.responses_api.output import OutputAssembler
from frontend.responses_api.request import ResponsesRequest

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


class Strings:
    def token_text(self, token_id: int) -> str:
        return f"<{token_id}>"

    def token_bytes(self, token_id: int) -> bytes:
        return f"<{token_id}>".encode()


def parsed(event: events.Event, sequence_number: int = 0) -> object:
    """The event as the official client parses it (a validation error fails the test)."""
    return STREAM_EVENT.validate_python(events.numbered(event, sequence_number))


def a_response(status: str = "completed") -> dict:
    req = ResponsesRequest(model="m", input="hi")
    return response_object(request_echo(req), response_id="resp_1", created_at=1, model="m", status=status,
                           output=[message_item("msg_1", "assistant", [output_text_part("hi")])],
                           usage=usage_object(3, 1))


@pytest.mark.parametrize("event", [
    events.response_event("created", a_response("in_progress")),
    events.response_event("completed", a_response()),
    events.response_event("failed", a_response("failed")),
    events.output_item_added(0, message_item("msg_1", "assistant", [], "in_progress")),
    events.content_part_added("msg_1", 0, 0, output_text_part("")),
    events.output_text_delta("msg_1", 0, 0, "Hel", []),
    events.output_text_done("msg_1", 0, 0, "Hello", []),
    events.content_part_done("msg_1", 0, 0, output_text_part("Hello")),
    events.reasoning_text_delta("rs_1", 0, 0, "hmm"),
    events.reasoning_text_done("rs_1", 0, 0, "hmm"),
    events.function_call_arguments_delta("fc_1", 1, '{"a"'),
    events.function_call_arguments_done("fc_1", 1, "f", '{"a": 1}'),
    events.error_event("boom", "engine_error", None),
], ids=lambda event: event["type"])
def test_every_renderer_parses_into_the_clients_typed_event(event: events.Event) -> None:
    typed = parsed(event, 7)
    assert type(typed).__name__.endswith("Event") and typed.type == event["type"]
    assert typed.sequence_number == 7


def test_a_frame_is_an_event_line_and_one_data_line() -> None:
    frame = events.sse_frame(events.numbered(events.output_text_delta("msg_1", 0, 0, "a\nb", []), 3))
    event_line, data_line, *rest = frame.decode().split("\n")
    assert event_line == "event: response.output_text.delta" and rest == ["", ""]
    assert json.loads(data_line.removeprefix("data: "))["delta"] == "a\nb"


def types_of(emitted: list[events.Event]) -> list[str]:
    return [event["type"] for event in emitted]


def test_text_then_a_tool_call_in_openai_order() -> None:
    assembler = OutputAssembler()
    emitted = assembler.feed(TextDelta("Let me check.", None))
    emitted += assembler.feed(TextDelta("", None, tool_calls=(ToolCallDelta(0, "get_weather", '{"city":'),)))
    emitted += assembler.feed(TextDelta("", "tool_calls", tool_calls=(ToolCallDelta(0, None, ' "Oslo"}'),)))
    assert types_of(emitted) == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    message, call = assembler.output
    assert message["content"][0]["text"] == "Let me check." and message["status"] == "completed"
    assert call["arguments"] == '{"city": "Oslo"}' and call["name"] == "get_weather"
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert [e["output_index"] for e in emitted if e["type"] == "response.output_item.added"] == [0, 1]
    for i, event in enumerate(emitted):
        parsed(event, i)


def test_two_calls_are_two_items() -> None:
    assembler = OutputAssembler()
    assembler.feed(TextDelta("", None, tool_calls=(ToolCallDelta(0, "a", "{}"), ToolCallDelta(1, "b", "{"))))
    assembler.feed(TextDelta("", "tool_calls", tool_calls=(ToolCallDelta(1, None, "}"),)))
    assert [(item["name"], item["arguments"]) for item in assembler.output] == [("a", "{}"), ("b", "{}")]


def test_reasoning_becomes_a_reasoning_item_before_the_message() -> None:
    assembler = OutputAssembler()
    emitted = assembler.feed(TextDelta("", None, [TokenInfo(1, None, [])], reasoning="Thinking"))
    emitted += assembler.feed(TextDelta("Answer", "stop", [TokenInfo(2, None, [])]))
    assert types_of(emitted)[:6] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    reasoning, message = assembler.output
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking"}]
    assert message["content"][0]["text"] == "Answer" and assembler.reasoning_tokens == 1
    Response.model_validate({**a_response(), "output": assembler.output})


def test_a_cut_off_answer_leaves_its_item_incomplete() -> None:
    assembler = OutputAssembler()
    assembler.feed(TextDelta("Once upon", None))
    emitted = assembler.feed(TextDelta(" a time", "length"))
    assert assembler.output[0]["status"] == "incomplete" and assembler.finish_reason == "length"
    assert emitted[-1]["item"]["status"] == "incomplete"


def test_an_empty_answer_is_an_empty_message_and_an_interrupted_one_ends_its_item() -> None:
    empty = OutputAssembler()
    assert types_of(empty.feed(TextDelta("", "stop"))) == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done"]
    assert empty.output[0]["content"][0]["text"] == ""
    interrupted = OutputAssembler()
    interrupted.feed(TextDelta("Hal", None))
    assert interrupted.items[0]["status"] == "in_progress"
    interrupted.interrupted()
    assert interrupted.output[0]["status"] == "incomplete" and interrupted.interrupted() == []


def test_logprobs_only_when_asked_and_streamed_pieces_join_to_the_item() -> None:
    deltas = [TextDelta("a", None, [TokenInfo(5, -0.5, [(5, -0.5), (6, -1.0)])]),
              TextDelta("b", "stop", [TokenInfo(6, -0.25, [(6, -0.25)])])]
    plain = OutputAssembler(Strings(), None)
    for delta in deltas:
        plain.feed(delta)
    assert "logprobs" not in plain.output[0]["content"][0]
    asked = OutputAssembler(Strings(), 1)
    emitted = [event for delta in deltas for event in asked.feed(delta)]
    part = asked.output[0]["content"][0]
    assert part["logprobs"] == [
        {"token": "<5>", "bytes": list(b"<5>"), "logprob": -0.5,
         "top_logprobs": [{"token": "<5>", "bytes": list(b"<5>"), "logprob": -0.5}]},
        {"token": "<6>", "bytes": list(b"<6>"), "logprob": -0.25,
         "top_logprobs": [{"token": "<6>", "bytes": list(b"<6>"), "logprob": -0.25}]}]
    streamed = [entry for e in emitted if e["type"] == "response.output_text.delta" for entry in e["logprobs"]]
    assert streamed == part["logprobs"]
    Response.model_validate({**a_response(), "output": asked.output})
