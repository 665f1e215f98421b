"""Token bytes for chat logprobs: each token's own raw bytes, joined, are exactly the text's UTF-8.

Two real tokenizer families, built locally: the demo checkpoint's byte-level BPE (GPT-2/Llama-3 style)
and a Llama-2-style SentencePiece tokenizer with byte fallback (tests/sentencepiece_tokenizer.py).

The rule checked for SentencePiece: its encoder puts one `▁` in front of a text that does not already
begin with a space, and a token's bytes keep that `▁` as b" " (they are the token's own bytes), so the
bytes of `encode(text)` join to `text` with one space in front unless it began with a space. In the
frontend, generated tokens are always decoded after some prompt context, where the decoder keeps that
space too: there, the joined bytes equal the emitted text exactly (checked with the frontend's own
Tokenizer and IncrementalDetokenizer).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from build_engine.demo_checkpoint import EOS_TOKEN, ensure_demo_checkpoint
from frontend.http.logprob_rendering import chat_logprobs
from frontend.generation.serving import TokenInfo
from frontend.text.token_bytes import (BYTE_LEVEL, DECODE, PLAIN, SENTENCEPIECE, apply_plan, build_token_bytes,
                                  bytes_to_unicode, plan_decoder)
from frontend.text.tokenizer import Tokenizer
from tests.sentencepiece_tokenizer import EOS_TOKEN as SP_EOS_TOKEN
from tests.sentencepiece_tokenizer import build_sentencepiece_tokenizer

REPLACEMENT_BYTES = "\ufffd".encode("utf-8")  # EF BF BD

TEXTS = [
    "Hello, world!",
    "a",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "tabs\tand\nnewlines\r\n",
    "def f(x):\n    return x ** 2\n",
    "中文",
    "你好，世界。",
    "你好世界",  # whole-word pieces in the SentencePiece vocabulary
    "日本語のテキスト",
    "한국어 문장",
    "鱼🚀",  # in no training text: byte-fallback tokens only
    "😀",
    "🎉👍🙂",
    "❤️",  # with a variation selector
    "👨\u200d👩\u200d👧",  # a ZWJ family
    "🇯🇵",  # a flag: two regional indicators
    "👍🏽",  # a skin tone modifier
    "cafe\u0301 vs café",  # combining acute accent vs precomposed
    "Zürich naïve résumé",
    "a\u0308\u0323",  # two combining marks on one letter
    "각",  # conjoining Hangul jamo
    "mixed: ASCII, 中文, emoji 😀 and e\u0301!",
    "x  y   z",
]
# Special-token text in the input encodes to the special token, whose bytes are its content; decoding
# for the response text skips special tokens, so only the encode-side join holds for it.
SPECIAL_TEXT = "<|im_end|> is text here"

# Texts where some token must split a character (the demo's byte-level BPE has no merges for these).
SPLIT_TEXTS = ["中文", "鱼🚀", "😀", "你好，世界。"]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny")


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("sentencepiece")
    build_sentencepiece_tokenizer(directory, vocab_size=4096)
    return directory


@pytest.fixture(scope="module")
def demo(demo_dir: Path) -> Tokenizer:
    return Tokenizer(demo_dir)


@pytest.fixture(scope="module")
def sp(sp_dir: Path) -> Tokenizer:
    return Tokenizer(sp_dir)


def joined(tokenizer: Tokenizer, ids: list[int]) -> bytes:
    return b"".join(tokenizer.token_bytes(t) for t in ids)


def sentencepiece_text(text: str) -> str:
    """What the SentencePiece encoder spells: one space in front unless the text begins with one."""
    return text if text.startswith(" ") else " " + text


def detokenized(tokenizer: Tokenizer, prompt_ids: list[int], ids: list[int]) -> str:
    """The text the frontend emits for `ids` generated after `prompt_ids`, token by token."""
    detok = tokenizer.detokenizer(prompt_ids)
    return "".join(detok.add([t]) for t in ids) + detok.flush()


# ----- the families are detected from the decoder ---------------------------------------------------------


def test_families_detected_from_the_decoder(demo: Tokenizer, sp: Tokenizer) -> None:
    assert demo.token_bytes_family == BYTE_LEVEL
    assert sp.token_bytes_family == SENTENCEPIECE


# ----- byte-level BPE (the demo tokenizer) ----------------------------------------------------------------


@pytest.mark.parametrize("text", [*TEXTS, SPECIAL_TEXT])
def test_byte_level_token_bytes_join_to_the_text(demo: Tokenizer, text: str) -> None:
    ids = demo.encode(text)
    assert joined(demo, ids) == text.encode("utf-8")


@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40))
@settings(max_examples=300, derandomize=True, deadline=None)
def test_byte_level_any_text(demo: Tokenizer, text: str) -> None:
    assert joined(demo, demo.encode(text)) == text.encode("utf-8")


@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_byte_level_split_characters_give_partial_bytes(demo: Tokenizer, text: str) -> None:
    ids = demo.encode(text)
    partial = [demo.token_bytes(t) for t in ids if not _is_utf8(demo.token_bytes(t))]
    assert partial, "expected some token to split a character"
    assert all(REPLACEMENT_BYTES not in demo.token_bytes(t) for t in ids)
    # The old computation (the single token's decoded text) gives U+FFFD for exactly those tokens.
    assert any(demo.token_text(t) == "\ufffd" for t in ids)


def test_byte_level_known_token_bytes(demo: Tokenizer) -> None:
    first, second, third = demo.encode("中")  # E4 B8 AD, one byte-level token per byte
    assert (demo.token_bytes(first), demo.token_bytes(second), demo.token_bytes(third)) == (
        b"\xe4", b"\xb8", b"\xad")
    (space_the,) = demo.encode(" the")
    assert demo.token_bytes(space_the) == b" the"  # Ġ is the space byte


def test_special_tokens_are_their_content(demo: Tokenizer, sp: Tokenizer) -> None:
    assert demo.token_bytes(demo.eos_token_id) == EOS_TOKEN.encode()
    assert sp.token_bytes(sp.eos_token_id) == SP_EOS_TOKEN.encode()


def test_ids_outside_the_vocabulary_have_no_bytes(demo: Tokenizer) -> None:
    assert demo.token_bytes(-1) == b""
    assert demo.token_bytes(demo.vocab_size + 10) == b""


# ----- SentencePiece with byte fallback --------------------------------------------------------------------


@pytest.mark.parametrize("text", [*TEXTS, SPECIAL_TEXT])
def test_sentencepiece_token_bytes_join_to_the_spelled_text(sp: Tokenizer, text: str) -> None:
    ids = sp.encode(text)
    assert joined(sp, ids) == sentencepiece_text(text).encode("utf-8")


@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\u2581"),
               min_size=1, max_size=40))
@settings(max_examples=300, derandomize=True, deadline=None)
def test_sentencepiece_any_text(sp: Tokenizer, text: str) -> None:
    # `▁` in the input is excluded: the tokenizer itself spells it as a space (its round trip is lossy).
    assert joined(sp, sp.encode(text)) == sentencepiece_text(text).encode("utf-8")


def test_sentencepiece_byte_fallback_and_whole_character_tokens(sp: Tokenizer) -> None:
    ids = sp.encode("你好🚀")
    pieces = [sp.token_bytes(t) for t in ids]
    # `▁你好` is one learned piece (a space and two whole characters); 🚀 (F0 9F 9A 80) is not in the
    # vocabulary, so it is four byte-fallback tokens of one raw byte each.
    assert pieces == [" 你好".encode(), b"\xf0", b"\x9f", b"\x9a", b"\x80"]
    assert [sp.token_text(t) for t in ids[1:]] == ["\ufffd"] * 4  # why text.encode() was wrong
    (whole,) = [t for t in sp.encode("x😀") if sp.token_bytes(t) == "😀".encode()]
    assert sp.token_text(whole) == "😀"


@pytest.mark.parametrize("text", ["鱼🚀", "中文🚀", "🚀 and 鱼"])  # 鱼 and 🚀: in no training text
def test_sentencepiece_split_characters_give_partial_bytes(sp: Tokenizer, text: str) -> None:
    ids = sp.encode(text)
    assert any(not _is_utf8(sp.token_bytes(t)) for t in ids)
    assert all(REPLACEMENT_BYTES not in sp.token_bytes(t) for t in ids)


# ----- what the frontend emits: generated tokens after a prompt ---------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("family", ["demo", "sp"])
def test_bytes_join_to_the_text_the_frontend_emits(request: pytest.FixtureRequest, family: str,
                                                   text: str) -> None:
    """Mid-text, the SentencePiece leading `▁` is a space in the text as in the bytes: exact equality."""
    tokenizer: Tokenizer = request.getfixturevalue(family)
    prompt_ids = tokenizer.encode("The answer is:")
    ids = tokenizer.encode(text)
    emitted = detokenized(tokenizer, prompt_ids, ids)
    assert emitted == (text if family == "demo" else sentencepiece_text(text))
    assert joined(tokenizer, ids) == emitted.encode("utf-8")


def test_sentencepiece_generation_at_the_sequence_start_keeps_the_space_only_in_bytes(sp: Tokenizer) -> None:
    """The documented exception: a prompt of special tokens only gives the decoder no text to follow,
    so its Strip removes the first piece's space from the text; the token's own bytes keep it."""
    ids = sp.encode("Hello world")
    assert detokenized(sp, [sp.encode("<s>")[0]], ids) == "Hello world"
    assert joined(sp, ids) == b" Hello world"


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("family", ["demo", "sp"])
def test_chat_logprobs_bytes_join_to_the_text(request: pytest.FixtureRequest, family: str, text: str) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(family)
    prompt_ids = tokenizer.encode("The answer is:")
    ids = tokenizer.encode(text)
    emitted = detokenized(tokenizer, prompt_ids, ids)
    alternative = tokenizer.encode("中")[-1]
    tokens = [TokenInfo(t, -0.25, [(t, -0.25), (alternative, -3.0)]) for t in ids]
    content = chat_logprobs(tokens, tokenizer, 2)["content"]
    assert len(content) == len(ids)
    assert b"".join(bytes(entry["bytes"]) for entry in content) == emitted.encode("utf-8")
    for entry, token_id in zip(content, ids):
        assert entry["token"] == tokenizer.token_text(token_id)
        assert [alt["bytes"] for alt in entry["top_logprobs"]] == [
            list(tokenizer.token_bytes(token_id)), list(tokenizer.token_bytes(alternative))]
        assert entry["top_logprobs"][0]["token"] == entry["token"]


# ----- decoder configurations and the fallback -------------------------------------------------------------


def test_decoder_plans() -> None:
    llama2 = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    plan = plan_decoder(llama2)
    assert plan.family == SENTENCEPIECE
    assert [apply_plan(plan, t) for t in ["▁Hello", "<0xE4>", "<0x0A>", "▁", "ab"]] == [
        b" Hello", b"\xe4", b"\n", b" ", b"ab"]
    gemma = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}]}
    assert apply_plan(plan_decoder(gemma), "▁<0x41>x") == b" <0x41>x"  # only a whole token is a byte
    metaspace = plan_decoder({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                              "split": True})
    # No ByteFallback step: the decoder writes `<0xE4>` as text, so its bytes are that text.
    assert metaspace.family == SENTENCEPIECE
    assert [apply_plan(metaspace, t) for t in ["▁Hello", "<0xE4>"]] == [b" Hello", b"<0xE4>"]
    # A Strip before any Fuse acts on every token (tokenizers applies it per token), not on the sequence.
    per_token = plan_decoder({"type": "Sequence", "decoders": [
        {"type": "Strip", "content": "_", "start": 1, "stop": 1}, {"type": "Fuse"}]})
    assert per_token.family == PLAIN and apply_plan(per_token, "_ab_") == b"ab"
    assert plan_decoder({"type": "ByteLevel"}).family == BYTE_LEVEL
    assert apply_plan(plan_decoder({"type": "ByteLevel"}), "ĠhÃ©") == " hé".encode()
    assert apply_plan(plan_decoder({"type": "ByteLevel"}), "<think>") == b"<think>"
    # A character outside the byte alphabet: the whole token is its own UTF-8, as tokenizers does.
    assert apply_plan(plan_decoder({"type": "ByteLevel"}), "Ġ中") == "Ġ中".encode()
    for unknown in [None, {"type": "WordPiece", "prefix": "##", "cleanup": True},
                    {"type": "Replace", "pattern": {"Regex": "▁+"}, "content": " "}]:
        assert plan_decoder(unknown).family == DECODE


def test_wordpiece_falls_back_to_decoding_the_single_token() -> None:
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models

    vocab = {"[UNK]": 0, "hello": 1, "##lo": 2, "中": 3}
    backend = BackendTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    token_bytes = build_token_bytes(backend)
    assert token_bytes.family == DECODE and len(token_bytes) == 0
    # Exactly the single token's decoded text (WordPiece writes a sequence's first `##lo` as is).
    assert [token_bytes(i) for i in range(4)] == [b"[UNK]", b"hello", b"##lo", "中".encode()]
    assert token_bytes(-1) == b""


def test_a_tokenizer_without_a_tokenizers_backend_falls_back_to_decode() -> None:
    class SlowTokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool = False,
                   clean_up_tokenization_spaces: bool = False) -> str:
            return "".join(chr(0x4E00 + i) for i in ids)

    token_bytes = build_token_bytes(SlowTokenizer())
    assert token_bytes.family == DECODE and token_bytes(1) == "丁".encode()


def test_large_byte_level_vocabulary_with_added_tokens() -> None:
    """Random byte strings as vocabulary, plus a special and a non-special added token."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = bytes_to_unicode()
    rng = random.Random(0)
    expected: dict[int, bytes] = {}
    vocab: dict[str, int] = {}
    for b in range(256):
        vocab[alphabet[b]] = b
        expected[b] = bytes((b,))
    while len(vocab) < 20_000:
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(2, 8)))
        spelled = "".join(alphabet[b] for b in raw)
        if spelled not in vocab:
            expected[len(vocab)] = raw
            vocab[spelled] = len(vocab)
    backend = BackendTokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken("<think>", special=False)])
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    token_bytes = build_token_bytes(backend)
    assert token_bytes.family == BYTE_LEVEL
    assert all(token_bytes(i) == raw for i, raw in expected.items())
    assert token_bytes(backend.token_to_id("<think>")) == b"<think>"
    assert token_bytes(backend.token_to_id("<|endoftext|>")) == b"<|endoftext|>"
    # Cross-check with the library's own decoder on whole-character runs of tokens.
    ids = backend.encode("héllo wörld 中文").ids
    assert b"".join(token_bytes(i) for i in ids).decode() == backend.decode(ids) == "héllo wörld 中文"


