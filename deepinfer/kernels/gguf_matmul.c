/* Matrix products with GGUF block-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K,
 * Q6_K), for CPUs.
 *
 * y[m, n] = sum_k x[m, k] * W[n, k], W kept in the file's packed blocks (row n = K/block blocks).
 * As llama.cpp does, each activation row is first quantized to int8 per block (32 values for the
 * 32-wide formats, 256 for the k-quants), so every block's dot product is an exact integer sum of
 * int8 products; floats only scale and add those sums.
 *
 * Numerics (the same on every code path and for every batch composition):
 *  - activations: 32-wide blocks are GGUF's Q8_0 / Q8_1, rounded as llama.cpp makes them:
 *    q = round-half-even(x * (127 / amax)), d = fp16(amax / 127), s = fp16(amax / 127 * sum(q));
 *    256-wide blocks: d = amax / 127 in float, q = round-half-even(x * (1 / d));
 *  - per (row m, output n), for each weight block b in order:
 *      acc = fma((float)isum(b), d_w(b) * d_a(b), acc)
 *    with isum(b) the block's exact integer dot product (k-quants: sub-block scales multiplied in,
 *    Q3_K's offset of 4 and Q6_K's of 32 taken out, all as integers), and the offset terms in a
 *    second sum:
 *      off = fma(m_w(b), s_a(b), off)                              (Q4_1's and Q5_1's min)
 *      off = fma(-(dmin(b) * d_a(b)), (float)sum_j m_j bsum_j, off)  (Q4_K's and Q5_K's mins)
 *  - y = acc + off.
 * A prologue may transform each activation row before it is quantized (fusing what would be
 * separate calls of a decoder layer): RMSNorm of x + residual (the sum also written out: the new
 * residual stream), or SwiGLU of a [gate | up] row.
 * A row's result depends only on its own activations: batching, threads and tiling never change
 * a bit, nor does the layout: every format may be interleaved eight rows at a time
 * (gguf_interleave, below), which changes where the bytes lie, not the arithmetic. The AVX2,
 * AVX-512 VNNI (on 256-bit registers) and portable C paths give identical bits: the integer sums
 * are exact whatever their order, the float operations are the ones above, and the file is
 * compiled with -ffp-contract=off so the compiler fuses nothing behind our back.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rowops.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GGUF_SIMD 1
#else
#define GGUF_SIMD 0
#endif
/* two 8-row groups per 512-bit tile (tile_x8_pair and its kin) */
#if GGUF_SIMD && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GGUF_X8_PAIRS 1
#else
#define GGUF_X8_PAIRS 0
#endif

#define AI static inline __attribute__((always_inline))

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 }; /* ggml ids */
enum { X8 = 100, Q4_0_X8 = X8 + Q4_0, Q4_1_X8 = X8 + Q4_1, Q5_0_X8 = X8 + Q5_0, Q5_1_X8 = X8 + Q5_1,
       Q8_0_X8 = X8 + Q8_0, Q3_K_X8 = X8 + Q3_K, Q4_K_X8 = X8 + Q4_K, Q5_K_X8 = X8 + Q5_K,
       Q6_K_X8 = X8 + Q6_K }; /* ours: below */

/* Packed weight blocks, byte for byte as in a GGUF file. */
typedef struct { uint16_t d; uint8_t qs[16]; } block_q4_0;                 /* (q - 8) * d */
typedef struct { uint16_t d, m; uint8_t qs[16]; } block_q4_1;              /* q * d + m */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } block_q5_0;  /* (q - 16) * d, bit 4 in qh */
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } block_q5_1; /* q * d + m */
typedef struct { uint16_t d; int8_t qs[32]; } block_q8_0;                  /* q * d */
/* 16 sub-blocks of 16: 2 low bits in qs, the third in hmask (clear: minus 4), 6-bit scales - 32 */
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; } block_q3_k;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } block_q4_k;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } block_q5_k; /* Q4_K + bit 4 */
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } block_q6_k;

/* The same blocks of eight consecutive rows interleaved (gguf_interleave), one struct per block
 * position: the rows' scales side by side, then their quants in groups of four positions, so that
 * one 32-byte vector holds positions 4k .. 4k+3 of all eight rows (lane j: row j). A dot product
 * with an activation row's four bytes broadcast leaves each row's block sum in its own lane: no
 * horizontal sums, one load for eight scales. Nibble formats pack positions 8p .. 8p+3 of row j
 * in the low nibbles of qs[32p + 4j ..] and 8p+4 .. 8p+7 in the high ones. */
typedef struct { uint16_t d[8]; uint8_t qs[128]; } block_q4_0x8;
typedef struct { uint16_t d[8], m[8]; uint8_t qs[128]; } block_q4_1x8;
typedef struct { uint16_t d[8]; int8_t qs[256]; } block_q8_0x8;
/* Q5_0 and Q5_1 (the fallback of Q4_K_M and Q5_K_M files for rows not a multiple of 256 long): Q4_0's
 * and Q4_1's nibbles after the fifth bits, that of position 4k + i of row j at bit k of qh[4j + i]. */
typedef struct { uint16_t d[8]; uint8_t qh[32]; uint8_t qs[128]; } block_q5_0x8;
typedef struct { uint16_t d[8], m[8]; uint8_t qh[32]; uint8_t qs[128]; } block_q5_1x8;
/* Q4_K the same way (the k-quant of most downloaded files): the rows' d and dmin side by side,
 * byte k of row j's 12 packed scale bytes at scales[8k + j] (so one vector unpacks the 6-bit
 * scales and mins of all eight rows), the 256 positions' nibbles as the 32-wide nibble formats'
 * (positions 8p .. 8p+3 of row j low in qs[32p + 4j ..], 8p+4 .. 8p+7 high). */
typedef struct { uint16_t d[8], dmin[8]; uint8_t scales[96]; uint8_t qs[1024]; } block_q4_kx8;
/* Q5_K: Q4_K's d, dmin and scales, then per 32-position sub-block s 160 bytes, read in order: its
 * low four bits as Q4_K's nibbles (128 bytes), and the fifth bit of positions 32s + 4k + i (k < 8,
 * i < 4) of row j at bit k of byte 128 + 4j + i (as Q6_K's, see below). */
typedef struct { uint16_t d[8], dmin[8]; uint8_t scales[96]; uint8_t q[8][160]; } block_q5_kx8;
/* Q6_K: the rows' d, sub-block t's scale of row j at scales[8t + j], then per 16-position
 * sub-block t 96 bytes, read in order: the low four bits of its positions as Q4_K's nibbles (64
 * bytes), and the top two bits of positions 16t + 4k + i (k, i < 4) of row j at bits 2k of byte
 * 64 + 4j + i. (The bits of one sub-block side by side: with all low bits before all high ones,
 * the two streams through each block kept the hardware prefetcher from reading ahead, and a
 * product from memory took twice the file layout's time.) */
typedef struct { uint16_t d[8]; int8_t scales[128]; uint8_t q[16][96]; } block_q6_kx8;
/* Q3_K: the rows' d, byte k of row j's 12 packed scale bytes at scales[8k + j] (as Q4_K's), then
 * per 32-position half s of a pair of sub-blocks 96 bytes, read in order: the low two bits of
 * positions 32s + 4k + i (k, i < 4) of row j at bits 2k of byte 4j + i, those of 32s + 16 + 4k + i
 * the same in bytes 32 .., and the third bit of position 32s + 4k + i (k < 8) at bit k of byte
 * 64 + 4j + i. */
typedef struct { uint16_t d[8]; uint8_t scales[96]; uint8_t q[8][96]; } block_q3_kx8;

/* The most activation rows a pair tile takes at once: 8 where one unpacking of the weights and
 * their scales then serves twice the rows (Zen 4: Q6_K 1.03-1.11x, Q3_K 1.10-1.15x, Q4_K
 * 1.00-1.09x once its mins took a product per two sub-blocks); 4 for the rest (Q8_0 and Q4_K
 * before that: 0.91-0.97x, registers spilled). */
static inline int pair_rows(int base) { return base == Q6_K || base == Q3_K || base == Q4_K ? 8 : 4; }

/* Quantized activations of M rows, in scratch: q [M][K] int8; d, s [nb][M] float (block-major,
 * so the scales of neighbouring rows load together); for 32-wide blocks qsum [nb][M], each block's
 * integer sum (the vector paths' offsets: a signed quant w times q is (w + c) q less c q); for
 * 256-wide blocks bsum [M][nb][16], the sums of each 16 values, and bsum32 [M][nb][8], of each 32
 * (Q4_K's and Q5_K's sub-blocks: their mins take two sub-blocks per 16-bit product). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *qsum;
    int16_t *bsum, *bsum32;
    int64_t M, K, nb;
} acts;

static inline float half_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
}

static int block_elems(int qtype) {
    return qtype == Q3_K || qtype == Q4_K || qtype == Q5_K || qtype == Q6_K || qtype == Q3_K_X8 || qtype == Q4_K_X8 ||
                   qtype == Q5_K_X8 || qtype == Q6_K_X8
               ? 256
               : 32;
}

/* The 32-wide formats with a per-block minimum (q * d + m). */
static inline int has_min(int qtype) { return qtype == Q4_1 || qtype == Q5_1; }

/* The file format an interleaved type holds (0: not interleaved). */
static int interleaved_base(int qtype) {
    return qtype == Q4_0_X8 || qtype == Q4_1_X8 || qtype == Q5_0_X8 || qtype == Q5_1_X8 || qtype == Q8_0_X8 ||
                   qtype == Q3_K_X8 || qtype == Q4_K_X8 || qtype == Q5_K_X8 || qtype == Q6_K_X8
               ? qtype - X8
               : 0;
}

/* Bytes per block of one row (an interleaved type: an eighth of its 8-row struct, the same). */
static int64_t block_bytes(int qtype) {
    switch (interleaved_base(qtype) ? interleaved_base(qtype) : qtype) {
    case Q4_0: return sizeof(block_q4_0);
    case Q4_1: return sizeof(block_q4_1);
    case Q5_0: return sizeof(block_q5_0);
    case Q5_1: return sizeof(block_q5_1);
    case Q8_0: return sizeof(block_q8_0);
    case Q3_K: return sizeof(block_q3_k);
    case Q4_K: return sizeof(block_q4_k);
    case Q5_K: return sizeof(block_q5_k);
    case Q6_K: return sizeof(block_q6_k);
    default: return 0;
    }
}

/* Where position i (0..31; Q4_K 0..255) of row j lies in an interleaved block's quants: Q8_0's
 * byte, and the nibble formats' byte (the low nibble when i % 8 < 4, else the high one). */
static inline int64_t x8_q8_at(int j, int i) { return 32 * (i / 4) + 4 * j + i % 4; }
static inline int64_t x8_nibble_at(int j, int i) { return 32 * (i / 8) + 4 * j + i % 4; }

static inline int x8_nibble(const uint8_t *qs, int j, int i) {
    const uint8_t byte = qs[x8_nibble_at(j, i)];
    return i % 8 < 4 ? byte & 0x0F : byte >> 4;
}

/* Where position i of row j lies in an interleaved Q6_K block's q: the byte of its top two bits,
 * and their shift there (its low four: x8_nibble of sub-block i / 16's first 64 bytes). */
static inline int64_t x8_q6_high_at(int j, int i) { return 96 * (i / 16) + 64 + 4 * j + i % 4; }
static inline int x8_q6_high_shift(int i) { return 2 * (i / 4 % 4); }

/* Stores Q6_K's value v (0..63, before its offset of 32) at position i (0..255) of a file block:
 * the low four bits in ql, the top two in qh. */
static inline void q6k_store(block_q6_k *blk, int i, int v) {
    const int h = i / 128, g = i % 128 / 32, l = i % 32;
    uint8_t *lowbyte = &blk->ql[64 * h + 32 * (g & 1) + l], *high = &blk->qh[32 * h + l];
    *lowbyte = g < 2 ? (uint8_t)((*lowbyte & 0xF0) | (v & 0x0F)) : (uint8_t)((*lowbyte & 0x0F) | (v & 0x0F) << 4);
    *high = (uint8_t)((*high & ~(3 << (2 * g))) | (v >> 4) << (2 * g));
}

/* Row j of the 8-row group at `group` (nb interleaved blocks of `qtype`), as the file's blocks. */
static void x8_row(int qtype, const uint8_t *group, int j, int64_t nb, uint8_t *row) {
    const int base = interleaved_base(qtype);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = group + b * 8 * block_bytes(base);
        if (base == Q8_0) {
            const block_q8_0x8 *x = (const block_q8_0x8 *)blk;
            block_q8_0 *o = (block_q8_0 *)row + b;
            o->d = x->d[j];
            for (int i = 0; i < 32; ++i) o->qs[i] = x->qs[x8_q8_at(j, i)];
            continue;
        }
        if (base == Q6_K) {
            const block_q6_kx8 *x = (const block_q6_kx8 *)blk;
            block_q6_k *o = (block_q6_k *)row + b;
            o->d = x->d[j];
            for (int t = 0; t < 16; ++t) o->scales[t] = x->scales[8 * t + j];
            for (int i = 0; i < 256; ++i) {
                const int high = (x->q[0][x8_q6_high_at(j, i)] >> x8_q6_high_shift(i)) & 3;
                q6k_store(o, i, x8_nibble(x->q[i / 16], j, i % 16) | high << 4);
            }
            continue;
        }
        if (base == Q3_K) {
            const block_q3_kx8 *x = (const block_q3_kx8 *)blk;
            block_q3_k *o = (block_q3_k *)row + b;
            o->d = x->d[j];
            for (int k = 0; k < 12; ++k) o->scales[k] = x->scales[8 * k + j];
            memset(o->qs, 0, sizeof o->qs);
            memset(o->hmask, 0, sizeof o->hmask);
            for (int p = 0; p < 256; ++p) { /* q3k_value's position 128h + 32c + l */
                const int h = p / 128, c = p % 128 / 32, l = p % 32, at = p % 32;
                const int low = (x->q[p / 32][32 * (at / 16) + 4 * j + at % 4] >> (2 * (at % 16 / 4))) & 3;
                const int third = (x->q[p / 32][64 + 4 * j + at % 4] >> (at / 4)) & 1;
                o->qs[32 * h + l] |= (uint8_t)(low << (2 * c));
                o->hmask[l] |= (uint8_t)(third << (4 * h + c));
            }
            continue;
        }
        if (base == Q4_K) {
            const block_q4_kx8 *x = (const block_q4_kx8 *)blk;
            block_q4_k *o = (block_q4_k *)row + b;
            o->d = x->d[j];
            o->dmin = x->dmin[j];
            for (int k = 0; k < 12; ++k) o->scales[k] = x->scales[8 * k + j];
            for (int c = 0; c < 4; ++c) /* the file's byte 32c + l: position 64c + l low, 64c + 32 + l high */
                for (int l = 0; l < 32; ++l)
                    o->qs[32 * c + l] = (uint8_t)(x8_nibble(x->qs, j, 64 * c + l) | x8_nibble(x->qs, j, 64 * c + 32 + l) << 4);
            continue;
        }
        if (base == Q5_K) {
            const block_q5_kx8 *x = (const block_q5_kx8 *)blk;
            block_q5_k *o = (block_q5_k *)row + b;
            o->d = x->d[j];
            o->dmin = x->dmin[j];
            for (int k = 0; k < 12; ++k) o->scales[k] = x->scales[8 * k + j];
            memset(o->qh, 0, sizeof o->qh);
            for (int i = 0; i < 256; ++i) { /* the file's position i: nibble of qs[32c + l], bit 2c (+1) of qh[l] */
                const int c = i / 64, hi = i % 64 / 32, l = i % 32, sub = i / 32, at = i % 32;
                const int nibble = x8_nibble(x->q[sub], j, at);
                const int bit = (x->q[sub][128 + 4 * j + at % 4] >> (at / 4)) & 1;
                uint8_t *q = &o->qs[32 * c + l];
                *q = hi ? (uint8_t)((*q & 0x0F) | nibble << 4) : (uint8_t)((*q & 0xF0) | nibble);
                o->qh[l] |= (uint8_t)(bit << (2 * c + hi));
            }
            continue;
        }
        if (base == Q5_0 || base == Q5_1) {
            const uint8_t *qh = base == Q5_0 ? ((const block_q5_0x8 *)blk)->qh : ((const block_q5_1x8 *)blk)->qh;
            const uint8_t *qs = qh + 32; /* in both structs */
            uint8_t *o = row + b * block_bytes(base); /* d (and m), qh[4], qs[16] */
            memcpy(o, blk + 2 * j, 2);
            if (base == Q5_1) memcpy(o + 2, ((const block_q5_1x8 *)blk)->m + j, 2);
            uint8_t *oh = o + (base == Q5_0 ? 2 : 4), *os = oh + 4;
            memset(oh, 0, 4);
            for (int i = 0; i < 32; ++i) {
                const int v = x8_nibble(qs, j, i) | ((qh[4 * j + i % 4] >> (i / 4)) & 1) << 4;
                oh[i / 8] |= (uint8_t)((v >> 4) << (i % 8));
                os[i % 16] = i < 16 ? (uint8_t)((os[i % 16] & 0xF0) | (v & 0x0F)) : (uint8_t)((os[i % 16] & 0x0F) | (v & 0x0F) << 4);
            }
            continue;
        }
        const uint8_t *qs = base == Q4_0 ? ((const block_q4_0x8 *)blk)->qs : ((const block_q4_1x8 *)blk)->qs;
        uint8_t *out = base == Q4_0 ? ((block_q4_0 *)row)[b].qs : ((block_q4_1 *)row)[b].qs;
        for (int i = 0; i < 16; ++i) out[i] = (uint8_t)(x8_nibble(qs, j, i) | x8_nibble(qs, j, i + 16) << 4);
        if (base == Q4_0) {
            ((block_q4_0 *)row)[b].d = ((const block_q4_0x8 *)blk)->d[j];
        } else {
            ((block_q4_1 *)row)[b].d = ((const block_q4_1x8 *)blk)->d[j];
            ((block_q4_1 *)row)[b].m = ((const block_q4_1x8 *)blk)->m[j];
        }
    }
}

