"""A conversation of Responses items as the chat messages the chat template renders.

Items are stored as OpenAI returns them (`input_items`, `output`), and a follow-up's prompt is rebuilt from
them: each ancestor's input items, then its output items, oldest first (the store's `conversation`), then
this request's input. The rebuilt messages are exactly those a client would send to /v1/chat/completions
for the same conversation, and go through the same `ChatMessage.as_template_input`, so the prompt is
token-identical to the chat one and the engine's prefix cache finds the previous turn's prompt:
- `message` -> a message of its role (text parts joined);
- `function_call` -> a tool call of the assistant message just before it (the turn's text), or of a new
  assistant message with no content when it follows anything else;
- `function_call_output` -> a `tool` message answering its `call_id`;
- `custom_tool_call` / `_output` -> the same, the call's input as the one argument of the function the
  model was offered, a namespaced call under its `<namespace>__<name>` (frontend/responses_api/tools.py);
- `local_shell_call` / `_output` -> a call of the `local_shell` function with the action's fields, and its
  output (whose `id` is the call's);
- `reasoning` -> the `reasoning_content` of the assistant message that follows it (templates that render
  reasoning in history, Qwen3's for one, read it there; the others ignore it).
`instructions` are the first, system, message: this request's only, never a previous response's (as OpenAI
documents), because they are no item of any stored response.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, TypeVar

from frontend.api_types.errors import OpenAIError, invalid_request
from frontend.api_types.request_bodies import ChatMessage, FunctionCallIn, ToolCallIn
from frontend.responses_api.objects import (custom_tool_call_item, function_call_item, function_call_output_item,
                                        local_shell_call_item, local_shell_call_output_item, message_item, new_id,
                                        output_text_part, reasoning_item)
from frontend.responses_api.request import (LOCAL_SHELL, CustomToolCallItem, FunctionCallItem, FunctionCallOutputItem,
                                        LocalShellCallItem, LocalShellCallOutputItem, MessageItem, ReasoningItem,
                                        TextPart)
from frontend.responses_api.tools import custom_arguments, model_name, shell_arguments

Item = (MessageItem | FunctionCallItem | CustomToolCallItem | FunctionCallOutputItem | LocalShellCallItem
        | LocalShellCallOutputItem | ReasoningItem)
T = TypeVar("T")


def stored_item(item: Item) -> dict[str, Any]:
    """A request's input item as it is stored and listed (`input_items`): with an id, and in the shape
    OpenAI lists it (an assistant message's parts as `output_text`, a user's as `input_text`)."""
    if isinstance(item, MessageItem):
        parts = [TextPart(type="input_text", text=item.content)] if isinstance(item.content, str) else item.content
        item_id = item.id or new_id("msg")
        if item.role == "assistant":
            return message_item(item_id, "assistant", [output_text_part(part.text) for part in parts])
        return message_item(item_id, item.role, [{"type": "input_text", "text": part.text} for part in parts])
    if isinstance(item, FunctionCallItem):
        return function_call_item(item.id or new_id("fc"), item.call_id, item.name, item.arguments,
                                  namespace=item.namespace)
    if isinstance(item, CustomToolCallItem):
        return custom_tool_call_item(item.id or new_id("ctc"), item.call_id, item.name, item.input,
                                     namespace=item.namespace)
    if isinstance(item, LocalShellCallItem):
        return local_shell_call_item(item.id or new_id("lsh"), item.call_id, item.action.model_dump())
    if isinstance(item, LocalShellCallOutputItem):
        return local_shell_call_output_item(item.id, item.output)
    if isinstance(item, FunctionCallOutputItem):
        return function_call_output_item(item.id or new_id("fco"), item.call_id, item.text, item.type)
    return reasoning_item(item.id or new_id("rs"), item.text,
                          [part.model_dump() for part in item.summary if part.type == "summary_text"])


def _text(parts: list[dict[str, Any]]) -> str:
    return "".join(part.get("text", "") for part in parts)


def _arguments_object(arguments: str, param: str) -> None:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise invalid_request(f"{param}: the arguments of a function_call must be a JSON object (as text)", param)


def chat_messages(items: list[dict[str, Any]], instructions: str | None,
                  params: list[str]) -> list[dict[str, Any]]:
    """The chat template's input for a conversation of stored items. `params[i]` names where item i came
    from, for a 400 (`input.3`, or `previous_response_id` for the stored chain's)."""
    messages: list[ChatMessage] = []
    reasoning: dict[int, str] = {}  # message index -> the reasoning that came before it
    pending_reasoning = ""
    extends_turn = False  # the last message is an assistant turn that this item's call belongs to
    if instructions is not None:
        messages.append(ChatMessage(role="system", content=instructions))
    for item, param in zip(items, params):
        kind = item.get("type")
        if kind == "reasoning":
            pending_reasoning += _text(item.get("content") or [])
            continue
        if kind in ("function_call", "custom_tool_call", "local_shell_call"):
            if kind == "function_call":
                arguments = item["arguments"]
                _arguments_object(arguments, f"{param}.arguments")
            elif kind == "custom_tool_call":  # offered as a function of one string argument (responses_api/tools.py)
                arguments = custom_arguments(item["input"])
            else:
                arguments = shell_arguments(item["action"])
            name = LOCAL_SHELL if kind == "local_shell_call" else model_name(item["name"], item.get("namespace"))
            call = ToolCallIn(id=item["call_id"], function=FunctionCallIn(name=name, arguments=arguments))
            if extends_turn:
                last = messages[-1]
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            call_id = item["id"] if kind == "local_shell_call_output" else item["call_id"]
            messages.append(ChatMessage(role="tool", content=item["output"], tool_call_id=call_id))
        else:
            messages.append(ChatMessage(role=item["role"], content=_text(item["content"])))
        extends_turn = messages[-1].role == "assistant"
        if extends_turn and pending_reasoning:
            index = len(messages) - 1
            reasoning[index] = reasoning.get(index, "") + pending_reasoning
        pending_reasoning = ""  # reasoning belongs to the assistant turn right after it, or to none
    rendered = []
    for index, message in enumerate(messages):
        template_input = message.as_template_input()
        if index in reasoning:
            template_input["reasoning_content"] = reasoning[index]
        rendered.append(template_input)
    return rendered


def conversation_messages(chain: list[dict[str, Any]], new_items: list[dict[str, Any]],
                          instructions: str | None) -> list[dict[str, Any]]:
    """The whole prompt's messages: the stored chain's items, then this request's (a 400 names the item)."""
    params = ["previous_response_id"] * len(chain) + [f"input.{i}" for i in range(len(new_items))]
    try:
        return chat_messages(chain + new_items, instructions, params)
    except OpenAIError:
        raise
    except ValueError as exc:  # a ChatMessage the chat schema refuses (pydantic's ValidationError is one)
        raise invalid_request(f"input: {exc}", "input") from None


def turn_starts(messages: list[dict[str, Any]]) -> list[int]:
    """Where the conversation's turns begin (its user messages, past the leading system ones): the places
    `truncation: auto` may cut it, so that no call is ever left without its assistant turn or output."""
    lead = next((i for i, message in enumerate(messages) if message["role"] not in ("system", "developer")),
                len(messages))
    return [i for i in range(lead + 1, len(messages)) if messages[i]["role"] == "user"]


async def drop_oldest_turns(messages: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], Awaitable[T]],
                            fits: Callable[[T], bool]) -> tuple[list[dict[str, Any]], T] | None:
    """`truncation: auto`: the conversation without as few of its oldest turns as make it fit (the leading
    system messages stay), found by bisection over the turn boundaries (each try is one render); None if
    not even its last turn fits."""
    starts = turn_starts(messages)
    lead = next((i for i, message in enumerate(messages) if message["role"] not in ("system", "developer")), 0)
    best: tuple[list[dict[str, Any]], T] | None = None
    low, high = 0, len(starts) - 1
    while low <= high:
        middle = (low + high) // 2
        kept = messages[:lead] + messages[starts[middle]:]
        rendered = await render(kept)
        if fits(rendered):
            best, high = (kept, rendered), middle - 1
        else:
            low = middle + 1
    return best
