/* Decode attention over a paged KV cache (fp32 or fp16 K/V, fp32 arithmetic), for CPUs.
 *
 * One query token per sequence. Work is split over (sequence, kv head): the G query heads that
 * share a kv head (GQA) are processed together, so each key and value row is read from memory
 * once. Keys are visited block by block with an online softmax (running max and sum), so nothing
 * is gathered or padded: the cost is one pass over the sequence's KV. Within a block, scores,
 * exponentials and the value sum are separate loops the compiler vectorizes; exp is a polynomial
 * (relative error ~2e-7) so no vector math library is needed. An fp16 cache halves the bytes read
 * (decode attention is bound by them): each block's rows of the kv head are converted into a small
 * fp32 buffer first, and the same loops run on it.
 */
#include <float.h>
#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#define MAX_GROUP 32
#define MAX_HEAD_DIM 512
#define MAX_BLOCK 256
#define MAX_HALF_ROWS 8192 /* block_size * head_dim of an fp16 cache (the caller checks) */

/* exp(x) for x <= 0 (the only case here: scores minus their running max). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f; /* x / ln 2 */
    const float n = __builtin_floorf(t);
    const float f = t - n; /* in [0, 1) */
    /* 2^f, minimax polynomial of degree 6 */
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)n << 23; /* multiply by 2^n */
    memcpy(&p, &bits, sizeof p);
    return p;
}

/* The rows j = 0..n-1 of one block for kv head kvh, as fp32 rows `*row_stride` floats apart:
 * pointers into an fp32 cache, or an fp16 cache's rows converted into `buffer`. */
static inline const float *block_rows(const void *cache, int64_t kv_half, int64_t first_slot, int64_t n,
                                      int64_t slot_stride, int64_t offset, int64_t head_dim, float *buffer,
                                      int64_t *row_stride) {
    if (!kv_half) {
        *row_stride = slot_stride;
        return (const float *)cache + first_slot * slot_stride + offset;
    }
    const _Float16 *half = (const _Float16 *)cache + first_slot * slot_stride + offset;
    for (int64_t j = 0; j < n; ++j) {
        const _Float16 *src = half + j * slot_stride;
        float *dst = buffer + j * head_dim;
        int64_t d = 0;
#ifdef __F16C__
        /* The compiler converts _Float16 one element at a time; F16C does 8 per instruction. */
        for (; d + 8 <= head_dim; d += 8)
            _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
#endif
        for (; d < head_dim; ++d) dst[d] = (float)src[d];
    }
    *row_stride = head_dim;
    return buffer;
}

/* Work item `work` of paged_decode_attention (below): row work / num_kv_heads, kv head
 * work % num_kv_heads. Exported so that a caller already running on every thread
 * (decode_layers.c) can share the items out itself; never inlined, so both callers run the same
 * instructions. */
