"""The values that fill the model repository templates for one engine.

Static per-backend settings live in ``model_repository/values/<backend>.json`` beside the templates they
fill; the values that depend on the build (paths, limits, name) are computed from the engine config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from build_engine.errors import BuildError


def static_values(template_dir: Path, backend: str) -> dict[str, str]:
    """Load ``<template_dir>/values/<backend>.json``: a flat object of string values."""
    path = Path(template_dir) / "values" / f"{backend}.json"
    if not path.is_file():
        raise BuildError(f"no template values for backend {backend!r}: {path} does not exist")
    values = json.loads(path.read_text())
    if not isinstance(values, dict):
        raise BuildError(f"{path} must hold a JSON object of string values")
    # Strings only: json's true/1 would render as Python's True/1 and not as the text Triton expects.
    not_strings = sorted(key for key, value in values.items() if not isinstance(value, str))
    if not_strings:
        raise BuildError(f"{path}: values must be JSON strings (quote them): {', '.join(not_strings)}")
    return values


DEFAULT_MAX_LORA_RANK = 64


def engine_values(engine_config: Mapping[str, Any], engine_dir: Path) -> dict[str, str]:
    """Template values that come from the engine just built."""
    return {
        "engine_dir": str(Path(engine_dir).resolve()),
        "tokenizer_dir": str(Path(engine_config["checkpoint_dir"]).resolve()),
        "triton_max_batch_size": str(engine_config["max_batch_size"]),
        "max_seq_len": str(engine_config["max_seq_len"]),
        "max_num_tokens": str(engine_config["max_num_tokens"]),
        # The CPU engine's paged KV cache; TensorRT-LLM ignores it (it sizes its own by memory fraction).
        "cpu_kv_cache_tokens": str(engine_config.get("kv_cache_tokens", 0)),
        "served_model_name": str(engine_config["served_model_name"]),
        # TensorRT-LLM builds write it (build_engine/xgrammar_info.py); empty for the CPU engine.
        "xgrammar_tokenizer_info_path": str(engine_config.get("xgrammar_tokenizer_info") or ""),
        # The largest LoRA rank: a TensorRT-LLM engine's --max-lora-rank; the CPU engine takes up to 64.
        "lora_cache_max_adapter_size": str(engine_config.get("max_lora_rank") or DEFAULT_MAX_LORA_RANK),
    }


def repository_values(
    template_dir: Path, backend: str, engine_config: Mapping[str, Any], engine_dir: Path
) -> dict[str, str]:
    """All template values for ``backend``; a key set both statically and dynamically is a mistake."""
    static = static_values(template_dir, backend)
    dynamic = engine_values(engine_config, engine_dir)
    clash = sorted(static.keys() & dynamic.keys())
    if clash:
        raise BuildError(f"values/{backend}.json sets keys the build computes: {', '.join(clash)}")
    return {**static, **dynamic}
