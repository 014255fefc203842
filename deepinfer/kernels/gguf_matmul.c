/* Matrix products with GGUF block-quantized weights (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), for CPUs.
 *
 * y[m, n] = sum_k x[m, k] * W[n, k], W kept in the file's packed blocks (row n = K/block blocks).
 * As llama.cpp does, each activation row is first quantized to int8 per block (32 values for the
 * 32-wide formats, 256 for the k-quants), so every block's dot product is an exact integer sum of
 * u8 x s8 products; floats only scale and add those sums.
 *
 * Numerics (the same on every code path and for every batch composition):
 *  - activations: d = amax / 127 per block, q = round-half-even(x * (1 / d)), integer block sums;
 *  - per (row m, output n): eight float lanes; for each weight block b in order,
 *    lane[l] = fma((float)isum_l(b), d_w(b) * d_a(b), lane[l]), where isum_l(b) is the exact
 *    integer sum over bytes 4l..4l+3 of each 32-byte group of the block (k-quants: with the
 *    sub-block scales multiplied in and the Q6_K offset of 32 taken out as integers);
 *    a separate scalar accumulates the blocks' offset terms (Q4_1's min, Q4_K's dmin) in order;
 *  - y = ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) + offsets.
 * A row's result depends only on its own activations: batching, threads and tiling never change
 * a bit. The AVX2, AVX-512 VNNI (on 256-bit registers) and portable C paths give identical bits
 * (the integer sums are exact, the float operations identical); the file is compiled with
 * -ffp-contract=off so the compiler fuses nothing behind our back.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GGUF_SIMD 1
#else
#define GGUF_SIMD 0
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 }; /* ggml type ids */

/* Packed weight blocks, byte for byte as in a GGUF file. */
typedef struct { uint16_t d; uint8_t qs[16]; } block_q4_0;                 /* (q - 8) * d */
typedef struct { uint16_t d, m; uint8_t qs[16]; } block_q4_1;              /* q * d + m */
typedef struct { uint16_t d; int8_t qs[32]; } block_q8_0;                  /* q * d */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } block_q4_k;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } block_q6_k;

/* Quantized activation blocks. s = d * sum(q) (Q4_1's min term); bsum = sums of 16 values. */
typedef struct { float d, s; int8_t q[32]; } act32;
typedef struct { float d; int16_t bsum[16]; int8_t q[256]; } act256;

static inline float half_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
}

static int block_elems(int qtype) { return qtype == Q4_K || qtype == Q6_K ? 256 : 32; }

static int64_t block_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return sizeof(block_q4_0);
    case Q4_1: return sizeof(block_q4_1);
    case Q8_0: return sizeof(block_q8_0);
    case Q4_K: return sizeof(block_q4_k);
    case Q6_K: return sizeof(block_q6_k);
    default: return 0;
    }
}

/* ---------------------------------------------------------------- activation quantization */

static void quantize_act32(const float *x, int64_t K, act32 *out) {
    for (int64_t b = 0; b < K / 32; ++b, x += 32) {
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[i]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; ++i) {
            const int q = (int)nearbyintf(x[i] * id);
            out[b].q[i] = (int8_t)q;
            sum += q;
        }
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
}

