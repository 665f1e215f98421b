"""What we answer: the bodies of chat and text completions (whole and as stream chunks), of /v1/models,
and the id and timestamp they carry.

Apart from the request bodies because they are built by the server, never validated from a client: plain
pydantic models, no bounds, no Unicode checks, and serialisers that leave out what OpenAI leaves out.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer


FinishReason = Literal["stop", "length", "tool_calls"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ResponseMessage(BaseModel):
    """`content` is always there (null when the answer is only tool calls, as OpenAI's); `tool_calls` and
    `reasoning_content` only when there are some."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {key: value for key, value in handler(self).items()
                if value is not None or key == "content"}


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


class FunctionCallDeltaOut(BaseModel):
    name: str | None = None
    arguments: str = ""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class ToolCallDeltaOut(BaseModel):
    """A call's first delta carries its id, type and name; the following ones argument fragments only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDeltaOut

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatDelta(BaseModel):
    """Streamed deltas carry only the fields they set: `{"role", "content"}` first, then `{"content"}`,
    `{"reasoning_content"}` or `{"tool_calls"}`, and `{}` with the finish reason."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None

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


class ModelVersion(BaseModel):
    """One build of a named model (its engine record), and whether it serves."""

    version: int
    status: Literal["live", "on_disk"]
    source: dict[str, str] | None = None
    checkpoint_sha256: str | None = None
    built_at: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tritonllm"
    max_model_len: int
    # Named models only (MODEL_REPOSITORY): the version serving, the one a rollback restores, and every
    # version on disk.
    live_version: int | None = None
    previous_version: int | None = None
    versions: list[ModelVersion] | None = None
    # vLLM's: a LoRA adapter's base model (`parent`) and its directory (`root`); a model's root is its own id.
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
