/* Decode attention over a paged KV cache (fp32, fp16 or bf16 K/V, fp32 arithmetic; a bf16 cache on
 * AMX bf16 tiles or VDPBF16PS where the CPU has them, attention_bf16.h), for CPUs.
 *
 * Built with -ffp-contract=off (attention/cpu_paged.py): every fused multiply-add is written out
 * (fma16, fma8), so that the same source gives a row the same bits in every function it is
 * inlined into. With contraction on, GCC fused x * y + z * w as fma(x, y, z * w) in one copy and
 * fma(z, w, x * y) in another, and moving code in or out of line changed results.
 *
 * One query token per sequence. Work is split over (sequence, kv head, part of the context): the
 * G query heads that share a kv head (GQA) are processed together, several per pass (a tile), so
 * each key and value row is read from memory once, and the parts' softmax states are merged
 * afterwards. Keys are visited in spans of aligned positions with an online softmax (running max
 * and sum), each span's blocks read where the block table puts them, so nothing is gathered or
 * padded: the cost is one pass over the sequence's KV. Within a span, scores, exponentials and
 * the value sum are separate loops over vectors of 16; exp is a polynomial (relative error ~2e-7)
 * so no vector math library is needed. An fp16 cache halves the
 * bytes read (batched decode attention is bound by them): its rows are converted as they are
 * loaded (F16C), and the same arithmetic runs on them.
 *
 * Consecutive rows of one prefill chunk (the default model's every prompt row is a kernel row)
 * form a row tile: one work item loads each block once for all of them, each row's arithmetic
 * unchanged, so a row has the same bits in any chunk, tile or batch, and alone as a decode row.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "paged_attention.h"
#include "rowops.h"
#include "transpose16.h"
#ifdef __F16C__
#include <immintrin.h>
#endif

#define MAX_GROUP 32
#define MAX_HEAD_DIM 512
#define MAX_HALF_ROWS 8192 /* floats of a span's fp16 K or V rows converted (span_tokens keeps to it) */

/* GCC vector types: AVX-512 registers where the machine has them, pairs of AVX2 ones otherwise. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef int32_t vi8 __attribute__((vector_size(32)));

/* The rows j = 0..n-1 of one block for kv head kvh, as fp32 rows `*row_stride` floats apart:
 * pointers into an fp32 cache, or an fp16 or bf16 cache's rows converted into `buffer`. */
static inline const float *block_rows(const void *cache, int64_t kv_format, int64_t first_slot, int64_t n,
                                      int64_t slot_stride, int64_t offset, int64_t head_dim, float *buffer,
                                      int64_t *row_stride) {
    if (kv_format == KV_FLOAT32) {
        *row_stride = slot_stride;
        return (const float *)cache + first_slot * slot_stride + offset;
    }
    *row_stride = head_dim;
    if (kv_format == KV_BFLOAT16) {
        const uint16_t *bf = (const uint16_t *)cache + first_slot * slot_stride + offset;
        for (int64_t j = 0; j < n; ++j)
            for (int64_t d = 0; d < head_dim; ++d) buffer[j * head_dim + d] = from_bf16(bf[j * slot_stride + d]);
        return buffer;
    }
    const _Float16 *half = (const _Float16 *)cache + first_slot * slot_stride + offset;
    for (int64_t j = 0; j < n; ++j) {
        const _Float16 *src = half + j * slot_stride;
        float *dst = buffer + j * head_dim;
        int64_t d = 0;
#ifdef __F16C__
        /* The compiler converts _Float16 one element at a time; F16C does 8 per instruction. */
        for (; d + 8 <= head_dim; d += 8)
            _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
#endif
        for (; d < head_dim; ++d) dst[d] = (float)src[d];
    }
    return buffer;
}

/* A decode row's context is split into parts of PART_TOKENS positions, aligned to absolute
 * positions (part p holds p * PART_TOKENS ..), each a work item, merged afterwards: a batch of
 * one row with a few kv heads then keeps both threads busy. The split depends only on the row's
 * own start and length, never on the batch, so a row's result is the same in every batch. */
#define PART_TOKENS 128

/* A row's online softmax takes one step per span: the keys of span_tokens(D) aligned positions
 * (a power of two dividing PART_TOKENS, however many blocks hold them), scored block by block,
 * then one maximum, one rescaling of the running sums and one pass over the values. A step per
 * block of 16 spent as much on that bookkeeping as on the keys. Spans depend on positions only,
 * so a row's steps are the same in any chunk, tile or batch. */
#define SPAN_MAX 64
static inline int64_t span_tokens(int64_t head_dim) {
    int64_t span = SPAN_MAX;
    while (span > 1 && span * head_dim > MAX_HALF_ROWS) span /= 2; /* a span's fp16 values fit v_buffer */
    return span;
}

/* Consecutive value rows of a span in one block: n rows `stride` elements apart (fp32, or fp16
 * converted as loaded). */
typedef struct {
    const void *rows;
    int64_t stride, n;
} segment;

static inline v16 load16(const float *p) {
    v16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* 16 fp16 values as fp32 (exact): one conversion instruction with AVX-512, two with F16C. */
static inline v16 load16_half(const _Float16 *p) {
    v16 x;
#if defined(__AVX512F__)
    const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&x, &wide, sizeof x);
#elif defined(__F16C__)
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    memcpy(&x, &lo, sizeof lo);
    memcpy((char *)&x + sizeof lo, &hi, sizeof hi);
#else
    for (int i = 0; i < 16; ++i) x[i] = (float)p[i];
#endif
    return x;
}

/* 16 bf16 values as fp32 (exact: the bits shifted into the upper half). */
static inline v16 load16_bf16(const uint16_t *p) {
    vi16 x;
#if defined(__AVX512F__)
    const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    memcpy(&x, &wide, sizeof x);
#else
    for (int i = 0; i < 16; ++i) x[i] = (int32_t)((uint32_t)p[i] << 16);
#endif
    return (v16)x;
}

/* Values index .. index+15 of a block's K or V rows: fp32, or fp16 / bf16 (FORMAT) converted as
 * loaded. */
static inline __attribute__((always_inline)) v16 row16(const void *rows, const int FORMAT, int64_t index) {
    return FORMAT == KV_FLOAT16    ? load16_half((const _Float16 *)rows + index)
           : FORMAT == KV_BFLOAT16 ? load16_bf16((const uint16_t *)rows + index)
                                   : load16((const float *)rows + index);
}

static inline float sum16(v16 x) {
    const v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* Query heads handled per pass over a block's keys and values: each K/V row is loaded once for
 * the tile and every head of it advances its own chain (one FMA chain per head would wait on its
 * own latency). Bounded by the registers: with AVX-512, a tile's value accumulators (TILE * D / 16
 * vectors) and one value row fit in 32; AVX2 registers hold half as much, so one head at a time. */
#ifdef __AVX512F__
#define TILE_FOR(D) ((D) <= 64 ? 4 : 2)
#else
#define TILE_FOR(D) 1
#endif

/* The sums of 16 vectors' lanes, lane i of the result holding x[i]'s sum16: the same additions as
 * sum16 (lanes i and i+8, then i and i+4, then i and i+2, then i and i+1), so the same bits, done
 * for 16 dot products at once by pairing vectors (45 shuffles and additions instead of ~200). */
#ifdef __AVX512F__
/* a * b + c, rounded once (the file is built without contraction). */
static inline __attribute__((always_inline)) v16 fma16(v16 a, v16 b, v16 c) {
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}

static inline __attribute__((always_inline)) v16 splat16(float x) { return (v16)_mm512_set1_ps(x); }

