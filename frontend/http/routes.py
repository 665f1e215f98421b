"""HTTP routes: parse the request, hand it to the serving layer, return its response. Nothing else."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, TypeVar

import anyio
from fastapi import APIRouter, Depends, Request

from frontend.policy.admission import TokenDemand
from frontend.planning.chat_plan import ChatPlan
from frontend.generation.engine import Guide
from frontend.api_types.errors import OpenAIError, invalid_request, service_unavailable
from frontend.http.json_body import OffLoopJSONRoute, parsed_json
from frontend.http.middleware import RequestContext
from frontend.models.registry import ModelContext
from frontend.http.renderers import ChatRenderer, CompletionRenderer
from frontend.http.request_budget import RequestBudget
from frontend.http.generation_response import GenerationResponse
from frontend.api_types.reply_bodies import ModelCard, ModelList, now
from frontend.api_types.request_bodies import (MAX_N, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                               DetokenizeRequest, SamplingFields, TokenizeRequest, raw_prompts)
from frontend.generation.serving import AnswerParsing, Generation, GenerationLimits, choice_jobs, resolve_max_tokens
from frontend.planning.guide_check import check_guides
from frontend.planning.logprob_rules import check_logprobs_meaning
from frontend.planning.sampling import check_top_k, engine_sampling
from frontend.planning.structured import extension_guide

router = APIRouter(route_class=OffLoopJSONRoute)  # large JSON bodies are parsed off the event loop
T = TypeVar("T")


def request_context(request: Request) -> RequestContext:
    """What the edge middleware knows of this request (id, deadline, key, usage record)."""
    return request.state.ctx


def request_budget(request: Request) -> RequestBudget:
    """What this request holds (lease, tokens, slots), given back after its last byte (the middleware)."""
    return request.state.budget


async def model_context(request: Request, model: str | None = None) -> ModelContext:
    """The context of the model the request names (404 if not served), leased until the request's last
    byte: a rollout waits for the requests that picked the version it retires (frontend/models/rollout.py)."""
    context = await request.app.state.models.get(model)
    ctx = request_context(request)
    ctx.model, ctx.model_version = context.served_model_name, context.version
    if context.engine is not None:
        request_budget(request).lease(context.engine)
    return context


def model_card(request: Request, context: ModelContext) -> ModelCard:
    card = ModelCard(id=context.served_model_name, created=now(), max_model_len=context.context_length)
    if context.parent is not None:  # a LoRA adapter: vLLM's card (its base as parent, its directory as root)
        return card.model_copy(update={"parent": context.parent, "root": context.root})
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
    models = request.app.state.models
    contexts = await models.all() + await models.adapter_contexts()
    return ModelList(data=[model_card(request, context) for context in contexts])


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
    await request_budget(request).check_request_rate()


async def lists_fit(request: Request) -> None:
    """Refuse, by their lengths alone and before the body is validated, more `messages`, Responses `input`
    items or `tools` than this server takes (settings): validation costs a Python step per item and runs
    on the event loop (a 3.7 MB chat body of 110k one-character messages took ~2.9 s of it), so a body of
    many tiny items must be a 400 at once, naming the field. Async: a count needs no thread hop."""
    body = parsed_json(request)
    if not isinstance(body, dict):
        return
    settings = request.app.state.settings
    for field, limit in (("messages", settings.max_messages), ("input", settings.max_input_items),
                         ("tools", settings.max_tools)):
        items = body.get(field)
        if isinstance(items, list) and len(items) > limit:
            raise invalid_request(f"{field} may hold at most {limit} items; this request has {len(items)}", field,
                                  "array_above_max_length")


def check_fits_context(text: str, context: ModelContext, param: str) -> None:
    """Refuse, before tokenizing it, a text that has more tokens than the model's context can ever hold."""
    if context.tokenizer.certainly_longer_than(text, context.context_length):
        raise invalid_request(f"The {param} is longer than this model's maximum context length of "
                              f"{context.context_length} tokens could hold.", param, "context_length_exceeded")


