"""The paged decode-attention kernel (cpu_engine.paged_attention) against PyTorch's attention over the same
blocks gathered, computed in float64: random block tables (scattered, some blocks shared between
sequences as prefix reuse shares them), lengths from 1 to 4,096 (block, tile and span boundaries among
them), grouped-query heads in groups of 2, 3 and 7 (the kernel takes a group's heads 4, 2 and 1 at a time),
head dims 32 and 64 (the demo presets') and one that is not a multiple of 16. Each (kv_heads, group,
head_dim) compiles kernels of its own (~10 s the first time, cached after): the cases keep to three.

The engine-level checks (in-place decode against the gather path, prefix reuse, preemption, seeded runs)
are in test_paged_kv.py and test_cpu_engine.py.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from cpu_engine import paged_attention
from cpu_engine.paged_attention import paged_decode_attention

ATOL, RTOL = 2e-5, 1e-4  # float32 kernel against a float64 reference


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
              lengths: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """F.scaled_dot_product_attention per row over its positions gathered through its block table, float64."""
    out = []
    for row, length in enumerate(lengths.tolist()):
        positions = torch.arange(length)
        places = tables[row, positions // block_size] * block_size + positions % block_size
        keys = k_pool[places].transpose(0, 1).double()  # [kv_heads, length, head_dim]
        values = v_pool[places].transpose(0, 1).double()
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[row][:, None, :].double(), keys, values, scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(out).float()


def random_case(lengths: list[int], kv_heads: int, group: int, head_dim: int, block_size: int, seed: int,
                q_scale: float = 1.0) -> tuple:
    """Pools with spare blocks, each row's table a random draw of them (row 1 shares row 0's first blocks,
    as a reused prefix does), padded with block 0 like the runner's tables."""
    generator = torch.Generator().manual_seed(seed)
    per_row = [-(-length // block_size) for length in lengths]
    num_blocks = sum(per_row) + 7
    k_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator)
    v_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(lengths), max(per_row), dtype=torch.long)
    taken = 0
    for row, blocks in enumerate(per_row):
        tables[row, :blocks] = torch.tensor(order[taken:taken + blocks])
        taken += blocks
    if len(lengths) > 1:
        shared = min(per_row[0], per_row[1]) // 2
        tables[1, :shared] = tables[0, :shared]
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=generator) * q_scale
    return q, k_pool, v_pool, tables, torch.tensor(lengths), block_size, head_dim ** -0.5


@pytest.mark.parametrize("lengths, kv_heads, group, head_dim, block_size", [
    ([1], 4, 3, 64, 16),  # `small`'s heads; one position: the output is its V row
    ([4096], 4, 3, 64, 16),  # the longest context the issue asks for
    ([1, 15, 16, 17, 127, 128, 129, 300], 2, 2, 32, 16),  # `tiny`'s heads; block and tile boundaries
    ([77, 513, 2], 2, 2, 32, 4),  # small blocks
    ([1000, 3, 2049], 2, 7, 24, 16),  # a group of 7 (heads 4 + 2 + 1 at a time), head_dim not a multiple of 16
])
def test_matches_attention_over_the_gathered_blocks(lengths: list[int], kv_heads: int, group: int,
                                                    head_dim: int, block_size: int) -> None:
    case = random_case(lengths, kv_heads, group, head_dim, block_size, seed=sum(lengths) + group)
    torch.testing.assert_close(paged_decode_attention(*case), reference(*case), atol=ATOL, rtol=RTOL)


def test_long_sequences_cut_into_spans_merge_to_the_same_result() -> None:
    """With more threads, a long sequence is cut into spans merged by log-sum-exp: forced here through the
    `threads` the span length is computed for (the spans then run on whatever threads numba has)."""
    q, k_pool, v_pool, tables, lengths, block_size, scale = random_case([4096, 700, 1, 2500], 4, 3, 64, 16, seed=5)
    expected = reference(q, k_pool, v_pool, tables, lengths, block_size, scale)
    for threads in (1, 2, 8, 64):
        span = paged_attention.span_positions(lengths.numpy(), threads)
        assert (span == 4096) == (threads == 1)
        out = torch.empty_like(q)
        paged_attention.decode_attention_into(q.numpy(), k_pool.numpy(), v_pool.numpy(), tables.numpy(),
                                              lengths.numpy(), block_size, np.float32(scale), threads,
                                              paged_attention.shape_of(4, 3, 64), out.numpy())
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_span_length_whole_tiles_at_least_min_span_at_most_the_longest_sequence() -> None:
    spans = paged_attention.span_positions
    assert spans(np.array([1024, 10]), 1) == 1024  # one thread: never cut
    assert spans(np.array([1]), 4) == 1
    assert spans(np.array([100, 50]), 2) == 100  # short rows stay whole
    span = spans(np.array([4096]), 2)  # batch 1: cut so both threads get spans
    assert span % paged_attention.TILE == 0 and paged_attention.MIN_SPAN <= span < 4096
    assert spans(np.array([1024] * 16), 2) == 1024  # a full batch already has work for every thread


