/* A Llama decoder stack on GGUF-packed weights for a step whose rows all attend through the
 * paged decode kernel (decodes and short chunks), in one call from Python.
 *
 * Layer by layer it makes the calls the PyTorch model makes (llama.py with gguf_linear.py):
 * q/k/v with the RMSNorm and residual add fused in, rotary embedding, the K/V write, paged
 * attention, o_proj, gate/up with the second RMSNorm, down with SwiGLU. At batch 1 the arithmetic
 * of a layer takes a few hundred microseconds while driving those seven calls from Python cost
 * about as much again (tensor views, allocations, ctypes argument conversion); here the loop is C.
 *
 * The bits are those of the PyTorch path: the products are gguf_matmul.c itself (included, built
 * with the same flags), and rotary, the K/V write and attention are the functions of rowwise.c
 * and paged_attention.c, called through pointers the caller takes from those libraries.
 */
#include <omp.h>

#include "gguf_matmul.c"
#include "layer_step.h"

/* Packed matrices multiplied as one (a PackedGroup): count segments, all of `cols` columns. */
typedef struct {
    int64_t count, rows;
    const int32_t *qtypes;
    const void *const *weights;
    const int64_t *row_counts;
} packed_group;

typedef struct {
    packed_group qkv, o, gate_up, down;
    const float *attn_norm, *ffn_norm;
    float attn_eps, ffn_eps;
} decode_layer;


static int64_t group_scratch(const packed_group *g, int64_t M, int64_t K) {
    return gguf_scratch_bytes(M, K, g->count, g->qtypes);
}

static void group_matmul(const packed_group *g, const float *x, int64_t M, int64_t K, int64_t ldx, void *scratch,
                         float *y, int prologue, const float *residual, float *sum, const float *norm, float eps) {
    matmul_team(x, M, K, ldx, g->count, g->qtypes, g->weights, g->row_counts, scratch, y, g->rows, PATH_TILES, prologue,
                residual, sum, norm, eps);
}

/* h [rows, hidden]: in, the embeddings; out, the last layer's output (before the final norm).
 * residual [rows, hidden]: out, the residual stream beside it. Returns 0, -1 if a position lies
 * outside the rotary tables (that layer's K/V not written, nothing after computed), -2 out of memory. */
int decode_layers(const stack_model *model, const decode_step *step, float *h, float *residual) {
    const int64_t M = step->rows, hidden = model->hidden, inter = model->intermediate, D = model->head_dim;
    const int64_t H = model->num_heads, KVH = model->num_kv_heads, qkv_rows = (H + 2 * KVH) * D;
    int64_t scratch_bytes = 0;
    for (int64_t l = 0; l < model->num_layers; ++l) {
        const decode_layer *layer = (const decode_layer *)model->layers + l;
        const int64_t need[4] = {group_scratch(&layer->qkv, M, hidden), group_scratch(&layer->o, M, H * D),
                                 group_scratch(&layer->gate_up, M, hidden), group_scratch(&layer->down, M, inter)};
        for (int i = 0; i < 4; ++i) scratch_bytes = need[i] > scratch_bytes ? need[i] : scratch_bytes;
    }
    float *qkv = malloc(M * qkv_rows * sizeof(float)), *q = malloc(M * H * D * sizeof(float));
    float *attn = malloc(M * H * D * sizeof(float)), *o = malloc(M * hidden * sizeof(float));
    float *gate_up = malloc(M * 2 * inter * sizeof(float));
    void *scratch = malloc(scratch_bytes);
    /* the attention's work items and their scratch, as paged_decode_attention plans them */
    attention_plan plan;
    model->attend_plan(step->seq_lens, step->starts, M, H, KVH, D, 1, &plan);
    const int threads = omp_get_max_threads();
    float *states = plan.tile_items ? malloc(plan.thread_floats * threads * sizeof(float)) : NULL;
    float *partial = plan.scratch_floats ? malloc(plan.scratch_floats * sizeof(float)) : NULL;
    int status = qkv && q && attn && o && gate_up && scratch && (!plan.tile_items || states) &&
                         (!plan.scratch_floats || partial)
                     ? 0
                     : -2;
    /* One parallel region for the whole step: its threads share out each product's rows and the
     * attention's items, and do the small steps in between on one thread (the
     * seven thread starts per layer of separate calls cost more than the barriers). */
#pragma omp parallel if (status == 0) num_threads(threads)
    for (int64_t l = 0; l < model->num_layers && status == 0; ++l) {
        const decode_layer *layer = (const decode_layer *)model->layers + l;
        char *k_cache = step->kv[l];
        /* the first layer's residual stream is its input */
        group_matmul(&layer->qkv, h, M, hidden, hidden, scratch, qkv, PROLOGUE_RMS_NORM, l ? residual : NULL,
                     residual, layer->attn_norm, layer->attn_eps);
#pragma omp single
        {
            if (model->rotary(qkv, step->positions, model->cos_table, model->sin_table, model->table_rows, M,
                              H + KVH, D, qkv_rows)) {
                status = -1; /* as the PyTorch path: nothing written for this layer */
            } else {
                model->write_kv(qkv + H * D, qkv + (H + KVH) * D, qkv_rows, qkv_rows, k_cache,
                                k_cache + step->v_offset, step->slots, M, KVH * D, step->slot_stride, step->kv_format);
                for (int64_t m = 0; m < M; ++m) memcpy(q + m * H * D, qkv + m * qkv_rows, H * D * sizeof(float));
            }
        } /* implicit barrier: every thread sees status */
        if (status) break;
        attend_team(model, step, &plan, k_cache, q, attn, partial, states);
        group_matmul(&layer->o, attn, M, H * D, H * D, scratch, o, PROLOGUE_NONE, NULL, NULL, NULL, 0.0f);
        group_matmul(&layer->gate_up, o, M, hidden, hidden, scratch, gate_up, PROLOGUE_RMS_NORM, residual, residual,
                     layer->ffn_norm, layer->ffn_eps);
        group_matmul(&layer->down, gate_up, M, inter, 2 * inter, scratch, h, PROLOGUE_SWIGLU, NULL, NULL, NULL, 0.0f);
    }
    free(qkv), free(q), free(attn), free(o), free(gate_up), free(scratch), free(states), free(partial);
    return status;
}
