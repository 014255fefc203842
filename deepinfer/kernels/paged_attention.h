/* How one call of the paged attention shares its rows out over threads (paged_attention.c), for
 * its callers: paged_decode_attention itself and decode_layers.c, which runs the items inside its
 * own parallel region. */
#ifndef DEEPINFER_PAGED_ATTENTION_H
#define DEEPINFER_PAGED_ATTENTION_H
#include <stdint.h>

/* The KV cache's element type (the kv_format argument): attention arithmetic is fp32 on each. */
enum { KV_FLOAT32 = 0, KV_FLOAT16 = 1, KV_BFLOAT16 = 2 };

typedef struct {
    int64_t parts;          /* parts of the longest row's context (1: no row is merged) */
    int64_t tile_items;     /* nonzero: an item is a (row tile, kv head) pair with all its parts */
    int64_t item_heads;     /* otherwise the kv heads of one item: 1, or every one (a part of a row) */
    int64_t items;          /* work items of the call */
    int64_t scratch_floats; /* the call's scratch: per-part items' states, merged after them (or 0) */
    int64_t thread_floats;  /* each thread's scratch: a tile item's states (or 0) */
} attention_plan;

#endif
