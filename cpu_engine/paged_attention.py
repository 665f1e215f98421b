"""Decode attention that reads K/V straight from the block pool, through each sequence's block table.

PyTorch has no CPU kernel that attends through a block table: with `F.scaled_dot_product_attention`, the
blocks a decode step reads must first be gathered into one contiguous tensor per layer, which writes and
then reads again every cached token of the batch (three passes over the KV bytes instead of one; at batch
16 that copy measured a fifth to a quarter of a step, the issue allowed 5%). This kernel, compiled once by
numba (cached on disk), reads each cached K and V row once where it lies: for each (sequence, KV head) it
walks the sequence's positions block by block and uses each row for all the query heads of its GQA group.
The softmax between the two passes is PyTorch's (its vectorised exp; numba's scalar exp, one per score,
made long-context steps several times slower).

Decode only: a prompt chunk is compute-bound (every weight for every token of the chunk), so the gather
its attention needs is small beside it and it keeps PyTorch's kernel. float32 only (numba has no
bfloat16); bfloat16 engines keep the gather.
"""

from __future__ import annotations

import numba
import numpy as np
import torch


@numba.njit(parallel=True, fastmath=True, cache=True)
def _paged_scores(q: np.ndarray, k_pool: np.ndarray, tables: np.ndarray, lengths: np.ndarray, block_size: int,
                  scale: float, scores: np.ndarray) -> None:  # pragma: no cover (numba-compiled)
    # q [B, H, D]; k_pool [blocks x block_size, KVH, D]; scores [B, H, L] (L >= every length), filled with
    # q.k x scale up to each row's length and -inf after it.
    batch, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    width = scores.shape[2]
    for job in numba.prange(batch * kv_heads):
        b = job // kv_heads
        g = job % kv_heads
        length = lengths[b]
        for pos in range(length):
            row = tables[b, pos // block_size] * block_size + pos % block_size
            for h in range(group):
                acc = np.float32(0.0)
                for d in range(dim):
                    acc += q[b, g * group + h, d] * k_pool[row, g, d]
                scores[b, g * group + h, pos] = acc * scale
        for h in range(group):
            for pos in range(length, width):
                scores[b, g * group + h, pos] = -np.inf


@numba.njit(parallel=True, fastmath=True, cache=True)
def _paged_weighted_values(weights: np.ndarray, v_pool: np.ndarray, tables: np.ndarray, lengths: np.ndarray,
                           block_size: int, out: np.ndarray) -> None:  # pragma: no cover (numba-compiled)
    # weights [B, H, L] (softmax rows); out [B, H, D] = sum over positions of weight x V.
    batch, heads, dim = out.shape
    kv_heads = v_pool.shape[1]
    group = heads // kv_heads
    for job in numba.prange(batch * kv_heads):
        b = job // kv_heads
        g = job % kv_heads
        for h in range(group):
            for d in range(dim):
                out[b, g * group + h, d] = 0.0
        for pos in range(lengths[b]):
            row = tables[b, pos // block_size] * block_size + pos % block_size
            for h in range(group):
                weight = weights[b, g * group + h, pos]
                for d in range(dim):
                    out[b, g * group + h, d] += weight * v_pool[row, g, d]


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """softmax(q K^T x scale) V for each decode row over its first `lengths[b]` positions.

    q [B, heads, head_dim] float32; k_pool / v_pool [blocks x block_size, kv_heads, head_dim] (the runner's
    per-layer cache, written in place, shared without a copy); tables [B, max blocks] int64; lengths [B]
    int64. Returns [B, heads, head_dim].
    """
    batch, heads, _ = q.shape
    q = q.contiguous()
    tables_np, lengths_np = tables.numpy(), lengths.numpy()
    scores = torch.empty(batch, heads, tables.shape[1] * block_size, dtype=torch.float32)
    _paged_scores(q.numpy(), k_pool.numpy(), tables_np, lengths_np, block_size, scale, scores.numpy())
    weights = torch.softmax(scores, dim=-1)  # PyTorch's vectorised exp: numba's scalar one cost more than the rest
    out = torch.empty_like(q)
    _paged_weighted_values(weights.numpy(), v_pool.numpy(), tables_np, lengths_np, block_size, out.numpy())
    return out
