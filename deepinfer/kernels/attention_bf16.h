/* One part of a row tile's attention in bf16 products, for a bf16 KV cache (included by
 * paged_attention.c, which splits the work into parts and merges them): on AMX bf16 tiles where
 * the CPU has them, else on AVX512-BF16's VDPBF16PS (AMD Zen 4/5, or AMX refused by the OS).
 *
 * The fp32 path spends 8 FMAs per (query head, key) pair at head_dim 64: 80% of an 8k-token
 * prefill on the Intel Xeon with AMX. On tiles, one TDPBF16PS does 16 x 16 x 32 multiply-adds, so
 * the products cost ~0.25 cycle per pair and the softmax's exponentials are most of what is left;
 * VDPBF16PS does 32 multiply-adds where an FMA does 16 (Zen 4: ~2.3x the fp32 FMA's rate). A part
 * (at most PART_TOKENS keys of one kv head) is one softmax step:
 *   S [queries, keys] = Q K^T      A: the queries' rows in bf16, B: K's pairs of dims, keys side
 *                                  by side (16 x 16 transposes of 32-bit pairs, once per part)
 *   m = max over a row's keys, P = e^(S - m) (0 where masked), l = the row's sum of P
 *   O [queries, dims] = P V        A: P's rows in bf16, B: V's pairs of keys side by side
 * with the scores scaled after the sums (q stays as the model rounded it). Query rows are the
 * tile's (row, head) pairs, 16 per block, sharing the part's staged K and V; a decode row's
 * block has `group` of them, and the softmax runs on those rows only. VDPBF16PS reads the same
 * staged operands: a lane of K^T (16 keys) or of V (16 dims) times one query's pair, broadcast.
 *
 * Numerics, per query row: q rounded to bf16 (exact for a bf16 model's q), each score the fp32
 * sum of the dim pairs' products in order (tiles: D/32 chunks in order), times the scale; P
 * rounded to bf16 for the values' product (as a bf16 GPU kernel does), each output element the
 * sum over key pairs in order (tiles: chunks of 32 keys); l sums P in fp32. Every element depends
 * only on its own query row and the keys, and a masked key adds an exact zero, so a row's bits are
 * the same alone, in any tile, chunk or batch on this machine (the rounding within an instruction
 * is the hardware's, as in bf16_matmul.c): the choice of path depends only on the machine, the
 * head_dim and the cache's format. */
#ifndef DEEPINFER_ATTENTION_BF16_H
#define DEEPINFER_ATTENTION_BF16_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define ATTENTION_BF16 1
#include <immintrin.h>

#include "amx.h" /* amx_status_once, for the VDPBF16PS path's self-check too */
#include "transpose16.h"

#define BF16_MAX_D 128        /* head dims of whole chunks up to this run on bf16 products */
#define BF16_KEYS PART_TOKENS /* keys of one part, at most */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define ATTENTION_AMX 1

#define TC0 0 /* numbers, not an enum: the intrinsics paste them into the instruction's text */
#define TC1 1 /* TC0..TC3: accumulators, 16 queries x 16 keys (S) or x 16 dims (O) */
#define TC2 2
#define TC3 3
#define TA 4  /* 16 queries x 32 dims (Q) or x 32 keys (P) */
#define TB0 5 /* 16 pairs of dims x 16 keys (K^T) or 16 pairs of keys x 16 dims (V) */
#define TB1 6
#else
#define ATTENTION_AMX 0
#endif

/* The part's buffers, on the stack of the thread that runs it. */
typedef struct {
    uint32_t kt[BF16_KEYS * BF16_MAX_D / 2] __attribute__((aligned(64))); /* [D/32][n16/16][16][16]: K^T pairs */
    uint32_t vp[BF16_KEYS / 2 * BF16_MAX_D] __attribute__((aligned(64))); /* [n32/2][D]: V's key pairs */
    uint16_t q[TILE_QUERIES * BF16_MAX_D] __attribute__((aligned(64)));  /* [blocks * 16][D]: the queries */
    float s[2][16 * BF16_KEYS] __attribute__((aligned(64)));             /* [16][BF16_KEYS]: S, two blocks */
    uint16_t p[16 * BF16_KEYS] __attribute__((aligned(64)));             /* [16][BF16_KEYS]: P in bf16 */
    float o[16 * BF16_MAX_D] __attribute__((aligned(64)));               /* [16][D]: O */
} bf16_part;

