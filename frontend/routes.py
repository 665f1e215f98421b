"""HTTP routes: parse the request, hand it to the serving layer, return its response. Nothing else."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import anyio
from fastapi import APIRouter, Depends, Request

from frontend.engine import Guide
from frontend.errors import invalid_request, service_unavailable
from frontend.middleware import RequestContext
from frontend.model_context import ModelContext
from frontend.renderers import ChatRenderer, CompletionRenderer
from frontend.responses import GenerationResponse
from frontend.schemas import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest, ModelCard,
                              ModelList, SamplingFields, TokenizeRequest, now)
from frontend.serving import AnswerParsing, Generation, GenerationLimits, choice_jobs
from frontend.structured import answer_parsing, chat_guide, extension_guide

router = APIRouter()
T = TypeVar("T")


def request_context(request: Request) -> RequestContext:
    """What the edge middleware knows of this request (id, deadline, key, usage record)."""
    return request.state.ctx


async def model_context(request: Request, model: str | None = None) -> ModelContext:
    """The context of the model the request names (404 if not served), leased until the request's last
    byte: a rollout waits for the requests that picked the version it retires (frontend/rollout.py)."""
    context = await request.app.state.models.get(model)
    ctx = request_context(request)
    ctx.model, ctx.model_version = context.served_model_name, context.version
    if context.engine is not None:
        context.engine.lease()
        ctx.on_finish.append(context.engine.release)
    return context


def model_card(request: Request, context: ModelContext) -> ModelCard:
    card = ModelCard(id=context.served_model_name, created=now(), max_model_len=context.context_length)
    return card.model_copy(update=request.app.state.models.versions(context))


# ----- health, models, tokenizer helpers -----------------------------------------------------------
@router.get("/health/live")
async def live() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/health/ready")
async def ready(request: Request) -> dict[str, str]:
    if not await request.app.state.models.is_ready():
        raise service_unavailable("Triton or an engine model is not ready")
    await request.app.state.models.all()
    return {"status": "ok"}


@router.get("/v1/models", response_model_exclude_none=True)
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[model_card(request, context) for context in await request.app.state.models.all()])


@router.get("/v1/models/{model_id:path}", response_model_exclude_none=True)
async def get_model(model_id: str, request: Request) -> ModelCard:
    return model_card(request, await request.app.state.models.get(model_id))


async def off_loop(request: Request, work: Callable[..., T], *args: Any) -> T:
    """Run tokenizer work (encode, decode, chat templates) in the tokenizer threads: a megabyte-long
    prompt must not stall every open stream on the event loop."""
    return await anyio.to_thread.run_sync(functools.partial(work, *args),
                                          limiter=request.app.state.tokenizer_threads)


async def rate_limited(request: Request) -> None:
    """Requests per minute of the caller's API key (429 past it): on the routes that do work."""
    request_context(request).check_request_rate()


def check_fits_context(text: str, context: ModelContext, param: str) -> None:
    """Refuse, before tokenizing it, a text that has more tokens than the model's context can ever hold."""
    if context.tokenizer.certainly_longer_than(text, context.context_length):
        raise invalid_request(f"The {param} is longer than this model's maximum context length of "
                              f"{context.context_length} tokens could hold.", param, "context_length_exceeded")


def messages_text(messages: list[ChatMessage]) -> str:
    return "".join(m.as_template_input()["content"] for m in messages)


@router.post("/tokenize", dependencies=[Depends(rate_limited)])
async def tokenize(req: TokenizeRequest, request: Request) -> dict[str, Any]:
    context = await model_context(request, req.model)
    if req.messages is not None:
        check_fits_context(messages_text(req.messages), context, "messages")
        ids = await off_loop(request, context.tokenizer.apply_chat_template,
                             [m.as_template_input() for m in req.messages])
    else:
        check_fits_context(req.prompt or "", context, "prompt")
        ids = await off_loop(request, context.tokenizer.encode, req.prompt or "")
    return {"tokens": ids, "count": len(ids), "max_model_len": context.context_length}


@router.post("/detokenize", dependencies=[Depends(rate_limited)])
async def detokenize(req: DetokenizeRequest, request: Request) -> dict[str, str]:
    context = await model_context(request, req.model)
    check_token_ids(req.tokens, context, "tokens")
    return {"prompt": await off_loop(request, context.tokenizer.decode, req.tokens)}


