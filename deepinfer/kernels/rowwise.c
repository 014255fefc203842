/* Row-wise operations of a decoder layer, for CPUs: RMSNorm (optionally fused with the residual
 * add before it) and rotary embedding in place on fp32 rows, SwiGLU on bf16 rows; and the
 * sampler's greedy argmax and its draws at a temperature.
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

/* The largest of a row's values other than NaNs (-inf if none), and whether it holds a NaN: 16
 * lanes at a time. */
static float row_max(const float *x, int64_t n, int *has_nan) {
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
    *has_nan = any_lane(nan);
    for (int64_t j = i; j < n; ++j) {
        best = x[j] > best ? x[j] : best;
        *has_nan |= x[j] != x[j];
    }
    return best;
}

/* The position of a row's largest value, as torch.argmax: the first of equal ones, and the first
 * NaN where there is one. One pass for the maximum (and whether a NaN is there), 16 lanes at a
 * time, then the first position holding it; indices, not sums, so every level gives the same. */
static int64_t argmax_row(const float *x, int64_t n) {
    int has_nan;
    const float best = row_max(x, n, &has_nan);
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

/* Values per step of a draw's running sum: pass one sums each span of the row, pass two walks the
 * spans' sums and then one span's values, so no probability is stored. */
#define DRAW_SPAN 1024

typedef double draw_d8 __attribute__((vector_size(64)));

/* e^(x[i] / temperature - top) for i in span [lo, hi) of a row, into e[0 .. hi-lo): 0 where that
 * exponent is below -87 (the -inf of a masked token among them), so a masked token is never drawn
 * and the sum never counts it. Returns their sum in double, 8 lanes then in lane order. */
static double draw_span(const float *x, int64_t lo, int64_t hi, float temperature, float top, float *e) {
    draw_d8 lanes = {0};
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        rowops_f16 v;
        memcpy(&v, x + i, sizeof v);
        const rowops_f16 s = v / temperature - top;
        const rowops_i16 kept = s >= -87.0f;
        const rowops_f16 p = (rowops_f16)((rowops_i16)exp16_clamped(s) & kept);
        memcpy(e + (i - lo), &p, sizeof p);
        lanes += __builtin_convertvector(__builtin_shufflevector(p, p, 0, 1, 2, 3, 4, 5, 6, 7), draw_d8) +
                 __builtin_convertvector(__builtin_shufflevector(p, p, 8, 9, 10, 11, 12, 13, 14, 15), draw_d8);
    }
    double sum = 0.0;
    for (int lane = 0; lane < 8; ++lane) sum += lanes[lane];
    for (; i < hi; ++i) {
        const float s = x[i] / temperature - top;
        e[i - lo] = s >= -87.0f ? exp_clamped(s) : 0.0f;
        sum += e[i - lo];
    }
    return sum;
}

/* One inverse-CDF draw from softmax(x / temperature) (n values) with uniform u in [0, 1): the
 * first token whose running sum of e^(x / temperature - max) reaches u times their total. The
 * running sum steps over whole spans (their sums from the first pass) and then over the chosen
 * span's values one by one, so the row is read about once and nothing [n] is allocated. A row
 * with a NaN or +inf draws what greedy sampling picks there; a row of -inf draws token 0. */
static int64_t draw_row(const float *x, int64_t n, float temperature, double u) {
    int has_nan;
    const float largest = row_max(x, n, &has_nan);
    if (has_nan || largest == INFINITY) return argmax_row(x, n);
    if (largest == -INFINITY) return 0;
    /* max(x / t) is max(x) / t: rounding a quotient keeps the order of its dividends */
    const float top = largest / temperature;
    if (top == INFINITY) return argmax_row(x, n); /* a temperature so small that it overflows */
    const int64_t spans = (n + DRAW_SPAN - 1) / DRAW_SPAN;
    double sums[spans], total = 0.0;
    float e[DRAW_SPAN];
    for (int64_t c = 0; c < spans; ++c) {
        sums[c] = draw_span(x, c * DRAW_SPAN, (c + 1) * DRAW_SPAN < n ? (c + 1) * DRAW_SPAN : n, temperature, top, e);
        total += sums[c];
    }
    const double target = u * total;
    double running = 0.0;
    int64_t last = 0; /* the last token of positive weight seen: the draw if rounding leaves target unreached */
    for (int64_t c = 0; c < spans; ++c) {
        if (sums[c] == 0.0) continue;
        if (running + sums[c] < target) {
            running += sums[c];
            continue;
        }
        const int64_t lo = c * DRAW_SPAN, hi = lo + DRAW_SPAN < n ? lo + DRAW_SPAN : n;
        draw_span(x, lo, hi, temperature, top, e);
        for (int64_t i = lo; i < hi; ++i) {
            if (e[i - lo] == 0.0f) continue;
            last = i;
            running += e[i - lo];
            if (running >= target) return i;
        }
        return last; /* the span's own order of additions fell short of its pass-one sum */
    }
    return last;
}

/* out[t] = a draw from softmax(x[rows[t]] / temperatures[t]) with uniforms[t], for t < count (x
 * rows `ld` floats apart, `cols` values each): sampling at a temperature with no top-k, top-p or
 * min-p, one pass over each row. torch's softmax, float64 cumsum and searchsorted took ~8 ms
 * for 32 rows of a 49k vocabulary on Zen 4 (2 threads), mostly in faulting in their [32, V]
 * results. Each row is drawn on its own, so a row's token does not depend on the batch. */
void draw_rows(const float *x, int64_t ld, const int64_t *rows, int64_t count, int64_t cols,
               const float *temperatures, const double *uniforms, int64_t *out) {
#pragma omp parallel for schedule(static) if (count * cols > 65536)
    for (int64_t t = 0; t < count; ++t) out[t] = draw_row(x + rows[t] * ld, cols, temperatures[t], uniforms[t]);
}
