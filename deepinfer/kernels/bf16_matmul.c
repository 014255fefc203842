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
 * sums are not fused. On a CPU with AMX, products whose K is a multiple of 32 run on bf16 tiles
 * instead, whose sums are the hardware's own (the AMX section below).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rowops.h" /* from_bf16, to_bf16 */

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

/* The VDPBF16PS path (the portable C where the build has no AVX512-BF16): the header's sums.
 * Threads split the panels; which thread computes an output never changes how. At one or two
 * rows a tile takes two panels, so the narrow matrices of a decode step still split evenly over
 * the threads. */
static void vector_linear_team(const uint16_t *x, int64_t ldx, const uint16_t *packed, const float *bias,
                               uint16_t *y, int64_t ldy, int64_t m, int64_t n, int64_t k) {
    const int64_t panel_stride = (k + 1) / 2 * 2 * PANEL, panels = (n + PANEL - 1) / PANEL;
    const int per_tile = m <= 2 ? 2 : NP;
    const int64_t tiles = (panels + per_tile - 1) / per_tile;
    /* As many rows as L2 keeps beside a panel, so the weights stream from memory once per block. */
    const int64_t block = X_BLOCK_BYTES / (2 * k) / MR * MR > MR ? X_BLOCK_BYTES / (2 * k) / MR * MR : MR;
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

static void vector_linear(const uint16_t *x, int64_t ldx, const uint16_t *packed, const float *bias, uint16_t *y,
                          int64_t ldy, int64_t m, int64_t n, int64_t k) {
#pragma omp parallel if (m * n * k > 65536)
    vector_linear_team(x, ldx, packed, bias, y, ldy, m, n, k);
}

/* ---------------------------------------------------------------- AMX bf16 tiles */

/* Where the CPU has AMX (Intel Xeon from Sapphire Rapids on), one TDPBF16PS multiplies 16
 * activation rows by 32 inputs of 16 outputs, the work of 32 VDPBF16PS. A panel's 16 input pairs
 * are already the instruction's second operand (16 rows of 64 bytes: pair q, the 16 outputs' two
 * weights side by side), so weights are loaded from the packing as they are.
 *
 * Numerics, for output (m, n), on a machine whose tiles pass amx_self_check: one fp32 tile
 * accumulator starting at +0, to which each chunk of 32 inputs (in order) adds its 32 products
 * the way the tile hardware does (Intel does not specify the rounding of the chunk's sum, and
 * measured on a Sapphire Rapids-class Xeon it is not the VDPBF16PS order, nor one rounding of the
 * exact sum: up to a few units of the last place apart where terms cancel); then
 * y = bf16 round-to-nearest-even of (acc + b[n]) by VCVTNEPS2BF16 (which also flushes values below
 * 2^-126 to zero). A row's sums do not depend on the rows beside it, the row tile's height, the
 * tiling or the threads, so a row's bits are the same in any batch on this machine; they are not
 * the VDPBF16PS path's bits. The choice of path depends only on the machine and the weight
 * (K a multiple of 32), never on the row count, so that invariance holds across batches. */
#if BF16_SIMD && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define BF16_AMX 1
#include "amx.h"

#define TILE_C00 0 /* numbers, not an enum: the intrinsics paste them into the instruction's text */
#define TILE_C01 1 /* C[row tile][panel]: 16 rows x 16 outputs of fp32 sums */
#define TILE_C10 2
#define TILE_C11 3
#define TILE_A0 4 /* 16 activation rows x 32 inputs */
#define TILE_A1 5
#define TILE_B0 6 /* one panel's 16 input pairs */
#define TILE_B1 7
#define CHUNK 32  /* inputs per TDPBF16PS */
#define AMX_ROWS 32 /* rows per block: two row tiles */

/* The sums of `rows` x 16 `panels` outputs (rows, panels in {1, 2}: row tiles and panels, as
 * constants after inlining) over `chunks` chunks of 32 inputs into out[r][16 j + c]. */
static inline __attribute__((always_inline)) void amx_block(const uint16_t *x, int64_t ldx, int rows,
                                                           const uint16_t *w, int64_t panel_stride, int panels,
                                                           int64_t chunks, float out[AMX_ROWS][2 * PANEL]) {
    _tile_zero(TILE_C00);
    if (panels == 2) _tile_zero(TILE_C01);
    if (rows == 2) _tile_zero(TILE_C10);
    if (rows == 2 && panels == 2) _tile_zero(TILE_C11);
    for (int64_t q = 0; q < chunks; ++q) {
        _tile_loadd(TILE_A0, x + q * CHUNK, 2 * ldx);
        _tile_loadd(TILE_B0, w + q * CHUNK * PANEL, 4 * PANEL);
        _tile_dpbf16ps(TILE_C00, TILE_A0, TILE_B0);
        if (panels == 2) {
            _tile_loadd(TILE_B1, w + panel_stride + q * CHUNK * PANEL, 4 * PANEL);
            _tile_dpbf16ps(TILE_C01, TILE_A0, TILE_B1);
        }
        if (rows == 2) {
            _tile_loadd(TILE_A1, x + 16 * ldx + q * CHUNK, 2 * ldx);
            _tile_dpbf16ps(TILE_C10, TILE_A1, TILE_B0);
            if (panels == 2) _tile_dpbf16ps(TILE_C11, TILE_A1, TILE_B1);
        }
    }
    _tile_stored(TILE_C00, out[0], sizeof out[0]);
    if (panels == 2) _tile_stored(TILE_C01, out[0] + PANEL, sizeof out[0]);
    if (rows == 2) _tile_stored(TILE_C10, out[16], sizeof out[0]);
    if (rows == 2 && panels == 2) _tile_stored(TILE_C11, out[16] + PANEL, sizeof out[0]);
}

static void amx_block_dispatch(const uint16_t *x, int64_t ldx, int rows, const uint16_t *w, int64_t panel_stride,
                               int panels, int64_t chunks, float out[AMX_ROWS][2 * PANEL]) {
    if (rows == 2 && panels == 2) amx_block(x, ldx, 2, w, panel_stride, 2, chunks, out);
    else if (rows == 2) amx_block(x, ldx, 2, w, panel_stride, 1, chunks, out);
    else if (panels == 2) amx_block(x, ldx, 1, w, panel_stride, 2, chunks, out);
    else amx_block(x, ldx, 1, w, panel_stride, 1, chunks, out);
}

/* y[r][n0 + c] = bf16(out[r][c] + bias[n0 + c]) for r < rows, c < width (at most 32). */
static void amx_write(const float out[AMX_ROWS][2 * PANEL], int64_t rows, int64_t width, const float *bias,
                      int64_t n0, uint16_t *y, int64_t ldy) {
    for (int h = 0; h < 2 && 16 * h < width; ++h) {
        const int64_t lanes = width - 16 * h < 16 ? width - 16 * h : 16;
        const __mmask16 mask = (__mmask16)((1u << lanes) - 1u);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0 + 16 * h) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; ++r) {
            const __m512 v = _mm512_load_ps(out[r] + 16 * h);
            const __m256bh rounded = _mm512_cvtneps_pbh(bias ? _mm512_add_ps(v, b) : v);
            _mm256_mask_storeu_epi16(y + r * ldy + n0 + 16 * h, mask, (__m256i)rounded);
        }
    }
}

