"""Decode attention that reads K/V straight from the block pool, through each sequence's block table.

PyTorch has no CPU kernel that attends through a block table: with `F.scaled_dot_product_attention`, the
blocks a decode step reads must first be gathered into one contiguous tensor per layer, which writes and
then reads again every cached token of the batch (three passes over the KV bytes instead of one; at batch
16 that copy measured a fifth to a quarter of a step, the issue allowed 5%). This kernel, compiled once by
numba (cached on disk), makes one pass: for each (sequence, KV head) it walks the sequence's positions
block by block, takes each key row once for all the query heads of its GQA group, and keeps the softmax
numerically safe with the usual max subtraction.

Decode only: a prompt chunk is compute-bound (every weight for every token of the chunk), so the gather
its attention needs is small beside it and it keeps PyTorch's kernel. float32 only (numba has no
bfloat16); bfloat16 engines keep the gather.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch


@numba.njit(parallel=True, fastmath=True, cache=True)
def _paged_decode(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, tables: np.ndarray,
                  lengths: np.ndarray, block_size: int, scale: float, out: np.ndarray) -> None:  # pragma: no cover
    # (numba-compiled: coverage cannot see inside.) q, out: [B, H, D]; pools: [blocks x block_size, KVH, D];
    # tables: [B, max blocks]; lengths: [B] positions to attend to (the new token's included).
    batch, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    for job in numba.prange(batch * kv_heads):
        b = job // kv_heads
        g = job % kv_heads
        length = lengths[b]
        scores = np.empty((group, length), dtype=np.float32)
        for pos in range(length):
            row = tables[b, pos // block_size] * block_size + pos % block_size
            for h in range(group):
                acc = np.float32(0.0)
                for d in range(dim):
                    acc += q[b, g * group + h, d] * k_pool[row, g, d]
                scores[h, pos] = acc * scale
        for h in range(group):
            top = scores[h, 0]
            for pos in range(1, length):
                top = max(top, scores[h, pos])
            total = np.float32(0.0)
            for pos in range(length):
                weight = math.exp(scores[h, pos] - top)
                scores[h, pos] = weight
                total += weight
            for pos in range(length):
                scores[h, pos] /= total
            for d in range(dim):
                out[b, g * group + h, d] = 0.0
        for pos in range(length):
            row = tables[b, pos // block_size] * block_size + pos % block_size
            for h in range(group):
                weight = scores[h, pos]
                for d in range(dim):
                    out[b, g * group + h, d] += weight * v_pool[row, g, d]


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """softmax(q K^T x scale) V for each decode row over its first `lengths[b]` positions.

    q [B, heads, head_dim] float32; k_pool / v_pool [blocks x block_size, kv_heads, head_dim] (the runner's
    per-layer cache, written in place, shared without a copy); tables [B, max blocks] int64; lengths [B]
    int64. Returns [B, heads, head_dim].
    """
    out = torch.empty_like(q)
    _paged_decode(q.contiguous().numpy(), k_pool.numpy(), v_pool.numpy(), tables.numpy(), lengths.numpy(),
                  block_size, scale, out.numpy())
    return out
