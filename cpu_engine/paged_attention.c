/* Decode attention over a bfloat16 KV pool (cpu_engine/paged_attention.py says when it runs): softmax(q K^T x
 * scale) V for each decode row, K and V read in place through the row's block table, each row once.
 *
 * Why C and not the numba kernel with a widening load: that kernel is bound by its instructions per K/V row, so
 * halving the bytes gained nothing (benchmarks/README.md, scenario `l`). Here q.K takes 16 positions at a time:
 * each (position, head) leaves a vector of partial sums, and one transpose-add reduction (45 instructions) turns
 * 16 of them into 16 scores, where a horizontal sum per score costs ~8; the online softmax runs on whole vectors;
 * V rows are read 16 at a time, each KV head's query heads summing them in registers. Rows are widened without
 * crossing lanes (widen_row: a 64-byte load, its even values shifted up, its odd ones masked), which leaves each
 * 32 values in even/odd order: q is put in that order once per span, the sums back in the row's order at its end.
 * And the memory is asked for ahead: each position's V row while its scores are computed, the next tile's K rows
 * while this tile's values are summed (into L2; software prefetch of the current tile's rows only, tried before
 * these, gained nothing). From memory the kernel had waited on its loads: at batch 16 x 1,024 positions of `small`
 * the three changes take it from ~11-13 to ~20 GB/s (benchmarks/README.md, scenario `l`).
 *
 * The work is cut as the numba kernel cuts it (span_positions): spans of sequences, in parallel, each with its
 * running max, sum and weighted values, merged per sequence by log-sum-exp; within a span, TILE positions at a
 * time. A span's sums do not depend on the other sequences of the batch; the cut does (as in the numba kernel). */
#include "gemm_common.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

KERNEL_THREADS(paged_attention)

#define TILE 128         /* positions per online-softmax step */
#define MIN_SPAN 256     /* a sequence is cut into spans of at least this many positions */
#define SPANS_PER_THREAD 4
#define MAX_HEADS 64
#define LOWEST (-3.0e38f) /* a finite minus infinity */

/* exp(v) for v <= 0 (floored at -87): Cephes' expf polynomial on [-ln2/2, ln2/2], times 2^k in the exponent. */
static inline __m512 exp16(__m512 v)
{
    v = _mm512_max_ps(v, _mm512_set1_ps(-87.0f));
    __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(v, _mm512_set1_ps(1.4426950408889634f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), v);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
}