/* The part's K and V (keys first .. first+n-1 of the kv head at `column`, read where the block
 * table puts them) as the products' second operands: K^T's 16 x 16 blocks of dim pairs by keys, and
 * V's key pairs, each 32-bit lane two keys' values of one dim; zeros past n. */
static void stage_part(const int64_t D, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table,
                       int64_t first, int64_t n, int64_t column, int64_t slot_stride, int64_t block_size,
                       bf16_part *buf) {
    const int64_t n16 = (n + 15) & ~15, n32 = (n + 31) & ~31, key_blocks = n16 / 16;
    const uint16_t *k_rows[BF16_KEYS], *v_rows[BF16_KEYS];
    for (int64_t i = 0; i < n; ++i) {
        const int64_t position = first + i;
        const int64_t slot = table[position / block_size] * block_size + position % block_size;
        k_rows[i] = k_cache + slot * slot_stride + column;
        v_rows[i] = v_cache + slot * slot_stride + column;
        /* every line asked for at once (into L2, as paged_attention.c's prefetch_rows), so that
         * a decode row's part waits for memory once rather than row by row */
        for (int64_t at = 0; at < D; at += 32) {
            __builtin_prefetch(k_rows[i] + at, 0, 2);
            __builtin_prefetch(v_rows[i] + at, 0, 2);
        }
    }
    for (int64_t b = 0; b < key_blocks; ++b)
        for (int64_t c = 0; c < D / 32; ++c) { /* keys 16b.., dims 32c..: 16 keys x 16 pairs, transposed */
            __m512i w[16];
            for (int64_t i = 0; i < 16; ++i)
                w[i] = 16 * b + i < n ? _mm512_loadu_si512(k_rows[16 * b + i] + 32 * c) : _mm512_setzero_si512();
            transpose16(w);
            for (int p = 0; p < 16; ++p) _mm512_store_si512(buf->kt + ((c * key_blocks + b) * 16 + p) * 16, w[p]);
        }
    for (int64_t pair = 0; pair < n32 / 2; ++pair) {
        const int64_t a = 2 * pair, b = a + 1;
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            const __m512i even = a < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v_rows[a] + d0)))
                                       : _mm512_setzero_si512();
            const __m512i odd = b < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v_rows[b] + d0)))
                                      : _mm512_setzero_si512();
            _mm512_store_si512(buf->vp + pair * D + d0, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
        }
    }
}

#if ATTENTION_AMX
/* S for the 16 query rows at `q` against the part's n16 keys, into s: four key blocks at a time,
 * one accumulator tile each, so that the tile unit has four independent sums in flight. */
static void amx_scores(const int64_t D, int64_t n16, const uint16_t *q, float *s, const bf16_part *buf) {
    const int64_t key_blocks = n16 / 16;
    for (int64_t b = 0; b < key_blocks; b += 4) {
        const int64_t count = key_blocks - b < 4 ? key_blocks - b : 4;
        _tile_zero(TC0);
        _tile_zero(TC1);
        _tile_zero(TC2);
        _tile_zero(TC3);
        for (int64_t c = 0; c < D / 32; ++c) {
            const uint32_t *kt = buf->kt + (c * key_blocks + b) * 256;
            _tile_loadd(TA, q + 32 * c, D * sizeof(uint16_t));
            _tile_loadd(TB0, kt, 64);
            _tile_dpbf16ps(TC0, TA, TB0);
            if (count > 1) {
                _tile_loadd(TB1, kt + 256, 64);
                _tile_dpbf16ps(TC1, TA, TB1);
            }
            if (count > 2) {
                _tile_loadd(TB0, kt + 512, 64);
                _tile_dpbf16ps(TC2, TA, TB0);
            }
            if (count > 3) {
                _tile_loadd(TB1, kt + 768, 64);
                _tile_dpbf16ps(TC3, TA, TB1);
            }
        }
        const int64_t stride = BF16_KEYS * sizeof(float);
        _tile_stored(TC0, s + 16 * b, stride);
        if (count > 1) _tile_stored(TC1, s + 16 * (b + 1), stride);
        if (count > 2) _tile_stored(TC2, s + 16 * (b + 2), stride);
        if (count > 3) _tile_stored(TC3, s + 16 * (b + 3), stride);
    }
}

