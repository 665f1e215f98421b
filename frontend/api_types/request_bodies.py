"""What clients send: the bodies of /v1/chat/completions, /v1/completions, /tokenize and /detokenize, and
the field types and bounds they are built from (which the Responses API's request reuses).

Requests ignore fields they do not know (clients add new OpenAI fields all the time) but reject known
fields set to values we cannot honour, naming the field, instead of silently dropping them.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from frontend.api_types.client_json import check_client_json, encodable
from frontend.api_types.errors import invalid_request


# Bounds of the engine's tensor types (the TensorRT-LLM tensor interface): a value past them would make
# numpy raise OverflowError (or wrap around) while the request is built, a 500 instead of a 400.
INT32_MAX = 2**31 - 1
SEED_LIMIT = 2**63  # the seed tensor is UINT64, but the CPU engine hands it to torch (int64)
# Within FP32's normal range (about 1.2e-38 to 3.4e38): a larger double becomes inf in an FP32 tensor, a
# smaller positive one may become 0 (a division by zero in the engine). Round numbers, for the messages.
FP32_LARGE = 1e30
FP32_SMALL = 1e-30
MAX_N = 128  # far above any server's max_n setting: only keeps absurd numbers out of arithmetic


def _utf8(value: str) -> str:
    if not encodable(value):
        raise ValueError("invalid Unicode, a lone surrogate (\\ud800-\\udfff) that is not part of a pair")
    return value


# Every string a client sends is checked twice over: by `check_client_json` on the whole body (which names
# the field), and by this type where models are built directly in Python.
ClientStr = Annotated[str, AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# FP32 tensors: finite (JSON as Python parses it allows NaN and Infinity) and, where not bounded tighter,
# within FP32's range.
Fp32 = Annotated[float, Field(allow_inf_nan=False)]


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ClientRequest(RequestModel):
    """A whole request body: checked for depth and invalid Unicode before any field is validated."""

    @model_validator(mode="before")
    @classmethod
    def _valid_json_text(cls, data: Any) -> Any:
        check_client_json(data)
        return data


class TextPart(RequestModel):
    type: Literal["text"]
    text: ClientStr


class FunctionCallIn(RequestModel):
    name: ClientStr
    arguments: ClientStr  # JSON text, as OpenAI sends it


class ToolCallIn(RequestModel):
    """A call the assistant made earlier in the conversation."""

    id: ClientStr
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: ClientStr | list[TextPart] | None = None
    name: ClientStr | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: ClientStr | None = None  # tool messages: the call this answers

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_template_input(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates expect it: content flattened to one string, and
        calls with their arguments as objects (templates serialise them with `tojson`)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    @model_validator(mode="after")
    def _calls_parse(self) -> "ChatMessage":
        for i, call in enumerate(self.tool_calls or []):
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise invalid_request(f"tool_calls.{i}.function.arguments must be a JSON object (as text)",
                                      "messages")
        if self.tool_calls and self.role != "assistant":
            raise invalid_request("only assistant messages carry tool_calls", "messages")
        return self


class FunctionDefinition(RequestModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: ClientStr | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition

    def as_template_input(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(RequestModel):
    name: ClientStr


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(RequestModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] = "response"
    description: ClientStr | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise invalid_request("response_format of type json_schema needs a json_schema object",
                                  "response_format")
        return self


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingFields(ClientRequest):
    """Fields chat and completions share. Every number is bounded by the engine tensor it becomes
    (INT32, UINT64, FP32), so that no value a client sends can overflow while the request is built."""

    model: ClientStr
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: Fp32 = Field(1.0, ge=0.0, le=2.0)
    top_p: Fp32 = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: ClientStr | list[ClientStr] | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    presence_penalty: Fp32 = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Fp32 = Field(0.0, ge=-2.0, le=2.0)
    user: ClientStr | None = None
    # Common extensions (vLLM, TGI)
    top_k: int = Field(0, ge=0, le=INT32_MAX)  # the engine's tensors are int32
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    repetition_penalty: Fp32 = Field(1.0, ge=FP32_SMALL, le=FP32_LARGE)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        return value

    @model_validator(mode="after")
    def _supported(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise invalid_request("stream_options is only allowed when stream is true", "stream_options")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class GuidedFields(SamplingFields):
    """vLLM's guided-decoding extensions, for chat and completions alike (at most one of them)."""

    guided_json: dict[str, Any] | None = None
    guided_regex: Annotated[str, Field(min_length=1, max_length=10_000)] | None = None
    guided_grammar: Annotated[str, Field(min_length=1, max_length=100_000)] | None = None

    @model_validator(mode="after")
    def _one_guide(self) -> "GuidedFields":
        given = [name for name in ("guided_json", "guided_regex", "guided_grammar") if getattr(self, name) is not None]
        if len(given) > 1:
            raise invalid_request(f"give at most one of {', '.join(given)}", given[1])
        return self