/* Lane i of the result: the sum of v[i]'s 16 lanes. */
static inline __m512 sum16(const __m512 *v)
{
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* 16 bfloat16 values widened to float32 (exact: a bfloat16 is a float32's upper half). */
static inline __m512 widen16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* A K or V row's D bfloat16 values as D / 16 float32 vectors, in the paired order (pair_order): each 32 values
 * one 64-byte load, its even values by a shift and its odd ones by a mask (no lane crossing); a last 16 widened
 * as they are. */
static inline __attribute__((always_inline)) void widen_row(const uint16_t *p, __m512 *v, const int D)
{
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    _Pragma("GCC unroll 4") for (int j = 0; j < D / 32; j++) {
        __m512i x = _mm512_loadu_si512((const void *)(p + 32 * j));
        v[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        v[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
    }
    if (D % 32)
        v[D / 16 - 1] = widen16(p + D - 16);
}

/* Where lane i of widen_row's vector j comes from in the row. */
static inline int pair_order(int j, int i, int D)
{
    return 2 * (j / 2) * 16 + (j < D / 16 - (D % 32 ? 1 : 0) ? 2 * i + (j & 1) : i);
}

#define MAX_VALUE_VECTORS 24 /* accumulators a KV head's query heads may keep in registers */

/* acc[G][D] += sum over the `count` rows of s[h][t] x the row's D values at `offset` (G, D constants where inlined:
 * the G x D / 16 sums stay in registers). s rows are `stride` apart. */
static inline __attribute__((always_inline)) void add_values(const uint16_t *const *rows, int count, long offset,
                                                             const float *s, int stride, float *acc, const int D,
                                                             const int G)
{
    const int DV = D / 16;
    __m512 sums[8][8];
    _Pragma("GCC unroll 8") for (int h = 0; h < G; h++)
        _Pragma("GCC unroll 8") for (int j = 0; j < DV; j++)
            sums[h][j] = _mm512_loadu_ps(acc + h * D + 16 * j);
    for (int t = 0; t < count; t++) {
        __m512 v[8];
        widen_row(rows[t] + offset, v, D);
        _Pragma("GCC unroll 8") for (int h = 0; h < G; h++) {
            __m512 w = _mm512_set1_ps(s[h * stride + t]);
            _Pragma("GCC unroll 8") for (int j = 0; j < DV; j++)
                sums[h][j] = _mm512_fmadd_ps(w, v[j], sums[h][j]);
        }
    }
    _Pragma("GCC unroll 8") for (int h = 0; h < G; h++)
        _Pragma("GCC unroll 8") for (int j = 0; j < DV; j++)
            _mm512_storeu_ps(acc + h * D + 16 * j, sums[h][j]);
}

/* Positions [start, end) of one sequence: m, l [heads] <- max score, sum of exp(score - m); acc [heads][D] <- sum of
 * exp(score - m) x V. D is a constant where this is inlined (the register arrays below hold D / 16 vectors). */
static inline __attribute__((always_inline)) void attend_span(
    const float *q, const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *table, int block_size,
    int kv_heads, int group, const int D, float scale, long start, long end, float *m, float *l, float *acc)
{
    const int DV = D / 16;
    const int heads = kv_heads * group;
    const long row = (long)kv_heads * D; /* a position's K (or V) row, in bfloat16 values */
    __m512 partial[MAX_HEADS][16] __attribute__((aligned(64)));
    float s[MAX_HEADS][TILE] __attribute__((aligned(64)));
    const uint16_t *k_rows[TILE], *v_rows[TILE];
    float qp[MAX_HEADS * 128] __attribute__((aligned(64))); /* q in widen_row's order */
    for (int h = 0; h < heads; h++)
        for (int j = 0; j < DV; j++)
            for (int i = 0; i < 16; i++)
                qp[h * D + 16 * j + i] = q[h * D + pair_order(j, i, D)];
    for (int h = 0; h < heads; h++) {
        m[h] = LOWEST;
        l[h] = 0.0f;
        for (int d = 0; d < D; d++)
            acc[h * D + d] = 0.0f;
    }
    for (long first = start; first < end; first += TILE) {
        int n = end - first < TILE ? (int)(end - first) : TILE;
        int padded = (n + 15) & ~15; /* positions past n repeat the first one; their scores are masked */
        for (int t = 0; t < padded; t++) {
            long p = first + (t < n ? t : 0);
            long place = table[p / block_size] * block_size + p % block_size;
            k_rows[t] = k_pool + place * row;
            v_rows[t] = v_pool + place * row;
        }
        /* scores: s[h][t] = scale x q_h . K[t, h / group], 16 positions at a time */
        for (int t0 = 0; t0 < padded; t0 += 16) {
            for (int t = 0; t < 16; t++) {
                for (long b = 0; b < row; b += 32) /* this position's V row, wanted after the scores */
                    _mm_prefetch((const char *)(v_rows[t0 + t] + b), _MM_HINT_T1);
                for (int g = 0; g < kv_heads; g++) {
                    __m512 k[8];
                    widen_row(k_rows[t0 + t] + (long)g * D, k, D);
                    for (int h = g * group; h < g * group + group; h++) {
                        const float *qh = qp + (long)h * D;
                        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), k[0]);
                        _Pragma("GCC unroll 8") for (int j = 1; j < DV; j++)
                            a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * j), k[j], a);
                        partial[h][t] = a;
                    }
                }
            }
            for (int h = 0; h < heads; h++)
                _mm512_store_ps(&s[h][t0], _mm512_mul_ps(sum16(partial[h]), _mm512_set1_ps(scale)));
        }
        /* the online softmax: s[h] <- exp(s[h] - new max), the earlier tiles' sums rescaled */
        for (int h = 0; h < heads; h++) {
            for (int t = n; t < padded; t++)
                s[h][t] = LOWEST;
            __m512 top = _mm512_set1_ps(LOWEST);
            for (int t0 = 0; t0 < padded; t0 += 16)
                top = _mm512_max_ps(top, _mm512_load_ps(&s[h][t0]));
            float tile_max = _mm512_reduce_max_ps(top), old = m[h];
            float new_max = tile_max > old ? tile_max : old;
            __m512 shift = _mm512_set1_ps(new_max), sum = _mm512_setzero_ps();
            for (int t0 = 0; t0 < padded; t0 += 16) {
                __m512 e = exp16(_mm512_sub_ps(_mm512_load_ps(&s[h][t0]), shift));
                if (t0 + 16 > n)
                    e = _mm512_maskz_mov_ps(lanes(n - t0), e);
                _mm512_store_ps(&s[h][t0], e);
                sum = _mm512_add_ps(sum, e);
            }
            float total = _mm512_reduce_add_ps(sum);
            if (new_max > old && old > LOWEST) {
                float alpha = expf(old - new_max);
                l[h] = l[h] * alpha + total;
                float *ah = acc + (long)h * D;
                for (int d = 0; d < D; d++)
                    ah[d] *= alpha;
            } else {
                l[h] += total;
            }
            m[h] = new_max;
        }
        /* values: acc[h] += sum over t of s[h][t] x V[t, h / group], 16 positions at a time, the sums of a KV head's
         * query heads in registers through the 16 (where they fit: group x D / 16 <= MAX_VALUE_VECTORS) */
        for (int t0 = 0; t0 < n; t0 += 16) {
            int count = n - t0 < 16 ? n - t0 : 16;
            for (long p = first + TILE + t0; p < first + TILE + t0 + 16 && p < end; p++) { /* the next tile's K */
                const uint16_t *next = k_pool + (table[p / block_size] * block_size + p % block_size) * row;
                for (long b = 0; b < row; b += 32)
                    _mm_prefetch((const char *)(next + b), _MM_HINT_T1);
            }
            for (int g = 0; g < kv_heads; g++) {
                if (group <= 8 && group * DV <= MAX_VALUE_VECTORS) {
                    switch (group) {
#define GROUP(G)                                                                                                    \
    case G:                                                                                                         \
        add_values(v_rows + t0, count, (long)g * D, &s[g * G][t0], TILE, acc + (long)g * G * D, D, G);             \
        break;
                        GROUP(1) GROUP(2) GROUP(3) GROUP(4) GROUP(5) GROUP(6) GROUP(7) GROUP(8)
#undef GROUP
                    }
                } else { /* one query head at a time, each reading the 16 rows again (from L1) */
                    for (int h = g * group; h < g * group + group; h++)
                        add_values(v_rows + t0, count, (long)g * D, &s[h][t0], TILE, acc + (long)h * D, D, 1);
                }
            }
        }
    }
    for (int h = 0; h < heads; h++) { /* the sums back in the row's order */
        float natural[128];
        for (int j = 0; j < DV; j++)
            for (int i = 0; i < 16; i++)
                natural[pair_order(j, i, D)] = acc[h * D + 16 * j + i];
        for (int d = 0; d < D; d++)
            acc[h * D + d] = natural[d];
    }
}

