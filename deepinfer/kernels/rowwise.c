/* Row-wise operations of a decoder layer, for CPUs: RMSNorm (optionally fused with the residual
 * add before it) and rotary embedding in place on fp32 rows, SwiGLU on bf16 rows; and the
 * sampler's greedy argmax.
 *
 * At batch 1 a decode step runs them 90 times on rows of a few hundred values, where PyTorch's
 * per-operator overhead (tens of microseconds each here) costs more than the arithmetic; one call
 * per operation does the whole batch. Each row is computed on its own, in the same order whatever
 * the number of rows or threads, so results never depend on the batch.
 */
#include <stdint.h>

#include "rowops.h"

/* out[t] = v * w / sqrt(mean(v^2) + eps) with v = x[t], or with a residual v = sum[t] =
 * x[t] + residual[t] (the new residual stream, written to sum). The sum of squares in double. */
void rms_norm_rows(const float *x, const float *residual, float *sum, const float *weight, float *out, int64_t rows,
                   int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim > 65536)
    for (int64_t t = 0; t < rows; ++t) {
        const float *row = x + t * dim;
        if (residual) {
            const float *r = residual + t * dim;
            float *s = sum + t * dim;
            for (int64_t i = 0; i < dim; ++i) s[i] = row[i] + r[i];
            row = s;
        }
        rms_norm_row(row, weight, out + t * dim, dim, eps);
    }
}

/* Rotate heads [0, heads) of each token in place, "rotate half" layout: with x1, x2 the two
 * halves of a head, x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. x is [T, *, head_dim] with
 * token stride token_stride; cos/sin are [table_rows, head_dim] tables (first halves used).
 * Returns -1, touching nothing, if a position lies outside the tables. */
int rotary_rows(float *x, const int64_t *positions, const float *cos_table, const float *sin_table,
                int64_t table_rows, int64_t tokens, int64_t heads, int64_t head_dim, int64_t token_stride) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < tokens; ++t)
        if (positions[t] < 0 || positions[t] >= table_rows) return -1;
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim > 65536)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos_table + positions[t] * head_dim, *s = sin_table + positions[t] * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
            float *x1 = x + t * token_stride + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
    return 0;
}

typedef float argmax_f16 __attribute__((vector_size(64)));
typedef int32_t argmax_i16 __attribute__((vector_size(64)));

static inline int any_lane(argmax_i16 mask) {
    static const argmax_i16 none = {0};
    return memcmp(&mask, &none, sizeof mask) != 0;
}

/* The position of a row's largest value, as torch.argmax: the first of equal ones, and the first
 * NaN where there is one. One pass for the maximum (and whether a NaN is there), 16 lanes at a
 * time, then the first position holding it; indices, not sums, so every level gives the same. */
static int64_t argmax_row(const float *x, int64_t n) {
    argmax_f16 top;
    argmax_i16 nan = {0};
    for (int i = 0; i < 16; ++i) top[i] = -INFINITY;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        argmax_f16 v;
        memcpy(&v, x + i, sizeof v);
        const argmax_i16 above = v > top;
        top = (argmax_f16)(((argmax_i16)v & above) | ((argmax_i16)top & ~above));
        nan |= v != v;
    }
    float best = -INFINITY;
    for (int lane = 0; lane < 16; ++lane) best = top[lane] > best ? top[lane] : best;
    int has_nan = any_lane(nan);
    for (int64_t j = i; j < n; ++j) {
        best = x[j] > best ? x[j] : best;
        has_nan |= x[j] != x[j];
    }
    if (has_nan) {
        for (int64_t j = 0; j < n; ++j)
            if (x[j] != x[j]) return j;
    }
    argmax_f16 wanted;
    for (int lane = 0; lane < 16; ++lane) wanted[lane] = best;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        argmax_f16 v;
        memcpy(&v, x + j, sizeof v);
        if (any_lane(v == wanted)) break;
    }
    for (; j < n; ++j)
        if (x[j] == best) return j;
    return 0; /* not reached: best is one of the row's values */
}

/* out[t] = argmax of row t of x [rows, cols] (rows `ld` floats apart). Greedy sampling's token:
 * torch.argmax took ~1.3 ms for 32 rows of a 49k vocabulary on 2 threads of the Intel Xeon with
 * AMX, ~2% of a 32-stream decode step. */
void argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t ld, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * cols > 65536)
    for (int64_t t = 0; t < rows; ++t) out[t] = argmax_row(x + t * ld, cols);
}

/* out[t] = bf16(silu(gate) * up) for bf16 rows gate_up[t] = [gate | up] (2 * dim values, rows
 * `ld` apart), out [rows, dim]: a bf16 model's MLP activation (rowops.h's swiglu_row_bf16, which
 * bf16_layers.c runs too). */
void swiglu_rows_bf16(const uint16_t *gate_up, int64_t ld, uint16_t *out, int64_t rows, int64_t dim) {
#pragma omp parallel for schedule(static) if (rows * dim > 65536)
    for (int64_t t = 0; t < rows; ++t) swiglu_row_bf16(gate_up + t * ld, gate_up + t * ld + dim, out + t * dim, dim);
}
