/* Decode attention over a paged, head-major KV cache, for the CPU.
 *
 * The cache of one layer is [kv_heads][num_blocks][block_size][head_dim] (the torch backend's
 * layout). Each work item is one (decode sequence, KV head) pair: the query heads that share the
 * KV head are loaded once as float rows; then block by block, the block's keys are read once,
 * in place, converted to float and dotted with each of those rows; a float softmax over the
 * scores; the values are read once the same way and accumulated. No gather copy, no padding,
 * nothing multiplied that does not belong together. Items run in parallel on OpenMP threads (the
 * runtime torch has already loaded: the same libgomp.so.1).
 *
 * Element types: float32 and bfloat16 (DTYPE_* below); all arithmetic is in float32.
 * Built and loaded by kernels/cpu_kernels.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "common.h"

#define MAX_HEAD_DIM 512
#define MAX_GROUP 64
#define MAX_ACC_VECTORS 8 /* head dims up to 128 accumulate in registers */

typedef float v16f __attribute__((vector_size(64)));
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2 /* blocks requested ahead of the one being read */
#endif

/* Ask for a block's cache lines ahead of use: blocks are scattered, so the hardware prefetcher,
 * which follows one stream, stalls at every block boundary without this. */
static inline void prefetch_block(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

typedef struct {
    const char *k_cache, *v_cache; /* bytes */
    int64_t num_blocks;
    int block_size, dtype, elem;
} cache_t;

/* Per-thread scratch: the query rows, the accumulators, one block as floats, the scores. */
typedef struct {
    float *q, *acc, *block, *scores;
} scratch_t;

/* One (sequence, KV head): D is a compile-time constant in the common instantiations below. */
static inline __attribute__((always_inline)) void attend(
        const cache_t *c, const int32_t *table, int ctx, int kv_head, int group, const int D,
        const scratch_t *w) {
    float *restrict qf = w->q, *restrict acc = w->acc, *restrict blk = w->block, *restrict scores = w->scores;
    const int bs = c->block_size;
    const int64_t head_base = (int64_t)kv_head * c->num_blocks;
    const int64_t block_bytes = (int64_t)bs * D * c->elem;
    const int last = (ctx - 1) / bs;
    /* scores[j * ctx + pos] = q_j . k_pos */
    for (int b = 0; b < PREFETCH_BLOCKS && b <= last; ++b)
        prefetch_block(c->k_cache + (head_base + table[b]) * block_bytes, block_bytes);
    for (int pos0 = 0, b = 0; pos0 < ctx; pos0 += bs, ++b) {
        const int n = ctx - pos0 < bs ? ctx - pos0 : bs;
        const int ahead = b + PREFETCH_BLOCKS; /* past the keys: the first values */
        if (ahead <= last)
            prefetch_block(c->k_cache + (head_base + table[ahead]) * block_bytes, block_bytes);
        else if (ahead - last - 1 <= last)
            prefetch_block(c->v_cache + (head_base + table[ahead - last - 1]) * block_bytes, block_bytes);
        to_float(c->k_cache + (head_base + table[b]) * block_bytes, c->dtype, blk, n * D);
        for (int j = 0; j < group; ++j) {
            const float *restrict qj = qf + j * D;
            float *restrict sj = scores + j * ctx + pos0;
            for (int t = 0; t < n; ++t) {
                const float *restrict kt = blk + t * D;
                float s = 0.f;
                for (int d = 0; d < D; ++d) s += qj[d] * kt[d];
                sj[t] = s;
            }
        }
    }
    /* softmax per query head, in place; 1 / sum kept in acc's tail */
    for (int j = 0; j < group; ++j) {
        float *restrict s = scores + j * ctx;
        float m = s[0];
        for (int p = 1; p < ctx; ++p) m = s[p] > m ? s[p] : m;
        float sum = 0.f;
        for (int p = 0; p < ctx; ++p) {
            s[p] = fast_exp(s[p] - m);
            sum += s[p];
        }
        acc[group * D + j] = 1.f / sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)group * D);
    for (int pos0 = 0, b = 0; pos0 < ctx; pos0 += bs, ++b) {
        const int n = ctx - pos0 < bs ? ctx - pos0 : bs;
        if (b + PREFETCH_BLOCKS <= last)
            prefetch_block(c->v_cache + (head_base + table[b + PREFETCH_BLOCKS]) * block_bytes, block_bytes);
        to_float(c->v_cache + (head_base + table[b]) * block_bytes, c->dtype, blk, n * D);
        for (int j = 0; j < group; ++j) {
            const float *restrict p = scores + j * ctx + pos0;
            float *restrict aj = acc + j * D;
            if (D % 16 == 0 && D <= 16 * MAX_ACC_VECTORS) {
                /* the head's accumulator in registers across the block's tokens (a plain loop keeps
                 * it in memory: a store-to-load chain per token) */
                v16f a[MAX_ACC_VECTORS];
                for (int v = 0; v < D / 16; ++v) memcpy(&a[v], aj + 16 * v, sizeof(v16f));
                for (int t = 0; t < n; ++t) {
                    const v16f pt = {p[t], p[t], p[t], p[t], p[t], p[t], p[t], p[t],
                                     p[t], p[t], p[t], p[t], p[t], p[t], p[t], p[t]};
                    for (int v = 0; v < D / 16; ++v) {
                        v16f x;
                        memcpy(&x, blk + t * D + 16 * v, sizeof(v16f));
                        a[v] += pt * x;
                    }
                }
                for (int v = 0; v < D / 16; ++v) memcpy(aj + 16 * v, &a[v], sizeof(v16f));
            } else {
                for (int t = 0; t < n; ++t) {
                    const float pt = p[t];
                    const float *restrict vt = blk + t * D;
                    for (int d = 0; d < D; ++d) aj[d] += pt * vt[d];
                }
            }
        }
    }
}

