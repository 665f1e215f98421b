"""The two OpenAI logprobs shapes, built from the engine's per-token log-probabilities.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.
A token's text is what it decodes to on its own; `bytes` is that text's UTF-8 encoding.
"""

from __future__ import annotations

from typing import Any, Callable

from frontend.generation import TokenInfo

TokenText = Callable[[int], str]


def _entry(token_text: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokens: list[TokenInfo], token_text: TokenText, top_n: int) -> dict[str, Any]:
    return {"content": [
        {**_entry(token_text, t.token_id, t.logprob),
         "top_logprobs": [_entry(token_text, alt, lp) for alt, lp in t.top[:top_n]]}
        for t in tokens
    ]}


def completion_logprobs(tokens: list[TokenInfo], token_text: TokenText, top_n: int,
                        text_offset: int) -> tuple[dict[str, Any], int]:
    """Return the logprobs object and the text offset after its last token (for the next chunk)."""
    texts, offsets = [], []
    for t in tokens:
        offsets.append(text_offset)
        texts.append(token_text(t.token_id))
        text_offset += len(texts[-1])
    top = [{token_text(alt): lp for alt, lp in t.top[:top_n]} for t in tokens] if top_n else None
    return {"tokens": texts, "token_logprobs": [t.logprob for t in tokens], "top_logprobs": top,
            "text_offset": offsets}, text_offset