__attribute__((noinline)) void paged_decode_attention_item(
    const float *q, const void *k_cache, const void *v_cache, float *out, const int64_t *block_tables,
    const int64_t *seq_lens, const int64_t *seq_starts, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t slot_stride, int64_t block_size, int64_t max_blocks, float scale, int64_t kv_half, int64_t work) {
    const int64_t element = kv_half ? 2 : 4;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t s = work / num_kv_heads;
    const int64_t kvh = work % num_kv_heads;
    const int64_t len = seq_lens[s];
    const int64_t *table = block_tables + s * max_blocks;
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float qs[MAX_GROUP][MAX_HEAD_DIM];
    float m[MAX_GROUP], l[MAX_GROUP];
    float scores[MAX_GROUP][MAX_BLOCK];
    float k_buffer[MAX_HALF_ROWS], v_buffer[MAX_HALF_ROWS];
    for (int64_t g = 0; g < group; ++g) {
        const float *src = q + (s * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
            qs[g][d] = src[d] * scale; /* fold the softmax scale into q once */
            acc[g][d] = 0.0f;
        }
        m[g] = -FLT_MAX;
        l[g] = 0.0f;
    }
    for (int64_t start = seq_starts ? seq_starts[s] : 0; start < len;) {
        const int64_t offset = start % block_size;
        const int64_t room = block_size - offset;
        const int64_t n = (len - start < room) ? len - start : room;
        const int64_t base = table[start / block_size] * block_size + offset;
        if (start + n < len) {
            /* The next block's rows are scattered (one per slot, slot_stride apart): ask for
             * them now so the loads overlap this block's arithmetic. */
            const int64_t next = table[start / block_size + 1] * block_size;
            for (int64_t j = 0; j < block_size; ++j) {
                const int64_t at = ((next + j) * slot_stride + kvh * head_dim) * element;
                for (int64_t b = 0; b < head_dim * element; b += 64) { /* one per 64-byte line */
                    __builtin_prefetch((const char *)k_cache + at + b);
                    __builtin_prefetch((const char *)v_cache + at + b);
                }
            }
        }
        int64_t k_stride, v_stride;
        const float *k_rows = block_rows(k_cache, kv_half, base, n, slot_stride, kvh * head_dim, head_dim,
                                         k_buffer, &k_stride);
        for (int64_t j = 0; j < n; ++j) {
            const float *k = k_rows + j * k_stride;
            for (int64_t g = 0; g < group; ++g) {
                const float *qg = qs[g];
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * k[d];
                scores[g][j] = dot;
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            float *sg = scores[g];
            float block_max = m[g];
            for (int64_t j = 0; j < n; ++j) block_max = sg[j] > block_max ? sg[j] : block_max;
            float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
            for (int64_t j = 0; j < n; ++j) {
                sg[j] = exp_nonpositive(sg[j] - block_max);
                block_sum += sg[j];
            }
            const float correction = exp_nonpositive(m[g] - block_max);
            l[g] = l[g] * correction + block_sum;
            m[g] = block_max;
            float *a = acc[g];
            if (correction != 1.0f) {
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
            }
        }
        const float *v_rows = block_rows(v_cache, kv_half, base, n, slot_stride, kvh * head_dim, head_dim,
                                         v_buffer, &v_stride);
        for (int64_t j = 0; j < n; ++j) {
            const float *v = v_rows + j * v_stride;
            for (int64_t g = 0; g < group; ++g) {
                const float p = scores[g][j];
                float *a = acc[g];
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
            }
        }
        start += n;
    }
    for (int64_t g = 0; g < group; ++g) {
        float *o = out + (s * num_heads + kvh * group + g) * head_dim;
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[g][d] * inv;
    }
}

void paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, float *out,
                            const int64_t *block_tables, const int64_t *seq_lens,
                            const int64_t *seq_starts, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t slot_stride,
                            int64_t block_size, int64_t max_blocks, float scale, int64_t kv_half) {
    /* k_cache/v_cache point at slot 0's K and V; consecutive slots are slot_stride elements apart
     * (float, or _Float16 when kv_half). Row s attends to positions seq_starts[s] .. seq_lens[s]-1
     * (seq_starts NULL: from 0; a sliding window starts later). */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t work = 0; work < num_seqs * num_kv_heads; ++work)
        paged_decode_attention_item(q, k_cache, v_cache, out, block_tables, seq_lens, seq_starts, num_heads,
                                    num_kv_heads, head_dim, slot_stride, block_size, max_blocks, scale, kv_half,
                                    work);
}

/* Store a step's K and V (fp32, `row` values per token, tokens k_stride / v_stride apart) at
 * their cache slots: k_cache/v_cache point at slot 0's K and V, slots are slot_stride elements
 * apart; converted to fp16 (round to nearest even, as torch does) when kv_half. One call instead
 * of a strided index copy per tensor, whose overhead dominates at batch 1. */
void paged_write_kv(const float *k, const float *v, int64_t k_stride, int64_t v_stride, void *k_cache,
                    void *v_cache, const int64_t *slots, int64_t tokens, int64_t row, int64_t slot_stride,
                    int64_t kv_half) {
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t at = slots[t] * slot_stride;
        const float *kt = k + t * k_stride, *vt = v + t * v_stride;
        if (kv_half) {
            _Float16 *kd = (_Float16 *)k_cache + at, *vd = (_Float16 *)v_cache + at;
            for (int64_t i = 0; i < row; ++i) {
                kd[i] = (_Float16)kt[i];
                vd[i] = (_Float16)vt[i];
            }
        } else {
            memcpy((float *)k_cache + at, kt, row * sizeof(float));
            memcpy((float *)v_cache + at, vt, row * sizeof(float));
        }
    }
}