static int64_t acts_bytes(int64_t M, int64_t K, int wide) {
    const int64_t nb = K / (wide ? 256 : 32);
    return M * K + 2 * nb * M * (int64_t)sizeof(float) +
           (wide ? M * nb * (16 + 8) * (int64_t)sizeof(int16_t) : nb * M * (int64_t)sizeof(int32_t));
}

static acts acts_at(void *base, int64_t M, int64_t K, int wide) {
    acts a;
    a.M = M, a.K = K, a.nb = K / (wide ? 256 : 32);
    a.q = (int8_t *)base;
    a.d = (float *)((char *)base + M * K);
    a.s = a.d + a.nb * M;
    a.qsum = wide ? NULL : (int32_t *)(a.s + a.nb * M);
    a.bsum = wide ? (int16_t *)(a.s + a.nb * M) : NULL;
    a.bsum32 = wide ? a.bsum + M * a.nb * 16 : NULL;
    return a;
}

/* ---------------------------------------------------------------- activation quantization */

static inline float round_to_half(float v) { return (float)(_Float16)v; } /* nearest even */

/* bsum32 of block b of activation row m from its bsum (|sum| <= 32 * 127: exact in 16 bits). */
static inline void bsum32_block(const acts *a, int64_t m, int64_t b) {
    const int16_t *sums = a->bsum + (m * a->nb + b) * 16;
    for (int j = 0; j < 8; ++j) a->bsum32[(m * a->nb + b) * 8 + j] = (int16_t)(sums[2 * j] + sums[2 * j + 1]);
}

static void quantize_row(const float *x, const acts *a, int64_t m, int block) {
    int8_t *q = a->q + m * a->K;
    for (int64_t b = 0; b < a->nb; ++b) {
        const float *xb = x + b * block;
        float amax = 0.0f;
        for (int i = 0; i < block; ++i) amax = fmaxf(amax, fabsf(xb[i]));
        const float d = amax / 127.0f;
        const float id = block == 32 ? (amax != 0.0f ? 127.0f / amax : 0.0f) : (d != 0.0f ? 1.0f / d : 0.0f);
        int sum = 0;
        for (int j = 0; j < block / 16; ++j) {
            int part = 0;
            for (int i = 16 * j; i < 16 * j + 16; ++i) {
                const int v = (int)nearbyintf(xb[i] * id);
                q[b * block + i] = (int8_t)v;
                part += v;
            }
            if (a->bsum) a->bsum[(m * a->nb + b) * 16 + j] = (int16_t)part;
            sum += part;
        }
        /* 32-wide blocks are GGUF's Q8_0 / Q8_1: fp16 scale and sum */
        a->d[b * a->M + m] = block == 32 ? round_to_half(d) : d;
        a->s[b * a->M + m] = block == 32 ? round_to_half(d * (float)sum) : d * (float)sum;
        if (a->qsum) a->qsum[b * a->M + m] = sum;
        if (a->bsum32) bsum32_block(a, m, b);
    }
}

#if GGUF_SIMD
/* The sum of v's eight lanes (exact integers) and the largest of x's (exact: any order). */
AI int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

AI float hmax_ps(__m256 x) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

/* The same for 32-wide blocks, eight values per instruction (same bits: max, one multiply, the
 * same rounding, exact integer sums). */
static void quantize_row32_simd(const float *x, const acts *a, int64_t m) {
    int8_t *q = a->q + m * a->K;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < a->nb; ++b) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        const float amax_s = hmax_ps(amax);
        const float d = amax_s / 127.0f;
        const __m256 id = _mm256_set1_ps(amax_s != 0.0f ? 127.0f / amax_s : 0.0f);
        __m256i qi[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
            qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            sum = _mm256_add_epi32(sum, qi[i]);
        }
        /* int32 -> int8 in element order (packs interleave the 128-bit halves; undo it) */
        const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256((__m256i *)(q + 32 * b), _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const int32_t total = hsum_epi32(sum);
        a->d[b * a->M + m] = round_to_half(d);
        a->s[b * a->M + m] = round_to_half(d * (float)total);
        a->qsum[b * a->M + m] = total;
    }
}

/* The same for 256-wide blocks (the k-quants' activations): eight values per instruction, the
 * scalar path's float steps (d = amax / 127, one reciprocal, the same rounding) and exact integer
 * sums, so its bits. The scalar loop took ~1 ms of a 1B Q4_K_M model's ~17 ms decode step. */
static void quantize_row256_simd(const float *x, const acts *a, int64_t m) {
    int8_t *q = a->q + m * a->K;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < a->nb; ++b) {
        const float *xb = x + 256 * b;
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 32; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * i)));
        const float d = hmax_ps(amax) / 127.0f;
        const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        int sum = 0;
        for (int j = 0; j < 16; ++j) { /* 16 values: two vectors, their sum, then 16 bytes */
            __m256i qi[2];
            for (int h = 0; h < 2; ++h)
                qi[h] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * j + 8 * h), id),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const int part = hsum_epi32(_mm256_add_epi32(qi[0], qi[1]));
            /* int32 -> int8 in element order: the packs work per 128-bit half */
            const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xD8);
            const __m128i p8 = _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
            _mm_storeu_si128((__m128i *)(q + 256 * b + 16 * j), p8);
            a->bsum[(m * a->nb + b) * 16 + j] = (int16_t)part;
            sum += part;
        }
        a->d[b * a->M + m] = d;
        a->s[b * a->M + m] = d * (float)sum;
        bsum32_block(a, m, b);
    }
}
#endif

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

/* Q3_K's sixteen 6-bit scales, unpacked from their 12 bytes, less their offset of 32. */
static inline void q3k_scales(const uint8_t *s, int8_t sc[16]) {
    /* scale i: its low 4 bits are nibble i of bytes 0-7 (the low nibbles first), its high 2 bits
     * bits 2 (i / 4) and 2 (i / 4) + 1 of byte 8 + i % 4; four scales per 32-bit word, as
     * llama.cpp unpacks them */
    uint32_t w[4];
    memcpy(w, s, 12);
    const uint32_t high = w[2], low4 = 0x0F0F0F0F, low2 = 0x03030303;
    w[2] = ((w[0] >> 4) & low4) | ((high >> 4) & low2) << 4;
    w[3] = ((w[1] >> 4) & low4) | ((high >> 6) & low2) << 4;
    w[0] = (w[0] & low4) | (high & low2) << 4;
    w[1] = (w[1] & low4) | ((high >> 2) & low2) << 4;
    uint8_t u[16];
    memcpy(u, w, 16);
    for (int i = 0; i < 16; ++i) sc[i] = (int8_t)(u[i] - 32);
}

/* Value i (0..31) of a Q5_0 / Q5_1 block, 0..31: a nibble of qs and bit i of qh. */
static inline int q5_value(const uint8_t qh[4], const uint8_t qs[16], int i) {
    const int nibble = i < 16 ? qs[i] & 0x0F : qs[i - 16] >> 4;
    return nibble | ((qh[i / 8] >> (i % 8)) & 1) << 4;
}

/* Value l (0..31) of chunk c (0..3) of a Q4_K (qh NULL) or Q5_K block: low half (0..15, or
 * with qh's bit 2c, 0..31) at hi = 0, high half at hi = 1. */
static inline int qk_value(const uint8_t *qs, const uint8_t *qh, int c, int hi, int l) {
    const int nibble = hi ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 0x0F;
    return qh ? nibble | ((qh[l] >> (2 * c + hi)) & 1) << 4 : nibble;
}

/* Q3_K's value at position 128 h + 32 j + l, -4..3. */
static inline int q3k_value(const block_q3_k *blk, int h, int j, int l) {
    return ((blk->qs[32 * h + l] >> (2 * j)) & 3) - ((blk->hmask[l] >> (4 * h + j)) & 1 ? 0 : 4);
}

static inline int32_t q4k_min_dot(const uint8_t mn[8], const int16_t *bsum) {
    int32_t total = 0;
    for (int j = 0; j < 8; ++j) total += mn[j] * (bsum[2 * j] + bsum[2 * j + 1]);
    return total;
}

/* ---------------------------------------------------------------- portable C path
 * One (weight row, activation row) pair at a time: the path for CPUs without AVX2, and the
 * cross-check of the SIMD paths' bits. */

static float dot_row_scalar(int qtype, const uint8_t *wrow, const acts *a, int64_t m) {
    float acc = 0.0f, off = 0.0f;
    const int8_t *q = a->q + m * a->K;
    for (int64_t b = 0; b < a->nb; ++b) {
        const float da = a->d[b * a->M + m];
        int32_t isum = 0;
        if (qtype == Q4_0 || qtype == Q4_1) {
            const uint8_t *qs = qtype == Q4_0 ? ((const block_q4_0 *)wrow)[b].qs : ((const block_q4_1 *)wrow)[b].qs;
            const int bias = qtype == Q4_0 ? 8 : 0;
            for (int i = 0; i < 16; ++i)
                isum += ((qs[i] & 0x0F) - bias) * q[32 * b + i] + ((qs[i] >> 4) - bias) * q[32 * b + i + 16];
            if (qtype == Q4_0) {
                acc = fmaf((float)isum, half_to_float(((const block_q4_0 *)wrow)[b].d) * da, acc);
            } else {
                const block_q4_1 *blk = (const block_q4_1 *)wrow + b;
                acc = fmaf((float)isum, half_to_float(blk->d) * da, acc);
                off = fmaf(half_to_float(blk->m), a->s[b * a->M + m], off);
            }
        } else if (qtype == Q8_0) {
            const block_q8_0 *blk = (const block_q8_0 *)wrow + b;
            for (int i = 0; i < 32; ++i) isum += blk->qs[i] * q[32 * b + i];
            acc = fmaf((float)isum, half_to_float(blk->d) * da, acc);
        } else if (qtype == Q5_0 || qtype == Q5_1) {
            /* d, m lead both structs; qh and qs follow them */
            const uint8_t *blk = wrow + b * block_bytes(qtype), *qh = blk + (qtype == Q5_0 ? 2 : 4);
            const int bias = qtype == Q5_0 ? 16 : 0;
            for (int i = 0; i < 32; ++i) isum += (q5_value(qh, qh + 4, i) - bias) * q[32 * b + i];
            acc = fmaf((float)isum, half_to_float(((const block_q5_1 *)blk)->d) * da, acc);
            if (qtype == Q5_1) off = fmaf(half_to_float(((const block_q5_1 *)blk)->m), a->s[b * a->M + m], off);
        } else if (qtype == Q4_K || qtype == Q5_K) {
            const int8_t *qb = q + 256 * b;
            const block_q4_k *k4 = (const block_q4_k *)wrow + b;
            const block_q5_k *k5 = (const block_q5_k *)wrow + b;
            const uint8_t *scales = qtype == Q4_K ? k4->scales : k5->scales;
            const uint8_t *qs = qtype == Q4_K ? k4->qs : k5->qs, *qh = qtype == Q4_K ? NULL : k5->qh;
            uint8_t sc[8], mn[8];
            q4k_scales(scales, sc, mn);
            for (int c = 0; c < 4; ++c) {
                int32_t lo = 0, hi = 0;
                for (int i = 0; i < 32; ++i) {
                    lo += qk_value(qs, qh, c, 0, i) * qb[64 * c + i];
                    hi += qk_value(qs, qh, c, 1, i) * qb[64 * c + 32 + i];
                }
                isum += sc[2 * c] * lo + sc[2 * c + 1] * hi;
            }
            const int32_t imin = q4k_min_dot(mn, a->bsum + (m * a->nb + b) * 16);
            const uint16_t d = qtype == Q4_K ? k4->d : k5->d, dmin = qtype == Q4_K ? k4->dmin : k5->dmin;
            acc = fmaf((float)isum, half_to_float(d) * da, acc);
            off = fmaf(-(half_to_float(dmin) * da), (float)imin, off);
        } else if (qtype == Q3_K) {
            const block_q3_k *blk = (const block_q3_k *)wrow + b;
            const int8_t *qb = q + 256 * b;
            int8_t sc[16];
            q3k_scales(blk->scales, sc);
            for (int h = 0; h < 2; ++h)
                for (int j = 0; j < 4; ++j)
                    for (int l = 0; l < 32; ++l)
                        isum += sc[8 * h + 2 * j + l / 16] * q3k_value(blk, h, j, l) * qb[128 * h + 32 * j + l];
            acc = fmaf((float)isum, half_to_float(blk->d) * da, acc);
        } else { /* Q6_K */
            const block_q6_k *blk = (const block_q6_k *)wrow + b;
            const int8_t *qb = q + 256 * b;
            for (int h = 0; h < 2; ++h) {
                const uint8_t *ql = blk->ql + 64 * h, *qh = blk->qh + 32 * h;
                for (int l = 0; l < 32; ++l) {
                    const int v[4] = {(ql[l] & 0x0F) | ((qh[l] & 3) << 4), (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                                      (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4), (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)};
                    for (int g = 0; g < 4; ++g)
                        isum += blk->scales[8 * h + 2 * g + l / 16] * (v[g] - 32) * qb[128 * h + 32 * g + l];
                }
            }
            acc = fmaf((float)isum, half_to_float(blk->d) * da, acc);
        }
    }
    return acc + off;
}

#if GGUF_SIMD
/* ---------------------------------------------------------------- AVX2 / AVX-512 VNNI paths */

/* acc + eight int32 lanes, lane l = sum of bytes 4l..4l+3 of u * s (u unsigned, s signed; our
 * ranges never saturate the 16-bit step, so both forms give the same integers). */
AI __m256i dot_u8s8_acc(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

AI __m256i dot_u8s8(__m256i u, __m256i s) { return dot_u8s8_acc(_mm256_setzero_si256(), u, s); }

/* Whether dot_u8s8_acc takes unsigned bytes up to 255 (VNNI sums four products in 32 bits; the
 * AVX2 form's 16-bit step saturates past 2 * 255 * 127, so there unsigned quants stay below 64:
 * 2 * 63 * 128 fits). */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define GGUF_WIDE_UNSIGNED 1
#else
#define GGUF_WIDE_UNSIGNED 0
#endif

/* The same with each 16-bit pair sum multiplied by scale16 (the k-quants' sub-block scales). */
AI __m256i dot_u8s8_scaled(__m256i u, __m256i s, __m256i scale16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale16);
}

/* Lane p = the sum of v[p]'s eight lanes, for eight vectors at once (exact integers). */
AI __m256i hsum8_epi32(const __m256i v[8]) {
    const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

AI __m256i nibbles32(const uint8_t *qs) { /* 16 bytes -> 32 values 0..15, in element order */
    /* both halves hold the 16 bytes; the upper one shifted by 4 (bits crossing into a byte's
     * top nibble from its neighbour are masked off) */
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
}

AI __m256i bits32(const uint8_t *x) { /* 32 bits (4 bytes, little-endian) -> 32 bytes, 0xFF where set */
    uint32_t bits;
    memcpy(&bits, x, sizeof bits);
    /* byte i gets the byte holding bit i, then every bit but bit i % 8 set: all ones iff it is */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(others, _mm256_set1_epi8(-1));
}

/* fp16 scale and min of block b of a 32-wide row, as raw halves (d leads every 32-wide struct,
 * the min follows it in Q4_1 and Q5_1) */
AI uint16_t block_d(const int qtype, const uint8_t *row, int64_t b) {
    uint16_t d;
    memcpy(&d, row + b * block_bytes(qtype), sizeof d);
    return d;
}

AI uint16_t block_m(const int qtype, const uint8_t *row, int64_t b) {
    uint16_t m;
    memcpy(&m, row + b * block_bytes(qtype) + 2, sizeof m);
    return m;
}

/* Output rows [n, n + NR) x activation rows [m, m + MR) of a 32-wide format, NR * MR <= 8:
 * the pairs' block dots are reduced to one integer each, then scaled eight at a time. */
AI void tile32(const int qtype, const int NR, const int MR, const uint8_t *w, int64_t w_stride, const acts *a,
               int64_t m, float *y, int64_t ldy) {
    __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
    const int64_t M = a->M;
    /* A decode tile reads NR short rows (a few hundred bytes each): too short for the hardware
     * prefetcher to lock on, so the bytes of the tile after next are requested while this one computes. */
    const char *next = (const char *)w + 2 * NR * w_stride;
    const int64_t next_lines = NR == 8 ? (NR * w_stride + 63) / 64 : 0;
    for (int64_t b = 0; b < a->nb; ++b) {
        for (int64_t l = b * next_lines / a->nb; l < (b + 1) * next_lines / a->nb; ++l)
            _mm_prefetch(next + 64 * l, _MM_HINT_T0);
        __m256i isum[8];
        for (int p = NR * MR; p < 8; ++p) isum[p] = _mm256_setzero_si256();
        __m256i aq[4];
        for (int r = 0; r < MR; ++r) aq[r] = _mm256_loadu_si256((const __m256i *)(a->q + (m + r) * a->K + 32 * b));
        for (int i = 0; i < NR; ++i) {
            const uint8_t *row = w + i * w_stride;
            __m256i u, sgn;
            if (qtype == Q4_1) {
                u = nibbles32(((const block_q4_1 *)row)[b].qs);
                sgn = u;
            } else if (qtype == Q5_0 || qtype == Q5_1) {
                const uint8_t *qh = row + b * block_bytes(qtype) + (qtype == Q5_0 ? 2 : 4); /* qs follows */
                const __m256i v = _mm256_or_si256(nibbles32(qh + 4), _mm256_and_si256(bits32(qh), _mm256_set1_epi8(0x10)));
                sgn = qtype == Q5_1 ? v : _mm256_sub_epi8(v, _mm256_set1_epi8(16));
                u = qtype == Q5_1 ? v : _mm256_sign_epi8(sgn, sgn);
            } else if (qtype == Q4_0) {
                sgn = _mm256_sub_epi8(nibbles32(((const block_q4_0 *)row)[b].qs), _mm256_set1_epi8(8));
                u = _mm256_sign_epi8(sgn, sgn);
            } else {
                sgn = _mm256_loadu_si256((const __m256i *)((const block_q8_0 *)row)[b].qs);
                u = _mm256_sign_epi8(sgn, sgn);
            }
            for (int r = 0; r < MR; ++r)
                isum[i * MR + r] = dot_u8s8(u, has_min(qtype) ? aq[r] : _mm256_sign_epi8(aq[r], sgn));
        }
        /* lane p = i * MR + r: the weight scale of row i times the activation scale of row r */
        __m256 dw, da, mw = _mm256_setzero_ps(), sa = _mm256_setzero_ps();
        if (NR == 8 && MR == 1) {
            __m128i h = _mm_cvtsi32_si128(block_d(qtype, w, b));
            for (int i = 1; i < 8; ++i) h = _mm_insert_epi16(h, block_d(qtype, w + i * w_stride, b), i);
            dw = _mm256_cvtph_ps(h);
            da = _mm256_set1_ps(a->d[b * M + m]);
            if (has_min(qtype)) {
                __m128i hm = _mm_cvtsi32_si128(block_m(qtype, w, b));
                for (int i = 1; i < 8; ++i) hm = _mm_insert_epi16(hm, block_m(qtype, w + i * w_stride, b), i);
                mw = _mm256_cvtph_ps(hm);
                sa = _mm256_set1_ps(a->s[b * M + m]);
            }
        } else if (NR == 2 && MR == 4) {
            dw = _mm256_set_m128(_mm_set1_ps(_cvtsh_ss(block_d(qtype, w + w_stride, b))), _mm_set1_ps(_cvtsh_ss(block_d(qtype, w, b))));
            da = _mm256_broadcast_ps((const __m128 *)(a->d + b * M + m));
            if (has_min(qtype)) {
                mw = _mm256_set_m128(_mm_set1_ps(_cvtsh_ss(block_m(qtype, w + w_stride, b))),
                                     _mm_set1_ps(_cvtsh_ss(block_m(qtype, w, b))));
                sa = _mm256_broadcast_ps((const __m128 *)(a->s + b * M + m));
            }
        } else { /* remainder tiles: lanes built one by one */
            float dwv[8] = {0}, dav[8] = {0}, mwv[8] = {0}, sav[8] = {0};
            for (int i = 0; i < NR; ++i)
                for (int r = 0; r < MR; ++r) {
                    dwv[i * MR + r] = _cvtsh_ss(block_d(qtype, w + i * w_stride, b));
                    dav[i * MR + r] = a->d[b * M + m + r];
                    if (has_min(qtype)) {
                        mwv[i * MR + r] = _cvtsh_ss(block_m(qtype, w + i * w_stride, b));
                        sav[i * MR + r] = a->s[b * M + m + r];
                    }
                }
            dw = _mm256_loadu_ps(dwv), da = _mm256_loadu_ps(dav), mw = _mm256_loadu_ps(mwv), sa = _mm256_loadu_ps(sav);
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8_epi32(isum)), _mm256_mul_ps(dw, da), acc);
        if (has_min(qtype)) off = _mm256_fmadd_ps(mw, sa, off);
    }
    float out[8];
    _mm256_storeu_ps(out, _mm256_add_ps(acc, off));
    for (int i = 0; i < NR; ++i)
        for (int r = 0; r < MR; ++r) y[r * ldy + i] = out[i * MR + r];
}

AI __m256i scale_pair16(int lo, int hi) { /* int16 lanes 0-7 = lo, 8-15 = hi */
    return _mm256_set_m128i(_mm_set1_epi16((int16_t)hi), _mm_set1_epi16((int16_t)lo));
}

/* Output row n x activation rows [m, m + MR) of Q4_K or Q5_K (the same block with a fifth bit). */
AI void tile_qk(const int qtype, const int MR, const uint8_t *w, const acts *a, int64_t m, float *y, int64_t ldy) {
    float acc[4] = {0}, off[4] = {0};
    const __m256i mask = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < a->nb; ++b) {
        const block_q4_k *k4 = (const block_q4_k *)w + b;
        const block_q5_k *k5 = (const block_q5_k *)w + b;
        const uint8_t *qs = qtype == Q4_K ? k4->qs : k5->qs;
        uint8_t sc[8], mn[8];
        q4k_scales(qtype == Q4_K ? k4->scales : k5->scales, sc, mn);
        __m256i isum[4];
        for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
        const __m256i qh = qtype == Q5_K ? _mm256_loadu_si256((const __m256i *)k5->qh) : _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i lo = _mm256_and_si256(bytes, mask), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
            if (qtype == Q5_K) { /* bits 2c and 2c + 1 of qh: bit 4 of the low and high halves */
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
            }
            const __m256i sc_lo = _mm256_set1_epi16(sc[2 * c]), sc_hi = _mm256_set1_epi16(sc[2 * c + 1]);
            for (int r = 0; r < MR; ++r) {
                const int8_t *q = a->q + (m + r) * a->K + 256 * b + 64 * c;
                const __m256i p_lo = dot_u8s8_scaled(lo, _mm256_loadu_si256((const __m256i *)q), sc_lo);
                const __m256i p_hi = dot_u8s8_scaled(hi, _mm256_loadu_si256((const __m256i *)(q + 32)), sc_hi);
                isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(p_lo, p_hi));
            }
        }
        const float d = _cvtsh_ss(qtype == Q4_K ? k4->d : k5->d), dmin = _cvtsh_ss(qtype == Q4_K ? k4->dmin : k5->dmin);
        for (int r = 0; r < MR; ++r) {
            const float da = a->d[b * a->M + m + r];
            const int32_t imin = q4k_min_dot(mn, a->bsum + ((m + r) * a->nb + b) * 16);
            acc[r] = fmaf((float)hsum_epi32(isum[r]), d * da, acc[r]);
            off[r] = fmaf(-(dmin * da), (float)imin, off[r]);
        }
    }
    for (int r = 0; r < MR; ++r) y[r * ldy] = acc[r] + off[r];
}