/* amx_linear's work, run by every thread of the enclosing parallel region together: `padded`
 * holds the rows past the last whole block of 32, zero-padded to 32 (NULL when there are none,
 * or 16 rows at most). Threads split pairs of panels; returns once y is complete. */
static void amx_linear_team(const uint16_t *x, int64_t ldx, const uint16_t *packed, const float *bias, uint16_t *y,
                            int64_t ldy, int64_t m, int64_t n, int64_t k, const uint16_t *padded) {
    const int64_t panel_stride = k * PANEL, panels = (n + PANEL - 1) / PANEL, pairs = (panels + 1) / 2;
    const int64_t chunks = k / CHUNK, height = m < 16 ? m : 16;
    tile_config config = {.palette = 1};
    for (int t = TILE_C00; t <= TILE_B1; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = (uint8_t)(t >= TILE_B0 ? 16 : height);
    }
    const int64_t per_block = X_BLOCK_BYTES / (2 * k) / AMX_ROWS * AMX_ROWS;
    const int64_t block = per_block > AMX_ROWS ? per_block : AMX_ROWS;
    float out[AMX_ROWS][2 * PANEL] __attribute__((aligned(64)));
    _tile_loadconfig(&config);
    for (int64_t m0 = 0; m0 < m; m0 += block) {
        const int64_t m1 = m0 + block < m ? m0 + block : m;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < pairs; ++t) {
            const int64_t n0 = 2 * t * PANEL;
            const int count = 2 * t + 1 < panels ? 2 : 1;
            const int64_t width = n - n0 < count * PANEL ? n - n0 : count * PANEL;
            for (int64_t i0 = m0; i0 < m1; i0 += AMX_ROWS) {
                const int64_t rows = m1 - i0 < AMX_ROWS ? m1 - i0 : AMX_ROWS;
                const int whole = m <= 16 || rows == AMX_ROWS;
                amx_block_dispatch(whole ? x + i0 * ldx : padded, whole ? ldx : k, rows > 16 ? 2 : 1,
                                   packed + 2 * t * panel_stride, panel_stride, count, chunks, out);
                amx_write(out, rows, width, bias, n0, y + i0 * ldy, ldy);
            }
        }
    }
    _tile_release();
}

/* The rows of x past its last whole block of 32 (when it has more than 16 rows), into `padded`
 * [32, k] with zero rows after them (zero rows do not change the others' sums); their count. */
static int64_t amx_tail(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, uint16_t *padded) {
    const int64_t tail = m > 16 ? m % AMX_ROWS : 0;
    if (tail) {
        memset(padded, 0, (size_t)(AMX_ROWS * k) * sizeof *padded);
        for (int64_t r = 0; r < tail; ++r) memcpy(padded + r * k, x + (m - tail + r) * ldx, (size_t)k * sizeof *x);
    }
    return tail;
}

