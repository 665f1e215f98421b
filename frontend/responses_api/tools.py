"""The Responses tools as the chat pipeline offers them to the model, and the model's calls as Responses items.

- `function` tools: chat function tools, as they are;
- `namespace` tools: each member offered as `<namespace>__<name>`; its calls come back as OpenAI returns a
  namespaced function's call, `name` and `namespace` apart, so that the client routes them back;
- `custom` tools (freeform input): offered as a function of one string argument, `input`; a call becomes a
  `custom_tool_call` whose `input` is that string. Forced (`tool_choice: {"type": "custom", ...}`), the whole
  answer is the input, constrained by the tool's grammar: a regex as it is, a Lark grammar turned into the
  EBNF the engines' guided decoding takes (xgrammar reads Lark);
- `local_shell`: offered as a function `local_shell` (command, working_directory, timeout_ms); a call becomes a
  `local_shell_call` with OpenAI's `exec` action, which the client runs;
- hosted tools (`web_search`, `file_search`, ...): never offered (this server runs none of them).
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar

from frontend.api_types.errors import invalid_request
from frontend.api_types.request_bodies import FunctionDefinition, NamedFunction, NamedToolChoice, ToolDefinition
from frontend.responses_api.request import NAMESPACE_SEPARATOR, CustomTool, OfferedTool, ResponsesRequest

CUSTOM_INPUT = "input"  # the one argument of a custom tool, as the model sees it


def _definition(tool: OfferedTool) -> ToolDefinition:
    if isinstance(tool.tool, CustomTool):
        description = tool.tool.description or ""
        parameters = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string",
                                                                      "description": "the tool's freeform input"}},
                      "required": [CUSTOM_INPUT], "additionalProperties": False}
        return ToolDefinition(type="function", function=FunctionDefinition(
            name=tool.model_name, description=description or None, parameters=parameters))
    fields = tool.tool.model_dump(include={"description", "parameters", "strict"}, exclude_none=True)
    return ToolDefinition(type="function", function=FunctionDefinition(name=tool.model_name, **fields))


def chat_tools(req: ResponsesRequest) -> dict[str, Any]:
    """The chat request's `tools`, `tool_choice` and guide (a forced custom tool's regex) for this request."""
    offered = req.offered_tools
    choice: Any = req.tool_choice
    chosen = req.chosen_tool
    if not offered:
        return {"tools": None, "tool_choice": None if choice in (None, "auto") else choice}
    fields: dict[str, Any] = {"tools": [_definition(tool) for tool in offered], "tool_choice": choice}
    if chosen is not None and isinstance(chosen.tool, CustomTool):
        # The whole answer is the input: no call markup, the grammar (a regex) from the first token.
        fields["tool_choice"] = "none"
        tool_format = chosen.tool.format
        if tool_format is not None and tool_format.type == "grammar" and tool_format.syntax == "regex":
            fields["guided_regex"] = tool_format.definition
        elif tool_format is not None and tool_format.type == "grammar":
            fields["guided_grammar"] = lark_to_ebnf(tool_format.definition or "")
    elif chosen is not None:
        fields["tool_choice"] = NamedToolChoice(type="function", function=NamedFunction(name=chosen.model_name))
    return fields


def lark_to_ebnf(definition: str) -> str:
    """A custom tool's Lark grammar as EBNF (its size bounded by the request's own); a 400 naming `tools` if
    it is no Lark grammar."""
    try:
        return str(xgrammar.Grammar.from_lark(definition))
    except Exception as exc:  # xgrammar raises RuntimeError (and others) for what it cannot read
        raise invalid_request(f"tools: the custom tool's lark grammar does not parse: {str(exc)[:200]}",
                              "tools") from None


def model_name(name: str, namespace: str | None) -> str:
    """A call sent back, by the name the model knows it under."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def custom_arguments(text: str) -> str:
    """A custom tool's input as the arguments of the function the model was offered."""
    return json.dumps({CUSTOM_INPUT: text}, ensure_ascii=False)


def shell_action(arguments: str) -> dict[str, Any]:
    """A `local_shell` call's `exec` action from the arguments the model wrote (what it got wrong, left out)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    value = value if isinstance(value, dict) else {}
    action: dict[str, Any] = {}
    command = value.get("command")
    if isinstance(command, str):
        command = [command]
    if isinstance(command, list):
        action["command"] = [str(part) for part in command]
    if isinstance(value.get("working_directory"), str):
        action["working_directory"] = value["working_directory"]
    if isinstance(value.get("timeout_ms"), int):
        action["timeout_ms"] = value["timeout_ms"]
    return action


def shell_arguments(action: dict[str, Any]) -> str:
    """A `local_shell` call sent back, as the arguments of the function the model was offered."""
    return json.dumps({key: action[key] for key in ("command", "working_directory", "timeout_ms")
                       if action.get(key) is not None}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """The input of a custom tool's call the model wrote as a function call (its arguments as it wrote
    them if they are no object with a string `input`)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return value[CUSTOM_INPUT]
    return arguments