static void quantize_act256(const float *x, int64_t K, act256 *out) {
    for (int64_t b = 0; b < K / 256; ++b, x += 256) {
        float amax = 0.0f;
        for (int i = 0; i < 256; ++i) amax = fmaxf(amax, fabsf(x[i]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < 16; ++j) {
            int sum = 0;
            for (int i = 16 * j; i < 16 * j + 16; ++i) {
                const int q = (int)nearbyintf(x[i] * id);
                out[b].q[i] = (int8_t)q;
                sum += q;
            }
            out[b].bsum[j] = (int16_t)sum;
        }
        out[b].d = d;
    }
}

/* ---------------------------------------------------------------- shared helpers */

/* Q4_K's eight 6-bit scales and mins, unpacked from their 12 bytes. */
static inline void q4k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

static inline float hsum_lanes(const float v[8]) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

/* ---------------------------------------------------------------- portable C path
 * One (weight row, activation row) pair at a time, with the eight lanes spelled out. It is the
 * path for CPUs without AVX2 and the cross-check of the SIMD paths' bits. */

static inline void lanes_fma(float lane[8], const int32_t isum[8], float scale) {
    for (int l = 0; l < 8; ++l) lane[l] = fmaf((float)isum[l], scale, lane[l]);
}

/* isum[l] += sum over bytes 4l..4l+3 of w * a * scale (one 32-byte group). */
static inline void group_dot(int32_t isum[8], const int8_t w[32], const int8_t a[32], int32_t scale) {
    for (int i = 0; i < 32; ++i) isum[i / 4 % 8] += (int32_t)w[i] * a[i] * scale;
}

static float dot_row_scalar(int qtype, const uint8_t *wrow, int64_t nb, const void *arow) {
    float lane[8] = {0}, offset = 0.0f;
    int8_t w[256];
    for (int64_t b = 0; b < nb; ++b) {
        int32_t isum[8] = {0};
        if (qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0) {
            const act32 *a = (const act32 *)arow + b;
            float d, m = 0.0f;
            if (qtype == Q8_0) {
                const block_q8_0 *blk = (const block_q8_0 *)wrow + b;
                memcpy(w, blk->qs, 32);
                d = half_to_float(blk->d);
            } else {
                const uint8_t *qs = qtype == Q4_0 ? ((const block_q4_0 *)wrow)[b].qs : ((const block_q4_1 *)wrow)[b].qs;
                const int bias = qtype == Q4_0 ? 8 : 0;
                for (int i = 0; i < 16; ++i) {
                    w[i] = (int8_t)((qs[i] & 0x0F) - bias);
                    w[i + 16] = (int8_t)((qs[i] >> 4) - bias);
                }
                if (qtype == Q4_0) {
                    d = half_to_float(((const block_q4_0 *)wrow)[b].d);
                } else {
                    d = half_to_float(((const block_q4_1 *)wrow)[b].d);
                    m = half_to_float(((const block_q4_1 *)wrow)[b].m);
                }
            }
            group_dot(isum, w, a->q, 1);
            lanes_fma(lane, isum, d * a->d);
            if (qtype == Q4_1) offset = fmaf(m, a->s, offset);
        } else if (qtype == Q4_K) {
            const block_q4_k *blk = (const block_q4_k *)wrow + b;
            const act256 *a = (const act256 *)arow + b;
            uint8_t sc[8], mn[8];
            q4k_scales(blk->scales, sc, mn);
            int32_t imin = 0;
            for (int c = 0; c < 4; ++c) {
                for (int i = 0; i < 32; ++i) {
                    w[i] = (int8_t)(blk->qs[32 * c + i] & 0x0F);
                    w[i + 32] = (int8_t)(blk->qs[32 * c + i] >> 4);
                }
                group_dot(isum, w, a->q + 64 * c, sc[2 * c]);
                group_dot(isum, w + 32, a->q + 64 * c + 32, sc[2 * c + 1]);
            }
            for (int j = 0; j < 8; ++j) imin += mn[j] * (a->bsum[2 * j] + a->bsum[2 * j + 1]);
            lanes_fma(lane, isum, half_to_float(blk->d) * a->d);
            offset = fmaf(-(half_to_float(blk->dmin) * a->d), (float)imin, offset);
        } else { /* Q6_K */
            const block_q6_k *blk = (const block_q6_k *)wrow + b;
            const act256 *a = (const act256 *)arow + b;
            for (int h = 0; h < 2; ++h) {
                const uint8_t *ql = blk->ql + 64 * h, *qh = blk->qh + 32 * h;
                for (int l = 0; l < 32; ++l) {
                    w[128 * h + l] = (int8_t)((ql[l] & 0x0F) | ((qh[l] & 3) << 4));
                    w[128 * h + l + 32] = (int8_t)((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4));
                    w[128 * h + l + 64] = (int8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    w[128 * h + l + 96] = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            }
            for (int g = 0; g < 8; ++g) {
                /* a 32-byte group spans two 16-value sub-blocks: bytes 0-15 and 16-31 */
                for (int i = 0; i < 32; ++i)
                    isum[i / 4 % 8] += (int32_t)w[32 * g + i] * a->q[32 * g + i] * blk->scales[2 * g + i / 16];
            }
            /* the offset of 32, as integers: lane l gets sub-blocks 2l and 2l+1 */
            for (int l = 0; l < 8; ++l)
                isum[l] -= 32 * (blk->scales[2 * l] * a->bsum[2 * l] + blk->scales[2 * l + 1] * a->bsum[2 * l + 1]);
            lanes_fma(lane, isum, half_to_float(blk->d) * a->d);
        }
    }
    return hsum_lanes(lane) + offset;
}

#if GGUF_SIMD
/* ---------------------------------------------------------------- AVX2 / AVX-512 VNNI paths */

static inline float hsum256(__m256 v) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l, l+4 */
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                             /* +2 */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));                           /* +1 */
}

