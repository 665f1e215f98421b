"""From prompt ids to text deltas: the one code path behind chat and completions, streamed or not.

Streaming and non-streaming responses are both built from the deltas this yields, so the streamed
pieces joined are exactly the non-streamed text, by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from frontend.errors import invalid_request
from frontend.stop_strings import StopStringMatcher
from frontend.tokenizer import Tokenizer
from frontend.triton_engine import SamplingOptions, TritonEngine
from frontend.schemas import SamplingFields


@dataclass
class TextDelta:
    text: str
    finish_reason: str | None = None  # set on the last delta only


@dataclass
class UsageCounter:
    prompt_tokens: int
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


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


def sampling_options(req: SamplingFields, max_tokens: int, tokenizer: Tokenizer) -> SamplingOptions:
    return SamplingOptions(
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
    )


async def generate_text(engine: TritonEngine, tokenizer: Tokenizer, request_id: str,
                        prompt_ids: list[int], options: SamplingOptions, stop: list[str],
                        usage: UsageCounter, streaming: bool) -> AsyncIterator[TextDelta]:
    """Yield text deltas (never empty, never part of a stop string), the last with its finish reason."""
    detok = tokenizer.detokenizer(prompt_ids)
    matcher = StopStringMatcher(stop)
    chunks = engine.generate(request_id, prompt_ids, options, streaming)
    try:
        async for chunk in chunks:
            usage.completion_tokens += len(chunk.token_ids)
            text, stopped = matcher.feed(detok.add(chunk.token_ids))
            if stopped:
                yield TextDelta(text, "stop")
                return
            if text:
                yield TextDelta(text)
    finally:
        await chunks.aclose()  # cancels the Triton request if it is still running
    text, stopped = matcher.feed(detok.flush())
    if not stopped:
        text += matcher.flush()
    finish = "length" if usage.completion_tokens >= options.max_tokens and not stopped else "stop"
    yield TextDelta(text, finish)
