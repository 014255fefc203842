/* A Llama decoder stack on bf16 weights (our bf16 kernel) for a step whose rows all attend through
 * the paged decode kernel, in one call from Python: the bf16 twin of decode_layers.c.
 *
 * At 32 streams a decode step of SmolLM2 in bf16 spent about two thirds of its time in Python and
 * torch between the kernels (py-spy, the Intel Xeon with AMX): a dozen tensor operations and
 * module calls per layer around four products that take ~0.15 ms together. Here the loop is C and
 * one OpenMP region, and the bits are those of the PyTorch path (llama.py with bf16_linear.py,
 * norm.py, rotary.py and float32_boundary.py on the CPU), step by step:
 *   residual add in bf16 (each sum rounded to nearest even, as torch adds bf16 tensors);
 *   RMSNorm of the widened row (rowops.h, as rowwise.c), rounded once;
 *   the projections through bf16_matmul.c itself (included, built with the same flags);
 *   q and k widened, rotated by rowwise.c's rotary, rounded back to bf16 and widened again;
 *   the K/V write, the attention items and their merge: paged_attention.c's functions, called
 *   through pointers the caller takes from that library; the output rounded once;
 *   SwiGLU by rowops.h's swiglu_row_bf16, as rowwise.c's swiglu_rows_bf16.
 */
#include <omp.h>

#include "bf16_matmul.c"
#include "layer_step.h"

/* A projection: W [n, k] packed (bf16_matmul.py's pack), bias fp32 [n] or NULL. */
typedef struct {
    const uint16_t *packed;
    const float *bias;
    int64_t n, k;
} bf16_weight;

typedef struct {
    bf16_weight qkv, o, gate_up, down;
    const float *attn_norm, *ffn_norm; /* fp32 [hidden] */
    float attn_eps, ffn_eps;
} bf16_layer;


/* residual = x (first layer) or bf16(x + residual), then out = bf16(rms_norm(residual)) for
 * rows [0, M), shared out over the team in groups of SQUARES_ROWS (their sums of squares side by
 * side); `row` is the calling thread's fp32 scratch of SQUARES_ROWS * dim. */
static void add_norm_team(const uint16_t *x, uint16_t *residual, int first, const float *weight, float eps,
                          uint16_t *out, int64_t M, int64_t dim, float *row) {
#pragma omp for schedule(static)
    for (int64_t m0 = 0; m0 < M; m0 += SQUARES_ROWS) {
        const int n = M - m0 < SQUARES_ROWS ? (int)(M - m0) : SQUARES_ROWS;
        float *wide[SQUARES_ROWS];
        for (int r = 0; r < n; ++r) {
            const uint16_t *xm = x + (m0 + r) * dim;
            uint16_t *rm = residual + (m0 + r) * dim;
            wide[r] = row + r * dim;
            for (int64_t i = 0; i < dim; ++i) {
                const uint16_t v = first ? xm[i] : to_bf16(from_bf16(xm[i]) + from_bf16(rm[i]));
                rm[i] = v;
                wide[r][i] = from_bf16(v);
            }
        }
        rms_norm_group((const float *const *)wide, n, dim, weight, eps, wide); /* in place */
        for (int r = 0; r < n; ++r) {
            uint16_t *om = out + (m0 + r) * dim;
            for (int64_t i = 0; i < dim; ++i) om[i] = to_bf16(wide[r][i]);
        }
    }
}

/* Returns 0, -1 if a position lies outside the rotary tables (that layer's K/V not written,
 * nothing after computed), -2 out of memory. h [rows, hidden] bf16: in, the embeddings; out, the
 * last layer's output (before the final norm). residual [rows, hidden] bf16: out, the residual
 * stream beside it. */