/* O for the 16 query rows of P (BF16_KEYS apart) against the part's n32 keys' values, into o
 * ([16][D]): 64 dims at a time, four accumulator tiles. */
static void amx_values(const int64_t D, int64_t n32, const uint16_t *p, float *o, const bf16_part *buf) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        _tile_zero(TC0);
        _tile_zero(TC1);
        _tile_zero(TC2);
        _tile_zero(TC3);
        for (int64_t k0 = 0; k0 < n32; k0 += 32) {
            const uint32_t *vp = buf->vp + k0 / 2 * D + d0;
            const int64_t stride = D * sizeof(uint32_t);
            _tile_loadd(TA, p + k0, BF16_KEYS * sizeof(uint16_t));
            _tile_loadd(TB0, vp, stride);
            _tile_dpbf16ps(TC0, TA, TB0);
            _tile_loadd(TB1, vp + 16, stride);
            _tile_dpbf16ps(TC1, TA, TB1);
            _tile_loadd(TB0, vp + 32, stride);
            _tile_dpbf16ps(TC2, TA, TB0);
            _tile_loadd(TB1, vp + 48, stride);
            _tile_dpbf16ps(TC3, TA, TB1);
        }
        const int64_t stride = D * sizeof(float);
        _tile_stored(TC0, o + d0, stride);
        _tile_stored(TC1, o + d0 + 16, stride);
        _tile_stored(TC2, o + d0 + 32, stride);
        _tile_stored(TC3, o + d0 + 48, stride);
    }
}
#endif

/* amx_scores on VDPBF16PS for the first `count` of the 16 query rows: a score is the sum of its
 * D/2 dim pairs' products in order, 16 keys per instruction (a lane of K^T's block times the
 * query's pair, broadcast). Two queries by four key blocks at a time: eight sums in flight, and
 * each K^T load serves two queries. */
static void dot_scores(const int64_t D, int64_t n16, int64_t count, const uint16_t *q, float *s,
                       const bf16_part *buf) {
    const int64_t key_blocks = n16 / 16;
    for (int64_t i = 0; i < count; i += 2) {
        const uint32_t *q0 = (const uint32_t *)(q + i * D), *q1 = (const uint32_t *)(q + (i + 1) * D);
        for (int64_t b = 0; b < key_blocks; b += 4) {
            const int64_t blocks = key_blocks - b < 4 ? key_blocks - b : 4;
            __m512 s0[4], s1[4];
            for (int k = 0; k < 4; ++k) s0[k] = s1[k] = _mm512_setzero_ps();
            for (int64_t c = 0; c < D / 32; ++c)
                for (int pair = 0; pair < 16; ++pair) {
                    const __m512bh a0 = (__m512bh)_mm512_set1_epi32((int)q0[16 * c + pair]);
                    const __m512bh a1 = (__m512bh)_mm512_set1_epi32((int)q1[16 * c + pair]);
                    const uint32_t *kt = buf->kt + ((c * key_blocks + b) * 16 + pair) * 16;
                    for (int k = 0; k < blocks; ++k) {
                        const __m512bh keys = (__m512bh)_mm512_load_si512(kt + 256 * k);
                        s0[k] = _mm512_dpbf16_ps(s0[k], a0, keys);
                        s1[k] = _mm512_dpbf16_ps(s1[k], a1, keys);
                    }
                }
            for (int k = 0; k < blocks; ++k) {
                _mm512_store_ps(s + i * BF16_KEYS + 16 * (b + k), s0[k]);
                _mm512_store_ps(s + (i + 1) * BF16_KEYS + 16 * (b + k), s1[k]);
            }
        }
    }
}

