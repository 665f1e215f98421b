"""The serving layer: one OpenAI generation request as engine requests, and their tokens back as text.

HTTP stays in routes.py and responses.py, engine conventions behind `LLMEngine`; what is here is the
generation path both chat and completions share, streamed or not:
- every choice (`n`, several prompts) is its own engine request, with an id this server makes;
- tokens are read one at a time from the engine whatever the client asked for, so a stop string ends
  the engine request at the token that completes it, and usage and logprobs count exactly the tokens
  up to there;
- the choices of a request run in one task group: one failure cancels the others and their engine
  requests, and so does the request's deadline or the client leaving.
Streamed and non-streamed responses are built from the same deltas, so the streamed pieces joined are
the non-streamed text by construction.
"""

from __future__ import annotations

import secrets
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Awaitable, Callable, NamedTuple, Protocol

import anyio

from frontend.generation.engine import BufferBudget, EngineRequest, Guide, LLMEngine, SamplingOptions, TokenChunk
from frontend.api_types.errors import OpenAIError, engine_error, invalid_request
from frontend.parsing.reasoning import ReasoningParser
from frontend.api_types.request_bodies import SamplingFields
from frontend.generation.stop_strings import StopStringMatcher
from frontend.text.tokenizer import Tokenizer
from frontend.parsing.tool_parsers import ToolCall, ToolCallDelta, ToolCallParser


class TokenInfo(NamedTuple):
    """One generated token and its log-probabilities. A named tuple: one is built per token (see TokenChunk)."""

    token_id: int
    logprob: float | None  # None unless logprobs were asked for
    top: list[tuple[int, float]]


@dataclass
class TextDelta:
    text: str  # the answer's text (chat: its `content`)
    finish_reason: str | None = None  # set on the last delta only
    tokens: list[TokenInfo] = field(default_factory=list)  # the tokens whose text this delta completes
    reasoning: str = ""  # chat with a reasoning parser: what the model thought, apart from `text`
    tool_calls: tuple[ToolCallDelta, ...] = ()  # chat with a tool-call parser: calls, taken out of `text`


@dataclass
class ChoiceResult:
    """A whole choice, for non-streamed responses: its deltas joined."""

    text: str = ""
    finish_reason: str = "stop"
    tokens: list[TokenInfo] = field(default_factory=list)
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, delta: TextDelta) -> None:
        self.text += delta.text
        self.reasoning += delta.reasoning
        self.tokens += delta.tokens
        for call in delta.tool_calls:
            if call.index == len(self.tool_calls):
                self.tool_calls.append(ToolCall(call.name or "", ""))
            previous = self.tool_calls[call.index]
            self.tool_calls[call.index] = ToolCall(previous.name, previous.arguments + call.arguments)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


@dataclass
class UsageCounter:
    prompt_tokens: int
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass(frozen=True)
class ChoiceJob:
    """One engine request and its `index` among the request's choices."""

    index: int
    request: EngineRequest


class TokenTimer(Protocol):
    def tokens(self, count: int) -> None: ...

    def close(self) -> None:
        """The request's last token has come (or never will)."""


class RequestHooks(Protocol):
    """What the HTTP edge wants to know of a generation (frontend.http.request_budget.RequestBudget)."""

    def bounded(self, awaitable: Awaitable[None]) -> Awaitable[None]:
        """Await under the request's deadline (504) and the server's shutdown (503)."""
        ...

    def timer(self) -> TokenTimer | None: ...

    def record_delta(self, delta: TextDelta) -> None: ...

    def record_failure(self, error: OpenAIError) -> None: ...


# ----- from a request to engine requests -------------------------------------------------------------------
def resolve_max_tokens(prompt_len: int, requested: int | None, context_length: int, prompt_param: str) -> int:
    """Default to what is left of the context (not a tiny fixed number); refuse what cannot fit."""
    if requested is None:
        if prompt_len >= context_length:
            raise invalid_request(
                f"This model's maximum context length is {context_length} tokens. However, your prompt "
                f"has {prompt_len} tokens, leaving no room for a completion. Please reduce the length of "
                "the prompt.", param=prompt_param, code="context_length_exceeded")
        return context_length - prompt_len
    if prompt_len + requested > context_length:
        raise invalid_request(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {prompt_param}, {requested} in the "
            f"completion). Please reduce the length of the {prompt_param} or completion.",
            param="max_tokens", code="context_length_exceeded")
    return requested


