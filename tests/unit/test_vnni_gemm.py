"""Our int8 GEMM for AVX-512 VNNI (cpu_engine/int8_gemm.c through cpu_engine.vnni_gemm): the integer sums
against numpy's, every tile and edge of the packed layout (tests/unit/test_native.py: how it is built and found)."""

from __future__ import annotations

import numpy as np
import pytest

from cpu_engine import native, vnni_gemm
from cpu_engine.row_kernels import GATED, NO_ROW, NO_ROWS, NORMED, PLAIN, rms_norm_rows, silu_rows

needs_vnni = pytest.mark.skipif(vnni_gemm.gemm() is None, reason="needs AVX-512 VNNI and a C compiler")
EPS = np.float32(1e-5)


def codes_of(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documented activation scheme: round(127 x / max|x|) per row (zero point left out), and max|x| / 127."""
    top = np.maximum(np.abs(x).max(axis=1, keepdims=True), np.finfo(np.float32).tiny)
    return np.rint(x * (np.float32(127) / top)).astype(np.int64), (top / np.float32(127)).astype(np.float32)


def expected(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The kernel's float ops in its order on numpy's exact integer sums: (sum x scale) x row scale."""
    codes, row_scale = codes_of(x)
    sums = (codes @ q.T.astype(np.int64)).astype(np.float32)
    return (sums * scale) * row_scale


def project(packed: vnni_gemm.PackedWeight, x: np.ndarray, bias=NO_ROW, addend=NO_ROWS, mode: int = PLAIN,
            norm_weight=NO_ROW) -> np.ndarray:
    return vnni_gemm.project_rows(vnni_gemm.gemm(), x, mode, norm_weight, EPS, packed.arrays, bias, addend)


@needs_vnni
@pytest.mark.parametrize("n, k", [(96, 64), (64, 64), (32, 8), (100, 70), (33, 4), (1, 3), (130, 2050)],
                         ids=lambda v: str(v))
def test_the_kernel_is_the_exact_integer_product_for_every_tile_and_edge(n: int, k: int) -> None:
    # n: whole 64-channel tiles, a lone 32-channel block, partial blocks (masked stores); k: padded to 4.
    rng = np.random.default_rng(n * 10_000 + k)
    q = rng.integers(-127, 128, (n, k), dtype=np.int8)
    scale = (rng.random(n) * 0.01 + 1e-4).astype(np.float32)
    packed = vnni_gemm.PackedWeight(q, scale)
    x = rng.standard_normal((9, k)).astype(np.float32)  # 9 rows: tiles of 4, 4 and 1
    out = project(packed, x)
    assert out.shape == (9, n) and np.array_equal(out, expected(x, q, scale))
    for rows in (1, 2, 3, 5):  # a row's bits do not depend on the batch or its place in it
        assert np.array_equal(project(packed, x[-rows:]), out[-rows:])


@needs_vnni
def test_bias_and_addend_are_added_after_the_product_in_the_unfused_order() -> None:
    rng = np.random.default_rng(7)
    q = rng.integers(-127, 128, (70, 40), dtype=np.int8)
    scale = (rng.random(70) * 0.01).astype(np.float32)
    packed = vnni_gemm.PackedWeight(q, scale)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    bias, addend = rng.standard_normal(70).astype(np.float32), rng.standard_normal((6, 70)).astype(np.float32)
    product = expected(x, q, scale)
    assert np.array_equal(project(packed, x, bias=bias), product + bias)
    assert np.array_equal(project(packed, x, bias=bias, addend=addend), addend + (product + bias))
    assert np.array_equal(project(packed, np.zeros((2, 40), np.float32)), np.zeros((2, 70), np.float32))


@needs_vnni
def test_the_norm_and_the_gated_product_are_quantized_as_if_computed_first() -> None:
    rng = np.random.default_rng(11)
    q = rng.integers(-127, 128, (48, 32), dtype=np.int8)
    scale = np.full(48, 0.01, dtype=np.float32)
    packed = vnni_gemm.PackedWeight(q, scale)
    x, weight = rng.standard_normal((3, 32)).astype(np.float32), rng.standard_normal(32).astype(np.float32)
    assert np.array_equal(project(packed, x, mode=NORMED, norm_weight=weight),
                          project(packed, rms_norm_rows(x, weight, EPS)))
    gate_up = rng.standard_normal((3, 64)).astype(np.float32)
    assert np.array_equal(project(packed, gate_up, mode=GATED),
                          project(packed, silu_rows(gate_up[:, :32]) * gate_up[:, 32:]))


@needs_vnni
def test_the_largest_codes_against_the_largest_weights_do_not_overflow() -> None:
    k = 4096
    q = np.full((32, k), 127, dtype=np.int8)
    q[1::2] = -127
    out = project(vnni_gemm.PackedWeight(q, np.ones(32, np.float32)), np.ones((1, k), np.float32))
    assert np.array_equal(out[0], np.where(np.arange(32) % 2, -127.0 * k, 127.0 * k).astype(np.float32))


@needs_vnni
@pytest.mark.parametrize("rows, threads", [(1, 2), (4, 3), (5, 2), (9, 3), (16, 2)])
def test_a_product_split_over_threads_has_the_bits_of_one_thread(rows: int, threads: int,
                                                                  restore_threads: None) -> None:
    # 1,049 channels (16 pairs of blocks of 32, then a partial block alone) x 256 inputs: 262 KiB of weights, over
    # the size below which a product stays on one thread.
    rng = np.random.default_rng(rows)
    q = rng.integers(-127, 128, (1049, 256), dtype=np.int8)
    scale = (rng.random(1049) * 0.01 + 1e-4).astype(np.float32)
    packed = vnni_gemm.PackedWeight(q, scale)
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    native.set_threads(1)
    alone = project(packed, x)
    native.set_threads(threads)
    assert np.array_equal(project(packed, x), alone) and np.array_equal(alone, expected(x, q, scale))


@needs_vnni
def test_the_quantized_rows_live_until_the_kernel_has_read_them(restore_threads: None) -> None:
    # The codes and row scales are the row kernel's own arrays, passed to C by address: freed at that point, their
    # memory went to the OpenMP runtime's allocations as a team started (wrong rows in ~40% of these calls).
    rng = np.random.default_rng(3)
    q = rng.integers(-127, 128, (130, 1024), dtype=np.int8)
    scale = (rng.random(130) * 0.01 + 1e-4).astype(np.float32)
    packed = vnni_gemm.PackedWeight(q, scale)
    native.set_threads(2)
    for i in range(60):
        x = rng.standard_normal((1 + i % 5, 1024)).astype(np.float32)
        assert np.array_equal(project(packed, x), expected(x, q, scale)), i