/* amx_values on VDPBF16PS for the first `count` query rows of P: an output element is the sum of
 * its n32/2 key pairs' products in order, 16 dims per instruction (a lane of V's pairs times the
 * query's pair of P, broadcast); two queries by 64 dims at a time, eight sums in flight. A pass
 * past `count` (an odd count) reads a zero row of P or a query row of the next block, harmlessly. */
static void dot_values(const int64_t D, int64_t n32, int64_t count, const uint16_t *p, float *o,
                       const bf16_part *buf) {
    for (int64_t i = 0; i < count; i += 2) {
        const uint32_t *p0 = (const uint32_t *)(p + i * BF16_KEYS);
        const uint32_t *p1 = (const uint32_t *)(p + (i + 1) * BF16_KEYS);
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            __m512 o0[4], o1[4];
            for (int k = 0; k < 4; ++k) o0[k] = o1[k] = _mm512_setzero_ps();
            for (int64_t pair = 0; pair < n32 / 2; ++pair) {
                const __m512bh a0 = (__m512bh)_mm512_set1_epi32((int)p0[pair]);
                const __m512bh a1 = (__m512bh)_mm512_set1_epi32((int)p1[pair]);
                const uint32_t *vp = buf->vp + pair * D + d0;
                for (int k = 0; k < 4; ++k) {
                    const __m512bh values = (__m512bh)_mm512_load_si512(vp + 16 * k);
                    o0[k] = _mm512_dpbf16_ps(o0[k], a0, values);
                    o1[k] = _mm512_dpbf16_ps(o1[k], a1, values);
                }
            }
            for (int k = 0; k < 4; ++k) {
                _mm512_store_ps(o + i * D + d0 + 16 * k, o0[k]);
                _mm512_store_ps(o + (i + 1) * D + d0 + 16 * k, o1[k]);
            }
        }
    }
}

/* Row i of the block's softmax over its first `visible` keys of s (n16 computed, n32 in P):
 * P's row in bf16 (zeros past visible), its max times the scale and its sum. P = 2^((s - top) *
 * scale * log2 e) = e^(s * scale - m) as 2^n * 2^f with n = floor, so that anything below 2^-150
 * is exactly +0. */
