/* Decode attention over a paged, head-major KV cache, for the CPU.
 *
 * The cache of one layer is [kv_heads][num_blocks][block_size][head_dim] (the torch backend's
 * layout). Each work item is one (decode sequence, KV head) pair: the query heads that share the
 * KV head are loaded once as float rows, then every key of the sequence is read once, in place
 * from its block, converted to float and dotted with each of those rows; a float softmax over
 * the scores; every value is read once and accumulated. No gather copy, no padding, nothing
 * multiplied that does not belong together. Items run in parallel over OpenMP threads (the
 * runtime torch already loaded: the same libgomp.so.1).
 *
 * Built and loaded by kernels/cpu_attention.py; one entry point per element type.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float load_f32(const float *p) { return *p; }
static inline float load_bf16(const bf16_t *p) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)(*p) << 16;
    return x.f;
}
static inline void store_f32(float *p, float v) { *p = v; }
static inline void store_bf16(bf16_t *p, float v) {
    union { uint32_t u; float f; } x;
    x.f = v;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) {  /* NaN stays NaN */
        *p = (bf16_t)((x.u >> 16) | 0x40u);
        return;
    }
    x.u += 0x7fffu + ((x.u >> 16) & 1u);  /* round to nearest even */
    *p = (bf16_t)(x.u >> 16);
}

/* exp(x) for x <= 0 (scores minus their maximum), in a form the compiler vectorizes: x = n ln2 + r
 * with |r| <= ln2 / 2, exp(r) by its Taylor polynomial to r^7 (relative error < 2e-7 there), 2^n
 * put into the exponent bits. Below -87 the result is 0 (float's smallest normal is e^-87.3). */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = __builtin_roundf(clamped * 1.44269504088896341f);
    const float r = (clamped - n * 0.693145751953125f) - n * 1.42860682030941723e-06f;
    float p = 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return x < -87.0f ? 0.f : p * scale.f;
}

#define MAX_HEAD_DIM 512

