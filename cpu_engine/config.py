"""The CPU engine's build-time settings, read from `engine_config.json` in the engine directory.

`build_engine` writes that file; like a TensorRT-LLM engine, the engine directory fixes the batch size,
sequence length, KV block size and dtype, and the Triton config only adds runtime knobs (threads, prefill
pacing, the KV cache's size in tokens (`cpu_kv_cache_tokens`) and whether prefixes are reused
(TensorRT-LLM's own `enable_kv_cache_reuse`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ENGINE_CONFIG_FILE = "engine_config.json"
DEFAULT_KV_BLOCK_SIZE = 16


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

    @property
    def kv_cache_blocks(self) -> int:
        """Blocks in the pool: the tokens asked for, rounded up to whole blocks."""
        tokens = self.kv_cache_tokens or self.max_batch_size * self.max_seq_len
        return -(-tokens // self.kv_block_size)

    @classmethod
    def from_engine_dir(cls, engine_dir: Path, num_threads: int = 0, max_num_tokens: int = 0,
                        prefill_step_ratio: float = 1.75, kv_cache_tokens: int = 0,
                        enable_prefix_reuse: bool = True) -> "EngineConfig":
        """`max_num_tokens` > 0 overrides the built value (the Triton config's runtime setting)."""
        path = Path(engine_dir) / ENGINE_CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: build the engine first (make engine)")
        raw = json.loads(path.read_text())
        if raw.get("backend", "cpu") != "cpu":
            raise ValueError(f"{path} describes a {raw.get('backend')!r} engine, not a CPU engine")
        return cls(
            checkpoint_dir=Path(raw["checkpoint_dir"]),
            dtype=raw.get("dtype", "float32"),
            max_batch_size=int(raw["max_batch_size"]),
            max_seq_len=int(raw["max_seq_len"]),
            max_num_tokens=max_num_tokens or int(raw["max_num_tokens"]),
            num_threads=num_threads,
            prefill_step_ratio=prefill_step_ratio,
            kv_block_size=int(raw.get("kv_block_size", DEFAULT_KV_BLOCK_SIZE)),
            kv_cache_tokens=kv_cache_tokens,
            enable_prefix_reuse=enable_prefix_reuse,
        )

    def __post_init__(self) -> None:
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be at least 1, got {self.kv_block_size}")
        if self.kv_cache_tokens < 0:
            raise ValueError(f"the KV cache size must be a positive number of tokens, got {self.kv_cache_tokens}")
