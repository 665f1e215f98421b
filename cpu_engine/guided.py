"""Guided decoding for the CPU engine with xgrammar, behind TensorRT-LLM's interface.

TensorRT-LLM's inputs `guided_decoding_guide_type` (json, json_schema, regex, ebnf_grammar) and
`guided_decoding_guide` select a grammar; every token of the answer is then drawn from the tokens the
grammar allows next. Three parts:

* `GuideCompiler`, one per model (built in the glue's initialize() when `guided_decoding_backend` is
  "xgrammar"): xgrammar's tokenizer description of the model (`TokenizerInfo.from_huggingface`, sized to
  the model's logits), its grammar compiler, and a bounded LRU of compiled guides keyed by (type, guide).
  The glue looks a request's guide up with `cached()` in execute(); an uncached one is compiled with
  `compile()` on the threads of cpu_engine.guide_pool.GuidePool, never on Triton's thread nor on the engine
  thread. A guide xgrammar cannot compile raises `GuideError` ("invalid guided_decoding_guide ..."), which
  the glue sends back as the request's error.
* `CompiledGuide`, what a GenerationRequest carries: the compiled grammar and the vocabulary filter that
  goes with it.
* `GuideState`, one per running sequence: the grammar matcher. The scheduler keeps one bitmask row per
  KV-cache slot (`GuideMasks`); after a step's tokens are accepted the rows of its guided sequences are
  filled for the next step, all at once, and the sampler applies them to those sequences' logits
  (xgrammar's CPU kernel) before sampling. Unguided sequences have no row and cost nothing.

What a row allows, beyond the grammar:

* Never a special token (bos, pad, chat markers ...): the demo tokenizer's added tokens look like plain
  text to xgrammar (`<|pad|>` would be allowed inside a JSON string), and the detokenizer drops them
  (skip_special_tokens), so the text would no longer be what the grammar matched.
* For json / json_schema, never a token whose bytes hold a raw control character (0x00-0x1F): strict JSON
  forbids them inside strings, and the compact JSON generated here needs none outside. xgrammar 0.2.9 still
  lets them into some strings: a free string's rule excludes them, but a string with maxLength/minLength
  becomes a repetition of "any character but quote, backslash, CR and LF"; without this filter 5 of 20
  samples of the test schema (tests/unit/test_guided.py) failed `json.loads` on the demo model (bytes 0x0F,
  0x1E, 0x09, 0x10, 0x13 inside strings), with it none. Regex and EBNF guides keep these tokens (a guide
  may want a newline).
* The request's end token (`end_id`) only where the grammar may end, and there only; with `end_id`
  absent (ignore_eos) never. A row that allows nothing else means the document is complete: the
  sequence ends there (finish reason end_id, "stop"), without another step, whatever min_tokens or
  ignore_eos ask for.

Whitespace: JSON is generated compact (xgrammar's `any_whitespace=False`: ", " and ": " separators and no
other whitespace). With the default (any whitespace between tokens) a random-weight model runs into
whitespace and never ends (0.2.9: none of 20 samples of the test schema ended within 256 tokens). `json` keeps TensorRT-LLM's meaning (xgrammar's built-in JSON grammar: an
object or an array at the top), as the JSON schema `{"type": ["object", "array"]}`, whose grammar is the
same language without the free whitespace.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import xgrammar as xgr

from cpu_engine.types import GuideStatus, RequestError

GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")
JSON_TYPES = frozenset({"json", "json_schema"})
# TensorRT-LLM's `json`: xgrammar's built-in JSON grammar (an object or an array), here without free whitespace.
ANY_JSON_SCHEMA = '{"type": ["object", "array"]}'
DEFAULT_CACHE_SIZE = 64  # a JSON schema grammar holds ~60 KB of token masks at 4k tokens, some MB at 128k


class GuideError(RequestError):
    """A guide that cannot be compiled (bad JSON schema, regex or grammar, unsupported schema feature)."""


def check_guide(guide_type: str | None, guide: str | None) -> tuple[str, str | None]:
    """The (type, guide) a request asks for, checked the way TensorRT-LLM's GuidedDecodingParams does: a
    known type, and a guide with every type but `json` (whose guide is ignored). RequestError otherwise."""
    if guide_type is None:
        raise RequestError("guided_decoding_guide was given without guided_decoding_guide_type")
    if guide_type not in GUIDE_TYPES:
        raise RequestError(f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}; got {guide_type!r}")
    if guide_type == "json":
        return guide_type, None
    if guide is None:
        raise RequestError(f"guided_decoding_guide_type {guide_type!r} needs a guided_decoding_guide")
    return guide_type, guide


# xgrammar's C++ errors start with "[hh:mm:ss] /project/cpp/file.cc:123: " and may hold a "Check failed" prefix.
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _reason(exc: Exception) -> str:
    text = _XGRAMMAR_PREFIX.sub("", str(exc).strip())
    return text or type(exc).__name__


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """A bool [vocab] tensor as an xgrammar bitmask row: int32 [ceil(vocab / 32)], bit j of word w = token 32w+j."""
    words = (allowed.numel() + 31) // 32
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[:allowed.numel()] = allowed.to(torch.int64)
    packed = (padded.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


@dataclass(frozen=True, eq=False)
class CompiledGuide:
    """A compiled grammar with the vocabulary filter of its kind (shared by every request with this guide)."""

    guide_type: str
    grammar: "xgr.CompiledGrammar"
    allowed_tokens: torch.Tensor  # bool [vocab]: tokens the filter lets through (see the module docstring)
    default_stop_ids: tuple[int, ...]  # the tokenizer's end tokens (the grammar's, when a request has no end_id)

    @property
    def vocab_size(self) -> int:
        return self.allowed_tokens.numel()

    def start(self, end_id: int | None) -> "GuideState":
        return GuideState(self, end_id)


class GuideState:
    """One sequence's grammar matcher, and its own view of the vocabulary filter: its end token cleared (the
    end is added back only where the grammar may end), and that token's bit (none with ignore_eos)."""

    def __init__(self, guide: CompiledGuide, end_id: int | None):
        stop_ids = [end_id] if end_id is not None else list(guide.default_stop_ids)
        self.matcher = xgr.GrammarMatcher(guide.grammar, override_stop_tokens=stop_ids or None)
        allowed = guide.allowed_tokens.clone()
        allowed[[t for t in stop_ids if 0 <= t < allowed.numel()]] = False
        self.filter = pack_bits(allowed)
        only_end = torch.zeros_like(guide.allowed_tokens)
        if end_id is not None:
            only_end[end_id] = True
        self.stop_bits = pack_bits(only_end)

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (the matcher is unchanged)."""
        return self.matcher.accept_token(token)


class GuideMasks:
    """The scheduler's bitmask rows, one per KV-cache slot: a guided sequence's row says what it may sample
    next. Rows are filled for all the sequences of a step at once (one call into xgrammar, then a few tensor
    operations over those rows, whatever their number)."""

    def __init__(self, rows: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.masks = xgr.allocate_token_bitmask(rows, vocab_size)
        self.filters = torch.zeros_like(self.masks)  # each slot's GuideState.filter
        self.stop_bits = torch.zeros_like(self.masks)  # each slot's GuideState.stop_bits
        self._batch = xgr.BatchGrammarMatcher()

    def start(self, state: GuideState, slot: int) -> GuideStatus:
        """A sequence takes `slot`: its filter goes there, and its first mask."""
        self.filters[slot] = state.filter
        self.stop_bits[slot] = state.stop_bits
        return self.fill([state], [slot])[0]

    def fill(self, states: list[GuideState], slots: list[int]) -> list[GuideStatus]:
        """Write the tokens each sequence may take next into its slot's row and say whether it can go on:
        the grammar's tokens, filtered; its end token where the grammar may end; COMPLETE when nothing else
        is left (the document is complete), DEAD when nothing at all is."""
        self._batch.batch_fill_next_token_bitmask([state.matcher for state in states], self.masks, slots)
        index = torch.tensor(slots)
        rows = self.masks[index] & self.filters[index]
        alive = rows.any(dim=1).tolist()
        completed = [state.matcher.is_completed() for state in states]
        if any(completed):
            rows |= self.stop_bits[index] & -torch.tensor(completed, dtype=torch.int32)[:, None]  # all ones or 0
        self.masks[index] = rows
        return [GuideStatus.OPEN if a else GuideStatus.COMPLETE if c else GuideStatus.DEAD
                for a, c in zip(alive, completed)]

    def for_batch(self, rows: list[int], slots: list[int]) -> "GuidedRows":
        return GuidedRows(rows, self.masks[torch.tensor(slots)], self.vocab_size)


@dataclass
class GuidedRows:
    """The guided rows of one sampling batch: their positions in the logits and their bitmasks [G, words]."""

    rows: list[int]
    masks: torch.Tensor
    vocab_size: int

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of the tokens the guided rows may not take to -inf, in place (xgrammar's CPU kernel);
        the other rows are not touched."""
        if self.rows == list(range(logits.shape[0])):
            bitmask = self.masks
        else:
            bitmask = torch.empty((logits.shape[0], self.masks.shape[1]), dtype=torch.int32)
            bitmask[torch.tensor(self.rows)] = self.masks
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=self.rows)


