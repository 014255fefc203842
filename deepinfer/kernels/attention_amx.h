/* One part of a row tile's attention on AMX bf16 tiles, for a bf16 KV cache (included by
 * paged_attention.c, which splits the work into parts and merges them).
 *
 * The fp32 path spends ~8 cycles of FMAs per (query head, key) pair at head_dim 64: 80% of an
 * 8k-token prefill on the Intel Xeon with AMX. On tiles, one TDPBF16PS does 16 x 16 x 32
 * multiply-adds, so the products cost ~0.25 cycle per pair and the softmax's exponentials are
 * what is left. A part (at most PART_TOKENS keys of one kv head) is done in one softmax step:
 *   S^T [keys, queries] = K Q^T          A: the part's K rows as stored (gathered from the block
 *                                           table), B: the queries' pairs of dims, transposed once
 *   m = max over keys, P = e^(S - m) (0 where masked), l = sum of P over keys, in key order
 *   O^T [dims, queries] = V^T P^T         A: V transposed once per part for every query block,
 *                                           B: P's pairs of keys, which S^T's layout gives cheaply
 * with the scores scaled after the sums (q stays as the model rounded it). Query rows are the
 * tile's (row, head) pairs, 16 per block.
 *
 * Numerics, per query row: q rounded to bf16 (exact for a bf16 model's q), each score the tile's
 * fp32 sum of D/32 chunk products in order, times the scale; P rounded to bf16 for the values'
 * product (as a bf16 GPU kernel does), each output element the tile's sum over chunks of 32 keys
 * in order; l sums P in fp32. Every element depends only on its own query row and the keys, and a
 * masked key adds an exact zero, so a row's bits are the same alone, in any tile, chunk or batch
 * on this machine (TDPBF16PS's rounding within a chunk is the hardware's, as in bf16_matmul.c):
 * the choice of this path depends only on the machine, the head_dim and the cache's format. */
#ifndef DEEPINFER_ATTENTION_AMX_H
#define DEEPINFER_ATTENTION_AMX_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__) && defined(__linux__)
#define ATTENTION_AMX 1
#include <immintrin.h>

#include "amx.h"

#define AMX_MAX_D 128          /* head dims of whole chunks up to this run on tiles */
#define AMX_KEYS PART_TOKENS   /* keys of one part, at most */
#define TO0 0 /* numbers, not an enum: the intrinsics paste them into the instruction's text */
#define TO1 1 /* TO0..TO3: accumulators, S^T (16 keys x 16 queries) or O^T (16 dims x 16 queries) */
#define TO2 2
#define TO3 3
#define TA 4 /* 16 keys x 32 dims (scores), or 16 dims x 32 keys (values) */
#define TB 5 /* 16 pairs of dims x 16 queries (scores), or 16 pairs of keys x 16 queries (values) */
#define TS 6 /* a second A tile: 16 keys x 32 dims */