def new_engine_request_id() -> str:
    return uuid.uuid4().hex


def choice_jobs(req: SamplingFields, prompts: list[list[int]], context_length: int, tokenizer: Tokenizer,
                top_logprobs: int | None, prompt_param: str, guide: Guide | None = None,
                buffer_bytes: int = 0) -> list[ChoiceJob]:
    """`n` jobs per prompt, indexed prompt-major as OpenAI does. With a seed, choice j uses seed + j so
    that the n choices differ yet the request stays reproducible. Without one, every choice gets a fresh
    random seed: an engine request always carries one, because TensorRT-LLM seeds a request that has none
    with 0 (llmRequest.cpp createChildRequest; TensorRT-LLM #1000, #2411), which would make every unseeded
    sample of a prompt the same. `top_logprobs` is None when the request wants no log-probabilities, else
    how many alternatives per token (0: the sampled token's only). `buffer_bytes` (0: no limit): the engine
    output all the jobs together may hold for a client that does not read it (BufferBudget)."""
    jobs = []
    buffer = BufferBudget(buffer_bytes) if buffer_bytes else None
    for p, prompt_ids in enumerate(prompts):
        max_tokens = resolve_max_tokens(len(prompt_ids), req.requested_max_tokens, context_length, prompt_param)
        base = SamplingOptions(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            # With no end id min_tokens holds nothing back, and TensorRT-LLM would mask logits[-1] (audit R1).
            min_tokens=min(req.min_tokens, max_tokens) if tokenizer.eos_token_id is not None else 0,
            eos_token_id=tokenizer.eos_token_id,
            extra_end_ids=tuple(i for i in tokenizer.end_token_ids if i != tokenizer.eos_token_id),
            pad_token_id=tokenizer.pad_token_id,
            ignore_eos=req.ignore_eos,
            logprobs=top_logprobs is not None,
            top_logprobs=top_logprobs or 0,
            guide=guide,
        )
        for j in range(req.n):
            seed = secrets.randbits(63) if req.seed is None else (req.seed + j) % 2**63
            options = replace(base, seed=seed)
            jobs.append(ChoiceJob(p * req.n + j, EngineRequest(new_engine_request_id(), prompt_ids, options, buffer=buffer)))
    return jobs


# ----- one choice ----------------------------------------------------------------------------------------
def token_infos(chunk: TokenChunk, options: SamplingOptions) -> list[TokenInfo]:
    """One entry per token, with the log-probabilities asked for; an engine that answers with fewer or more
    log-probabilities than tokens is an engine error, never silently truncated."""
    if not options.logprobs and not options.top_logprobs:  # the common case
        return [TokenInfo(token, None, []) for token in chunk.token_ids]
    count = len(chunk.token_ids)
    logprobs: list[float | None] = [None] * count
    top: list[list[tuple[int, float]]] = [[] for _ in range(count)]
    if options.logprobs:
        if chunk.logprobs is None or len(chunk.logprobs) != count:
            got = "none" if chunk.logprobs is None else len(chunk.logprobs)
            raise engine_error(f"the engine returned {got} log-probabilities for {count} tokens")
        logprobs = list(chunk.logprobs)
    if options.top_logprobs:
        if chunk.top is None or len(chunk.top) != count:
            raise engine_error(f"the engine returned no top log-probabilities for {count} tokens"
                               if chunk.top is None else
                               f"the engine returned top log-probabilities for {len(chunk.top)} of {count} tokens")
        top = chunk.top
    return [TokenInfo(token, lp, alternatives) for token, lp, alternatives in zip(chunk.token_ids, logprobs, top)]


