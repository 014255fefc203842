/* Row operations shared by rowwise.c, gguf_matmul.c, bf16_matmul.c and bf16_layers.c: bf16
 * conversions, RMSNorm of rows and SiLU.
 * Plain loops of IEEE operations (the files are built with -ffp-contract=off): a vectorized
 * and a scalar build give the same bits. paged_attention.c (built the same way) uses the
 * exponential too, its vector forms with the polynomial's steps fused (EXP2_OF_FRACTION_FUSED). */
#ifndef DEEPINFER_ROWOPS_H
#define DEEPINFER_ROWOPS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* A bf16 value widened to fp32 (exact). */
static inline float from_bf16(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 rounded to the nearest bf16, ties to even, as torch's .to(torch.bfloat16); NaN stays NaN. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN, quiet */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Rows per call of squares_rows: eight independent sums keep the adder busy where one row's
 * sum is a chain of dependent additions (~4 cycles each). */
#define SQUARES_ROWS 8

/* squares[r] = the sum of rows[r][i]^2 over i < dim, r < n (at most SQUARES_ROWS): each square in
 * float, summed in double in the order i = 0, 1, ..; the rows' sums advance side by side. */
static inline void squares_rows(const float *const *rows, int n, int64_t dim, double *squares) {
    double sums[SQUARES_ROWS] = {0.0};
    if (n == SQUARES_ROWS) { /* a constant count: the compiler keeps the sums in registers */
        for (int64_t i = 0; i < dim; ++i)
            for (int r = 0; r < SQUARES_ROWS; ++r) sums[r] += (double)(rows[r][i] * rows[r][i]);
    } else {
        for (int64_t i = 0; i < dim; ++i)
            for (int r = 0; r < n; ++r) sums[r] += (double)(rows[r][i] * rows[r][i]);
    }
    for (int r = 0; r < n; ++r) squares[r] = sums[r];
}

/* out = v * w / sqrt(mean(v^2) + eps) given squares = the sum of v^2 (squares_rows): the mean and
 * the scale in float (GGUF files come from llama.cpp, whose RMSNorm rounds so). */
static inline void rms_norm_scaled(const float *v, const float *weight, float *out, int64_t dim, float eps,
                                   double squares) {
    const float mean = (float)(squares / (double)dim);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int64_t i = 0; i < dim; ++i) out[i] = (v[i] * scale) * weight[i];
}

/* outs[r] = RMSNorm of rows[r] for r < n (at most SQUARES_ROWS), their sums of squares side by
 * side; outs[r] may be rows[r] (element by element, so in place is exact). */
static inline void rms_norm_group(const float *const *rows, int n, int64_t dim, const float *weight, float eps,
                                  float *const *outs) {
    double squares[SQUARES_ROWS];
    squares_rows(rows, n, dim, squares);
    for (int r = 0; r < n; ++r) rms_norm_scaled(rows[r], weight, outs[r], dim, eps, squares[r]);
}

/* 2^f for f in [0, 1), a degree-6 minimax polynomial in Horner form; f a float or a GCC
 * vector of floats (each lane the same operations). */
#define EXP2_OF_FRACTION(f) \
    ((((((1.535336188319500e-4f * (f) + 1.339887440266574e-3f) * (f) + 9.618437357674640e-3f) * (f) + \
        5.550332471162809e-2f) * (f) + 2.402264791363012e-1f) * (f) + 6.931472028550421e-1f) * (f) + 1.0f)

/* The same polynomial with each step one fused multiply-add: FMA(a, b, c) is a * b + c rounded
 * once and CONST(x) the constant x in f's type (for vector code built without contraction). */
