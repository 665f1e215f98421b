"""HTTP routes: thin wrappers that turn OpenAI requests into engine jobs and the results back into JSON/SSE."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from frontend.errors import OpenAIError, invalid_request, service_unavailable
from frontend.generation import (ChoiceJob, TextDelta, UsageCounter, choice_jobs, generate_text,
                                 merge_choices)
from frontend.logprobs import chat_logprobs, completion_logprobs
from frontend.metrics import TokenTiming
from frontend.middleware import RequestContext
from frontend.model_context import ModelContext
from frontend.schemas import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                              ChatCompletionRequest, ChatDelta, Completion, CompletionChoice,
                              CompletionRequest, DetokenizeRequest, ModelCard, ModelList, ResponseMessage,
                              SamplingFields, TokenizeRequest, Usage, completion_id, now)
from frontend.sse import DONE, sse_data, sse_json

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DISCONNECT_POLL_S = 0.2


def request_id_of(request: Request) -> str:
    """The client's X-Request-Id if it sent one (so its logs and Triton's line up), else a new one."""
    return request.headers.get("x-request-id") or uuid.uuid4().hex


def request_context(request: Request) -> RequestContext | None:
    """What the edge middleware knows of this request (deadline, key, usage record); None without it."""
    return getattr(request.state, "ctx", None)


async def model_context(request: Request, model: str | None = None) -> ModelContext:
    context = await request.app.state.contexts.get()
    if model is not None and model != context.served_model_name:
        raise OpenAIError(404, f"The model '{model}' does not exist; this server serves "
                               f"'{context.served_model_name}'", "invalid_request_error", "model",
                          "model_not_found")
    return context


def model_card(context: ModelContext) -> ModelCard:
    return ModelCard(id=context.served_model_name, created=now(), max_model_len=context.context_length)


# ----- health, models, tokenizer helpers -----------------------------------------------------------
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
    return ModelList(data=[model_card(await model_context(request))])


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> ModelCard:
    return model_card(await model_context(request, model_id))


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> dict[str, Any]:
    context = await model_context(request, req.model)
    if req.messages is not None:
        ids = context.tokenizer.apply_chat_template([m.as_template_input() for m in req.messages])
    else:
        ids = context.tokenizer.encode(req.prompt or "")
    return {"tokens": ids, "count": len(ids), "max_model_len": context.context_length}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> dict[str, str]:
    context = await model_context(request, req.model)
    check_token_ids(req.tokens, context, "tokens")
    return {"prompt": context.tokenizer.decode(req.tokens)}


def check_token_ids(ids: list[int], context: ModelContext, param: str) -> None:
    vocab = context.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise invalid_request(f"token ids must be in [0, {vocab})", param)


# ----- generation ----------------------------------------------------------------------------------
class Generation:
    """The engine jobs of one request and their shared usage count."""

    def __init__(self, request: Request, req: SamplingFields, context: ModelContext, prompts: list[list[int]],
                 top_logprobs: int | None):
        max_n = request.app.state.settings.max_n
        if req.n > max_n:
            raise invalid_request(f"n must be at most {max_n}", "n")
        settings = request.app.state.settings
        if settings.max_prompt_tokens and any(len(p) > settings.max_prompt_tokens for p in prompts):
            longest = max(len(p) for p in prompts)
            raise invalid_request(f"The prompt has {longest} tokens, more than this server's limit of "
                                  f"{settings.max_prompt_tokens}.", "messages" if hasattr(req, "messages")
                                  else "prompt", "prompt_too_long")
        self.request_id = request_id_of(request)
        self.context = context
        self.jobs = choice_jobs(req, prompts, context.context_length, context.tokenizer, top_logprobs)
        self.usage = UsageCounter(prompt_tokens=sum(len(p) for p in prompts))
        self._engine = request.app.state.engine
        self._stop = req.stop_strings
        self._streaming = req.stream
        self.ctx = ctx = request_context(request)
        if ctx is not None:  # tokens per minute: reserve the most this can use (429 if over the limit)
            ctx.reserve_tokens(self.usage.prompt_tokens + sum(job.options.max_tokens for job in self.jobs))
            ctx.prompt_tokens, ctx.usage = self.usage.prompt_tokens, self.usage
            if settings.log_prompts:
                ctx.prompt_text = [context.tokenizer.decode(p) for p in prompts]
                ctx.completion_text = []

    def _job_request_id(self, job: ChoiceJob) -> str:
        return self.request_id if len(self.jobs) == 1 else f"{self.request_id}-{job.index}"

    def _timing(self) -> TokenTiming | None:
        ctx = self.ctx
        if ctx is None or ctx.edge is None:
            return None

        def first(ttft: float) -> None:
            ctx.ttft_s = ttft if ctx.ttft_s is None else min(ctx.ttft_s, ttft)

        return TokenTiming(ctx.started, ctx.edge.metrics, ctx.route, first)

    def streams(self) -> dict[int, AsyncIterator[TextDelta]]:
        return {job.index: generate_text(self._engine, self.context.tokenizer, self._job_request_id(job), job,
                                         self._stop, self.usage, self._streaming, self._timing())
                for job in self.jobs}

    async def bounded(self, awaitable: Any) -> Any:
        """Await under the request's deadline: cancelled (with its Triton requests) when time is up or the
        server shuts down, raising the matching OpenAIError (504 timeout / 503)."""
        if self.ctx is None or self.ctx.deadline is None:
            return await awaitable
        return await self.ctx.deadline.run(awaitable)

    def record(self, delta: TextDelta) -> None:
        """Note a delta's finish reason (and, with log_prompts, its text) for metrics and the access log."""
        if self.ctx is not None:
            self.ctx.record_finish(delta.finish_reason)
            if self.ctx.completion_text is not None:
                self.ctx.completion_text.append(delta.text)

    def failed(self, exc: OpenAIError) -> None:
        if self.ctx is not None:
            deadline = self.ctx.deadline
            self.ctx.finish_reason = (deadline.reason if deadline is not None and deadline.reason
                                      else "timeout" if exc.code == "timeout" else "error")

    async def collect(self) -> dict[int, tuple[str, str, list]]:
        """Every choice's (text, finish_reason, tokens), generated concurrently."""

        async def one(stream: AsyncIterator[TextDelta]) -> tuple[str, str, list]:
            parts, tokens, finish = [], [], "stop"
            async for delta in stream:
                parts.append(delta.text)
                tokens += delta.tokens
                finish = delta.finish_reason or finish
                self.record(delta)
            return "".join(parts), finish, tokens

        streams = self.streams()
        try:
            results = await self.bounded(asyncio.gather(*(one(s) for s in streams.values())))
        except OpenAIError as exc:
            self.failed(exc)
            raise
        return dict(zip(streams, results))


