"""The body of `POST /v1/responses`, validated.

As on chat, fields this server does not know are ignored (clients add new OpenAI fields all the time), and
known fields set to something it cannot honour are a 400 naming the field: a built-in tool, an image part,
an `include` value it cannot fill. Every list a client sends is bounded (items, parts, tools, metadata),
and the whole body is checked for nesting depth and invalid Unicode before any field is (`ClientRequest`).
Item and part types are checked before pydantic's union matching, so that a wrong one is named plainly
(`input.3.content.0`) instead of by pydantic's error for every member of the union.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from frontend.api_types.client_json import client_error_path
from frontend.api_types.errors import invalid_request
from frontend.api_types.request_bodies import INT32_MAX, SEED_LIMIT, ClientRequest, ClientStr, Fp32, RequestModel

MAX_INPUT_ITEMS = 1024  # items in one request's `input`
MAX_CONTENT_PARTS = 256  # parts of one message
MAX_TOOLS = 128
MAX_METADATA_KEYS = 16  # OpenAI's bounds on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_ID_CHARS = 128  # ids a client echoes back to us (previous_response_id, call ids)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"
# OpenAI's `include` values (openai-python's ResponseIncludable): all accepted. The logprobs and the encrypted
# reasoning are filled; the others name outputs of tools this server does not run, or of images it does
# not take, so they add nothing.
SUPPORTED_INCLUDES = (
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    ENCRYPTED_REASONING_INCLUDE, LOGPROBS_INCLUDE,
)
ITEM_TYPES = ("message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
              "local_shell_call", "local_shell_call_output", "reasoning")
# Tools OpenAI runs on its side (hosted): accepted, echoed, never offered to the model (this server runs none
# of them); a tool_choice that requires one is a 400. `shell` and `apply_patch` are OpenAI's own client tools
# whose calls only OpenAI's models write: not offered either.
HOSTED_TOOL_TYPES = (
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "image_generation", "computer", "computer_use", "computer_use_preview", "mcp",
    "tool_search", "programmatic_tool_calling", "shell", "apply_patch",
)
OFFERED_TOOL_TYPES = ("function", "custom", "namespace", "local_shell")
CHOICE_TYPES = ("allowed_tools",)  # other tool_choice shapes OpenAI has, refused here
LOCAL_SHELL = "local_shell"  # OpenAI's client-run shell: offered as a function of this name
NAMESPACE_SEPARATOR = "__"  # a namespaced function as the model sees it: <namespace>__<name>
TEXT_PART_TYPES = ("input_text", "output_text")

Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
ItemId = Annotated[ClientStr, Field(min_length=1, max_length=MAX_ID_CHARS)]


class TextPart(RequestModel):
    """A message's text part: `input_text` (user, system, developer) or `output_text` (an assistant's turn
    sent back, as the client got it); annotations and logprobs a client echoes are ignored."""

    type: Literal["input_text", "output_text"]
    text: ClientStr


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    id: ItemId | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: ClientStr | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(RequestModel):
    """A call the model made earlier, sent back with the conversation."""

    type: Literal["function_call"]
    id: ItemId | None = None
    call_id: ItemId
    name: Name
    namespace: Name | None = None  # a function of a `namespace` tool
    arguments: ClientStr  # JSON text of an object, as the model wrote it


class CustomToolCallItem(RequestModel):
    """A call of a custom tool the model made earlier: its freeform input."""

    type: Literal["custom_tool_call"]
    id: ItemId | None = None
    call_id: ItemId
    name: Name
    namespace: Name | None = None
    input: ClientStr


class LocalShellAction(RequestModel):
    type: Literal["exec"] = "exec"
    command: Annotated[list[ClientStr], Field(min_length=1, max_length=MAX_CONTENT_PARTS)]
    env: dict[ClientStr, ClientStr] = {}
    timeout_ms: int | None = Field(None, ge=0, le=INT32_MAX)
    user: ClientStr | None = None
    working_directory: ClientStr | None = None


class LocalShellCallItem(RequestModel):
    """A `local_shell` call the model made earlier (the client ran it)."""

    type: Literal["local_shell_call"]
    id: ItemId | None = None
    call_id: ItemId
    action: LocalShellAction


class LocalShellCallOutputItem(RequestModel):
    """What a `local_shell` call printed; its `id` is the call's `call_id`, as OpenAI has it."""

    type: Literal["local_shell_call_output"]
    id: ItemId
    output: ClientStr


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output", "custom_tool_call_output"]
    id: ItemId | None = None
    call_id: ItemId
    output: ClientStr | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)]

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningText(RequestModel):
    type: Literal["reasoning_text", "summary_text"]
    text: ClientStr


