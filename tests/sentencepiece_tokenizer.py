"""A Llama-2-style SentencePiece tokenizer with byte fallback, built locally (no download) for tests.

The demo checkpoint's tokenizer is byte-level BPE (GPT-2/Llama-3 style). The other family the frontend
serves is SentencePiece with byte fallback (Llama-2, Mistral): `▁` stands for a space, characters the
vocabulary lacks are spelled as `<0xAB>` single-byte tokens, and the decoder is
Replace(`▁`, " ") / ByteFallback / Fuse / Strip(" ", 1, 0), which drops the one space the encoder put in
front of the text. Token-bytes and logprob tests need such a tokenizer whose vocabulary size they choose
(the scripted model of the integration tests emits ids of a 4096-entry vocabulary), so this module trains
one with the `tokenizers` library on text that ships with Python plus a generated multilingual text.

Layout, as in Llama-2: ids 0-2 are `<unk>`, `<s>`, `</s>`; ids 3-258 are `<0x00>`..`<0xFF>`; the learned
pieces follow. The training text contains some CJK characters, emoji and accented letters, so those
exist as whole-character (and whole-word) tokens, while every other character (e.g. 🚀, 鱼) is spelled
with byte-fallback tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from build_engine.demo_checkpoint import stdlib_training_text

if TYPE_CHECKING:  # imported lazily below: transformers is slow to import
    from transformers import PreTrainedTokenizerFast

UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN)
BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))
SPACE_PIECE = "\u2581"  # ▁
DEFAULT_VOCAB_SIZE = 4096

# Llama-2's template, shortened (no system prompt): the prompt ends in " [/INST]".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<s>[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + '</s>' }}{% endif %}"
    "{% endfor %}"
)

# Enough Python source for a 4k-piece vocabulary with room to spare; training stays around a second.
STDLIB_TEXT_BYTES = 1024 * 1024
# Characters the training text contains, hence whole-character pieces. Everything else non-ASCII
# (not in stdlib sources either) falls back to bytes.
CJK_WORDS = ("你好", "世界", "中文", "谢谢", "学习", "语言", "模型", "日本語", "こんにちは", "한국어")
EMOJI = ("😀", "🎉", "👍", "❤️", "🙂")
LATIN_WORDS = ("café", "naïve", "résumé", "Zürich", "cafe\u0301", "the", "model", "token", "bytes")


def training_text(seed: int = 0) -> list[str]:
    """Stdlib sources (ship with every Python) plus a generated text mixing CJK, emoji and Latin words."""
    texts = stdlib_training_text(STDLIB_TEXT_BYTES)
    rng = random.Random(seed)
    vocabulary = CJK_WORDS + EMOJI + LATIN_WORDS
    for _ in range(2000):
        words = rng.choices(vocabulary, k=rng.randint(3, 12))
        joiner = "" if rng.random() < 0.3 else " "  # CJK is often written without spaces
        texts.append(joiner.join(words) + rng.choice((".", "!", "。", "", "\n")))
    return texts


def build_sentencepiece_tokenizer(directory: Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train the tokenizer and save it as a Hugging Face tokenizer directory; return the loaded
    `transformers` tokenizer. `len(tokenizer) == vocab_size` exactly (asserted).

    Written: tokenizer.json and tokenizer_config.json (bos `<s>`, eos `</s>`, unk `<unk>`, a Llama-2-style
    chat template), loadable with `transformers.AutoTokenizer.from_pretrained(directory)`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    fixed = len(SPECIAL_TOKENS) + len(BYTE_TOKENS)
    learned_size = vocab_size - fixed
    if learned_size < 1:
        raise ValueError(f"vocab_size must exceed {fixed} (special and byte tokens)")
    metaspace = pre_tokenizers.Metaspace(replacement=SPACE_PIECE, prepend_scheme="first")
    trainer_model = Tokenizer(models.BPE())
    trainer_model.pre_tokenizer = metaspace
    # A little more than needed, then cut to the exact size below: a few learned pieces may coincide
    # with a byte token's spelling, and the trainer may stop a few short of its target.
    trainer = trainers.BpeTrainer(vocab_size=learned_size + 64, show_progress=False)
    trainer_model.train_from_iterator(training_text(), trainer=trainer)
    learned = json.loads(trainer_model.to_str())["model"]
    fixed_tokens = (*SPECIAL_TOKENS, *BYTE_TOKENS)
    vocab: dict[str, int] = {token: i for i, token in enumerate(fixed_tokens)}
    # Learned pieces in the trainer's order (alphabet first, then one per merge), so keeping a prefix
    # keeps a consistent BPE model: every kept merge's parts were learned before it.
    for token, _ in sorted(learned["vocab"].items(), key=lambda item: item[1]):
        if len(vocab) == vocab_size:
            break
        vocab.setdefault(token, len(vocab))
    if len(vocab) != vocab_size:
        raise RuntimeError(f"training gave only {len(vocab)} tokens, {vocab_size} wanted; add training text")
    merges = [tuple(pair) for pair in learned["merges"]
              if pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token=UNK_TOKEN, byte_fallback=True, fuse_unk=True))
    backend.pre_tokenizer = metaspace
    backend.decoder = decoders.Sequence([
        decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    backend.add_special_tokens(list(SPECIAL_TOKENS))  # already in the vocabulary: marks them special only
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                        unk_token=UNK_TOKEN, model_max_length=4096)
    tokenizer.chat_template = CHAT_TEMPLATE
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"built {len(tokenizer)} tokens, {vocab_size} wanted")
    Path(directory).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    return tokenizer
