"""OpenAI request and response shapes, all in one place.

Requests ignore fields they do not know (clients add new OpenAI fields all the time) but reject known
fields set to values we cannot honour, naming the field, instead of silently dropping them.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator,
                      model_serializer, model_validator)

from frontend.errors import invalid_request


INT32_MAX = 2**31 - 1


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        """The message as chat templates expect it: content flattened to one string."""
        if self.content is None:
            content = ""
        elif isinstance(self.content, str):
            content = self.content
        else:
            content = "".join(part.text for part in self.content)
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingFields(RequestModel):
    """Fields chat and completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # Common extensions (vLLM, TGI)
    top_k: int = Field(0, ge=0, le=INT32_MAX)  # the engine's tensors are int32
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    repetition_penalty: float = Field(1.0, gt=0.0)
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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _chat_supported(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.tools:
            raise invalid_request("tools are not supported: this server does not parse tool calls", "tools")
        if self.tool_choice not in (None, "none"):
            raise invalid_request("tool_choice is not supported: this server does not parse tool calls",
                                  "tool_choice")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise invalid_request("only response_format type 'text' is supported (no guided decoding)",
                                  "response_format")
        if self.logit_bias:
            raise invalid_request("logit_bias is not supported", "logit_bias")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


Prompt = str | list[int]


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None

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


# ----- responses ---------------------------------------------------------------------------------------
FinishReason = Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: dict | None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """Streamed deltas carry only the fields they set: `{"role", "content"}` first, `{"content"}`
    after, `{}` with the finish reason."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: dict | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict | None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tritonllm"
    max_model_len: int


class TokenizeRequest(RequestModel):
    """vLLM-style helper: either a prompt or chat messages (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise invalid_request("give exactly one of prompt or messages", "prompt")
        return self


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
