/* The int8 engine's GEMM on AVX-512 VNNI: uint8 activation codes x int8 weights, int32 sums, float32 out.
 *
 * cpu_engine/vnni_gemm.py compiles this file on first use and documents the scheme and the layout. In short:
 * the weights [n, k] are packed in blocks of 32 output channels, each block k / 4 groups of [32 channels][4
 * inputs] (64 x 2 bytes: one zmm register per 16 channels), so that one `vpdpbusd` adds 4 products into each
 * of 16 int32 sums and a block is one sequential read. A tile is up to 4 rows x 64 channels (16 sums): each
 * weight register is loaded once for 4 rows, each row's 4 codes are broadcast once for 4 registers.
 *
 *   out[r][c] = addend[r][c] + ((float)(sum_j code[r][j] w[c][j] - offset[c]) * scale[c] * row_scale[r] + bias[c])
 *
 * with offset[c] = 128 x sum_j w[c][j] (the codes' zero point) and bias / addend left out where null. The sums
 * are exact, the rest is per element: a row's result does not depend on the other rows.
 *
 * With more rows than one tile, each tile of a pair of blocks also prefetches its share of the thread's next pair
 * (as cpu_engine/float32_gemm.c does, which says why): the tiles that read the pair from L2 compute while the next
 * one comes from memory.
 */
#include <stdint.h>
#include <string.h>

#include "gemm_common.h"

/* The team splits pairs of blocks (gemm_common.h says how). */
#define ROWS 4     /* a tile's rows */
#define CHUNK 16   /* groups of 4 inputs between a tile's prefetches */

KERNEL_THREADS(int8_gemm)

/* sums[r][j] += the products of groups start .. end - 1 (4 inputs each), in order. */
static inline __attribute__((always_inline)) void multiply_add(
    int rows, int blocks, const uint8_t *codes, int k, const int8_t *weights, int start, int end,
    __m512i sums[ROWS][4])
{
    for (int group = start; group < end; group++) {
        __m512i w[4];
        for (int b = 0; b < blocks; b++) {
            const int8_t *p = weights + (long)b * k * 32 + 128L * group;
            w[2 * b] = _mm512_loadu_si512((const void *)p);
            w[2 * b + 1] = _mm512_loadu_si512((const void *)(p + 64));
        }
        for (int r = 0; r < rows; r++) {
            int32_t four;
            memcpy(&four, codes + (long)r * k + 4 * group, 4);
            __m512i a = _mm512_set1_epi32(four);
            for (int j = 0; j < 2 * blocks; j++)
                sums[r][j] = _mm512_dpbusd_epi32(sums[r][j], a, w[j]);
        }
    }
}

static inline __attribute__((always_inline)) void tile(
    int rows, int blocks, const uint8_t *codes, int k, const int8_t *weights, const int32_t *offset,
    const float *scale, const float *row_scale, const float *bias, const float *addend, float *out, int n,
    int channels, const char *prefetch, long prefetch_lines)
{
    __m512i sums[ROWS][4];
    int groups = k / 4;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 2 * blocks; j++)
            sums[r][j] = _mm512_setzero_si512();
    long asked = 0;
    for (int start = 0, end; start < groups; start = end) {
        end = pass_end(start, groups, CHUNK, prefetch, prefetch_lines, &asked);
        multiply_add(rows, blocks, codes, k, weights, start, end, sums);
    }
    for (int j = 0; j < 2 * blocks; j++) {
        int left = channels - 16 * j;
        if (left <= 0)
            break;
        __mmask16 mask = lanes(left);
        __m512i off = _mm512_loadu_si512((const void *)(offset + 16 * j));
        __m512 s = _mm512_loadu_ps(scale + 16 * j);
        for (int r = 0; r < rows; r++) {
            __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r][j], off));
            v = _mm512_mul_ps(_mm512_mul_ps(v, s), _mm512_set1_ps(row_scale[r]));
            if (bias)
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + 16 * j));
            if (addend)
                v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, addend + (long)r * n + 16 * j), v);
            _mm512_mask_storeu_ps(out + (long)r * n + 16 * j, mask, v);
        }
    }
}

