"""The CPU engine's build-time settings, read from `engine_config.json` in the engine directory.

`build_engine` writes that file; like a TensorRT-LLM engine, the engine directory fixes the batch size,
sequence length and dtype, and the Triton config only adds runtime knobs (threads, prefill pacing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ENGINE_CONFIG_FILE = "engine_config.json"


@dataclass(frozen=True)
class EngineConfig:
    checkpoint_dir: Path
    dtype: str = "float32"
    max_batch_size: int = 16
    max_seq_len: int = 1024
    max_num_tokens: int = 512
    num_threads: int = 0  # 0: every core this process may run on
    prefill_step_ratio: float = 1.75  # see scheduler.PrefillBudget

    @classmethod
    def from_engine_dir(cls, engine_dir: Path, num_threads: int = 0, max_num_tokens: int = 0,
                        prefill_step_ratio: float = 1.75) -> "EngineConfig":
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
        )