/* 16 rows of 16 32-bit lanes transposed in place: r[i] lane j becomes r[j] lane i. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) { /* r[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i+3 */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
        const __m512i x = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), y = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
        const __m512i z = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        const __m512i w = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
        t[c] = _mm512_shuffle_i32x4(x, z, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(x, z, 0xdd);
        t[8 + c] = _mm512_shuffle_i32x4(y, w, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(y, w, 0xdd);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

/* The part's buffers, on the stack of the thread that runs it. */
typedef struct {
    uint16_t k[AMX_KEYS * AMX_MAX_D] __attribute__((aligned(64)));  /* [n16][D]: K rows, zeros past n */
    uint16_t vt[AMX_MAX_D * AMX_KEYS] __attribute__((aligned(64))); /* [D][n32]: V^T, zeros past n */
    uint32_t qt[AMX_MAX_D / 2 * 16] __attribute__((aligned(64)));  /* [D/2][16]: query dim pairs */
    float s[AMX_KEYS * 16] __attribute__((aligned(64)));           /* [n32][16]: S^T, then P^T */
    uint32_t pt[AMX_KEYS / 2 * 16] __attribute__((aligned(64)));   /* [n32/2][16]: P's key pairs */
    float ot[AMX_MAX_D * 16] __attribute__((aligned(64)));         /* [D][16]: O^T */
} amx_part;

/* The part's V rows, transposed, into buf->vt, and (unless `direct`) its K rows into buf->k: keys
 * first .. first+n-1 of the kv head at `column`, read where the block table puts them. */
static void amx_stage(const int64_t D, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table,
                      int64_t first, int64_t n, int64_t column, int64_t slot_stride, int64_t block_size, int direct,
                      amx_part *buf) {
    const int64_t n16 = (n + 15) & ~15, n32 = (n + 31) & ~31;
    const uint16_t *v_rows[AMX_KEYS];
    for (int64_t i = 0; i < n; ++i) {
        const int64_t position = first + i;
        const int64_t slot = table[position / block_size] * block_size + position % block_size;
        if (!direct) memcpy(buf->k + i * D, k_cache + slot * slot_stride + column, D * sizeof(uint16_t));
        v_rows[i] = v_cache + slot * slot_stride + column;
    }
    if (!direct) memset(buf->k + n * D, 0, (n16 - n) * D * sizeof(uint16_t));
    /* 32 keys by 16 dims at a time: key pairs' values side by side in 32-bit lanes, then those
     * 16 x 16 lanes transposed: row d of the block is then keys 0..31's values of dim d in order. */
    for (int64_t k0 = 0; k0 < n32; k0 += 32)
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512i w[16];
            for (int p = 0; p < 16; ++p) {
                const int64_t a = k0 + 2 * p, b = a + 1;
                const __m512i even = a < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v_rows[a] + d0)))
                                           : _mm512_setzero_si512();
                const __m512i odd = b < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v_rows[b] + d0)))
                                          : _mm512_setzero_si512();
                w[p] = _mm512_or_si512(even, _mm512_slli_epi32(odd, 16));
            }
            transpose16(w);
            for (int d = 0; d < 16; ++d) _mm512_store_si512((__m512i *)(buf->vt + (d0 + d) * n32 + k0), w[d]);
        }
}

/* Queries rows q0 .. q0+count-1 of the tile (row r's head g at q + r * q_stride + g * D) as
 * buf->qt: rounded to bf16 (round to nearest even), dims in pairs, transposed so that row p of
 * chunk c holds pair 16c + p of every query (zeros past count). */
static void amx_queries(const int64_t D, const float *q, int64_t q_stride, int64_t group, int64_t q0, int64_t count,
                        amx_part *buf) {
    for (int64_t c = 0; c < D / 32; ++c) {
        __m512i w[16];
        for (int64_t i = 0; i < 16; ++i) {
            if (i >= count) {
                w[i] = _mm512_setzero_si512();
                continue;
            }
            const float *row = q + (q0 + i) / group * q_stride + (q0 + i) % group * D + 32 * c;
            w[i] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row));
        }
        transpose16(w);
        for (int p = 0; p < 16; ++p) _mm512_store_si512((__m512i *)(buf->qt + (16 * c + p) * 16), w[p]);
    }
}

/* S^T for the part's keys (n16, whole blocks of 16) against the query block in buf->qt, into
 * buf->s [n16][16]: four key blocks at a time, one accumulator tile each, so that the tile unit
 * has four independent sums in flight; the queries' chunk loaded once for the four. */
