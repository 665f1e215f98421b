"""Decode attention that reads K/V straight from the block pool, through each sequence's block table.

PyTorch has no CPU kernel that attends through a block table: with `F.scaled_dot_product_attention`, the
blocks a decode step reads must first be gathered into one contiguous tensor per layer, which writes and
then reads again every cached token of the batch (three passes over the KV bytes instead of one; at batch
16 that copy measured a fifth to a quarter of a step). This kernel, compiled by numba (cached on disk),
reads each cached K and V row once where it lies, in one sweep (flash-decoding):

- the work is cut into spans: a whole sequence, or a part of a long one (`span_positions`: cut so that a
  batch of one, or one long sequence among short ones, still gives every thread work); spans run in
  parallel (numba's OpenMP team, dynamic schedule), each keeping its running max, sum and weighted values,
  and a serial pass merges a sequence's spans (log-sum-exp);
- within a span, TILE positions at a time: the rows' places in the pool (one table lookup per block); q.k
  for every query head, each K row read once for all the heads of its GQA group (the dot products
  vectorised over head_dim); the online-softmax update, with an exp written so that LLVM vectorises it
  (numba's exp is a scalar call per score, which made long contexts several times slower); then each V row
  added, weighted, into the span's per-head accumulators.

The model's shape (kv_heads, group, head_dim) reaches the kernels as tuples whose lengths are part of their
numba type (`shape_of`): each shape compiles (and caches) its own kernels, whose inner loops have constant
trip counts, fully unrolled (from memory: ~10% faster on the `small` preset, ~35% on `tiny`, where loop
overhead outweighs its 32-wide heads). A shape's first compile takes ~10 s (cached on disk after).

Rows are read in pool order, one row per loop step, which the hardware prefetchers follow. Measured and
dropped: reading two or four rows per step (fewer accumulator loads and stores; faster in cache, 30-40%
slower from memory), explicit software prefetch (no gain), a two-pass variant with PyTorch's softmax
between (slower from a few hundred positions on, and three parallel regions per layer instead of one); a
C kernel on float32 rows (paged_attention.c's design: slower than this one from memory, 17.0 against 15.1 ms
at batch 16 x 1,024, benchmarks/README.md scenario `l`). The limit here is instructions, not memory (one core
sums memory at ~26 GB/s): on the 2-core AMD EPYC this was written on, one thread, inside decode steps
(`python -m benchmarks.engine_bench --only l --threads 1`), K/V read at ~11-12 GB/s on `small` (the
previous two-pass kernel ~5-7) and ~3.8 on `tiny` (~2; its 32-wide heads leave more loop overhead per
byte); ~14.5 on `small` with the KV pool on huge pages (fewer TLB misses: the runner's pool asks for them,
cpu_engine/runner.py kv_pool).

Decode only: a prompt chunk is compute-bound (every weight for every token of the chunk), so the gather
its attention needs is small beside it and it keeps PyTorch's kernel. float32 pools only (numba has no
bfloat16): a float32 engine's bfloat16 pool (`cpu_kv_cache_dtype`) is read by our C kernel instead
(paged_attention.c, `attend_into` below picks by the pool's dtype), and bfloat16 engines keep the gather.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numba
import numpy as np
import torch
from numba import types
from numba.extending import overload

from cpu_engine import native

TILE = 128  # positions per online-softmax step: their scores for every head sit in a [heads, TILE] scratch
MIN_SPAN = 256  # a sequence is cut into spans of at least this many positions (a span costs a merge)
SPANS_PER_THREAD = 4  # target work items per thread when cutting long sequences, for the dynamic schedule

# Finite stand-in for minus infinity: the kernels keep fastmath's reassociation (vectorised reductions) but
# not its no-infinities/no-NaNs assumptions, and never compare against an infinity.
_LOWEST = np.float32(-3.0e38)
_EXP_FLOOR = np.float32(-87.0)  # exp(-87) ~ 1.6e-38: the smallest normal float32 is 1.2e-38
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 in two parts (Cody-Waite): k x _LN2_HI is exact for |k| < 2^7
_LN2_LO = np.float32(-2.12194440e-4)
_FASTMATH = {"contract", "reassoc", "nsz", "arcp", "afn"}
_JIT = dict(fastmath=_FASTMATH, boundscheck=False, nogil=True, error_model="numpy", cache=True)
# The span's functions are inlined (numba IR) into the parallel loop's body: LLVM then sees the pools and the
# accumulators as the distinct arrays they are (numba marks that body's array arguments noalias) and drops
# the runtime overlap checks around every head_dim-long loop (`tiny`: ~1.5x; `small`: a few %).


@functools.cache
def shape_of(kv_heads: int, group: int, head_dim: int) -> tuple[tuple, tuple, tuple]:
    """The kernels' `shape` argument: tuples of kv_heads, group and head_dim Nones (see the module's doc)."""
    return (None,) * kv_heads, (None,) * group, (None,) * head_dim


@numba.njit(inline="always", **_JIT)
def _exp_sum(x, n, shift, bits):  # pragma: no cover (numba-compiled, as every function below)
    """x[:n] <- exp(x[:n] - shift) (shift >= every x: arguments <= 0), returns their sum. exp(r) on
    [-ln2/2, ln2/2] by a degree-6 polynomial (Cephes' expf coefficients), times 2^k built in the exponent
    bits; two plain loops LLVM vectorises."""
    scale = bits.view(np.float32)
    for i in range(n):
        v = max(x[i] - shift, _EXP_FLOOR)
        k = np.floor(v * _LOG2E + np.float32(0.5))
        r = v - k * _LN2_HI - k * _LN2_LO
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        x[i] = p * r * r + r + np.float32(1.0)
        bits[i] = (np.int32(k) + np.int32(127)) << np.int32(23)
    total = np.float32(0.0)
    for i in range(n):
        e = x[i] * scale[i]
        x[i] = e
        total += e
    return total


@numba.njit(inline="always", **_JIT)
def _dot4(q0, q1, q2, q3, k, shape):  # pragma: no cover
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    for d in range(len(shape[2])):
        kd = k[d]
        a0 += q0[d] * kd
        a1 += q1[d] * kd
        a2 += q2[d] * kd
        a3 += q3[d] * kd
    return a0, a1, a2, a3


@numba.njit(inline="always", **_JIT)
def _dot2(q0, q1, k, shape):  # pragma: no cover
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    for d in range(len(shape[2])):
        kd = k[d]
        a0 += q0[d] * kd
        a1 += q1[d] * kd
    return a0, a1


@numba.njit(inline="always", **_JIT)
def _dot1(q0, k, shape):  # pragma: no cover
    a0 = np.float32(0.0)
    for d in range(len(shape[2])):
        a0 += q0[d] * k[d]
    return a0


@numba.njit(inline="always", **_JIT)
def _tile_scores(qb, k_pool, rows, first, n, scale, s, shape):  # pragma: no cover
    """s[h, t] = scale x q_h . K[rows[first + t], h // group] for t < n. Each K row is read once for its
    group's heads, four, two or one at a time (any group size)."""
    kv_heads, group = len(shape[0]), len(shape[1])
    for t in range(n):
        k_row = k_pool[rows[first + t]]
        for g in range(kv_heads):
            k = k_row[g]
            h = g * group
            stop = h + group
            while h + 4 <= stop:
                a0, a1, a2, a3 = _dot4(qb[h], qb[h + 1], qb[h + 2], qb[h + 3], k, shape)
                s[h, t] = a0 * scale
                s[h + 1, t] = a1 * scale
                s[h + 2, t] = a2 * scale
                s[h + 3, t] = a3 * scale
                h += 4
            if h + 2 <= stop:
                a0, a1 = _dot2(qb[h], qb[h + 1], k, shape)
                s[h, t] = a0 * scale
                s[h + 1, t] = a1 * scale
                h += 2
            if h < stop:
                s[h, t] = _dot1(qb[h], k, shape) * scale


@numba.njit(inline="always", **_JIT)
def _tile_values(p, v_pool, rows, first, n, acc, shape):  # pragma: no cover
    """acc[h] += sum over t < n of p[h, t] x V[rows[first + t], h // group], one V row per step."""
    kv_heads, group, dim = len(shape[0]), len(shape[1]), len(shape[2])
    for t in range(n):
        v_row = v_pool[rows[first + t]]
        for g in range(kv_heads):
            v = v_row[g]
            for h in range(g * group, g * group + group):
                w = p[h, t]
                out = acc[h]
                for d in range(dim):
                    out[d] += w * v[d]


@numba.njit(inline="always", **_JIT)
def _attend_span(q, k_pool, v_pool, tables, b, start, end, block_size, scale, shape, m, l, acc):  # pragma: no cover
    """Sequence b's positions [start, end): m [heads] <- max score, l [heads] <- sum of exp(score - m),
    acc [heads, head_dim] <- sum of exp(score - m) x V."""
    heads = len(shape[0]) * len(shape[1])
    dim = len(shape[2])
    qb = q[b]
    span = end - start
    rows = np.empty(span, np.int64)  # each position's row in the pool: one table lookup per block
    t = 0
    while t < span:
        block = (start + t) // block_size
        offset = start + t - block * block_size
        run = min(block_size - offset, span - t)
        first_row = tables[b, block] * block_size + offset
        for u in range(run):
            rows[t + u] = first_row + u
        t += run
    s = np.empty((heads, TILE), np.float32)
    bits = np.empty(TILE, np.int32)
    for h in range(heads):
        m[h] = _LOWEST
        l[h] = 0.0
        for d in range(dim):
            acc[h, d] = 0.0
    for first in range(0, span, TILE):
        n = min(TILE, span - first)
        _tile_scores(qb, k_pool, rows, first, n, scale, s, shape)
        for h in range(heads):
            sh = s[h]
            top = m[h]
            for t in range(n):
                top = max(top, sh[t])
            total = _exp_sum(sh, n, top, bits)
            if top > m[h] and m[h] > _LOWEST:  # a new max: rescale what the earlier tiles summed
                alpha = np.float32(np.exp(m[h] - top))
                l[h] = l[h] * alpha + total
                out = acc[h]
                for d in range(dim):
                    out[d] *= alpha
            else:
                l[h] += total
            m[h] = top
        _tile_values(s, v_pool, rows, first, n, acc, shape)


@numba.njit(parallel=True, **_JIT)
def _attend_spans(q, k_pool, v_pool, tables, lengths, block_size, scale, span, kvs, groups, dims, m, l,
                  acc):  # pragma: no cover
    # The shape's tuples come apart: a parallel loop's body takes no nested tuple.
    per_row = m.shape[1]
    for job in numba.prange(q.shape[0] * per_row):
        b = job // per_row
        c = job - b * per_row
        start = c * span
        end = min(start + span, lengths[b])
        if start < end:
            _attend_span(q, k_pool, v_pool, tables, b, start, end, block_size, scale, (kvs, groups, dims), m[b, c],
                         l[b, c], acc[b, c])


@numba.njit(**_JIT)
def _merge_spans(lengths, span, m, l, acc, out):  # pragma: no cover
    """out[b, h] = the softmax-weighted mean of V over all of sequence b's spans (log-sum-exp merge)."""
    batch, heads, dim = out.shape
    for b in range(batch):
        used = (lengths[b] + span - 1) // span
        for h in range(heads):
            top = m[b, 0, h]
            for c in range(1, used):
                top = max(top, m[b, c, h])
            o = out[b, h]
            w = np.float32(np.exp(m[b, 0, h] - top))
            total = w * l[b, 0, h]
            a = acc[b, 0, h]
            for d in range(dim):
                o[d] = w * a[d]
            for c in range(1, used):
                w = np.float32(np.exp(m[b, c, h] - top))
                total += w * l[b, c, h]
                a = acc[b, c, h]
                for d in range(dim):
                    o[d] += w * a[d]
            inverse = np.float32(1.0) / total
            for d in range(dim):
                o[d] *= inverse


@numba.njit(**_JIT)
def span_positions(lengths, threads):  # pragma: no cover
    """The longest span a sequence is cut into: the whole longest sequence on one thread; else about
    SPANS_PER_THREAD spans per thread over the batch's positions, at least MIN_SPAN, in whole tiles."""
    longest = 1
    total = 0
    for b in range(lengths.shape[0]):
        longest = max(longest, lengths[b])
        total += lengths[b]
    if threads <= 1:
        return longest
    target = max((total + threads * SPANS_PER_THREAD - 1) // (threads * SPANS_PER_THREAD), MIN_SPAN)
    return min((target + TILE - 1) // TILE * TILE, longest)


@numba.njit(**_JIT)
def decode_attention_into(q, k_pool, v_pool, tables, lengths, block_size, scale, threads, shape,
                          out):  # pragma: no cover
    """paged_decode_attention's work on numpy arrays, into `out`, for callers that are numba code themselves
    (cpu_engine.fused_step); `threads` > 1 wants numba's chunk size set to 1 around the call (a dynamic
    schedule)."""
    batch, heads, dim = q.shape
    span = span_positions(lengths, threads)
    longest = 0
    for b in range(batch):
        longest = max(longest, lengths[b])
    per_row = (longest + span - 1) // span
    m = np.empty((batch, per_row, heads), np.float32)
    l = np.empty((batch, per_row, heads), np.float32)
    acc = np.empty((batch, per_row, heads, dim), np.float32)
    _attend_spans(q, k_pool, v_pool, tables, lengths, block_size, scale, span, shape[0], shape[1], shape[2], m, l, acc)
    _merge_spans(lengths, span, m, l, acc, out)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """softmax(q K^T x scale) V for each decode row over its first `lengths[b]` positions (each >= 1).

    q [B, heads, head_dim] float32; k_pool / v_pool [blocks x block_size, kv_heads, head_dim] (the runner's
    per-layer cache, written in place, shared without a copy); tables [B, max blocks] int64; lengths [B]
    int64. Returns [B, heads, head_dim].
    """
    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32)
    args = (q.contiguous().numpy(), k_pool.numpy(), v_pool.numpy(), tables.numpy(), lengths.numpy(), block_size,
            np.float32(scale))
    shape = shape_of(kv_heads, heads // kv_heads, head_dim)
    threads = numba.get_num_threads()
    if threads == 1:
        decode_attention_into(*args, 1, shape, out.numpy())
        return out
    previous = numba.set_parallel_chunksize(1)  # dynamic schedule: spans differ in length (ragged batches)
    try:
        decode_attention_into(*args, threads, shape, out.numpy())
    finally:
        numba.set_parallel_chunksize(previous)
    return out


# A bfloat16 KV pool's decode attention: our C kernel (paged_attention.c, where it says why), compiled and loaded
# like the GEMMs (cpu_engine.native); head_dim a multiple of 16 up to 128, up to 64 heads.
BFLOAT16_SOURCE = Path(__file__).with_name("paged_attention.c")
BFLOAT16_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-fopenmp", "-fPIC", "-shared")
BFLOAT16_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512dq"})
BFLOAT16_HEAD_DIMS = tuple(range(16, 129, 16))
BFLOAT16_MAX_HEADS = 64


@functools.cache
def bfloat16_kernel() -> ctypes._CFuncPtr | None:
    """The C kernel's entry point, or None where it cannot run here (the reason is logged once)."""
    kernel = native.load(BFLOAT16_SOURCE, BFLOAT16_FLAGS, BFLOAT16_CPU_FLAGS,
                         [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 5
                         + [ctypes.c_float, ctypes.c_void_p], "a bfloat16 KV cache is not available")
    if kernel is not None:
        kernel.restype = ctypes.c_int
    return kernel


def bfloat16_fits(kv_heads: int, group: int, head_dim: int) -> bool:
    return head_dim in BFLOAT16_HEAD_DIMS and kv_heads * group <= BFLOAT16_MAX_HEADS


def paged_decode_attention_bfloat16(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                    tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                                    scale: float) -> torch.Tensor:
    """paged_decode_attention over bfloat16 pools (torch.bfloat16, the same shapes), on the C kernel (which
    must be available: bfloat16_kernel)."""
    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    if not bfloat16_fits(kv_heads, heads // kv_heads, head_dim):
        raise ValueError(f"the bfloat16 kernel takes head_dim {BFLOAT16_HEAD_DIMS} and up to "
                         f"{BFLOAT16_MAX_HEADS} heads, not {head_dim} and {heads}")
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32)
    bits = [pool.view(torch.int16).numpy().view(np.uint16) for pool in (k_pool, v_pool)]
    _attend_bfloat16(bfloat16_kernel(), q.contiguous().numpy(), *bits, tables.contiguous().numpy(),
                     lengths.contiguous().numpy(), block_size, np.float32(scale),
                     shape_of(kv_heads, heads // kv_heads, head_dim), out.numpy())
    return out


def attend_into(kernel, q, k_pool, v_pool, tables, lengths, block_size, scale, threads, shape, out):  # pragma: no cover
    """decode_attention_into for a float32 pool, the bfloat16 kernel (`kernel`, bfloat16_kernel's) for a bfloat16
    one (uint16 arrays): what the one-call step (cpu_engine.fused_step) calls, chosen where numba compiles it."""
    raise NotImplementedError("called from numba only")


@overload(attend_into)
def _attend_into_for(kernel, q, k_pool, v_pool, tables, lengths, block_size, scale, threads, shape,
                     out):  # pragma: no cover
    if k_pool.dtype == types.uint16:
        def bfloat16_pool(kernel, q, k_pool, v_pool, tables, lengths, block_size, scale, threads, shape, out):
            batch, heads, dim = q.shape
            kv_heads = k_pool.shape[1]
            if kernel(q.ctypes.data, k_pool.ctypes.data, v_pool.ctypes.data, tables.ctypes.data, tables.shape[1],
                      lengths.ctypes.data, batch, kv_heads, heads // kv_heads, dim, block_size, scale,
                      out.ctypes.data):
                raise MemoryError("no memory for the attention kernel's partial sums")
        return bfloat16_pool
    return lambda kernel, q, k_pool, v_pool, tables, lengths, block_size, scale, threads, shape, out: \
        decode_attention_into(q, k_pool, v_pool, tables, lengths, block_size, scale, threads, shape, out)


@numba.njit(nogil=True, cache=True)
def _attend_bfloat16(kernel, q, k_pool, v_pool, tables, lengths, block_size, scale, shape, out):  # pragma: no cover
    attend_into(kernel, q, k_pool, v_pool, tables, lengths, block_size, scale, 1, shape, out)