static inline void softmax_row_bf16(const float *s, int64_t visible, int64_t n32, float scale, uint16_t *p,
                                    float *m, float *l) {
    __m512 top = _mm512_set1_ps(-FLT_MAX);
    for (int64_t j = 0; j < visible; j += 16) {
        const __mmask16 seen = visible - j >= 16 ? 0xffff : (__mmask16)((1u << (visible - j)) - 1);
        top = _mm512_mask_max_ps(top, seen, top, _mm512_load_ps(s + j));
    }
    const float top1 = _mm512_reduce_max_ps(top);
    const __m512 log2_scale = _mm512_set1_ps(scale * 1.44269504088896341f);
    const __m512 shift = _mm512_set1_ps(top1 * (scale * 1.44269504088896341f));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n32; j += 32) {
        __m512 e[2];
        for (int h = 0; h < 2; ++h) {
            const int64_t at = j + 16 * h;
            if (at >= visible) {
                e[h] = _mm512_setzero_ps();
                continue;
            }
            const __mmask16 seen = visible - at >= 16 ? 0xffff : (__mmask16)((1u << (visible - at)) - 1);
            const __m512 t =
                _mm512_max_ps(_mm512_fmsub_ps(_mm512_load_ps(s + at), log2_scale, shift), _mm512_set1_ps(-160.0f));
            const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
            const __m512 f = _mm512_sub_ps(t, whole);
            e[h] = _mm512_maskz_scalef_ps(seen, EXP2_OF_FRACTION_FUSED(f, _mm512_fmadd_ps, _mm512_set1_ps), whole);
            sum = _mm512_add_ps(sum, e[h]);
        }
        _mm512_store_si512((__m512i *)(p + j), (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    }
    *m = top1 * scale;
    *l = _mm512_reduce_add_ps(sum);
}

/* One part for the tile's rows (R rows of `group` query heads of one kv head, row r's head g at
 * q + r * q_stride + g * D; row r attends to keys first .. lasts[r]-1, lasts nondecreasing,
 * through `table`): each (row, head)'s softmax state for the part (max m, sum l, unnormalized
 * output acc at [(r * group + g) * D]), as attend_span leaves it. On AMX tiles if `tiles`, else
 * on VDPBF16PS. */
static __attribute__((noinline)) void bf16_attend(const int64_t D, int64_t R, int64_t group, const float *q,
                                                  int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                                                  const int64_t *table, int64_t first, const int64_t *lasts,
                                                  int64_t column, int64_t slot_stride, int64_t block_size, float scale,
                                                  float *m, float *l, float *acc, int tiles) {
    bf16_part buf;
    const int64_t n = lasts[R - 1] - first, n16 = (n + 15) & ~15, n32 = (n + 31) & ~31;
#if ATTENTION_AMX
    if (tiles) {
        tile_config config = {.palette = 1};
        for (int t = TC0; t <= TB1; ++t) {
            config.colsb[t] = 64;
            config.rows[t] = 16;
        }
        _tile_loadconfig(&config);
    }
#endif
    stage_part(D, k_cache, v_cache, table, first, n, column, slot_stride, block_size, &buf);
    const int64_t queries = R * group, blocks = (queries + 15) / 16;
    for (int64_t i = 0; i < blocks * 16; ++i) /* every query in bf16, zeros past the last */
        for (int64_t d = 0; d < D; d += 32) {
            const float *row = q + i / group * q_stride + i % group * D + d;
            const __m512bh pair = i < queries ? _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row))
                                              : (__m512bh)_mm512_setzero_si512();
            _mm512_store_si512((__m512i *)(buf.q + i * D + d), (__m512i)pair);
        }
    /* On tiles, block b's scores are issued before block b-1's values: tile loads wait for the
     * vector stores they read to reach the cache (no forwarding), and the scores' tile work
     * covers the wait on P's stores. */
#if ATTENTION_AMX
    if (tiles) amx_scores(D, n16, buf.q, buf.s[0], &buf);
#endif
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t q0 = 16 * b, count = queries - q0 < 16 ? queries - q0 : 16;
        const float *s = buf.s[b % 2];
        if (!tiles) dot_scores(D, n16, count, buf.q + q0 * D, buf.s[b % 2], &buf);
        for (int64_t i = 0; i < count; ++i)
            softmax_row_bf16(s + i * BF16_KEYS, lasts[(q0 + i) / group] - first, n32, scale, buf.p + i * BF16_KEYS,
                             m + q0 + i, l + q0 + i);
        if (count < 16) memset(buf.p + count * BF16_KEYS, 0, (16 - count) * BF16_KEYS * sizeof(uint16_t));
#if ATTENTION_AMX
        if (tiles) {
            if (b + 1 < blocks) amx_scores(D, n16, buf.q + (q0 + 16) * D, buf.s[(b + 1) % 2], &buf);
            amx_values(D, n32, buf.p, buf.o, &buf);
        }
#endif
        if (!tiles) dot_values(D, n32, count, buf.p, buf.o, &buf);
        memcpy(acc + q0 * D, buf.o, count * D * sizeof(float));
    }
#if ATTENTION_AMX
    if (tiles) _tile_release();
#endif
}
#endif
#endif
