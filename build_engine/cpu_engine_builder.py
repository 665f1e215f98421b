"""The CPU engine "build": no compilation, just the settings the CPU engine loads the checkpoint with.

Recording them in ``engine_config.json`` gives the CPU engine the same shape as a TensorRT-LLM engine
directory (an engine dir whose config fixes dtype and limits), so the model repository treats both alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from build_engine.checkpoint import CheckpointInfo
from build_engine.limits import EngineLimits

ENGINE_CONFIG_FILE = "engine_config.json"
DTYPES = ("float32", "bfloat16")


def cpu_engine_config(
    checkpoint: CheckpointInfo,
    *,
    served_model_name: str,
    dtype: str,
    limits: EngineLimits,
    source: dict[str, str],
) -> dict[str, Any]:
    """The content of ``engine_config.json`` for the CPU engine."""
    import torch
    import transformers

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return {
        "backend": "cpu",
        "checkpoint_dir": str(checkpoint.directory),
        "served_model_name": served_model_name,
        "architecture": checkpoint.architecture,
        "dtype": dtype,
        "max_batch_size": limits.max_batch_size,
        "max_seq_len": limits.max_seq_len,
        "max_num_tokens": limits.max_num_tokens,
        "source": source,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def write_engine_config(engine_dir: Path, config: dict[str, Any]) -> None:
    """Write ``<engine_dir>/engine_config.json`` atomically: readers never see a partial file."""
    engine_dir.mkdir(parents=True, exist_ok=True)
    staging = engine_dir / f".{ENGINE_CONFIG_FILE}.tmp"
    staging.write_text(json.dumps(config, indent=2) + "\n")
    staging.replace(engine_dir / ENGINE_CONFIG_FILE)