/* Output row n x activation rows [m, m + MR) of Q3_K: the values plus 4 (0..7, unsigned) times
 * the activations, less 4 times the scales times the 16-value sums, as Q6_K takes out its 32. */
AI void tile_q3k(const int MR, const uint8_t *w, const acts *a, int64_t m, float *y, int64_t ldy) {
    float acc[4] = {0};
    const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < a->nb; ++b) {
        const block_q3_k *blk = (const block_q3_k *)w + b;
        int8_t sc[16];
        q3k_scales(blk->scales, sc);
        __m256i isum[4];
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        for (int r = 0; r < MR; ++r) {
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(a->bsum + ((m + r) * a->nb + b) * 16));
            isum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 2));
        }
        const __m256i hm = _mm256_loadu_si256((const __m256i *)blk->hmask);
        for (int h = 0; h < 2; ++h) {
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk->qs + 32 * h));
            for (int j = 0; j < 4; ++j) {
                const __m256i low = _mm256_and_si256(_mm256_srli_epi16(ql, 2 * j), m2);
                const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + j), one);
                const __m256i u = _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
                const int sub = 8 * h + 2 * j;
                const __m256i scale = scale_pair16(sc[sub], sc[sub + 1]);
                for (int r = 0; r < MR; ++r) {
                    const int8_t *q = a->q + (m + r) * a->K + 256 * b + 128 * h + 32 * j;
                    isum[r] = _mm256_add_epi32(isum[r], dot_u8s8_scaled(u, _mm256_loadu_si256((const __m256i *)q), scale));
                }
            }
        }
        const float d = _cvtsh_ss(blk->d);
        for (int r = 0; r < MR; ++r) acc[r] = fmaf((float)hsum_epi32(isum[r]), d * a->d[b * a->M + m + r], acc[r]);
    }
    for (int r = 0; r < MR; ++r) y[r * ldy] = acc[r];
}

/* Output row n x activation rows [m, m + MR) of Q6_K. */
AI void tile_q6k(const int MR, const uint8_t *w, const acts *a, int64_t m, float *y, int64_t ldy) {
    float acc[4] = {0};
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < a->nb; ++b) {
        const block_q6_k *blk = (const block_q6_k *)w + b;
        __m256i isum[4];
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)blk->scales));
        for (int r = 0; r < MR; ++r) { /* the offset of 32 first: scales times the 16-value sums */
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(a->bsum + ((m + r) * a->nb + b) * 16));
            isum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
        }
        for (int h = 0; h < 2; ++h) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk->qh + 32 * h));
            __m256i g[4];
            g[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
            g[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
            g[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
            g[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
            for (int k = 0; k < 4; ++k) {
                const int sub = 8 * h + 2 * k; /* the group's two 16-value sub-blocks */
                const __m256i scale = scale_pair16(blk->scales[sub], blk->scales[sub + 1]);
                for (int r = 0; r < MR; ++r) {
                    const int8_t *q = a->q + (m + r) * a->K + 256 * b + 128 * h + 32 * k;
                    isum[r] = _mm256_add_epi32(isum[r], dot_u8s8_scaled(g[k], _mm256_loadu_si256((const __m256i *)q), scale));
                }
            }
        }
        const float d = _cvtsh_ss(blk->d);
        for (int r = 0; r < MR; ++r) acc[r] = fmaf((float)hsum_epi32(isum[r]), d * a->d[b * a->M + m + r], acc[r]);
    }
    for (int r = 0; r < MR; ++r) y[r * ldy] = acc[r];
}

#define TILE32_CASE(QT)                                                                                       \
    case QT:                                                                                                  \
        if (nr == 8 && mr == 1) tile32(QT, 8, 1, w, w_stride, a, m, y, ldy);                                  \
        else if (nr == 2 && mr == 4) tile32(QT, 2, 4, w, w_stride, a, m, y, ldy);                             \
        else if (nr == 1 && mr == 4) tile32(QT, 1, 4, w, w_stride, a, m, y, ldy);                             \
        else if (nr == 2 && mr == 1) tile32(QT, 2, 1, w, w_stride, a, m, y, ldy);                             \
        else tile32(QT, 1, 1, w, w_stride, a, m, y, ldy);                                                     \
        break;

/* The quants of an interleaved 32-wide block less their offset: 8 (Q4_0), 16 (Q5_0), 128 (Q8_0 as
 * unsigned bytes) or none (the formats with a min). */
static inline int x8_offset(int base) { return base == Q4_0 ? 8 : base == Q5_0 ? 16 : base == Q8_0 ? 128 : 0; }

/* Where an interleaved 32-wide block's nibbles lie (after the fifth bits of Q5_0's and Q5_1's). */
AI const uint8_t *x8_nibbles(const int base, const uint8_t *blk) {
    return base == Q4_0   ? ((const block_q4_0x8 *)blk)->qs
           : base == Q4_1 ? ((const block_q4_1x8 *)blk)->qs
           : base == Q5_0 ? ((const block_q5_0x8 *)blk)->qs
                          : ((const block_q5_1x8 *)blk)->qs;
}

/* u[k] |= the fifth bits of positions 4k .. 4k+3 (bit k of each byte of qh), as 16: Q5_0's, Q5_1's
 * and Q5_K's interleaved bits. */
AI void x8_fifth_bits(const uint8_t *qh, __m256i u[8]) {
    const __m256i bits = _mm256_loadu_si256((const __m256i *)qh), sixteen = _mm256_set1_epi8(16);
    for (int k = 0; k < 8; ++k) { /* a 16-bit shift moves bit k of each byte to its bit 4; the mask keeps bytes apart */
        const __m256i moved = k <= 4 ? _mm256_slli_epi16(bits, 4 - k) : _mm256_srli_epi16(bits, k - 4);
        u[k] = _mm256_or_si256(u[k], _mm256_and_si256(moved, sixteen));
    }
}

/* An interleaved block's quants as unsigned bytes, u[k] holding positions 4k .. 4k+3 of its eight
 * rows (lane 4j + i: row j, position 4k + i): the nibble formats' values (0 .. 15, Q5_0's and Q5_1's
 * 0 .. 31), Q8_0's plus 128 (for GGUF_WIDE_UNSIGNED builds only). */
AI void x8_unsigned_quants(const int base, const uint8_t *blk, __m256i u[8]) {
    if (base == Q8_0) {
        for (int k = 0; k < 8; ++k)
            u[k] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(((const block_q8_0x8 *)blk)->qs + 32 * k)),
                                    _mm256_set1_epi8((char)0x80));
        return;
    }
    const __m256i low = _mm256_set1_epi8(0x0F);
    const uint8_t *qs = x8_nibbles(base, blk);
    for (int p = 0; p < 4; ++p) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
        u[2 * p] = _mm256_and_si256(x, low);
        u[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
    }
    if (base == Q5_0 || base == Q5_1) x8_fifth_bits(qs - 32, u); /* qh precedes qs in both */
}

/* The same quants as the values they stand for: Q8_0's as stored, Q4_0's less its 8 and Q5_0's less
 * its 16 (signed), Q4_1's and Q5_1's as they are. */
AI void x8_quants(const int base, const uint8_t *blk, __m256i w[8]) {
    if (base == Q8_0) {
        for (int k = 0; k < 8; ++k) w[k] = _mm256_loadu_si256((const __m256i *)(((const block_q8_0x8 *)blk)->qs + 32 * k));
        return;
    }
    x8_unsigned_quants(base, blk, w);
    if (x8_offset(base))
        for (int k = 0; k < 8; ++k) w[k] = _mm256_sub_epi8(w[k], _mm256_set1_epi8((char)x8_offset(base)));
}

/* Four activation bytes read as one int32 (any alignment, any declared type). */
typedef int32_t int32_unaligned __attribute__((may_alias, aligned(1)));

/* The sums of n interleaved quant vectors w[k] (lane 4j + i: row j, position 4k + i, unsigned)
 * times an activation row's bytes aq[4k .. 4k+3]: lane j's sum is row j's exact dot product. */
AI __m256i x8_dot(const __m256i *w, const int n, const int8_t *aq) {
    __m256i sum = _mm256_setzero_si256();
    for (int k = 0; k < n; ++k) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) /* x8_dot_rows's broadcast operand */
        __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(sum) : "v"(w[k]), "m"(((const int32_unaligned *)aq)[k]));
#else
        int32_t four;
        memcpy(&four, aq + 4 * k, sizeof four);
        sum = dot_u8s8_acc(sum, w[k], _mm256_set1_epi32(four));
#endif
    }
    return sum;
}

/* The eight rows of an interleaved group x activation rows [m, m + MR): y[r * ldy + j] for row j.
 * Per block, lane j of the integer sums is row j's exact block dot product, then the same float
 * steps as tile32 (so the same bits). The quants multiply the activations as unsigned bytes:
 * Q4_1's and Q5_1's as they are, Q4_0's and Q5_0's before taking out their 8 or 16 and Q8_0's plus
 * 128 (its sign bit flipped), then that offset times the block's activation sum is taken out: the
 * same integers as |w| times the activations carrying w's sign, in two fewer instructions per 32
 * bytes (a 1.3x faster product at one row). */
