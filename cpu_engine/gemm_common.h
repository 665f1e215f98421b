/* What our C kernels (cpu_engine/float32_gemm.c, cpu_engine/int8_gemm.c, cpu_engine/paged_attention.c) share.
 * cpu_engine/native.py hashes this file into each kernel's library name with the kernel's own source, so a change
 * here rebuilds them all. */
#ifndef CPU_ENGINE_GEMM_COMMON_H
#define CPU_ENGINE_GEMM_COMMON_H

#include <immintrin.h>

/* Threads (cpu_engine/native.py, set_threads): a product whose weights take at least SPLIT_MIN_BYTES splits its
 * blocks of channels over `threads` threads. Each block, so each output, is still one thread's chain in the same
 * order: the bits do not depend on the threads. With up to one tile of rows the blocks are handed out one at a
 * time (dynamic), so a thread the rest of the stack pushed off its core holds up one block, not its share; with
 * more, thread t takes blocks t, t + threads, ... (static), so that it knows which block to prefetch. */
#define SPLIT_MIN_BYTES (256L << 10)

/* `static int threads` and its setter `<kernel>_threads`, which native.py calls. */
#define KERNEL_THREADS(kernel)        \
    static int threads = 1;           \
    void kernel##_threads(int threads_) \
    {                                 \
        threads = threads_;           \
    }

/* A tile's passes over its `total` steps of input (inputs, or groups of inputs): with nothing to prefetch one
 * pass; else passes of `chunk` steps, each after asking for its share of the `lines` cache lines at `prefetch`
 * (`*asked` counts those asked for so far). Returns the end of the pass that starts at `start`. */
static inline __attribute__((always_inline)) int pass_end(
    int start, int total, int chunk, const char *prefetch, long lines, long *asked)
{
    if (!lines)
        return total;
    int end = start + chunk < total ? start + chunk : total;
    for (long due = lines * end / total; *asked < due; ++*asked)
        _mm_prefetch(prefetch + 64 * *asked, _MM_HINT_T1);
    return end;
}

/* The lanes of a block's 16 channels that exist when `left` channels are left from its first. */
static inline __mmask16 lanes(int left)
{
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

#endif
