"""HTTP routes of the Responses API: parse, hand to the Responses service (frontend/responses_api/), return.

A response is planned, tokenized and admitted with the chat route's own steps (frontend/http/routes.py):
the same chat plan, guide check, chat template and admission, so a Responses prompt is exactly the chat
prompt of the same conversation. A background response takes its own budget (admission slot, tokens per
minute, the model version's lease, a deadline that shutdown aborts), detached from the HTTP request,
which returns at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from frontend.generation.serving import Generation
from frontend.http.json_body import OffLoopJSONRoute
from frontend.http.middleware import RequestContext
from frontend.http.request_budget import RequestBudget
from frontend.http.routes import (check_fits_context, check_top_logprobs, lists_fit, model_context, new_generation,
                                  off_loop, rate_limited, request_context)
from frontend.models.registry import ModelContext
from frontend.api_types.request_bodies import ChatCompletionRequest
from frontend.planning.chat_plan import ChatPlan
from frontend.planning.guide_check import check_guides
from frontend.planning.logprob_rules import check_logprobs_meaning
from frontend.planning.sampling import engine_sampling
from frontend.policy.deadlines import Deadline
from frontend.http.responses_asgi import FollowResponse, ForegroundResponse
from frontend.responses_api.conversation import drop_oldest_turns
from frontend.responses_api.request import ReasoningItem, ReasoningText, ResponsesRequest
from frontend.responses_api.sealing import ReasoningSeal, reasoning_seal
from frontend.responses_api.service import ResponsesService, responses_params

router = APIRouter(route_class=OffLoopJSONRoute, dependencies=[Depends(rate_limited)])

CREATE_ROUTE = "/v1/responses"
RESPONSE_ROUTE = "/v1/responses/{response_id}"


def service(request: Request) -> ResponsesService:
    return request.app.state.responses


def owner(request: Request) -> str:
    """Who the request's stored responses belong to: its API key's owner id, stable across restarts and
    workers ("" on a server without keys)."""
    return request_context(request).owner


@dataclass(frozen=True)
class PlannedPrompt:
    prompt_ids: list[int]
    plan: ChatPlan
    top_logprobs: int | None


async def planned_prompt(request: Request, chat: ChatCompletionRequest, messages: list[dict[str, Any]],
                         context: ModelContext, truncation: str) -> PlannedPrompt:
    """The chat route's steps up to the prompt: log-probs checks, the chat plan, its guide compiled, the
    template rendered (a 400 naming the field for each). `truncation: auto` drops the oldest turns of a
    conversation that does not fit (prompt and max_output_tokens) in the model's context."""
    with responses_params():
        check_top_logprobs(chat.num_top_logprobs, context, "top_logprobs")
        plan = ChatPlan.build(chat, context)
        check_logprobs_meaning(engine_sampling(chat, plan.guide), chat.logprobs, context.log_probs, "include")
        await check_guides(request.app.state, context.engine, plan.guide, plan.guide_parts)

        async def render(conversation: list[dict[str, Any]]) -> list[int]:
            return await off_loop(request, context.tokenizer.apply_chat_template, conversation, plan.template_tools)

        def fits(ids: list[int]) -> bool:
            return len(ids) + (chat.requested_max_tokens or 1) <= context.context_length

        if truncation == "disabled":
            check_fits_context("".join(m["content"] for m in messages), context, "input")
        prompt_ids = await render(messages)
        if truncation == "auto" and not fits(prompt_ids):
            prompt_ids = (await drop_oldest_turns(messages, render, fits) or (messages, prompt_ids))[1]
    return PlannedPrompt(prompt_ids, plan.for_prompt(context.tokenizer, prompt_ids),
                         chat.num_top_logprobs if chat.logprobs else None)


async def generation_of(request: Request, chat: ChatCompletionRequest, context: ModelContext,
                        planned: PlannedPrompt) -> Generation:
    with responses_params():
        return await new_generation(request, chat, context, [planned.prompt_ids], planned.top_logprobs, "input",
                                    planned.plan.guide, planned.plan.parsing)