AI void tile_x8(const int base, const int MR, const uint8_t *group, const acts *a, int64_t m, float *y,
                int64_t ldy) {
    const int64_t gbytes = 8 * block_bytes(base);
    const int unsigned_quants = base != Q8_0 || GGUF_WIDE_UNSIGNED; /* else |w| times a carrying w's sign */
    __m256 acc[4], off[4];
    for (int r = 0; r < MR; ++r) acc[r] = off[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; ++b) {
        const uint8_t *blk = group + b * gbytes;
        __m256i u[8], w[8]; /* w: Q8_0's signed quants where bytes past 15 cannot be unsigned */
        if (unsigned_quants) x8_unsigned_quants(base, blk, u);
        else {
            x8_quants(base, blk, w);
            for (int k = 0; k < 8; ++k) u[k] = _mm256_sign_epi8(w[k], w[k]);
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)); /* d[8] leads each struct */
        /* the mins follow the scales in Q4_1's and Q5_1's structs */
        const __m256 mw = has_min(base) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : _mm256_setzero_ps();
        for (int r = 0; r < MR; ++r) {
            const int8_t *aq = a->q + (m + r) * a->K + 32 * b;
            __m256i isum;
            if (unsigned_quants) /* the offset first: x8_offset times the activations' sum, negated */
                isum = _mm256_add_epi32(_mm256_set1_epi32(-x8_offset(base) * a->qsum[b * a->M + m + r]), x8_dot(u, 8, aq));
            else {
                isum = _mm256_setzero_si256();
                for (int k = 0; k < 8; ++k) {
                    int32_t four;
                    memcpy(&four, aq + 4 * k, sizeof four);
                    isum = dot_u8s8_acc(isum, u[k], _mm256_sign_epi8(_mm256_set1_epi32(four), w[k]));
                }
            }
            const __m256 da = _mm256_set1_ps(a->d[b * a->M + m + r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, da), acc[r]);
            if (has_min(base)) off[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->s[b * a->M + m + r]), off[r]);
        }
    }
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + r * ldy, _mm256_add_ps(acc[r], off[r]));
}

/* Two sub-blocks' eight 8-bit factors of an interleaved group (f[j], f[8 + j] for row j) as byte
 * pairs, bytes 2j and 2j + 1: widened to 16 bits, the operand of one multiply-add per two
 * sub-blocks (the k-quants' mins and offset terms). */
AI __m128i byte_pairs(const void *f) {
    const uint8_t *bytes = (const uint8_t *)f;
    return _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)bytes), _mm_loadl_epi64((const __m128i *)(bytes + 8)));
}

/* The 6-bit scales and mins of an interleaved Q4_K block's eight rows (q4k_scales on all of them
 * at once): sc[8 s + j] and mn[8 s + j] for sub-block s of row j. */
AI void x8_q4k_scales(const uint8_t *scales, uint8_t sc[64], uint8_t mn[64]) {
    /* bytes 8k + j of the three vectors: byte k, k + 4 and k + 8 of row j's packed twelve */
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)scales);
    const __m256i v1 = _mm256_loadu_si256((const __m256i *)(scales + 32));
    const __m256i v2 = _mm256_loadu_si256((const __m256i *)(scales + 64));
    const __m256i six = _mm256_set1_epi8(63), low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8((char)0xC0);
    _mm256_storeu_si256((__m256i *)sc, _mm256_and_si256(v0, six));
    _mm256_storeu_si256((__m256i *)mn, _mm256_and_si256(v1, six));
    /* sub-blocks 4..7: the low (scale) or high (min) nibble of bytes 8..11 under bits 6-7 of bytes 0..3
     * or 4..7 moved to bits 4-5 (a 16-bit shift: the masks keep bits from crossing bytes) */
    _mm256_storeu_si256((__m256i *)(sc + 32),
                        _mm256_or_si256(_mm256_and_si256(v2, low), _mm256_srli_epi16(_mm256_and_si256(v0, top), 2)));
    _mm256_storeu_si256((__m256i *)(mn + 32), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v2, 4), low),
                                                              _mm256_srli_epi16(_mm256_and_si256(v1, top), 2)));
}

/* Sub-block s of an interleaved k-quant block as its tile reads it: w[k] holds positions P s + 4k ..
 * P s + 4k + 3 of the eight rows (lane 4j + i: row j, position P s + 4k + i) as unsigned values,
 * with P = 32 for Q4_K and Q5_K (k < 8) and 16 for Q6_K (0..63) and Q3_K (0..7) (k < 4). */
AI void x8_k_sub_block(const int base, const uint8_t *blk, const int s, __m256i *w) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    if (base == Q4_K || base == Q5_K) {
        const uint8_t *nibbles = base == Q4_K ? ((const block_q4_kx8 *)blk)->qs + 128 * s : ((const block_q5_kx8 *)blk)->q[s];
        for (int p = 0; p < 4; ++p) { /* positions 32s + 8p .. 32s + 8p + 7 */
            const __m256i x = _mm256_loadu_si256((const __m256i *)(nibbles + 32 * p));
            w[2 * p] = _mm256_and_si256(x, low);
            w[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
        }
        if (base == Q5_K) x8_fifth_bits(nibbles + 128, w);
    } else if (base == Q6_K) {
        const uint8_t *q = ((const block_q6_kx8 *)blk)->q[s];
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)q), x1 = _mm256_loadu_si256((const __m256i *)(q + 32));
        const __m256i hv = _mm256_loadu_si256((const __m256i *)(q + 64)), two = _mm256_set1_epi8(0x30);
        /* positions 16s + 4k .. + 3: low nibbles, then bits 2k, 2k + 1 of hv moved to bits 4, 5 */
        w[0] = _mm256_or_si256(_mm256_and_si256(x0, low), _mm256_and_si256(_mm256_slli_epi16(hv, 4), two));
        w[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x0, 4), low), _mm256_and_si256(_mm256_slli_epi16(hv, 2), two));
        w[2] = _mm256_or_si256(_mm256_and_si256(x1, low), _mm256_and_si256(hv, two));
        w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x1, 4), low), _mm256_and_si256(_mm256_srli_epi16(hv, 2), two));
    } else { /* Q3_K */
        const uint8_t *q = ((const block_q3_kx8 *)blk)->q[s / 2];
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(q + 32 * (s % 2)));
        const __m256i hv = _mm256_loadu_si256((const __m256i *)(q + 64));
        const __m256i two = _mm256_set1_epi8(3), third = _mm256_set1_epi8(4);
        /* positions 16s + 4k .. + 3: bits 2k, 2k + 1 of lo, then bit 4 (s % 2) + k of hv moved to bit 2 */
        for (int k = 0; k < 4; ++k) {
            const int shift = 4 * (s % 2) + k - 2;
            const __m256i high = shift >= 0 ? _mm256_srli_epi16(hv, shift) : _mm256_slli_epi16(hv, -shift);
            w[k] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 2 * k), two), _mm256_and_si256(high, third));
        }
    }
}

/* The eight rows of an interleaved Q4_K or Q5_K group x activation rows [m, m + MR): y[r * ldy +
 * j] for row j. Per sub-block of 32 positions, lane j gathers row j's exact integer dot product
 * (VNNI, unsigned quants times the activations), multiplied by its 6-bit scale; the mins' term is
 * the mins times the activations' 32-value sums, two sub-blocks per 16-bit multiply-add (both
 * factors fit 16 bits). Then tile_qk's float steps lane by lane, so tile_qk's bits. */
AI void tile_qk_x8(const int qtype, const int MR, const uint8_t *group, const acts *a, int64_t m, float *y,
                   int64_t ldy) {
    __m256 acc[4], off[4];
    for (int r = 0; r < MR; ++r) acc[r] = off[r] = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < a->nb; ++b) { /* Q5_K's block begins as Q4_K's */
        const block_q4_kx8 *blk = (const block_q4_kx8 *)(group + b * 8 * block_bytes(qtype));
        uint8_t sc[64], mn[64];
        x8_q4k_scales(blk->scales, sc, mn);
        __m256i isum[4], imin[4];
        for (int r = 0; r < MR; ++r) isum[r] = imin[r] = _mm256_setzero_si256();
        for (int s = 0; s < 8; ++s) {
            __m256i w[8];
            x8_k_sub_block(qtype, (const uint8_t *)blk, s, w);
            const __m256i scale = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * s)));
            for (int r = 0; r < MR; ++r) {
                const __m256i part = x8_dot(w, 8, a->q + (m + r) * a->K + 256 * b + 32 * s);
                isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(part, scale));
            }
        }
        for (int u = 0; u < 4; ++u) { /* the mins of sub-blocks 2u and 2u + 1 times their 32-value sums */
            const __m256i mins = _mm256_cvtepu8_epi16(byte_pairs(mn + 16 * u));
            for (int r = 0; r < MR; ++r) {
                int32_t sums;
                memcpy(&sums, a->bsum32 + ((m + r) * a->nb + b) * 8 + 2 * u, sizeof sums);
                imin[r] = _mm256_add_epi32(imin[r], _mm256_madd_epi16(mins, _mm256_set1_epi32(sums)));
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->d));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->dmin));
        for (int r = 0; r < MR; ++r) {
            const __m256 da = _mm256_set1_ps(a->d[b * a->M + m + r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(dw, da), acc[r]);
            off[r] = _mm256_fmadd_ps(_mm256_xor_ps(_mm256_mul_ps(dmin, da), sign), _mm256_cvtepi32_ps(imin[r]), off[r]);
        }
    }
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + r * ldy, _mm256_add_ps(acc[r], off[r]));
}

/* The k-quants with sixteen 16-position sub-blocks (Q6_K, Q3_K), on an interleaved group: their
 * offset's term, the sub-blocks' scaled dot products and the block's float steps. */

/* -(the scales sc[8t + j] of row j times the activations' 16-value sums bsum[t]) << shift, lane j:
 * two sub-blocks per 16-bit multiply-add (both factors fit 16 bits). */
AI __m256i x8_offset_sum(const int8_t *sc, const int16_t *bsum, const int shift) {
    __m256i offset = _mm256_setzero_si256();
    for (int u = 0; u < 8; ++u) {
        int32_t sums;
        memcpy(&sums, bsum + 2 * u, sizeof sums);
        offset = _mm256_add_epi32(offset,
                                  _mm256_madd_epi16(_mm256_cvtepi8_epi16(byte_pairs(sc + 16 * u)), _mm256_set1_epi32(sums)));
    }
    return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, shift));
}

/* isum[r] += sub-block t's dot product (its quants w, unsigned) times its scales sc[8t ..], r < MR. */
AI void x8_sub_block(const int MR, const __m256i w[4], const int8_t *sc, const acts *a, int64_t m, int64_t b, int t,
                     __m256i *isum) {
    const __m256i scale = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * t)));
    for (int r = 0; r < MR; ++r) {
        const __m256i part = x8_dot(w, 4, a->q + (m + r) * a->K + 256 * b + 16 * t);
        isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(part, scale));
    }
}

/* acc[r] = fma(isum[r], d_w * d_a, acc[r]): tile_q6k's and tile_q3k's float step, lane by lane. */
AI void x8_block_steps(const int MR, const uint16_t d[8], const __m256i *isum, const acts *a, int64_t m, int64_t b,
                       __m256 *acc) {
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d));
    for (int r = 0; r < MR; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(dw, _mm256_set1_ps(a->d[b * a->M + m + r])),
                                 acc[r]);
}

/* The eight rows of an interleaved Q6_K group x activation rows [m, m + MR), as tile_qk_x8: per
 * 16-position sub-block the exact dot products of the unsigned values (0..63) in the rows' lanes,
 * times their scales; the offset of 32 as 32 times the scales times the activations' 16-value
 * sums, two sub-blocks per 16-bit multiply-add. tile_q6k's float steps, so its bits. */
AI void tile_q6k_x8(const int MR, const uint8_t *group, const acts *a, int64_t m, float *y, int64_t ldy) {
    __m256 acc[4];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; ++b) {
        const block_q6_kx8 *blk = (const block_q6_kx8 *)group + b;
        __m256i isum[4];
        for (int r = 0; r < MR; ++r) /* the offset of 32 first */
            isum[r] = x8_offset_sum(blk->scales, a->bsum + ((m + r) * a->nb + b) * 16, 5);
        for (int t = 0; t < 16; ++t) {
            __m256i w[4];
            x8_k_sub_block(Q6_K, (const uint8_t *)blk, t, w);
            x8_sub_block(MR, w, blk->scales, a, m, b, t, isum);
        }
        x8_block_steps(MR, blk->d, isum, a, m, b, acc);
    }
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

/* The sixteen 6-bit scales of an interleaved Q3_K block's eight rows, less their offset of 32
 * (q3k_scales on all of them at once): sc[8 t + j] for sub-block t of row j. */
AI void x8_q3k_scales(const uint8_t *scales, int8_t sc[128]) {
    /* bytes 8k + j of the three vectors: byte k, k + 4 and k + 8 of row j's packed twelve */
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)scales);
    const __m256i v1 = _mm256_loadu_si256((const __m256i *)(scales + 32));
    const __m256i v2 = _mm256_loadu_si256((const __m256i *)(scales + 64));
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30), offset = _mm256_set1_epi8(32);
    /* scales 4q + k: a nibble of byte k (q = 0, 2) or k + 4 (q = 1, 3), and bits 2q, 2q + 1 of
     * byte k + 8 moved to bits 4-5 (16-bit shifts: the masks keep bits from crossing bytes) */
    const __m256i parts[4] = {
        _mm256_or_si256(_mm256_and_si256(v0, low), _mm256_and_si256(_mm256_slli_epi16(v2, 4), top)),
        _mm256_or_si256(_mm256_and_si256(v1, low), _mm256_and_si256(_mm256_slli_epi16(v2, 2), top)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low), _mm256_and_si256(v2, top)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low), _mm256_and_si256(_mm256_srli_epi16(v2, 2), top)),
    };
    for (int q = 0; q < 4; ++q) _mm256_storeu_si256((__m256i *)(sc + 32 * q), _mm256_sub_epi8(parts[q], offset));
}

/* The eight rows of an interleaved Q3_K group x activation rows [m, m + MR), as tile_q6k_x8: per
 * 16-position sub-block, lane j gathers row j's exact integer dot product of its values plus 4
 * (0..7, unsigned) times its scale; 4 times the scales times the activations' 16-value sums is
 * taken out first. Then tile_q3k's float steps lane by lane, so tile_q3k's bits. */
AI void tile_q3k_x8(const int MR, const uint8_t *group, const acts *a, int64_t m, float *y, int64_t ldy) {
    __m256 acc[4];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; ++b) {
        const block_q3_kx8 *blk = (const block_q3_kx8 *)group + b;
        int8_t sc[128];
        x8_q3k_scales(blk->scales, sc);
        __m256i isum[4];
        for (int r = 0; r < MR; ++r) /* the offset of 4 first */
            isum[r] = x8_offset_sum(sc, a->bsum + ((m + r) * a->nb + b) * 16, 2);
        for (int t = 0; t < 16; ++t) {
            __m256i w[4];
            x8_k_sub_block(Q3_K, (const uint8_t *)blk, t, w);
            x8_sub_block(MR, w, sc, a, m, b, t, isum);
        }
        x8_block_steps(MR, blk->d, isum, a, m, b, acc);
    }
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

#if GGUF_X8_PAIRS
/* Two 256-bit halves as one 512-bit vector (lo in lanes 0-7). */
AI __m512i join256(const void *lo, const void *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}

/* Eight fp16 values at lo and eight at hi as sixteen floats. */
AI __m512 halves16(const void *lo, const void *hi) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)lo)),
                                                   _mm_loadu_si128((const __m128i *)hi), 1));
}

/* x8_dot on two groups' quant vectors for MR activation rows (row r's bytes at aq + r * stride):
 * sums[r] lane j gains row j's exact dot product with activation row r. The activations' four
 * bytes are the instruction's broadcast operand, one instruction where the compiler emits a
 * broadcast and a product (1.04-1.14x on a Q4_K product, Zen 4). The rows' products interleave,
 * each chain waiting on the instruction MR back: one row's whole chain after another kept every
 * product waiting on the one before it (Q4_0 1.06-1.15x this way, Q4_K 1.02-1.06x, Zen 4). */
AI void x8_dot_rows(const int MR, __m512i *sums, const __m512i *w, const int n, const int8_t *aq, int64_t stride) {
    for (int k = 0; k < n; ++k)
        for (int r = 0; r < MR; ++r)
            __asm__("vpdpbusd %2%{1to16%}, %1, %0"
                    : "+v"(sums[r])
                    : "v"(w[k]), "m"(((const int32_unaligned *)(aq + r * stride))[k]));
}

/* isum[r] += scale times the products of w with activation row r (x8_dot_rows), r < MR: one
 * k-quant sub-block's scaled sums. */
AI void x8_scaled_rows(const int MR, __m512i *isum, const __m512i *w, const int n, const int8_t *aq, int64_t stride,
                       const __m512i scale) {
    __m512i part[8];
    for (int r = 0; r < MR; ++r) part[r] = _mm512_setzero_si512();
    x8_dot_rows(MR, part, w, n, aq, stride);
    for (int r = 0; r < MR; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(part[r], scale));
}

/* sum + v's 16-bit pairs times the pair of int16 at `pair` (as one int32, every lane), each lane
 * gaining v's two products: VPDPWSSD with its broadcast operand, where a separate broadcast, a
 * 16-bit multiply-add and an add took three instructions. Exact (no saturation). */
AI __m512i dot16_pair(__m512i sum, const __m512i v, const int16_t *pair) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(v), "m"(*(const int32_unaligned *)pair));
    return sum;
}

/* tile_x8 for two consecutive 8-row groups at once (`group` and `group + group_bytes`), lanes
 * 0-7 the first group's rows and 8-15 the second's: one instruction does the work of two on
 * 256-bit registers where the machine has full 512-bit units. Every lane goes through tile_x8's
 * operations (the exact block sum, then the same float steps), so the bits are tile_x8's; the
 * quants as tile_x8's unsigned bytes (this build has VNNI). */