def test_saved_sentencepiece_tokenizer_is_llama2_style(sp_dir: Path) -> None:
    config = json.loads((sp_dir / "tokenizer.json").read_text())
    assert config["model"]["type"] == "BPE" and config["model"]["byte_fallback"] is True
    assert [d["type"] for d in config["decoder"]["decoders"]] == ["Replace", "ByteFallback", "Fuse", "Strip"]
    assert config["model"]["vocab"]["<0x00>"] == 3 and config["model"]["vocab"]["<0xFF>"] == 258
    tokenizer_config = json.loads((sp_dir / "tokenizer_config.json").read_text())
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<s>", "</s>")


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_the_detokenizers_fast_decode_is_decode(demo: Tokenizer, sp: Tokenizer) -> None:
    """The detokenizer decodes through the Rust tokenizer directly; it must give exactly `decode`'s text,
    special tokens (skipped) and split characters included."""
    import random

    rng = random.Random(0)
    for tokenizer in (demo, sp):
        assert tokenizer._decode_ids is not tokenizer.decode  # the fast path is in use
        specials = list(tokenizer._tok.all_special_ids)
        for _ in range(300):
            ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 12))]
            ids += rng.sample(specials, k=min(len(specials), rng.randrange(0, 2)))
            rng.shuffle(ids)
            assert tokenizer._decode_ids(ids) == tokenizer.decode(ids), ids
