/* Row operations shared by rowwise.c and gguf_matmul.c: RMSNorm of one row and SiLU.
 * Plain loops of IEEE operations (the files are built with -ffp-contract=off): a vectorized
 * and a scalar build give the same bits. paged_attention.c uses the exponential too (built with
 * contraction, its polynomial steps become FMAs there, in its scalar and vector forms alike). */
#ifndef DEEPINFER_ROWOPS_H
#define DEEPINFER_ROWOPS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* out = v * w / sqrt(mean(v^2) + eps): the squares in float, summed in double, the mean and
 * the scale in float (GGUF files come from llama.cpp, whose RMSNorm rounds so). */
static inline void rms_norm_row(const float *v, const float *weight, float *out, int64_t dim, float eps) {
    double squares = 0.0;
    for (int64_t i = 0; i < dim; ++i) squares += (double)(v[i] * v[i]);
    const float mean = (float)(squares / (double)dim);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int64_t i = 0; i < dim; ++i) out[i] = (v[i] * scale) * weight[i];
}

/* 2^f for f in [0, 1), a degree-6 minimax polynomial in Horner form; f a float or a GCC
 * vector of floats (each lane the same operations). */
#define EXP2_OF_FRACTION(f) \
    ((((((1.535336188319500e-4f * (f) + 1.339887440266574e-3f) * (f) + 9.618437357674640e-3f) * (f) + \
        5.550332471162809e-2f) * (f) + 2.402264791363012e-1f) * (f) + 6.931472028550421e-1f) * (f) + 1.0f)

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

/* out = silu(gate) * up = gate / (1 + e^-gate) * up */
static inline void swiglu_row(const float *gate, const float *up, float *out, int64_t dim) {
    for (int64_t i = 0; i < dim; ++i) out[i] = gate[i] / (1.0f + exp_clamped(-gate[i])) * up[i];
}
#endif
