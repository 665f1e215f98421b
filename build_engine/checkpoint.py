"""Validate a Hugging Face causal-LM checkpoint directory before anything is built from it.

Failing here, with a message naming what is missing, is far cheaper than a tritonserver that fails to load
a model minutes later with an error about some file deep inside the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from build_engine.errors import BuildError

VALID_LAYOUT = (
    "a valid checkpoint directory is a Hugging Face causal LM saved with save_pretrained: config.json "
    "(architectures such as ['LlamaForCausalLM']), weights (*.safetensors or pytorch_model*.bin) and "
    "tokenizer files (tokenizer.json or equivalent, tokenizer_config.json)"
)
# Config keys that hold the context length, in the order model families use them (GPT-2 uses n_positions).
CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


class CheckpointError(BuildError):
    """The checkpoint directory cannot be served; the message says what is missing."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What the engine build needs to know about a validated checkpoint."""

    directory: Path
    architecture: str
    max_position_embeddings: int


def validate_checkpoint(directory: Path) -> CheckpointInfo:
    """Check ``directory`` is a loadable causal-LM checkpoint; raise :class:`CheckpointError` if not."""
    directory = Path(directory).resolve()
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist; {VALID_LAYOUT}")
    config = _read_config(directory)
    architecture = _causal_lm_architecture(directory, config)
    context_length = _context_length(directory, config)
    _check_weights(directory)
    _check_tokenizer(directory)
    return CheckpointInfo(directory, architecture, context_length)


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no config.json; {VALID_LAYOUT}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); {VALID_LAYOUT}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object; {VALID_LAYOUT}")
    return config


def _causal_lm_architecture(directory: Path, config: dict[str, Any]) -> str:
    architectures = config.get("architectures") or []
    for name in architectures:
        if isinstance(name, str) and name.endswith("ForCausalLM"):
            return name
    raise CheckpointError(
        f"{directory}/config.json does not describe a causal language model: architectures is "
        f"{architectures!r}, expected an entry ending in 'ForCausalLM'; {VALID_LAYOUT}"
    )


def _context_length(directory: Path, config: dict[str, Any]) -> int:
    for key in CONTEXT_LENGTH_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    raise CheckpointError(
        f"{directory}/config.json states no context length (looked for {', '.join(CONTEXT_LENGTH_KEYS)})"
    )


def _check_weights(directory: Path) -> None:
    if any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin")):
        return
    raise CheckpointError(
        f"{directory} has no model weights (no *.safetensors or pytorch_model*.bin); {VALID_LAYOUT}"
    )


def _check_tokenizer(directory: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as exc:  # transformers raises many types here; all mean the same to the user
        raise CheckpointError(
            f"no tokenizer could be loaded from {directory} ({type(exc).__name__}: {exc}); {VALID_LAYOUT}"
        ) from exc
    if len(tokenizer) == 0:
        raise CheckpointError(
            f"the tokenizer loaded from {directory} has an empty vocabulary; {VALID_LAYOUT}"
        )