AI void tile_x8_pair(const int base, const int MR, const uint8_t *group, int64_t group_bytes, const acts *a,
                     int64_t m, float *y, int64_t ldy) {
    const int64_t gbytes = 8 * block_bytes(base);
    __m512 acc[4], off[4];
    for (int r = 0; r < MR; ++r) acc[r] = off[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < a->nb; ++b) {
        const uint8_t *lo = group + b * gbytes, *hi = lo + group_bytes;
        __m512i u[8];
        if (base == Q8_0) {
            const int8_t *ql = ((const block_q8_0x8 *)lo)->qs, *qh = ((const block_q8_0x8 *)hi)->qs;
            for (int k = 0; k < 8; ++k) u[k] = _mm512_xor_si512(join256(ql + 32 * k, qh + 32 * k), _mm512_set1_epi8((char)0x80));
        } else if (base == Q5_0 || base == Q5_1) { /* each half as tile_x8 takes it */
            __m256i ul[8], uh[8];
            x8_unsigned_quants(base, lo, ul);
            x8_unsigned_quants(base, hi, uh);
            for (int k = 0; k < 8; ++k) u[k] = _mm512_inserti64x4(_mm512_castsi256_si512(ul[k]), uh[k], 1);
        } else {
            const uint8_t *ql = x8_nibbles(base, lo), *qh = x8_nibbles(base, hi);
            for (int p = 0; p < 4; ++p) {
                const __m512i x = join256(ql + 32 * p, qh + 32 * p);
                u[2 * p] = _mm512_and_si512(x, low);
                u[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
            }
        }
        const __m512 dw = halves16(lo, hi); /* d[8] leads each struct */
        const __m512 mw = has_min(base) ? halves16(lo + 16, hi + 16) : _mm512_setzero_ps(); /* the mins follow d */
        __m512i isum[4];
        for (int r = 0; r < MR; ++r) isum[r] = _mm512_set1_epi32(-x8_offset(base) * a->qsum[b * a->M + m + r]);
        x8_dot_rows(MR, isum, u, 8, a->q + m * a->K + 32 * b, a->K);
        for (int r = 0; r < MR; ++r) {
            const __m512 da = _mm512_set1_ps(a->d[b * a->M + m + r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dw, da), acc[r]);
            if (has_min(base)) off[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->s[b * a->M + m + r]), off[r]);
        }
    }
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(acc[r], off[r]));
}

/* Eight 6-bit scales of one 8-row group and eight of the next, as sixteen int32 lanes. */
AI __m512i scales16(const uint8_t *lo, const uint8_t *hi, const int is_signed) {
    const __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)lo), _mm_loadl_epi64((const __m128i *)hi));
    return is_signed ? _mm512_cvtepi8_epi32(both) : _mm512_cvtepu8_epi32(both);
}

/* byte_pairs of two groups as 16-bit pairs, lanes 0-7 the group at lo, 8-15 the one at hi:
 * dot16_pair's operand. */
AI __m512i pairs16(const uint8_t *lo, const uint8_t *hi, const int is_signed) {
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(byte_pairs(lo)), byte_pairs(hi), 1);
    return is_signed ? _mm512_cvtepi8_epi16(both) : _mm512_cvtepu8_epi16(both);
}

/* tile_qk_x8 (Q4_K, Q5_K) for two consecutive 8-row groups at once, as tile_x8_pair: every lane
 * through tile_qk_x8's operations, so its bits, with half the instructions of two 256-bit tiles.
 * The Q4_K_M files users download spend most of their products here and in tile_q6k_x8_pair. */
AI void tile_qk_x8_pair(const int qtype, const int MR, const uint8_t *group, int64_t group_bytes, const acts *a,
                        int64_t m, float *y, int64_t ldy) {
    const int64_t gbytes = 8 * block_bytes(qtype);
    __m512 acc[8], off[8];
    for (int r = 0; r < MR; ++r) acc[r] = off[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t b = 0; b < a->nb; ++b) {
        const block_q4_kx8 *lo = (const block_q4_kx8 *)(group + b * gbytes);
        const block_q4_kx8 *hi = (const block_q4_kx8 *)((const uint8_t *)lo + group_bytes);
        uint8_t sc[2][64], mn[2][64];
        x8_q4k_scales(lo->scales, sc[0], mn[0]);
        x8_q4k_scales(hi->scales, sc[1], mn[1]);
        __m512i isum[8], imin[8];
        for (int r = 0; r < MR; ++r) isum[r] = imin[r] = _mm512_setzero_si512();
        for (int s = 0; s < 8; ++s) {
            __m512i w[8];
            const uint8_t *ql = qtype == Q4_K ? lo->qs + 128 * s : ((const block_q5_kx8 *)lo)->q[s];
            const uint8_t *qh = qtype == Q4_K ? hi->qs + 128 * s : ((const block_q5_kx8 *)hi)->q[s];
            for (int p = 0; p < 4; ++p) { /* positions 32s + 8p .. 32s + 8p + 7 */
                const __m512i x = join256(ql + 32 * p, qh + 32 * p);
                w[2 * p] = _mm512_and_si512(x, low);
                w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
            }
            if (qtype == Q5_K) { /* x8_fifth_bits on both groups */
                const __m512i bits = join256(ql + 128, qh + 128);
                for (int k = 0; k < 8; ++k) {
                    const __m512i moved = k <= 4 ? _mm512_slli_epi16(bits, 4 - k) : _mm512_srli_epi16(bits, k - 4);
                    w[k] = _mm512_or_si512(w[k], _mm512_and_si512(moved, sixteen));
                }
            }
            const __m512i scale = scales16(sc[0] + 8 * s, sc[1] + 8 * s, 0);
            x8_scaled_rows(MR, isum, w, 8, a->q + m * a->K + 256 * b + 32 * s, a->K, scale);
        }
        for (int u = 0; u < 4; ++u) { /* the mins of sub-blocks 2u and 2u + 1 times their 32-value sums */
            const __m512i mins = pairs16(mn[0] + 16 * u, mn[1] + 16 * u, 0);
            for (int r = 0; r < MR; ++r) imin[r] = dot16_pair(imin[r], mins, a->bsum32 + ((m + r) * a->nb + b) * 8 + 2 * u);
        }
        const __m512 dw = halves16(lo->d, hi->d), dmin = halves16(lo->dmin, hi->dmin);
        for (int r = 0; r < MR; ++r) {
            const __m512 da = _mm512_set1_ps(a->d[b * a->M + m + r]);
            const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, da)), sign));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dw, da), acc[r]);
            off[r] = _mm512_fmadd_ps(neg, _mm512_cvtepi32_ps(imin[r]), off[r]);
        }
    }
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(acc[r], off[r]));
}

/* The pair forms of x8_offset_sum, x8_sub_block and x8_block_steps (Q6_K, Q3_K): lanes 0-7 the
 * group whose scales are at sl (d at dl), 8-15 the next one's. */
/* isum[r] = x8_offset_sum's term for activation row m + r, r < MR: each pair of sub-blocks' scales
 * unpacked once for all the rows, then one VPDPWSSD per pair and row (the integer sums are exact,
 * so their order does not change them). */
AI void x8_offset_sum_pair(const int MR, const int8_t *sl, const int8_t *sh, const acts *a, int64_t m, int64_t b,
                           const int shift, __m512i *isum) {
    __m512i sum[8];
    for (int r = 0; r < MR; ++r) sum[r] = _mm512_setzero_si512();
    for (int u = 0; u < 8; ++u) { /* lanes j, 8 + j: sub-blocks 2u and 2u + 1 of either group's row j */
        const __m512i pairs = pairs16((const uint8_t *)sl + 16 * u, (const uint8_t *)sh + 16 * u, 1);
        for (int r = 0; r < MR; ++r) sum[r] = dot16_pair(sum[r], pairs, a->bsum + ((m + r) * a->nb + b) * 16 + 2 * u);
    }
    for (int r = 0; r < MR; ++r) isum[r] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum[r], shift));
}

AI void x8_sub_block_pair(const int MR, const __m512i w[4], const int8_t *sl, const int8_t *sh, const acts *a,
                          int64_t m, int64_t b, int t, __m512i *isum) {
    const __m512i scale = scales16((const uint8_t *)sl + 8 * t, (const uint8_t *)sh + 8 * t, 1);
    x8_scaled_rows(MR, isum, w, 4, a->q + m * a->K + 256 * b + 16 * t, a->K, scale);
}

AI void x8_block_steps_pair(const int MR, const uint16_t *dl, const uint16_t *dh, const __m512i *isum, const acts *a,
                            int64_t m, int64_t b, __m512 *acc) {
    const __m512 dw = halves16(dl, dh);
    for (int r = 0; r < MR; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dw, _mm512_set1_ps(a->d[b * a->M + m + r])),
                                 acc[r]);
}

/* tile_q6k_x8 for two consecutive 8-row groups at once: every lane through its operations. */
AI void tile_q6k_x8_pair(const int MR, const uint8_t *group, int64_t group_bytes, const acts *a, int64_t m, float *y,
                         int64_t ldy) {
    __m512 acc[8];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
    for (int64_t b = 0; b < a->nb; ++b) {
        const block_q6_kx8 *lo = (const block_q6_kx8 *)group + b;
        const block_q6_kx8 *hi = (const block_q6_kx8 *)(group + group_bytes) + b;
        __m512i isum[8];
        x8_offset_sum_pair(MR, lo->scales, hi->scales, a, m, b, 5, isum); /* the offset of 32 first */
        for (int t = 0; t < 16; ++t) {
            const __m512i x0 = join256(lo->q[t], hi->q[t]);
            const __m512i x1 = join256(lo->q[t] + 32, hi->q[t] + 32);
            const __m512i hv = join256(lo->q[t] + 64, hi->q[t] + 64);
            const __m512i w[4] = {
                _mm512_or_si512(_mm512_and_si512(x0, low), _mm512_and_si512(_mm512_slli_epi16(hv, 4), two)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(x0, 4), low), _mm512_and_si512(_mm512_slli_epi16(hv, 2), two)),
                _mm512_or_si512(_mm512_and_si512(x1, low), _mm512_and_si512(hv, two)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(x1, 4), low), _mm512_and_si512(_mm512_srli_epi16(hv, 2), two)),
            };
            x8_sub_block_pair(MR, w, lo->scales, hi->scales, a, m, b, t, isum);
        }
        x8_block_steps_pair(MR, lo->d, hi->d, isum, a, m, b, acc);
    }
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* tile_q3k_x8 for two consecutive 8-row groups at once: every lane through its operations. */
AI void tile_q3k_x8_pair(const int MR, const uint8_t *group, int64_t group_bytes, const acts *a, int64_t m, float *y,
                         int64_t ldy) {
    __m512 acc[8];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    const __m512i two = _mm512_set1_epi8(3), third = _mm512_set1_epi8(4);
    for (int64_t b = 0; b < a->nb; ++b) {
        const block_q3_kx8 *lo = (const block_q3_kx8 *)group + b;
        const block_q3_kx8 *hi = (const block_q3_kx8 *)(group + group_bytes) + b;
        int8_t sl[128], sh[128];
        x8_q3k_scales(lo->scales, sl);
        x8_q3k_scales(hi->scales, sh);
        __m512i isum[8];
        x8_offset_sum_pair(MR, sl, sh, a, m, b, 2, isum); /* the offset of 4 first */
        for (int t = 0; t < 16; ++t) {
            const __m512i bits = join256(lo->q[t / 2] + 32 * (t % 2), hi->q[t / 2] + 32 * (t % 2));
            const __m512i hv = join256(lo->q[t / 2] + 64, hi->q[t / 2] + 64);
            __m512i w[4];
            for (int k = 0; k < 4; ++k) {
                const int shift = 4 * (t % 2) + k - 2;
                const __m512i high = shift >= 0 ? _mm512_srli_epi16(hv, shift) : _mm512_slli_epi16(hv, -shift);
                w[k] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bits, 2 * k), two), _mm512_and_si512(high, third));
            }
            x8_sub_block_pair(MR, w, sl, sh, a, m, b, t, isum);
        }
        x8_block_steps_pair(MR, lo->d, hi->d, isum, a, m, b, acc);
    }
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* A case of run_tile_x8_pair: `call` with the format and the row count (4 or 1; 8 too for the
 * formats of pair_rows) constants, so each is compiled for its shape. */
#define PAIR_CASE(QT, call)                                                                                   \
    case QT:                                                                                                  \
        mr == 4 ? call(QT, 4) : call(QT, 1);                                                                  \
        break;
#define PAIR_CASE8(QT, call)                                                                                  \
    case QT:                                                                                                  \
        mr == 8 ? call(QT, 8) : mr == 4 ? call(QT, 4) : call(QT, 1);                                          \
        break;

static void run_tile_x8_pair(int qtype, int mr, const uint8_t *group, int64_t group_bytes, const acts *a, int64_t m,
                             float *y, int64_t ldy) {
#define QK(QT, MR) tile_qk_x8_pair(QT, MR, group, group_bytes, a, m, y, ldy)
#define Q6K(QT, MR) tile_q6k_x8_pair(MR, group, group_bytes, a, m, y, ldy)
#define Q3K(QT, MR) tile_q3k_x8_pair(MR, group, group_bytes, a, m, y, ldy)
#define X32(QT, MR) tile_x8_pair(QT, MR, group, group_bytes, a, m, y, ldy)
    switch (interleaved_base(qtype)) {
        PAIR_CASE8(Q4_K, QK)
        PAIR_CASE(Q5_K, QK)
        PAIR_CASE8(Q6_K, Q6K)
        PAIR_CASE8(Q3_K, Q3K)
        PAIR_CASE(Q4_0, X32)
        PAIR_CASE(Q4_1, X32)
        PAIR_CASE(Q5_0, X32)
        PAIR_CASE(Q5_1, X32)
    default:
        mr == 4 ? X32(Q8_0, 4) : X32(Q8_0, 1);
        break;
    }
#undef QK
#undef Q6K
#undef Q3K
#undef X32
}
#endif

static void run_tile_x8(int qtype, int mr, const uint8_t *group, const acts *a, int64_t m, float *y, int64_t ldy) {
    switch (interleaved_base(qtype)) {
    case Q4_K: mr == 4 ? tile_qk_x8(Q4_K, 4, group, a, m, y, ldy) : tile_qk_x8(Q4_K, 1, group, a, m, y, ldy); break;
    case Q5_K: mr == 4 ? tile_qk_x8(Q5_K, 4, group, a, m, y, ldy) : tile_qk_x8(Q5_K, 1, group, a, m, y, ldy); break;
    case Q6_K: mr == 4 ? tile_q6k_x8(4, group, a, m, y, ldy) : tile_q6k_x8(1, group, a, m, y, ldy); break;
    case Q3_K: mr == 4 ? tile_q3k_x8(4, group, a, m, y, ldy) : tile_q3k_x8(1, group, a, m, y, ldy); break;
    case Q4_0: mr == 4 ? tile_x8(Q4_0, 4, group, a, m, y, ldy) : tile_x8(Q4_0, 1, group, a, m, y, ldy); break;
    case Q4_1: mr == 4 ? tile_x8(Q4_1, 4, group, a, m, y, ldy) : tile_x8(Q4_1, 1, group, a, m, y, ldy); break;
    case Q5_0: mr == 4 ? tile_x8(Q5_0, 4, group, a, m, y, ldy) : tile_x8(Q5_0, 1, group, a, m, y, ldy); break;
    case Q5_1: mr == 4 ? tile_x8(Q5_1, 4, group, a, m, y, ldy) : tile_x8(Q5_1, 1, group, a, m, y, ldy); break;
    default: mr == 4 ? tile_x8(Q8_0, 4, group, a, m, y, ldy) : tile_x8(Q8_0, 1, group, a, m, y, ldy); break;
    }
}

/* ---------------------------------------------------------------- AMX int8 tiles */

/* Where the CPU has AMX (Intel Xeon from Sapphire Rapids on), one TDPBSSD multiplies a tile of 16
 * activation rows by a block of 16 output rows: 16 x 16 exact int32 block sums per instruction,
 * the work of ~128 VNNI instructions. The interleaved formats' quants are already laid out as
 * the instruction wants its second operand (four consecutive positions of each row side by
 * side), so a block's tile is two groups' quants placed side by side (nibbles unpacked, Q4_0's 8
 * taken out). The sums are the same integers as the VNNI path's and the float steps per (row,
 * output, block) are tile_x8's, so the bits are too; the k-quants the same way per sub-block
 * (amx_unit_k). Rows past the last whole 16 and units of fewer than 16 outputs take the VNNI
 * path.
 *
 * GGUF_AMX_EMULATE builds the same code with the tile instructions done in C from their
 * definitions (Intel SDM, AMX), which is how a machine without AMX tests it; the real build is
 * checked against the VNNI path once per process before its first use (amx_ready). */
#if GGUF_SIMD && ((defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)) || defined(GGUF_AMX_EMULATE))
#define GGUF_AMX 1
#include "amx.h"

/* The tiles of amx_sums, two sets so that consecutive blocks overlap: a block's weights (8 rows of
 * 64 bytes: K = 32 positions, 16 outputs), 16 activation rows (32 bytes each) and their 16 x 16
 * int32 sums. */
