"""Each token id's own raw bytes, for the `bytes` field of OpenAI chat logprobs.

OpenAI defines `logprobs.content[i].bytes` as the token's UTF-8 bytes, so that the entries' bytes joined
are the response text's UTF-8 even where one token holds part of a multi-byte character (你 = E4 BD A0
may come as [E4] then [BD A0]). Decoding the single token and encoding its text cannot give that: the
text of a partial character is U+FFFD, whose bytes are EF BF BD. So the bytes come from the vocabulary
itself, read the way the tokenizer's own decoder reads it. The family is detected from the decoder
configuration (never from the model's name):

* byte-level BPE (GPT-2, Llama-3, Qwen: decoder `ByteLevel`): every vocabulary string is spelled in
  GPT-2's byte-to-unicode alphabet of 256 printable characters; mapping each character back gives the
  token's bytes. A string with a character outside that alphabet (an added token such as `<think>` whose
  characters are all in it is unaffected) decodes as its own UTF-8, exactly as the `tokenizers` decoder
  does.
* SentencePiece with byte fallback (Llama-2, Mistral, Gemma: decoder `Sequence[Replace("▁", " "),
  ByteFallback, Fuse, Strip(" ", 1, 0)]`, or `Metaspace`): `▁` is a space and `<0xAB>` is the single raw
  byte AB; anything else is the string's UTF-8.
* other decoders made only of the steps above and `Fuse` / `Strip` ("plain"): interpreted the same way.
* special tokens: their content's UTF-8 (`<|im_end|>`), as OpenAI shows special tokens. Non-special added
  tokens go through the decoder like vocabulary tokens, because that is how they appear in the text.
* anything else (a WordPiece or CTC decoder, a regex Replace, no decoder, a tokenizer with no `tokenizers`
  backend): the best available is the UTF-8 of the single token's decoded text, which is exact for every
  token that holds whole characters and gives U+FFFD's bytes for one that splits a character. That
  family is reported as "decode", so callers and logs can tell.

The sequence-start space rule of SentencePiece. The encoder puts a `▁` in front of the text and the
decoder's final `Strip(" ", 1, 0)` (or `Metaspace`'s first-token rule) removes one leading space from the
*whole decoded sequence*: `▁Hello` decodes to "Hello" at the start of a sequence and to " Hello" after
any other token. A token's bytes here are context-free, the token's own: `▁Hello` is b" Hello". That
matches the response text because the frontend never decodes generated tokens at the start of a
sequence: `frontend.text.detokenizer.IncrementalDetokenizer` decodes them after a few tokens of prompt
context, so a generated `▁Hello` reads " Hello" in the text too, and the bytes of all entries join to
exactly the text's UTF-8. The one case where they cannot agree is a prompt with no non-special token at
all (e.g. only `<s>`): the decoder then strips the first generated token's space from the text, and the
bytes keep it (one extra leading 0x20). For comparison, vLLM's `bytes` are
`token.encode("utf-8", errors="replace")` of the token's decoded text, so split characters come out as
EF BF BD there; OpenAI's own tokenizers are byte-level and have no leading-space rule.

Special tokens. The frontend's text skips special tokens, so a special token generated mid-text (the end
token never is: the engine stops on it without emitting it) shows its content in `bytes` but nothing in
the text; only then do the joined bytes hold more than the text, as OpenAI lists special tokens too.

The table is built once per tokenizer (at model load, in the frontend's loader thread), in one pass over
the vocabulary: measured on a 2-core machine, the demo tokenizer's 4,096 entries take 4-6 ms, and
synthetic 150k-entry byte-level and SentencePiece vocabularies about 0.23 s (`id_to_token` over the ids
is about half of that; `get_vocab()` alone would take longer). The "decode" fallback is filled lazily
instead, one decoder call per token id the first time it is asked for.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Union

BYTE_LEVEL = "byte_level"
SENTENCEPIECE = "sentencepiece"
PLAIN = "plain"
DECODE = "decode"

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>\Z")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-unicode alphabet: byte value -> the printable character that spells it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_level_table() -> dict[int, int]:
    """A `str.translate` table: alphabet characters -> chr(their byte), so `.encode("latin-1")` yields the
    bytes; every other character below 256 -> U+0100, so that encoding fails and the caller falls back
    to the string's UTF-8 (as the `tokenizers` ByteLevel decoder does for a token outside the alphabet)."""
    table = {ord(ch): byte for byte, ch in bytes_to_unicode().items()}
    for code in range(256):
        table.setdefault(code, 0x100)
    return table