class ChatCompletionRequest(GuidedFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    logit_bias: dict[ClientStr, float] | None = None

    @model_validator(mode="after")
    def _chat_supported(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise invalid_request("tool_choice needs tools", "tool_choice")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise invalid_request("tool names must be unique", "tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise invalid_request(f"tool_choice names {self.tool_choice.function.name!r}, which is not one of the "
                                  "tools", "tool_choice")
        if self.logit_bias:
            raise invalid_request("logit_bias is not supported", "logit_bias")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


Prompt = str | list[int]


def _out_of_int32(token: Any) -> bool:
    """A number that would be a token id (an integer, or a float with an integral value, as lax
    validation converts it) outside [0, INT32_MAX]."""
    if isinstance(token, bool) or not isinstance(token, (int, float)):
        return False
    if isinstance(token, float) and not (math.isfinite(token) and token.is_integer()):
        return False  # not a token id at all: pydantic's error for the field
    return not 0 <= token <= INT32_MAX


def _outside_int32_at(ids: list[Any]) -> int | None:
    """The index of an id outside [0, INT32_MAX] (`_out_of_int32`) in a list of would-be token ids, or None.
    For a list of numbers (the usual case) that is min and max at C speed, not a Python step per id: a
    prompt may hold as many ids as the model's context. Only a list of mixed types (which pydantic refuses
    anyway) is looked at item by item."""
    try:
        extremes = (min(ids), max(ids))
    except (TypeError, ValueError):  # types that do not compare (pydantic names them), or empty
        return next((j for j, token in enumerate(ids) if _out_of_int32(token)), None)
    for extreme in extremes:
        if _out_of_int32(extreme):
            return ids.index(extreme)
    return None


def raw_prompts(body: Any) -> list[Any]:
    """The prompts of a /v1/completions body as parsed JSON, before it is validated, told apart by the first
    item as `CompletionRequest.prompts` does: a list of token ids is one prompt, a list of texts or of
    token-id lists is several. [] for a text prompt or anything else. O(1), for the checks by length alone
    that come before validation (routes.token_prompts_fit)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(prompt, list) or not prompt:
        return []
    return prompt if isinstance(prompt[0], (str, list)) else [prompt]


class CompletionRequest(GuidedFields):
    prompt: ClientStr | list[TokenId] | list[ClientStr] | list[list[TokenId]]
    echo: bool = False
    suffix: ClientStr | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    logit_bias: dict[ClientStr, float] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids_fit(cls, value: Any) -> Any:
        """Token ids outside INT32 (or negative) named plainly, instead of pydantic's error for each of the
        four shapes of the union; whether an id is in the vocabulary is the route's check. No Python step
        per id (`_outside_int32_at`); a step per prompt of a list of prompts, which the route bounds by
        their number before the body is validated."""
        if not isinstance(value, list) or not value:
            return value
        if not isinstance(value[0], list):  # one prompt of token ids (or texts)
            at = _outside_int32_at(value)
            where = None if at is None else f"prompt.{at}"
        else:
            where = None
            for i, item in enumerate(value):
                at = _outside_int32_at(item) if isinstance(item, list) else (0 if _out_of_int32(item) else None)
                if at is not None:
                    where = f"prompt.{i}.{at}" if isinstance(item, list) else f"prompt.{i}"
                    break
        if where is not None:
            raise invalid_request(f"{where}: token ids must be integers in [0, {INT32_MAX}]", "prompt")
        return value

    @model_validator(mode="after")
    def _completion_supported(self) -> "CompletionRequest":
        if not self.prompts or any(len(p) == 0 for p in self.prompts):
            raise invalid_request("prompt must not be empty", "prompt")
        if self.suffix:
            raise invalid_request("suffix is not supported: the model has no fill-in-the-middle mode", "suffix")
        if self.echo and self.logprobs is not None:
            raise invalid_request("echo together with logprobs is not supported", "echo")
        if self.best_of not in (None, 1) and self.best_of != self.n:
            raise invalid_request("best_of is not supported (use n)", "best_of")
        if self.logit_bias:
            raise invalid_request("logit_bias is not supported", "logit_bias")
        return self

    @property
    def prompts(self) -> list[Prompt]:
        """The prompt field's four shapes, as a list of prompts (text or token ids)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(ClientRequest):
    """vLLM-style helper: either a prompt or chat messages (rendered with the chat template)."""

    model: ClientStr | None = None
    prompt: ClientStr | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise invalid_request("give exactly one of prompt or messages", "prompt")
        return self


class DetokenizeRequest(ClientRequest):
    model: ClientStr | None = None
    tokens: list[TokenId]