/* Eight int32 lanes, lane l = sum of bytes 4l..4l+3 of u * s (u unsigned, s signed, no overflow
 * for our ranges, so both forms give the same integers). */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* Same as dot_u8s8 with every 16-bit pair product sum scaled: for the k-quants' sub-block scales. */
static inline __m256i dot_u8s8_scaled(__m256i u, __m256i s, __m256i scale16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale16);
}

static inline __m256i nibbles32(const uint8_t *qs) { /* 16 bytes -> 32 values 0..15, in element order */
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

/* One unpacked 32-wide weight block: unsigned operand, the sign to move onto the activations
 * (signed formats), scale and min. */
typedef struct { __m256i u, sgn; float d, m; } wblock;

static inline __attribute__((always_inline)) wblock load_wblock(const int qtype, const uint8_t *row, int64_t b) {
    wblock w;
    if (qtype == Q4_1) {
        const block_q4_1 *blk = (const block_q4_1 *)row + b;
        w.u = nibbles32(blk->qs);
        w.sgn = w.u;
        w.d = _cvtsh_ss(blk->d);
        w.m = _cvtsh_ss(blk->m);
    } else if (qtype == Q4_0) {
        const block_q4_0 *blk = (const block_q4_0 *)row + b;
        w.sgn = _mm256_sub_epi8(nibbles32(blk->qs), _mm256_set1_epi8(8));
        w.u = _mm256_sign_epi8(w.sgn, w.sgn);
        w.d = _cvtsh_ss(blk->d);
        w.m = 0.0f;
    } else { /* Q8_0 */
        const block_q8_0 *blk = (const block_q8_0 *)row + b;
        w.sgn = _mm256_loadu_si256((const __m256i *)blk->qs);
        w.u = _mm256_sign_epi8(w.sgn, w.sgn);
        w.d = _cvtsh_ss(blk->d);
        w.m = 0.0f;
    }
    return w;
}

/* Output rows [n, n + NR) x activation rows [m, m + MR) of a 32-wide format. */
static inline __attribute__((always_inline)) void tile32(const int qtype, const int NR, const int MR,
                                                          const uint8_t *w, int64_t w_stride, int64_t nb,
                                                          const act32 *a, int64_t a_stride, float *y,
                                                          int64_t ldy) {
    __m256 acc[4][4];
    float offset[4][4];
    for (int i = 0; i < NR; ++i)
        for (int r = 0; r < MR; ++r) {
            acc[i][r] = _mm256_setzero_ps();
            offset[i][r] = 0.0f;
        }
    for (int64_t b = 0; b < nb; ++b) {
        wblock wb[4];
        for (int i = 0; i < NR; ++i) wb[i] = load_wblock(qtype, w + i * w_stride, b);
        for (int r = 0; r < MR; ++r) {
            const act32 *ab = a + r * a_stride + b;
            const __m256i q = _mm256_loadu_si256((const __m256i *)ab->q);
            for (int i = 0; i < NR; ++i) {
                const __m256i s = qtype == Q4_1 ? q : _mm256_sign_epi8(q, wb[i].sgn);
                const __m256i isum = dot_u8s8(wb[i].u, s);
                acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(wb[i].d * ab->d), acc[i][r]);
                if (qtype == Q4_1) offset[i][r] = fmaf(wb[i].m, ab->s, offset[i][r]);
            }
        }
    }
    for (int i = 0; i < NR; ++i)
        for (int r = 0; r < MR; ++r) y[r * ldy + i] = hsum256(acc[i][r]) + offset[i][r];
}