/* For each i: out[tokens[i]] = attention of q[tokens[i]] over the first seq_lens[seq_ids[i]]
 * keys and values in the blocks of block_tables[seq_ids[i]]. Strides are in elements. Returns 0,
 * 1 for shapes it does not take, 2 when scratch memory could not be had. */
int paged_decode(const void *q, int64_t q_token_stride, int64_t q_head_stride, const void *k_cache,
                 const void *v_cache, int64_t num_blocks, int block_size, const int32_t *block_tables,
                 int64_t table_stride, const int32_t *seq_lens, const int32_t *seq_ids,
                 const int32_t *tokens, int num_decodes, int num_heads, int num_kv_heads, int head_dim,
                 float scale, void *out, int64_t out_token_stride, int64_t out_head_stride, int dtype,
                 int num_threads) {
    const int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    if (head_dim > MAX_HEAD_DIM || group < 1 || group > MAX_GROUP || group * num_kv_heads != num_heads ||
        (dtype != DTYPE_F32 && dtype != DTYPE_BF16))
        return 1;
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    const cache_t cache = {(const char *)k_cache, (const char *)v_cache, num_blocks, block_size, dtype, elem};
    int max_ctx = 1;
    for (int i = 0; i < num_decodes; ++i)
        max_ctx = seq_lens[seq_ids[i]] > max_ctx ? seq_lens[seq_ids[i]] : max_ctx;
    const int items = num_decodes * num_kv_heads;
    /* every thread's scratch in one allocation, made before the team starts: each thread reaches
     * the worksharing loop, and a decode step allocates once per layer, not four times a thread */
    const size_t q_len = (size_t)group * head_dim, acc_len = q_len + group;
    const size_t block_len = (size_t)block_size * head_dim, scores_len = (size_t)group * max_ctx;
    const size_t per_thread = q_len + acc_len + block_len + scores_len;
    const int threads = num_threads > 0 ? num_threads : 1;
    float *scratch = malloc(sizeof(float) * per_thread * threads);
    if (!scratch) return 2;
#pragma omp parallel num_threads(threads)
    {
        float *mine = scratch + per_thread * (size_t)omp_get_thread_num();
        const scratch_t w = {mine, mine + q_len, mine + q_len + acc_len, mine + q_len + acc_len + block_len};
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; ++item) {
            const int i = item / num_kv_heads, kv_head = item % num_kv_heads;
            const int seq = seq_ids[i], ctx = seq_lens[seq];
            if (ctx <= 0) continue;
            const int64_t token = tokens[i];
            const int h0 = kv_head * group;
            for (int j = 0; j < group; ++j) {
                const char *src = (const char *)q + (token * q_token_stride + (h0 + j) * q_head_stride) * elem;
                to_float(src, dtype, w.q + j * head_dim, head_dim);
                for (int d = 0; d < head_dim; ++d) w.q[j * head_dim + d] *= scale;
            }
            const int32_t *table = block_tables + (int64_t)seq * table_stride;
            if (head_dim == 64)
                attend(&cache, table, ctx, kv_head, group, 64, &w);
            else if (head_dim == 128)
                attend(&cache, table, ctx, kv_head, group, 128, &w);
            else
                attend(&cache, table, ctx, kv_head, group, head_dim, &w);
            for (int j = 0; j < group; ++j) {
                char *dst = (char *)out + (token * out_token_stride + (h0 + j) * out_head_stride) * elem;
                from_float(w.acc + j * head_dim, w.acc[group * head_dim + j], dtype, dst, head_dim);
            }
        }
    }
    free(scratch);
    return 0;
}
