"""The two OpenAI logprobs shapes, built from the engine's per-token log-probabilities.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.
A token's `token` is the text it decodes to on its own. Its `bytes` are the token's own raw bytes
(`tokenizer.token_bytes`, see frontend.text.token_bytes), not that text's UTF-8: a token holding part of a
multi-byte character decodes to U+FFFD on its own, while OpenAI's contract is that the entries' bytes
joined are the response text's UTF-8.
"""

from __future__ import annotations

from typing import Any, Protocol

from frontend.generation.serving import TokenInfo


class TokenStrings(Protocol):
    """What logprobs need of a tokenizer (frontend.text.tokenizer.Tokenizer, or a test's fake)."""

    def token_text(self, token_id: int) -> str:
        """The token's text on its own (special tokens included): OpenAI's `token`."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own raw bytes (part of a character where it splits one): OpenAI's `bytes`."""
        ...


def _entry(tokenizer: TokenStrings, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": tokenizer.token_text(token_id), "logprob": logprob,
            "bytes": list(tokenizer.token_bytes(token_id))}


def chat_logprobs(tokens: list[TokenInfo], tokenizer: TokenStrings, top_n: int) -> dict[str, Any]:
    return {"content": [
        {**_entry(tokenizer, t.token_id, t.logprob),
         "top_logprobs": [_entry(tokenizer, alt, lp) for alt, lp in t.top[:top_n]]}
        for t in tokens
    ]}


def completion_logprobs(tokens: list[TokenInfo], tokenizer: TokenStrings, top_n: int,
                        text_offset: int) -> tuple[dict[str, Any], int]:
    """Return the logprobs object and the text offset after its last token (for the next chunk)."""
    texts, offsets = [], []
    for t in tokens:
        offsets.append(text_offset)
        texts.append(tokenizer.token_text(t.token_id))
        text_offset += len(texts[-1])
    top = [{tokenizer.token_text(alt): lp for alt, lp in t.top[:top_n]} for t in tokens] if top_n else None
    return {"tokens": texts, "token_logprobs": [t.logprob for t in tokens], "top_logprobs": top,
            "text_offset": offsets}, text_offset