#define TILE_W0 0 /* numbers, not an enum: the intrinsics paste them into the instruction's text */
#define TILE_A0 1
#define TILE_C0 2
#define TILE_W1 3
#define TILE_A1 4
#define TILE_C1 5
static const tile_config amx_config = {
    .palette = 1,
    .colsb = {[TILE_W0] = 64, [TILE_A0] = 32, [TILE_C0] = 64, [TILE_W1] = 64, [TILE_A1] = 32, [TILE_C1] = 64},
    .rows = {[TILE_W0] = 8, [TILE_A0] = 16, [TILE_C0] = 16, [TILE_W1] = 8, [TILE_A1] = 16, [TILE_C1] = 16},
};

#ifdef GGUF_AMX_EMULATE
static __thread tile_config emu_config;
static __thread uint8_t emu_tiles[8][16][64];

static void emu_tile_config(const void *config) { memcpy(&emu_config, config, sizeof emu_config); }

/* A tile used beyond what its configuration allows faults on the hardware: here it aborts. */
static void emu_require(int ok) {
    if (!ok) abort();
}

static void emu_tile_load(int t, const void *base, int64_t stride) {
    emu_require(emu_config.palette == 1 && emu_config.rows[t] <= 16 && emu_config.colsb[t] <= 64);
    memset(emu_tiles[t], 0, sizeof emu_tiles[t]);
    for (int r = 0; r < emu_config.rows[t]; ++r)
        memcpy(emu_tiles[t][r], (const uint8_t *)base + r * stride, emu_config.colsb[t]);
}

static void emu_tile_store(int t, void *base, int64_t stride) {
    emu_require(emu_config.palette == 1);
    for (int r = 0; r < emu_config.rows[t]; ++r) memcpy((uint8_t *)base + r * stride, emu_tiles[t][r], emu_config.colsb[t]);
}

static void emu_tile_zero(int t) { memset(emu_tiles[t], 0, sizeof emu_tiles[t]); }

/* TDPBSSD c, a, b: c[m] dword n += sum over k < colsb(a) / 4 of the signed bytes a[m][4k + i]
 * times b[k][4n + i], i < 4. */
static void emu_tile_dpbssd(int c, int a, int b) {
    const tile_config *t = &emu_config;
    emu_require(t->palette == 1 && t->rows[c] == t->rows[a] && t->colsb[a] / 4 == t->rows[b] &&
                t->colsb[b] == t->colsb[c] && t->colsb[a] % 4 == 0 && t->colsb[c] % 4 == 0);
    for (int m = 0; m < t->rows[c]; ++m)
        for (int n = 0; n < t->colsb[c] / 4; ++n) {
            int32_t sum;
            memcpy(&sum, &emu_tiles[c][m][4 * n], sizeof sum);
            for (int k = 0; k < t->colsb[a] / 4; ++k)
                for (int i = 0; i < 4; ++i)
                    sum += (int32_t)(int8_t)emu_tiles[a][m][4 * k + i] * (int32_t)(int8_t)emu_tiles[b][k][4 * n + i];
            memcpy(&emu_tiles[c][m][4 * n], &sum, sizeof sum);
        }
}

#define TILE_CONFIG(config) emu_tile_config(config)
#define TILE_LOAD(t, base, stride) emu_tile_load(t, base, stride)
#define TILE_STORE(t, base, stride) emu_tile_store(t, base, stride)
#define TILE_ZERO(t) emu_tile_zero(t)
#define TILE_DPBSSD(c, a, b) emu_tile_dpbssd(c, a, b)
#define TILE_RELEASE() ((void)0)
static int amx_permitted(void) { return 1; }
#else
#define TILE_CONFIG(config) _tile_loadconfig(config)
#define TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define TILE_RELEASE() _tile_release()
static int amx_permitted(void) { return amx_request_permission(); }
#endif

/* Block b of output rows n0 .. n0+15 (groups `lo` and `hi`, 8 rows each) as tiles TILE_W0 and TILE_W1 want
 * it: row r holds positions 4r .. 4r+3 of the 16 outputs, the quants as signed bytes. */
static void amx_weight_tile(int base, const uint8_t *lo, const uint8_t *hi, int8_t tile[8][64]) {
    for (int half = 0; half < 2; ++half) {
        __m256i w[8];
        x8_quants(base, half ? hi : lo, w);
        for (int r = 0; r < 8; ++r) _mm256_storeu_si256((__m256i *)(tile[r] + 32 * half), w[r]);
    }
}

/* Blocks whose sums wait in L1 for their float steps (18 KB of sums at most). */
enum { AMX_CHUNK = 18 };

/* c[j] = the exact int32 sums of block b0 + j for activation rows [m, m + 16) and the unit's 16
 * outputs, j < nc. Two blocks at a time on separate tiles, so one's product overlaps the other's
 * loads and stores. */
static void amx_sums(const acts *a, int64_t m, int64_t b0, int64_t nc, int8_t (*tiles)[8][64],
                     int32_t c[AMX_CHUNK][16][16]) {
    const int8_t *q = a->q + m * a->K + 32 * b0;
    int64_t j = 0;
    for (; j + 2 <= nc; j += 2) {
        TILE_LOAD(TILE_W0, tiles[b0 + j], 64);
        TILE_LOAD(TILE_A0, q + 32 * j, a->K);
        TILE_ZERO(TILE_C0);
        TILE_DPBSSD(TILE_C0, TILE_A0, TILE_W0);
        TILE_LOAD(TILE_W1, tiles[b0 + j + 1], 64);
        TILE_LOAD(TILE_A1, q + 32 * (j + 1), a->K);
        TILE_ZERO(TILE_C1);
        TILE_DPBSSD(TILE_C1, TILE_A1, TILE_W1);
        TILE_STORE(TILE_C0, c[j], 64);
        TILE_STORE(TILE_C1, c[j + 1], 64);
    }
    if (j < nc) {
        TILE_LOAD(TILE_W0, tiles[b0 + j], 64);
        TILE_LOAD(TILE_A0, q + 32 * j, a->K);
        TILE_ZERO(TILE_C0);
        TILE_DPBSSD(TILE_C0, TILE_A0, TILE_W0);
        TILE_STORE(TILE_C0, c[j], 64);
    }
}

/* tile_x8's float steps for activation rows m + r0 .. m + r0 + 7, their 16 outputs and blocks
 * b0 .. b0 + nc - 1 in order: acc = fma(sum, d_w * d_a, acc), and with base Q4_1 (for every
 * format with a min) off = fma(m_w, s_a, off). Eight rows side by side: eight independent chains of FMAs hide the
 * FMA's latency, and their accumulators fit the registers. */
AI void amx_row_steps(const int base, const int32_t c[AMX_CHUNK][16][16], const float dw[AMX_CHUNK][16],
                      const float mw[AMX_CHUNK][16], const acts *a, int64_t b0, int64_t nc, int64_t m, int r0,
                      float acc[16][16], float off[16][16]) {
    enum { R = 8 };
    const float *da = a->d + b0 * a->M + m + r0, *sa = a->s + b0 * a->M + m + r0;
#ifdef __AVX512F__
    __m512 sum[R], min[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm512_load_ps(acc[r0 + r]), min[r] = _mm512_load_ps(off[r0 + r]);
    for (int64_t j = 0; j < nc; ++j) {
        const __m512 w = _mm512_load_ps(dw[j]), wm = _mm512_load_ps(mw[j]);
        for (int r = 0; r < R; ++r) {
            const __m512 block = _mm512_cvtepi32_ps(_mm512_load_si512(c[j][r0 + r]));
            sum[r] = _mm512_fmadd_ps(block, _mm512_mul_ps(w, _mm512_set1_ps(da[j * a->M + r])), sum[r]);
            if (base == Q4_1) min[r] = _mm512_fmadd_ps(wm, _mm512_set1_ps(sa[j * a->M + r]), min[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_store_ps(acc[r0 + r], sum[r]), _mm512_store_ps(off[r0 + r], min[r]);
#else
    for (int h = 0; h < 16; h += 8) {
        __m256 sum[R], min[R];
        for (int r = 0; r < R; ++r) sum[r] = _mm256_load_ps(acc[r0 + r] + h), min[r] = _mm256_load_ps(off[r0 + r] + h);
        for (int64_t j = 0; j < nc; ++j) {
            const __m256 w = _mm256_load_ps(dw[j] + h), wm = _mm256_load_ps(mw[j] + h);
            for (int r = 0; r < R; ++r) {
                const __m256 block = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)(c[j][r0 + r] + h)));
                sum[r] = _mm256_fmadd_ps(block, _mm256_mul_ps(w, _mm256_set1_ps(da[j * a->M + r])), sum[r]);
                if (base == Q4_1) min[r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(sa[j * a->M + r]), min[r]);
            }
        }
        for (int r = 0; r < R; ++r) _mm256_store_ps(acc[r0 + r] + h, sum[r]), _mm256_store_ps(off[r0 + r] + h, min[r]);
    }
#endif
}

/* Output rows n0 .. n0+15 (the groups at `group` and `group + group_bytes`) for activation rows
 * [m_begin, m_end), a multiple of 16 rows: y[(m - m_begin) * ldy + j] for output n0 + j. `tiles`
 * holds the unit's weight tiles, nb * 512 bytes. Per 16 rows and chunk of blocks, the tiles give
 * every block's sums, then each row takes the chunk's float steps; per (row, output) the blocks
 * still come in order, so the bits are tile_x8's. */
static void amx_unit(int base, const uint8_t *group, int64_t group_bytes, const acts *a, int64_t m_begin,
                     int64_t m_end, float *y, int64_t ldy, int8_t (*tiles)[8][64]) {
    const int64_t gbytes = 8 * block_bytes(base), nb = a->nb;
    for (int64_t b = 0; b < nb; ++b)
        amx_weight_tile(base, group + b * gbytes, group + group_bytes + b * gbytes, tiles[b]);
    TILE_CONFIG(&amx_config);
    int32_t c[AMX_CHUNK][16][16] __attribute__((aligned(64)));
    float dw[AMX_CHUNK][16] __attribute__((aligned(64))), mw[AMX_CHUNK][16] __attribute__((aligned(64)));
    float acc[16][16] __attribute__((aligned(64))), off[16][16] __attribute__((aligned(64)));
    const int64_t chunk = (nb + (nb + AMX_CHUNK - 1) / AMX_CHUNK - 1) / ((nb + AMX_CHUNK - 1) / AMX_CHUNK); /* even */
    for (int64_t m = m_begin; m < m_end; m += 16) {
        memset(acc, 0, sizeof acc);
        memset(off, 0, sizeof off);
        for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
            const int64_t nc = nb - b0 < chunk ? nb - b0 : chunk;
            amx_sums(a, m, b0, nc, tiles, c);
            for (int64_t j = 0; j < nc; ++j) { /* the scales (and the mins after them) lead each group's struct */
                const uint8_t *lo = group + (b0 + j) * gbytes, *hi = lo + group_bytes;
                _mm256_store_ps(dw[j], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)lo)));
                _mm256_store_ps(dw[j] + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hi)));
                if (has_min(base)) {
                    _mm256_store_ps(mw[j], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(lo + 16))));
                    _mm256_store_ps(mw[j] + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hi + 16))));
                }
            }
            for (int r0 = 0; r0 < 16; r0 += 8) {
                if (has_min(base)) amx_row_steps(Q4_1, c, dw, mw, a, b0, nc, m, r0, acc, off);
                else amx_row_steps(Q8_0, c, dw, mw, a, b0, nc, m, r0, acc, off); /* no min */
            }
        }
        for (int r = 0; r < 16; ++r) /* the VNNI path's last step, + 0 included (it turns -0 into +0) */
            for (int h = 0; h < 16; h += 8)
                _mm256_storeu_ps(y + (m - m_begin + r) * ldy + h,
                                 _mm256_add_ps(_mm256_load_ps(acc[r] + h), _mm256_load_ps(off[r] + h)));
    }
    TILE_RELEASE();
}

/* ---- the k-quants on the tiles */

/* Sixteen lanes (outputs n0 .. n0+15) as GCC vectors: 512-bit registers where the build has
 * them, two 256-bit halves elsewhere, the same operation lane by lane either way. */
typedef int32_t i32x16 __attribute__((vector_size(64), aligned(64)));
typedef float f32x16 __attribute__((vector_size(64), aligned(64)));

AI f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
#ifdef __AVX512F__
    return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    union { f32x16 v; __m256 h[2]; } x = {a}, y = {b}, z = {c}, out;
    for (int h = 0; h < 2; ++h) out.h[h] = _mm256_fmadd_ps(x.h[h], y.h[h], z.h[h]);
    return out.v;
#endif
}

/* Eight fp16 values of one group and eight of the next as sixteen floats. */
AI f32x16 halves_f32x16(const uint16_t *lo, const uint16_t *hi) {
    union { f32x16 v; __m256 h[2]; } out;
    out.h[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)lo));
    out.h[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hi));
    return out.v;
}

/* Positions per sub-block: one tile product each. */
static inline int k_sub_len(int base) { return base == Q4_K || base == Q5_K ? 32 : 16; }

static const tile_config amx_config16 = { /* TILE_A* 16 rows x 16 positions, TILE_W* 4 x 64 */
    .palette = 1,
    .colsb = {[TILE_W0] = 64, [TILE_A0] = 16, [TILE_C0] = 64, [TILE_W1] = 64, [TILE_A1] = 16, [TILE_C1] = 64},
    .rows = {[TILE_W0] = 4, [TILE_A0] = 16, [TILE_C0] = 16, [TILE_W1] = 4, [TILE_A1] = 16, [TILE_C1] = 16},
};

/* Per block of a k-quant unit: the sub-blocks' scales (and Q4_K's and Q5_K's mins) of its 16
 * outputs, as the VNNI kernels multiply them. */
typedef struct {
    i32x16 scale[16], min[8];
    f32x16 d, dmin;
} k_block_scales;

/* Lanes 8h .. 8h + 7 of v = the eight bytes at p, widened (signed or not). */
AI void widen8(i32x16 *v, int h, const void *p, int is_signed) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    const __m256i lanes = is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    memcpy((int32_t *)v + 8 * h, &lanes, sizeof lanes);
}

static void k_scales(int base, const uint8_t *lo, const uint8_t *hi, k_block_scales *out) {
    const uint8_t *blk[2] = {lo, hi};
    for (int h = 0; h < 2; ++h) {
        if (base == Q4_K || base == Q5_K) {
            uint8_t sc[64], mn[64];
            x8_q4k_scales(((const block_q4_kx8 *)blk[h])->scales, sc, mn);
            for (int t = 0; t < 8; ++t) widen8(&out->scale[t], h, sc + 8 * t, 0), widen8(&out->min[t], h, mn + 8 * t, 0);
        } else {
            int8_t q3[128];
            if (base == Q3_K) x8_q3k_scales(((const block_q3_kx8 *)blk[h])->scales, q3);
            const int8_t *sc = base == Q3_K ? q3 : ((const block_q6_kx8 *)blk[h])->scales;
            for (int t = 0; t < 16; ++t) widen8(&out->scale[t], h, sc + 8 * t, 1);
        }
    }
    /* d leads every k-quant group's struct, dmin follows it in Q4_K's and Q5_K's */
    out->d = halves_f32x16((const uint16_t *)lo, (const uint16_t *)hi);
    if (base == Q4_K || base == Q5_K) out->dmin = halves_f32x16((const uint16_t *)lo + 8, (const uint16_t *)hi + 8);
}

/* amx_unit for the k-quants (Q3_K, Q4_K, Q5_K, Q6_K). Per 16 activation rows and block, one
 * product per sub-block gives its exact 16 x 16 sums; each row then takes the VNNI kernels'
 * integer steps (times the sub-block scales; the mins' or the offset's term from the activations'
 * 16-value sums) and their float steps per block in order: the same integers and the same float
 * operations, so tile_qk_x8's, tile_q6k_x8's and tile_q3k_x8's bits. `tiles` holds the unit's
 * weight tiles, K * 16 bytes: sub-block g of the unit at g * (P / 4) * 64; `scales` its blocks'
 * scales (K / 256 of them), both staged once per unit for every 16 rows. */