async def until_disconnect(request: Request, work: Any) -> Any:
    """Run `work`; if the client goes away first, cancel it (and with it the Triton requests)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None


class ChatChunks:
    """The chat.completion.chunk objects of one stream (same id and created on every chunk)."""

    def __init__(self, model: str, indexes: list[int], top_logprobs: int | None, token_text):
        self.id, self.created, self.model = completion_id("chatcmpl"), now(), model
        self.indexes, self.top_logprobs, self.token_text = indexes, top_logprobs, token_text

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                    usage=usage)
        return sse_data(chunk.model_dump_json())

    def start(self) -> list[bytes]:
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in self.indexes]

    def delta(self, index: int, delta: TextDelta) -> list[bytes]:
        frames = []
        logprobs = (chat_logprobs(delta.tokens, self.token_text, self.top_logprobs)
                    if self.top_logprobs is not None and delta.tokens else None)
        if delta.text or logprobs:
            frames.append(self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=delta.text),
                                                       logprobs=logprobs)]))
        if delta.finish_reason is not None:
            frames.append(self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(),
                                                       finish_reason=delta.finish_reason)]))
        return frames

    def usage(self, usage: UsageCounter) -> bytes:
        return self._chunk([], Usage(**usage.as_dict()))


class CompletionChunks:
    """The text_completion objects of one legacy-completions stream."""

    def __init__(self, model: str, top_logprobs: int | None, token_text, echo: dict[int, str]):
        self.id, self.created, self.model = completion_id("cmpl"), now(), model
        self.top_logprobs, self.token_text, self.echo = top_logprobs, token_text, echo
        self.offsets: dict[int, int] = {}

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        chunk = Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
        return sse_data(chunk.model_dump_json())

    def start(self) -> list[bytes]:
        return [self._chunk([CompletionChoice(index=i, text=text)]) for i, text in self.echo.items()]

    def delta(self, index: int, delta: TextDelta) -> list[bytes]:
        logprobs = None
        if self.top_logprobs is not None and delta.tokens:
            logprobs, self.offsets[index] = completion_logprobs(
                delta.tokens, self.token_text, self.top_logprobs, self.offsets.get(index, 0))
        if not delta.text and logprobs is None and delta.finish_reason is None:
            return []
        return [self._chunk([CompletionChoice(index=index, text=delta.text, logprobs=logprobs,
                                              finish_reason=delta.finish_reason)])]

    def usage(self, usage: UsageCounter) -> bytes:
        return self._chunk([], Usage(**usage.as_dict()))


async def stream_response(generation: Generation, chunks: ChatChunks | CompletionChunks,
                          include_usage: bool) -> StreamingResponse:
    """Start the SSE response once the first delta is known, so errors before the first token still get
    a real HTTP status; after that, an error ends the stream with an error event and [DONE]. A client
    that disconnects closes the body generator, which cancels every Triton request of the stream."""
    merged = merge_choices(generation.streams())
    try:
        first = await generation.bounded(anext(merged, None))
    except BaseException as exc:
        await merged.aclose()
        if isinstance(exc, OpenAIError):
            generation.failed(exc)
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            for frame in chunks.start():
                yield frame
            item = first
            while item is not None:
                generation.record(item[1])
                for frame in chunks.delta(*item):
                    yield frame
                item = await generation.bounded(anext(merged, None))
            if include_usage:
                yield chunks.usage(generation.usage)
        except OpenAIError as exc:
            generation.failed(exc)
            yield sse_json(exc.body())
        finally:
            await merged.aclose()
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={**SSE_HEADERS, "X-Request-Id": generation.request_id})


def client_gone() -> Response:
    return Response(status_code=499)  # nobody reads it; 499 marks it in access logs


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    context = await model_context(request, req.model)
    prompt_ids = context.tokenizer.apply_chat_template([m.as_template_input() for m in req.messages])
    top = req.num_top_logprobs if req.logprobs else None
    generation = Generation(request, req, context, [prompt_ids], top)
    token_text = context.tokenizer.token_text
    if req.stream:
        chunks = ChatChunks(context.served_model_name, [j.index for j in generation.jobs], top, token_text)
        return await stream_response(generation, chunks, req.include_usage)
    results = await until_disconnect(request, generation.collect())
    if results is None:
        return client_gone()
    choices = [ChatChoice(index=i, message=ResponseMessage(content=text), finish_reason=finish,
                          logprobs=chat_logprobs(tokens, token_text, top) if top is not None else None)
               for i, (text, finish, tokens) in sorted(results.items())]
    body = ChatCompletion(id=completion_id("chatcmpl"), created=now(), model=context.served_model_name,
                          choices=choices, usage=Usage(**generation.usage.as_dict()))
    return JSONResponse(body.model_dump(), headers={"X-Request-Id": generation.request_id})


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request) -> Response:
    context = await model_context(request, req.model)
    prompts: list[list[int]] = []
    for prompt in req.prompts:
        if isinstance(prompt, str):
            prompts.append(context.tokenizer.encode(prompt))
        else:
            check_token_ids(prompt, context, "prompt")
            prompts.append(list(prompt))
    if any(not p for p in prompts):
        raise invalid_request("prompt must not be empty", "prompt")
    top = req.logprobs
    generation = Generation(request, req, context, prompts, top)
    token_text = context.tokenizer.token_text
    echo = {job.index: context.tokenizer.decode(job.prompt_ids) for job in generation.jobs} if req.echo else {}
    if req.stream:
        chunks = CompletionChunks(context.served_model_name, top, token_text, echo)
        return await stream_response(generation, chunks, req.include_usage)
    results = await until_disconnect(request, generation.collect())
    if results is None:
        return client_gone()
    choices = []
    for i, (text, finish, tokens) in sorted(results.items()):
        logprobs = completion_logprobs(tokens, token_text, top, 0)[0] if top is not None else None
        choices.append(CompletionChoice(index=i, text=echo.get(i, "") + text, finish_reason=finish,
                                        logprobs=logprobs))
    body = Completion(id=completion_id("cmpl"), created=now(), model=context.served_model_name,
                      choices=choices, usage=Usage(**generation.usage.as_dict()))
    return JSONResponse(body.model_dump(), headers={"X-Request-Id": generation.request_id})