async def generate_choice(engine: LLMEngine, tokenizer: Tokenizer, job: ChoiceJob, stop: list[str],
                          usage: UsageCounter, timer: TokenTimer | None = None,
                          markers: tuple[str, ...] = ()) -> AsyncIterator[TextDelta]:
    """Yield text deltas (never empty, never part of a stop string), the last with its finish reason.

    Tokens are taken one at a time even when the engine sends several together, so that the engine
    request ends (the iterator is closed, which stops it) at the token that completes a stop string,
    and that usage and logprobs hold exactly the tokens up to and including that one."""
    options = job.request.options
    # `markers`: special tokens kept in the text for a tool-call parser (AnswerParsing.markers)
    detokenizer = tokenizer.detokenizer(job.request.prompt_ids, markers) if markers else \
        tokenizer.detokenizer(job.request.prompt_ids)
    matcher = StopStringMatcher(stop)
    pending: list[TokenInfo] = []
    generated = 0
    # The engine ends at eos_token_id without emitting it; the other end ids it stops at after emitting them
    # (TensorRT-LLM's stop_words_list): such a token is the end, not part of the answer or its usage.
    ends = frozenset(options.extra_end_ids) if not options.ignore_eos else frozenset()
    async with aclosing(engine.generate(job.request)) as chunks:
        async for chunk in chunks:
            if timer is not None:
                timer.tokens(len(chunk.token_ids))
            for info in token_infos(chunk, options):
                if info.token_id in ends:
                    text, stopped = matcher.feed(detokenizer.flush())
                    if not stopped:
                        text += matcher.flush()
                    # The engine ends the request at this token itself (its stop_words_list): its stream is
                    # read to the end, which spares stopping it (TritonEngine.generate).
                    async for _ in chunks:
                        pass
                    yield TextDelta(text, "stop", pending)
                    return
                generated += 1
                usage.completion_tokens += 1
                pending.append(info)
                text, stopped = matcher.feed(detokenizer.add([info.token_id]))
                if stopped:
                    yield TextDelta(text, "stop", pending)
                    return
                if text:
                    yield TextDelta(text, None, pending)
                    pending = []
    text, stopped = matcher.feed(detokenizer.flush())
    if not stopped:
        text += matcher.flush()
    # The engine ends a request early only at its end-of-sequence token (an engine-side cancellation
    # arrives as an error), so an early end is a natural stop.
    finish = "length" if generated >= options.max_tokens and not stopped else "stop"
    yield TextDelta(text, finish, pending)


# ----- what the answer holds besides text: reasoning, tool calls ---------------------------------------------
@dataclass(frozen=True)
class AnswerParsing:
    """How a chat answer's text is taken apart, per choice: reasoning first (`<think>...</think>`), then
    tool calls in what remains. Each factory makes one parser per choice (parsers keep state). Which
    parsers, and how they start, is the request's chat plan's decision (frontend/planning/chat_plan.py)."""

    reasoning: Callable[[], ReasoningParser] | None = None
    tool_calls: Callable[[], ToolCallParser] | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        """The special tokens the tool-call parser finds calls after (Mistral's `[TOOL_CALLS]`, Llama 3.1's
        `<|python_tag|>`): the detokenizer drops special tokens from the text, but must keep these."""
        return tuple(getattr(self.tool_calls(), "SPECIAL_MARKERS", ())) if self.tool_calls is not None else ()

    def __bool__(self) -> bool:
        return self.reasoning is not None or self.tool_calls is not None


async def parse_answer(deltas: AsyncIterator[TextDelta], parsing: AnswerParsing) -> AsyncIterator[TextDelta]:
    """The deltas with their text split into reasoning, content and tool-call deltas, as soon as each
    part is certain; an answer that called tools ends with finish reason "tool_calls"."""
    reasoning = parsing.reasoning() if parsing.reasoning is not None else None
    tools = parsing.tool_calls() if parsing.tool_calls is not None else None
    async with aclosing(deltas):  # closing this closes the engine request at once
        async for delta in deltas:
            thought, content = reasoning.feed(delta.text) if reasoning is not None else ("", delta.text)
            if delta.finish_reason is not None and reasoning is not None:
                more_thought, more_content = reasoning.finish()
                thought, content = thought + more_thought, content + more_content
            calls: tuple[ToolCallDelta, ...] = ()
            if tools is not None:
                parsed = tools.feed(content)
                content, calls = parsed.content, parsed.tool_calls
                if delta.finish_reason is not None:
                    rest = tools.finish()
                    content, calls = content + rest.content, calls + rest.tool_calls
            finish = delta.finish_reason
            if finish == "stop" and tools is not None and tools.calls:
                finish = "tool_calls"
            yield TextDelta(content, finish, delta.tokens, thought, calls)


