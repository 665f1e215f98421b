"""`/v1/responses`, round 2, on the real stack through the official `openai` client: what the Codex CLI sends
(a `namespace` tool, a hosted `web_search`, every `include` value, `store: false`), a forced call of a namespaced
function that the client parses with its namespace and that routes back, a `custom` tool forced through its
regex grammar, a hosted tool named by tool_choice (a 400), and reasoning sealed for the client
(`reasoning.encrypted_content`): sent back, the server renders the same reasoning into the prompt (the engine's
prefix cache finds the first turn), and an altered blob is a 400 naming `input`.

The demo weights are random: tests compare the stack with itself, never with expected words.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from openai.types.responses import ResponseCustomToolCall, ResponseFunctionToolCall, ResponseReasoningItem

from build_engine.demo_checkpoint import CHATML_TEMPLATE
from tests.integration.conftest import ENGINE_WAIT_S, Stack, engine_settled, frontend_on, wait_until

pytestmark = pytest.mark.integration

SPAWN = {"type": "function", "name": "spawn_agent", "description": "Start an agent",
         "parameters": {"type": "object", "properties": {"task": {"type": "string", "maxLength": 12}},
                        "required": ["task"], "additionalProperties": False}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Agents", "tools": [SPAWN]}
CODE_REGEX = "[0-9]{3}-[a-z]{2}"
CUSTOM = {"type": "custom", "name": "set_code", "description": "Set the code",
          "format": {"type": "grammar", "syntax": "regex", "definition": CODE_REGEX}}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
ALL_INCLUDES = ["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                "message.input_image.image_url", "computer_call_output.output.image_url",
                "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]
REASONING_KEY = "a-test-key-of-at-least-32-characters-0123456789"


def test_codex_shaped_requests_are_served(stack: Stack, client: openai.OpenAI) -> None:
    """Namespace, custom (regex grammar) and web_search tools, every include value, store false: a 200, and the
    echo states every tool (the hosted one too: accepted, never offered)."""
    answer = client.responses.create(model=stack.model, input="Hello", max_output_tokens=8, temperature=0,
                                     tools=[{"type": "function", "name": "exec_command",
                                             "parameters": {"type": "object"}}, NAMESPACE, CUSTOM, WEB_SEARCH],
                                     include=ALL_INCLUDES, store=False, parallel_tool_calls=True,
                                     reasoning={"summary": "auto"}, prompt_cache_key="k",
                                     extra_body={"client_metadata": {"turn_id": "t"}})
    assert answer.status in ("completed", "incomplete") and answer.output
    assert [tool.type for tool in answer.tools] == ["function", "namespace", "custom", "web_search"]
    assert answer.tools[1].tools[0].name == "spawn_agent" and answer.store is False


def test_a_forced_namespaced_call_parses_with_its_namespace_and_routes_back(stack: Stack,
                                                                         client: openai.OpenAI) -> None:
    call = client.responses.create(model=stack.model, input="Start an agent", temperature=0, max_output_tokens=64,
                                   tools=[NAMESPACE, WEB_SEARCH], tool_choice={"type": "function", "name": "spawn_agent"})
    assert call.status == "completed"
    function_call = call.output[-1]
    assert isinstance(function_call, ResponseFunctionToolCall)
    assert (function_call.name, function_call.namespace) == ("spawn_agent", "multi_agent_v1")
    assert set(json.loads(function_call.arguments)) == {"task"}
    streamed = list(client.responses.create(model=stack.model, input="Start an agent", temperature=0,
                                            max_output_tokens=64, tools=[NAMESPACE], stream=True,
                                            tool_choice={"type": "function", "name": "spawn_agent"}))
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert (done[-1].name, done[-1].namespace, done[-1].arguments) == ("spawn_agent", "multi_agent_v1",
                                                                       function_call.arguments)
    # The client sends the call back with its output, as Codex does (store false: the whole history as input).
    answer = client.responses.create(model=stack.model, temperature=0, max_output_tokens=4, tools=[NAMESPACE],
                                     store=False, input=[
                                         {"role": "user", "content": "Start an agent"},
                                         function_call.model_dump(exclude_none=True),
                                         {"type": "function_call_output", "call_id": function_call.call_id,
                                          "output": "agent-1"}])
    assert answer.status in ("completed", "incomplete")
    assert answer.usage.input_tokens > call.usage.input_tokens  # the call and its output are in the prompt


def test_a_forced_custom_tool_follows_its_regex(stack: Stack, client: openai.OpenAI) -> None:
    call = client.responses.create(model=stack.model, input="Set a code", temperature=1.0, max_output_tokens=32,
                                   tools=[CUSTOM], tool_choice={"type": "custom", "name": "set_code"})
    [custom] = call.output
    assert isinstance(custom, ResponseCustomToolCall) and custom.name == "set_code"
    assert re.fullmatch(CODE_REGEX, custom.input), custom.input
    assert call.status == "completed"
    lark = {"type": "custom", "name": "say", "format": {"type": "grammar", "syntax": "lark",
                                                         "definition": 'start: WORD (" " WORD)?\nWORD: /[a-z]{1,8}/'}}
    said = client.responses.create(model=stack.model, input="Say a word", temperature=1.0, max_output_tokens=32,
                                   tools=[lark], tool_choice={"type": "custom", "name": "say"})
    assert said.status == "completed" and re.fullmatch("[a-z]{1,8}( [a-z]{1,8})?", said.output[0].input)


def test_tool_choice_naming_a_hosted_tool_is_a_400(stack: Stack, client: openai.OpenAI) -> None:
    for choice in ({"type": "web_search"}, {"type": "web_search_preview"}, "required"):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=stack.model, input="x", tools=[WEB_SEARCH], tool_choice=choice)
        assert refused.value.param == "tool_choice", refused.value.body


# ----- reasoning the client carries -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reasoning_url(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A frontend with the think reasoning parser and a template that opens `<think>` and renders an assistant
    turn's reasoning in history (as Qwen3's does), with a reasoning key."""
    log_dir = tmp_path_factory.mktemp("reasoning")
    generation_prompt = "<|im_start|>assistant\n{% endif %}"
    turn_start = "<|im_start|>{{ message['role'] }}\n"
    assert CHATML_TEMPLATE.endswith(generation_prompt) and CHATML_TEMPLATE.count(turn_start) == 1
    template = CHATML_TEMPLATE.replace(generation_prompt, "<|im_start|>assistant\n<think>\n{% endif %}").replace(
        turn_start, turn_start + "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n"
                                 "</think>\n\n{% endif %}")
    (log_dir / "thinking.jinja").write_text(template)
    with frontend_on(stack, "tensorrt_llm", log_dir, TOKENIZER_DIR=str(stack.checkpoint_dir),
                     CHAT_TEMPLATE=str(log_dir / "thinking.jinja"), REASONING_PARSER="think",
                     RESPONSES_REASONING_KEYS=REASONING_KEY,
                     RESPONSES_DB_URL=f"sqlite:///{log_dir / 'responses.sqlite3'}") as url:
        yield url