/* bf16_linear on tiles, for K a multiple of 32. Products of up to 16 rows configure their row
 * tiles that high; longer ones go 32 rows at a time, the last block's rows copied into a
 * zero-padded block. */
static void amx_linear(const uint16_t *x, int64_t ldx, const uint16_t *packed, const float *bias, uint16_t *y,
                       int64_t ldy, int64_t m, int64_t n, int64_t k) {
    uint16_t *padded = NULL;
    if (m > 16 && m % AMX_ROWS) {
        padded = malloc((size_t)(AMX_ROWS * k) * sizeof *padded);
        if (!padded) { /* no memory for 32 rows: the vector path needs none */
            vector_linear(x, ldx, packed, bias, y, ldy, m, n, k);
            return;
        }
        amx_tail(x, ldx, m, k, padded);
    }
#pragma omp parallel if (m * n * k > 65536)
    amx_linear_team(x, ldx, packed, bias, y, ldy, m, n, k, padded);
    free(padded);
}

/* Whether the tiles are wired right: products whose every sum is exact (small integers) must be
 * the vector path's, bit for bit, at heights 5 and 16 and in a padded block (37 rows). */
static int amx_self_check(void) {
    enum { K = 64, N = 40, M = 37 };
    uint16_t x[M * K], w[N * K], packed[(N + PANEL - 1) / PANEL * K * PANEL], tiled[M * N], vector[M * N];
    float bias[N];
    uint32_t state = 12345u;
    for (int i = 0; i < M * K; ++i) x[i] = to_bf16((float)((int)((state = state * 1664525u + 1013904223u) >> 29) - 4));
    for (int i = 0; i < N * K; ++i) w[i] = to_bf16((float)((int)((state = state * 1664525u + 1013904223u) >> 29) - 4));
    for (int i = 0; i < N; ++i) bias[i] = (float)(i - 20);
    memset(packed, 0, sizeof packed);
    for (int r = 0; r < N; ++r)
        for (int c = 0; c < K; ++c) packed[(r / PANEL) * K * PANEL + (c / 2) * 2 * PANEL + (r % PANEL) * 2 + c % 2] = w[r * K + c];
    static const int heights[] = {5, 16, M};
    for (int i = 0; i < 3; ++i) {
        amx_linear(x, K, packed, bias, tiled, N, heights[i], N, K);
        vector_linear(x, K, packed, bias, vector, N, heights[i], N, K);
        if (memcmp(tiled, vector, (size_t)heights[i] * N * sizeof *tiled) != 0) return 0;
    }
    return 1;
}

static int amx_state; /* 0: not yet known, else bf16_amx_ready's answer */

static int amx_status(void) { return amx_status_once(&amx_state, amx_request_permission, amx_self_check); }
#else
#define BF16_AMX 0
#endif

/* 1 when products with K a multiple of 32 run on AMX bf16 tiles (built for them, permitted by the
 * OS, and wired right); 0 a build without tiles, -1 the OS refused them, -2 the self-check failed
 * (a defect: tiles stay off). */
int bf16_amx_ready(void) {
#if BF16_AMX
    return amx_status();
#else
    return 0;
#endif
}

/* y[m, n] = bf16(x[m, :] . W[n, :] + bias[n]): x [m, k] with row stride ldx, W packed as in the
 * header, bias fp32 [n] or NULL, y [m, n] with row stride ldy. On tiles where bf16_amx_ready and
 * K is a multiple of 32, else the vector path: a choice made by the machine and the weight alone. */
void bf16_linear(const uint16_t *x, int64_t ldx, const uint16_t *packed, const float *bias, uint16_t *y,
                 int64_t ldy, int64_t m, int64_t n, int64_t k) {
#if BF16_AMX
    if (k % CHUNK == 0 && amx_status() == 1) {
        amx_linear(x, ldx, packed, bias, y, ldy, m, n, k);
        return;
    }
#endif
    vector_linear(x, ldx, packed, bias, y, ldy, m, n, k);
}

/* bf16_linear by every thread of the enclosing parallel region together (bf16_layers.c), the
 * same bits: `scratch` holds 32 * k values for the tiles' padded last rows. bf16_amx_ready must
 * have been called before the region. */
static inline void bf16_linear_team(const uint16_t *x, int64_t ldx, const uint16_t *packed, const float *bias, uint16_t *y,
                             int64_t ldy, int64_t m, int64_t n, int64_t k, uint16_t *scratch) {
#if BF16_AMX
    if (k % CHUNK == 0 && amx_status() == 1) {
        int64_t tail = 0;
#pragma omp single copyprivate(tail)
        tail = amx_tail(x, ldx, m, k, scratch);
        amx_linear_team(x, ldx, packed, bias, y, ldy, m, n, k, tail ? scratch : NULL);
        return;
    }
#else
    (void)scratch;
#endif
    vector_linear_team(x, ldx, packed, bias, y, ldy, m, n, k);
}