#define EXP2_OF_FRACTION_FUSED(f, FMA, CONST)                                                                  \
    FMA(FMA(FMA(FMA(FMA(FMA(CONST(1.535336188319500e-4f), (f), CONST(1.339887440266574e-3f)), (f),              \
                        CONST(9.618437357674640e-3f)),                                                          \
                    (f), CONST(5.550332471162809e-2f)),                                                         \
                (f), CONST(2.402264791363012e-1f)),                                                             \
            (f), CONST(6.931472028550421e-1f)),                                                                 \
        (f), CONST(1.0f))

/* e^x for x in [-87, 88] (clamped outside): 2^(x log2 e) split into 2^n * 2^f, 2^f by a
 * degree-6 minimax polynomial on [0, 1); relative error about 2e-7. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float t = x * 1.44269504088896341f;
    const float n = floorf(t);
    const float f = t - n;
    float p = EXP2_OF_FRACTION(f);
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)n * (1 << 23);
    memcpy(&p, &bits, sizeof p);
    return p;
}

/* GCC vector types of 16 lanes: AVX-512 registers where the build has them, pairs of AVX2 or
 * quadruples of SSE ones otherwise (every lane the same IEEE operations either way). */
typedef float rowops_f16 __attribute__((vector_size(64)));
typedef int32_t rowops_i16 __attribute__((vector_size(64)));

/* exp_clamped on 16 lanes, the same operations lane by lane (so the same bits): the compiler
 * does not vectorize the scalar form's floor and exponent arithmetic, and SwiGLU's loop of it ran
 * one value at a time (13% of a GGUF prefill on the Intel Xeon with AMX, perf). paged_attention.c's
 * softmax has its own for x <= 0 (exp16_nonpositive). */
static inline rowops_f16 exp16_clamped(rowops_f16 x) {
    const rowops_i16 low = x < -87.0f, high = x > 88.0f; /* false for NaN, as the scalar tests */
    x = (rowops_f16)(((rowops_i16)x & ~(low | high)) | ((rowops_i16)(x * 0.0f - 87.0f) & low) |
                     ((rowops_i16)(x * 0.0f + 88.0f) & high));
    const rowops_f16 t = x * 1.44269504088896341f;
    const rowops_f16 toward_zero = __builtin_convertvector(__builtin_convertvector(t, rowops_i16), rowops_f16);
    const rowops_f16 n = toward_zero + __builtin_convertvector(toward_zero > t, rowops_f16); /* floor */
    const rowops_f16 f = t - n;
    const rowops_f16 p = EXP2_OF_FRACTION(f);
    return (rowops_f16)((rowops_i16)p + (__builtin_convertvector(n, rowops_i16) << 23));
}

/* out = silu(gate) * up = gate / (1 + e^-gate) * up, 16 values at a time, the rest one by one
 * (the same bits either way). */
static inline void swiglu_row(const float *gate, const float *up, float *out, int64_t dim) {
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) {
        rowops_f16 g, u;
        memcpy(&g, gate + i, sizeof g);
        memcpy(&u, up + i, sizeof u);
        const rowops_f16 r = g / (1.0f + exp16_clamped(-g)) * u;
        memcpy(out + i, &r, sizeof r);
    }
    for (; i < dim; ++i) out[i] = gate[i] / (1.0f + exp_clamped(-gate[i])) * up[i];
}

/* The same for bf16 rows: gate and up widened, swiglu_row's fp32 result rounded once (a bf16
 * model's activation, on the PyTorch path and in bf16_layers.c alike). */
static inline void swiglu_row_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t dim) {
    enum { STEP = 64 };
    float g[STEP], u[STEP], r[STEP];
    for (int64_t i0 = 0; i0 < dim; i0 += STEP) {
        const int64_t n = dim - i0 < STEP ? dim - i0 : STEP;
        for (int64_t i = 0; i < n; ++i) g[i] = from_bf16(gate[i0 + i]), u[i] = from_bf16(up[i0 + i]);
        swiglu_row(g, u, r, n);
        for (int64_t i = 0; i < n; ++i) out[i0 + i] = to_bf16(r[i]);
    }
}
#endif