static inline __m256i scale_pair16(int lo, int hi) { /* int16 lanes 0-7 = lo, 8-15 = hi */
    return _mm256_set_m128i(_mm_set1_epi16((int16_t)hi), _mm_set1_epi16((int16_t)lo));
}

/* Output row n x activation rows [m, m + MR) of Q4_K. */
static inline __attribute__((always_inline)) void tile_q4k(const int MR, const uint8_t *w, int64_t nb,
                                                            const act256 *a, int64_t a_stride, float *y,
                                                            int64_t ldy) {
    __m256 acc[4];
    float offset[4];
    for (int r = 0; r < MR; ++r) {
        acc[r] = _mm256_setzero_ps();
        offset[r] = 0.0f;
    }
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
        const block_q4_k *blk = (const block_q4_k *)w + b;
        uint8_t sc[8], mn[8];
        q4k_scales(blk->scales, sc, mn);
        const float d = _cvtsh_ss(blk->d), dmin = _cvtsh_ss(blk->dmin);
        __m256i isum[4];
        for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(blk->qs + 32 * c));
            const __m256i lo = _mm256_and_si256(bytes, mask), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
            const __m256i sc_lo = _mm256_set1_epi16(sc[2 * c]), sc_hi = _mm256_set1_epi16(sc[2 * c + 1]);
            for (int r = 0; r < MR; ++r) {
                const int8_t *q = a[r * a_stride + b].q + 64 * c;
                const __m256i p_lo = dot_u8s8_scaled(lo, _mm256_loadu_si256((const __m256i *)q), sc_lo);
                const __m256i p_hi = dot_u8s8_scaled(hi, _mm256_loadu_si256((const __m256i *)(q + 32)), sc_hi);
                isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(p_lo, p_hi));
            }
        }
        for (int r = 0; r < MR; ++r) {
            const act256 *ab = a + r * a_stride + b;
            int32_t imin = 0;
            for (int j = 0; j < 8; ++j) imin += mn[j] * (ab->bsum[2 * j] + ab->bsum[2 * j + 1]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * ab->d), acc[r]);
            offset[r] = fmaf(-(dmin * ab->d), (float)imin, offset[r]);
        }
    }
    for (int r = 0; r < MR; ++r) y[r * ldy] = hsum256(acc[r]) + offset[r];
}

/* Output row n x activation rows [m, m + MR) of Q6_K. */
static inline __attribute__((always_inline)) void tile_q6k(const int MR, const uint8_t *w, int64_t nb,
                                                            const act256 *a, int64_t a_stride, float *y,
                                                            int64_t ldy) {
    __m256 acc[4];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < nb; ++b) {
        const block_q6_k *blk = (const block_q6_k *)w + b;
        __m256i isum[4];
        for (int r = 0; r < MR; ++r) {
            /* the offset of 32 first, as integers: lane l = scales 2l, 2l+1 times their bsums */
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)blk->scales));
            const __m256i bs = _mm256_loadu_si256((const __m256i *)a[r * a_stride + b].bsum);
            isum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
        }
        for (int h = 0; h < 2; ++h) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk->qh + 32 * h));
            __m256i g[4];
            g[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
            g[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
            g[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
            g[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
            for (int k = 0; k < 4; ++k) {
                const int sub = 8 * h + 2 * k; /* the group's two 16-value sub-blocks */
                const __m256i scale = scale_pair16(blk->scales[sub], blk->scales[sub + 1]);
                for (int r = 0; r < MR; ++r) {
                    const int8_t *q = a[r * a_stride + b].q + 128 * h + 32 * k;
                    const __m256i p = dot_u8s8_scaled(g[k], _mm256_loadu_si256((const __m256i *)q), scale);
                    isum[r] = _mm256_add_epi32(isum[r], p);
                }
            }
        }
        for (int r = 0; r < MR; ++r) {
            const float d = _cvtsh_ss(blk->d) * a[r * a_stride + b].d;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d), acc[r]);
        }
    }
    for (int r = 0; r < MR; ++r) y[r * ldy] = hsum256(acc[r]);
}

