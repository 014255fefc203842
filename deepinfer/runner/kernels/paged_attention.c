/* Decode attention over a paged KV cache, fp32, for CPUs.
 *
 * One query token per sequence. Work is split over (sequence, kv head): the G query heads that
 * share a kv head (GQA) are processed together, so each key and value row is read from memory
 * once. Keys are visited block by block with an online softmax (running max and sum), so nothing
 * is gathered or padded: the cost is one pass over the sequence's KV.
 */
#include <math.h>
#include <stdint.h>

#define MAX_GROUP 32
#define MAX_HEAD_DIM 512
#define MAX_BLOCK 256

void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, float *out,
                            const int64_t *block_tables, const int64_t *seq_lens, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t slot_stride,
                            int64_t block_size, int64_t max_blocks, float scale) {
    /* k_cache/v_cache point at slot 0's K and V; consecutive slots are slot_stride floats apart. */
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = slot_stride;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t work = 0; work < num_seqs * num_kv_heads; ++work) {
        const int64_t s = work / num_kv_heads;
        const int64_t kvh = work % num_kv_heads;
        const int64_t len = seq_lens[s];
        const int64_t *table = block_tables + s * max_blocks;
        float acc[MAX_GROUP][MAX_HEAD_DIM];
        float m[MAX_GROUP], l[MAX_GROUP];
        float scores[MAX_GROUP][MAX_BLOCK];
        const float *qs[MAX_GROUP];
        for (int64_t g = 0; g < group; ++g) {
            qs[g] = q + (s * num_heads + kvh * group + g) * head_dim;
            m[g] = -INFINITY;
            l[g] = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) acc[g][d] = 0.0f;
        }
        for (int64_t start = 0; start < len; start += block_size) {
            const int64_t n = (len - start < block_size) ? len - start : block_size;
            const int64_t base = table[start / block_size] * block_size;
            for (int64_t j = 0; j < n; ++j) {
                const float *k = k_cache + (base + j) * row + kvh * head_dim;
                for (int64_t g = 0; g < group; ++g) {
                    const float *qg = qs[g];
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * k[d];
                    scores[g][j] = dot * scale;
                }
            }
            for (int64_t g = 0; g < group; ++g) {
                float block_max = m[g];
                for (int64_t j = 0; j < n; ++j) block_max = scores[g][j] > block_max ? scores[g][j] : block_max;
                const float correction = expf(m[g] - block_max);
                l[g] *= correction;
                for (int64_t d = 0; d < head_dim; ++d) acc[g][d] *= correction;
                for (int64_t j = 0; j < n; ++j) {
                    const float p = expf(scores[g][j] - block_max);
                    const float *v = v_cache + (base + j) * row + kvh * head_dim;
                    l[g] += p;
                    float *a = acc[g];
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
                }
                m[g] = block_max;
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            float *o = out + (s * num_heads + kvh * group + g) * head_dim;
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[g][d] * inv;
        }
    }
}
