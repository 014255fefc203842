/* Matrix products with bf16 weights and bf16 activations, for CPUs: y = bf16(x W^T + b).
 *
 * Exact-weight models (a bf16 checkpoint run in bf16 on a CPU with AVX512-BF16 or AMX) used
 * torch's bf16 GEMM, whose result for one row depends on how many rows came with it (oneDNN
 * blocks K differently for large products) and whose one-row GEMV is no faster than fp32's on
 * small matrices. Here every output is one fixed sum, whatever the batch, the tiling or the
 * threads, and the weights stream once per step at batch 1.
 *
 * Weights are packed once (bf16_matmul.py's `pack`) in panels of 16 outputs: panel p holds, for
 * each pair of inputs (2q, 2q + 1), the 16 outputs' two weights side by side:
 *     packed[p][q][c][e] = W[16p + c][2q + e]      (zeros past N and past K)
 * so one 512-bit load is 16 outputs x one input pair, the operand VDPBF16PS takes against the
 * broadcast input pair of an activation row; each output's sum stays in its own vector lane.
 *
 * Numerics, for output (m, n): one fp32 sum starting at +0, over the input pairs in order,
 *     acc += x[2q + 1] * W[n][2q + 1]
 *     acc += x[2q]     * W[n][2q]
 * (each product of two bf16 values is exact in fp32, so each step rounds once; this is what
 * VDPBF16PS does per lane, save that the instruction flushes values below 2^-126 to zero, which
 * products and sums of a network's weights and activations do not come near), an odd K's last
 * pair completed with a zero; then y = bf16 round-to-nearest-even of (acc + b[n]) (of acc without
 * a bias). The AVX512-BF16 build and the portable build give the same bits
 * (tests/kernels/test_bf16_matmul.py); the file is built with -ffp-contract=off so the portable
 * sums are not fused.
 */
#include <stdint.h>
#include <string.h>

#define PANEL 16   /* outputs per panel: one fp32 lane each */
#define MR 6       /* activation rows per tile */
#define NP 4       /* panels per tile */
#define X_BLOCK_BYTES (384 << 10) /* activation rows kept in L2 while every panel streams past them */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BF16_SIMD 1
#else
#define BF16_SIMD 0
#endif