#define TILE32_CASE(QT)                                                                                       \
    case QT:                                                                                                  \
        if (nr == 4 && mr == 1) tile32(QT, 4, 1, w, w_stride, nb, a, a_stride, y, ldy);                       \
        else if (nr == 2 && mr == 4) tile32(QT, 2, 4, w, w_stride, nb, a, a_stride, y, ldy);                  \
        else if (nr == 1 && mr == 4) tile32(QT, 1, 4, w, w_stride, nb, a, a_stride, y, ldy);                  \
        else if (nr == 2 && mr == 1) tile32(QT, 2, 1, w, w_stride, nb, a, a_stride, y, ldy);                  \
        else tile32(QT, 1, 1, w, w_stride, nb, a, a_stride, y, ldy);                                          \
        break;

/* One tile through the SIMD path: nr and mr are one of the shapes that the caller picks. */
static void run_tile(int qtype, int nr, int mr, const uint8_t *w, int64_t w_stride, int64_t nb, const void *a,
                     int64_t a_stride, float *y, int64_t ldy) {
    switch (qtype) {
        TILE32_CASE(Q4_0)
        TILE32_CASE(Q4_1)
        TILE32_CASE(Q8_0)
    case Q4_K:
        for (int i = 0; i < nr; ++i) {
            if (mr == 4) tile_q4k(4, w + i * w_stride, nb, a, a_stride, y + i, ldy);
            else tile_q4k(1, w + i * w_stride, nb, a, a_stride, y + i, ldy);
        }
        break;
    case Q6_K:
        for (int i = 0; i < nr; ++i) {
            if (mr == 4) tile_q6k(4, w + i * w_stride, nb, a, a_stride, y + i, ldy);
            else tile_q6k(1, w + i * w_stride, nb, a, a_stride, y + i, ldy);
        }
        break;
    }
}

static void quantize_act32_simd(const float *x, int64_t K, act32 *out) {
    for (int64_t b = 0; b < K / 32; ++b, x += 32) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_loadu_ps(x + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float am = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float d = am / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        __m256i qi[4];
        __m256i sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
            qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            sum = _mm256_add_epi32(sum, qi[i]);
        }
        /* int32 -> int8 in element order (packs interleave the 128-bit halves; undo it) */
        const __m256i p16 = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
        const __m256i p8 = _mm256_packs_epi16(p16, p16b);
        _mm256_storeu_si256((__m256i *)out[b].q, _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        out[b].d = d;
        out[b].s = d * (float)_mm_cvtsi128_si32(s4);
    }
}
#endif /* GGUF_SIMD */

/* ---------------------------------------------------------------- entry points */

static void quantize_rows32(const float *x, int64_t K, act32 *out, int use_simd) {
#if GGUF_SIMD
    if (use_simd) {
        quantize_act32_simd(x, K, out);
        return;
    }
#endif
    (void)use_simd;
    quantize_act32(x, K, out);
}

/* 1 when this build runs the SIMD path, 2 with VNNI dot products, 0 for portable C. */
int gguf_simd_level(void) {
#if GGUF_SIMD && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
    return 2;
#elif GGUF_SIMD
    return 1;
#else
    return 0;
#endif
}

int64_t gguf_block_bytes(int qtype) { return block_bytes(qtype); }

int gguf_block_elems(int qtype) { return block_bytes(qtype) ? block_elems(qtype) : 0; }