static inline __attribute__((always_inline)) v16 sum16_x16(const v16 *x) {
    v16 a[8], b[4], c[2];
    for (int p = 0; p < 8; ++p) /* [x(2p) lanes i + i+8 | x(2p+1) lanes i + i+8], i < 8 */
        a[p] = __builtin_shufflevector(x[2 * p], x[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(x[2 * p], x[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int p = 0; p < 4; ++p) /* four lanes (i + i+4, i < 4) for each of x(4p) .. x(4p+3) */
        b[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(a[2 * p], a[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int p = 0; p < 2; ++p) /* two lanes (b0 + b2, b1 + b3) for each of x(8p) .. x(8p+7) */
        c[p] = __builtin_shufflevector(b[2 * p], b[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(b[2 * p], b[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Scores of query heads qs[t * D ..], t < T, against a block's n fp32 key rows (k_stride apart; an
 * fp16 block is converted once by the caller). Each head's dot product is summed in the same order
 * whatever the tile, so the bits do not depend on it: 16 keys at a time, their 16 dot products
 * reduced together (sum16_x16), the keys past the last 16 one at a time. */
static inline __attribute__((always_inline)) void tile_scores(const int64_t D, const int T, const float *qs,
                                                              const float *k_rows, int64_t k_stride, int64_t n,
                                                              float (*scores)[SPAN_MAX], int64_t at) {
    const int64_t whole = n - n % 16;
    for (int t = 0; t < T; ++t) {
        v16 qv[MAX_HEAD_DIM / 16];
        for (int64_t c = 0; c < D / 16; ++c) qv[c] = load16(qs + t * D + 16 * c);
        for (int64_t j0 = 0; j0 < whole; j0 += 16) {
            v16 dots[16];
            for (int i = 0; i < 16; ++i) {
                const float *k = k_rows + (j0 + i) * k_stride;
                v16 dot = qv[0] * load16(k);
                for (int64_t c = 1; c < D / 16; ++c) dot = fma16(qv[c], load16(k + 16 * c), dot);
                dots[i] = dot;
            }
            const v16 s = sum16_x16(dots);
            memcpy(scores[t] + at + j0, &s, sizeof s);
        }
        for (int64_t j = whole; j < n; ++j) {
            const float *k = k_rows + j * k_stride;
            v16 dot = qv[0] * load16(k);
            for (int64_t c = 1; c < D / 16; ++c) dot = fma16(qv[c], load16(k + 16 * c), dot);
            scores[t][at + j] = sum16(dot);
        }
    }
}

/* A row tile's rows score each block's keys side by side: 16 keys' rows transposed once (kt[d *
 * 16 + j] = key j's dim d) serve every (row, head) of the tile, and a score needs no shuffles. Lane
 * j of partial i is key j's lane i of tile_scores's dot: q[i] k[i], then + q[16c + i] k[16c + i]
 * for c = 1 .. D/16 - 1, the same products and fused additions in the same order; the 16 partials
 * are then added in sum16's order (i and i+8, then i and i+4, i and i+2, i and i+1). So every
 * score has tile_scores's bits, and a row's bits stay those it has alone as a decode row, while
 * sum16_x16's 45 shuffles and additions per (head, 16 keys) become 15 additions. */
#define KEYS_SIDE_BY_SIDE 1

/* kt[d * 16 + j] = row j's value d, for the 16 fp32 rows at k_rows (k_stride apart), d < D. */
static inline __attribute__((always_inline)) void transpose_keys(const int64_t D, const float *k_rows,
                                                                 int64_t k_stride, float *kt) {
    for (int64_t c = 0; c < D / 16; ++c) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(k_rows + j * k_stride + 16 * c);
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kt + (16 * c + i) * 16, r[i]);
    }
}

/* out[t] = partial i + partial i+8 of head t's 16 scores (t < T, heads qs[t * D ..]). */
static inline __attribute__((always_inline)) void lane_pair(const int64_t D, const int T, const float *qs,
                                                            const float *kt, int i, v16 *out) {
    v16 lo[4], hi[4];
    for (int t = 0; t < T; ++t) {
        lo[t] = qs[t * D + i] * load16(kt + i * 16);
        hi[t] = qs[t * D + i + 8] * load16(kt + (i + 8) * 16);
    }
    for (int64_t c = 1; c < D / 16; ++c) {
        const v16 k_lo = load16(kt + (16 * c + i) * 16), k_hi = load16(kt + (16 * c + i + 8) * 16);
        for (int t = 0; t < T; ++t) {
            lo[t] = fma16(splat16(qs[t * D + 16 * c + i]), k_lo, lo[t]);
            hi[t] = fma16(splat16(qs[t * D + 16 * c + i + 8]), k_hi, hi[t]);
        }
    }
    for (int t = 0; t < T; ++t) out[t] = lo[t] + hi[t];
}

/* tile_scores's 16 scores of heads qs[t * D ..], t < T, against the keys transposed into kt, at
 * scores[t][at ..]: the sums of pairs (0, 4), (2, 6), (1, 5), (3, 7) as they are ready, so that
 * few partials are live at once. */
static inline __attribute__((always_inline)) void tile_scores_kt(const int64_t D, const int T, const float *qs,
                                                                 const float *kt, float (*scores)[SPAN_MAX],
                                                                 int64_t at) {
    v16 x[4], y[4], b0[4], c0[4], b1[4];
    lane_pair(D, T, qs, kt, 0, x);
    lane_pair(D, T, qs, kt, 4, y);
    for (int t = 0; t < T; ++t) b0[t] = x[t] + y[t];
    lane_pair(D, T, qs, kt, 2, x);
    lane_pair(D, T, qs, kt, 6, y);
    for (int t = 0; t < T; ++t) c0[t] = b0[t] + (x[t] + y[t]);
    lane_pair(D, T, qs, kt, 1, x);
    lane_pair(D, T, qs, kt, 5, y);
    for (int t = 0; t < T; ++t) b1[t] = x[t] + y[t];
    lane_pair(D, T, qs, kt, 3, x);
    lane_pair(D, T, qs, kt, 7, y);
    for (int t = 0; t < T; ++t) {
        const v16 s = c0[t] + (b1[t] + (x[t] + y[t]));
        memcpy(scores[t] + at, &s, sizeof s);
    }
}

/* acc[t * D ..] = acc * correction[t] + sum_j weights[t][j] * value row j, for t < T and the
 * first n value rows of the span's segments, in order. */
static inline __attribute__((always_inline)) void tile_values(const int64_t D, const int FORMAT, const int T,
                                                              float *acc, const float *correction,
                                                              const segment *values, int64_t n,
                                                              float (*weights)[SPAN_MAX]) {
    v16 av[4][MAX_HEAD_DIM / 16];
    for (int t = 0; t < T; ++t)
        for (int64_t c = 0; c < D / 16; ++c) av[t][c] = load16(acc + t * D + 16 * c) * correction[t];
    for (int64_t s = 0, j = 0; j < n; ++s) {
        const int64_t rows = values[s].n < n - j ? values[s].n : n - j;
        for (int64_t i = 0; i < rows; ++i, ++j) {
            v16 vv[MAX_HEAD_DIM / 16];
            for (int64_t c = 0; c < D / 16; ++c) {
                vv[c] = row16(values[s].rows, FORMAT, i * values[s].stride + 16 * c);
                /* in a register for the T heads: folded into each FMA, the row was loaded T times
                 * and the loads, not the FMAs, set the pace */
                __asm__("" : "+v"(vv[c]));
            }
            for (int t = 0; t < T; ++t)
                for (int64_t c = 0; c < D / 16; ++c) av[t][c] = fma16(splat16(weights[t][j]), vv[c], av[t][c]);
        }
    }
    for (int t = 0; t < T; ++t) memcpy(acc + t * D, av[t], D * sizeof(float));
}

/* rowops.h's exp16_clamped for x <= 0 (a score less its span's maximum), its polynomial's steps
 * fused, in fewer instructions: the upper clamp never applies, the lower one is a maximum (VMAXPS
 * returns its second operand, x, for a NaN, as the comparison keeps it), and floor(t) one
 * rounding instruction instead of a truncation, a comparison and a correction (the same value). */
static inline v16 exp16_nonpositive(v16 x) {
    x = (v16)_mm512_max_ps(_mm512_set1_ps(-87.0f), (__m512)x);
    const v16 t = x * 1.44269504088896341f;
    const v16 n = (v16)_mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const v16 f = t - n;
    const v16 p = EXP2_OF_FRACTION_FUSED(f, fma16, splat16);
    return (v16)((vi16)p + (__builtin_convertvector(n, vi16) << 23));
}

/* e^(s_j - max) in place for j < n, returning their sum: 16 at a time (exp16_nonpositive, each
 * 16 summed by sum16), the rest one by one, in order. Four 16s' sums are reduced side by side,
 * with sum16's additions in its order (lanes i + i+8, then i + i+4, then b0 + b2 and b1 + b3,
 * then those two): one tree for four instead of four (a 427-row chunk after 3,328 positions
 * 5-8% faster, one thread, Zen 4). */
static inline float exponentiate(float *s, int64_t n, float max) {
    float sum = 0.0f;
    int64_t j = 0;
    for (; j + 64 <= n; j += 64) {
        __m512 e[4];
        for (int k = 0; k < 4; ++k) {
            e[k] = (__m512)exp16_nonpositive(load16(s + j + 16 * k) - max);
            _mm512_storeu_ps(s + j + 16 * k, e[k]);
        }
        /* lanes 8k .. 8k+7 of a: x(k)'s i + i+8 (for e[0], e[1]; b: e[2], e[3]) */
        const __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x44), _mm512_shuffle_f32x4(e[0], e[1], 0xee));
        const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(e[2], e[3], 0x44), _mm512_shuffle_f32x4(e[2], e[3], 0xee));
        /* lanes 4k .. 4k+3: x(k)'s i + i+4 */
        const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
        const __m512 d = _mm512_add_ps(c, _mm512_permute_ps(c, 0x4e)); /* 4k: b0 + b2, 4k+1: b1 + b3 */
        const __m512 sums = _mm512_add_ps(d, _mm512_permute_ps(d, 0xb1));
        float lanes[16];
        _mm512_storeu_ps(lanes, sums);
        sum = (((sum + lanes[0]) + lanes[4]) + lanes[8]) + lanes[12];
    }
    for (; j + 16 <= n; j += 16) {
        const v16 e = exp16_nonpositive(load16(s + j) - max);
        memcpy(s + j, &e, sizeof e);
        sum += sum16(e);
    }
    for (; j < n; ++j) {
        s[j] = exp_clamped(s[j] - max);
        sum += s[j];
    }
    return sum;
}

#else
#define KEYS_SIDE_BY_SIDE 0 /* a block's keys are transposed with AVX-512 shuffles only */
/* Without AVX-512 GCC lowers 16-lane vectors badly: their shuffles one element at a time, a
 * scalar times a 16-lane vector through the stack (prefill attention took ~6x as long as on
 * AVX-512). The same two functions on 8-lane halves: every lane's operations are the ones
 * above, in the same order, and the 16 dot products' reduction runs sum16's additions on
 * 128-bit halves (vperm2f128) and lanes within them (vshufps). */
/* a * b + c, rounded once where the build has FMA; a product and a sum in the portable build. */
static inline __attribute__((always_inline)) v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline __attribute__((always_inline)) v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

static inline v8 load8(const float *p) {
    v8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline v8 load8_half(const _Float16 *p) {
    v8 x;
#if defined(__F16C__)
    const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(&x, &wide, sizeof x);
#else
    for (int i = 0; i < 8; ++i) x[i] = (float)p[i];
#endif
    return x;
}

static inline v8 load8_bf16(const uint16_t *p) {
    vi8 x;
#if defined(__AVX2__)
    const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    memcpy(&x, &wide, sizeof x);
#else
    for (int i = 0; i < 8; ++i) x[i] = (int32_t)((uint32_t)p[i] << 16);
#endif
    return (v8)x;
}

static inline __attribute__((always_inline)) v8 row8(const void *rows, const int FORMAT, int64_t index) {
    return FORMAT == KV_FLOAT16    ? load8_half((const _Float16 *)rows + index)
           : FORMAT == KV_BFLOAT16 ? load8_bf16((const uint16_t *)rows + index)
                                   : load8((const float *)rows + index);
}

/* A dot product's 16 lanes (query halves qlo/qhi against key row k), as sum16's first step
 * leaves them: lane j holds lanes j + j+8. */
static inline __attribute__((always_inline)) v8 dot_halves(const v8 *qlo, const v8 *qhi, const float *k, int64_t D) {
    v8 lo = qlo[0] * load8(k), hi = qhi[0] * load8(k + 8);
    for (int64_t c = 1; c < D / 16; ++c) {
        lo = fma8(qlo[c], load8(k + 16 * c), lo);
        hi = fma8(qhi[c], load8(k + 16 * c + 8), hi);
    }
    return lo + hi;
}

/* The rest of sum16's additions on dot_halves' result. */
static inline float sum16_rest(v8 a) {
    const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* sum16_x16 given a[i] = the lanes j + j+8 (j < 8) of dot product i: out[0..16) its 16 sums. */
static inline __attribute__((always_inline)) void sum16_x16_halves(const v8 *a, float *out) {
    v8 b[8], c[4], e[2];
    for (int p = 0; p < 8; ++p) /* [x(2p) lanes i + i+4 | x(2p+1) lanes i + i+4], i < 4 */
        b[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a[2 * p], a[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int p = 0; p < 4; ++p) /* [x(4p): b0+b2, b1+b3, x(4p+2): .. | x(4p+1): .., x(4p+3): ..] */
        c[p] = __builtin_shufflevector(b[2 * p], b[2 * p + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(b[2 * p], b[2 * p + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    for (int p = 0; p < 2; ++p) /* sums of x(8p + 0, 2, 4, 6 | 1, 3, 5, 7) */
        e[p] = __builtin_shufflevector(c[2 * p], c[2 * p + 1], 0, 2, 8, 10, 4, 6, 12, 14) +
               __builtin_shufflevector(c[2 * p], c[2 * p + 1], 1, 3, 9, 11, 5, 7, 13, 15);
    for (int p = 0; p < 2; ++p) {
        const v8 ordered = __builtin_shufflevector(e[p], e[p], 0, 4, 1, 5, 2, 6, 3, 7);
        memcpy(out + 8 * p, &ordered, sizeof ordered);
    }
}

static inline __attribute__((always_inline)) void tile_scores(const int64_t D, const int T, const float *qs,
                                                              const float *k_rows, int64_t k_stride, int64_t n,
                                                              float (*scores)[SPAN_MAX], int64_t at) {
    const int64_t whole = n - n % 16;
    for (int t = 0; t < T; ++t) {
        v8 qlo[MAX_HEAD_DIM / 16], qhi[MAX_HEAD_DIM / 16];
        for (int64_t c = 0; c < D / 16; ++c) {
            qlo[c] = load8(qs + t * D + 16 * c);
            qhi[c] = load8(qs + t * D + 16 * c + 8);
        }
        for (int64_t j0 = 0; j0 < whole; j0 += 16) {
            v8 a[16];
            for (int i = 0; i < 16; ++i) a[i] = dot_halves(qlo, qhi, k_rows + (j0 + i) * k_stride, D);
            sum16_x16_halves(a, scores[t] + at + j0);
        }
        for (int64_t j = whole; j < n; ++j)
            scores[t][at + j] = sum16_rest(dot_halves(qlo, qhi, k_rows + j * k_stride, D));
    }
}

static inline __attribute__((always_inline)) void tile_values(const int64_t D, const int FORMAT, const int T,
                                                              float *acc, const float *correction,
                                                              const segment *values, int64_t n,
                                                              float (*weights)[SPAN_MAX]) {
    v8 av[4][MAX_HEAD_DIM / 8];
    for (int t = 0; t < T; ++t)
        for (int64_t c = 0; c < D / 8; ++c) av[t][c] = load8(acc + t * D + 8 * c) * correction[t];
    for (int64_t s = 0, j = 0; j < n; ++s) {
        const int64_t rows = values[s].n < n - j ? values[s].n : n - j;
        for (int64_t i = 0; i < rows; ++i, ++j) {
            v8 vv[MAX_HEAD_DIM / 8];
            for (int64_t c = 0; c < D / 8; ++c) vv[c] = row8(values[s].rows, FORMAT, i * values[s].stride + 8 * c);
            for (int t = 0; t < T; ++t) {
                const float w = weights[t][j];
                for (int64_t c = 0; c < D / 8; ++c) av[t][c] = fma8(splat8(w), vv[c], av[t][c]);
            }
        }
    }
    for (int t = 0; t < T; ++t) memcpy(acc + t * D, av[t], D * sizeof(float));
}
/* rowops.h's exp16_clamped on 8 lanes for x <= 0 (its upper clamp never applies there): the same
 * operations per lane. */
static inline v8 exp8_nonpositive(v8 x) {
    const vi8 low = x < -87.0f;
    x = (v8)(((vi8)x & ~low) | ((vi8)(x * 0.0f - 87.0f) & low));
    const v8 t = x * 1.44269504088896341f;
    const v8 toward_zero = __builtin_convertvector(__builtin_convertvector(t, vi8), v8);
    const v8 n = toward_zero + __builtin_convertvector(toward_zero > t, v8);
    const v8 f = t - n;
    const v8 p = EXP2_OF_FRACTION_FUSED(f, fma8, splat8);
    return (v8)((vi8)p + (__builtin_convertvector(n, vi8) << 23));
}

/* exponentiate (above) on 8-lane halves: each 16's exponentials as exp16_clamped's lanes,
 * their sum as sum16's (lanes i + i+8 first), so the same bits as the AVX-512 build. */
static inline float exponentiate(float *s, int64_t n, float max) {
    float sum = 0.0f;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const v8 lo = exp8_nonpositive(load8(s + j) - max), hi = exp8_nonpositive(load8(s + j + 8) - max);
        memcpy(s + j, &lo, sizeof lo);
        memcpy(s + j + 8, &hi, sizeof hi);
        sum += sum16_rest(lo + hi);
    }
    for (; j < n; ++j) {
        s[j] = exp_clamped(s[j] - max);
        sum += s[j];
    }
    return sum;
}
#endif

/* The largest of s_j (j < n) and `running`: exact, so the order of the comparisons is free;
 * 16 or 8 lanes at a time (the compiler does not vectorize a running maximum by itself). */
static inline float scores_max(const float *s, int64_t n, float running) {
    int64_t j = 0;
#ifdef __AVX512F__
    if (n >= 16) { /* VMAXPS(x, top) is x > top ? x : top, the 8-lane loop's selection */
        __m512 top = _mm512_loadu_ps(s);
        for (j = 16; j + 16 <= n; j += 16) top = _mm512_max_ps(_mm512_loadu_ps(s + j), top);
        const float lanes = _mm512_reduce_max_ps(top);
        running = lanes > running ? lanes : running;
    }
#else
    if (n >= 8) {
        v8 top;
        memcpy(&top, s, sizeof top);
        for (j = 8; j + 8 <= n; j += 8) {
            v8 x;
            memcpy(&x, s + j, sizeof x);
            const vi8 above = x > top;
            top = (v8)(((vi8)x & above) | ((vi8)top & ~above));
        }
        for (int i = 0; i < 8; ++i) running = top[i] > running ? top[i] : running;
    }
#endif
    for (; j < n; ++j) running = s[j] > running ? s[j] : running;
    return running;
}

/* call(T) for a tile of `count` heads (at most 4), T the same number as a constant. */
#define DISPATCH_TILE(count, call) \
    switch (count) {               \
    case 1: call(1); break;        \
    case 2: call(2); break;        \
    case 3: call(3); break;        \
    default: call(4); break;       \
    }

/* Ask for the K and V rows of one kv head in slots first_slot .. first_slot+n-1 (row_bytes each, at
 * byte `column` of slots slot_bytes apart): the hardware prefetchers do not follow a block table
 * to the next block, nor reliably pick out these lines of each slot. Into L2 (locality 2), not
 * L1: a block's 64 lines at once overflow L1's miss buffers, and with prefetches into L1 fp16
 * decode attention took ~1.5x as long (bench attention_kernels, bandwidth). Always inlined: out
 * of line, GCC 12 finds the function free of effects and drops its calls. */
static inline __attribute__((always_inline)) void prefetch_rows(const void *k_cache, const void *v_cache,
                                                                int64_t first_slot, int64_t n, int64_t slot_bytes,
                                                                int64_t column, int64_t row_bytes) {
    for (int64_t j = 0; j < n; ++j) {
        const int64_t at = (first_slot + j) * slot_bytes + column;
        for (int64_t b = 0; b < row_bytes; b += 64) { /* one per 64-byte line */
            __builtin_prefetch((const char *)k_cache + at + b, 0, 2);
            __builtin_prefetch((const char *)v_cache + at + b, 0, 2);
        }
    }
}

/* Rows of one sequence's chunk attended together (a row tile): each block's keys and values are
 * loaded (and an fp16 block converted) once for all of them, while every row runs the arithmetic
 * it runs alone, so its bits do not depend on the tile. Without the tile, each row of a long
 * prefill chunk streamed the whole context from memory again. */
#define ROW_TILE 64
/* Floats of a tile's queries and of its outputs, and its (row, query head) pairs: ROW_TILE rows
 * where the group and head_dim allow. 64 rows of SmolLM2's 3 heads per kv head are the AMX
 * path's twelve full blocks of 16 queries, among which it shares each part's staged K and V; a
 * tile of 64 rows also reads the context half as often as one of 32 (GGUF 8k prefill: 27.4 s
 * with 32 rows, 23.6 s with 64, `deepinfer bench prefill`). */
#define TILE_FLOATS (MAX_GROUP * MAX_HEAD_DIM)
#define TILE_QUERIES 256

/* tile_values of a row tile's fp32 (converted) value rows at head_dim 64 and 128, out of line:
 * inlined into attend_span, GCC kept accumulators on the stack (a 427-row chunk after 3,328
 * positions, one layer, one thread, Zen 4: 52.8 ms inlined, 49.3 ms out of line). */
#define VALUES_OUT_OF_LINE(D_, T_)                                                                        \
    static __attribute__((noinline)) void values_##D_##_##T_(float *acc, const float *correction,         \
                                                             const segment *values, int64_t n,            \
                                                             float (*weights)[SPAN_MAX]) {                \
        tile_values(D_, KV_FLOAT32, T_, acc, correction, values, n, weights);                             \
    }
VALUES_OUT_OF_LINE(64, 1)
VALUES_OUT_OF_LINE(64, 2)
VALUES_OUT_OF_LINE(64, 3)
VALUES_OUT_OF_LINE(64, 4)
VALUES_OUT_OF_LINE(128, 1)
VALUES_OUT_OF_LINE(128, 2)
VALUES_OUT_OF_LINE(128, 3)
VALUES_OUT_OF_LINE(128, 4)
#undef VALUES_OUT_OF_LINE
/* tile_values of fp32 rows for T heads (a constant), out of line where D is 64 or 128 */
#define VALUES_FP32(D, T, ...)                  \
    if (D == 64) values_64_##T(__VA_ARGS__);    \
    else if (D == 128) values_128_##T(__VA_ARGS__); \
    else tile_values(D, KV_FLOAT32, T, __VA_ARGS__)

/* Fold positions first .. lasts[r]-1 of rows r < R (one kv head; lasts nondecreasing, the same
 * block table up to each row's last) into their online softmaxes: row r's running max m[r * group
 * + g], sum l[..] and unnormalized output acc[(r * group + g) * D ..] of its query heads qs[(r *
 * group + g) * D ..] (already scaled). Inlined with D and FORMAT (kv_format) constants where the caller
 * dispatches on them, so that a tile's accumulators stay in registers across a block's values. */
static inline __attribute__((always_inline)) void attend_span(
    const int64_t D, const int FORMAT, const int64_t R, const float *qs, const void *k_cache, const void *v_cache,
    const int64_t *table, int64_t first, const int64_t *lasts, int64_t group, int64_t column, int64_t slot_stride,
    int64_t block_size, float *m, float *l, float *acc) {
    const int64_t element = FORMAT == KV_FLOAT32 ? 4 : 2;
    const int vectors = D % 16 == 0; /* every head_dim a model ships; others take scalar loops */
    const int64_t tile = TILE_FOR(D);
    const int64_t last = lasts[R - 1];
    const int64_t span = span_tokens(D);
    /* fp16 value rows are converted once for a tile of rows (and for the scalar loops); a single
     * row converts them as it loads them, which saves a buffer's stores and loads. The values are
     * the same either way. */
    const int half_values = FORMAT != KV_FLOAT32 && R == 1 && vectors;
    float scores[TILE_QUERIES][SPAN_MAX], correction[TILE_QUERIES];
    float k_buffer[MAX_HALF_ROWS], v_buffer[MAX_HALF_ROWS]; /* fp16 rows as fp32 */
    /* A tile of at least 8 heads shares each block's transposes (4 KB of shuffles at head_dim 64,
     * about what sum16_x16 spends on 5 heads); a decode row's few heads keep the row form. */
    const int side_by_side = vectors && R * group >= 8;
#if KEYS_SIDE_BY_SIDE
    float kt[MAX_HEAD_DIM * 16] __attribute__((aligned(64)));
#endif
    segment values[SPAN_MAX];
    /* the first block's rows too: its values are not loaded before its scores are done */
    const int64_t first_rows = block_size - first % block_size < last - first ? block_size - first % block_size
                                                                              : last - first;
    prefetch_rows(k_cache, v_cache, table[first / block_size] * block_size + first % block_size, first_rows,
                  slot_stride * element, column * element, D * element);
    for (int64_t span_start = first; span_start < last;) {
        const int64_t span_end = (span_start / span + 1) * span < last ? (span_start / span + 1) * span : last;
        /* The span's blocks, each scored against every row and head of the tile while its keys are
         * at hand (an fp16 block converted once for all of them). */
        int64_t segments = 0;
        for (int64_t start = span_start; start < span_end; ++segments) {
            const int64_t offset = start % block_size;
            const int64_t room = block_size - offset;
            const int64_t n = span_end - start < room ? span_end - start : room;
            const int64_t base = table[start / block_size] * block_size + offset;
            if (start + n < last && n == room) /* the next block's rows, to overlap this block's arithmetic */
                prefetch_rows(k_cache, v_cache, table[start / block_size + 1] * block_size, block_size,
                              slot_stride * element, column * element, D * element);
            int64_t k_stride;
            const float *k_rows = block_rows(k_cache, FORMAT, base, n, slot_stride, column, D, k_buffer, &k_stride);
            const int64_t at = start - span_start;
            /* keys 0 .. side-1 of the block are scored side by side for the rows that have them */
            const int64_t side = KEYS_SIDE_BY_SIDE && side_by_side ? n - n % 16 : 0;
#if KEYS_SIDE_BY_SIDE
            for (int64_t j0 = 0; j0 < side; j0 += 16) {
                transpose_keys(D, k_rows + j0 * k_stride, k_stride, kt);
                for (int64_t r = 0; r < R; ++r) {
                    if (lasts[r] - start < j0 + 16) continue;
                    const float *qr = qs + r * group * D;
                    for (int64_t g = 0; g < group; g += tile) {
                        const int64_t count = group - g < tile ? group - g : tile;
#define SCORES(T) tile_scores_kt(D, T, qr + g * D, kt, scores + r * group + g, at + j0)
                        DISPATCH_TILE(count, SCORES)
#undef SCORES
                    }
                }
            }
#endif
            for (int64_t r = 0; r < R; ++r) {
                const int64_t nr = lasts[r] - start < n ? lasts[r] - start : n; /* this row's keys of the block */
                if (nr <= 0) continue;
                const int64_t done = nr - nr % 16 < side ? nr - nr % 16 : side; /* scored side by side */
                const float *qr = qs + r * group * D;
                float(*sr)[SPAN_MAX] = scores + r * group;
                for (int64_t g = 0; g < group; g += vectors ? tile : 1) {
                    if (vectors) {
                        const int64_t count = group - g < tile ? group - g : tile;
#define SCORES(T) tile_scores(D, T, qr + g * D, k_rows + done * k_stride, k_stride, nr - done, sr + g, at + done)
                        DISPATCH_TILE(count, SCORES)
#undef SCORES
                    } else {
                        const float *qg = qr + g * D;
                        for (int64_t j = 0; j < nr; ++j) {
                            const float *k = k_rows + j * k_stride;
                            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                            for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
                            sr[g][at + j] = dot;
                        }
                    }
                }
            }
            if (half_values) {
                values[segments] = (segment){(const char *)v_cache + (base * slot_stride + column) * element,
                                             slot_stride, n};
            } else {
                int64_t v_stride;
                const float *v_rows =
                    block_rows(v_cache, FORMAT, base, n, slot_stride, column, D, v_buffer + at * D, &v_stride);
                values[segments] = (segment){v_rows, v_stride, n};
            }
            start += n;
        }
        /* One step of each row's online softmax over its keys of the span, then the values. */
        for (int64_t r = 0; r < R; ++r) {
            const int64_t nr = (lasts[r] < span_end ? lasts[r] : span_end) - span_start;
            if (nr <= 0) continue;
            float *mr = m + r * group, *lr = l + r * group, *ar = acc + r * group * D, *cr = correction + r * group;
            float(*sr)[SPAN_MAX] = scores + r * group;
            for (int64_t g = 0; g < group; ++g) {
                const float span_max = scores_max(sr[g], nr, mr[g]);
                const float span_sum = exponentiate(sr[g], nr, span_max);
                cr[g] = exp_clamped(mr[g] - span_max);
                lr[g] = lr[g] * cr[g] + span_sum;
                mr[g] = span_max;
            }
            for (int64_t g = 0; g < group; g += vectors ? tile : 1) {
                if (vectors) {
                    const int64_t count = group - g < tile ? group - g : tile;
#define VALUES(T)                                                                \
    if (half_values)                                                             \
        tile_values(D, FORMAT, T, ar + g * D, cr + g, values, nr, sr + g);         \
    else                                                                         \
        VALUES_FP32(D, T, ar + g * D, cr + g, values, nr, sr + g)
                    DISPATCH_TILE(count, VALUES)
#undef VALUES
                } else {
                    float *a = ar + g * D;
                    const float *pg = sr[g];
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) a[d] *= cr[g];
                    for (int64_t s = 0, j = 0; j < nr; ++s) {
                        for (int64_t i = 0; i < values[s].n && j < nr; ++i, ++j) {
                            const float *v = (const float *)values[s].rows + i * values[s].stride;
#pragma omp simd
                            for (int64_t d = 0; d < D; ++d) a[d] += pg[j] * v[d];
                        }
                    }
                }
            }
        }
        span_start = span_end;
    }
}

/* The parts of a row attending to positions start .. len-1 (at least one). */
static inline int64_t row_first_part(int64_t start) { return start / PART_TOKENS; }
static inline int64_t row_parts(int64_t start, int64_t len) {
    const int64_t parts = (len + PART_TOKENS - 1) / PART_TOKENS - row_first_part(start);
    return parts > 1 ? parts : 1;
}

/* Floats of scratch per (row, kv head, part): the group's unnormalized outputs, maxima and sums. */
static inline int64_t partial_floats(int64_t group, int64_t head_dim) { return group * (head_dim + 2); }

/* Whether row b (the next row of the call) joins row a's row tile for `part`: the next position of
 * the same chunk (or of a sequence sharing its blocks), with the same window start, a having this
 * part, and the same blocks wherever a reads. Rows so joined have the same first position in the
 * part and read through the last one's block table. */
static inline int join_tile(const int64_t *block_tables, const int64_t *seq_lens, const int64_t *seq_starts,
                            int64_t max_blocks, int64_t block_size, int64_t parts, int64_t part, int64_t a,
                            int64_t b) {
    const int64_t start = seq_starts ? seq_starts[a] : 0, len = seq_lens[a];
    if (seq_lens[b] != len + 1 || (seq_starts && seq_starts[b] != start)) return 0;
    const int64_t count = parts == 1 ? 1 : row_parts(start, len);
    if (part >= count) return 0;
    const int64_t lo = (row_first_part(start) + part) * PART_TOKENS;
    const int64_t first = count == 1 || start > lo ? start : lo;
    const int64_t last = count == 1 || len < lo + PART_TOKENS ? len : lo + PART_TOKENS;
    const int64_t *ta = block_tables + a * max_blocks, *tb = block_tables + b * max_blocks;
    for (int64_t block = first / block_size; block * block_size < last; ++block)
        if (ta[block] != tb[block]) return 0;
    return 1;
}

#include "attention_bf16.h"

#if ATTENTION_BF16
/* Whether a head_dim runs on bf16 products: whole sets of four 16-dim accumulators. */
static inline int bf16_head_dim(int64_t head_dim) { return head_dim % 64 == 0 && head_dim <= BF16_MAX_D; }

/* Whether the bf16 products (tiles, or VDPBF16PS) are wired right: two rows of three heads (40 and
 * 37 keys, one part) against a double-precision softmax of the same bf16 values. Every score is
 * exact (eighths times eighths, summed), so the maxima must be equal; the outputs within the
 * bf16 rounding of P. */
static int bf16_attention_check(int tiles) {
    enum { D = 64, KEYS = 40, GROUP = 3, ROWS = 2, BLOCK = 16 };
    static uint16_t k[KEYS * D], v[KEYS * D];
    float q[ROWS * GROUP * D], m[ROWS * GROUP], l[ROWS * GROUP], acc[ROWS * GROUP * D];
    const int64_t table[3] = {2, 0, 1}, lasts[ROWS] = {37, KEYS};
    uint32_t state = 12345u;
#define SMALL() ((float)((int)((state = state * 1664525u + 1013904223u) >> 28) - 8) / 8.0f)
    for (int i = 0; i < KEYS * D; ++i) k[i] = to_bf16(SMALL()), v[i] = to_bf16(SMALL());
    for (int i = 0; i < ROWS * GROUP * D; ++i) q[i] = SMALL();
#undef SMALL
    /* key j lives in slot table[j / 16] * 16 + j % 16 of the cache (k, v above) */
    bf16_attend(D, ROWS, GROUP, q, GROUP * D, k, v, table, 0, lasts, 0, D, BLOCK, 0.125f, m, l, acc, tiles);
    for (int r = 0; r < ROWS; ++r)
        for (int g = 0; g < GROUP; ++g) {
            const float *qg = q + (r * GROUP + g) * D;
            double scores[KEYS], top = -1e300, total = 0.0;
            for (int j = 0; j < lasts[r]; ++j) {
                const int64_t slot = table[j / BLOCK] * BLOCK + j % BLOCK;
                double dot = 0.0;
                for (int d = 0; d < D; ++d) dot += (double)qg[d] * from_bf16(k[slot * D + d]);
                scores[j] = dot * 0.125;
                top = scores[j] > top ? scores[j] : top;
            }
            const int at = r * GROUP + g;
            if ((double)m[at] != top) return 0;
            for (int j = 0; j < lasts[r]; ++j) total += exp(scores[j] - top);
            if (fabs(l[at] - total) > 1e-4 * total) return 0;
            for (int d = 0; d < D; ++d) {
                double out = 0.0;
                for (int j = 0; j < lasts[r]; ++j)
                    out += exp(scores[j] - top) * from_bf16(v[(table[j / BLOCK] * BLOCK + j % BLOCK) * D + d]);
                if (fabs(acc[at * D + d] - out) > 2e-2 * total) return 0;
            }
        }
    return 1;
}

#if ATTENTION_AMX
static int amx_attention_check(void) { return bf16_attention_check(1); }
static int amx_attention_state; /* 0: not yet known, else amx_status_once's answer */
static int amx_attention_status(void) {
    return amx_status_once(&amx_attention_state, amx_request_permission, amx_attention_check);
}
#endif

static int dot_permitted(void) { return 1; }
static int dot_attention_check(void) { return bf16_attention_check(0); }
static int dot_attention_state;

/* Which bf16 products a bf16 cache's attention runs on: 2 AMX tiles, 1 VDPBF16PS (no tiles in the
 * build, or the OS refused them), 0 neither (not built for AVX512-BF16, or the check failed: a
 * defect, the fp32 path runs instead). Fixed for the process, so every row takes the same one. */
static int bf16_attention_path(void) {
#if ATTENTION_AMX
    if (amx_attention_status() == 1) return 2;
#endif
    return amx_status_once(&dot_attention_state, dot_permitted, dot_attention_check) == 1;
}
#endif

/* bf16_attention_path's answer (0 in a build without AVX512-BF16). */
int paged_attention_bf16_path(void) {
#if ATTENTION_BF16
    return bf16_attention_path();
#else
    return 0;
#endif
}

/* The path a bf16 cache's rows of this head size take: paged_attention_bf16_path's, or 0 (the
 * fp32 path) for a head size the bf16 products do not cover. */
int paged_attention_bf16_rows(int64_t head_dim) {
#if ATTENTION_BF16
    return bf16_head_dim(head_dim) ? bf16_attention_path() : 0;
#else
    (void)head_dim;
    return 0;
#endif
}

/* Computes part `part` of kv head kvh for rows s .. s+rows-1, a run that join_tile links (or one
 * row). A row of one part writes its output; the others leave their softmax state at
 * states + r * row_stride (row s + r). Never inlined, so every caller runs the same instructions. */
static __attribute__((noinline)) void attend_run(const float *q, const void *k_cache, const void *v_cache,
                                                 float *out, const int64_t *block_tables, const int64_t *seq_lens,
                                                 const int64_t *seq_starts, int64_t num_heads, int64_t num_kv_heads,
                                                 int64_t head_dim, int64_t slot_stride, int64_t block_size,
                                                 int64_t max_blocks, float scale, int64_t kv_format, int64_t parts,
                                                 int64_t s, int64_t rows, int64_t kvh, int64_t part, float *states,
                                                 int64_t row_stride) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t start = seq_starts ? seq_starts[s] : 0;
    const int64_t count = parts == 1 ? 1 : row_parts(start, seq_lens[s]);
    const int64_t lo = (row_first_part(start) + part) * PART_TOKENS;
    const int64_t first = count == 1 || start > lo ? start : lo;
    int64_t lasts[ROW_TILE], counts[ROW_TILE];
    float qs[TILE_FLOATS], acc[TILE_FLOATS];
    float m[TILE_QUERIES], l[TILE_QUERIES];
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t row_len = seq_lens[s + r];
        counts[r] = parts == 1 ? 1 : row_parts(start, row_len);
        lasts[r] = counts[r] == 1 || row_len < lo + PART_TOKENS ? row_len : lo + PART_TOKENS;
    }
    const int64_t *table = block_tables + (s + rows - 1) * max_blocks;
    const int64_t column = kvh * head_dim;
#if ATTENTION_BF16
    const int bf16_path = kv_format == KV_BFLOAT16 && bf16_head_dim(head_dim) ? bf16_attention_path() : 0;
    if (bf16_path) {
        bf16_attend(head_dim, rows, group, q + (s * num_heads + kvh * group) * head_dim, num_heads * head_dim,
                    k_cache, v_cache, table, first, lasts, column, slot_stride, block_size, scale, m, l, acc,
                    bf16_path == 2);
    } else
#endif
    {
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t g = 0; g < group; ++g) {
                const float *src = q + ((s + r) * num_heads + kvh * group + g) * head_dim;
                float *qg = qs + (r * group + g) * head_dim, *ag = acc + (r * group + g) * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) {
                    qg[d] = src[d] * scale; /* fold the softmax scale into q once */
                    ag[d] = 0.0f;
                }
                m[r * group + g] = -FLT_MAX;
                l[r * group + g] = 0.0f;
            }
#define ATTEND(D, FORMAT)                                                                                            \
    attend_span(D, FORMAT, rows, qs, k_cache, v_cache, table, first, lasts, group, column, slot_stride, block_size, \
                m, l, acc)
#define ATTEND_FORMATS(D)                                      \
    if (kv_format == KV_FLOAT16) ATTEND(D, KV_FLOAT16);        \
    else if (kv_format == KV_BFLOAT16) ATTEND(D, KV_BFLOAT16); \
    else ATTEND(D, KV_FLOAT32)
        if (head_dim == 64) {
            ATTEND_FORMATS(64);
        } else if (head_dim == 128) {
            ATTEND_FORMATS(128);
        } else {
            ATTEND_FORMATS(head_dim);
        }
    }
#undef ATTEND_FORMATS
#undef ATTEND
    for (int64_t r = 0; r < rows; ++r) {
        const float *ar = acc + r * group * head_dim;
        if (counts[r] == 1) {
            for (int64_t g = 0; g < group; ++g) {
                float *o = out + ((s + r) * num_heads + kvh * group + g) * head_dim;
                const float lg = l[r * group + g], inv = lg > 0.0f ? 1.0f / lg : 0.0f;
                for (int64_t d = 0; d < head_dim; ++d) o[d] = ar[g * head_dim + d] * inv;
            }
            continue;
        }
        float *state = states + r * row_stride;
        memcpy(state, ar, group * head_dim * sizeof(float));
        memcpy(state + group * head_dim, m + r * group, group * sizeof(float));
        memcpy(state + group * head_dim + group, l + r * group, group * sizeof(float));
    }
}

/* Rows per row tile for this shape: ROW_TILE where a tile's queries fit TILE_FLOATS and
 * TILE_QUERIES (MAX_GROUP heads fit both). */
static inline int64_t tile_rows_for(int64_t group, int64_t head_dim) {
    const int64_t by_floats = TILE_FLOATS / (group * head_dim), by_queries = TILE_QUERIES / group;
    const int64_t rows = by_floats < by_queries ? by_floats : by_queries;
    return rows < ROW_TILE ? (rows > 1 ? rows : 1) : ROW_TILE;
}

/* Part `part` of row s's context for kv head kvh. The call of the first row of a row tile (at
 * most ROW_TILE rows that join_tile links, starting at multiples of ROW_TILE or where a link
 * breaks) computes the part for every row of the tile; the others return. A row of one part
 * writes its output; otherwise the part leaves its softmax state in `partial` (at the row's own
 * (kv head, part)) for paged_decode_attention_merge. */
static void attend_part(
    const float *q, const void *k_cache, const void *v_cache, float *out, const int64_t *block_tables,
    const int64_t *seq_lens, const int64_t *seq_starts, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t slot_stride, int64_t block_size, int64_t max_blocks, float scale, int64_t kv_format,
    int64_t parts, float *partial, int64_t s, int64_t kvh, int64_t part) {
    const int64_t start = seq_starts ? seq_starts[s] : 0;
    /* parts == 1: the caller has no scratch; every row is then one part, start .. len - 1 */
    if (part >= (parts == 1 ? 1 : row_parts(start, seq_lens[s]))) return;
    const int64_t tile_rows = tile_rows_for(num_heads / num_kv_heads, head_dim);
#define JOINS(a, b) join_tile(block_tables, seq_lens, seq_starts, max_blocks, block_size, parts, part, a, b)
    if (s % tile_rows && JOINS(s - 1, s)) return; /* computed by its tile's first row */
    int64_t rows = 1;
    while (rows < tile_rows && s + rows < num_rows && (s + rows) % tile_rows && JOINS(s + rows - 1, s + rows)) ++rows;
#undef JOINS
    const int64_t per_part = partial_floats(num_heads / num_kv_heads, head_dim);
    attend_run(q, k_cache, v_cache, out, block_tables, seq_lens, seq_starts, num_heads, num_kv_heads, head_dim,
               slot_stride, block_size, max_blocks, scale, kv_format, parts, s, rows, kvh, part,
               partial + ((s * num_kv_heads + kvh) * parts + part) * per_part, num_kv_heads * parts * per_part);
}

/* Output o[g * head_dim ..] of a row's query heads g < group from its `count` parts' states (the
 * first at `states`, `stride` floats apart), combined in part order. */
static void merge_states(float *o, const float *states, int64_t stride, int64_t count, int64_t group,
                         int64_t head_dim) {
    for (int64_t g = 0; g < group; ++g) {
        float top = -FLT_MAX;
        for (int64_t p = 0; p < count; ++p) {
            const float mp = states[p * stride + group * head_dim + g];
            top = mp > top ? mp : top;
        }
        float total = 0.0f;
        float *og = o + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) og[d] = 0.0f;
        for (int64_t p = 0; p < count; ++p) {
            const float *state = states + p * stride;
            const float w = exp_clamped(state[group * head_dim + g] - top);
            total += state[group * head_dim + group + g] * w;
            for (int64_t d = 0; d < head_dim; ++d) og[d] += state[g * head_dim + d] * w;
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) og[d] *= inv;
    }
}

/* The output of (row, kv head) `pair` from its parts' states, combined in part order. */
__attribute__((noinline)) void paged_decode_attention_merge(float *out, const int64_t *seq_lens,
                                                            const int64_t *seq_starts, int64_t num_heads,
                                                            int64_t num_kv_heads, int64_t head_dim, int64_t parts,
                                                            const float *partial, int64_t pair) {
    const int64_t s = pair / num_kv_heads, kvh = pair % num_kv_heads;
    const int64_t group = num_heads / num_kv_heads, stride = partial_floats(group, head_dim);
    const int64_t count = parts == 1 ? 1 : row_parts(seq_starts ? seq_starts[s] : 0, seq_lens[s]);
    if (count == 1) return; /* written by its only part */
    merge_states(out + (s * num_heads + kvh * group) * head_dim, partial + pair * parts * stride, stride, count, group,
                 head_dim);
}

/* Every part of kv head kvh for the row tile of rows t0 .. t0+tile_rows-1 (t0 a multiple of
 * tile_rows; fewer at the end), then their merges: the same runs and the same arithmetic as the
 * per-part items (attend_part), with the parts' states in `states` (tile_rows * parts
 * * partial_floats floats) instead of a scratch for the whole call. */
static void attend_tile_parts(const float *q, const void *k_cache, const void *v_cache, float *out,
                              const int64_t *block_tables, const int64_t *seq_lens, const int64_t *seq_starts,
                              int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t slot_stride, int64_t block_size, int64_t max_blocks, float scale,
                              int64_t kv_format, int64_t parts, int64_t t0, int64_t kvh, float *states) {
    const int64_t group = num_heads / num_kv_heads, per_part = partial_floats(group, head_dim);
    const int64_t tile_rows = tile_rows_for(group, head_dim);
    const int64_t end = t0 + tile_rows < num_rows ? t0 + tile_rows : num_rows;
    for (int64_t part = 0; part < parts; ++part) {
#define JOINS(a, b) join_tile(block_tables, seq_lens, seq_starts, max_blocks, block_size, parts, part, a, b)
        for (int64_t s = t0; s < end;) {
            const int64_t count = row_parts(seq_starts ? seq_starts[s] : 0, seq_lens[s]);
            int64_t rows = 1;
            while (s + rows < end && JOINS(s + rows - 1, s + rows)) ++rows;
            if (part < count)
                attend_run(q, k_cache, v_cache, out, block_tables, seq_lens, seq_starts, num_heads, num_kv_heads,
                           head_dim, slot_stride, block_size, max_blocks, scale, kv_format, parts, s, rows, kvh, part,
                           states + ((s - t0) * parts + part) * per_part, parts * per_part);
            s += rows;
        }
#undef JOINS
    }
    for (int64_t s = t0; s < end; ++s) {
        const int64_t count = row_parts(seq_starts ? seq_starts[s] : 0, seq_lens[s]);
        if (count > 1)
            merge_states(out + (s * num_heads + kvh * group) * head_dim, states + (s - t0) * parts * per_part,
                         per_part, count, group, head_dim);
    }
}

/* (row tile, kv head) items from which a call runs each item's parts together, and (row, part)
 * items from which a per-part item takes every kv head: enough to share out over the threads of
 * a 2..16-core host (a 512-row chunk of SmolLM2 has 48 of the first kind, 32 streams at 300
 * positions 96 of the second). */
#define WHOLE_TILE_ITEMS 16

/* The plan of a call (attention_plan, paged_attention.h). Many rows (a prefill chunk): an item is
 * a row tile and kv head with all its parts, its parts' states in a scratch of its thread's own,
 * merged by the item (a scratch of the whole call, 75 MB for a 512-row chunk at 8k positions, was
 * faulted in anew at every call). Few rows (decode): an item is one part, so a short batch still
 * keeps every thread busy; the states go to the call's scratch and paged_decode_attention_merge
 * combines them after every item. Where rows and parts are many (batched decode), an item takes
 * the part for every kv head in turn: a slot holds every head's K and V side by side, so the
 * lines the first head leaves unread arrive with its own (the hardware fetches neighbours) and
 * the other heads find them in cache; with one head per item another thread read them later, from
 * memory (bench attention_kernels, bandwidth: ~10% less time per layer on the Intel Xeon with
 * AMX). The bits are the same in every plan. `tiles_allowed` 0 asks for per-part items (a caller
 * that could not allocate the threads' scratch). */
void paged_attention_plan(const int64_t *seq_lens, const int64_t *seq_starts, int64_t num_seqs, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t tiles_allowed, attention_plan *plan) {
    int64_t parts = 1;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t p = row_parts(seq_starts ? seq_starts[s] : 0, seq_lens[s]);
        parts = p > parts ? p : parts;
    }
    const int64_t group = num_heads / num_kv_heads, per_part = partial_floats(group, head_dim);
    const int64_t tile_rows = tile_rows_for(group, head_dim);
    const int64_t tile_items = (num_seqs + tile_rows - 1) / tile_rows * num_kv_heads;
    plan->parts = parts;
    plan->tile_items = tiles_allowed && parts > 1 && tile_items >= WHOLE_TILE_ITEMS;
    plan->item_heads = num_seqs * parts >= 2 * WHOLE_TILE_ITEMS ? num_kv_heads : 1;
    plan->items = plan->tile_items ? tile_items : num_seqs * num_kv_heads / plan->item_heads * parts;
    plan->scratch_floats = !plan->tile_items && parts > 1 ? num_seqs * num_kv_heads * parts * per_part : 0;
    plan->thread_floats = plan->tile_items ? tile_rows * parts * per_part : 0;
}

/* Work item `work` of a call planned by paged_attention_plan: `partial` is the call's scratch
 * (plan->scratch_floats), `states` the calling thread's (plan->thread_floats). Writes the rows'
 * outputs it completes and the states it leaves; after every item of a per-part plan with several
 * parts, paged_decode_attention_merge completes the rest. */
void paged_attention_item(const float *q, const void *k_cache, const void *v_cache, float *out,
                          const int64_t *block_tables, const int64_t *seq_lens, const int64_t *seq_starts,
                          int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t slot_stride, int64_t block_size, int64_t max_blocks, float scale, int64_t kv_format,
                          const attention_plan *plan, float *partial, float *states, int64_t work) {
    if (plan->tile_items)
        attend_tile_parts(q, k_cache, v_cache, out, block_tables, seq_lens, seq_starts, num_rows, num_heads,
                          num_kv_heads, head_dim, slot_stride, block_size, max_blocks, scale, kv_format, plan->parts,
                          work / num_kv_heads * tile_rows_for(num_heads / num_kv_heads, head_dim),
                          work % num_kv_heads, states);
    else
        for (int64_t h = 0; h < plan->item_heads; ++h) { /* work: (row, kv head, part), or (row, part) */
            const int64_t heads = num_kv_heads / plan->item_heads, part = work % plan->parts;
            const int64_t row = work / plan->parts / heads, kvh = plan->item_heads > 1 ? h : work / plan->parts % heads;
            attend_part(q, k_cache, v_cache, out, block_tables, seq_lens, seq_starts, num_rows, num_heads,
                        num_kv_heads, head_dim, slot_stride, block_size, max_blocks, scale, kv_format, plan->parts,
                        partial, row, kvh, part);
        }
}

void paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, float *out,
                            const int64_t *block_tables, const int64_t *seq_lens,
                            const int64_t *seq_starts, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t slot_stride,
                            int64_t block_size, int64_t max_blocks, float scale, int64_t kv_format) {
    /* k_cache/v_cache point at slot 0's K and V; consecutive slots are slot_stride elements apart
     * (float, _Float16 or bf16 as kv_format says). Row s attends to positions seq_starts[s] .. seq_lens[s]-1
     * (seq_starts NULL: from 0; a sliding window starts later). If a scratch cannot be allocated,
     * per-part items replace tile items, and then every row runs as one part. */
    attention_plan plan;
    paged_attention_plan(seq_lens, seq_starts, num_seqs, num_heads, num_kv_heads, head_dim, 1, &plan);
    const int threads = omp_get_max_threads();
    float *states = plan.tile_items ? malloc(plan.thread_floats * threads * sizeof(float)) : NULL;
    if (plan.tile_items && states == NULL)
        paged_attention_plan(seq_lens, seq_starts, num_seqs, num_heads, num_kv_heads, head_dim, 0, &plan);
    float *partial = plan.scratch_floats ? malloc(plan.scratch_floats * sizeof(float)) : NULL;
    if (plan.scratch_floats && partial == NULL) {
        plan.parts = 1;
        plan.item_heads = 1;
        plan.items = num_seqs * num_kv_heads;
        plan.scratch_floats = 0;
    }
#pragma omp parallel num_threads(threads)
    {
        float *mine = states ? states + omp_get_thread_num() * plan.thread_floats : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t work = 0; work < plan.items; ++work)
            paged_attention_item(q, k_cache, v_cache, out, block_tables, seq_lens, seq_starts, num_seqs, num_heads,
                                 num_kv_heads, head_dim, slot_stride, block_size, max_blocks, scale, kv_format, &plan,
                                 partial, mine, work);
        if (!plan.tile_items && plan.parts > 1) {
#pragma omp for schedule(static)
            for (int64_t pair = 0; pair < num_seqs * num_kv_heads; ++pair)
                paged_decode_attention_merge(out, seq_lens, seq_starts, num_heads, num_kv_heads, head_dim, plan.parts,
                                             partial, pair);
        }
    }
    free(states);
    free(partial);
}

