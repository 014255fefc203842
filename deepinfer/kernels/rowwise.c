/* Row-wise operations of a decoder layer, for CPUs: RMSNorm (optionally fused with the residual
 * add before it) and rotary embedding in place on fp32 rows, SwiGLU on bf16 rows; and the
 * sampler's greedy argmax, its draws (temperature, top-k, top-p, min-p) and its logprobs.
 *
 * At batch 1 a decode step runs them 90 times on rows of a few hundred values, where PyTorch's
 * per-operator overhead (tens of microseconds each here) costs more than the arithmetic; one call
 * per operation does the whole batch. Each row is computed on its own, in the same order whatever
 * the number of rows or threads, so results never depend on the batch.
 */
#include <stdint.h>
#include <stdlib.h>

#include "rowops.h"

/* out[t] = v * w / sqrt(mean(v^2) + eps) with v = x[t], or with a residual v = sum[t] =
 * x[t] + residual[t] (the new residual stream, written to sum). The sum of squares in double. */
void rms_norm_rows(const float *x, const float *residual, float *sum, const float *weight, float *out, int64_t rows,
                   int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim > 65536)
    for (int64_t t0 = 0; t0 < rows; t0 += SQUARES_ROWS) { /* rows side by side for their sums */
        const int n = rows - t0 < SQUARES_ROWS ? (int)(rows - t0) : SQUARES_ROWS;
        const float *in[SQUARES_ROWS];
        float *normed[SQUARES_ROWS];
        for (int r = 0; r < n; ++r) {
            const int64_t t = t0 + r;
            in[r] = x + t * dim;
            normed[r] = out + t * dim;
            if (residual) {
                float *s = sum + t * dim;
                for (int64_t i = 0; i < dim; ++i) s[i] = x[t * dim + i] + residual[t * dim + i];
                in[r] = s;
            }
        }
        rms_norm_group(in, n, dim, weight, eps, normed);
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

/* The number of lanes set in a comparison's mask, as a negative count (true lanes are -1). */
static inline int64_t lane_count(argmax_i16 mask) {
    int64_t total = 0;
    for (int lane = 0; lane < 16; ++lane) total += mask[lane];
    return total;
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
 * spans' sums and then one span's values, so the walk reads the row about once more. */
#define DRAW_SPAN 1024
/* Buckets of a threshold's search: the top 12 bits of an order-preserving key (sign, exponent and
 * three bits of mantissa), one pass over the row to find the bucket, then its values sorted. */
#define DRAW_BUCKETS 4096

typedef double draw_d8 __attribute__((vector_size(64)));

/* An unsigned key whose order is x's (no NaN), and its bucket. */
static inline uint32_t draw_key(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits >> 31 ? ~bits : bits | 0x80000000u;
}
static inline int draw_bucket(float x) { return (int)(draw_key(x) >> 20); }

static int descending(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* The weights e^(x[i] / temperature - top) of span [lo, hi) of a row, into e[0 .. hi-lo), and their
 * sum in double (8 lanes, then in lane order). A token weighs 0 where its scaled logit lies below
 * kth (top-k) or more than 87 below top (the -inf of a masked token among them, so a masked token
 * is never drawn) or its weight below `floor` (top-p, min-p). */
static double draw_span(const float *x, int64_t lo, int64_t hi, float temperature, float top, float kth, float floor,
                        float *e) {
    draw_d8 lanes = {0};
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        rowops_f16 v;
        memcpy(&v, x + i, sizeof v);
        const rowops_f16 scaled = v / temperature, s = scaled - top;
        const rowops_f16 w = (rowops_f16)((rowops_i16)exp16_clamped(s) & (s >= -87.0f) & (scaled >= kth));
        const rowops_f16 p = (rowops_f16)((rowops_i16)w & (w >= floor));
        memcpy(e + (i - lo), &p, sizeof p);
        lanes += __builtin_convertvector(__builtin_shufflevector(p, p, 0, 1, 2, 3, 4, 5, 6, 7), draw_d8) +
                 __builtin_convertvector(__builtin_shufflevector(p, p, 8, 9, 10, 11, 12, 13, 14, 15), draw_d8);
    }
    double sum = 0.0;
    for (int lane = 0; lane < 8; ++lane) sum += lanes[lane];
    for (; i < hi; ++i) {
        const float scaled = x[i] / temperature, s = scaled - top;
        const float w = s >= -87.0f && scaled >= kth ? exp_clamped(s) : 0.0f;
        e[i - lo] = w >= floor ? w : 0.0f;
        sum += e[i - lo];
    }
    return sum;
}

/* The k-th largest of x[i] / temperature (0 < k < n, no NaN): the bucket holding it by counting,
 * then that bucket's values sorted (in `scratch`, n floats). */
static float kth_scaled(const float *x, int64_t n, float temperature, int64_t k, float *scratch) {
    int64_t counts[DRAW_BUCKETS] = {0};
    for (int64_t i = 0; i < n; ++i) ++counts[draw_bucket(x[i] / temperature)];
    int bucket = DRAW_BUCKETS - 1;
    int64_t above = 0;
    while (above + counts[bucket] < k) above += counts[bucket--];
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i)
        if (draw_bucket(x[i] / temperature) == bucket) scratch[m++] = x[i] / temperature;
    qsort(scratch, m, sizeof *scratch, descending);
    return scratch[k - above - 1];
}

/* The smallest weight top-p keeps of e[0 .. n) (non-negative, `total` their sum): a token stays
 * while the weight of the tokens strictly heavier than it is below top_p x total, so tokens of
 * equal weight stay or go together (a sort would keep some of a tie, in its own order). The
 * bucket where that mass is reached by summing, then that bucket's weights sorted (in `scratch`). */
static float nucleus_floor(const float *e, int64_t n, double total, float top_p, float *scratch) {
    const double limit = (double)top_p * total;
    double mass[DRAW_BUCKETS] = {0};
    for (int64_t i = 0; i < n; ++i)
        if (e[i] > 0.0f) mass[draw_bucket(e[i])] += e[i];
    double above = 0.0;
    int bucket = DRAW_BUCKETS - 1;
    while (bucket >= 0 && above + mass[bucket] < limit) above += mass[bucket--];
    if (bucket < 0) return 0.0f; /* rounding left the whole mass under the limit: keep every token */
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i)
        if (e[i] > 0.0f && draw_bucket(e[i]) == bucket) scratch[m++] = e[i];
    qsort(scratch, m, sizeof *scratch, descending);
    /* heaviest first: a weight stays while what precedes it is under the limit, so the first
     * token of a tie (preceded by the heavier tokens only) decides for all of it, `floor` being a
     * weight; the last weight that stays is the floor */
    float floor = scratch[0];
    for (int64_t j = 0; j < m && above < limit; ++j) {
        floor = scratch[j];
        above += scratch[j];
    }
    return floor;
}

