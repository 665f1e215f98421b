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


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


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
    top_k: int = Field(0, ge=0)
    min_tokens: int = Field(0, ge=0)
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
        if self.n != 1:
            raise invalid_request("only n=1 is supported", "n")
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
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None

    @model_validator(mode="after")
    def _chat_supported(self) -> "ChatCompletionRequest":
        if self.logprobs or self.top_logprobs:
            raise invalid_request("logprobs are not supported yet", "logprobs")
        if self.tools:
            raise invalid_request("tools are not supported by this server", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise invalid_request("only response_format type 'text' is supported", "response_format")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_supported(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            if len(self.prompt) != 1:
                raise invalid_request("only one prompt per request is supported", "prompt")
        if isinstance(self.prompt, (str, list)) and len(self.prompt) == 0:
            raise invalid_request("prompt must not be empty", "prompt")
        if self.echo:
            raise invalid_request("echo is not supported", "echo")
        if self.suffix:
            raise invalid_request("suffix is not supported by this model", "suffix")
        if self.logprobs:
            raise invalid_request("logprobs are not supported yet", "logprobs")
        if self.best_of not in (None, 1):
            raise invalid_request("best_of is not supported", "best_of")
        return self

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
    logprobs: None = None
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
    logprobs: None = None
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
    logprobs: None = None
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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