static void amx_unit_k(int base, const uint8_t *group, int64_t group_bytes, const acts *a, int64_t m_begin,
                       int64_t m_end, float *y, int64_t ldy, uint8_t *tiles, k_block_scales *scales) {
    const int64_t gbytes = 8 * block_bytes(base), nb = a->nb;
    const int P = k_sub_len(base), subs = 256 / P, tile_bytes = P / 4 * 64;
    for (int64_t b = 0; b < nb; ++b) {
        for (int t = 0; t < subs; ++t) {
            uint8_t *tile = tiles + (b * subs + t) * tile_bytes;
            for (int h = 0; h < 2; ++h) {
                __m256i w[8];
                x8_k_sub_block(base, group + h * group_bytes + b * gbytes, t, w);
                for (int r = 0; r < P / 4; ++r) _mm256_storeu_si256((__m256i *)(tile + 64 * r + 32 * h), w[r]);
            }
        }
        k_scales(base, group + b * gbytes, group + group_bytes + b * gbytes, &scales[b]);
    }
    TILE_CONFIG(P == 32 ? &amx_config : &amx_config16);
    int32_t c[16][16][16] __attribute__((aligned(64))); /* [sub-block][row][output] */
    f32x16 acc[16], off[16];
    const i32x16 zero = {0};
    for (int64_t m = m_begin; m < m_end; m += 16) {
        for (int r = 0; r < 16; ++r) acc[r] = off[r] = (f32x16){0};
        for (int64_t b = 0; b < nb; ++b) {
            const int8_t *q = a->q + m * a->K + 256 * b;
            const uint8_t *w = tiles + b * subs * tile_bytes;
            for (int t = 0; t < subs; t += 2) { /* two products in flight, as amx_sums */
                TILE_LOAD(TILE_W0, w + t * tile_bytes, 64);
                TILE_LOAD(TILE_A0, q + P * t, a->K);
                TILE_ZERO(TILE_C0);
                TILE_DPBSSD(TILE_C0, TILE_A0, TILE_W0);
                TILE_LOAD(TILE_W1, w + (t + 1) * tile_bytes, 64);
                TILE_LOAD(TILE_A1, q + P * (t + 1), a->K);
                TILE_ZERO(TILE_C1);
                TILE_DPBSSD(TILE_C1, TILE_A1, TILE_W1);
                TILE_STORE(TILE_C0, c[t], 64);
                TILE_STORE(TILE_C1, c[t + 1], 64);
            }
            const k_block_scales *sc = &scales[b];
            for (int r = 0; r < 16; ++r) {
                const int16_t *bsum = a->bsum + ((m + r) * nb + b) * 16;
                i32x16 isum = zero, imin = zero;
                if (P == 16) { /* the offset first: 32 (Q6_K) or 4 (Q3_K) times the scaled 16-value sums */
                    for (int t = 0; t < 16; ++t) imin += sc->scale[t] * bsum[t];
                    isum = zero - (imin << (base == Q6_K ? 5 : 2));
                }
                for (int t = 0; t < subs; ++t) {
                    i32x16 sums;
                    memcpy(&sums, c[t][r], sizeof sums);
                    isum += sums * sc->scale[t];
                }
                const f32x16 da = (f32x16){0} + a->d[b * a->M + m + r];
                acc[r] = fma16(__builtin_convertvector(isum, f32x16), sc->d * da, acc[r]);
                if (P == 32) {
                    imin = zero;
                    for (int t = 0; t < 8; ++t) imin += sc->min[t] * (bsum[2 * t] + bsum[2 * t + 1]);
                    off[r] = fma16(-(sc->dmin * da), __builtin_convertvector(imin, f32x16), off[r]);
                }
            }
        }
        for (int r = 0; r < 16; ++r) { /* Q4_K's and Q5_K's last step adds the mins' term */
            const f32x16 out = P == 32 ? acc[r] + off[r] : acc[r];
            memcpy(y + (m - m_begin + r) * ldy, &out, sizeof out);
        }
    }
    TILE_RELEASE();
}

/* Whether this process may use the tiles: permission, then the tiles' products of a fixed
 * pseudo-random case against the VNNI path's, bit for bit (once per process; a build whose tiles
 * disagree falls back, which the tests would show). */
static int amx_self_check(void) {
    enum { K = 96, NB = K / 32, M = 48 }; /* three blocks: amx_sums' pair and its odd last */
    static const int bases[5] = {Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
    uint32_t seed = 12345u;
#define NEXT() (seed = seed * 1664525u + 1013904223u, seed >> 8)
    int8_t q[M * K];
    float d[NB * M], s[NB * M];
    for (int i = 0; i < M * K; ++i) q[i] = (int8_t)((int)(NEXT() % 255) - 127);
    for (int i = 0; i < NB * M; ++i) d[i] = (float)(NEXT() % 1000 + 1) / 8192.0f, s[i] = (float)((int)(NEXT() % 2001) - 1000) / 64.0f;
    int32_t qsum[NB * M] = {0};
    for (int i = 0; i < M * K; ++i) qsum[i % K / 32 * M + i / K] += q[i];
    const acts a = {.q = q, .d = d, .s = s, .qsum = qsum, .bsum = NULL, .M = M, .K = K, .nb = NB};
    uint8_t weights[2 * NB * sizeof(block_q8_0x8)];
    int8_t tiles[NB][8][64];
    float tiled[M * 16], vnni[M * 16];
    for (int i = 0; i < 5; ++i) {
        const int64_t gbytes = 8 * block_bytes(bases[i]);
        for (int64_t j = 0; j < 2 * NB * gbytes; ++j) weights[j] = (uint8_t)NEXT();
        for (int g = 0; g < 2 * NB; ++g) /* finite fp16 scales (and the mins): 0.0039 .. 1 */
            for (int j = 0; j < (has_min(bases[i]) ? 16 : 8); ++j) {
                const uint16_t h = (uint16_t)(0x1C00 + NEXT() % 0x1C00);
                memcpy(weights + g * gbytes + 2 * j, &h, sizeof h);
            }
        amx_unit(bases[i], weights, NB * gbytes, &a, 0, M, tiled, 16, tiles);
        for (int h = 0; h < 2; ++h)
            for (int64_t m = 0; m < M; ++m)
                run_tile_x8(X8 + bases[i], 1, weights + h * NB * gbytes, &a, m, vnni + m * 16 + 8 * h, 16);
        if (memcmp(tiled, vnni, sizeof tiled) != 0) return 0;
    }
    /* the k-quants: one block of 256 positions, the activations' 16- and 32-value sums from their quants */
    static const int kbases[4] = {Q3_K, Q4_K, Q5_K, Q6_K};
    int8_t qk[M * 256];
    int16_t bsum[M * 16] = {0}, bsum32[M * 8] = {0};
    for (int i = 0; i < M * 256; ++i) qk[i] = (int8_t)((int)(NEXT() % 255) - 127), bsum[i / 16] += qk[i], bsum32[i / 32] += qk[i];
    const acts ak = {.q = qk, .d = d, .s = s, .qsum = NULL, .bsum = bsum, .bsum32 = bsum32, .M = M, .K = 256, .nb = 1};
    uint8_t kweights[2 * sizeof(block_q6_kx8)], ktiles[256 * 16];
    k_block_scales kscales[1];
    for (int i = 0; i < 4; ++i) {
        const int base = kbases[i];
        const int64_t gbytes = 8 * block_bytes(base);
        for (int64_t j = 0; j < 2 * gbytes; ++j) kweights[j] = (uint8_t)NEXT();
        for (int g = 0; g < 2; ++g) /* finite d (and dmin): 0.0039 .. 1 */
            for (int j = 0; j < (base == Q4_K || base == Q5_K ? 16 : 8); ++j) {
                const uint16_t h = (uint16_t)(0x1C00 + NEXT() % 0x1C00);
                memcpy(kweights + g * gbytes + 2 * j, &h, sizeof h);
            }
        amx_unit_k(base, kweights, gbytes, &ak, 0, M, tiled, 16, ktiles, kscales);
        for (int h = 0; h < 2; ++h)
            for (int64_t m = 0; m < M; ++m)
                run_tile_x8(X8 + base, 1, kweights + h * gbytes, &ak, m, vnni + m * 16 + 8 * h, 16);
        if (memcmp(tiled, vnni, sizeof tiled) != 0) return 0;
    }
#undef NEXT
    return 1;
}

static int amx_state; /* 0: not yet known, else gguf_amx_ready's answer */

static int amx_status(void) { return amx_status_once(&amx_state, amx_permitted, amx_self_check); }

static int amx_ready(void) { return amx_status() == 1; }
#else
#define GGUF_AMX 0
#endif

/* One tile through the SIMD path; (nr, mr) is one of the shapes the caller picks. */
static void run_tile(int qtype, int nr, int mr, const uint8_t *w, int64_t w_stride, const acts *a, int64_t m,
                     float *y, int64_t ldy) {
    switch (qtype) {
        TILE32_CASE(Q4_0)
        TILE32_CASE(Q4_1)
        TILE32_CASE(Q5_0)
        TILE32_CASE(Q5_1)
        TILE32_CASE(Q8_0)
    case Q3_K:
        for (int i = 0; i < nr; ++i) {
            if (mr == 4) tile_q3k(4, w + i * w_stride, a, m, y + i, ldy);
            else tile_q3k(1, w + i * w_stride, a, m, y + i, ldy);
        }
        break;
    case Q4_K:
        for (int i = 0; i < nr; ++i) {
            if (mr == 4) tile_qk(Q4_K, 4, w + i * w_stride, a, m, y + i, ldy);
            else tile_qk(Q4_K, 1, w + i * w_stride, a, m, y + i, ldy);
        }
        break;
    case Q5_K:
        for (int i = 0; i < nr; ++i) {
            if (mr == 4) tile_qk(Q5_K, 4, w + i * w_stride, a, m, y + i, ldy);
            else tile_qk(Q5_K, 1, w + i * w_stride, a, m, y + i, ldy);
        }
        break;
    case Q6_K:
        for (int i = 0; i < nr; ++i) {
            if (mr == 4) tile_q6k(4, w + i * w_stride, a, m, y + i, ldy);
            else tile_q6k(1, w + i * w_stride, a, m, y + i, ldy);
        }
        break;
    }
}
#endif /* GGUF_SIMD */

/* ---------------------------------------------------------------- entry points */

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

/* 1 when products of 16 or more rows on the interleaved formats run on AMX tiles (built for them,
 * permitted by the OS, and checked against the VNNI path); 0 a build without tiles, -1 the OS
 * refused them, -2 the tiles' products differed from the VNNI path's (a defect: tiles stay off). */
int gguf_amx_ready(void) {
#if GGUF_AMX
    return amx_status();
#else
    return 0;
#endif
}

int64_t gguf_block_bytes(int qtype) { return block_bytes(qtype); }

/* The interleaved type of a rows x K matrix of `qtype`, 0 when it has none. */
int gguf_interleaved_type(int qtype, int64_t rows, int64_t K) {
    return block_bytes(qtype) && !interleaved_base(qtype) &&
                   rows % 8 == 0 &&
                   K % block_elems(qtype) == 0
               ? X8 + qtype
               : 0;
}

/* dst = src (rows x K of any of the file formats above, the file's blocks) with every eight rows
 * interleaved (block_q4_0x8 and kin, same size); returns the interleaved type, or 0 (nothing
 * written) when the format has no interleaved form or rows is not a multiple of 8. */
int gguf_interleave(int qtype, const void *src, int64_t rows, int64_t K, void *dst) {
    if (!gguf_interleaved_type(qtype, rows, K)) return 0;
    const int64_t nb = K / block_elems(qtype), bb = block_bytes(qtype);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < rows / 8; ++g) {
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t *out = (uint8_t *)dst + (g * nb + b) * 8 * bb;
            for (int j = 0; j < 8; ++j) {
                const uint8_t *blk = (const uint8_t *)src + ((8 * g + j) * nb + b) * bb;
                uint8_t v[256]; /* the block's values in position order (Q6_K's less nothing, 0..63) */
                if (qtype == Q8_0) {
                    block_q8_0x8 *x = (block_q8_0x8 *)out;
                    x->d[j] = ((const block_q8_0 *)blk)->d;
                    for (int k = 0; k < 8; ++k) memcpy(x->qs + x8_q8_at(j, 4 * k), ((const block_q8_0 *)blk)->qs + 4 * k, 4);
                } else if (qtype == Q6_K) {
                    const block_q6_k *k6 = (const block_q6_k *)blk;
                    block_q6_kx8 *x = (block_q6_kx8 *)out;
                    x->d[j] = k6->d;
                    for (int h = 0; h < 2; ++h)
                        for (int l = 0; l < 32; ++l) { /* the four positions of byte l (q6k_store's places) */
                            const uint8_t ql0 = k6->ql[64 * h + l], ql1 = k6->ql[64 * h + 32 + l], qh = k6->qh[32 * h + l];
                            v[128 * h + l] = (uint8_t)((ql0 & 0x0F) | (qh & 3) << 4);
                            v[128 * h + 32 + l] = (uint8_t)((ql1 & 0x0F) | (qh >> 2 & 3) << 4);
                            v[128 * h + 64 + l] = (uint8_t)(ql0 >> 4 | (qh >> 4 & 3) << 4);
                            v[128 * h + 96 + l] = (uint8_t)(ql1 >> 4 | (qh >> 6) << 4);
                        }
                    for (int t = 0; t < 16; ++t) {
                        x->scales[8 * t + j] = k6->scales[t];
                        for (int i = 0; i < 4; ++i) { /* positions 16t + 4k + i */
                            const uint8_t *w = v + 16 * t + i;
                            x->q[t][4 * j + i] = (uint8_t)((w[0] & 0x0F) | (w[4] & 0x0F) << 4);
                            x->q[t][32 + 4 * j + i] = (uint8_t)((w[8] & 0x0F) | (w[12] & 0x0F) << 4);
                            x->q[t][64 + 4 * j + i] = (uint8_t)(w[0] >> 4 | (w[4] >> 4) << 2 | (w[8] >> 4) << 4 | (w[12] >> 4) << 6);
                        }
                    }
                } else if (qtype == Q5_K) {
                    const block_q5_k *k5 = (const block_q5_k *)blk;
                    block_q5_kx8 *x = (block_q5_kx8 *)out;
                    x->d[j] = k5->d;
                    x->dmin[j] = k5->dmin;
                    for (int k = 0; k < 12; ++k) x->scales[8 * k + j] = k5->scales[k];
                    for (int c = 0; c < 4; ++c) /* qk_value's positions 64c + l and 64c + 32 + l */
                        for (int l = 0; l < 32; ++l) {
                            v[64 * c + l] = (uint8_t)qk_value(k5->qs, k5->qh, c, 0, l);
                            v[64 * c + 32 + l] = (uint8_t)qk_value(k5->qs, k5->qh, c, 1, l);
                        }
                    for (int sub = 0; sub < 8; ++sub) {
                        const uint8_t *w = v + 32 * sub;
                        for (int p = 0; p < 4; ++p)
                            for (int i = 0; i < 4; ++i)
                                x->q[sub][32 * p + 4 * j + i] = (uint8_t)((w[8 * p + i] & 0x0F) | (w[8 * p + 4 + i] & 0x0F) << 4);
                        for (int i = 0; i < 4; ++i) {
                            int bits = 0;
                            for (int k = 0; k < 8; ++k) bits |= (w[4 * k + i] >> 4) << k;
                            x->q[sub][128 + 4 * j + i] = (uint8_t)bits;
                        }
                    }
                } else if (qtype == Q3_K) {
                    const block_q3_k *k3 = (const block_q3_k *)blk;
                    block_q3_kx8 *x = (block_q3_kx8 *)out;
                    x->d[j] = k3->d;
                    for (int k = 0; k < 12; ++k) x->scales[8 * k + j] = k3->scales[k];
                    for (int p = 0; p < 256; ++p) /* 0..7: the value plus 4 */
                        v[p] = (uint8_t)(q3k_value(k3, p / 128, p % 128 / 32, p % 32) + 4);
                    for (int half = 0; half < 8; ++half) {
                        const uint8_t *w = v + 32 * half;
                        for (int i = 0; i < 4; ++i) {
                            int lo0 = 0, lo1 = 0, bits = 0;
                            for (int k = 0; k < 4; ++k) {
                                lo0 |= (w[4 * k + i] & 3) << (2 * k);
                                lo1 |= (w[16 + 4 * k + i] & 3) << (2 * k);
                            }
                            for (int k = 0; k < 8; ++k) bits |= (w[4 * k + i] >> 2) << k;
                            x->q[half][4 * j + i] = (uint8_t)lo0;
                            x->q[half][32 + 4 * j + i] = (uint8_t)lo1;
                            x->q[half][64 + 4 * j + i] = (uint8_t)bits;
                        }
                    }
                } else if (qtype == Q5_0 || qtype == Q5_1) {
                    const int min = qtype == Q5_1; /* d (and m), qh[4], qs[16] */
                    memcpy(out + 2 * j, blk, 2);
                    if (min) memcpy(out + 16 + 2 * j, blk + 2, 2);
                    const uint8_t *qh = blk + 2 + 2 * min, *qs = qh + 4;
                    uint8_t *xh = out + 16 + 16 * min, *xs = xh + 32;
                    for (int i = 0; i < 32; ++i) v[i] = (uint8_t)q5_value(qh, qs, i);
                    for (int i = 0; i < 4; ++i) { /* positions 4k + i: nibbles as Q4_0's, fifth bits in bit k */
                        int bits = 0;
                        for (int k = 0; k < 8; ++k) bits |= (v[4 * k + i] >> 4) << k;
                        xh[4 * j + i] = (uint8_t)bits;
                        for (int p = 0; p < 4; ++p)
                            xs[32 * p + 4 * j + i] = (uint8_t)((v[8 * p + i] & 0x0F) | (v[8 * p + 4 + i] & 0x0F) << 4);
                    }
                } else { /* the nibble formats */
                    const uint8_t *qs;
                    uint8_t *xs;
                    int n;
                    if (qtype == Q4_K) {
                        const block_q4_k *k4 = (const block_q4_k *)blk;
                        block_q4_kx8 *x = (block_q4_kx8 *)out;
                        x->d[j] = k4->d;
                        x->dmin[j] = k4->dmin;
                        for (int k = 0; k < 12; ++k) x->scales[8 * k + j] = k4->scales[k];
                        qs = k4->qs, xs = x->qs, n = 256;
                    } else if (qtype == Q4_0) {
                        ((block_q4_0x8 *)out)->d[j] = ((const block_q4_0 *)blk)->d;
                        qs = ((const block_q4_0 *)blk)->qs, xs = ((block_q4_0x8 *)out)->qs, n = 32;
                    } else {
                        ((block_q4_1x8 *)out)->d[j] = ((const block_q4_1 *)blk)->d;
                        ((block_q4_1x8 *)out)->m[j] = ((const block_q4_1 *)blk)->m;
                        qs = ((const block_q4_1 *)blk)->qs, xs = ((block_q4_1x8 *)out)->qs, n = 32;
                    }
                    /* the file's 32-value halves: position l low in byte l, l + half high (Q4_K per 64) */
                    const int half = n == 256 ? 32 : 16;
                    for (int c = 0; c < n / (2 * half); ++c)
                        for (int l = 0; l < half; ++l) {
                            v[2 * half * c + l] = qs[half * c + l] & 0x0F;
                            v[2 * half * c + half + l] = qs[half * c + l] >> 4;
                        }
                    for (int p = 0; p < n / 8; ++p) /* positions 8p + i low, 8p + 4 + i high */
                        for (int i = 0; i < 4; ++i) xs[32 * p + 4 * j + i] = (uint8_t)(v[8 * p + i] | v[8 * p + 4 + i] << 4);
                }
            }
        }
    }
    return X8 + qtype;
}

