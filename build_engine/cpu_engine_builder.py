"""The CPU engine "build": no compilation, the settings the CPU engine loads the checkpoint with and, for
``--weights int8``, the int8 copy of its projections.

Recording them in ``engine_config.json`` gives the CPU engine the same shape as a TensorRT-LLM engine
directory (an engine dir whose config fixes dtype and limits), so the model repository treats both alike.
Quantizing at build time (seconds for the demo presets) keeps it out of every start, and the numbers an
engine serves with are fixed with the engine, like a TensorRT-LLM engine's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from build_engine.checkpoint import CheckpointInfo
from build_engine.errors import BuildError
from build_engine.limits import EngineLimits
from cpu_engine.config import INT8_WEIGHTS_FILE, WEIGHT_FORMATS

ENGINE_CONFIG_FILE = "engine_config.json"
DTYPES = ("float32", "bfloat16")
KV_BLOCK_SIZE = 16  # tokens per KV-cache block: the prefix cache shares whole blocks


def cpu_engine_config(
    checkpoint: CheckpointInfo,
    *,
    served_model_name: str,
    dtype: str,
    weights: str = "float32",
    limits: EngineLimits,
    source: dict[str, str],
    kv_cache_tokens: int | None = None,
) -> dict[str, Any]:
    """The content of ``engine_config.json`` for the CPU engine. ``kv_cache_tokens`` sizes the paged KV
    cache (default: as much as max_batch_size full-length sequences, what the engine held before it was
    paged); at least one full-length sequence must fit."""
    import torch
    import transformers

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if weights not in WEIGHT_FORMATS:
        raise BuildError(f"--weights {weights} is not supported by the CPU engine; "
                         f"use one of {', '.join(WEIGHT_FORMATS)}")
    if kv_cache_tokens is None:
        kv_cache_tokens = limits.max_batch_size * limits.max_seq_len
    if kv_cache_tokens < limits.max_seq_len:
        raise BuildError(f"--kv-cache-tokens {kv_cache_tokens} is below --max-seq-len {limits.max_seq_len}: "
                         "the KV cache must hold at least one full-length sequence")
    return {
        "backend": "cpu",
        "checkpoint_dir": str(checkpoint.directory),
        "served_model_name": served_model_name,
        "architecture": checkpoint.architecture,
        "dtype": dtype,
        "weights": weights,
        "max_batch_size": limits.max_batch_size,
        "max_seq_len": limits.max_seq_len,
        "max_num_tokens": limits.max_num_tokens,
        "kv_cache_tokens": kv_cache_tokens,
        "kv_block_size": KV_BLOCK_SIZE,
        "source": source,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def write_engine_config(engine_dir: Path, config: dict[str, Any]) -> None:
    """Write ``<engine_dir>/engine_config.json`` atomically: readers never see a partial file."""
    engine_dir.mkdir(parents=True, exist_ok=True)
    staging = engine_dir / f".{ENGINE_CONFIG_FILE}.tmp"
    staging.write_text(json.dumps(config, indent=2) + "\n")
    staging.replace(engine_dir / ENGINE_CONFIG_FILE)


def write_int8_weights(checkpoint_dir: Path, engine_dir: Path) -> Path:
    """Quantize every projection of the checkpoint (fused as the engine runs them) to int8 with per-channel
    scales, into the engine directory; returns the file."""
    import torch
    from transformers import AutoModelForCausalLM

    from cpu_engine.int8 import save_int8_weights
    from cpu_engine.runner import fused_projections

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    engine_dir.mkdir(parents=True, exist_ok=True)
    path = engine_dir / INT8_WEIGHTS_FILE
    save_int8_weights(path, {name: weight for name, (weight, _) in fused_projections(model).items()})
    return path
