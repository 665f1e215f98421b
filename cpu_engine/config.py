"""The CPU engine's build-time settings, read from `engine_config.json` in the engine directory.

`build_engine` writes that file; like a TensorRT-LLM engine, the engine directory fixes the batch size,
sequence length, KV block size, dtype and weight format, and the Triton config only adds runtime knobs
(threads, prefill pacing, the KV cache's size in tokens (`cpu_kv_cache_tokens`), whether prefixes are
reused (TensorRT-LLM's own `enable_kv_cache_reuse`) and the compute dtype for this machine (`cpu_dtype`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ENGINE_CONFIG_FILE = "engine_config.json"
DEFAULT_KV_BLOCK_SIZE = 16
# How the projections' weights are stored: the checkpoint's own floats, or the int8 copy the build made
# (cpu_engine.int8) in this file of the engine directory.
WEIGHT_FORMATS = ("float32", "int8")
INT8_WEIGHTS_FILE = "weights_int8.safetensors"
# `cpu_dtype` in the Triton config: the compute dtype, chosen at start-up (see resolve_dtype).
DTYPE_SETTINGS = ("engine", "auto", "float32", "bfloat16")
# `cpu_kv_cache_dtype`: the KV cache's element type. "auto": the compute dtype's; "bfloat16": half the bytes
# (cpu_engine.runner says where it can be had).
KV_CACHE_DTYPES = ("auto", "bfloat16")


def resolve_dtype(setting: str, built: str) -> str:
    """The compute dtype for `cpu_dtype` = `setting` on this machine. "engine" keeps the dtype the engine
    was built with (`--dtype`, float32 by default: the reference); "float32" and "bfloat16" force one;
    "auto" takes bfloat16 only where the CPU has AMX tiles, float32 everywhere else. Measured on a 2-core
    AMD EPYC with AVX512-BF16 but no AMX (benchmarks.engine_bench --only w): bfloat16 gained nothing at
    batch 1 and made batch-16 steps ~4x slower (its decode attention gathers the KV blocks, the float32
    kernel reads them in place), so native bfloat16 dot products alone do not earn it. AMX is where
    oneDNN's bfloat16 GEMMs run on tiles (prompt chunks, large batches); not measured here."""
    if setting not in DTYPE_SETTINGS:
        raise ValueError(f"cpu_dtype must be one of {DTYPE_SETTINGS}, got {setting!r}")
    if setting == "engine":
        return built
    if setting == "auto":
        import torch

        return "bfloat16" if torch.cpu._is_amx_tile_supported() else "float32"
    return setting


@dataclass(frozen=True)
class EngineConfig:
    checkpoint_dir: Path
    dtype: str = "float32"
    max_batch_size: int = 16
    max_seq_len: int = 1024
    max_num_tokens: int = 512
    num_threads: int = 0  # 0: every core this process may run on
    prefill_step_ratio: float = 1.75  # see scheduler.PrefillBudget
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE  # tokens per KV-cache block (TensorRT-LLM's tokens_per_block)
    kv_cache_tokens: int = 0  # the KV pool's size in tokens; 0: max_batch_size x max_seq_len
    enable_prefix_reuse: bool = True  # keep full blocks after a request ends and share them by content
    int8_weights: Path | None = None  # the engine's INT8_WEIGHTS_FILE (--weights int8); None: float weights
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    @property
    def weights(self) -> str:
        """The weight format, one of WEIGHT_FORMATS."""
        return "float32" if self.int8_weights is None else "int8"

    @property
    def kv_cache_blocks(self) -> int:
        """Blocks in the pool: the tokens asked for, rounded up to whole blocks."""
        tokens = self.kv_cache_tokens or self.max_batch_size * self.max_seq_len
        return -(-tokens // self.kv_block_size)

    @classmethod
    def from_engine_dir(cls, engine_dir: Path, num_threads: int = 0, max_num_tokens: int = 0,
                        prefill_step_ratio: float = 1.75, kv_cache_tokens: int = 0,
                        enable_prefix_reuse: bool = True, cpu_dtype: str = "engine",
                        kv_cache_dtype: str = "auto") -> "EngineConfig":
        """`max_num_tokens` > 0 overrides the built value (the Triton config's runtime setting), and
        `cpu_dtype` may override the built dtype (resolve_dtype)."""
        path = Path(engine_dir) / ENGINE_CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: build the engine first (make engine)")
        raw = json.loads(path.read_text())
        if raw.get("backend", "cpu") != "cpu":
            raise ValueError(f"{path} describes a {raw.get('backend')!r} engine, not a CPU engine")
        weights = raw.get("weights", "float32")
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"{path}: weights {weights!r} is not one of {WEIGHT_FORMATS}")
        return cls(
            checkpoint_dir=Path(raw["checkpoint_dir"]),
            dtype=resolve_dtype(cpu_dtype, raw.get("dtype", "float32")),
            max_batch_size=int(raw["max_batch_size"]),
            max_seq_len=int(raw["max_seq_len"]),
            max_num_tokens=max_num_tokens or int(raw["max_num_tokens"]),
            num_threads=num_threads,
            prefill_step_ratio=prefill_step_ratio,
            kv_block_size=int(raw.get("kv_block_size", DEFAULT_KV_BLOCK_SIZE)),
            kv_cache_tokens=kv_cache_tokens,
            enable_prefix_reuse=enable_prefix_reuse,
            int8_weights=Path(engine_dir) / INT8_WEIGHTS_FILE if weights == "int8" else None,
            kv_cache_dtype=kv_cache_dtype,
        )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"cpu_kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be at least 1, got {self.kv_block_size}")
        if self.kv_cache_tokens < 0:
            raise ValueError(f"the KV cache size must be a positive number of tokens, got {self.kv_cache_tokens}")
