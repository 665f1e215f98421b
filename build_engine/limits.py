"""Engine capacity limits: defaults and the checks that keep them consistent with the checkpoint.

Shared by every backend, because the frontend and the Triton configs read the same numbers whichever
engine serves them.
"""

from __future__ import annotations

from dataclasses import dataclass

from build_engine.errors import BuildError

DEFAULT_MAX_BATCH_SIZE = 32
TINY_MAX_BATCH_SIZE = 16  # the tiny preset serves tests, which never need more
DEFAULT_MAX_SEQ_LEN_CAP = 2048
DEFAULT_MAX_NUM_TOKENS = 512


@dataclass(frozen=True)
class EngineLimits:
    """Capacity of an engine: concurrent sequences, tokens per sequence, tokens per engine step."""

    max_batch_size: int
    max_seq_len: int
    max_num_tokens: int


def resolve_limits(
    *,
    max_position_embeddings: int,
    preset: str | None,
    max_batch_size: int | None,
    max_seq_len: int | None,
    max_num_tokens: int | None,
) -> EngineLimits:
    """Fill unset limits with defaults and reject combinations the engine cannot honour."""
    limits = EngineLimits(
        max_batch_size=max_batch_size
        if max_batch_size is not None
        else (TINY_MAX_BATCH_SIZE if preset == "tiny" else DEFAULT_MAX_BATCH_SIZE),
        max_seq_len=max_seq_len
        if max_seq_len is not None
        else min(max_position_embeddings, DEFAULT_MAX_SEQ_LEN_CAP),
        max_num_tokens=max_num_tokens if max_num_tokens is not None else DEFAULT_MAX_NUM_TOKENS,
    )
    if limits.max_batch_size < 1:
        raise BuildError(f"--max-batch-size must be at least 1, got {limits.max_batch_size}")
    if limits.max_seq_len < 2:
        raise BuildError(
            "--max-seq-len must be at least 2 (one prompt token plus one generated), "
            f"got {limits.max_seq_len}"
        )
    if limits.max_seq_len > max_position_embeddings:
        raise BuildError(
            f"--max-seq-len {limits.max_seq_len} exceeds the model's context length "
            f"({max_position_embeddings} positions in config.json)"
        )
    if limits.max_num_tokens < 1:
        raise BuildError(f"--max-num-tokens must be at least 1, got {limits.max_num_tokens}")
    # Each engine step decodes one token for every active sequence, so a full batch must fit in one step.
    if limits.max_num_tokens < limits.max_batch_size:
        raise BuildError(
            f"--max-num-tokens {limits.max_num_tokens} is below --max-batch-size {limits.max_batch_size}: "
            "every engine step decodes one token per active sequence, so it must be at least the batch size"
        )
    return limits