/* Bytes of scratch gguf_matmul needs for M rows of K values and these weight types. */
int64_t gguf_scratch_bytes(int64_t M, int64_t K, int64_t nseg, const int32_t *qtypes) {
    int need32 = 0, need256 = 0;
    for (int64_t s = 0; s < nseg; ++s) {
        if (block_elems(qtypes[s]) == 32) need32 = 1;
        else need256 = 1;
    }
    return M * (need32 * (K / 32) * (int64_t)sizeof(act32) + need256 * (K / 256) * (int64_t)sizeof(act256));
}

/* y[M, sum(rows)] (row stride ldy) = x[M, K] (row stride ldx) times the concatenation of nseg
 * packed matrices (segment s: qtypes[s], rows[s] x K, weights[s] row-major blocks) transposed.
 * Writes only y and scratch (gguf_scratch_bytes). simd = 0 forces the portable path. */
void gguf_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t nseg, const int32_t *qtypes,
                 const void *const *weights, const int64_t *rows, void *scratch, float *y, int64_t ldy,
                 int simd) {
    int need32 = 0, need256 = 0;
    for (int64_t s = 0; s < nseg; ++s) {
        if (block_elems(qtypes[s]) == 32) need32 = 1;
        else need256 = 1;
    }
    act32 *a32 = (act32 *)scratch;
    const int64_t a32_stride = K / 32;
    act256 *a256 = (act256 *)((char *)scratch + need32 * M * a32_stride * (int64_t)sizeof(act32));
    const int64_t a256_stride = K / 256;
    const int use_simd = simd && GGUF_SIMD;
    /* Work units of UNIT output rows (never across segments): the static split over threads
     * only decides who computes a row, never how. */
    enum { UNIT = 16 };
    int64_t units = 0;
    for (int64_t s = 0; s < nseg; ++s) units += (rows[s] + UNIT - 1) / UNIT;
    /* Activation rows per pass: a chunk of quantized activations stays in L2 while a unit's
     * weight rows are reused over it. */
    const int64_t act_row_bytes = need32 * a32_stride * (int64_t)sizeof(act32) + need256 * a256_stride * (int64_t)sizeof(act256);
    int64_t m_chunk = (256 << 10) / (act_row_bytes ? act_row_bytes : 1);
    m_chunk = m_chunk < 4 ? 4 : m_chunk - m_chunk % 4;

#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
            if (need32) quantize_rows32(x + m * ldx, K, a32 + m * a32_stride, use_simd);
            if (need256) quantize_act256(x + m * ldx, K, a256 + m * a256_stride);
        }
        /* implicit barrier: every activation row is quantized before any product */
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; ++u) {
            int64_t s = 0, first = u, col0 = 0;
            while (first >= (rows[s] + UNIT - 1) / UNIT) {
                first -= (rows[s] + UNIT - 1) / UNIT;
                col0 += rows[s];
                ++s;
            }
            const int qtype = qtypes[s];
            const int64_t nb = K / block_elems(qtype), w_stride = nb * block_bytes(qtype);
            const int64_t n0 = first * UNIT, n1 = n0 + UNIT < rows[s] ? n0 + UNIT : rows[s];
            const uint8_t *wseg = (const uint8_t *)weights[s];
            const int wide = block_elems(qtype) == 256;
            const int64_t a_stride = wide ? a256_stride : a32_stride;
            for (int64_t m0 = 0; m0 < M; m0 += m_chunk) {
                const int64_t m1 = m0 + m_chunk < M ? m0 + m_chunk : M;
                if (!use_simd) {
                    for (int64_t n = n0; n < n1; ++n)
                        for (int64_t m = m0; m < m1; ++m) {
                            const void *arow = wide ? (const void *)(a256 + m * a_stride) : (const void *)(a32 + m * a_stride);
                            y[m * ldy + col0 + n] = dot_row_scalar(qtype, wseg + n * w_stride, nb, arow);
                        }
                    continue;
                }
#if GGUF_SIMD
                const int nr = M == 1 ? 4 : 2;
                for (int64_t n = n0; n < n1;) {
                    const int tile_rows = n + nr <= n1 ? nr : 1;
                    for (int64_t m = m0; m < m1;) {
                        const int tile_cols = M > 1 && m + 4 <= m1 ? 4 : 1;
                        const void *arow = wide ? (const void *)(a256 + m * a_stride) : (const void *)(a32 + m * a_stride);
                        run_tile(qtype, tile_rows, tile_cols, wseg + n * w_stride, w_stride, nb, arow, a_stride,
                                 y + m * ldy + col0 + n, ldy);
                        m += tile_cols;
                    }
                    n += tile_rows;
                }
#endif
            }
        }
    }
}