static void amx_scores(const int64_t D, const uint16_t *k_cache, const int64_t *table, int64_t first, int64_t n16,
                       int64_t column, int64_t slot_stride, int64_t block_size, int direct, amx_part *buf) {
    const int64_t stride = (direct ? slot_stride : D) * (int64_t)sizeof(uint16_t);
    for (int64_t k0 = 0; k0 < n16; k0 += 64) {
        const int64_t blocks = (n16 - k0) / 16 < 4 ? (n16 - k0) / 16 : 4;
        const uint16_t *rows[4];
        for (int64_t j = 0; j < blocks; ++j) {
            const int64_t position = first + k0 + 16 * j;
            rows[j] = direct ? k_cache + (table[position / block_size] * block_size + position % block_size) * slot_stride +
                                   column
                             : buf->k + (k0 + 16 * j) * D;
        }
        _tile_zero(TO0);
        _tile_zero(TO1);
        _tile_zero(TO2);
        _tile_zero(TO3);
        for (int64_t c = 0; c < D / 32; ++c) {
            _tile_loadd(TB, buf->qt + 16 * c * 16, 64);
            _tile_loadd(TA, rows[0] + 32 * c, stride);
            _tile_dpbf16ps(TO0, TA, TB);
            if (blocks > 1) {
                _tile_loadd(TS, rows[1] + 32 * c, stride);
                _tile_dpbf16ps(TO1, TS, TB);
            }
            if (blocks > 2) {
                _tile_loadd(TA, rows[2] + 32 * c, stride);
                _tile_dpbf16ps(TO2, TA, TB);
            }
            if (blocks > 3) {
                _tile_loadd(TS, rows[3] + 32 * c, stride);
                _tile_dpbf16ps(TO3, TS, TB);
            }
        }
        _tile_stored(TO0, buf->s + k0 * 16, 64);
        if (blocks > 1) _tile_stored(TO1, buf->s + (k0 + 16) * 16, 64);
        if (blocks > 2) _tile_stored(TO2, buf->s + (k0 + 32) * 16, 64);
        if (blocks > 3) _tile_stored(TO3, buf->s + (k0 + 48) * 16, 64);
    }
}

/* One part for the tile's rows (R rows of `group` query heads of one kv head; row r attends to
 * keys first .. lasts[r]-1, lasts nondecreasing, through `table`): row r head g's softmax state
 * (max m, sum l, unnormalized output acc), as attend_span leaves it for the part. */