def messages_text(messages: list[ChatMessage]) -> str:
    return "".join(m.as_template_input()["content"] for m in messages)


@router.post("/tokenize", dependencies=[Depends(rate_limited), Depends(lists_fit)])
async def tokenize(req: TokenizeRequest, request: Request) -> dict[str, Any]:
    context = await model_context(request, req.model)
    if req.messages is not None:
        check_fits_context(messages_text(req.messages), context, "messages")
        ids = await off_loop(request, context.tokenizer.apply_chat_template,
                             [m.as_template_input() for m in req.messages])
    else:
        check_fits_context(req.prompt or "", context, "prompt")
        ids = await off_loop(request, context.tokenizer.encode_prompt, req.prompt or "")
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
    """Ids in the model's vocabulary. The schema made them ints in [0, INT32_MAX], so the largest decides:
    one pass at C speed, not a Python step per id (a prompt may be as long as the context)."""
    vocab = context.tokenizer.vocab_size
    if ids and max(ids) >= vocab:
        raise invalid_request(f"token ids must be in [0, {vocab})", param)


async def context_length_for(request: Request, model: Any) -> int | None:
    """Before the body is validated: the context length of the model it names, or, if it names none this
    server serves (the route answers that once the body is valid), the longest of the served models'.
    None while no model can be loaded. Takes no lease."""
    registry = request.app.state.models
    if isinstance(model, str):
        with contextlib.suppress(OpenAIError):
            return (await registry.get(model)).context_length
    with contextlib.suppress(OpenAIError):
        return max((context.context_length for context in await registry.all()), default=None)
    return None


async def token_prompts_fit(request: Request) -> None:
    """Refuse, by their lengths alone and before the body is validated, prompts that could never run: more
    than a request may start, or token ids more than MAX_PROMPT_TOKENS or the model's context holds.
    Validation costs per id (in pydantic, holding the GIL, on the event loop): a 4 MB body of two million
    ids must be a 400 at once, not a stall of every open stream. FastAPI has parsed the body (off the loop,
    json_body.py) before it solves this dependency, and validates it after."""
    body = parsed_json(request)
    prompts = raw_prompts(body)
    if not prompts:
        return
    n = body.get("n")
    n = n if type(n) is int and 1 <= n <= MAX_N else 1
    limits(request).check_choices(n, len(prompts), "prompt")
    token_prompts = [p for p in prompts if isinstance(p, list)]
    limits(request).check_prompts(token_prompts, "prompt")
    context_length = await context_length_for(request, body.get("model")) if token_prompts else None
    if context_length is not None:  # no room left for one token: the route's own 400
        resolve_max_tokens(max(map(len, token_prompts)), None, context_length, "prompt")


# ----- generation ----------------------------------------------------------------------------------
def limits(request: Request) -> GenerationLimits:
    settings = request.app.state.settings
    return GenerationLimits(settings.max_n, settings.max_engine_requests, settings.max_prompt_tokens,
                            settings.max_stop_length)


