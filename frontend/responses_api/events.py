"""The events of a streamed response, as OpenAI streams them, and their SSE frames.

Each function builds one event without its `sequence_number`: the stream numbers its events as it sends
them (`numbered`), so that a stored stream replays with the same numbers. A frame is `event: <type>` and
`data: <json>` (OpenAI's framing, unlike chat's bare `data:`), and a stream ends with its terminal event
(`response.completed`, `.incomplete` or `.failed`), never with `[DONE]`.

Order, per output item: `response.output_item.added`, then for a message `response.content_part.added`,
`response.output_text.delta` …, `response.output_text.done`, `response.content_part.done`; for reasoning
the same with `response.reasoning_text.*`; for a function call `response.function_call_arguments.delta` …
and `.done`, for a custom tool's call `response.custom_tool_call_input.delta` … and `.done`; then
`response.output_item.done` (frontend/responses_api/output.py drives this order).
"""

from __future__ import annotations

import json
from typing import Any

Event = dict[str, Any]


def response_event(kind: str, response: dict[str, Any]) -> Event:
    """`response.created`, `.queued`, `.in_progress`, `.completed`, `.incomplete`, `.failed`: the whole
    response object as it stands."""
    return {"type": f"response.{kind}", "response": response}


def output_item_added(output_index: int, item: dict[str, Any]) -> Event:
    return {"type": "response.output_item.added", "output_index": output_index, "item": item}


def output_item_done(output_index: int, item: dict[str, Any]) -> Event:
    return {"type": "response.output_item.done", "output_index": output_index, "item": item}


def content_part_added(item_id: str, output_index: int, content_index: int, part: dict[str, Any]) -> Event:
    return {"type": "response.content_part.added", "item_id": item_id, "output_index": output_index,
            "content_index": content_index, "part": part}


def content_part_done(item_id: str, output_index: int, content_index: int, part: dict[str, Any]) -> Event:
    return {"type": "response.content_part.done", "item_id": item_id, "output_index": output_index,
            "content_index": content_index, "part": part}


def output_text_delta(item_id: str, output_index: int, content_index: int, delta: str,
                      logprobs: list[dict[str, Any]]) -> Event:
    return {"type": "response.output_text.delta", "item_id": item_id, "output_index": output_index,
            "content_index": content_index, "delta": delta, "logprobs": logprobs}


def output_text_done(item_id: str, output_index: int, content_index: int, text: str,
                     logprobs: list[dict[str, Any]]) -> Event:
    return {"type": "response.output_text.done", "item_id": item_id, "output_index": output_index,
            "content_index": content_index, "text": text, "logprobs": logprobs}


def reasoning_text_delta(item_id: str, output_index: int, content_index: int, delta: str) -> Event:
    return {"type": "response.reasoning_text.delta", "item_id": item_id, "output_index": output_index,
            "content_index": content_index, "delta": delta}


def reasoning_text_done(item_id: str, output_index: int, content_index: int, text: str) -> Event:
    return {"type": "response.reasoning_text.done", "item_id": item_id, "output_index": output_index,
            "content_index": content_index, "text": text}


def function_call_arguments_delta(item_id: str, output_index: int, delta: str) -> Event:
    return {"type": "response.function_call_arguments.delta", "item_id": item_id, "output_index": output_index,
            "delta": delta}


def function_call_arguments_done(item_id: str, output_index: int, name: str, arguments: str) -> Event:
    return {"type": "response.function_call_arguments.done", "item_id": item_id, "output_index": output_index,
            "name": name, "arguments": arguments}


def custom_tool_call_input_delta(item_id: str, output_index: int, delta: str) -> Event:
    return {"type": "response.custom_tool_call_input.delta", "item_id": item_id, "output_index": output_index,
            "delta": delta}


def custom_tool_call_input_done(item_id: str, output_index: int, text: str) -> Event:
    return {"type": "response.custom_tool_call_input.done", "item_id": item_id, "output_index": output_index,
            "input": text}


def error_event(message: str, code: str | None, param: str | None) -> Event:
    """A failure after the stream began; the terminal `response.failed` follows it."""
    return {"type": "error", "code": code, "message": message, "param": param}


def numbered(event: Event, sequence_number: int) -> Event:
    return {**event, "sequence_number": sequence_number}


def sse_frame(event: Event) -> bytes:
    """One event as an SSE frame. JSON holds no raw newline, so one `data:` line carries it."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode("utf-8")


def is_terminal(event: Event) -> bool:
    return event["type"] in ("response.completed", "response.incomplete", "response.failed")