def check_top_logprobs(top_logprobs: int | None, context: ModelContext, param: str) -> None:
    """Refuse alternatives the engine cannot give, rather than answer without them."""
    if not top_logprobs or top_logprobs <= context.max_top_logprobs:
        return
    if context.max_top_logprobs == 0:
        raise invalid_request(
            f"This engine returns the sampled tokens' log-probabilities only, no most likely alternatives "
            f"(the TensorRT-LLM backend has none); ask for logprobs with {param} 0.", param)
    raise invalid_request(f"This engine returns at most {context.max_top_logprobs} alternatives per token; "
                          f"{param} was {top_logprobs}.", param)


def check_token_ids(ids: list[int], context: ModelContext, param: str) -> None:
    vocab = context.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise invalid_request(f"token ids must be in [0, {vocab})", param)


# ----- generation ----------------------------------------------------------------------------------
def limits(request: Request) -> GenerationLimits:
    settings = request.app.state.settings
    return GenerationLimits(settings.max_n, settings.max_engine_requests, settings.max_prompt_tokens,
                            settings.max_stop_length)


async def new_generation(request: Request, req: SamplingFields, context: ModelContext, prompts: list[list[int]],
                         top_logprobs: int | None, prompt_param: str, guide: Guide | None = None,
                         parsing: AnswerParsing = AnswerParsing()) -> Generation:
    """The serving layer's Generation for this request, after the checks that need no engine (limits,
    context length), the tokens-per-minute reservation (prompt + the most it may generate), and admission
    (one slot per engine request)."""
    limits(request).check_prompts(prompts, prompt_param)
    jobs = choice_jobs(req, prompts, context.context_length, context.tokenizer, top_logprobs, prompt_param, guide)
    ctx = request_context(request)
    generation = Generation(context.engine, context.tokenizer, jobs, req.stop_strings,
                            sum(len(p) for p in prompts), ctx, parsing)
    ctx.reserve_tokens(generation.usage.prompt_tokens + sum(job.request.options.max_tokens for job in jobs))
    ctx.prompt_tokens, ctx.usage = generation.usage.prompt_tokens, generation.usage
    if request.app.state.settings.log_prompts:
        ctx.prompt_text = [await off_loop(request, context.tokenizer.decode, p) for p in prompts]
        ctx.completion_text = []
    await ctx.admit(len(jobs))
    return generation


@router.post("/v1/chat/completions", dependencies=[Depends(rate_limited)])
async def chat_completions(req: ChatCompletionRequest, request: Request) -> GenerationResponse:
    limits(request).check_choices(req.n, 1, "messages")
    limits(request).check_stops(req.stop_strings)
    context = await model_context(request, req.model)
    check_top_logprobs(req.num_top_logprobs, context, "top_logprobs")
    guide = chat_guide(req)
    check_fits_context(messages_text(req.messages), context, "messages")
    tools = [tool.as_template_input() for tool in req.tools] if req.tools else None
    prompt_ids = await off_loop(request, context.tokenizer.apply_chat_template,
                                [m.as_template_input() for m in req.messages], tools)
    parsing = answer_parsing(req, context, prompt_ids)
    top = req.num_top_logprobs if req.logprobs else None
    generation = await new_generation(request, req, context, [prompt_ids], top, "messages", guide, parsing)
    renderer = ChatRenderer(context.served_model_name, generation.indexes, top, context.tokenizer)
    return GenerationResponse(generation, renderer, stream=req.stream, include_usage=req.include_usage,
                              request_id=request_context(request).request_id)


@router.post("/v1/completions", dependencies=[Depends(rate_limited)])
async def completions(req: CompletionRequest, request: Request) -> GenerationResponse:
    limits(request).check_choices(req.n, len(req.prompts), "prompt")
    limits(request).check_stops(req.stop_strings)
    context = await model_context(request, req.model)
    check_top_logprobs(req.logprobs, context, "logprobs")
    prompts: list[list[int]] = []
    for prompt in req.prompts:
        if isinstance(prompt, str):
            check_fits_context(prompt, context, "prompt")
            prompts.append(await off_loop(request, context.tokenizer.encode, prompt))
        else:
            check_token_ids(prompt, context, "prompt")
            prompts.append(list(prompt))
    if any(not p for p in prompts):
        raise invalid_request("prompt must not be empty", "prompt")
    generation = await new_generation(request, req, context, prompts, req.logprobs, "prompt", extension_guide(req))
    echo = ({job.index: await off_loop(request, context.tokenizer.decode, job.request.prompt_ids)
             for job in generation.jobs} if req.echo else {})
    renderer = CompletionRenderer(context.served_model_name, req.logprobs, context.tokenizer, echo)
    return GenerationResponse(generation, renderer, stream=req.stream, include_usage=req.include_usage,
                              request_id=request_context(request).request_id)
