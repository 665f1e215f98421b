"""A decoder layer's small per-row ops on float32 as numba loops: RMSNorm, SiLU, rotary with the KV cache store.

At batch 1 each PyTorch op costs microseconds of Python and dispatch, more than its arithmetic (see RMSNorm).
The row helpers are also called from the int8 kernels (cpu_engine.int8, cpu_engine.vnni_gemm) and from the
int8 engine's decode step in one call (cpu_engine.fused_step), which put the norm before a projection or the
gate's SiLU into the same call as the quantization of its input rows; one helper for every path keeps the
numbers the same bits on all of them (numba compiles a helper with its own floating-point flags, which stay
on its instructions wherever it is inlined; tests/unit/test_int8.py checks fused against unfused).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
import torch.nn.functional as F
from numba import types
from numba.extending import overload


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


@numba.njit(boundscheck=False, nogil=True, cache=True)
def silu(x):  # pragma: no cover
    """x / (1 + exp(-x)) in float32, exp from the C library: the same bits in every loop it is inlined into
    (numba vectorises exp with Intel's SVML only where icc_rt is installed, which this project does not ship;
    tests/unit/test_int8.py would catch fused and unfused layers apart). The int8 engine's SiLU (FusedLayer):
    PyTorch's vectorised exp can differ from it in the last bit, and the int8 decode step computes the gate
    inside one numba call."""
    return x / (np.float32(1.0) + np.exp(-x))


@numba.njit(boundscheck=False, nogil=True, cache=True)
def silu_rows(x):  # pragma: no cover
    """silu of each element of x ([n, k] float32, any strides), as a new array."""
    n, k = x.shape
    out = np.empty((n, k), dtype=np.float32)
    for i in range(n):
        for j in range(k):
            out[i, j] = silu(x[i, j])
    return out


def silu_of(x: torch.Tensor) -> torch.Tensor:
    """`silu` on float32 rows, as a PyTorch op would be called (the int8 engine's unfused layers)."""
    return torch.from_numpy(silu_rows(x.numpy()))


# What a projection's row kernel (vnni_gemm.project_rows, float32_gemm.project_rows) multiplies: the rows as
# they are, RMSNorm of them, or silu(gate) x up of rows [gate | up].
PLAIN, NORMED, GATED = 0, 1, 2
NO_ROW, NO_ROWS = np.empty(0, dtype=np.float32), np.empty((0, 0), dtype=np.float32)  # "none" for numba


@numba.njit(nogil=True, cache=True)
def keep_alive(*arrays):  # pragma: no cover
    """Nothing: called after a C kernel with the arrays whose addresses it was given. numba frees an array after
    its last use, and taking `.ctypes.data` is the last use unless something follows: the memory could go back
    to the allocator before the kernel reads it, and be handed out again in between (the kernel's OpenMP
    runtime allocates as it starts a team: rows of codes read as other bytes)."""


@numba.njit(boundscheck=False, nogil=True, cache=True)
def input_row(x, mode, norm_weight, eps, out):  # pragma: no cover
    """out = RMSNorm(x) (NORMED, weights `norm_weight`) or silu(gate) x up for x = [gate | up] (GATED): the
    ops before a projection, computed for its row kernel."""
    if mode == NORMED:
        rms_norm_row(x, norm_weight, eps, out)
    else:
        k = out.shape[0]
        for j in range(k):
            out[j] = silu(x[j]) * x[k + j]


def store_row(pool_row, values):  # pragma: no cover
    """pool_row [kv_heads, head_dim] <- values (float32): as they are into a float32 pool; rounded to bfloat16
    (nearest, ties to even, as torch rounds) into a bfloat16 pool held as uint16."""
    raise NotImplementedError("called from numba only")


@overload(store_row, inline="always")
def _store_row_for(pool_row, values):  # pragma: no cover
    if pool_row.dtype == types.uint16:
        def to_bfloat16(pool_row, values):
            bits = values.view(np.uint32)
            for g in range(values.shape[0]):
                for d in range(values.shape[1]):
                    b = bits[g, d]
                    pool_row[g, d] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
                                               >> np.uint32(16))
        return to_bfloat16

    def copy(pool_row, values):
        for g in range(values.shape[0]):
            for d in range(values.shape[1]):
                pool_row[g, d] = values[g, d]
    return copy


@numba.njit(boundscheck=False, nogil=True, cache=True)
def rotate_and_store(qkv, heads, kv_heads, cos, sin_signed, places, k_pool, v_pool, q_out):  # pragma: no cover
    """Rotary on q and k (x cos + roll(x, head_dim / 2) sin_signed, each product rounded as PyTorch's three ops
    round them) into q_out and, with v, into each token's row of the layer's pool (`places`): one call for the
    nine small ops a layer ran for it. qkv [T, (heads + 2 kv_heads) x head_dim] (the qkv projection's rows),
    cos / sin_signed [T, 1, head_dim] (float32 views, any strides), q_out [T, heads, head_dim]. The pools are
    float32, or bfloat16 as uint16 (each value rounded to the nearest, ties to even: store_row)."""
    tokens, dim = qkv.shape[0], q_out.shape[2]
    half = dim // 2
    v_start = (heads + kv_heads) * dim
    k_row = np.empty((kv_heads, dim), np.float32)
    v_row = np.empty((kv_heads, dim), np.float32)
    for t in range(tokens):
        place = places[t]
        for h in range(heads + kv_heads):
            base = h * dim
            for d in range(dim):
                partner = qkv[t, base + d + half] if d < half else qkv[t, base + d - half]
                value = qkv[t, base + d] * cos[t, 0, d] + partner * sin_signed[t, 0, d]
                if h < heads:
                    q_out[t, h, d] = value
                else:
                    k_row[h - heads, d] = value
        for h in range(kv_heads):
            for d in range(dim):
                v_row[h, d] = qkv[t, v_start + h * dim + d]
        store_row(k_pool[place], k_row)
        store_row(v_pool[place], v_row)
