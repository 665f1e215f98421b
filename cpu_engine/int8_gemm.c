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
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Threads (cpu_engine/native.py, set_threads): a product whose weights take at least SPLIT_MIN_BYTES splits its
 * blocks of channels over `threads` threads. Each block, so each output, is still one thread's chain in the same
 * order: the bits do not depend on the threads. Blocks are handed out one at a time (dynamic), so a thread the
 * rest of the stack pushed off its core holds up one block, not its share. */
#define SPLIT_MIN_BYTES (256L << 10)
static int threads = 1;

void int8_gemm_threads(int threads_)
{
    threads = threads_;
}

static inline __attribute__((always_inline)) void tile(
    int rows, int blocks, const uint8_t *codes, int k, const int8_t *weights, const int32_t *offset,
    const float *scale, const float *row_scale, const float *bias, const float *addend, float *out, int n,
    int channels)
{
    __m512i sums[4][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 2 * blocks; j++)
            sums[r][j] = _mm512_setzero_si512();
    for (int group = 0; group < k / 4; group++) {
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
    for (int j = 0; j < 2 * blocks; j++) {
        int left = channels - 16 * j;
        if (left <= 0)
            break;
        __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
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

/* Up to 4 rows at a time over `blocks` (1 or 2) blocks: `rows` a constant in each call, so each tile unrolls. */
static inline __attribute__((always_inline)) void rows_of(
    int m, int blocks, const uint8_t *codes, int k, const int8_t *weights, const int32_t *offset,
    const float *scale, const float *row_scale, const float *bias, const float *addend, float *out, int n,
    int channels)
{
    for (int r = 0; r < m; r += 4) {
        const uint8_t *c = codes + (long)r * k;
        const float *a = addend ? addend + (long)r * n : 0;
        float *o = out + (long)r * n;
        switch (m - r < 4 ? m - r : 4) {
        case 1: tile(1, blocks, c, k, weights, offset, scale, row_scale + r, bias, a, o, n, channels); break;
        case 2: tile(2, blocks, c, k, weights, offset, scale, row_scale + r, bias, a, o, n, channels); break;
        case 3: tile(3, blocks, c, k, weights, offset, scale, row_scale + r, bias, a, o, n, channels); break;
        default: tile(4, blocks, c, k, weights, offset, scale, row_scale + r, bias, a, o, n, channels); break;
        }
    }
}

/* codes [m, k] (k a multiple of 4), weights packed for n channels (offset and scale padded to the blocks),
 * row_scale [m], bias [n] or null, addend [m, n] or null, out [m, n]. */
void int8_gemm(const uint8_t *codes, int m, int k, const int8_t *weights, int n, const int32_t *offset,
               const float *scale, const float *row_scale, const float *bias, const float *addend, float *out)
{
    int blocks = (n + 31) / 32, team_size = (long)n * k < SPLIT_MIN_BYTES ? 1 : threads;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(team_size) if (team_size > 1)
    for (int b = 0; b < blocks - 1; b += 2)  /* pairs of blocks */
        rows_of(m, 2, codes, k, weights + (long)b * k * 32, offset + 32 * b, scale + 32 * b, row_scale,
                bias ? bias + 32 * b : 0, addend ? addend + 32 * b : 0, out + 32 * b, n, n - 32 * b);
    int b = blocks & ~1;
    if (b < blocks)
        rows_of(m, 1, codes, k, weights + (long)b * k * 32, offset + 32 * b, scale + 32 * b, row_scale,
                bias ? bias + 32 * b : 0, addend ? addend + 32 * b : 0, out + 32 * b, n, n - 32 * b);
}