/* out[i, :] = dequantized row ids[i] of a packed [*, K] matrix (embedding lookups, tests).
 * The arithmetic is the `gguf` package's (d * q + m in that order), so rows equal its output. */
void gguf_dequantize_rows(int qtype, const void *weights, int64_t K, const int64_t *ids, int64_t n, float *out) {
    const int64_t nb = K / block_elems(qtype), w_stride = nb * block_bytes(qtype);
#pragma omp parallel for schedule(static) if (n > 16)
    for (int64_t i = 0; i < n; ++i) {
        const uint8_t *row = (const uint8_t *)weights + ids[i] * w_stride;
        float *o = out + i * K;
        for (int64_t b = 0; b < nb; ++b) {
            if (qtype == Q4_0 || qtype == Q4_1) {
                const uint8_t *qs = qtype == Q4_0 ? ((const block_q4_0 *)row)[b].qs : ((const block_q4_1 *)row)[b].qs;
                const float d = half_to_float(qtype == Q4_0 ? ((const block_q4_0 *)row)[b].d : ((const block_q4_1 *)row)[b].d);
                for (int j = 0; j < 16; ++j) {
                    if (qtype == Q4_0) {
                        o[32 * b + j] = d * (float)((qs[j] & 0x0F) - 8);
                        o[32 * b + j + 16] = d * (float)((qs[j] >> 4) - 8);
                    } else {
                        const float m = half_to_float(((const block_q4_1 *)row)[b].m);
                        o[32 * b + j] = d * (float)(qs[j] & 0x0F) + m;
                        o[32 * b + j + 16] = d * (float)(qs[j] >> 4) + m;
                    }
                }
            } else if (qtype == Q8_0) {
                const block_q8_0 *blk = (const block_q8_0 *)row + b;
                const float d = half_to_float(blk->d);
                for (int j = 0; j < 32; ++j) o[32 * b + j] = (float)blk->qs[j] * d;
            } else if (qtype == Q4_K) {
                const block_q4_k *blk = (const block_q4_k *)row + b;
                uint8_t sc[8], mn[8];
                q4k_scales(blk->scales, sc, mn);
                const float d = half_to_float(blk->d), dmin = half_to_float(blk->dmin);
                for (int c = 0; c < 4; ++c) {
                    const float d_lo = d * (float)sc[2 * c], m_lo = dmin * (float)mn[2 * c];
                    const float d_hi = d * (float)sc[2 * c + 1], m_hi = dmin * (float)mn[2 * c + 1];
                    for (int j = 0; j < 32; ++j) {
                        o[256 * b + 64 * c + j] = d_lo * (float)(blk->qs[32 * c + j] & 0x0F) - m_lo;
                        o[256 * b + 64 * c + 32 + j] = d_hi * (float)(blk->qs[32 * c + j] >> 4) - m_hi;
                    }
                }
            } else if (qtype == Q6_K) {
                const block_q6_k *blk = (const block_q6_k *)row + b;
                const float d = half_to_float(blk->d);
                for (int h = 0; h < 2; ++h) {
                    const uint8_t *ql = blk->ql + 64 * h, *qh = blk->qh + 32 * h;
                    float *oh = o + 256 * b + 128 * h;
                    for (int l = 0; l < 32; ++l) {
                        const int q[4] = {(ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                                          (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                                          (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                                          (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)};
                        for (int g = 0; g < 4; ++g)
                            oh[32 * g + l] = (d * (float)blk->scales[8 * h + 2 * g + l / 16]) * (float)(q[g] - 32);
                    }
                }
            }
        }
    }
}