/* Up to ROWS rows at a time over `blocks` (1 or 2) blocks: `rows` a constant in each call, so each tile unrolls.
 * The tiles share the prefetch of `next_lines` cache lines from `next`. */
static inline __attribute__((always_inline)) void rows_of(
    int m, int blocks, const uint8_t *codes, int k, const int8_t *weights, const int32_t *offset,
    const float *scale, const float *row_scale, const float *bias, const float *addend, float *out, int n,
    int channels, const char *next, long next_lines)
{
    int tiles = (m + ROWS - 1) / ROWS;
    for (int r = 0, t = 0; r < m; r += ROWS, t++) {
        const uint8_t *c = codes + (long)r * k;
        const float *a = addend ? addend + (long)r * n : 0;
        float *o = out + (long)r * n;
        long first = next_lines * t / tiles, lines = next_lines * (t + 1) / tiles - first;
        const char *p = next ? next + 64 * first : 0;
        switch (m - r < ROWS ? m - r : ROWS) {
        case 1: tile(1, blocks, c, k, weights, offset, scale, row_scale + r, bias, a, o, n, channels, p, lines); break;
        case 2: tile(2, blocks, c, k, weights, offset, scale, row_scale + r, bias, a, o, n, channels, p, lines); break;
        case 3: tile(3, blocks, c, k, weights, offset, scale, row_scale + r, bias, a, o, n, channels, p, lines); break;
        default: tile(ROWS, blocks, c, k, weights, offset, scale, row_scale + r, bias, a, o, n, channels, p, lines);
        }
    }
}

/* `blocks` (1 or 2) blocks from block b, prefetching the pair `stride` blocks on where there are more rows than one
 * tile and that pair is whole. */
static inline __attribute__((always_inline)) void blocks_from(
    int b, int blocks, int stride, const uint8_t *codes, int m, int k, const int8_t *weights, int n,
    const int32_t *offset, const float *scale, const float *row_scale, const float *bias, const float *addend,
    float *out)
{
    int next = b + stride;
    long next_lines = stride && m > ROWS && next + 1 < (n + 31) / 32 ? 2L * k * 32 / 64 : 0;
    const char *p = next_lines ? (const char *)(weights + (long)next * k * 32) : 0;  /* a group: 2 lines a block */
    rows_of(m, blocks, codes, k, weights + (long)b * k * 32, offset + 32 * b, scale + 32 * b, row_scale,
            bias ? bias + 32 * b : 0, addend ? addend + 32 * b : 0, out + 32 * b, n, n - 32 * b, p, next_lines);
}

/* codes [m, k] (k a multiple of 4), weights packed for n channels (offset and scale padded to the blocks),
 * row_scale [m], bias [n] or null, addend [m, n] or null, out [m, n]. */
void int8_gemm(const uint8_t *codes, int m, int k, const int8_t *weights, int n, const int32_t *offset,
               const float *scale, const float *row_scale, const float *bias, const float *addend, float *out)
{
    int blocks = (n + 31) / 32, team_size = (long)n * k < SPLIT_MIN_BYTES ? 1 : threads;
    if (m <= ROWS) {
        #pragma omp parallel for schedule(dynamic, 1) num_threads(team_size) if (team_size > 1)
        for (int b = 0; b < blocks - 1; b += 2)  /* pairs of blocks */
            blocks_from(b, 2, 0, codes, m, k, weights, n, offset, scale, row_scale, bias, addend, out);
    } else {
        #pragma omp parallel for schedule(static, 1) num_threads(team_size) if (team_size > 1)
        for (int b = 0; b < blocks - 1; b += 2)
            blocks_from(b, 2, 2 * team_size, codes, m, k, weights, n, offset, scale, row_scale, bias, addend, out);
    }
    if (blocks & 1)
        blocks_from(blocks - 1, 1, 0, codes, m, k, weights, n, offset, scale, row_scale, bias, addend, out);
}