_BYTE_LEVEL_TRANSLATION = _byte_level_table()

# One decoding step applied to one token: it maps the token's value (a string until a step turns it into
# raw bytes) to a new value.
Piece = Union[str, bytes]
Step = Callable[[Piece], Piece]


def _byte_level(piece: Piece) -> Piece:
    if isinstance(piece, bytes):
        return piece
    try:
        return piece.translate(_BYTE_LEVEL_TRANSLATION).encode("latin-1")
    except UnicodeEncodeError:
        return piece.encode("utf-8")


def _byte_fallback(piece: Piece) -> Piece:
    if isinstance(piece, str) and len(piece) == 6:
        match = _BYTE_TOKEN.match(piece)
        if match:
            return bytes((int(match.group(1), 16),))
    return piece


def _replace(pattern: str, content: str) -> Step:
    def step(piece: Piece) -> Piece:
        if isinstance(piece, bytes):
            return piece.replace(pattern.encode("utf-8"), content.encode("utf-8"))
        return piece.replace(pattern, content)
    return step


def _strip(content: str, start: int, stop: int) -> Step:
    """The `Strip` decoder on one token: up to `start` leading and `stop` trailing `content` characters."""
    def step(piece: Piece) -> Piece:
        unit: Piece = content.encode("utf-8") if isinstance(piece, bytes) else content
        for _ in range(start):
            if piece.startswith(unit):  # type: ignore[arg-type]
                piece = piece[len(unit):]
        for _ in range(stop):
            if piece.endswith(unit):  # type: ignore[arg-type]
                piece = piece[:len(piece) - len(unit)]
        return piece
    return step


@dataclass(frozen=True)
class DecoderPlan:
    """The per-token part of a decoder configuration (no steps, family "decode", if it has none)."""

    family: str
    steps: tuple[Step, ...] = ()


def plan_decoder(decoder: dict[str, Any] | None) -> DecoderPlan:
    """Read a `tokenizers` decoder configuration (its JSON as a dict) into per-token steps.

    Steps that act on the whole decoded sequence rather than on each token are left out on purpose:
    `Fuse` (joins tokens) and a `Strip` after it or after `ByteLevel` (which also joins), and
    `Metaspace`'s first-token space removal; see the module docstring for the sequence-start rule.
    An unknown step makes the whole plan the "decode" fallback.
    """
    if not decoder:
        return DecoderPlan(DECODE)  # no decoder: tokenizers joins tokens with spaces; not a per-token rule
    items = _flatten(decoder)
    steps: list[Step] = []
    joined = False  # once the tokens are joined into one, a Strip applies to the sequence, not to tokens
    kinds: set[str] = set()
    for item in items:
        kind = item.get("type")
        kinds.add(kind)
        if kind == "ByteLevel":
            steps.append(_byte_level)
            joined = True
        elif kind == "ByteFallback":
            steps.append(_byte_fallback)
        elif kind == "Replace":
            pattern = item.get("pattern", {})
            if "String" not in pattern:
                return DecoderPlan(DECODE)  # a regex pattern: not worth re-implementing
            steps.append(_replace(pattern["String"], item.get("content", "")))
        elif kind == "Metaspace":
            steps.append(_replace(item.get("replacement", "\u2581"), " "))
        elif kind == "Fuse":
            joined = True
        elif kind == "Strip":
            if not joined:
                steps.append(_strip(item.get("content", " "), int(item.get("start", 0)), int(item.get("stop", 0))))
        else:
            return DecoderPlan(DECODE)
    if "ByteLevel" in kinds:
        family = BYTE_LEVEL
    elif kinds & {"ByteFallback", "Metaspace"} or any(
            item.get("type") == "Replace" and item.get("pattern", {}).get("String") == "\u2581" for item in items):
        family = SENTENCEPIECE
    else:
        family = PLAIN
    return DecoderPlan(family, tuple(steps))


