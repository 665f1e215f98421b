"""The int8 engine's own GEMM for CPUs with AVX-512 VNNI (`int8_gemm.c`): compiled on first use, its packed
weight layout, and the row kernel that quantizes a projection's input rows and calls it.

Why our own: at batch 1 a decode step is the weights read from memory, and FBGEMM's int8 product (the kernel
used before, still used on CPUs without VNNI) read them at ~25 GB/s and cost ~8.6 us a call of fixed work
(packing the activations, its code cache) on top; a step makes 49 calls. The kernel here streams each block
of 32 output channels once (`vpdpbusd`: 64 products a register into int32), tiles up to 4 rows x 64 channels
so larger batches reuse each loaded register, and scales, adds the bias and the residual in the same pass.
Measured on a 2-core AMD EPYC (AVX-512 VNNI), all 49 projections of a `small` step, one thread, against
FBGEMM's op on the same rows (the prototype's loop, three rounds): 1 row 2.3-2.5 ms against 3.2-3.6 (~33 against
~24 GB/s), 16 rows 5.4-5.7 against 8.1-8.4, 64 rows 13.9 against 18.5-25, 256 rows 47 against 63-65.

The scheme is the one the FBGEMM path uses with VNNI (cpu_engine.int8): each activation row divided by its
largest |value| on the grid 1/127, codes round(127 x / max|x|) + 128 in 1..255, one scale per weight channel.
The integer sums are exact and the rest is per element in a fixed order, so a row's result does not depend on
the batch. cpu_engine.native compiles and loads the file; without a compiler or without VNNI the engine keeps
FBGEMM (the server log says which).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numba
import numpy as np

from cpu_engine import native
from cpu_engine.row_kernels import GATED, PLAIN, input_row, keep_alive

SOURCE = Path(__file__).with_name("int8_gemm.c")
# -ffp-contract=off: GCC would fuse the scale and the bias add into one FMA, other bits than the unfused add.
FLAGS = ("-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-fopenmp", "-fPIC",
         "-shared")
REQUIRED_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
BLOCK = 32  # output channels a packed block holds (two zmm registers of int32 sums)
STEPS, ZERO_POINT = 127, 128  # activation codes round(127 u) + 128, u = x / max|x|
TINY = np.float32(np.finfo(np.float32).tiny)  # a row's max |x| at least this: no 0 / 0


@functools.cache
def gemm() -> ctypes._CFuncPtr | None:
    """The kernel's entry point, or None where it cannot run here (the reason is logged once)."""
    return native.load(SOURCE, FLAGS, REQUIRED_CPU_FLAGS, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                                           ctypes.c_int] + [ctypes.c_void_p] * 6,
                       "the int8 engine uses FBGEMM's product instead")


class PackedWeight:
    """An int8 weight [n, k] in the kernel's layout: blocks of BLOCK channels, each k / 4 groups of [BLOCK
    channels][4 inputs], k padded to a multiple of 4 and n to BLOCK with zero weights; `offset` (128 x each
    channel's sum: the codes' zero point) and `scale` padded alike."""

    def __init__(self, q: np.ndarray, scale: np.ndarray):
        n, k = q.shape
        self.n, self.k = n, -(-k // 4) * 4
        padded_n = -(-n // BLOCK) * BLOCK
        weights = np.zeros((padded_n, self.k), dtype=np.int8)
        weights[:n, :k] = q
        self.weights = np.ascontiguousarray(
            weights.reshape(padded_n // BLOCK, BLOCK, self.k // 4, 4).transpose(0, 2, 1, 3)).reshape(-1)
        self.offset = np.zeros(padded_n, dtype=np.int32)
        self.offset[:n] = ZERO_POINT * q.astype(np.int32).sum(axis=1)
        self.scale = np.zeros(padded_n, dtype=np.float32)
        self.scale[:n] = scale

    @property
    def arrays(self) -> tuple[np.ndarray, int, int, np.ndarray, np.ndarray]:
        """What project_rows takes (a tuple: numba unboxes it without Python attribute lookups)."""
        return self.weights, self.n, self.k, self.offset, self.scale

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes + self.offset.nbytes + self.scale.nbytes


@numba.njit(boundscheck=False, nogil=True, cache=True)
def _quantize_row(values, codes):  # pragma: no cover
    """codes[:k] = round(127 x / max|x|) + 128 for the k values, the padding after them 128 (zero); returns
    max|x| / 127, the row's scale."""
    k = values.shape[0]
    top = TINY
    for j in range(k):
        top = max(top, abs(values[j]))
    gain = np.float32(STEPS) / top
    for j in range(k):
        codes[j] = np.uint8(np.int32(np.rint(values[j] * gain)) + ZERO_POINT)
    for j in range(k, codes.shape[0]):
        codes[j] = ZERO_POINT
    return top / np.float32(STEPS)


@numba.njit(boundscheck=False, nogil=True, cache=True)
def project_rows(gemm, x, mode, norm_weight, eps, packed, bias, addend):  # pragma: no cover
    """addend + (rows @ dequant(weights).T + bias) for rows = x (PLAIN), RMSNorm(x) (NORMED), or silu(gate) x up
    for x = [gate | up] (GATED; row_kernels.input_row): the rows quantized and the kernel called in one numba
    call. norm_weight [k], bias [n] and addend [m, n]: NO_ROW / NO_ROWS where not used. `packed` is
    PackedWeight.arrays."""
    weights, n, k_padded, offset, scale = packed
    m = x.shape[0]
    k = x.shape[1] // 2 if mode == GATED else x.shape[1]
    codes = np.empty((m, k_padded), dtype=np.uint8)
    row_scale = np.empty(m, dtype=np.float32)
    values = np.empty(k, dtype=np.float32)
    for i in range(m):
        if mode == PLAIN:
            row_scale[i] = _quantize_row(x[i], codes[i])
        else:
            input_row(x[i], mode, norm_weight, eps, values)
            row_scale[i] = _quantize_row(values, codes[i])
    out = np.empty((m, n), dtype=np.float32)
    null = np.uintp(0)
    gemm(codes.ctypes.data, m, k_padded, weights.ctypes.data, n, offset.ctypes.data, scale.ctypes.data,
         row_scale.ctypes.data, bias.ctypes.data if bias.size else null,
         addend.ctypes.data if addend.size else null, out.ctypes.data)
    keep_alive(codes, row_scale)
    return out
