"""RMSNorm on float32 rows as a numba loop (one of a decode step's small ops: see RMSNorm for why).

The row helper is also called from the int8 kernels (cpu_engine.int8), which put the norm before a projection
into the same call as the quantization of its input rows; one helper for both keeps the numbers the same bits
on every path (numba compiles it with its own floating-point flags, which stay on its instructions wherever
it is inlined; tests/unit/test_int8.py checks fused against unfused).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
import torch.nn.functional as F


@numba.njit(boundscheck=False, nogil=True, cache=True, fastmath={"reassoc", "nsz", "contract"})
def rms_norm_row(x, weight, eps, out):  # pragma: no cover
    """out = weight x x / sqrt(mean(x^2) + eps) for one row, in float32 as the checkpoint's module computes
    it (the sum of squares in another order: ~1e-7 apart)."""
    k = x.shape[0]
    total = np.float32(0.0)
    for j in range(k):
        total += x[j] * x[j]
    inverse = np.float32(1.0) / np.sqrt(total / np.float32(k) + eps)
    for j in range(k):
        out[j] = weight[j] * (x[j] * inverse)


@numba.njit(boundscheck=False, nogil=True, cache=True)
def rms_norm_rows(x, weight, eps):  # pragma: no cover
    """rms_norm_row for each row of x ([n, k] float32)."""
    n, k = x.shape
    out = np.empty((n, k), dtype=np.float32)
    for i in range(n):
        rms_norm_row(x[i], weight, eps, out[i])
    return out


class RMSNorm:
    """The checkpoint's RMSNorm. On float32 rows, one numba loop: PyTorch's `F.rms_norm` runs as five ops on
    CPU (8.6 us for a row of 768 against 3.1), which counts at batch 1, where a step runs 25 of them for a
    few hundred bytes each. Elsewhere (bfloat16, Qwen3's per-head norms) `F.rms_norm`, the same numbers as
    the module's seven small ops."""

    def __init__(self, module: torch.nn.Module):
        self.weight = module.weight.detach()
        self.eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        # float32 weights: the numba loop's (None: F.rms_norm only)
        self.weight_array = self.weight.numpy() if self.weight.dtype == torch.float32 else None
        self.eps32 = np.float32(self.eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_array is not None and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
            return torch.from_numpy(rms_norm_rows(x.numpy(), self.weight_array, self.eps32))
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