async def new_generation(request: Request, req: SamplingFields, context: ModelContext, prompts: list[list[int]],
                         top_logprobs: int | None, prompt_param: str, guide: Guide | None = None,
                         parsing: AnswerParsing = AnswerParsing()) -> Generation:
    """The serving layer's Generation for this request, after the checks that need no engine (limits,
    context length), the tokens-per-minute reservation (prompt + the most it may generate, see
    admission.tokens_to_reserve), and admission (one slot per engine request). What the engine gets of the
    sampling fields is decided by planning/sampling.py (no combination that would fail a TensorRT-LLM batch)."""
    check_top_k(req.top_k, context.log_probs)
    req = engine_sampling(req, guide)
    limits(request).check_prompts(prompts, prompt_param)
    jobs = choice_jobs(req, prompts, context.context_length, context.tokenizer, top_logprobs, prompt_param, guide,
                       request.app.state.settings.request_buffer_bytes)
    ctx, budget = request_context(request), request_budget(request)
    generation = Generation(context.engine, context.tokenizer, jobs, req.stop_strings,
                            sum(len(p) for p in prompts), budget, parsing)
    demand = TokenDemand(generation.usage.prompt_tokens, sum(job.request.options.max_tokens for job in jobs),
                         len(jobs), max_tokens_given=req.requested_max_tokens is not None)
    await budget.reserve_tokens(demand, prompt_param)
    ctx.prompt_tokens, ctx.usage = generation.usage.prompt_tokens, generation.usage
    if request.app.state.settings.log_prompts:
        ctx.prompt_text = [await off_loop(request, context.tokenizer.decode, p) for p in prompts]
        ctx.completion_text = []
    await budget.admit(len(jobs))
    return generation


@router.post("/v1/chat/completions", dependencies=[Depends(rate_limited), Depends(lists_fit)])
async def chat_completions(req: ChatCompletionRequest, request: Request) -> GenerationResponse:
    limits(request).check_choices(req.n, 1, "messages")
    limits(request).check_stops(req.stop_strings)
    context = await model_context(request, req.model)
    check_top_logprobs(req.num_top_logprobs, context, "top_logprobs")
    plan = ChatPlan.build(req, context)  # the tools rendered, the guide and the answer's parsers, together
    check_logprobs_meaning(engine_sampling(req, plan.guide), req.logprobs, context.log_probs, "logprobs")
    await check_guides(request.app.state, context.engine, plan.guide, plan.guide_parts)  # compiles, or a 400
    check_fits_context(messages_text(req.messages), context, "messages")
    prompt_ids = await off_loop(request, context.tokenizer.apply_chat_template,
                                [m.as_template_input() for m in req.messages], plan.template_tools)
    plan = plan.for_prompt(context.tokenizer, prompt_ids)
    top = req.num_top_logprobs if req.logprobs else None
    generation = await new_generation(request, req, context, [prompt_ids], top, "messages", plan.guide,
                                      plan.parsing)
    renderer = ChatRenderer(context.served_model_name, generation.indexes, top, context.tokenizer)
    return GenerationResponse(generation, renderer, stream=req.stream, include_usage=req.include_usage,
                              request_id=request_context(request).request_id)


@router.post("/v1/completions", dependencies=[Depends(rate_limited), Depends(token_prompts_fit)])
async def completions(req: CompletionRequest, request: Request) -> GenerationResponse:
    limits(request).check_choices(req.n, len(req.prompts), "prompt")
    limits(request).check_stops(req.stop_strings)
    context = await model_context(request, req.model)
    check_top_logprobs(req.logprobs, context, "logprobs")
    guide = extension_guide(req)
    check_logprobs_meaning(engine_sampling(req, guide), req.logprobs is not None, context.log_probs, "logprobs")
    await check_guides(request.app.state, context.engine, guide)  # compiles, or a 400, before any engine
    prompts: list[list[int]] = []
    for prompt in req.prompts:
        if isinstance(prompt, str):
            check_fits_context(prompt, context, "prompt")
            prompts.append(await off_loop(request, context.tokenizer.encode_prompt, prompt))
        else:
            check_token_ids(prompt, context, "prompt")
            prompts.append(list(prompt))
    if any(not p for p in prompts):
        raise invalid_request("prompt must not be empty", "prompt")
    generation = await new_generation(request, req, context, prompts, req.logprobs, "prompt", guide)
    echo = ({job.index: await off_loop(request, context.tokenizer.decode, job.request.prompt_ids)
             for job in generation.jobs} if req.echo else {})
    renderer = CompletionRenderer(context.served_model_name, req.logprobs, context.tokenizer, echo)
    return GenerationResponse(generation, renderer, stream=req.stream, include_usage=req.include_usage,
                              request_id=request_context(request).request_id)
