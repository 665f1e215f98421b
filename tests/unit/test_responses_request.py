"""The `/v1/responses` body behind FastAPI and the app's error handlers: what this server cannot honour is a
400 in OpenAI's shape naming the field, never a 500; unknown fields are ignored; the echo of the request's
parameters parses into the official client's `Response`."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from openai.types.responses import Response

from frontend.api_types.errors import OpenAIError, install_error_handlers
from frontend.responses_api.objects import request_echo, response_object
from frontend.responses_api.request import MAX_INPUT_ITEMS, ResponsesRequest
from frontend.responses_api.service import chat_request


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/responses")
    async def responses(req: ResponsesRequest) -> dict[str, Any]:
        return {"items": len(req.items)}

    return TestClient(app, raise_server_exceptions=False)


def post(client: TestClient, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = client.post("/responses", content=json.dumps(body), headers={"Content-Type": "application/json"})
    return response.status_code, response.json()


TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


@pytest.mark.parametrize("extra, param", [
    ({"include": ["reasoning.no_such_thing"]}, "include"),
    ({"tools": [{"type": "no_such_tool"}]}, "tools.0.type"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "mcp", "server_label": "s"}], "tool_choice": {"type": "mcp", "server_label": "s"}},
     "tool_choice"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f"}]},
                {"type": "function", "name": "ns__f"}]}, "tools"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]}, "tools.0.tools.0"),
    ({"tools": [{"type": "custom", "name": "c", "format": {"type": "grammar", "syntax": "regex"}}]}, "tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "custom", "name": "f"}}, "tool_choice"),
    ({"tools": [{"type": "namespace", "name": "n" * 40, "tools": [{"type": "function", "name": "f" * 30}]}]}, "tools"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input.0.output.0"),
    ({"input": [{"role": "user", "content": "x"}] * (MAX_INPUT_ITEMS + 1)}, "input"),
    ({"background": True, "store": False}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(client: TestClient, extra: dict[str, Any],
                                                          param: str) -> None:
    status, body = post(client, {"model": "m", "input": "hi", **extra})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored_and_easy_messages_are_messages(client: TestClient) -> None:
    status, body = post(client, {"model": "m", "service_tier": "auto", "future_field": {"x": 1},
                                 "input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    assert (status, body) == (200, {"items": 2})


def test_the_echo_parses_as_the_clients_response_and_the_chat_request_carries_the_fields() -> None:
    req = ResponsesRequest.model_validate({
        "model": "m", "input": "hi", "instructions": "sys", "tools": [TOOL], "tool_choice": {"type": "function",
                                                                                           "name": "f"},
        "parallel_tool_calls": False, "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
        "include": ["message.output_text.logprobs"], "top_logprobs": 2, "metadata": {"a": "b"}, "user": "u",
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
        "reasoning": {"effort": "low"}, "truncation": "disabled"})
    parsed = Response.model_validate(response_object(request_echo(req), response_id="resp_1", created_at=1,
                                                     model="m", status="completed", output=[]))
    assert parsed.tool_choice.name == "f" and parsed.tools[0].name == "f" and parsed.top_logprobs == 2
    assert parsed.text.format.type == "json_schema" and parsed.text.format.strict is True
    chat = chat_request(req, [])
    assert chat.tools[0].function.name == "f" and chat.tool_choice.function.name == "f"
    assert not chat.parallel_tool_calls and chat.requested_max_tokens == 7 and chat.seed == 3
    assert chat.logprobs and chat.top_logprobs == 2 and chat.temperature == 0.5 and chat.top_p == 0.9
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.name == "s"


# ----- round 2: what the Codex CLI sends (namespace and hosted tools, every include value) --------------------
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
             "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]}
CUSTOM = {"type": "custom", "name": "code", "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]+"}}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "file_search", "vector_store_ids": ["v"]},
          {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "image_generation"},
          {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"},
          {"type": "mcp", "server_label": "s", "server_url": "https://example.invalid"}]
ALL_INCLUDES = ["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                "message.input_image.image_url", "computer_call_output.output.image_url",
                "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]


def test_namespace_custom_hosted_tools_and_every_include_are_accepted(client: TestClient) -> None:
    status, body = post(client, {"model": "m", "input": "hi", "tools": [TOOL, NAMESPACE, CUSTOM, *HOSTED],
                                 "include": ALL_INCLUDES, "store": False, "reasoning": {"summary": "auto"},
                                 "prompt_cache_key": "k", "client_metadata": {"a": "b"}})
    assert status == 200, body


def test_the_model_is_offered_functions_only_and_the_echo_keeps_every_tool() -> None:
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [TOOL, NAMESPACE, CUSTOM, *HOSTED],
                                           "tool_choice": {"type": "function", "name": "spawn_agent"}})
    chat = chat_request(req, [{"role": "user", "content": "hi"}])
    assert [t.function.name for t in chat.tools] == ["f", "multi_agent_v1__spawn_agent", "code"]
    assert chat.tools[2].function.parameters["required"] == ["input"]  # a custom tool: one string argument
    assert chat.tool_choice.function.name == "multi_agent_v1__spawn_agent"
    echo = request_echo(req)
    assert [t["type"] for t in echo["tools"]] == ["function", "namespace", "custom", *(t["type"] for t in HOSTED)]
    Response.model_validate(response_object(echo, response_id="resp_1", created_at=1, model="m",
                                            status="completed", output=[]))
    forced = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [CUSTOM],
                                              "tool_choice": {"type": "custom", "name": "code"}})
    chat = chat_request(forced, [{"role": "user", "content": "hi"}])
    assert chat.guided_regex == "[0-9]+" and chat.tool_choice == "none"  # the whole answer is the input
    only_hosted = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": HOSTED})
    assert chat_request(only_hosted, [{"role": "user", "content": "hi"}]).tools is None


def test_a_forced_custom_tool_with_a_lark_grammar_is_guided_by_its_ebnf() -> None:
    lark = {"type": "custom", "name": "say", "format": {"type": "grammar", "syntax": "lark",
                                                         "definition": 'start: WORD (" " WORD)*\nWORD: /[a-z]+/'}}
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [lark],
                                           "tool_choice": {"type": "custom", "name": "say"}})
    chat = chat_request(req, [{"role": "user", "content": "hi"}])
    assert chat.guided_grammar.startswith("root ::=") and chat.tool_choice == "none"
    broken = {**lark, "format": {**lark["format"], "definition": "start: ("}}
    bad = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [broken],
                                           "tool_choice": {"type": "custom", "name": "say"}})
    with pytest.raises(OpenAIError) as refused:
        chat_request(bad, [{"role": "user", "content": "hi"}])
    assert refused.value.param == "tools"