#define DEFINE_PAGED_DECODE(NAME, T, LOAD, STORE)                                                 \
static inline __attribute__((always_inline)) void NAME##_item(                                   \
        const T *q, int64_t q_token_stride, int64_t q_head_stride,                               \
        const T *k_cache, const T *v_cache, int64_t num_blocks, int block_size,                  \
        const int32_t *table, int ctx, int token, int kv_head, int group, int D, float scale,    \
        T *out, int64_t out_token_stride, int64_t out_head_stride, float *qf, float *scores,     \
        float *acc, float *vf) {                                                                             \
    float row[MAX_HEAD_DIM];                                                                      \
    const int h0 = kv_head * group;                                                               \
    for (int j = 0; j < group; ++j) {                                                             \
        const T *src = q + token * q_token_stride + (int64_t)(h0 + j) * q_head_stride;           \
        for (int d = 0; d < D; ++d) qf[j * D + d] = LOAD(src + d) * scale;                        \
    }                                                                                             \
    const int64_t head_base = (int64_t)kv_head * num_blocks;                                      \
    /* scores[j * ctx + pos] = q_j . k_pos */                                                    \
    for (int pos0 = 0, b = 0; pos0 < ctx; pos0 += block_size, ++b) {                              \
        const int n = ctx - pos0 < block_size ? ctx - pos0 : block_size;                         \
        const T *kb = k_cache + (head_base + table[b]) * block_size * D;                          \
        for (int t = 0; t < n; ++t) {                                                             \
            const T *kr = kb + (int64_t)t * D;                                                    \
            for (int d = 0; d < D; ++d) row[d] = LOAD(kr + d);                                    \
            for (int j = 0; j < group; ++j) {                                                     \
                const float *qj = qf + j * D;                                                     \
                float s = 0.f;                                                                    \
                for (int d = 0; d < D; ++d) s += qj[d] * row[d];                                  \
                scores[j * ctx + pos0 + t] = s;                                                   \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    /* softmax per query head, in place; 1 / sum kept for the end */                             \
    float inv_sum[64];                                                                            \
    for (int j = 0; j < group; ++j) {                                                             \
        float *s = scores + j * ctx;                                                              \
        float m = s[0];                                                                           \
        for (int p = 1; p < ctx; ++p) m = s[p] > m ? s[p] : m;                                    \
        float sum = 0.f;                                                                          \
        for (int p = 0; p < ctx; ++p) {                                                           \
            s[p] = exp_nonpositive(s[p] - m);                                                                \
            sum += s[p];                                                                          \
        }                                                                                         \
        inv_sum[j] = 1.f / sum;                                                                   \
    }                                                                                             \
    memset(acc, 0, sizeof(float) * group * D);                                                    \
    for (int pos0 = 0, b = 0; pos0 < ctx; pos0 += block_size, ++b) {                              \
        const int n = ctx - pos0 < block_size ? ctx - pos0 : block_size;                         \
        const T *vb = v_cache + (head_base + table[b]) * block_size * D;                          \
        for (int i = 0; i < n * D; ++i) vf[i] = LOAD(vb + i);  /* the block as floats, once */    \
        for (int j = 0; j < group; ++j) {                                                         \
            const float *p = scores + j * ctx + pos0;                                             \
            float a[MAX_HEAD_DIM];                                                                \
            for (int d = 0; d < D; ++d) a[d] = acc[j * D + d];                                    \
            for (int t = 0; t < n; ++t)                                                           \
                for (int d = 0; d < D; ++d) a[d] += p[t] * vf[t * D + d];                         \
            for (int d = 0; d < D; ++d) acc[j * D + d] = a[d];                                    \
        }                                                                                         \
    }                                                                                             \
    for (int j = 0; j < group; ++j) {                                                             \
        T *dst = out + token * out_token_stride + (int64_t)(h0 + j) * out_head_stride;           \
        for (int d = 0; d < D; ++d) STORE(dst + d, acc[j * D + d] * inv_sum[j]);                 \
    }                                                                                             \
}                                                                                                 \
                                                                                                  \
int NAME(const T *q, int64_t q_token_stride, int64_t q_head_stride, const T *k_cache,            \
         const T *v_cache, int64_t num_blocks, int block_size, const int32_t *block_tables,      \
         int64_t table_stride, const int32_t *seq_lens, const int32_t *seq_ids,                   \
         const int32_t *tokens, int num_decodes, int num_heads, int num_kv_heads, int head_dim,  \
         float scale, T *out, int64_t out_token_stride, int64_t out_head_stride,                 \
         int num_threads) {                                                                       \
    const int group = num_heads / num_kv_heads;                                                   \
    if (head_dim > MAX_HEAD_DIM || group > 64 || group * num_kv_heads != num_heads) return 1;     \
    int max_ctx = 0;                                                                              \
    for (int i = 0; i < num_decodes; ++i)                                                         \
        max_ctx = seq_lens[seq_ids[i]] > max_ctx ? seq_lens[seq_ids[i]] : max_ctx;                \
    const int items = num_decodes * num_kv_heads;                                                 \
    int failed = 0;                                                                               \
    _Pragma("omp parallel num_threads(num_threads) reduction(|:failed)")                         \
    {                                                                                             \
        float *qf = malloc(sizeof(float) * group * head_dim);                                     \
        float *acc = malloc(sizeof(float) * group * head_dim);                                    \
        float *scores = malloc(sizeof(float) * group * (size_t)(max_ctx > 0 ? max_ctx : 1));     \
        float *vf = malloc(sizeof(float) * (size_t)block_size * head_dim);                        \
        if (!qf || !acc || !scores || !vf) {                                                             \
            failed = 1;                                                                           \
        } else {                                                                                  \
            _Pragma("omp for schedule(dynamic, 1)")                                               \
            for (int item = 0; item < items; ++item) {                                            \
                const int i = item / num_kv_heads, kv_head = item % num_kv_heads;                 \
                const int seq = seq_ids[i];                                                       \
                const int ctx = seq_lens[seq];                                                    \
                if (ctx <= 0) continue;                                                           \
                const int32_t *table = block_tables + (int64_t)seq * table_stride;               \
                if (head_dim == 64)                                                               \
                    NAME##_item(q, q_token_stride, q_head_stride, k_cache, v_cache, num_blocks,   \
                                block_size, table, ctx, tokens[i], kv_head, group, 64, scale,     \
                                out, out_token_stride, out_head_stride, qf, scores, acc, vf);         \
                else if (head_dim == 128)                                                         \
                    NAME##_item(q, q_token_stride, q_head_stride, k_cache, v_cache, num_blocks,   \
                                block_size, table, ctx, tokens[i], kv_head, group, 128, scale,    \
                                out, out_token_stride, out_head_stride, qf, scores, acc, vf);         \
                else                                                                              \
                    NAME##_item(q, q_token_stride, q_head_stride, k_cache, v_cache, num_blocks,   \
                                block_size, table, ctx, tokens[i], kv_head, group, head_dim,      \
                                scale, out, out_token_stride, out_head_stride, qf, scores, acc, vf);  \
            }                                                                                     \
        }                                                                                         \
        free(qf);                                                                                 \
        free(acc);                                                                                \
        free(scores);                                                                             \
        free(vf);                                                                                 \
    }                                                                                             \
    return failed ? 2 : 0;                                                                        \
}

DEFINE_PAGED_DECODE(paged_decode_f32, float, load_f32, store_f32)
DEFINE_PAGED_DECODE(paged_decode_bf16, bf16_t, load_bf16, store_bf16)
