"""The checkpoint's own tokenizer and chat template, as the frontend uses them."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Collection

import tokenizers
from transformers import AutoTokenizer

from frontend.text.detokenizer import IncrementalDetokenizer
from frontend.api_types.errors import invalid_request
from frontend.text.token_bytes import TokenBytes, build_token_bytes


def end_token_ids(eos_token_id: int | None, checkpoint_dir: Path, vocab_size: int) -> tuple[int, ...]:
    """The tokenizer's eos id, then the other ids `generation_config.json` ends generation with (an int or a
    list), each once and inside the vocabulary."""
    ids = [eos_token_id] if eos_token_id is not None else []
    try:
        configured = json.loads((checkpoint_dir / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        configured = None
    ids += configured if isinstance(configured, list) else [configured]
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int) and not isinstance(i, bool)
                               and 0 <= i < vocab_size))


class Tokenizer:
    def __init__(self, tokenizer_dir: Path, chat_template: Path | None = None):
        self._tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.directory = Path(tokenizer_dir)  # the checkpoint's, as a rule: LoRA adapters are checked against it
        if chat_template is not None:
            self._tok.chat_template = Path(chat_template).read_text()
        self.eos_token_id: int | None = self._tok.eos_token_id
        # Every id that ends an answer: the tokenizer's eos first, then generation_config.json's (Llama 3.1
        # Instruct ends tool turns with <|eom_id|>, chat turns with <|eot_id|>, documents with <|end_of_text|>).
        self.end_token_ids: tuple[int, ...] = end_token_ids(self.eos_token_id, Path(tokenizer_dir), len(self._tok))
        pad = self._tok.pad_token_id
        self.pad_token_id: int | None = pad if pad is not None else self.eos_token_id
        self.vocab_size = len(self._tok)
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)
        self._decode_ids = self._fast_decode()
        # Memoized single-token decodes for the detokenizer (one per generated token; see IncrementalDetokenizer).
        self._decode_one = functools.lru_cache(maxsize=65536)(lambda token_id: self._decode_ids([token_id]))
        # Built once here (this runs in a worker thread at model load): ~0.25 s for a 150k vocabulary.
        self._token_bytes: TokenBytes = build_token_bytes(self._tok)
        # No token is longer than this many bytes, so a text of more than `n * max_token_bytes` UTF-8
        # bytes is more than n tokens: long texts are refused before they are tokenized (seconds of CPU).
        self.max_token_bytes = max((len(self._token_bytes(i)) for i in range(self.vocab_size)), default=1) or 1

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tok.chat_template)

    def certainly_longer_than(self, text: str, tokens: int) -> bool:
        """Whether `text` has more than `tokens` tokens, known without tokenizing it."""
        return len(text) > tokens * self.max_token_bytes or len(text.encode("utf-8")) > tokens * self.max_token_bytes

    def encode(self, text: str) -> list[int]:
        """Text as it appears inside a prompt: no special tokens added."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        """A whole prompt (/v1/completions, /tokenize): with the special tokens the tokenizer adds by default,
        as Hugging Face and vLLM encode one, so models trained with a BOS (Llama 2, Mistral) get it. A chat
        prompt is what its template renders, BOS included, and never comes through here."""
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _fast_decode(self) -> Any:
        """`decode` without transformers' Python layers, where the tokenizer is a Rust `tokenizers` one: the
        detokenizer calls it twice per generated token. transformers' own fast path is exactly this call
        (TokenizersBackend._decode) when spaces are not cleaned up."""
        backend = getattr(self._tok, "_tokenizer", None)
        if not isinstance(backend, tokenizers.Tokenizer):
            return self.decode
        return functools.partial(backend.decode, skip_special_tokens=True)

    @functools.cached_property
    def _skipped_special_tokens(self) -> dict[int, str]:
        """The tokens `decode` drops (the special tokens, as this tokenizer's backend marks them), with
        their text: found by decoding each candidate both ways, so it is exactly what `decode` does."""
        candidates = set(self._tok.all_special_ids) | set(self._tok.added_tokens_decoder)
        return {token_id: text for token_id in sorted(candidates)
                if not self.decode([token_id]) and (text := self._token_text(token_id))}

    def _decode_keeping(self, kept: frozenset[int], ids: list[int]) -> str:
        """`decode`, but the special tokens in `kept` are written out as their text."""
        skipped = self._skipped_special_tokens
        return self._tok.decode([i for i in ids if i in kept or i not in skipped], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)

    def _token_text(self, token_id: int) -> str:
        """One token's text on its own (special tokens included), for logprobs."""
        return self._tok.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own raw bytes, for the `bytes` of chat logprobs: part of a character where the
        token splits one (never U+FFFD's), the space of a SentencePiece `▁`, a special token's content.
        Joined over the generated tokens they are the response text's UTF-8 (frontend.text.token_bytes)."""
        return self._token_bytes(token_id)

    @property
    def token_bytes_family(self) -> str:
        """How `token_bytes` reads this vocabulary: "byte_level", "sentencepiece", "plain", or "decode"
        (the fallback: each token's decoded text, U+FFFD for a split character)."""
        return self._token_bytes.family

    @property
    def chat_template(self) -> str | None:
        template = self._tok.chat_template
        return template if isinstance(template, str) else None

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template uses the `tools` it is given (Hugging Face templates that support
        tool calling do); one that does not would silently drop them from the prompt."""
        return "tools" in (self.chat_template or "")

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                            ) -> list[int]:
        if not self.has_chat_template:
            raise invalid_request(
                "this model's tokenizer has no chat template, so /v1/chat/completions cannot format "
                "messages; start the frontend with --chat-template FILE (a Jinja template), or use "
                "/v1/completions with a plain prompt", param="messages", code="chat_template_missing")
        if tools and not self.template_renders_tools:
            raise invalid_request(
                "this model's chat template does not render tools, so the model would never see them; start "
                "the frontend with --chat-template FILE (a template that renders `tools`)", param="tools",
                code="chat_template_without_tools")
        try:
            ids = self._tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        except Exception as exc:  # the template itself raised (e.g. roles it does not allow)
            raise invalid_request(f"the chat template rejected these messages: {exc}",
                                  param="messages") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def detokenizer(self, prompt_ids: list[int], markers: Collection[str] = ()) -> IncrementalDetokenizer:
        """Text deltas of the generated tokens, special tokens dropped, except those of `markers` that are
        special tokens here: a tool-call parser reads its calls after them (Mistral's `[TOOL_CALLS]`,
        Llama 3.1's `<|python_tag|>`), so they must stay in the text it reads."""
        kept = frozenset(i for i, text in self._skipped_special_tokens.items() if text in markers) \
            if markers else frozenset()
        if not kept:
            return IncrementalDetokenizer(self._decode_ids, prompt_tail=prompt_ids, decode_one=self._decode_one)
        return IncrementalDetokenizer(functools.partial(self._decode_keeping, kept), prompt_tail=prompt_ids)