class ReasoningItem(RequestModel):
    """Reasoning of an earlier turn: in the clear (`content`), or as this server sealed it (`encrypted_content`,
    include `reasoning.encrypted_content`), opened again before the prompt is rendered (frontend/responses_api/
    sealing.py)."""

    type: Literal["reasoning"]
    id: ItemId | None = None
    summary: Annotated[list[ReasoningText], Field(max_length=MAX_CONTENT_PARTS)] = []
    content: Annotated[list[ReasoningText], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    encrypted_content: ClientStr | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


InputItem = Annotated[MessageItem | FunctionCallItem | CustomToolCallItem | FunctionCallOutputItem | LocalShellCallItem
                      | LocalShellCallOutputItem | ReasoningItem, Field(discriminator="type")]


class FunctionTool(RequestModel):
    """A function tool, flat as the Responses API has them (no nested `function` object as on chat)."""

    type: Literal["function"]
    name: Name
    description: ClientStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def echo(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class CustomToolFormat(RequestModel):
    """A custom tool's input: free text, or text of a grammar (`lark` or `regex` syntax)."""

    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: ClientStr | None = None

    @model_validator(mode="after")
    def _grammar_given(self) -> "CustomToolFormat":
        if self.type == "grammar" and (self.syntax is None or not self.definition):
            raise invalid_request("a custom tool's format of type grammar needs a syntax (lark or regex) and a "
                                  "definition", "tools")
        return self


class CustomTool(RequestModel):
    """A tool whose input is freeform text (no JSON arguments), optionally of a grammar."""

    type: Literal["custom"]
    name: Name
    description: ClientStr | None = None
    format: CustomToolFormat | None = None

    def echo(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class NamespaceTool(RequestModel):
    """Function and custom tools grouped under a name: offered to the model as `<namespace>__<name>`, their calls
    returned with `name` and `namespace` apart, as OpenAI returns them."""

    type: Literal["namespace"]
    name: Name
    description: ClientStr | None = None
    tools: Annotated[list[Annotated[FunctionTool | CustomTool, Field(discriminator="type")]],
                     Field(min_length=1, max_length=MAX_TOOLS)]

    def echo(self) -> dict[str, Any]:
        return {"type": "namespace", "name": self.name, "description": self.description or "",
                "tools": [tool.echo() for tool in self.tools]}


class HostedTool(RequestModel):
    """A tool OpenAI runs (web search, file search, ...): accepted and echoed as sent, never offered."""

    model_config = ConfigDict(extra="allow")
    type: str

    def echo(self) -> dict[str, Any]:
        return self.model_dump()


class LocalShellTool(RequestModel):
    """OpenAI's `local_shell`: the model asks the client to run a command (a `local_shell_call` item)."""

    type: Literal["local_shell"]

    def echo(self) -> dict[str, Any]:
        return {"type": "local_shell"}

    @property
    def function(self) -> FunctionTool:
        """The function the model is offered for it (the template carries it as any other)."""
        return FunctionTool(type="function", name=LOCAL_SHELL, description="Run a command on the user's machine",
                            parameters={"type": "object", "properties": {
                                "command": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                            "description": "the program and its arguments"},
                                "working_directory": {"type": "string"},
                                "timeout_ms": {"type": "integer", "minimum": 0}},
                                "required": ["command"], "additionalProperties": False})


Tool = FunctionTool | CustomTool | NamespaceTool | LocalShellTool | HostedTool


@dataclass(frozen=True)
class OfferedTool:
    """A tool as the model sees it: a function (a custom tool's input is its one string argument)."""

    model_name: str  # the function name in the prompt: the tool's, or `<namespace>__<name>`
    name: str
    namespace: str | None
    kind: str  # "function", "custom" or "local_shell"
    tool: FunctionTool | CustomTool


class FunctionToolChoice(RequestModel):
    """A named tool forced: a function (`local_shell` too: OpenAI has no tool_choice of its own for it) or a custom
    tool, in `namespace` if given."""

    type: Literal["function", "custom"]
    name: ClientStr
    namespace: ClientStr | None = None


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Name | None = None
    description: ClientStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise invalid_request("text.format of type json_schema needs a name and a schema", "text.format")
        return self


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(RequestModel):
    """Accepted and echoed. Whether and how long the model reasons is its own (and its chat template's)
    affair here: no effort knob reaches the engine."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


def _check_part_types(parts: Any, path: tuple[str | int, ...], allowed: tuple[str, ...]) -> None:
    if not isinstance(parts, list):
        return
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in allowed:
            where = client_error_path((*path, j))
            raise invalid_request(f"{where}: content of type {kind[:40]!r} is not supported here (this server takes "
                                  f"text only: {', '.join(allowed)})", where)


def _check_item_types(items: Any) -> Any:
    """Items without a `type` but with a `role` are messages (OpenAI's "easy" input messages). Item and
    part types this server does not take are a 400 naming the item."""
    if not isinstance(items, list):
        return items
    if len(items) > MAX_INPUT_ITEMS:
        raise invalid_request(f"input may hold at most {MAX_INPUT_ITEMS} items", "input")
    checked = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            if "type" not in item and "role" in item:
                item = {**item, "type": "message"}
            kind = item.get("type")
            if isinstance(kind, str) and kind not in ITEM_TYPES:
                raise invalid_request(f"input.{i}: items of type {kind[:40]!r} are not supported (supported: "
                                      f"{', '.join(ITEM_TYPES)})", f"input.{i}.type")
            if kind == "message":
                _check_part_types(item.get("content"), ("input", i, "content"), TEXT_PART_TYPES)
            elif kind in ("function_call_output", "custom_tool_call_output"):
                _check_part_types(item.get("output"), ("input", i, "output"), ("input_text",))
        checked.append(item)
    return checked


class ResponsesRequest(ClientRequest):
    model: ClientStr
    input: ClientStr | list[InputItem] | None = None
    instructions: ClientStr | None = None
    previous_response_id: ItemId | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = Field(None, ge=1, le=INT32_MAX)  # OpenAI's is for built-in tools: echoed only
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: Fp32 = Field(1.0, ge=0.0, le=2.0)
    top_p: Fp32 = Field(1.0, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)  # extensions, as on chat
    ignore_eos: bool = False
    metadata: dict[ClientStr, ClientStr] | None = None
    user: ClientStr | None = None
    safety_identifier: ClientStr | None = None
    prompt_cache_key: ClientStr | None = None  # echoed; the engine's prefix cache needs no key
    truncation: Literal["auto", "disabled"] = "disabled"
    include: Annotated[list[ClientStr], Field(max_length=16)] | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    conversation: Any = None  # refused: conversations are not served here (previous_response_id is)
    prompt: Any = None  # refused: stored prompt templates are OpenAI's

    @field_validator("input", mode="before")
    @classmethod
    def _item_types(cls, value: Any) -> Any:
        return _check_item_types(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _known_tool_types(cls, value: Any) -> Any:
        """Each tool parsed as its type's model (so an error names the tool); unknown types are a 400 naming
        the tool."""
        if not isinstance(value, list):
            return value
        tools: list[Any] = []
        for i, tool in enumerate(value):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if not isinstance(kind, str):
                raise invalid_request(f"tools.{i}: a tool needs a type", f"tools.{i}.type")
            if kind not in OFFERED_TOOL_TYPES and kind not in HOSTED_TOOL_TYPES:
                raise invalid_request(f"tools.{i}: tools of type {kind[:40]!r} are not supported (supported: "
                                      f"function, custom, namespace, local_shell; accepted and not run: "
                                      f"{', '.join(HOSTED_TOOL_TYPES)})", f"tools.{i}.type")
            model = {"function": FunctionTool, "custom": CustomTool, "namespace": NamespaceTool,
                     "local_shell": LocalShellTool}.get(kind, HostedTool)
            try:
                tools.append(model.model_validate(tool))
            except ValidationError as exc:
                error = exc.errors()[0]
                where = client_error_path(("tools", i, *error["loc"]))
                raise invalid_request(f"{where}: {error['msg']}", where) from None
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_shape(cls, value: Any) -> Any:
        """A hosted tool's type (`{"type": "web_search"}`) or an MCP server can be named, and never run here."""
        if isinstance(value, dict) and value.get("type") not in ("function", "custom"):
            kind = value.get("type")
            if isinstance(kind, str) and (kind in HOSTED_TOOL_TYPES or kind in CHOICE_TYPES):
                raise invalid_request(f"tool_choice: {kind[:40]!r} is a tool this server does not run (it takes the "
                                      "tool and never offers it to the model): it cannot be required",
                                      "tool_choice")
            raise invalid_request("tool_choice: only none, auto, required, {\"type\": \"function\", \"name\": ...} "
                                  "or {\"type\": \"custom\", \"name\": ...} are supported", "tool_choice")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_bounded(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA_KEYS:
            raise invalid_request(f"metadata may hold at most {MAX_METADATA_KEYS} keys", "metadata")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(text) > MAX_METADATA_VALUE_CHARS:
                raise invalid_request(f"metadata keys may be at most {MAX_METADATA_KEY_CHARS} characters and values "
                                      f"at most {MAX_METADATA_VALUE_CHARS}", "metadata")
        return value

    @model_validator(mode="after")
    def _supported(self) -> "ResponsesRequest":
        if self.conversation is not None:
            raise invalid_request("conversation is not supported: chain responses with previous_response_id",
                                  "conversation")
        if self.prompt is not None:
            raise invalid_request("prompt (stored prompt templates) is not supported", "prompt")
        for value in self.include or []:
            if value not in SUPPORTED_INCLUDES:
                raise invalid_request(f"include: {value[:80]!r} is not supported here (supported: "
                                      f"{', '.join(SUPPORTED_INCLUDES)})", "include")
        if self.background and not self.store:
            raise invalid_request("background responses must be stored: background needs store true", "background")
        names = [tool.model_name for tool in self.offered_tools]
        if any(len(name) > 64 for name in names):
            raise invalid_request(f"a namespaced function's <namespace>{NAMESPACE_SEPARATOR}<name> may be at most 64 "
                                  "characters (the model is offered it under that name)", "tools")
        if len(set(names)) != len(names):
            raise invalid_request("tool names must be unique (a namespace's functions count as "
                                  f"<namespace>{NAMESPACE_SEPARATOR}<name>)", "tools")
        if self.tool_choice not in (None, "none") and not self.offered_tools:
            raise invalid_request("tool_choice needs function, custom or namespace tools (this server offers the "
                                  "model no other kind)", "tool_choice")
        if isinstance(self.tool_choice, FunctionToolChoice):
            self.chosen_tool  # a 400 naming tool_choice if it names no offered tool
        if self.top_logprobs and not self.wants_logprobs:
            raise invalid_request(f"top_logprobs needs include [{LOGPROBS_INCLUDE!r}]", "top_logprobs")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    @property
    def items(self) -> list[MessageItem | FunctionCallItem | CustomToolCallItem | FunctionCallOutputItem
                            | LocalShellCallItem | LocalShellCallOutputItem | ReasoningItem]:
        """`input` as items: a string is one user message."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def wants_encrypted_reasoning(self) -> bool:
        return ENCRYPTED_REASONING_INCLUDE in (self.include or [])

    @property
    def offered_tools(self) -> list[OfferedTool]:
        """The tools the model is offered, namespaces flattened (hosted tools are not offered)."""
        offered = []
        for tool in self.tools or []:
            if isinstance(tool, NamespaceTool):
                offered += [OfferedTool(f"{tool.name}{NAMESPACE_SEPARATOR}{member.name}", member.name, tool.name,
                                        member.type, member) for member in tool.tools]
            elif isinstance(tool, (FunctionTool, CustomTool)):
                offered.append(OfferedTool(tool.name, tool.name, None, tool.type, tool))
            elif isinstance(tool, LocalShellTool):
                offered.append(OfferedTool(LOCAL_SHELL, LOCAL_SHELL, None, "local_shell", tool.function))
        return offered

    @property
    def chosen_tool(self) -> OfferedTool | None:
        """The tool a named tool_choice forces: a function or custom tool by name, in `namespace` if given
        (else a top-level tool, else the one namespaced tool of that name)."""
        choice = self.tool_choice
        if not isinstance(choice, FunctionToolChoice):
            return None
        kinds = ("function", "local_shell") if choice.type == "function" else (choice.type,)
        matches = [tool for tool in self.offered_tools if tool.name == choice.name and tool.kind in kinds
                   and (choice.namespace is None or tool.namespace == choice.namespace)]
        if choice.namespace is None and len(matches) > 1:
            matches = [tool for tool in matches if tool.namespace is None] or matches
        if len(matches) != 1:
            raise invalid_request(f"tool_choice names {choice.type} tool {choice.name[:64]!r}, which is "
                                  f"{'not one of the tools' if not matches else 'ambiguous: give its namespace'}",
                                  "tool_choice")
        return matches[0]

    @property
    def format(self) -> TextFormat:
        return self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")

    @property
    def effective_tool_choice(self) -> str | FunctionToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"
