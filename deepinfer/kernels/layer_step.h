/* What the one-call layer stacks (decode_layers.c on GGUF weights, bf16_layers.c on bf16 ones)
 * share: the functions of the other kernel libraries they call through pointers, so that their
 * bits are those libraries' own, and the step they run. */
#ifndef DEEPINFER_LAYER_STEP_H
#define DEEPINFER_LAYER_STEP_H
#include <stdint.h>

#include "paged_attention.h"

typedef int (*rotary_fn)(float *x, const int64_t *positions, const float *cos_table, const float *sin_table,
                         int64_t table_rows, int64_t tokens, int64_t heads, int64_t head_dim, int64_t token_stride);
typedef void (*write_kv_fn)(const float *k, const float *v, int64_t k_stride, int64_t v_stride, void *k_cache,
                            void *v_cache, const int64_t *slots, int64_t tokens, int64_t row, int64_t slot_stride,
                            int64_t kv_half);
typedef void (*attend_plan_fn)(const int64_t *seq_lens, const int64_t *seq_starts, int64_t num_seqs,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t tiles_allowed,
                               attention_plan *plan);
typedef void (*attend_item_fn)(const float *q, const void *k_cache, const void *v_cache, float *out,
                               const int64_t *block_tables, const int64_t *seq_lens, const int64_t *seq_starts,
                               int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t slot_stride, int64_t block_size, int64_t max_blocks, float scale,
                               int64_t kv_half, const attention_plan *plan, float *partial, float *states,
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
    int64_t slot_stride, kv_half;
} decode_step;

#endif
