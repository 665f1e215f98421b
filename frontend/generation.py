"""From prompt ids to text deltas: the one code path behind chat and completions, streamed or not.

Streaming and non-streaming responses are both built from the deltas this yields, so the streamed
pieces joined are exactly the non-streamed text, by construction. Each choice (`n`, several prompts) is
its own engine request; `merge_choices` interleaves them for one SSE stream.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Protocol

from frontend.errors import invalid_request
from frontend.schemas import SamplingFields
from frontend.stop_strings import StopStringMatcher
from frontend.tokenizer import Tokenizer
from frontend.triton_engine import SamplingOptions, TritonEngine


@dataclass(frozen=True)
class TokenInfo:
    token_id: int
    logprob: float | None  # None unless logprobs were asked for
    top: list[tuple[int, float]]


@dataclass
class TextDelta:
    text: str
    finish_reason: str | None = None  # set on the last delta only
    tokens: list[TokenInfo] = field(default_factory=list)  # the tokens whose text this delta completes


@dataclass
class UsageCounter:
    prompt_tokens: int
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass(frozen=True)
class ChoiceJob:
    """One engine request: a prompt, its sampling options and its `index` among the choices."""

    index: int
    prompt_ids: list[int]
    options: SamplingOptions


def resolve_max_tokens(prompt_len: int, requested: int | None, context_length: int) -> int:
    """Default to what is left of the context (not a tiny fixed number); refuse what cannot fit."""
    if requested is None:
        if prompt_len >= context_length:
            raise invalid_request(
                f"This model's maximum context length is {context_length} tokens. However, your prompt "
                f"has {prompt_len} tokens, leaving no room for a completion. Please reduce the length of "
                "the prompt.", param="messages", code="context_length_exceeded")
        return context_length - prompt_len
    if prompt_len + requested > context_length:
        raise invalid_request(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the "
            "completion). Please reduce the length of the messages or completion.",
            param="max_tokens", code="context_length_exceeded")
    return requested


def choice_jobs(req: SamplingFields, prompts: list[list[int]], context_length: int, tokenizer: Tokenizer,
                top_logprobs: int | None) -> list[ChoiceJob]:
    """`n` jobs per prompt, indexed prompt-major as OpenAI does. With a seed, choice j uses seed + j so
    that the n choices differ yet the request stays reproducible. `top_logprobs` is None when the
    request wants no log-probabilities, else how many alternatives per token (0: the sampled token's only)."""
    jobs = []
    for p, prompt_ids in enumerate(prompts):
        max_tokens = resolve_max_tokens(len(prompt_ids), req.requested_max_tokens, context_length)
        base = SamplingOptions(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            min_tokens=min(req.min_tokens, max_tokens),
            # ignore_eos: an end id no token can have, so generation runs to max_tokens
            end_id=tokenizer.vocab_size if req.ignore_eos else tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            logprobs=top_logprobs is not None,
            top_logprobs=top_logprobs or 0,
        )
        for j in range(req.n):
            seed = None if req.seed is None else (req.seed + j) % 2**63
            jobs.append(ChoiceJob(p * req.n + j, prompt_ids, replace(base, seed=seed)))
    return jobs


async def generate_text(engine: TritonEngine, tokenizer: Tokenizer, request_id: str, job: ChoiceJob,
                        stop: list[str], usage: UsageCounter, streaming: bool,
                        timing: TokenTimer | None = None) -> AsyncIterator[TextDelta]:
    """Yield text deltas (never empty, never part of a stop string), the last with its finish reason.
    `timing.tokens(n)` is told of each engine chunk's tokens as they arrive (TTFT, inter-token latency)."""
    detok = tokenizer.detokenizer(job.prompt_ids)
    matcher = StopStringMatcher(stop)
    pending: list[TokenInfo] = []
    generated = 0
    chunks = engine.generate(request_id, job.prompt_ids, job.options, streaming)
    try:
        async for chunk in chunks:
            generated += len(chunk.token_ids)
            usage.completion_tokens += len(chunk.token_ids)
            if timing is not None:
                timing.tokens(len(chunk.token_ids))
            logprobs = chunk.logprobs or [None] * len(chunk.token_ids)
            pending += [TokenInfo(t, lp, top) for t, lp, top in zip(chunk.token_ids, logprobs, chunk.top)]
            text, stopped = matcher.feed(detok.add(chunk.token_ids))
            if stopped:
                yield TextDelta(text, "stop", pending)
                return
            if text:
                yield TextDelta(text, None, pending)
                pending = []
    finally:
        await chunks.aclose()  # cancels the Triton request if it is still running
    text, stopped = matcher.feed(detok.flush())
    if not stopped:
        text += matcher.flush()
    finish = "length" if generated >= job.options.max_tokens and not stopped else "stop"
    yield TextDelta(text, finish, pending)


class TokenTimer(Protocol):
    def tokens(self, count: int) -> None: ...


_END = object()


async def merge_choices(streams: dict[int, AsyncIterator[TextDelta]]) -> AsyncIterator[tuple[int, TextDelta]]:
    """Interleave several choices' deltas as they come. Closing this closes (and cancels) them all."""
    if len(streams) == 1:  # the common case needs no tasks
        (index, stream), = streams.items()
        try:
            async for delta in stream:
                yield index, delta
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[TextDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
            await queue.put((index, _END))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in streams.items()]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams.values():
            await stream.aclose()