class GuideCompiler:
    """Compiles guides for one model, caching the last `cache_size` distinct (type, guide) pairs."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE, max_threads: int = 0):
        """`tokenizer`: the model's Hugging Face tokenizer; `vocab_size`: the size of the model's logits
        (the tokenizer may have fewer ids, or more that the model never emits)."""
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        threads = max_threads or min(8, len(os.sched_getaffinity(0)))
        # Our own bounded LRU instead of xgrammar's cache (unbounded by default).
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads, cache_enabled=False)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str | None], CompiledGuide] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        special |= set(self.tokenizer_info.special_token_ids)
        decoded = self.tokenizer_info.decoded_vocab
        plain = torch.tensor([bool(b) and i not in special for i, b in enumerate(decoded)], dtype=torch.bool)
        no_control = torch.tensor([not any(c < 0x20 for c in b) for b in decoded], dtype=torch.bool)
        self._allowed = {False: plain, True: plain & no_control}
        self._stop_ids = tuple(self.tokenizer_info.stop_token_ids)

    @classmethod
    def from_tokenizer_dir(cls, tokenizer_dir: str | Path, vocab_size: int, **kwargs) -> "GuideCompiler":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(tokenizer_dir)), vocab_size, **kwargs)

    def cached(self, guide_type: str | None, guide: str | None) -> CompiledGuide | None:
        """The compiled guide for a request's (type, guide) inputs when the cache holds it (a hit), else None
        (nothing counted, nothing compiled). Raises RequestError for inputs that do not name a guide."""
        key = check_guide(guide_type, guide)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            return compiled

    def compile(self, guide_type: str | None, guide: str | None) -> CompiledGuide:
        """The compiled guide for a request's (type, guide) inputs, from the cache when it was seen lately.
        Raises RequestError for inputs that do not name a guide, GuideError for a guide that does not compile."""
        key = check_guide(guide_type, guide)
        compiled = self.cached(guide_type, guide)
        if compiled is not None:
            return compiled
        with self._lock:
            self.misses += 1
        compiled = self._compile(*key)  # outside the lock: a slow grammar does not hold up cached ones
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, guide_type: str, guide: str | None) -> CompiledGuide:
        try:
            if guide_type == "json":
                grammar = self._compiler.compile_json_schema(ANY_JSON_SCHEMA, any_whitespace=False)
            elif guide_type == "json_schema":
                grammar = self._compiler.compile_json_schema(guide, any_whitespace=False)
            elif guide_type == "regex":
                grammar = self._compiler.compile_regex(guide)
            else:
                grammar = self._compiler.compile_grammar(guide)
        except Exception as exc:  # xgrammar raises RuntimeError (and a few others) with the parser's message
            raise GuideError(f"invalid guided_decoding_guide for guided_decoding_guide_type {guide_type!r}: "
                             f"{_reason(exc)}") from exc
        return CompiledGuide(guide_type, grammar, self._allowed[guide_type in JSON_TYPES], self._stop_ids)