int gguf_block_elems(int qtype) { return block_bytes(qtype) ? block_elems(qtype) : 0; }

static void families(int64_t nseg, const int32_t *qtypes, int *need32, int *need256) {
    *need32 = *need256 = 0;
    for (int64_t s = 0; s < nseg; ++s) {
        if (block_elems(qtypes[s]) == 32) *need32 = 1;
        else *need256 = 1;
    }
}

/* Bytes of scratch gguf_matmul needs for M rows of K values and these weight types. */
int64_t gguf_scratch_bytes(int64_t M, int64_t K, int64_t nseg, const int32_t *qtypes) {
    int need32, need256;
    families(nseg, qtypes, &need32, &need256);
    return need32 * acts_bytes(M, K, 0) + need256 * acts_bytes(M, K, 1);
}

/* Ask for part `part` of `parts` of a unit's weights (`bytes` at `w`) to come into L2. A unit's
 * products reuse its weights from L1 over the activation rows; meanwhile the next unit's arrive,
 * a slice per pass of activation rows, so few requests are outstanding at once. The hardware
 * prefetchers alone brought them late: 32 rows over a matrix past the last-level cache ran at
 * 80-90% of the rate over a cached one. */
static inline void prefetch_part(const uint8_t *w, int64_t bytes, int64_t part, int64_t parts) {
    for (int64_t b = bytes * part / parts / 64 * 64; b < bytes * (part + 1) / parts; b += 64)
        __builtin_prefetch(w + b, 0, 2);
}

enum { PROLOGUE_NONE = 0, PROLOGUE_RMS_NORM = 1, PROLOGUE_SWIGLU = 2 };
enum { PATH_PORTABLE = 0, PATH_VECTOR = 1, PATH_TILES = 2 }; /* gguf_matmul's simd */

/* y[M, sum(rows)] (row stride ldy) = a[M, K] times the concatenation of nseg packed matrices
 * (segment s: qtypes[s], rows[s] x K, weights[s] row-major blocks) transposed, where a is
 * x [M, K] (row stride ldx) after the prologue:
 *   PROLOGUE_NONE      a = x;
 *   PROLOGUE_RMS_NORM  v = x + residual (or x when residual is NULL), sum = v (when not NULL),
 *                      a = rms_norm(v) * norm_weight, eps; residual and sum rows are K apart;
 *   PROLOGUE_SWIGLU    x rows hold 2K values [gate | up]: a = silu(gate) * up.
 * Writes only y, sum and scratch (gguf_scratch_bytes). simd: 0 the portable path, 1 the vector
 * path, 2 the vector path with AMX tiles where gguf_amx_ready (the same bits on all three). */
static void matmul_team(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t nseg, const int32_t *qtypes,
                        const void *const *weights, const int64_t *rows, void *scratch, float *y, int64_t ldy,
                        int simd, int prologue, const float *residual, float *sum, const float *norm_weight,
                        float eps);

void gguf_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t nseg, const int32_t *qtypes,
                 const void *const *weights, const int64_t *rows, void *scratch, float *y, int64_t ldy, int simd,
                 int prologue, const float *residual, float *sum, const float *norm_weight, float eps) {
#pragma omp parallel
    matmul_team(x, M, K, ldx, nseg, qtypes, weights, rows, scratch, y, ldy, simd, prologue, residual, sum,
                norm_weight, eps);
}

/* gguf_matmul's work, run by every thread of the enclosing parallel region together (its loops
 * are shared out among them); returns once y is complete. */
static void matmul_team(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t nseg, const int32_t *qtypes,
                        const void *const *weights, const int64_t *rows, void *scratch, float *y, int64_t ldy,
                        int simd, int prologue, const float *residual, float *sum, const float *norm_weight,
                        float eps) {
    int need32, need256;
    families(nseg, qtypes, &need32, &need256);
    const acts a32 = acts_at(scratch, M, K, 0);
    const acts a256 = acts_at((char *)scratch + need32 * acts_bytes(M, K, 0), M, K, 1);
    const int use_simd = simd && GGUF_SIMD;
    /* Work units of UNIT output rows (never across segments): the static split over threads
     * decides who computes a row, never how. */
    enum { UNIT = 16 };
    int64_t units = 0;
    for (int64_t s = 0; s < nseg; ++s) units += (rows[s] + UNIT - 1) / UNIT;
    /* Activation rows per pass: a chunk of quantized activations stays in L2 while a unit's
     * weight rows are reused over it. */
    int64_t m_chunk = (192 << 10) / (K + 16);
    m_chunk = m_chunk < 4 ? 4 : m_chunk - m_chunk % 4;

    /* RMSNorm rows go in groups: their sums of squares side by side (squares_rows); the scratch
     * holds one group's rows, no more than the call has (batch 1: one row, as before groups) */
    const int64_t group_rows = prologue == PROLOGUE_RMS_NORM ? SQUARES_ROWS : 1;
    const int64_t scratch_rows = M < group_rows ? M : group_rows;
    float *row = prologue != PROLOGUE_NONE ? malloc(scratch_rows * K * sizeof(float)) : NULL;
#pragma omp for schedule(static)
    for (int64_t m0 = 0; m0 < M; m0 += group_rows) {
        const int n = M - m0 < group_rows ? (int)(M - m0) : (int)group_rows;
        if (prologue == PROLOGUE_RMS_NORM) {
            const float *v[SQUARES_ROWS]; /* the rows to normalize */
            float *normed[SQUARES_ROWS];
            for (int r = 0; r < n; ++r) {
                const int64_t m = m0 + r;
                v[r] = x + m * ldx;
                normed[r] = row + r * K;
                if (residual) {
                    float *out = sum ? sum + m * K : row + r * K;
                    for (int64_t i = 0; i < K; ++i) out[i] = x[m * ldx + i] + residual[m * K + i];
                    v[r] = out;
                } else if (sum) {
                    memcpy(sum + m * K, v[r], K * sizeof(float));
                }
            }
            rms_norm_group(v, n, K, norm_weight, eps, normed); /* in place where v[r] is in row */
        }
        for (int r = 0; r < n; ++r) {
            const int64_t m = m0 + r;
            const float *a = x + m * ldx;
            if (prologue == PROLOGUE_RMS_NORM) {
                a = row + r * K;
            } else if (prologue == PROLOGUE_SWIGLU) {
                swiglu_row(a, a + K, row, K);
                a = row;
            }
            if (need32) {
#if GGUF_SIMD
                if (use_simd) quantize_row32_simd(a, &a32, m);
                else
#endif
                    quantize_row(a, &a32, m, 32);
            }
            if (need256) {
#if GGUF_SIMD
                if (use_simd) quantize_row256_simd(a, &a256, m);
                else
#endif
                    quantize_row(a, &a256, m, 256);
            }
        }
    }
    free(row);
    /* the portable path's copy of an interleaved row in the file's blocks (at most Q8_0's size) */
    uint8_t *unpacked = use_simd ? NULL : malloc((K / 32 + 1) * sizeof(block_q8_0));
#if GGUF_AMX
    /* tiles for a whole 16 activation rows at least; a unit's weight tiles, 16 bytes a position */
    const int use_amx = simd == PATH_TILES && M >= 16 && amx_ready();
    int8_t(*tiles)[8][64] = use_amx ? aligned_alloc(64, (K / 32) * sizeof *tiles) : NULL;
    k_block_scales *kscales = use_amx && need256 ? aligned_alloc(64, (K / 256) * sizeof *kscales) : NULL;
#else
    enum { use_amx = 0 }; /* a build without tiles */
#endif
    /* implicit barrier: every activation row is quantized before any product. A chunk of
     * activation rows stays in L2 while every unit passes over it (each thread the same units in
     * every chunk); the weights are read once per chunk. */
    for (int64_t m0 = 0; m0 < M; m0 += m_chunk) {
        const int64_t m1 = m0 + m_chunk < M ? m0 + m_chunk : M;
#pragma omp for schedule(static) nowait
        for (int64_t u = 0; u < units; ++u) {
            int64_t s = 0, first = u, col0 = 0;
            while (first >= (rows[s] + UNIT - 1) / UNIT) {
                first -= (rows[s] + UNIT - 1) / UNIT;
                col0 += rows[s];
                ++s;
            }
            const int qtype = qtypes[s], base = interleaved_base(qtype);
            const acts *a = block_elems(qtype) == 256 ? &a256 : &a32;
            const int64_t w_stride = a->nb * block_bytes(qtype);
            const int64_t n0 = first * UNIT, n1 = n0 + UNIT < rows[s] ? n0 + UNIT : rows[s];
            const uint8_t *wseg = (const uint8_t *)weights[s];
            /* the next unit of this segment, prefetched over this unit's passes (a few rows: no need) */
            const uint8_t *next = wseg + n1 * w_stride;
            const int64_t next_bytes = M >= 8 ? ((n1 + UNIT < rows[s] ? n1 + UNIT : rows[s]) - n1) * w_stride : 0;
            /* a pass (a tile of activation rows) asks for at most 8 KB: more at once (a unit of a long
             * row, few passes) was slower */
            const int tile_most = GGUF_X8_PAIRS && M > 1 ? pair_rows(base) : 4;
            const int64_t row_tiles = (m1 - m0 + tile_most - 1) / tile_most;
            const int64_t passes = row_tiles > (next_bytes >> 13) + 1 ? row_tiles : (next_bytes >> 13) + 1;
            int64_t pass = 0;
            if (!use_simd) {
                for (int64_t n = n0; n < n1; ++n) {
                    const uint8_t *wrow = wseg + n * w_stride;
                    if (base) { /* the row back in the file's blocks: the portable path reads those */
                        x8_row(qtype, wseg + n / 8 * 8 * w_stride, (int)(n % 8), a->nb, unpacked);
                        wrow = unpacked;
                    }
                    for (int64_t m = m0; m < m1; ++m)
                        y[m * ldy + col0 + n] = dot_row_scalar(base ? base : qtype, wrow, a, m);
                }
                continue;
            }
#if GGUF_SIMD
            if (base) { /* rows come in 8-row groups (their count is a multiple of 8) */
                for (int64_t n = n0; n < n1;) {
                    /* two groups per 512-bit tile; one row streams the weights faster a group at a time */
                    const int wide = n + 16 <= n1;
                    const int pair = GGUF_X8_PAIRS && M > 1 && wide;
                    const int64_t width = pair || (wide && use_amx) ? 16 : 8;
                    const uint8_t *group = wseg + n * w_stride;
                    int64_t m = m0;
#if GGUF_AMX
                    if (use_amx && wide && m1 - m0 >= 16) { /* whole 16-row tiles; the rest below */
                        const int64_t whole = m0 + (m1 - m0) / 16 * 16;
                        prefetch_part(next, next_bytes, pass, passes);
                        pass = passes; /* one slice before the tiles' single call, none after (untimed on AMX) */
                        float *out = y + m0 * ldy + col0 + n;
                        if (block_elems(base) == 32) amx_unit(base, group, 8 * w_stride, a, m0, whole, out, ldy, tiles);
                        else amx_unit_k(base, group, 8 * w_stride, a, m0, whole, out, ldy, (uint8_t *)tiles, kscales);
                        m = whole;
                    }
#endif
                    for (; m < m1;) {
                        const int tile_cols = pair && m + tile_most <= m1 ? tile_most : m + 4 <= m1 ? 4 : 1;
                        if (n == n0) prefetch_part(next, next_bytes, pass++, passes);
                        float *out = y + m * ldy + col0 + n;
#if GGUF_X8_PAIRS
                        if (pair) run_tile_x8_pair(qtype, tile_cols, group, 8 * w_stride, a, m, out, ldy);
                        else
#endif
                            for (int64_t g = 0; g < width; g += 8)
                                run_tile_x8(qtype, tile_cols, group + g * w_stride, a, m, out + g, ldy);
                        m += tile_cols;
                    }
                    n += width;
                }
                continue;
            }
            const int nr = M == 1 ? 8 : 2;
            for (int64_t n = n0; n < n1;) {
                const int tile_rows = n + nr <= n1 ? nr : 1;
                for (int64_t m = m0; m < m1;) {
                    const int tile_cols = M > 1 && m + 4 <= m1 ? 4 : 1;
                    run_tile(qtype, tile_rows, tile_cols, wseg + n * w_stride, w_stride, a, m, y + m * ldy + col0 + n, ldy);
                    m += tile_cols;
                }
                n += tile_rows;
            }
#endif
        }
    }
#pragma omp barrier /* y is complete for every thread on return */
    free(unpacked);
#if GGUF_AMX
    free(tiles);
    free(kscales);
#endif
}

/* out[i, :] = dequantized row ids[i] of a packed [*, K] matrix (embedding lookups, tests).
 * The arithmetic is the `gguf` package's (d * q + m in that order), so rows equal its output. */
void gguf_dequantize_rows(int qtype, const void *weights, int64_t K, const int64_t *ids, int64_t n, float *out) {
    const int64_t nb = K / block_elems(qtype), w_stride = nb * block_bytes(qtype);
    const int interleaved = interleaved_base(qtype);
    if (interleaved) qtype = interleaved; /* each row is read back in the file's blocks */
#pragma omp parallel for schedule(static) if (n > 16)
    for (int64_t i = 0; i < n; ++i) {
        const uint8_t *row = (const uint8_t *)weights + ids[i] * w_stride;
        uint8_t unpacked[interleaved ? w_stride : 1];
        if (interleaved) {
            x8_row(X8 + qtype, (const uint8_t *)weights + ids[i] / 8 * 8 * w_stride, (int)(ids[i] % 8), nb, unpacked);
            row = unpacked;
        }
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
            } else if (qtype == Q5_0 || qtype == Q5_1) {
                const uint8_t *blk = row + b * block_bytes(qtype), *qh = blk + (qtype == Q5_0 ? 2 : 4);
                const float d = half_to_float(((const block_q5_1 *)blk)->d);
                for (int j = 0; j < 32; ++j)
                    o[32 * b + j] = qtype == Q5_0 ? d * (float)(q5_value(qh, qh + 4, j) - 16)
                                                  : d * (float)q5_value(qh, qh + 4, j) + half_to_float(((const block_q5_1 *)blk)->m);
            } else if (qtype == Q8_0) {
                const block_q8_0 *blk = (const block_q8_0 *)row + b;
                const float d = half_to_float(blk->d);
                for (int j = 0; j < 32; ++j) o[32 * b + j] = (float)blk->qs[j] * d;
            } else if (qtype == Q3_K) {
                const block_q3_k *blk = (const block_q3_k *)row + b;
                int8_t sc[16];
                q3k_scales(blk->scales, sc);
                const float d = half_to_float(blk->d);
                for (int h = 0; h < 2; ++h)
                    for (int j = 0; j < 4; ++j)
                        for (int l = 0; l < 32; ++l)
                            o[256 * b + 128 * h + 32 * j + l] = (d * (float)sc[8 * h + 2 * j + l / 16]) * (float)q3k_value(blk, h, j, l);
            } else if (qtype == Q4_K || qtype == Q5_K) {
                const block_q4_k *k4 = (const block_q4_k *)row + b;
                const block_q5_k *k5 = (const block_q5_k *)row + b;
                const uint8_t *qs = qtype == Q4_K ? k4->qs : k5->qs, *qh = qtype == Q4_K ? NULL : k5->qh;
                uint8_t sc[8], mn[8];
                q4k_scales(qtype == Q4_K ? k4->scales : k5->scales, sc, mn);
                const float d = half_to_float(qtype == Q4_K ? k4->d : k5->d);
                const float dmin = half_to_float(qtype == Q4_K ? k4->dmin : k5->dmin);
                for (int c = 0; c < 4; ++c) {
                    const float d_lo = d * (float)sc[2 * c], m_lo = dmin * (float)mn[2 * c];
                    const float d_hi = d * (float)sc[2 * c + 1], m_hi = dmin * (float)mn[2 * c + 1];
                    for (int j = 0; j < 32; ++j) {
                        o[256 * b + 64 * c + j] = d_lo * (float)qk_value(qs, qh, c, 0, j) - m_lo;
                        o[256 * b + 64 * c + 32 + j] = d_hi * (float)qk_value(qs, qh, c, 1, j) - m_hi;
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
