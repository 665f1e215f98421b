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
 *
 * With more rows than one tile, a block of 64 channels is read from memory by its first tile and from the core's L2
 * by the rest: the first tile waits on memory and the others leave it idle. So each tile of such a product also
 * prefetches its share of the thread's next block (spread over the j loop), and the next tiles' arithmetic runs
 * while it comes: a `small` step's 49 products of 16 rows from memory, two threads, 8-16% faster.
 */
#include "gemm_common.h"

#define ROWS 6    /* a tile's rows */
#define BLOCKS 4  /* a tile's blocks of 16 channels */
#define CHUNK 16  /* inputs between a tile's prefetches */

KERNEL_THREADS(float32_gemm)

/* sums[r][b] += x[r][j] w[b][j] for j = start .. end - 1, in order. */
static inline __attribute__((always_inline)) void multiply_add(
    int rows, int blocks, const float *x, int k, const float *weights, int start, int end, __m512 sums[ROWS][BLOCKS])
{
    for (int j = start; j < end; j++) {
        __m512 w[BLOCKS];
        for (int b = 0; b < blocks; b++)
            w[b] = _mm512_loadu_ps(weights + (long)b * k * 16 + 16L * j);
        for (int r = 0; r < rows; r++) {
            __m512 a = _mm512_set1_ps(x[(long)r * k + j]);
            for (int b = 0; b < blocks; b++)
                sums[r][b] = _mm512_fmadd_ps(a, w[b], sums[r][b]);
        }
    }
}

static inline __attribute__((always_inline)) void tile(
    int rows, int blocks, const float *x, int k, const float *weights, const float *bias, const float *addend,
    float *out, int n, int channels, const char *prefetch, long prefetch_lines)
{
    __m512 sums[ROWS][BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++)
            sums[r][b] = _mm512_setzero_ps();
    long asked = 0;
    for (int start = 0, end; start < k; start = end) {
        end = pass_end(start, k, CHUNK, prefetch, prefetch_lines, &asked);
        multiply_add(rows, blocks, x, k, weights, start, end, sums);
    }
    for (int b = 0; b < blocks; b++) {
        int left = channels - 16 * b;
        if (left <= 0)
            break;
        __mmask16 mask = lanes(left);
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
 * each tile unrolls into registers. The tiles share the prefetch of `next_lines` cache lines from `next`. */
static inline __attribute__((always_inline)) void rows_of(
    int m, int blocks, const float *x, int k, const float *weights, const float *bias, const float *addend,
    float *out, int n, int channels, const char *next, long next_lines)
{
    int tiles = (m + ROWS - 1) / ROWS;
    for (int r = 0, t = 0; r < m; r += ROWS, t++) {
        const float *rows = x + (long)r * k;
        const float *a = addend ? addend + (long)r * n : 0;
        float *o = out + (long)r * n;
        long first = next_lines * t / tiles, lines = next_lines * (t + 1) / tiles - first;
        const char *p = next ? next + 64 * first : 0;
        switch (m - r < ROWS ? m - r : ROWS) {
        case 1: tile(1, blocks, rows, k, weights, bias, a, o, n, channels, p, lines); break;
        case 2: tile(2, blocks, rows, k, weights, bias, a, o, n, channels, p, lines); break;
        case 3: tile(3, blocks, rows, k, weights, bias, a, o, n, channels, p, lines); break;
        case 4: tile(4, blocks, rows, k, weights, bias, a, o, n, channels, p, lines); break;
        case 5: tile(5, blocks, rows, k, weights, bias, a, o, n, channels, p, lines); break;
        default: tile(ROWS, blocks, rows, k, weights, bias, a, o, n, channels, p, lines); break;
        }
    }
}

/* The BLOCKS blocks from block b (fewer at the end), prefetching the ones `stride` blocks on where there are more
 * rows than one tile. */
static inline __attribute__((always_inline)) void blocks_from(
    int b, int stride, const float *x, int m, int k, const float *weights, int n, const float *bias,
    const float *addend, float *out)
{
    int blocks = (n + 15) / 16, next = b + stride;
    const float *w = weights + (long)b * k * 16, *bb = bias ? bias + 16 * b : 0, *a = addend ? addend + 16 * b : 0;
    float *o = out + 16 * b;
    long next_lines = m > ROWS && next < blocks ? (long)(blocks - next < BLOCKS ? blocks - next : BLOCKS) * k : 0;
    const char *p = next_lines ? (const char *)(weights + (long)next * k * 16) : 0;  /* a block's row j: 64 bytes */
    switch (blocks - b < BLOCKS ? blocks - b : BLOCKS) {
    case 1: rows_of(m, 1, x, k, w, bb, a, o, n, n - 16 * b, p, next_lines); break;
    case 2: rows_of(m, 2, x, k, w, bb, a, o, n, n - 16 * b, p, next_lines); break;
    case 3: rows_of(m, 3, x, k, w, bb, a, o, n, n - 16 * b, p, next_lines); break;
    default: rows_of(m, BLOCKS, x, k, w, bb, a, o, n, n - 16 * b, p, next_lines); break;
    }
}

/* x [m, k], weights packed for n channels (padded to whole blocks), bias [n] or null, addend [m, n] or null,
 * out [m, n]. */
void float32_gemm(const float *x, int m, int k, const float *weights, int n, const float *bias,
                  const float *addend, float *out)
{
    int blocks = (n + 15) / 16, team_size = 4L * n * k < SPLIT_MIN_BYTES ? 1 : threads;
    if (m <= ROWS) {
        #pragma omp parallel for schedule(dynamic, 1) num_threads(team_size) if (team_size > 1)
        for (int b = 0; b < blocks; b += BLOCKS)
            blocks_from(b, 0, x, m, k, weights, n, bias, addend, out);
    } else {
        #pragma omp parallel for schedule(static, 1) num_threads(team_size) if (team_size > 1)
        for (int b = 0; b < blocks; b += BLOCKS)
            blocks_from(b, BLOCKS * team_size, x, m, k, weights, n, bias, addend, out);
    }
}
