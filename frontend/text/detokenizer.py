"""Incremental detokenization: turn a growing list of token ids into text deltas.

Decoding each new token on its own loses the leading spaces of SentencePiece tokenizers and splits
multi-byte characters (CJK, emoji) across tokens into U+FFFD. Instead we decode a short window of
tokens ending at the newest one and emit only what the window adds to the text of its prefix; while the
newest text ends in an incomplete character (U+FFFD), nothing is emitted and the window grows. Joined,
the deltas are exactly the text of the whole sequence, which is what makes streamed text equal the
non-streamed text.
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"

# How many already-emitted tokens to decode again as context for the next ones (enough for any
# tokenizer's merge of a leading space or a byte-fallback sequence).
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], prompt_tail: list[int] | None = None,
                 decode_one: Callable[[int], str] | None = None):
        """`decode` maps ids to text (special tokens already skipped); `prompt_tail` gives context so the
        first generated token decodes as it would mid-text. `decode_one` is `decode` of a single id, which
        the caller may memoize: one token at a time, the text before each new token is the previous token
        alone, so a memo saves one of the two decodes per token."""
        self._decode = decode
        self._decode_one = decode_one or (lambda token_id: decode([token_id]))
        self.tokens: list[int] = list(prompt_tail or [])[-CONTEXT_TOKENS:]
        self._prefix_offset = 0
        self._read_offset = len(self.tokens)

    def _prefix_text(self) -> str:
        """The text of the tokens already emitted that the window keeps as context."""
        start, end = self._prefix_offset, self._read_offset
        return self._decode_one(self.tokens[start]) if end - start == 1 else self._decode(self.tokens[start:end])

    def add(self, new_tokens: list[int]) -> str:
        """Append tokens; return the text they complete (maybe empty, held back)."""
        self.tokens.extend(new_tokens)
        prefix_text = self._prefix_text()
        full_text = self._decode(self.tokens[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset = max(self._read_offset, len(self.tokens) - CONTEXT_TOKENS)
        self._read_offset = len(self.tokens)
        return delta

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back (an incomplete character stays U+FFFD)."""
        prefix_text = self._prefix_text()
        full_text = self._decode(self.tokens[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self.tokens)
        return full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""