# ----- all the choices of one request --------------------------------------------------------------------
def first_error(group: BaseExceptionGroup) -> BaseException:
    """The error to answer with from a task group's failures: an OpenAIError if there is one."""
    errors: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        else:
            errors.append(exc)
    return next((e for e in errors if isinstance(e, OpenAIError)), errors[0])


DeltaHandler = Callable[[int, TextDelta], Awaitable[None]]


class Generation:
    """The engine requests of one HTTP request and their shared usage count."""

    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer, jobs: list[ChoiceJob], stop: list[str],
                 prompt_tokens: int, hooks: RequestHooks | None = None, parsing: AnswerParsing = AnswerParsing()):
        self.engine = engine
        self.tokenizer = tokenizer
        self.jobs = jobs
        self.stop = stop
        self.usage = UsageCounter(prompt_tokens)
        self.hooks = hooks
        self.parsing = parsing

    @property
    def indexes(self) -> list[int]:
        return [job.index for job in self.jobs]

    async def run(self, on_delta: DeltaHandler) -> None:
        """Generate every choice concurrently, handing each delta to `on_delta` as it comes. Raises the
        first failure (OpenAIError) after cancelling every other choice's engine request; cancelling the
        task that runs this (client gone) cancels them all too."""
        try:
            if self.hooks is None:
                await self._all(on_delta)
            else:
                await self.hooks.bounded(self._all(on_delta))
        except OpenAIError as exc:
            if self.hooks is not None:
                self.hooks.record_failure(exc)
            raise

    async def collect(self) -> dict[int, ChoiceResult]:
        """Every choice whole, for a non-streamed response."""
        results = {index: ChoiceResult() for index in self.indexes}

        async def add(index: int, delta: TextDelta) -> None:
            results[index].add(delta)

        await self.run(add)
        return results

    async def _all(self, on_delta: DeltaHandler) -> None:
        if len(self.jobs) == 1:  # the common case needs no tasks
            await self._choice(self.jobs[0], on_delta)
            return
        try:
            async with anyio.create_task_group() as group:
                for job in self.jobs:
                    group.start_soon(self._choice, job, on_delta)
        except BaseExceptionGroup as failures:  # the others were cancelled; answer with the first error
            raise first_error(failures) from None

    async def _choice(self, job: ChoiceJob, on_delta: DeltaHandler) -> None:
        timer = self.hooks.timer() if self.hooks is not None else None
        deltas = generate_choice(self.engine, self.tokenizer, job, self.stop, self.usage, timer,
                                 self.parsing.markers)
        if self.parsing:
            deltas = parse_answer(deltas, self.parsing)
        try:
            async with aclosing(deltas):
                async for delta in deltas:
                    if self.hooks is not None:
                        self.hooks.record_delta(delta)
                    await on_delta(job.index, delta)
        finally:
            if timer is not None:
                timer.close()


@dataclass(frozen=True)
class GenerationLimits:
    """Per-request limits of this server (settings), checked before anything reaches the engine."""

    max_n: int
    max_engine_requests: int  # prompts x n
    max_prompt_tokens: int = 0  # 0: only the context length
    max_stop_length: int = 0  # 0: no limit

    def check_choices(self, n: int, prompts: int, prompt_param: str) -> None:
        """Before any tokenization: the work one request may start is bounded (a body of thousands of
        tiny prompts is refused at once, not run under one admission slot)."""
        if n > self.max_n:
            raise invalid_request(f"n must be at most {self.max_n}", "n")
        if n * prompts > self.max_engine_requests:
            raise invalid_request(
                f"This request would start {n * prompts} generations ({prompts} prompt(s) x n={n}); this "
                f"server allows at most {self.max_engine_requests} per request.",
                prompt_param if prompts > 1 else "n", "too_many_generations")

    def check_prompts(self, prompts: list[list[int]], prompt_param: str) -> None:
        longest = max((len(p) for p in prompts), default=0)
        if self.max_prompt_tokens and longest > self.max_prompt_tokens:
            raise invalid_request(f"The prompt has {longest} tokens, more than this server's limit of "
                                  f"{self.max_prompt_tokens}.", prompt_param, "prompt_too_long")

    def check_stops(self, stops: list[str]) -> None:
        if self.max_stop_length and any(len(stop) > self.max_stop_length for stop in stops):
            raise invalid_request(f"stop sequences may be at most {self.max_stop_length} characters long", "stop")