def detached(request: Request, context: ModelContext) -> tuple[Request, Callable[[], None]]:
    """A request of its own for a background run: its record and budget (slots, tokens, the version's
    lease, taken now), a deadline shutdown aborts; and what gives them all back when the run ends."""
    ctx, edge, settings = request_context(request), request.app.state.edge, request.app.state.settings
    record = RequestContext(ctx.request_id, CREATE_ROUTE, "POST", time.monotonic(), key_id=ctx.key_id,
                            deadline=Deadline(settings.request_timeout_s), model=ctx.model,
                            model_version=ctx.model_version)
    budget = record.budget = RequestBudget(edge, record)
    if context.engine is not None:
        budget.lease(context.engine)
    edge.deadlines.add(record.deadline)
    scope = {"type": "http", "app": request.app, "method": "POST", "path": CREATE_ROUTE, "headers": [],
             "query_string": b"", "state": {"ctx": record, "budget": budget}}

    def release() -> None:
        budget.close()
        edge.deadlines.discard(record.deadline)

    return Request(scope), release


def seal_of(request: Request) -> ReasoningSeal:
    """The seal of encrypted reasoning, made from the settings' keys on first use in this process."""
    state = request.app.state
    seal = getattr(state, "reasoning_seal", None)
    if seal is None:
        seal = state.reasoning_seal = reasoning_seal(state.settings)
    return seal


def open_reasoning(req: ResponsesRequest, seal: ReasoningSeal) -> ResponsesRequest:
    """The request with each sealed reasoning item's text opened into its `content` (what the prompt renders);
    a blob this server did not seal, or one altered, is a 400 naming `input`."""
    if not isinstance(req.input, list) or not any(isinstance(item, ReasoningItem) and item.encrypted_content
                                                  for item in req.input):
        return req
    items = [item.model_copy(update={"content": [ReasoningText(
                 type="reasoning_text", text=seal.open(item.encrypted_content, f"input.{i}"))]})
             if isinstance(item, ReasoningItem) and item.encrypted_content else item
             for i, item in enumerate(req.input)]
    return req.model_copy(update={"input": items})


@router.post(CREATE_ROUTE, dependencies=[Depends(lists_fit)])
async def create_response(req: ResponsesRequest, request: Request) -> Response:
    caller = owner(request)  # the edge gave the request its deadline, as it gives chat and completions theirs
    responses = service(request)
    req = open_reasoning(req, seal_of(request))
    context = await model_context(request, req.model)
    prepared, chat, messages = await responses.prepare(req, caller, context.context_length)
    planned = await planned_prompt(request, chat, messages, context, req.truncation)
    run = responses.run(prepared, context.served_model_name, context.tokenizer)
    run.assembler.configure(req.offered_tools, req.chosen_tool,
                            seal_of(request).seal if req.wants_encrypted_reasoning else None)
    request_id = request_context(request).request_id
    if req.background:
        background, release = detached(request, context)
        await responses.start_background(run, lambda: generation_of(background, chat, context, planned), release)
        if req.stream:
            return FollowResponse(await responses.follow(caller, run.id, None), request_id=request_id)
        return JSONResponse(run.response())
    generation = await generation_of(request, chat, context, planned)
    run.begin()
    return ForegroundResponse(run, generation, lambda: responses.save_final(run), request_id=request_id)


@router.get(RESPONSE_ROUTE)
async def get_response(response_id: str, request: Request, stream: bool = False,
                       starting_after: int | None = Query(None, ge=-1)) -> Response:
    caller = owner(request)
    if stream:
        events = await service(request).follow(caller, response_id, starting_after)
        return FollowResponse(events, request_id=request_context(request).request_id)
    return JSONResponse(await service(request).get(caller, response_id))


@router.get(RESPONSE_ROUTE + "/input_items")
async def list_input_items(response_id: str, request: Request, after: str | None = Query(None, max_length=128),
                           limit: int = Query(20, ge=1, le=100),
                           order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
    caller = owner(request)
    return await service(request).input_items(caller, response_id, after, limit, order)


@router.delete(RESPONSE_ROUTE)
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    return await service(request).delete(owner(request), response_id)


@router.post(RESPONSE_ROUTE + "/cancel")
async def cancel_response(response_id: str, request: Request) -> dict[str, Any]:
    return await service(request).cancel(owner(request), response_id)