static __attribute__((noinline)) void amx_attend(const int64_t D, int64_t R, int64_t group, const float *q, int64_t q_stride,
                       const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table, int64_t first,
                       const int64_t *lasts, int64_t column, int64_t slot_stride, int64_t block_size, float scale,
                       float *m, float *l, float *acc) {
    amx_part buf;
    const int64_t n = lasts[R - 1] - first, n16 = (n + 15) & ~15, n32 = (n + 31) & ~31;
    /* Where every 16 keys from `first` lie in one block, the score tiles load K from the cache
     * itself (slot_stride apart); rows past a row's last are masked whatever they hold. */
    const int direct = block_size % 16 == 0 && first % 16 == 0;
    tile_config config = {.palette = 1};
    for (int t = TO0; t <= TS; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
    amx_stage(D, k_cache, v_cache, table, first, n, column, slot_stride, block_size, direct, &buf);
    /* P^T's pairs of keys interleaved: key 2p's 16 queries and key 2p+1's, as [a0 b0 a1 b1 ..] */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t q0 = 0; q0 < R * group; q0 += 16) {
        const int64_t count = R * group - q0 < 16 ? R * group - q0 : 16;
        amx_queries(D, q, q_stride, group, q0, count, &buf);
        amx_scores(D, k_cache, table, first, n16, column, slot_stride, block_size, direct, &buf);
        /* The softmax, 16 queries per vector: each lane its own query's keys. Keys below every
         * lane's count need no mask; padding lanes (zero queries) count as seeing every key. */
        int32_t keys[16];
        int64_t unmasked = n;
        for (int64_t i = 0; i < 16; ++i) {
            keys[i] = i < count ? (int32_t)(lasts[(q0 + i) / group] - first) : (int32_t)n;
            unmasked = keys[i] < unmasked ? keys[i] : unmasked;
        }
        const __m512i visible = _mm512_loadu_si512(keys);
        __m512 top = _mm512_set1_ps(-FLT_MAX);
        for (int64_t i = 0; i < unmasked; ++i) top = _mm512_max_ps(top, _mm512_load_ps(buf.s + i * 16));
        for (int64_t i = unmasked; i < n16; ++i) {
            const __mmask16 seen = _mm512_cmpgt_epi32_mask(visible, _mm512_set1_epi32((int32_t)i));
            const __m512 x = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), _mm512_load_ps(buf.s + i * 16));
            _mm512_store_ps(buf.s + i * 16, x);
            top = _mm512_max_ps(top, x);
        }
        /* P = 2^((s - top) * scale * log2 e) = e^(s * scale - m), m = top * scale: 2^n * 2^f with
         * n = floor, so that a masked key (-inf) and anything below 2^-150 is exactly +0. */
        const __m512 log2_scale = _mm512_set1_ps(scale * 1.44269504088896341f);
        const __m512 shift = _mm512_mul_ps(top, log2_scale);
        __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t i = 0; i < n32; i += 2) {
            __m512 p[2];
            for (int e = 0; e < 2; ++e) {
                if (i + e >= n16) {
                    p[e] = _mm512_setzero_ps();
                    continue;
                }
                const __m512 t = _mm512_max_ps(_mm512_fmsub_ps(_mm512_load_ps(buf.s + (i + e) * 16), log2_scale, shift),
                                               _mm512_set1_ps(-160.0f));
                const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
                const __m512 f = _mm512_sub_ps(t, whole);
                p[e] = _mm512_scalef_ps(EXP2_OF_FRACTION(f), whole);
                sums[e] = _mm512_add_ps(sums[e], p[e]);
            }
            const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]);
            _mm512_store_si512((__m512i *)(buf.pt + i / 2 * 16), _mm512_permutexvar_epi16(interleave, pair));
        }
        const __m512 sum = _mm512_add_ps(sums[0], sums[1]);
        top = _mm512_mul_ps(top, _mm512_set1_ps(scale));
        /* O^T, 64 dims at a time (four accumulator tiles). */
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            _tile_zero(TO0);
            _tile_zero(TO1);
            _tile_zero(TO2);
            _tile_zero(TO3);
            for (int64_t k0 = 0; k0 < n32; k0 += 32) {
                _tile_loadd(TB, buf.pt + k0 / 2 * 16, 64);
                const uint16_t *vt = buf.vt + d0 * n32 + k0;
                const int64_t stride = n32 * sizeof(uint16_t);
                _tile_loadd(TA, vt, stride);
                _tile_dpbf16ps(TO0, TA, TB);
                _tile_loadd(TA, vt + 16 * n32, stride);
                _tile_dpbf16ps(TO1, TA, TB);
                _tile_loadd(TA, vt + 32 * n32, stride);
                _tile_dpbf16ps(TO2, TA, TB);
                _tile_loadd(TA, vt + 48 * n32, stride);
                _tile_dpbf16ps(TO3, TA, TB);
            }
            _tile_stored(TO0, buf.ot + d0 * 16, 64);
            _tile_stored(TO1, buf.ot + (d0 + 16) * 16, 64);
            _tile_stored(TO2, buf.ot + (d0 + 32) * 16, 64);
            _tile_stored(TO3, buf.ot + (d0 + 48) * 16, 64);
        }
        float top_lanes[16], sum_lanes[16];
        _mm512_storeu_ps(top_lanes, top);
        _mm512_storeu_ps(sum_lanes, sum);
        for (int64_t d0 = 0; d0 < D; d0 += 16) { /* O^T's 16 x 16 blocks back to rows of queries */
            __m512i w[16];
            for (int d = 0; d < 16; ++d) w[d] = _mm512_load_si512((const __m512i *)(buf.ot + (d0 + d) * 16));
            transpose16(w);
            for (int64_t i = 0; i < count; ++i) _mm512_storeu_si512((__m512i *)(acc + (q0 + i) * D + d0), w[i]);
        }
        for (int64_t i = 0; i < count; ++i) {
            m[q0 + i] = top_lanes[i];
            l[q0 + i] = sum_lanes[i];
        }
    }
    _tile_release();
}
#endif
#endif
