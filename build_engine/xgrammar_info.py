"""The tokenizer description that TensorRT-LLM's guided decoding (xgrammar) reads in the C++ Triton backend.

Why this file exists: the Python side of TensorRT-LLM hands xgrammar a live Hugging Face tokenizer, but
the C++ Triton backend (``backend: "tensorrtllm"``) has no tokenizer. Instead its model parameter
``xgrammar_tokenizer_info_path`` names a JSON file that upstream makes with
``examples/generate_xgrammar_tokenizer_info.py`` (it loads ``AutoTokenizer.from_pretrained(model_dir)``,
calls ``_xgrammar_tokenizer_info()`` of ``tensorrt_llm/llmapi/tokenizer.py`` and ``json.dump``s the
result as ``xgrammar_tokenizer_info.json``). That script needs the ``tensorrt_llm`` package, which only a
GPU build machine has, so this module produces the same file from the checkpoint with ``transformers``
alone. No ``xgrammar`` dependency is needed: the file holds only the tokenizer's own data; xgrammar runs
inside the C++ backend.

The format, one JSON object with exactly these keys (upstream files read to learn it):

``encoded_vocab`` (list of str)
    Position ``i`` holds token id ``i``'s string exactly as the HF tokenizer stores it (``get_vocab()``:
    still encoded, e.g. ``Ġhello`` for byte-level BPE, ``▁hello`` and ``<0x0A>`` for SentencePiece with
    byte fallback, added/special tokens by their content). xgrammar decodes these itself, by the vocab
    type it detects from ``tokenizer_str``. Read by ``getGuidedDecodingConfigFromParams()`` in
    ``triton_backend/inflight_batcher_llm/src/model_instance_state.cc`` and passed as
    ``executor::GuidedDecodingConfig``'s encoded vocab; ``cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp``
    builds ``xgrammar::TokenizerInfo(encodedVocab, vocabType, vocabSizePadded, stopTokenIds, ...)`` from it,
    where the list position is the token id and the mask size is the engine's padded vocab size.
``tokenizer_str`` (str)
    The backend tokenizer serialized (``tokenizer.backend_tokenizer.to_str()``, i.e. tokenizer.json as
    the loaded tokenizer has it). guidedDecoder.cpp gives it to ``xgrammar::TokenizerInfo``'s
    ``DetectMetadataFromHF`` (xgrammar ``cpp/tokenizer_info.cc``), which reads only the ``decoder``
    (ByteLevel / ByteFallback / raw vocab type) and ``normalizer`` / ``pre_tokenizer`` (prefix space).
``stop_token_ids`` (list of int)
    ``[tokenizer.eos_token_id]``, as upstream's ``_xgrammar_tokenizer_info()``: the tokens the grammar
    lets through once it is complete. Upstream adds nothing else, and neither do we (not the extra
    ``eos_token_id`` entries of generation_config.json): ``GuidedDecodingConfig::validate()``
    (``cpp/tensorrt_llm/executor/guidedDecodingConfig.cpp``) warns that stop ids that differ from the
    requests' end id break xgrammar, and our frontend sends ``end_id = tokenizer.eos_token_id``
    (frontend/generation/trtllm_tensors.py), so a grammar that ended on another id would leave the request running.

Where we differ from upstream, deliberately:

* Ids with no token. Upstream sorts ``get_vocab()`` by id and keeps only the strings, so a gap in the
  ids (a tokenizer without some id) would shift every later token onto the wrong id. We keep positions
  equal to ids and put ``""`` at a gap, as xgrammar's own ``TokenizerInfo.from_huggingface()``
  (``python/xgrammar/tokenizer_info.py``) does; xgrammar treats an empty token as special (never allowed
  by a grammar).
* A model vocabulary larger than the tokenizer's (padded embeddings): nothing is added; the C++ side
  passes the engine's padded vocab size and xgrammar marks every id past the list as special, as
  upstream relies on.
* A tokenizer with more ids than the model (config.json ``vocab_size``; added tokens the model never
  emits): the list is cut at the model's vocab size, as ``from_huggingface(vocab_size=...)`` does, so
  xgrammar never sees an id beyond the engine's logits (TensorRT-LLM only ever pads that size up).
* Tokenizers without a ``tokenizers`` backend (slow / tiktoken): upstream writes the file without
  ``tokenizer_str`` for tiktoken, which the C++ backend cannot read (it requires all three keys), so we
  refuse them, and a tokenizer without an eos token, whose ``[null]`` the backend cannot read either.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from build_engine.errors import BuildError

# The keys getGuidedDecodingConfigFromParams() reads, in upstream's order.
ENCODED_VOCAB = "encoded_vocab"
TOKENIZER_STR = "tokenizer_str"
STOP_TOKEN_IDS = "stop_token_ids"
# Marks an id the tokenizer has no token for; xgrammar treats "" as a special (never allowed) token.
NO_TOKEN = ""


class XgrammarInfoError(BuildError):
    """The checkpoint's tokenizer cannot be described for the C++ backend's guided decoding."""


def tokenizer_info(checkpoint_dir: Path) -> dict[str, Any]:
    """The xgrammar tokenizer info of the checkpoint's tokenizer: ``{"encoded_vocab": [...],
    "tokenizer_str": "...", "stop_token_ids": [eos]}`` (see the module docstring for each key)."""
    from transformers import AutoTokenizer  # slow to import: only when needed

    checkpoint_dir = Path(checkpoint_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir))
    return info_from_tokenizer(tokenizer, model_vocab_size=model_vocab_size(checkpoint_dir), source=checkpoint_dir)


def write_tokenizer_info(checkpoint_dir: Path, out_path: Path) -> Path:
    """Write :func:`tokenizer_info` of ``checkpoint_dir`` as JSON to ``out_path`` (parents created; the
    file appears whole or not at all); return ``out_path``."""
    info = tokenizer_info(checkpoint_dir)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # Beside the target, then renamed over it; opened as usual (not mkstemp's 0600), so that a server
    # running as another user can read it like the engine files.
    tmp_path = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp_path, "w", encoding="utf-8") as f:
            # ASCII escapes, as upstream's json.dump: any JSON reader (nlohmann in the backend) decodes them.
            json.dump(info, f)
        os.replace(tmp_path, out_path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return out_path


def info_from_tokenizer(tokenizer: Any, *, model_vocab_size: int | None = None, source: object = "") -> dict[str, Any]:
    """The tokenizer info of a loaded ``transformers`` tokenizer; ``model_vocab_size`` (the model's
    ``vocab_size``) cuts off ids the model cannot produce. ``source`` only names it in errors."""
    where = f" of {source}" if str(source) else ""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise XgrammarInfoError(
            f"the tokenizer{where} ({type(tokenizer).__name__}) has no `tokenizers` backend (tokenizer.json); "
            "TensorRT-LLM's C++ guided decoding needs its serialized form (tokenizer_str)"
        )
    eos = tokenizer.eos_token_id
    if eos is None:
        raise XgrammarInfoError(
            f"the tokenizer{where} has no eos token; guided decoding needs it as the grammar's stop token"
        )
    vocab: dict[str, int] = tokenizer.get_vocab()  # added and special tokens included
    size = max(vocab.values(), default=-1) + 1
    if model_vocab_size is not None:
        size = min(size, model_vocab_size)
    encoded_vocab = [NO_TOKEN] * size
    for token, token_id in vocab.items():
        if 0 <= token_id < size:
            encoded_vocab[token_id] = token
    if not 0 <= eos < size:
        raise XgrammarInfoError(
            f"the eos token id {eos} of the tokenizer{where} is outside the model's vocabulary (size {size})"
        )
    return {
        ENCODED_VOCAB: encoded_vocab,
        TOKENIZER_STR: backend.to_str(),
        STOP_TOKEN_IDS: [int(eos)],
    }


def model_vocab_size(checkpoint_dir: Path) -> int | None:
    """The model's vocabulary size from config.json (``vocab_size``, or that of ``text_config`` for
    multimodal models); None when the checkpoint does not say."""
    path = Path(checkpoint_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for section in (config, config.get("text_config")):
        if isinstance(section, dict):
            value = section.get("vocab_size")
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
