/* The float32 engine's GEMM on AVX-512: float32 rows x float32 weights, float32 sums.
 *
 * cpu_engine/float32_gemm.py compiles this file on first use and documents why. In short: the weights [n, k]
 * are packed in blocks of 16 output channels, each block [k][16] (one zmm register an input), so that a block
 * is one sequential read. A tile is up to 6 rows x 64 channels (24 sums; with 4 weight registers and a
 * broadcast, 29 of the 32 zmm registers): each weight register is loaded once for 6 rows, each row's input is
 * broadcast once for 4 registers.
 *
 *   out[r][c] = addend[r][c] + (sum_j x[r][j] w[c][j] + bias[c])
 *
 * with bias / addend left out where null. Each sum is one chain of fused multiply-adds over j = 0, 1, ..., k - 1
 * whatever the tile, so a row's result does not depend on the other rows.
 */
#include <immintrin.h>

#define ROWS 6    /* a tile's rows */
#define BLOCKS 4  /* a tile's blocks of 16 channels */

/* Threads (cpu_engine/native.py, set_threads): a product whose weights take at least SPLIT_MIN_BYTES splits its
 * blocks of channels over `threads` threads. Each block, so each output, is still one thread's chain in the same
 * order: the bits do not depend on the threads. Blocks are handed out one at a time (dynamic), so a thread the
 * rest of the stack pushed off its core holds up one block, not its share. */
#define SPLIT_MIN_BYTES (256L << 10)
static int threads = 1;

void float32_gemm_threads(int threads_)
{
    threads = threads_;
}

static inline __attribute__((always_inline)) void tile(
    int rows, int blocks, const float *x, int k, const float *weights, const float *bias, const float *addend,
    float *out, int n, int channels)
{
    __m512 sums[ROWS][BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++)
            sums[r][b] = _mm512_setzero_ps();
    for (int j = 0; j < k; j++) {
        __m512 w[BLOCKS];
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

/* Up to ROWS rows at a time over `blocks` (1 to BLOCKS) blocks: `rows` and `blocks` constants in each call, so
 * each tile unrolls into registers. */
static inline __attribute__((always_inline)) void rows_of(
    int m, int blocks, const float *x, int k, const float *weights, const float *bias, const float *addend,
    float *out, int n, int channels)
{
    for (int r = 0; r < m; r += ROWS) {
        const float *rows = x + (long)r * k;
        const float *a = addend ? addend + (long)r * n : 0;
        float *o = out + (long)r * n;
        switch (m - r < ROWS ? m - r : ROWS) {
        case 1: tile(1, blocks, rows, k, weights, bias, a, o, n, channels); break;
        case 2: tile(2, blocks, rows, k, weights, bias, a, o, n, channels); break;
        case 3: tile(3, blocks, rows, k, weights, bias, a, o, n, channels); break;
        case 4: tile(4, blocks, rows, k, weights, bias, a, o, n, channels); break;
        case 5: tile(5, blocks, rows, k, weights, bias, a, o, n, channels); break;
        default: tile(ROWS, blocks, rows, k, weights, bias, a, o, n, channels); break;
        }
    }
}

/* x [m, k], weights packed for n channels (padded to whole blocks), bias [n] or null, addend [m, n] or null,
 * out [m, n]. */
void float32_gemm(const float *x, int m, int k, const float *weights, int n, const float *bias,
                  const float *addend, float *out)
{
    int blocks = (n + 15) / 16, team_size = 4L * n * k < SPLIT_MIN_BYTES ? 1 : threads;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(team_size) if (team_size > 1)
    for (int b = 0; b < blocks; b += BLOCKS) {
        const float *w = weights + (long)b * k * 16, *bb = bias ? bias + 16 * b : 0, *a = addend ? addend + 16 * b : 0;
        float *o = out + 16 * b;
        switch (blocks - b < BLOCKS ? blocks - b : BLOCKS) {
        case 1: rows_of(m, 1, x, k, w, bb, a, o, n, n - 16 * b); break;
        case 2: rows_of(m, 2, x, k, w, bb, a, o, n, n - 16 * b); break;
        case 3: rows_of(m, 3, x, k, w, bb, a, o, n, n - 16 * b); break;
        default: rows_of(m, BLOCKS, x, k, w, bb, a, o, n, n - 16 * b); break;
        }
    }
}
