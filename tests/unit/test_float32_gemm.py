"""Our float32 GEMM for AVX-512 (cpu_engine/float32_gemm.c through cpu_engine.float32_gemm): each output the
documented chain of fused multiply-adds, for every tile and edge of the packed layout, and the ops its row
kernel takes in (tests/unit/test_native.py: how it is built and found)."""

from __future__ import annotations

import numpy as np
import pytest

from cpu_engine import float32_gemm, native
from cpu_engine.row_kernels import GATED, NO_ROW, NO_ROWS, NORMED, PLAIN, rms_norm_rows, silu_rows

needs_kernel = pytest.mark.skipif(float32_gemm.gemm() is None, reason="needs AVX-512 and a C compiler")
EPS = np.float32(1e-5)


def fused_multiply_adds(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """sum_j x[r, j] w[c, j] as the kernel documents it: acc = fma(x[r, j], w[c, j], acc) for j = 0, 1, ...,
    each step rounded once to float32. A float32 product is exact in float64, and the float64 sum of it and a
    float32 is rounded a second time only where it needs more than 53 bits, which these inputs never hit (the
    test would fail: the seeds are fixed)."""
    acc = np.zeros((x.shape[0], weight.shape[0]), dtype=np.float32)
    for j in range(x.shape[1]):
        acc = (x[:, j, None].astype(np.float64) * weight[None, :, j] + acc).astype(np.float32)
    return acc


def project(weight: np.ndarray, x: np.ndarray, bias=NO_ROW, addend=NO_ROWS, mode: int = PLAIN,
            norm_weight=NO_ROW) -> np.ndarray:
    return float32_gemm.project_rows(float32_gemm.gemm(), x, mode, norm_weight, EPS,
                                     float32_gemm.packed_weight(weight), bias, addend)


@needs_kernel
@pytest.mark.parametrize("n, k", [(64, 64), (48, 64), (32, 8), (16, 8), (100, 70), (17, 4), (1, 3), (130, 1537)],
                         ids=lambda v: str(v))
def test_each_output_is_one_chain_of_multiply_adds_for_every_tile_and_edge(n: int, k: int) -> None:
    # n: a whole 64-channel tile, tiles of 3, 2 and 1 blocks of 16 channels, partial blocks (masked stores), 4 + 3
    # and 4 + 4 + 1 blocks; k any length.
    rng = np.random.default_rng(n * 10_000 + k)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((13, k)).astype(np.float32)  # 13 rows: tiles of 6, 6 and 1
    out = project(weight, x)
    assert out.shape == (13, n) and np.array_equal(out, fused_multiply_adds(x, weight))
    for rows in (1, 2, 3, 4, 5, 7):  # a row's bits do not depend on the batch or its place in it
        assert np.array_equal(project(weight, x[-rows:]), out[-rows:])


@needs_kernel
def test_bias_and_addend_are_added_after_the_product_in_the_unfused_order() -> None:
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((70, 40)).astype(np.float32)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    bias, addend = rng.standard_normal(70).astype(np.float32), rng.standard_normal((6, 70)).astype(np.float32)
    product = fused_multiply_adds(x, weight)
    assert np.array_equal(project(weight, x, bias=bias), product + bias)
    assert np.array_equal(project(weight, x, bias=bias, addend=addend), addend + (product + bias))
    with pytest.raises(ValueError, match="do not fit"):  # checked in the row kernel, before the C call
        project(weight, x[:, :39])


@needs_kernel
def test_the_norm_and_the_gated_product_are_the_rows_computed_first() -> None:
    rng = np.random.default_rng(11)
    weight = rng.standard_normal((48, 32)).astype(np.float32)
    x, norm_weight = rng.standard_normal((3, 32)).astype(np.float32), rng.standard_normal(32).astype(np.float32)
    assert np.array_equal(project(weight, x, mode=NORMED, norm_weight=norm_weight),
                          project(weight, rms_norm_rows(x, norm_weight, EPS)))
    gate_up = rng.standard_normal((3, 64)).astype(np.float32)
    assert np.array_equal(project(weight, gate_up, mode=GATED),
                          project(weight, silu_rows(gate_up[:, :32]) * gate_up[:, 32:]))


@needs_kernel
@pytest.mark.parametrize("rows, threads", [(1, 2), (4, 3), (5, 2), (13, 3), (16, 2)])
def test_a_product_split_over_threads_has_the_bits_of_one_thread(rows: int, threads: int,
                                                                  restore_threads: None) -> None:
    # 277 channels (17 whole blocks of 16 and a partial one) x 256 inputs: 277 KiB of weights, over the size
    # below which a product stays on one thread.
    rng = np.random.default_rng(rows)
    weight = rng.standard_normal((277, 256)).astype(np.float32)
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    native.set_threads(1)
    alone = project(weight, x)
    native.set_threads(threads)
    assert np.array_equal(project(weight, x), alone) and np.array_equal(alone, fused_multiply_adds(x, weight))

