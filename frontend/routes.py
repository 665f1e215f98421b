"""HTTP routes: thin wrappers that turn OpenAI requests into `generate_text` calls and back."""

from __future__ import annotations

import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from frontend.errors import OpenAIError, invalid_request, service_unavailable
from frontend.generation import (TextDelta, UsageCounter, generate_text, resolve_max_tokens,
                                 sampling_options)
from frontend.model_context import ModelContext
from frontend.schemas import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                              ChatCompletionRequest, ChatDelta, Completion, CompletionChoice,
                              CompletionRequest, ModelCard, ModelList, ResponseMessage, SamplingFields,
                              Usage, completion_id, now)
from frontend.sse import DONE, sse_data, sse_json

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def request_id_of(request: Request) -> str:
    """The client's X-Request-Id if it sent one (so its logs and Triton's line up), else a new one."""
    return request.headers.get("x-request-id") or uuid.uuid4().hex


async def model_context(request: Request, model: str | None = None) -> ModelContext:
    context = await request.app.state.contexts.get()
    if model is not None and model != context.served_model_name:
        raise OpenAIError(404, f"The model '{model}' does not exist; this server serves "
                               f"'{context.served_model_name}'", "invalid_request_error", "model",
                          "model_not_found")
    return context


# ----- health and models -------------------------------------------------------------------------------
@router.get("/health/live")
async def live() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/health/ready")
async def ready(request: Request) -> dict[str, str]:
    if not await request.app.state.engine.is_ready():
        raise service_unavailable("Triton or the engine model is not ready")
    await model_context(request)
    return {"status": "ok"}


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    context = await model_context(request)
    return ModelList(data=[ModelCard(id=context.served_model_name, created=now(),
                                     max_model_len=context.context_length)])


# ----- generation ----------------------------------------------------------------------------------
async def _run(request: Request, req: SamplingFields, context: ModelContext, prompt_ids: list[int],
               request_id: str) -> tuple[AsyncIterator[TextDelta], UsageCounter]:
    max_tokens = resolve_max_tokens(len(prompt_ids), req.requested_max_tokens, context.context_length)
    usage = UsageCounter(prompt_tokens=len(prompt_ids))
    deltas = generate_text(request.app.state.engine, context.tokenizer, request_id, prompt_ids,
                           sampling_options(req, max_tokens, context.tokenizer), req.stop_strings, usage,
                           streaming=req.stream)
    return deltas, usage


async def _collect(deltas: AsyncIterator[TextDelta]) -> tuple[str, str]:
    parts, finish = [], "stop"
    async for delta in deltas:
        parts.append(delta.text)
        finish = delta.finish_reason or finish
    return "".join(parts), finish


class ChatChunks:
    """The chat.completion.chunk objects of one stream (same id and created on every chunk)."""

    def __init__(self, model: str):
        self.id, self.created, self.model = completion_id("chatcmpl"), now(), model

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                    usage=usage)
        return sse_data(chunk.model_dump_json())

    def start(self) -> list[bytes]:
        return [self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])]

    def text(self, text: str) -> bytes:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(content=text))])

    def finish(self, reason: str) -> bytes:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(), finish_reason=reason)])

    def usage(self, usage: UsageCounter) -> bytes:
        return self._chunk([], Usage(**usage.as_dict()))


class CompletionChunks:
    """The text_completion objects of one legacy-completions stream."""

    def __init__(self, model: str):
        self.id, self.created, self.model = completion_id("cmpl"), now(), model

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        chunk = Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
        return sse_data(chunk.model_dump_json())

    def start(self) -> list[bytes]:
        return []

    def text(self, text: str) -> bytes:
        return self._chunk([CompletionChoice(text=text)])

    def finish(self, reason: str) -> bytes:
        return self._chunk([CompletionChoice(text="", finish_reason=reason)])

    def usage(self, usage: UsageCounter) -> bytes:
        return self._chunk([], Usage(**usage.as_dict()))


async def _stream(deltas: AsyncIterator[TextDelta], usage: UsageCounter, include_usage: bool,
                  chunks: ChatChunks | CompletionChunks, request_id: str) -> StreamingResponse:
    """Start the SSE response once the first delta is known, so errors before the first token still get
    a real HTTP status; after that, an error ends the stream with an error event and [DONE]."""
    try:
        first = await anext(deltas, None)
    except BaseException:
        await deltas.aclose()
        raise

    async def body() -> AsyncIterator[bytes]:
        for frame in chunks.start():
            yield frame
        try:
            delta = first
            while delta is not None:
                if delta.text:
                    yield chunks.text(delta.text)
                if delta.finish_reason is not None:
                    yield chunks.finish(delta.finish_reason)
                delta = await anext(deltas, None)
            if include_usage:
                yield chunks.usage(usage)
        except OpenAIError as exc:
            yield sse_json(exc.body())
        finally:
            await deltas.aclose()
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={**SSE_HEADERS, "X-Request-Id": request_id})


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    context = await model_context(request, req.model)
    request_id = request_id_of(request)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    prompt_ids = context.tokenizer.apply_chat_template(messages)
    deltas, usage = await _run(request, req, context, prompt_ids, request_id)
    if req.stream:
        return await _stream(deltas, usage, req.include_usage, ChatChunks(context.served_model_name),
                             request_id)
    text, finish = await _collect(deltas)
    body = ChatCompletion(id=completion_id("chatcmpl"), created=now(), model=context.served_model_name,
                          choices=[ChatChoice(message=ResponseMessage(content=text), finish_reason=finish)],
                          usage=Usage(**usage.as_dict()))
    return JSONResponse(body.model_dump(), headers={"X-Request-Id": request_id})


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    context = await model_context(request, req.model)
    request_id = request_id_of(request)
    prompt = req.prompt[0] if isinstance(req.prompt, list) and not isinstance(req.prompt[0], int) else req.prompt
    if isinstance(prompt, str):
        prompt_ids = context.tokenizer.encode(prompt)
    else:
        vocab = context.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise invalid_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        prompt_ids = list(prompt)
    if not prompt_ids:
        raise invalid_request("prompt must not be empty", "prompt")
    deltas, usage = await _run(request, req, context, prompt_ids, request_id)
    if req.stream:
        return await _stream(deltas, usage, req.include_usage, CompletionChunks(context.served_model_name),
                             request_id)
    text, finish = await _collect(deltas)
    body = Completion(id=completion_id("cmpl"), created=now(), model=context.served_model_name,
                      choices=[CompletionChoice(text=text, finish_reason=finish)],
                      usage=Usage(**usage.as_dict()))
    return JSONResponse(body.model_dump(), headers={"X-Request-Id": request_id})
