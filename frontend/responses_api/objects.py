"""The Responses API's objects as OpenAI sends them: the response, its output items, usage, and the list and
deletion shapes. Pure functions building plain dicts (what is stored is what is sent): each shape is checked
against the official `openai` client's types (tests/unit/test_responses_objects.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from frontend.responses_api.request import FunctionToolChoice, ResponsesRequest

TERMINAL_STATUSES = ("completed", "incomplete", "failed", "cancelled")


def new_id(prefix: str) -> str:
    """`resp_…`, `msg_…`, `fc_…`, `rs_…`, `call_…`: OpenAI's prefixes, then 32 random hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ----- items ---------------------------------------------------------------------------------------------
def output_text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def message_item(item_id: str, role: str, content: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": role, "content": content, "status": status}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str = "completed", namespace: str | None = None) -> dict[str, Any]:
    """A function call; a namespaced function's has its `namespace` apart from its `name`, as OpenAI's."""
    item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def custom_tool_call_item(item_id: str, call_id: str, name: str, text: str, status: str = "completed",
                          namespace: str | None = None) -> dict[str, Any]:
    item = {"id": item_id, "type": "custom_tool_call", "call_id": call_id, "name": name, "input": text,
            "status": status}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def local_shell_call_item(item_id: str, call_id: str, action: dict[str, Any],
                          status: str = "completed") -> dict[str, Any]:
    """A `local_shell` call: the command the client is asked to run (OpenAI's `exec` action)."""
    return {"id": item_id, "type": "local_shell_call", "call_id": call_id, "status": status,
            "action": {"type": "exec", "command": [], "env": {}, "timeout_ms": None, "user": None,
                       "working_directory": None, **action}}


def local_shell_call_output_item(call_id: str, output: str) -> dict[str, Any]:
    """What a `local_shell` call printed; its `id` is the call's `call_id`, as OpenAI has it."""
    return {"id": call_id, "type": "local_shell_call_output", "output": output, "status": "completed"}


def function_call_output_item(item_id: str, call_id: str, output: str,
                              kind: str = "function_call_output") -> dict[str, Any]:
    """A call's output sent back (`function_call_output`, or `custom_tool_call_output`)."""
    return {"id": item_id, "type": kind, "call_id": call_id, "output": output, "status": "completed"}


def reasoning_item(item_id: str, text: str, summary: list[dict[str, Any]] | None = None,
                   status: str = "completed", encrypted_content: str | None = None) -> dict[str, Any]:
    item = {"id": item_id, "type": "reasoning", "summary": summary or [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [], "status": status}
    if encrypted_content is not None:
        item["encrypted_content"] = encrypted_content
    return item


# ----- the response --------------------------------------------------------------------------------------
def tool_choice_echo(choice: str | FunctionToolChoice) -> str | dict[str, str]:
    if isinstance(choice, str):
        return choice
    return {"type": choice.type, "name": choice.name}


def request_echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request's parameters, as the response object repeats them."""
    text_format = req.format.model_dump(by_alias=True, exclude_none=True)
    return {
        "background": req.background,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                      "summary": req.reasoning.summary if req.reasoning else None},
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",
        "store": req.store,
        "temperature": req.temperature,
        "text": {"format": text_format, "verbosity": (req.text.verbosity if req.text else None) or "medium"},
        "tool_choice": tool_choice_echo(req.effective_tool_choice),
        "tools": [tool.echo() for tool in req.tools or []],  # hosted ones too: accepted, never run (README)
        "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
        "top_p": req.top_p,
        "truncation": req.truncation,
        "user": req.user,
    }


def usage_object(input_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    """Cached tokens are reported as 0: the engine does not say per request how much of the prompt its
    prefix cache held (its own counters do, server-wide)."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def error_object(message: str, code: str = "server_error") -> dict[str, Any]:
    """The response's `error` (OpenAI's codes are an enum: what fails here is the server's, or the prompt's)."""
    return {"code": code, "message": message}


def response_object(echo: dict[str, Any], *, response_id: str, created_at: int, model: str, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None, incomplete_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": now() if status == "completed" else None,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "model": model,
        "output": output,
        "usage": usage,
        **echo,
    }


# ----- other endpoints' shapes ---------------------------------------------------------------------------
def item_list(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def deleted_object(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True}