/* Store a step's K and V (fp32, `row` values per token, tokens k_stride / v_stride apart) at
 * their cache slots: k_cache/v_cache point at slot 0's K and V, slots are slot_stride elements
 * apart; converted to the cache's format (fp16 or bf16, round to nearest even, as torch does).
 * One call instead of a strided index copy per tensor, whose overhead dominates at batch 1. */
void paged_write_kv(const float *k, const float *v, int64_t k_stride, int64_t v_stride, void *k_cache,
                    void *v_cache, const int64_t *slots, int64_t tokens, int64_t row, int64_t slot_stride,
                    int64_t kv_format) {
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t at = slots[t] * slot_stride;
        const float *kt = k + t * k_stride, *vt = v + t * v_stride;
        if (kv_format == KV_FLOAT16) {
            _Float16 *kd = (_Float16 *)k_cache + at, *vd = (_Float16 *)v_cache + at;
            for (int64_t i = 0; i < row; ++i) {
                kd[i] = (_Float16)kt[i];
                vd[i] = (_Float16)vt[i];
            }
        } else if (kv_format == KV_BFLOAT16) {
            uint16_t *kd = (uint16_t *)k_cache + at, *vd = (uint16_t *)v_cache + at;
            for (int64_t i = 0; i < row; ++i) {
                kd[i] = to_bf16(kt[i]);
                vd[i] = to_bf16(vt[i]);
            }
        } else {
            memcpy((float *)k_cache + at, kt, row * sizeof(float));
            memcpy((float *)v_cache + at, vt, row * sizeof(float));
        }
    }
}
