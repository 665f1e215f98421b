"""LoRA adapters as users have them (Hugging Face PEFT directories), converted once to the engines' tensors.

Both engines take TensorRT-LLM's per-request LoRA tensors (cpu_engine/lora.py says the layout): `lora_config`
[rows, 3] int32 (module id, layer, rank) and `lora_weights` [rows, width] in the engine's dtype, A then B with the
PEFT scale folded into B. An adapter is read and checked here, at load, so that a bad one is a 400 that changes
nothing serving, never an engine error mid-request. The reader is numpy only (safetensors is a JSON header and
raw little-endian arrays): the frontend needs no torch.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# TensorRT-LLM's LoraModule::ModuleType ids (runtime/loraModule.h) of the Llama projections PEFT names.
MODULE_IDS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6, "up_proj": 7}
# TensorRT-LLM's names of the same modules (trtllm-build --lora_target_modules).
TRTLLM_MODULES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_dense",
                  "gate_proj": "mlp_h_to_4h", "down_proj": "mlp_4h_to_h", "up_proj": "mlp_gate"}
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_HEADER_MAX = 100 << 20


class AdapterError(ValueError):
    """An adapter that cannot be served (a 400 at load)."""


@dataclass(frozen=True)
class BaseShapes:
    """The base model's per-module (in, out) features and layer count, from its config.json."""

    num_layers: int
    dims: dict[str, tuple[int, int]]

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Path) -> "BaseShapes":
        config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        q, kv = heads * head_dim, int(config.get("num_key_value_heads", heads)) * head_dim
        inter = int(config["intermediate_size"])
        return cls(int(config["num_hidden_layers"]),
                   {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                    "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)})


@dataclass(frozen=True)
class LoraTensors:
    """An adapter in the engines' layout, with what /v1/models and the limits need."""

    weights: np.ndarray  # float32 [rows, width]; cast to the engine's dtype when sent
    config: np.ndarray  # int32 [rows, 3]
    rank: int
    modules: tuple[str, ...]
    checksum: int  # of the converted tensors: the same directory reloaded keeps its task id only if unchanged

    @property
    def nbytes(self) -> int:
        return int(self.weights.nbytes)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 numpy arrays (F32, F16, BF16); AdapterError if corrupt."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise AdapterError(f"cannot read {path.name}: {exc.strerror or exc}") from exc
    if len(data) < 8:
        raise AdapterError(f"{path.name} is not a safetensors file (too short)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(_HEADER_MAX, len(data) - 8):
        raise AdapterError(f"{path.name} is not a safetensors file (bad header length)")
    try:
        header = json.loads(data[8:8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path.name} is not a safetensors file (bad header)") from exc
    body = memoryview(data)[8 + size:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
        if dtype is None:
            raise AdapterError(f"{path.name}: tensor {name} has dtype {info.get('dtype') if isinstance(info, dict) else '?'}"
                               f"; supported: {', '.join(_DTYPES)}")
        start, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        if not 0 <= start <= end <= len(body) or (end - start) != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise AdapterError(f"{path.name} is truncated or corrupt (tensor {name})")
        array = np.frombuffer(body[start:end], dtype=dtype).reshape(shape)
        if info["dtype"] == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = array.astype(np.float32)
    return tensors


def convert_peft(adapter_dir: Path, max_rank: int, base: BaseShapes | None) -> LoraTensors:
    """A PEFT LoRA directory as `lora_weights`/`lora_config`, checked against `base` and `max_rank`."""
    adapter_dir = Path(adapter_dir)
    try:
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{adapter_dir.name}: no readable adapter_config.json") from exc
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not supported: LoRA only")
    for unsupported in ("use_dora", "fan_in_fan_out"):
        if config.get(unsupported):
            raise AdapterError(f"{unsupported} adapters are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("modules_to_save"):
        raise AdapterError("rank_pattern, alpha_pattern and modules_to_save are not supported")
    tensors = read_safetensors(adapter_dir / "adapter_model.safetensors")
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise AdapterError(f"tensor {key} is not a LoRA A/B of a layer's projection")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in MODULE_IDS:
            raise AdapterError(f"module {module} is not supported; supported: {', '.join(MODULE_IDS)}")
        pairs.setdefault((layer, module), {})[which] = value
    if not pairs:
        raise AdapterError("the adapter holds no LoRA weights")
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    rows, entries, rank = [], [], 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module}: lora_A and lora_B go together")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != r:
            raise AdapterError(f"layer {layer} {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} disagree")
        if r > max_rank:
            raise AdapterError(f"rank {r} is over the maximum of {max_rank} (LORA_MAX_RANK)")
        if base is not None:
            if layer >= base.num_layers:
                raise AdapterError(f"layer {layer}: the base model has {base.num_layers} layers")
            if (a.shape[1], b.shape[0]) != base.dims[module]:
                raise AdapterError(f"layer {layer} {module} is {a.shape[1]} -> {b.shape[0]}, the base model's "
                                   f"{base.dims[module][0]} -> {base.dims[module][1]}: an adapter of another model")
        scale = alpha / (np.sqrt(r) if config.get("use_rslora") else r)
        rows.append(np.concatenate([a.reshape(-1), (b * scale).reshape(-1)]))
        entries.append((MODULE_IDS[module], layer, r))
        rank = max(rank, r)
    width = max(row.shape[0] for row in rows)
    weights = np.zeros((len(rows), width), dtype=np.float32)
    for i, row in enumerate(rows):
        weights[i, :row.shape[0]] = row
    config_rows = np.array(entries, dtype=np.int32)
    checksum = zlib.crc32(config_rows.tobytes(), zlib.crc32(weights.tobytes()))
    modules = tuple(sorted({module for _, module in pairs}))
    return LoraTensors(weights, config_rows, rank, modules, checksum)