/* Sampling parameters of a drawn row: top_k 0, top_p 1 and min_p 0 truncate nothing. */
typedef struct {
    float temperature, top_p, min_p;
    int64_t top_k;
} draw_params;

/* Whether a row's draw truncates by rank or mass (top-k or top-p): what needs `scratch`. */
static inline int draw_truncates(draw_params p, int64_t n) {
    return (p.top_k > 0 && p.top_k < n) || p.top_p < 1.0f;
}

/* One inverse-CDF draw with uniform u in [0, 1) from softmax(x / temperature) (n values) after
 * top-k, top-p and min-p: the first token whose running sum of kept weights reaches u times their
 * total. The running sum steps over whole spans (their sums from the first pass) and then over the
 * chosen span's weights one by one. `scratch` (2n floats) is needed only to truncate. A row with a
 * NaN or +inf draws what greedy sampling picks there; a row of -inf draws token 0. */
static int64_t draw_row(const float *x, int64_t n, draw_params p, double u, float *scratch) {
    int has_nan;
    const float largest = row_max(x, n, &has_nan);
    if (has_nan || largest == INFINITY) return argmax_row(x, n);
    if (largest == -INFINITY) return 0;
    /* max(x / t) is max(x) / t: rounding a quotient keeps the order of its dividends */
    const float top = largest / p.temperature;
    if (top == INFINITY) return argmax_row(x, n); /* a temperature so small that it overflows */
    const float kth = p.top_k > 0 && p.top_k < n ? kth_scaled(x, n, p.temperature, p.top_k, scratch) : -INFINITY;
    float floor = p.min_p > 0.0f ? p.min_p : 0.0f; /* min_p of the top weight, e^0 = 1 */
    if (p.top_p < 1.0f) {
        const double total = draw_span(x, 0, n, p.temperature, top, kth, 0.0f, scratch);
        const float nucleus = nucleus_floor(scratch, n, total, p.top_p, scratch + n);
        floor = nucleus > floor ? nucleus : floor;
    }
    const int64_t spans = (n + DRAW_SPAN - 1) / DRAW_SPAN;
    double sums[spans], total = 0.0;
    float e[DRAW_SPAN];
    for (int64_t c = 0; c < spans; ++c) {
        const int64_t lo = c * DRAW_SPAN, hi = lo + DRAW_SPAN < n ? lo + DRAW_SPAN : n;
        sums[c] = draw_span(x, lo, hi, p.temperature, top, kth, floor, e);
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
        draw_span(x, lo, hi, p.temperature, top, kth, floor, e);
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

/* out[t] = a draw from row rows[t] of x (rows `ld` floats apart, `cols` values each) at
 * temperatures[t] > 0 after top_k[t], top_p[t] and min_p[t], with uniforms[t], for t < count; -1
 * where a row's scratch could not be allocated. torch's softmax, float64 cumsum and searchsorted
 * took ~15 ms for 32 rows of a 49k vocabulary on Zen 4 (2 threads), mostly faulting in their
 * [32, V] results, and top-p's sort ~70 ms. Each row is drawn on its own, so a row's token does
 * not depend on the batch. */
void draw_rows(const float *x, int64_t ld, const int64_t *rows, int64_t count, int64_t cols,
               const float *temperatures, const int64_t *top_k, const float *top_p, const float *min_p,
               const double *uniforms, int64_t *out) {
    int truncates = 0;
    for (int64_t t = 0; t < count; ++t)
        truncates |= draw_truncates((draw_params){.top_p = top_p[t], .top_k = top_k[t]}, cols);
#pragma omp parallel if (count * cols > 65536)
    {
        float *scratch = truncates ? malloc(2 * cols * sizeof(float)) : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < count; ++t) {
            const draw_params p = {temperatures[t], top_p[t], min_p[t], top_k[t]};
            out[t] = draw_truncates(p, cols) && scratch == NULL
                         ? -1
                         : draw_row(x + rows[t] * ld, cols, p, uniforms[t], scratch);
        }
        free(scratch);
    }
}

/* The most logprobs a row asks for (the APIs' top_logprobs limit). */
#define LOGPROB_TOP 20

/* Logprobs of one row at a temperature: lp_i = (x_i / t - m) - log(sum_j e^(x_j / t - m)), m the
 * largest x / t, in float as log_softmax computes them (the sum of the exponentials in double).
 * Writes the token's lp, its rank (1 + the number of strictly larger lp) and the k largest lp with
 * their positions (larger first, the lower position first among equal ones). Returns 0, or -1
 * for a row holding a NaN or +inf (torch answers those rows). */
static int logprob_row(const float *x, int64_t n, float temperature, int64_t token, int64_t k, float *lp,
                       int64_t *rank, int64_t *top_ids, float *top_values) {
    int has_nan;
    const float largest = row_max(x, n, &has_nan);
    if (has_nan || largest == INFINITY || largest == -INFINITY) return -1;
    const float m = largest / temperature;
    if (m == INFINITY) return -1;
    /* the exponentials' sum: a draw's weights with nothing truncated, span by span */
    double sum = 0.0;
    float e[DRAW_SPAN];
    for (int64_t lo = 0; lo < n; lo += DRAW_SPAN)
        sum += draw_span(x, lo, lo + DRAW_SPAN < n ? lo + DRAW_SPAN : n, temperature, m, -INFINITY, 0.0f, e);
    const float log_sum = (float)log(sum);
    const float chosen = (x[token] / temperature - m) - log_sum;
    /* the rank's count and the top k: 16 values at a time, one by one only where a lane could
     * enter the top k (above its smallest, or while it is not full) */
    int64_t above = 0, kept = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const int64_t width = n - i < 16 ? n - i : 16;
        rowops_f16 v;
        if (width == 16) {
            memcpy(&v, x + i, sizeof v);
            v = v / temperature - m - log_sum;
            above -= lane_count((argmax_i16)(v > chosen));
            if (k == 0 || (kept == k && !any_lane((argmax_i16)(v > top_values[k - 1])))) continue;
        } else {
            for (int j = 0; j < width; ++j) {
                v[j] = (x[i + j] / temperature - m) - log_sum;
                above += v[j] > chosen;
            }
        }
        for (int j = 0; j < width && k > 0; ++j) {
            if (kept == k && !(v[j] > top_values[k - 1])) continue;
            int64_t at = kept < k ? kept++ : k - 1; /* insert v[j], keeping the k largest in order */
            for (; at > 0 && v[j] > top_values[at - 1]; --at) {
                top_values[at] = top_values[at - 1];
                top_ids[at] = top_ids[at - 1];
            }
            top_values[at] = v[j];
            top_ids[at] = i + j;
        }
    }
    *lp = chosen;
    *rank = above + 1;
    return 0;
}

