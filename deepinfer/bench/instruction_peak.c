/* How many of one multiply instruction a core retires per second: the ceiling of any kernel whose
 * work is that instruction (the GGUF products on VPDPBUSD, the fp32 ones on VFMADD231PS).
 *
 * Twelve independent accumulator chains, more than an instruction's latency times its throughput
 * on the x86 cores we run on, so the pipes, not the chains, set the rate. The operands are zeros:
 * no denormals, and an integer or float multiply takes the same time whatever its values. The
 * instructions are written in assembly (the compiler would fold or vectorise a C loop), so the
 * library builds anywhere and the caller runs a kind only where the CPU has it. */
#include <stdint.h>
#include <time.h>

#define AS_STR(x) #x
#define STEP(ins, r, n) ins " %%" r "14, %%" r "15, %%" r AS_STR(n) "\n\t"
#define TWELVE(ins, r)                                                                                  \
    STEP(ins, r, 0) STEP(ins, r, 1) STEP(ins, r, 2) STEP(ins, r, 3) STEP(ins, r, 4) STEP(ins, r, 5)     \
    STEP(ins, r, 6) STEP(ins, r, 7) STEP(ins, r, 8) STEP(ins, r, 9) STEP(ins, r, 10) STEP(ins, r, 11)
#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                 "xmm11", "xmm14", "xmm15"
#define LOOP(ins, r)                                                                                    \
    for (int64_t i = 0; i < iters; ++i) __asm__ volatile(TWELVE(ins, r)::: CLOBBERS)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Instructions of `kind` retired per second by `threads` threads together, each running 12 * iters
 * of them: 0 VPDPBUSD zmm (AVX-512 VNNI), 1 VPMADDUBSW ymm (AVX2), 2 VFMADD231PS zmm (AVX-512F),
 * 3 VFMADD231PS ymm (FMA). -1 for an unknown kind or a build that is not for x86-64. */
double instruction_rate(int kind, int threads, int64_t iters) {
#if defined(__x86_64__)
    if (kind < 0 || kind > 3) return -1.0;
    const double start = now();
#pragma omp parallel num_threads(threads)
    {
        /* VEX-encoded zeroing clears the whole register, zmm included */
        __asm__ volatile("vpxor %%xmm0, %%xmm0, %%xmm0\n\tvpxor %%xmm1, %%xmm1, %%xmm1\n\t"
                         "vpxor %%xmm2, %%xmm2, %%xmm2\n\tvpxor %%xmm3, %%xmm3, %%xmm3\n\t"
                         "vpxor %%xmm4, %%xmm4, %%xmm4\n\tvpxor %%xmm5, %%xmm5, %%xmm5\n\t"
                         "vpxor %%xmm6, %%xmm6, %%xmm6\n\tvpxor %%xmm7, %%xmm7, %%xmm7\n\t"
                         "vpxor %%xmm8, %%xmm8, %%xmm8\n\tvpxor %%xmm9, %%xmm9, %%xmm9\n\t"
                         "vpxor %%xmm10, %%xmm10, %%xmm10\n\tvpxor %%xmm11, %%xmm11, %%xmm11\n\t"
                         "vpxor %%xmm14, %%xmm14, %%xmm14\n\tvpxor %%xmm15, %%xmm15, %%xmm15\n\t" ::
                             : CLOBBERS);
        switch (kind) {
        case 0: LOOP("vpdpbusd", "zmm"); break;
        case 1: LOOP("vpmaddubsw", "ymm"); break;
        case 2: LOOP("vfmadd231ps", "zmm"); break;
        default: LOOP("vfmadd231ps", "ymm"); break;
        }
    }
    return (double)threads * 12.0 * (double)iters / (now() - start);
#else
    (void)kind, (void)threads, (void)iters;
    return -1.0;
#endif
}