def _flatten(decoder: dict[str, Any]) -> list[dict[str, Any]]:
    """A decoder's steps in order, nested `Sequence`s expanded (they apply their members in turn)."""
    if decoder.get("type") != "Sequence":
        return [decoder]
    return [step for member in decoder.get("decoders", []) for step in _flatten(member)]


def apply_plan(plan: DecoderPlan, token: str) -> bytes:
    """One vocabulary string's bytes under `plan` (not for the "decode" family)."""
    piece: Piece = token
    for step in plan.steps:
        piece = step(piece)
    return piece if isinstance(piece, bytes) else piece.encode("utf-8")


class TokenBytes:
    """token id -> the token's own bytes; see the module docstring for what "own" means per family.

    Ids inside the eagerly built table are answered from it (b"" for a hole: the decoder gives "" for an
    id the vocabulary lacks). Ids past it, which is every id for the "decode" family, are looked up once
    with `decode_one` (the single token's decoded text) and cached; negative ids give b"".
    """

    def __init__(self, family: str, table: list[bytes | None], decode_one: Callable[[int], str],
                 special: dict[int, bytes] | None = None):
        self.family = family
        self._table = table
        self._decode_one = decode_one
        self._special = special or {}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        if 0 <= token_id < len(self._table):
            value = self._table[token_id]
            return value if value is not None else b""
        if token_id < 0:
            return b""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._special.get(token_id)
            if cached is None:
                try:
                    cached = self._decode_one(token_id).encode("utf-8")
                except Exception:  # an id the tokenizer cannot decode at all: no bytes, like a hole
                    cached = b""
            self._cache[token_id] = cached  # a race between threads only computes the same value twice
        return cached

    def __len__(self) -> int:
        """How many ids the eager table covers (0 for the "decode" family)."""
        return len(self._table)


def build_token_bytes(tokenizer: Any) -> TokenBytes:
    """The token-bytes lookup for a Hugging Face tokenizer.

    `tokenizer` is a `transformers` fast tokenizer (its `backend_tokenizer` is read) or a
    `tokenizers.Tokenizer`. A tokenizer without a `tokenizers` backend, or with a decoder we cannot read
    per token, gets the "decode" fallback (the UTF-8 of each single token's decoded text).
    """
    backend = _backend(tokenizer)
    decode_one = _single_token_decoder(tokenizer, backend)
    if backend is None:
        return TokenBytes(DECODE, [], decode_one)
    added = backend.get_added_tokens_decoder()
    special = {i: t.content.encode("utf-8") for i, t in added.items() if t.special}
    decoder_state = backend.decoder.__getstate__() if backend.decoder is not None else None
    plan = plan_decoder(json.loads(decoder_state) if decoder_state else None)
    if plan.family == DECODE:
        return TokenBytes(DECODE, [], decode_one, special)
    # id_to_token over the id range is the quickest way to the vocabulary (150k ids: ~0.1 s, about half
    # of get_vocab()'s time). Ids past the range (a vocabulary with holes) are decoded lazily.
    size = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
    table: list[bytes | None] = []
    for token_id in range(size):
        token = backend.id_to_token(token_id)
        table.append(None if token is None else apply_plan(plan, token))
    for token_id, content in special.items():
        table[token_id] = content
    return TokenBytes(plan.family, table, decode_one, special)


def _backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind `tokenizer`, or None if it has none."""
    try:
        from tokenizers import Tokenizer as BackendTokenizer
    except ImportError:  # pragma: no cover - tokenizers is a pinned dependency of the frontend
        return None
    if isinstance(tokenizer, BackendTokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, BackendTokenizer) else None


def _single_token_decoder(tokenizer: Any, backend: Any | None) -> Callable[[int], str]:
    if backend is not None and tokenizer is backend:
        return lambda token_id: backend.decode([token_id], skip_special_tokens=False)
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False,
                                             clean_up_tokenization_spaces=False)
