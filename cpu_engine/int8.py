"""Weight-only int8: the per-channel quantization done at build time, its file, and its projection.

Decode is bound by reading the weights from memory, so an int8 copy of every projection (a quarter of
float32's bytes, with one scale per output channel) makes a small-batch step faster; activations stay
floating point. The build quantizes (`python -m build_engine --weights int8`) and stores the result in the
engine directory (`cpu_engine.config.INT8_WEIGHTS_FILE`), so every start loads the same numbers without
quantizing again.

The matmul is PyTorch's `torch._weight_int8pack_mm` (the fused kernel torchchat and gpt-fast use for int8
weight-only on CPU), with bfloat16 activations: with float32 activations it took 5x (1 row) to 25x (16
rows) the CPU time on this AMD EPYC (AVX-512, AVX512-BF16, no AMX). Measured on the `small`
preset's projections (CPU ms per step, 1 thread, medians of interleaved rounds): 17.6 against 39.0 for
float32 on oneDNN at 1 row, 22 against 34 at 4 rows, 62 against 52 at 16, 708 against 428 at 256. Its
result for a row does not depend on the other rows, so a greedy sequence decodes the same alone and batched.
"""

from __future__ import annotations

from pathlib import Path

import torch

# Scales are bfloat16, the kernel's own dtype; quantizing with the rounded scale makes q x scale the
# weight's closest int8 picture for the scale the kernel will actually use.
SCALE_DTYPE = torch.bfloat16
_QUANT_MAX = 127  # symmetric: -127..127, so that negation is exact
_FORMAT = {"format": "int8 weight-only, symmetric, one bfloat16 scale per output channel", "version": "1"}


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([out, in] int8, [out] bfloat16 scales) with weight ~= q * scale[:, None], row by row."""
    weight = weight.detach().float()
    amax = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
    scale = (amax / _QUANT_MAX).to(SCALE_DTYPE)
    q = torch.round(weight / scale.float()[:, None]).clamp(-_QUANT_MAX, _QUANT_MAX).to(torch.int8)
    return q.contiguous(), scale


class Int8Projection:
    """`x @ dequant(q).T + bias` on the int8 kernel; returns x's dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"int8 weight [out, in] and [out] scales expected, got {q.dtype} {tuple(q.shape)} "
                             f"and {tuple(scale.shape)}")
        # Copies in memory of our own: a tensor read from a safetensors file may sit at an address the
        # kernel's aligned vector loads crash on (seen: a segfault on the `layers.0.qkv` of a test model).
        self.q = q.clone(memory_format=torch.contiguous_format)
        self.scale = scale.to(SCALE_DTYPE).clone()
        self.bias = bias

    @property
    def nbytes(self) -> int:
        """What one call reads of the weights, scales and bias."""
        return self.q.nbytes + self.scale.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int8pack_mm(x.to(SCALE_DTYPE), self.q, self.scale).to(x.dtype)
        return out if self.bias is None else out + self.bias


def save_int8_weights(path: Path, weights: dict[str, torch.Tensor]) -> None:
    """Quantize each named float weight and store them all in one safetensors file, atomically: a
    half-written file never sits where the engine would load it."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, weight in weights.items():
        tensors[f"{name}.q"], tensors[f"{name}.scale"] = quantize_per_channel(weight)
    staging = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(staging), metadata=_FORMAT)
    staging.replace(path)


def load_int8_weights(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (int8 weight, scales), as `save_int8_weights` stored them."""
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: rebuild the engine with --weights int8")
    with safe_open(str(path), framework="pt") as handle:
        if handle.metadata() != _FORMAT:
            raise ValueError(f"{path} holds {handle.metadata()}, not {_FORMAT}: rebuild the engine")
        names = {key.rsplit(".", 1)[0] for key in handle.keys()}
        return {name: (handle.get_tensor(f"{name}.q"), handle.get_tensor(f"{name}.scale")) for name in names}
