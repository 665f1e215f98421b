"""The xgrammar tokenizer info the TensorRT-LLM C++ backend's guided decoding reads (build_engine/xgrammar_info.py).

Checked on the two tokenizer families built locally (the demo checkpoint's byte-level BPE and a
Llama-2-style SentencePiece with byte fallback) and on small hand-made tokenizers for the edge cases
(ids without a token, model vocabulary larger or smaller than the tokenizer's, no eos), and by xgrammar
itself (pinned for the CPU engine): fed this file the way TensorRT-LLM's guidedDecoder.cpp feeds it, it must
describe the tokenizer as its own `TokenizerInfo.from_huggingface` does.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from build_engine.demo_checkpoint import EOS_TOKEN, ensure_demo_checkpoint
from build_engine.xgrammar_info import (ENCODED_VOCAB, NO_TOKEN, STOP_TOKEN_IDS, TOKENIZER_STR, XgrammarInfoError,
                                        info_from_tokenizer, model_vocab_size, tokenizer_info, write_tokenizer_info)
from tests.sentencepiece_tokenizer import EOS_TOKEN as SP_EOS_TOKEN
from tests.sentencepiece_tokenizer import build_sentencepiece_tokenizer

KEYS = [ENCODED_VOCAB, TOKENIZER_STR, STOP_TOKEN_IDS]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny")


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("sentencepiece")
    build_sentencepiece_tokenizer(directory)
    return directory


def _auto(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _check_against_tokenizer(info: dict, directory: Path, eos_token: str) -> None:
    tokenizer = _auto(directory)
    assert list(info) == KEYS
    vocab = info[ENCODED_VOCAB]
    assert all(isinstance(token, str) for token in vocab)
    # One entry per token id, in id order, each the tokenizer's own (still encoded) token string.
    assert len(vocab) == len(tokenizer) == len(tokenizer.get_vocab())
    assert vocab == tokenizer.convert_ids_to_tokens(list(range(len(vocab))))
    assert NO_TOKEN not in vocab
    for token, token_id in tokenizer.get_vocab().items():
        assert vocab[token_id] == token
    eos_id = tokenizer.convert_tokens_to_ids(eos_token)
    assert info[STOP_TOKEN_IDS] == [eos_id] == [tokenizer.eos_token_id]
    # The tokenizer string is the checkpoint's tokenizer.json, as the loaded tokenizer serializes it.
    assert json.loads(info[TOKENIZER_STR]) == json.loads((directory / "tokenizer.json").read_text())


def test_demo_checkpoint(demo_dir: Path) -> None:
    info = tokenizer_info(demo_dir)
    _check_against_tokenizer(info, demo_dir, EOS_TOKEN)
    assert len(info[ENCODED_VOCAB]) == model_vocab_size(demo_dir) == 4096
    # Byte-level BPE: a space is spelled Ġ; xgrammar finds the ByteLevel decoder in tokenizer_str.
    assert any(token.startswith("\u0120") for token in info[ENCODED_VOCAB])
    assert json.loads(info[TOKENIZER_STR])["decoder"]["type"] == "ByteLevel"


def test_sentencepiece_tokenizer(sentencepiece_dir: Path) -> None:
    assert model_vocab_size(sentencepiece_dir) is None  # a tokenizer folder only: nothing cut
    info = tokenizer_info(sentencepiece_dir)
    _check_against_tokenizer(info, sentencepiece_dir, SP_EOS_TOKEN)
    vocab = info[ENCODED_VOCAB]
    assert vocab[:3] == ["<unk>", "<s>", "</s>"] and vocab[3 + 0x0A] == "<0x0A>"
    assert any(token.startswith("\u2581") for token in vocab)  # ▁ kept as stored, not decoded to a space
    decoders = json.loads(info[TOKENIZER_STR])["decoder"]["decoders"]
    assert "ByteFallback" in [decoder["type"] for decoder in decoders]


def test_written_file_round_trips(demo_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "engine" / "xgrammar_tokenizer_info.json"
    assert write_tokenizer_info(demo_dir, out) == out
    raw = out.read_bytes()
    raw.decode("ascii")  # escaped like upstream's json.dump
    assert json.loads(raw) == tokenizer_info(demo_dir)
    write_tokenizer_info(demo_dir, out)  # overwrites in place, leaves no temporary file behind
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def _checkpoint_with_vocab_size(demo_dir: Path, directory: Path, vocab_size: int, *, nested: bool = False) -> Path:
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_dir / name, directory / name)
    config = json.loads((demo_dir / "config.json").read_text())
    if nested:
        del config["vocab_size"]
        config["text_config"] = {"vocab_size": vocab_size}
    else:
        config["vocab_size"] = vocab_size
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_padded_model_vocabulary_adds_nothing(demo_dir: Path, tmp_path: Path) -> None:
    # Embeddings padded past the tokenizer: the C++ side passes the engine's padded size to xgrammar,
    # which treats every id past the list as special; the file lists only real tokens.
    padded = _checkpoint_with_vocab_size(demo_dir, tmp_path / "padded", 4096 + 64)
    assert tokenizer_info(padded) == tokenizer_info(demo_dir)


@pytest.mark.parametrize("nested", [False, True])
def test_tokenizer_larger_than_model_is_cut(demo_dir: Path, tmp_path: Path, nested: bool) -> None:
    small = _checkpoint_with_vocab_size(demo_dir, tmp_path / "small", 4000, nested=nested)
    assert model_vocab_size(small) == 4000
    info = tokenizer_info(small)
    assert info[ENCODED_VOCAB] == tokenizer_info(demo_dir)[ENCODED_VOCAB][:4000]
    assert info[STOP_TOKEN_IDS] == [2]


def test_eos_outside_model_vocabulary_is_refused(demo_dir: Path) -> None:
    tokenizer = _auto(demo_dir)
    with pytest.raises(XgrammarInfoError, match="outside the model's vocabulary"):
        info_from_tokenizer(tokenizer, model_vocab_size=2)  # eos is id 2


def _word_level(vocab: dict[str, int], **special):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


def test_ids_without_a_token_keep_their_place() -> None:
    # Ids 2 and 4 have no token: positions stay ids (upstream's sorted list would shift "c" and "</s>").
    tokenizer = _word_level({"[UNK]": 0, "a": 1, "c": 3, "</s>": 5}, unk_token="[UNK]", eos_token="</s>")
    info = info_from_tokenizer(tokenizer)
    assert info[ENCODED_VOCAB] == ["[UNK]", "a", NO_TOKEN, "c", NO_TOKEN, "</s>"]
    assert info[STOP_TOKEN_IDS] == [5]


def test_added_tokens_are_listed_at_their_ids() -> None:
    tokenizer = _word_level({"[UNK]": 0, "a": 1}, unk_token="[UNK]")
    tokenizer.add_special_tokens({"eos_token": "<|end|>"})
    tokenizer.add_tokens(["<tool>"])
    info = info_from_tokenizer(tokenizer)
    assert info[ENCODED_VOCAB] == ["[UNK]", "a", "<|end|>", "<tool>"]
    assert info[STOP_TOKEN_IDS] == [2]


def test_tokenizer_without_eos_is_refused() -> None:
    tokenizer = _word_level({"[UNK]": 0, "a": 1}, unk_token="[UNK]")
    with pytest.raises(XgrammarInfoError, match="no eos token"):
        info_from_tokenizer(tokenizer)


def test_tokenizer_without_backend_is_refused() -> None:
    class Slow:
        eos_token_id = 0

        def get_vocab(self):
            return {"a": 0}

    with pytest.raises(XgrammarInfoError, match="no `tokenizers` backend"):
        info_from_tokenizer(Slow())


def test_model_vocab_size_unreadable_config(tmp_path: Path) -> None:
    assert model_vocab_size(tmp_path) is None
    (tmp_path / "config.json").write_text("not json")
    assert model_vocab_size(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": True}))
    assert model_vocab_size(tmp_path) is None


def test_written_file_is_readable_by_others(demo_dir: Path, tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        out = write_tokenizer_info(demo_dir, tmp_path / "info.json")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644  # not a temporary file's 0600


@pytest.mark.parametrize("family", ["demo", "sentencepiece"])
def test_xgrammar_reads_it_as_it_reads_the_tokenizer_itself(family: str, request: pytest.FixtureRequest) -> None:
    """xgrammar (pinned for the CPU engine), fed our file as TensorRT-LLM's guidedDecoder.cpp feeds it
    (the encoded vocab, metadata detected from tokenizer_str, the stop ids, the engine's padded vocab size),
    describes the tokenizer exactly as its own from_huggingface does, down to the JSON grammar's first mask."""
    import xgrammar as xgr

    directory = request.getfixturevalue(f"{family}_dir")
    tokenizer = _auto(directory)
    info = json.loads(json.dumps(tokenizer_info(directory)))
    padded = len(tokenizer) + 32  # an engine's padded vocabulary, as the C++ side passes it
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(info[TOKENIZER_STR])
    ours = xgr.TokenizerInfo(info[ENCODED_VOCAB], metadata["vocab_type"], vocab_size=padded,
                             stop_token_ids=info[STOP_TOKEN_IDS], add_prefix_space=metadata["add_prefix_space"])
    theirs = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=padded)
    expected_type = {"demo": xgr.VocabType.BYTE_LEVEL, "sentencepiece": xgr.VocabType.BYTE_FALLBACK}[family]
    assert ours.vocab_type == theirs.vocab_type == expected_type
    assert ours.vocab_size == theirs.vocab_size == padded
    assert ours.add_prefix_space == theirs.add_prefix_space
    assert ours.stop_token_ids == theirs.stop_token_ids == [tokenizer.eos_token_id]
    assert ours.decoded_vocab[: len(tokenizer)] == theirs.decoded_vocab[: len(tokenizer)]
    masks = []
    for described in (ours, theirs):
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(described).compile_builtin_json_grammar())
        bitmask = xgr.allocate_token_bitmask(1, padded)
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(bitmask.tolist())
    assert masks[0] == masks[1]
    allowed = [i for i in range(padded) if masks[0][0][i // 32] >> (i % 32) & 1]
    assert allowed and tokenizer.eos_token_id not in allowed
