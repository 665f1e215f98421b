"""The float32 engine's own GEMM for CPUs with AVX-512 (`float32_gemm.c`): its packed weight layout and the row
kernel that prepares a projection's input rows and calls it.

Why our own: at batch 1 a decode step is the weights read from memory, and oneDNN's float32 product (packed
once at load, the kernel used before and still used on CPUs without AVX-512) read them at ~12.5 GB/s with 1-3
rows on a 2-core AMD EPYC where one core reads ~22 GB/s, and its 1-row kernel summed long inputs in another order
than its kernels for more rows (a sequence decoding alone got other bits than in a batch; it was padded to 4
rows). The kernel here streams each block of 16 output channels once, tiles up to 6 rows x 64 channels so larger
batches reuse each loaded register (and, past one tile of rows, prefetches the next block while the tiles from L2
compute), adds the bias and the residual in the same pass, and sums every output in
one chain of fused multiply-adds in input order, so a row's bits never depend on the batch. Measured on that
machine, plain decode steps of `small`, one thread, interleaved with oneDNN's (`python -m benchmarks.engine_bench
--only w`): batch 1 13.6 against 23.5 ms (the weights read at ~23 GB/s), batch 16 36.6 against 42.1.

With the norms, the gate's SiLU and the residual adds in its row kernel, as the int8 engine's VNNI kernel has
them, the float32 engine's decode steps also run every layer in one numba call (cpu_engine.fused_step).
cpu_engine.native compiles and loads the file; without a compiler or without AVX-512 the engine keeps oneDNN
(the server log says which).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numba
import numpy as np

from cpu_engine import native
from cpu_engine.row_kernels import GATED, PLAIN, input_row, keep_alive

SOURCE = Path(__file__).with_name("float32_gemm.c")
# -ffp-contract=off: GCC would fuse the bias add into the last multiply-add, other bits than the unfused add.
FLAGS = ("-O3", "-ffp-contract=off", "-mavx512f", "-fopenmp", "-fPIC", "-shared")
REQUIRED_CPU_FLAGS = frozenset({"avx512f"})
BLOCK = 16  # output channels a packed block holds (one zmm register of float32 sums)


@functools.cache
def gemm() -> ctypes._CFuncPtr | None:
    """The kernel's entry point, or None where it cannot run here (the reason is logged once)."""
    return native.load(SOURCE, FLAGS, REQUIRED_CPU_FLAGS, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                                           ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3,
                       "the float32 engine uses oneDNN's product instead")


def packed_weight(weight: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(weights, n, k) for a float32 weight [n, k], as project_rows takes it: blocks of BLOCK channels, each
    [k][BLOCK], n padded to whole blocks with zero weights."""
    n, k = weight.shape
    padded = np.zeros((-(-n // BLOCK) * BLOCK, k), dtype=np.float32)
    padded[:n] = weight
    return np.ascontiguousarray(padded.reshape(-1, BLOCK, k).transpose(0, 2, 1)).reshape(-1), n, k


@numba.njit(boundscheck=False, nogil=True, cache=True)
def project_rows(gemm, x, mode, norm_weight, eps, packed, bias, addend):  # pragma: no cover
    """addend + (rows @ weight.T + bias) for rows = x (PLAIN), RMSNorm(x) (NORMED), or silu(gate) x up for
    x = [gate | up] (GATED; row_kernels.input_row), in one numba call. norm_weight [k], bias [n] and addend
    [m, n]: NO_ROW / NO_ROWS where not used. `packed` is packed_weight's."""
    weights, n, k = packed
    m = x.shape[0]
    if mode == PLAIN:
        rows = np.ascontiguousarray(x)
    else:
        rows = np.empty((m, x.shape[1] // 2 if mode == GATED else x.shape[1]), dtype=np.float32)
        for i in range(m):
            input_row(x[i], mode, norm_weight, eps, rows[i])
    if rows.shape[1] != k or (bias.size and bias.shape[0] != n) or (addend.size and addend.shape != (m, n)):
        raise ValueError("the rows, bias or addend do not fit the weight")
    out = np.empty((m, n), dtype=np.float32)
    null = np.uintp(0)
    gemm(rows.ctypes.data, m, k, weights.ctypes.data, n, bias.ctypes.data if bias.size else null,
         addend.ctypes.data if addend.size else null, out.ctypes.data)
    keep_alive(rows)
    return out
