"""How a generation's deltas become OpenAI objects: chat or legacy completions, SSE chunks or one body.

Pure functions of the deltas (no I/O), so the wire format is tested without servers. Every chunk of a
stream has the same `id` and `created`, as OpenAI's do.
"""

from __future__ import annotations

import uuid
from typing import Callable, Protocol

from pydantic import BaseModel
from pydantic_core import to_json

from frontend.http.logprob_rendering import TokenStrings, chat_logprobs, completion_logprobs
from frontend.api_types.reply_bodies import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                                             ChatDelta, Completion, CompletionChoice, FunctionCallDeltaOut,
                                             FunctionCallOut, ResponseMessage, ToolCallDeltaOut, ToolCallOut, Usage,
                                             completion_id, now)
from frontend.generation.serving import ChoiceResult, TextDelta, UsageCounter
from frontend.http.sse import sse_data


class Renderer(Protocol):
    def stream_start(self) -> list[bytes]:
        """The frames sent before the first delta (chat: the role; completions: echoed prompts)."""
        ...

    def stream_delta(self, index: int, delta: TextDelta) -> list[bytes]: ...

    def stream_usage(self, usage: UsageCounter) -> bytes: ...

    def body(self, results: dict[int, ChoiceResult], usage: UsageCounter) -> BaseModel: ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class TextFrames:
    """The SSE frame of a delta that is only text, from a template rendered once per choice: the chunk
    serialised with a unique marker as its text, split there; the text goes in with pydantic's own JSON
    string encoder. The bytes are those of the full model, by construction (tests/unit/test_wire_format.py
    checks it over many texts); the model is built once per choice instead of once per token."""

    def __init__(self, render: Callable[[int, str], str]):
        self._render = render  # (choice index, text) -> the chunk's JSON
        self._templates: dict[int, tuple[bytes, bytes]] = {}

    def frame(self, index: int, text: str) -> bytes:
        template = self._templates.get(index)
        if template is None:
            marker = f"text-{uuid.uuid4().hex}"
            prefix, marked, suffix = self._render(index, marker).partition(f'"{marker}"')
            if not marked or marker in suffix:
                return sse_data(self._render(index, text))
            template = self._templates[index] = (b"data: " + prefix.encode(), suffix.encode() + b"\n\n")
        return template[0] + to_json(text) + template[1]


class ChatRenderer:
    def __init__(self, model: str, indexes: list[int], top_logprobs: int | None, tokens: TokenStrings):
        self.id, self.created, self.model = completion_id("chatcmpl"), now(), model
        self.indexes, self.top_logprobs, self.tokens = indexes, top_logprobs, tokens
        self.call_ids: dict[tuple[int, int], str] = {}  # (choice, call) -> its id, made at its first delta
        self.text_frames = TextFrames(lambda index, text: self._json([ChatChunkChoice(
            index=index, delta=ChatDelta(content=text))]))

    def _json(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                   usage=usage).model_dump_json()

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse_data(self._json(choices, usage))

    def _logprobs(self, delta_tokens: list) -> dict | None:
        if self.top_logprobs is None:
            return None
        return chat_logprobs(delta_tokens, self.tokens, self.top_logprobs)

    def _call_id(self, choice: int, call: int) -> str:
        return self.call_ids.setdefault((choice, call), new_call_id())

    def stream_start(self) -> list[bytes]:
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in self.indexes]

    def stream_delta(self, index: int, delta: TextDelta) -> list[bytes]:
        if (delta.text and delta.finish_reason is None and self.top_logprobs is None and not delta.reasoning
                and not delta.tool_calls):  # the common token: text only
            return [self.text_frames.frame(index, delta.text)]
        frames = []
        logprobs = self._logprobs(delta.tokens) if delta.tokens else None
        calls = [ToolCallDeltaOut(index=call.index, id=self._call_id(index, call.index) if call.name else None,
                                  type="function" if call.name else None,
                                  function=FunctionCallDeltaOut(name=call.name, arguments=call.arguments))
                 for call in delta.tool_calls]
        if delta.text or delta.reasoning or calls or logprobs:
            content = delta.text if delta.text or not (delta.reasoning or calls) else None
            frames.append(self._chunk([ChatChunkChoice(
                index=index, logprobs=logprobs,
                delta=ChatDelta(content=content, reasoning_content=delta.reasoning or None, tool_calls=calls or None))]))
        if delta.finish_reason is not None:
            frames.append(self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(),
                                                       finish_reason=delta.finish_reason)]))
        return frames

    def stream_usage(self, usage: UsageCounter) -> bytes:
        return self._chunk([], Usage(**usage.as_dict()))

    def _message(self, index: int, result: ChoiceResult) -> ResponseMessage:
        calls = [ToolCallOut(id=self._call_id(index, i), function=FunctionCallOut(name=c.name, arguments=c.arguments))
                 for i, c in enumerate(result.tool_calls)]
        return ResponseMessage(content=result.text if result.text or not calls else None, tool_calls=calls or None,
                               reasoning_content=result.reasoning or None)

    def body(self, results: dict[int, ChoiceResult], usage: UsageCounter) -> BaseModel:
        choices = [ChatChoice(index=i, message=self._message(i, r), finish_reason=r.finish_reason,
                              logprobs=self._logprobs(r.tokens))
                   for i, r in sorted(results.items())]
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices,
                              usage=Usage(**usage.as_dict()))


class CompletionRenderer:
    def __init__(self, model: str, top_logprobs: int | None, tokens: TokenStrings, echo: dict[int, str]):
        self.id, self.created, self.model = completion_id("cmpl"), now(), model
        self.top_logprobs, self.tokens, self.echo = top_logprobs, tokens, echo
        self.offsets: dict[int, int] = {}  # per choice, the text offset of its next token (streaming)
        self.text_frames = TextFrames(lambda index, text: self._json([CompletionChoice(index=index, text=text)]))

    def _json(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices,
                          usage=usage).model_dump_json()

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        return sse_data(self._json(choices, usage))

    def stream_start(self) -> list[bytes]:
        return [self._chunk([CompletionChoice(index=i, text=text)]) for i, text in self.echo.items()]

    def stream_delta(self, index: int, delta: TextDelta) -> list[bytes]:
        if delta.text and delta.finish_reason is None and self.top_logprobs is None:  # the common token
            return [self.text_frames.frame(index, delta.text)]
        logprobs = None
        if self.top_logprobs is not None and delta.tokens:
            logprobs, self.offsets[index] = completion_logprobs(
                delta.tokens, self.tokens, self.top_logprobs, self.offsets.get(index, 0))
        if not delta.text and logprobs is None and delta.finish_reason is None:
            return []
        return [self._chunk([CompletionChoice(index=index, text=delta.text, logprobs=logprobs,
                                              finish_reason=delta.finish_reason)])]

    def stream_usage(self, usage: UsageCounter) -> bytes:
        return self._chunk([], Usage(**usage.as_dict()))

    def body(self, results: dict[int, ChoiceResult], usage: UsageCounter) -> BaseModel:
        choices = []
        for i, r in sorted(results.items()):
            logprobs = (completion_logprobs(r.tokens, self.tokens, self.top_logprobs, 0)[0]
                        if self.top_logprobs is not None else None)
            choices.append(CompletionChoice(index=i, text=self.echo.get(i, "") + r.text,
                                            finish_reason=r.finish_reason, logprobs=logprobs))
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices,
                          usage=Usage(**usage.as_dict()))