def test_large_scores_stay_finite_and_exact() -> None:
    """Scores in the hundreds (a sharp softmax, where exp without the running max would overflow) and
    the new max found late in the sequence, which rescales what earlier tiles summed."""
    q, k_pool, v_pool, tables, lengths, block_size, scale = random_case([600, 33], 2, 2, 32, 16, seed=9, q_scale=30.0)
    places = tables[0, 590 // block_size] * block_size + 590 % block_size
    k_pool[places] = q[0].view(2, 2, 32)[:, 0] * 2  # position 590 dominates row 0's first head of each group
    got = paged_decode_attention(q, k_pool, v_pool, tables, lengths, block_size, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference(q, k_pool, v_pool, tables, lengths, block_size, scale),
                               atol=ATOL, rtol=RTOL)


def test_query_rows_sliced_out_of_a_wider_tensor() -> None:
    """The runner passes q[:num_decode] of its packed [tokens, heads + kv_heads, head_dim] tensor: not
    contiguous."""
    q, k_pool, v_pool, tables, lengths, block_size, scale = random_case([40, 9], 2, 2, 32, 16, seed=2)
    packed = torch.cat((q, torch.randn(2, 2, 32)), dim=1)  # [B, heads + kv_heads, head_dim]
    sliced = packed[:, :4]
    assert not sliced.is_contiguous()
    torch.testing.assert_close(paged_decode_attention(sliced, k_pool, v_pool, tables, lengths, block_size, scale),
                               reference(q, k_pool, v_pool, tables, lengths, block_size, scale), atol=ATOL, rtol=RTOL)


def test_the_vectorised_exp_is_within_a_few_ulps() -> None:
    x = np.linspace(-86.0, 0.0, 100_001, dtype=np.float32)
    got = x.copy()
    total = paged_attention._exp_sum(got, x.shape[0], np.float32(0.0), np.empty(x.shape[0], np.int32))
    expected = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - expected) / expected) < 5e-7
    assert abs(total - expected.sum()) / expected.sum() < 1e-5


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs numba to have two threads")
def test_same_result_on_one_and_two_threads() -> None:
    case = random_case([3000, 5, 1200], 4, 3, 64, 16, seed=11)
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = paged_decode_attention(*case)
        numba.set_num_threads(2)
        two = paged_decode_attention(*case)
    finally:
        numba.set_num_threads(previous)
    torch.testing.assert_close(one, two, atol=ATOL, rtol=RTOL)


@pytest.mark.skipif(paged_attention.bfloat16_kernel() is None,
                    reason="the bfloat16 kernel needs AVX-512 (F, BW, DQ) and a C compiler")
@pytest.mark.parametrize("lengths, kv_heads, group, head_dim, block_size", [
    ([1, 15, 16, 17, 300, 1000], 4, 3, 64, 16),  # `small`'s heads; tile (128) and span (256) boundaries
    ([5, 700, 129], 2, 4, 128, 4),
    ([4096, 3], 1, 2, 32, 16),  # one long sequence cut into spans beside a short one
    ([3, 40, 17], 2, 2, 16, 4),  # the unit tests' checkpoint's heads
    ([20, 130], 1, 8, 48, 16),  # 32 values paired and a last 16; 8 query heads' sums in registers (24 vectors)
    ([33, 260], 2, 5, 80, 8),  # too many sums for registers: one query head at a time
])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_bfloat16_kernel_matches_attention_over_the_same_values(
        lengths: list[int], kv_heads: int, group: int, head_dim: int, block_size: int, threads: int,
        request: pytest.FixtureRequest) -> None:
    """The C kernel over bfloat16 pools against the float64 reference over the same (widened) values, on one
    thread and on a team of two."""
    from cpu_engine import native

    request.addfinalizer(lambda: native.set_threads(1))
    native.set_threads(threads)
    q, k_pool, v_pool, tables, lengths_t, block_size, scale = random_case(lengths, kv_heads, group, head_dim,
                                                                          block_size, seed=len(lengths))
    k16, v16 = k_pool.bfloat16(), v_pool.bfloat16()
    out = paged_attention.paged_decode_attention_bfloat16(q, k16, v16, tables, lengths_t, block_size, scale)
    expected = reference(q, k16.float(), v16.float(), tables, lengths_t, block_size, scale)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_a_bfloat16_pool_stores_each_value_rounded_as_torch_rounds_it() -> None:
    """row_kernels.rotate_and_store into a bfloat16 pool (uint16 bits) stores what torch's .bfloat16() makes of
    the float32 values it stores into a float32 pool: nearest, ties to even (ties made on purpose here)."""
    from cpu_engine.row_kernels import rotate_and_store

    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, tokens = 4, 2, 16, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator)
    ties = qkv.view(torch.int32)
    ties[:, ::3] = (ties[:, ::3] & ~0xFFFF) | 0x8000  # exactly halfway between two bfloat16 values
    cos, sin = torch.randn(tokens, 1, dim, generator=generator), torch.randn(tokens, 1, dim, generator=generator)
    places = np.array([7, 0, 3, 12, 9])
    pools = {}
    for dtype in (torch.float32, torch.bfloat16):
        k_pool, v_pool = torch.zeros(16, kv_heads, dim, dtype=dtype), torch.zeros(16, kv_heads, dim, dtype=dtype)
        arrays = [pool.numpy() if dtype == torch.float32 else pool.view(torch.int16).numpy().view(np.uint16)
                  for pool in (k_pool, v_pool)]
        q = torch.empty(tokens, heads, dim)
        rotate_and_store(qkv.numpy(), heads, kv_heads, cos.numpy(), sin.numpy(), places, *arrays, q.numpy())
        pools[dtype] = (k_pool, v_pool)
    for wide, narrow in zip(pools[torch.float32], pools[torch.bfloat16]):
        assert torch.equal(wide.bfloat16().view(torch.int16), narrow.view(torch.int16))