/* The longest span a sequence is cut into (paged_attention.py span_positions, the same rule). */
static long span_positions(const int64_t *lengths, int batch, int team)
{
    long longest = 1, total = 0;
    for (int b = 0; b < batch; b++) {
        longest = lengths[b] > longest ? lengths[b] : longest;
        total += lengths[b];
    }
    if (team <= 1)
        return longest;
    long target = (total + team * SPANS_PER_THREAD - 1) / (team * SPANS_PER_THREAD);
    target = target > MIN_SPAN ? target : MIN_SPAN;
    target = (target + TILE - 1) / TILE * TILE;
    return target < longest ? target : longest;
}

/* out [batch][heads][head_dim] for q [batch][heads][head_dim] (float32) over k_pool / v_pool [positions][kv_heads]
 * [head_dim] (bfloat16 as uint16), tables [batch][table_stride] block ids, lengths [batch] (each >= 1). head_dim is
 * a multiple of 16 up to 128 (paged_attention.py checks); heads <= MAX_HEADS. Returns 0, or -1 where scratch memory
 * could not be had. */
int paged_attention(const float *q, const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *tables,
                    int table_stride, const int64_t *lengths, int batch, int kv_heads, int group, int head_dim,
                    int block_size, float scale, float *out)
{
    const int heads = kv_heads * group;
    long positions = 0;
    for (int b = 0; b < batch; b++)
        positions += lengths[b];
    /* K and V bytes to read: under the GEMMs' threshold one thread (a team's start would cost more than it saves;
     * at 1 MiB instead, batch-16 steps of `small` at context 32 took 1.05x the float32 cache's time, at 256 KiB
     * 0.99x) */
    int team = positions * 2L * 2 * kv_heads * head_dim >= SPLIT_MIN_BYTES ? threads : 1;
    long span = span_positions(lengths, batch, team), per_row = 1;
    for (int b = 0; b < batch; b++) {
        long spans = (lengths[b] + span - 1) / span;
        per_row = spans > per_row ? spans : per_row;
    }
    long partials = (long)batch * per_row * heads;
    float *m = malloc(sizeof(float) * partials), *l = malloc(sizeof(float) * partials);
    float *acc = malloc(sizeof(float) * partials * head_dim);
    if (!m || !l || !acc) {
        free(m), free(l), free(acc);
        return -1;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(team) if (team > 1)
    for (long item = 0; item < (long)batch * per_row; item++) {
        int b = (int)(item / per_row);
        long start = (item - (long)b * per_row) * span;
        long end = start + span < lengths[b] ? start + span : lengths[b];
        if (start >= end)
            continue;
        const float *qb = q + (long)b * heads * head_dim;
        const int64_t *table = tables + (long)b * table_stride;
        float *mb = m + item * heads, *lb = l + item * heads, *ab = acc + item * heads * head_dim;
        switch (head_dim) { /* each a copy of attend_span whose D is a constant */
#define HEAD_DIM(D)                                                                                                 \
    case D:                                                                                                         \
        attend_span(qb, k_pool, v_pool, table, block_size, kv_heads, group, D, scale, start, end, mb, lb, ab);     \
        break;
            HEAD_DIM(16) HEAD_DIM(32) HEAD_DIM(48) HEAD_DIM(64) HEAD_DIM(80) HEAD_DIM(96) HEAD_DIM(112) HEAD_DIM(128)
#undef HEAD_DIM
        }
    }
    /* each sequence's spans merged (log-sum-exp), in span order */
    for (int b = 0; b < batch; b++) {
        long used = (lengths[b] + span - 1) / span;
        for (int h = 0; h < heads; h++) {
            float top = LOWEST;
            for (long c = 0; c < used; c++) {
                float value = m[((long)b * per_row + c) * heads + h];
                top = value > top ? value : top;
            }
            float *o = out + ((long)b * heads + h) * head_dim, total = 0.0f;
            for (int d = 0; d < head_dim; d++)
                o[d] = 0.0f;
            for (long c = 0; c < used; c++) {
                long i = ((long)b * per_row + c) * heads + h;
                float w = expf(m[i] - top);
                total += w * l[i];
                for (int d = 0; d < head_dim; d++)
                    o[d] += w * acc[i * head_dim + d];
            }
            float inverse = 1.0f / total;
            for (int d = 0; d < head_dim; d++)
                o[d] *= inverse;
        }
    }
    free(m), free(l), free(acc);
    return 0;
}
