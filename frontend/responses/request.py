"""The body of `POST /v1/responses`, validated.

As on chat, fields this server does not know are ignored (clients add new OpenAI fields all the time), and
known fields set to something it cannot honour are a 400 naming the field: a built-in tool, an image part,
an `include` value it cannot fill. Every list a client sends is bounded (items, parts, tools, metadata),
and the whole body is checked for nesting depth and invalid Unicode before any field is (`ClientRequest`).
Item and part types are checked before pydantic's union matching, so that a wrong one is named plainly
(`input.3.content.0`) instead of by pydantic's error for every member of the union.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from frontend.openai.errors import invalid_request
from frontend.openai.schemas import (INT32_MAX, SEED_LIMIT, ClientRequest, ClientStr, Fp32, RequestModel,
                                     client_error_path)

MAX_INPUT_ITEMS = 1024  # items in one request's `input`
MAX_CONTENT_PARTS = 256  # parts of one message
MAX_TOOLS = 128
MAX_METADATA_KEYS = 16  # OpenAI's bounds on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_ID_CHARS = 128  # ids a client echoes back to us (previous_response_id, call ids)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
SUPPORTED_INCLUDES = (LOGPROBS_INCLUDE,)
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
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
    arguments: ClientStr  # JSON text of an object, as the model wrote it


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
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
    """Reasoning of an earlier turn, in the clear (this server never encrypts it)."""

    type: Literal["reasoning"]
    id: ItemId | None = None
    summary: Annotated[list[ReasoningText], Field(max_length=MAX_CONTENT_PARTS)] = []
    content: Annotated[list[ReasoningText], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    encrypted_content: ClientStr | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(RequestModel):
    """A function tool, flat as the Responses API has them (no nested `function` object as on chat)."""

    type: Literal["function"]
    name: Name
    description: ClientStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: ClientStr


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
            elif kind == "function_call_output":
                _check_part_types(item.get("output"), ("input", i, "output"), ("input_text",))
        checked.append(item)
    return checked


class ResponsesRequest(ClientRequest):
    model: ClientStr
    input: ClientStr | list[InputItem] | None = None
    instructions: ClientStr | None = None
    previous_response_id: ItemId | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
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
    def _function_tools_only(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise invalid_request(f"tools.{i}: tools of type {kind[:40]!r} are not supported (function tools "
                                      "only: this server runs no built-in tools)", f"tools.{i}.type")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise invalid_request("tool_choice: only none, auto, required or {\"type\": \"function\", \"name\": ...} "
                                  "are supported", "tool_choice")
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
        names = [tool.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise invalid_request("tool names must be unique", "tools")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise invalid_request("tool_choice needs tools", "tool_choice")
        if isinstance(self.tool_choice, FunctionToolChoice) and self.tool_choice.name not in names:
            raise invalid_request(f"tool_choice names {self.tool_choice.name[:64]!r}, which is not one of the tools",
                                  "tool_choice")
        if self.top_logprobs and not self.wants_logprobs:
            raise invalid_request(f"top_logprobs needs include [{LOGPROBS_INCLUDE!r}]", "top_logprobs")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    @property
    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        """`input` as items: a string is one user message."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def format(self) -> TextFormat:
        return self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")

    @property
    def effective_tool_choice(self) -> str | FunctionToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"
