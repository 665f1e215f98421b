/* The float32 engine's GEMM on AVX-512: float32 rows x float32 weights, float32 sums.
 *
 * cpu_engine/float32_gemm.py compiles this file on first use and documents why. In short: the weights [n, k]
 * are packed in blocks of 16 output channels, each block [k][16] (one zmm register an input), so that a block
 * is one sequential read. A tile is up to 4 rows x 32 channels (8 sums): each weight register is loaded once
 * for 4 rows, each row's input is broadcast once for 2 registers.
 *
 *   out[r][c] = addend[r][c] + (sum_j x[r][j] w[c][j] + bias[c])
 *
 * with bias / addend left out where null. Each sum is one chain of fused multiply-adds over j = 0, 1, ..., k - 1
 * whatever the tile, so a row's result does not depend on the other rows.
 */
#include <immintrin.h>

static inline __attribute__((always_inline)) void tile(
    int rows, int blocks, const float *x, int k, const float *weights, const float *bias, const float *addend,
    float *out, int n, int channels)
{
    __m512 sums[4][2];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++)
            sums[r][b] = _mm512_setzero_ps();
    for (int j = 0; j < k; j++) {
        __m512 w[2];
        for (int b = 0; b < blocks; b++)
            w[b] = _mm512_loadu_ps(weights + (long)b * k * 16 + 16L * j);
        for (int r = 0; r < rows; r++) {
            __m512 a = _mm512_set1_ps(x[(long)r * k + j]);
            for (int b = 0; b < blocks; b++)
                sums[r][b] = _mm512_fmadd_ps(a, w[b], sums[r][b]);
        }
    }
    for (int b = 0; b < blocks; b++) {
        int left = channels - 16 * b;
        if (left <= 0)
            break;
        __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < rows; r++) {
            __m512 v = sums[r][b];
            if (bias)
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + 16 * b));
            if (addend)
                v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, addend + (long)r * n + 16 * b), v);
            _mm512_mask_storeu_ps(out + (long)r * n + 16 * b, mask, v);
        }
    }
}

/* Up to 4 rows at a time over `blocks` (1 or 2) blocks: `rows` a constant in each call, so each tile unrolls. */
static inline __attribute__((always_inline)) void rows_of(
    int m, int blocks, const float *x, int k, const float *weights, const float *bias, const float *addend,
    float *out, int n, int channels)
{
    for (int r = 0; r < m; r += 4) {
        const float *rows = x + (long)r * k;
        const float *a = addend ? addend + (long)r * n : 0;
        float *o = out + (long)r * n;
        switch (m - r < 4 ? m - r : 4) {
        case 1: tile(1, blocks, rows, k, weights, bias, a, o, n, channels); break;
        case 2: tile(2, blocks, rows, k, weights, bias, a, o, n, channels); break;
        case 3: tile(3, blocks, rows, k, weights, bias, a, o, n, channels); break;
        default: tile(4, blocks, rows, k, weights, bias, a, o, n, channels); break;
        }
    }
}

/* x [m, k], weights packed for n channels (padded to whole blocks), bias [n] or null, addend [m, n] or null,
 * out [m, n]. */
void float32_gemm(const float *x, int m, int k, const float *weights, int n, const float *bias,
                  const float *addend, float *out)
{
    int blocks = (n + 15) / 16, b = 0;
    for (; b + 2 <= blocks; b += 2)
        rows_of(m, 2, x, k, weights + (long)b * k * 16, bias ? bias + 16 * b : 0, addend ? addend + 16 * b : 0,
                out + 16 * b, n, n - 16 * b);
    if (b < blocks)
        rows_of(m, 1, x, k, weights + (long)b * k * 16, bias ? bias + 16 * b : 0, addend ? addend + 16 * b : 0,
                out + 16 * b, n, n - 16 * b);
}