def test_encrypted_reasoning_is_rendered_back_into_the_prompt(stack: Stack, reasoning_url: str) -> None:
    client = openai.OpenAI(base_url=reasoning_url, api_key="unused", max_retries=0, timeout=120)
    question = {"role": "user", "content": "Why is the sky blue?"}
    first = client.responses.create(model=stack.model, input=[question], temperature=0, max_output_tokens=24,
                                    store=False, include=["reasoning.encrypted_content"])
    reasoning = first.output[0]
    assert isinstance(reasoning, ResponseReasoningItem) and reasoning.encrypted_content
    text = reasoning.content[0].text
    assert text and text not in reasoning.encrypted_content

    def follow_up(item: dict[str, Any] | None) -> list[dict[str, Any]]:
        return [question, *([item] if item else []), {"role": "assistant", "content": "Rayleigh."},
                {"role": "user", "content": "And at night?"}]

    idle = engine_settled(stack.triton_metrics_url, "tensorrt_llm")
    hits_before = idle["prefix_cache_hits_tokens_total"]
    # As Codex sends it back: the sealed blob only, no content.
    sealed = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
    second = client.responses.create(model=stack.model, input=follow_up(sealed), temperature=0, max_output_tokens=2,
                                     store=False, include=["reasoning.encrypted_content"])
    assert second.status in ("completed", "incomplete")
    # The engine found the first turn's prompt (its blocks up to where the rendered history goes on).
    assert wait_until(lambda: stack.engine_metric("prefix_cache_hits_tokens_total") - hits_before > 0, ENGINE_WAIT_S)
    # The same reasoning was rendered: the prompt is the one of the reasoning sent in the clear, and longer
    # than the one without it.
    clear = {"type": "reasoning", "id": reasoning.id, "summary": [],
             "content": [{"type": "reasoning_text", "text": text}]}
    in_clear = client.responses.create(model=stack.model, input=follow_up(clear), temperature=0, max_output_tokens=2,
                                       store=False)
    without = client.responses.create(model=stack.model, input=follow_up(None), temperature=0, max_output_tokens=2,
                                      store=False)
    assert second.usage.input_tokens == in_clear.usage.input_tokens > without.usage.input_tokens

    blob = reasoning.encrypted_content
    tampered = blob[:30] + ("A" if blob[30] != "A" else "B") + blob[31:]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=stack.model, input=follow_up({**sealed, "encrypted_content": tampered}),
                                max_output_tokens=2, store=False)
    assert refused.value.param == "input" and refused.value.code == "invalid_encrypted_content"
    # Another server's key cannot open it either (a 400, never a 500).
    response = httpx.post(f"{stack.base_url}/responses", timeout=60, json={
        "model": stack.model, "input": follow_up(sealed), "max_output_tokens": 2, "store": False})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"