/* For t < count: the logprobs of row rows[t] of x (rows `ld` floats apart, `cols` values) at
 * temperatures[t] > 0, for its token tokens[t] and its k[t] <= LOGPROB_TOP most likely tokens:
 * lp[t], rank[t] (-1 where torch must answer the row) and top_ids / top_values [t * LOGPROB_TOP ..].
 * log_softmax, a rank and a top-k per row through torch took ~10 ms for 32 rows of a 49k
 * vocabulary (Zen 4), mostly faulting in new [32, V] tensors. */
void logprob_rows(const float *x, int64_t ld, const int64_t *rows, int64_t count, int64_t cols,
                  const float *temperatures, const int64_t *tokens, const int64_t *k, float *lp, int64_t *rank,
                  int64_t *top_ids, float *top_values) {
#pragma omp parallel for schedule(dynamic, 1) if (count * cols > 65536)
    for (int64_t t = 0; t < count; ++t) {
        const int64_t want = k[t] < LOGPROB_TOP ? k[t] : LOGPROB_TOP;
        if (logprob_row(x + rows[t] * ld, cols, temperatures[t], tokens[t], want, lp + t, rank + t,
                        top_ids + t * LOGPROB_TOP, top_values + t * LOGPROB_TOP))
            rank[t] = -1;
    }
}