int bf16_layers(const stack_model *model, const decode_step *step, uint16_t *h, uint16_t *residual) {
    const int64_t M = step->rows, hidden = model->hidden, inter = model->intermediate, D = model->head_dim;
    const int64_t H = model->num_heads, KVH = model->num_kv_heads, qk_cols = (H + KVH) * D;
    const int64_t qkv_cols = qk_cols + KVH * D, widest = hidden > inter ? hidden : inter;
    bf16_amx_ready(); /* the tiles' status, known before any thread asks for it */
    uint16_t *normed = malloc(M * hidden * sizeof *normed), *qkv = malloc(M * qkv_cols * sizeof *qkv);
    uint16_t *attn16 = malloc(M * H * D * sizeof *attn16), *o = malloc(M * hidden * sizeof *o);
    uint16_t *gate_up = malloc(M * 2 * inter * sizeof *gate_up), *act = malloc(M * inter * sizeof *act);
    uint16_t *padded = malloc(32 * (widest > H * D ? widest : H * D) * sizeof *padded);
    float *qk = malloc(M * qk_cols * sizeof *qk), *q = malloc(M * H * D * sizeof *q);
    float *v = malloc(M * KVH * D * sizeof *v), *attn = malloc(M * H * D * sizeof *attn);
    attention_plan plan;
    model->attend_plan(step->seq_lens, step->starts, M, H, KVH, D, 1, &plan);
    const int threads = omp_get_max_threads();
    float *rows = malloc(SQUARES_ROWS * widest * threads * sizeof *rows); /* add_norm_team's */
    float *states = plan.tile_items ? malloc(plan.thread_floats * threads * sizeof(float)) : NULL;
    float *partial = plan.scratch_floats ? malloc(plan.scratch_floats * sizeof(float)) : NULL;
    int status = normed && qkv && attn16 && o && gate_up && act && padded && qk && q && v && attn && rows &&
                         (!plan.tile_items || states) && (!plan.scratch_floats || partial)
                     ? 0
                     : -2;
#pragma omp parallel if (status == 0) num_threads(threads)
    {
        float *row = rows + SQUARES_ROWS * widest * omp_get_thread_num();
        for (int64_t l = 0; l < model->num_layers && status == 0; ++l) {
            const bf16_layer *layer = (const bf16_layer *)model->layers + l;
            char *k_cache = step->kv[l];
            add_norm_team(h, residual, l == 0, layer->attn_norm, layer->attn_eps, normed, M, hidden, row);
            bf16_linear_team(normed, hidden, layer->qkv.packed, layer->qkv.bias, qkv, qkv_cols, M, qkv_cols, hidden,
                             padded);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; ++m) {
                for (int64_t i = 0; i < qk_cols; ++i) qk[m * qk_cols + i] = from_bf16(qkv[m * qkv_cols + i]);
                for (int64_t i = 0; i < KVH * D; ++i) v[m * KVH * D + i] = from_bf16(qkv[m * qkv_cols + qk_cols + i]);
            }
#pragma omp single
            {
                if (model->rotary(qk, step->positions, model->cos_table, model->sin_table, model->table_rows, M,
                                  H + KVH, D, qk_cols)) {
                    status = -1; /* as the PyTorch path: nothing written for this layer */
                } else {
                    for (int64_t i = 0; i < M * qk_cols; ++i) qk[i] = from_bf16(to_bf16(qk[i])); /* q, k in bf16 */
                    for (int64_t m = 0; m < M; ++m) memcpy(q + m * H * D, qk + m * qk_cols, H * D * sizeof *q);
                    model->write_kv(qk + H * D, v, qk_cols, KVH * D, k_cache, k_cache + step->v_offset, step->slots,
                                    M, KVH * D, step->slot_stride, step->kv_format);
                }
            } /* implicit barrier: every thread sees status */
            if (status) break;
            attend_team(model, step, &plan, k_cache, q, attn, partial, states);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < M * H * D; ++i) attn16[i] = to_bf16(attn[i]);
            bf16_linear_team(attn16, H * D, layer->o.packed, layer->o.bias, o, hidden, M, hidden, H * D, padded);
            add_norm_team(o, residual, 0, layer->ffn_norm, layer->ffn_eps, normed, M, hidden, row);
            bf16_linear_team(normed, hidden, layer->gate_up.packed, layer->gate_up.bias, gate_up, 2 * inter, M,
                             2 * inter, hidden, padded);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; ++m)
                swiglu_row_bf16(gate_up + m * 2 * inter, gate_up + m * 2 * inter + inter, act + m * inter, inter);
            bf16_linear_team(act, inter, layer->down.packed, layer->down.bias, h, hidden, M, hidden, inter, padded);
        }
    }
    free(normed), free(qkv), free(attn16), free(o), free(gate_up), free(act), free(padded);
    free(qk), free(q), free(v), free(attn), free(rows), free(states), free(partial);
    return status;
}
