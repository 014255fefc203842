/* What the one-call layer stacks (decode_layers.c on GGUF weights, bf16_layers.c on bf16 ones)
 * share: the functions of the other kernel libraries they call through pointers, so that their
 * bits are those libraries' own, the step they run and the description of the stack. */
#ifndef DEEPINFER_LAYER_STEP_H
#define DEEPINFER_LAYER_STEP_H
#include <omp.h>
#include <stdint.h>

#include "paged_attention.h"

typedef int (*rotary_fn)(float *x, const int64_t *positions, const float *cos_table, const float *sin_table,
                         int64_t table_rows, int64_t tokens, int64_t heads, int64_t head_dim, int64_t token_stride);
typedef void (*write_kv_fn)(const float *k, const float *v, int64_t k_stride, int64_t v_stride, void *k_cache,
                            void *v_cache, const int64_t *slots, int64_t tokens, int64_t row, int64_t slot_stride,
                            int64_t kv_format);
typedef void (*attend_plan_fn)(const int64_t *seq_lens, const int64_t *seq_starts, int64_t num_seqs,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t tiles_allowed,
                               attention_plan *plan);
typedef void (*attend_item_fn)(const float *q, const void *k_cache, const void *v_cache, float *out,
                               const int64_t *block_tables, const int64_t *seq_lens, const int64_t *seq_starts,
                               int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t slot_stride, int64_t block_size, int64_t max_blocks, float scale,
                               int64_t kv_format, const attention_plan *plan, float *partial, float *states,
                               int64_t work);
typedef void (*attend_merge_fn)(float *out, const int64_t *seq_lens, const int64_t *seq_starts, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t parts, const float *partial,
                                int64_t pair);

/* One step: `rows` tokens, each a kernel row of the paged attention (the backend's prepare). */
typedef struct {
    int64_t rows;
    const int64_t *positions, *slots;                /* [rows] */
    const int64_t *block_tables, *seq_lens, *starts; /* [rows, max_blocks], [rows], [rows] or NULL */
    int64_t block_size, max_blocks;
    void *const *kv;   /* per layer: its cache tensor's first byte (slot 0's K) */
    int64_t v_offset;  /* bytes from a slot's K to its V */
    int64_t slot_stride, kv_format;
} decode_step;

/* A stack as the caller describes it once: shapes, its layers (the stack's own layer type), the
 * rotary tables and the other libraries' functions. */
typedef struct {
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim;
    const void *layers;                 /* decode_layer[] or bf16_layer[] */
    const float *cos_table, *sin_table; /* [table_rows, head_dim] */
    int64_t table_rows;
    float scale; /* softmax scale */
    rotary_fn rotary;
    write_kv_fn write_kv;
    attend_item_fn attend_item;   /* paged_attention_item */
    attend_merge_fn attend_merge; /* paged_decode_attention_merge */
    attend_plan_fn attend_plan;   /* paged_attention_plan */
} stack_model;

/* One layer's attention for the step, by every thread of the enclosing parallel region: the
 * plan's work items over q [rows, heads * head_dim] into out (the same shape, fp32), then the
 * merge of the parts where the plan leaves one; `states` is every thread's scratch
 * (plan->thread_floats each), `partial` the call's. */
static inline void attend_team(const stack_model *model, const decode_step *step, const attention_plan *plan,
                               char *k_cache, const float *q, float *out, float *partial, float *states) {
    const int64_t M = step->rows, H = model->num_heads, KVH = model->num_kv_heads, D = model->head_dim;
#pragma omp for schedule(dynamic, 1)
    for (int64_t work = 0; work < plan->items; ++work)
        model->attend_item(q, k_cache, k_cache + step->v_offset, out, step->block_tables, step->seq_lens, step->starts,
                           M, H, KVH, D, step->slot_stride, step->block_size, step->max_blocks, model->scale,
                           step->kv_format, plan, partial,
                           states ? states + omp_get_thread_num() * plan->thread_floats : NULL, work);
    if (!plan->tile_items && plan->parts > 1) {
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < M * KVH; ++pair)
            model->attend_merge(out, step->seq_lens, step->starts, H, KVH, D, plan->parts, partial, pair);
    }
}

#endif
