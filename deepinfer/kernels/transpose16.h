/* A 16 x 16 transpose of 32-bit lanes on AVX-512 registers, shared by paged_attention.c (a block's
 * fp32 keys side by side for a row tile's scores) and attention_bf16.h (K^T's bf16 pairs for the
 * tiles). */
#ifndef DEEPINFER_TRANSPOSE16_H
#define DEEPINFER_TRANSPOSE16_H

#ifdef __AVX512F__
#include <immintrin.h>

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
#endif

#endif