static inline float from_bf16(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN, quiet */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* The input pair q of a row as one 32-bit word (low half: the even input), an odd K's last
 * pair completed with a zero. */
static inline uint32_t input_pair(const uint16_t *row, int64_t q, int64_t k) {
    const uint32_t even = row[2 * q], odd = 2 * q + 1 < k ? row[2 * q + 1] : 0;
    return even | (odd << 16);
}

/* y[i][16 j + c] for rows x[0..rows) and panels w[0..panels) (rows, panels constants after
 * inlining): the sums of the header, then bias and rounding; outputs past n are not written. */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t ldx, int rows,
                                                       const uint16_t *w, int64_t panel_stride, int panels,
                                                       int64_t n0, int64_t n, int64_t k, const float *bias,
                                                       uint16_t *y, int64_t ldy) {
    const int64_t pairs = (k + 1) / 2, full = k / 2;
    float sums[MR][NP * PANEL];
#if BF16_SIMD
    __m512 acc[MR][NP];
    for (int i = 0; i < rows; ++i)
        for (int j = 0; j < panels; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t q = 0; q < pairs; ++q) {
        __m512bh wv[NP];
        for (int j = 0; j < panels; ++j)
            wv[j] = (__m512bh)_mm512_loadu_si512(w + j * panel_stride + q * 2 * PANEL);
        for (int i = 0; i < rows; ++i) {
            int32_t pair;
            if (q < full) memcpy(&pair, x + i * ldx + 2 * q, sizeof pair);
            else pair = (int32_t)input_pair(x + i * ldx, q, k);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < panels; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < rows; ++i)
        for (int j = 0; j < panels; ++j) _mm512_storeu_ps(sums[i] + j * PANEL, acc[i][j]);
#else
    for (int i = 0; i < rows; ++i)
        for (int j = 0; j < panels; ++j)
            for (int c = 0; c < PANEL; ++c) {
                const uint16_t *panel = w + j * panel_stride + 2 * c;
                float acc = 0.0f;
                for (int64_t q = 0; q < pairs; ++q) {
                    const uint32_t pair = input_pair(x + i * ldx, q, k);
                    acc += from_bf16((uint16_t)(pair >> 16)) * from_bf16(panel[q * 2 * PANEL + 1]);
                    acc += from_bf16((uint16_t)pair) * from_bf16(panel[q * 2 * PANEL]);
                }
                sums[i][j * PANEL + c] = acc;
            }
#endif
    const int64_t width = n - n0 < panels * PANEL ? n - n0 : panels * PANEL;
    for (int i = 0; i < rows; ++i)
        for (int64_t c = 0; c < width; ++c)
            y[i * ldy + n0 + c] = to_bf16(bias ? sums[i][c] + bias[n0 + c] : sums[i][c]);
}

/* One tile with its row and panel counts as constants, so its sums stay in registers. */
static void tile_dispatch(const uint16_t *x, int64_t ldx, int rows, const uint16_t *w, int64_t panel_stride,
                          int panels, int64_t n0, int64_t n, int64_t k, const float *bias, uint16_t *y,
                          int64_t ldy) {
#define TILE(R, P) tile(x, ldx, R, w, panel_stride, P, n0, n, k, bias, y, ldy)
#define ROWS(P)                                                                                                        \
    switch (rows) {                                                                                                    \
    case 6: TILE(6, P); break;                                                                                         \
    case 5: TILE(5, P); break;                                                                                         \
    case 4: TILE(4, P); break;                                                                                         \
    case 3: TILE(3, P); break;                                                                                         \
    case 2: TILE(2, P); break;                                                                                         \
    default: TILE(1, P); break;                                                                                        \
    }
    switch (panels) {
    case 4: ROWS(4); break;
    case 3: ROWS(3); break;
    case 2: ROWS(2); break;
    default: ROWS(1); break;
    }
#undef ROWS
#undef TILE
}

/* y[m, n] = bf16(x[m, :] . W[n, :] + bias[n]): x [m, k] with row stride ldx, W packed as in the
 * header, bias fp32 [n] or NULL, y [m, n] with row stride ldy. Threads split the panels; which
 * thread computes an output never changes how. At one or two rows a tile takes two panels, so
 * the narrow matrices of a decode step still split evenly over the threads. */
void bf16_linear(const uint16_t *x, int64_t ldx, const uint16_t *packed, const float *bias, uint16_t *y,
                 int64_t ldy, int64_t m, int64_t n, int64_t k) {
    const int64_t panel_stride = (k + 1) / 2 * 2 * PANEL, panels = (n + PANEL - 1) / PANEL;
    const int per_tile = m <= 2 ? 2 : NP;
    const int64_t tiles = (panels + per_tile - 1) / per_tile;
    /* As many rows as L2 keeps beside a panel, so the weights stream from memory once per block. */
    const int64_t block = X_BLOCK_BYTES / (2 * k) / MR * MR > MR ? X_BLOCK_BYTES / (2 * k) / MR * MR : MR;
#pragma omp parallel if (m * n * k > 65536)
    for (int64_t m0 = 0; m0 < m; m0 += block) {
        const int64_t m1 = m0 + block < m ? m0 + block : m;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t p0 = t * per_tile;
            const int count = (int)(panels - p0 < per_tile ? panels - p0 : per_tile);
            for (int64_t i0 = m0; i0 < m1; i0 += MR) {
                const int rows = (int)(m1 - i0 < MR ? m1 - i0 : MR);
                tile_dispatch(x + i0 * ldx, ldx, rows, packed + p0 * panel_stride, panel_stride, count,
                              p0 * PANEL, n, k, bias, y + i0 * ldy, ldy);
            }
        }
    }
}
