/* A single stream's decode step through every decoder layer in one call: the Llama layer
 * (input RMSNorm, q|k|v projection, rotary, KV store, attention, output projection, residual
 * RMSNorm, gate|up projection, SiLU*up, down projection) for one token, with the same kernels and
 * the same roundings as the per-op path (kernels/cpu_kernels.py), in one OpenMP team.
 *
 * Per op, that path opens a parallel region for each projection and the attention (~5 a layer)
 * and runs Python in between; at one token a step is mostly weight reads of a few hundred
 * microseconds each, so the wake-up of the other thread (tens of microseconds here) and the
 * Python between ops were a third of it. Here the team lives for the whole step: the elementwise
 * work runs on one thread (omp single), the projections and the attention are shared out, and a
 * barrier separates each stage from the next.
 *
 * Built and loaded by kernels/cpu_kernels.py; engine/models/decode_row.py decides when it runs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "common.h"

int rms_norm(const void *x, int64_t x_outer, int64_t x_inner, void *residual, int64_t res_outer,
             const void *weight, int weight_dtype, void *out, int64_t out_outer, int64_t out_inner,
             int outer, int inner, int width, float eps, int dtype, int num_threads);
int rotary(void *x, int64_t x_token, int64_t x_head, int tokens, int heads, int width, const void *cos,
           const void *sin, int64_t cs_stride, int dtype, int num_threads);
int store_kv(const void *k, int64_t k_token, int64_t k_head, const void *v, int64_t v_token, int64_t v_head,
             const int64_t *slots, int tokens, int kv_heads, int width, void *k_cache, void *v_cache,
             int64_t cache_slots, int dtype);
int silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t out_stride, int rows, int width,
                 int dtype, int num_threads);

typedef struct {
    const void *input_norm, *post_norm; /* [hidden] of norm_dtype */
    lin_t qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* this layer's [kv_heads][num_blocks][block_size][head_dim] */
} row_layer_t;

typedef struct {
    int hidden, heads, kv_heads, head_dim, inter;
    int dtype, norm_dtype;
    float eps, scale;
    int64_t num_blocks;
    int block_size;
    const int32_t *table; /* the sequence's block table */
    int ctx;              /* keys it sees, this token's included */
    int64_t slot;         /* where this token's K/V go */
    const void *cos, *sin; /* [head_dim] rows for its position (RotaryEmbedding.cos_sin), dtype */
} row_step_t;

/* hidden [hidden]: in, the embedded token; out, the last layer's output. residual [hidden]: out,
 * the running residual (the final norm adds the two). 0, or 1 for shapes it does not take, 2
 * when memory could not be had. */
int decode_row(const row_layer_t *layers, int num_layers, const row_step_t *st, void *hidden, void *residual,
               int num_threads) {
#if !(defined(__AVX512F__) && defined(__AVX512BW__))
    (void)layers, (void)num_layers, (void)st, (void)hidden, (void)residual, (void)num_threads;
    return 1; /* the projections' team kernel is AVX-512 only (linear.c) */
#else
    const int H = st->hidden, D = st->head_dim, heads = st->heads, kvh = st->kv_heads;
    const int dtype = st->dtype, elem = elem_size(dtype);
    if (kvh < 1 || heads % kvh || D > MAX_HEAD_DIM || heads / kvh > MAX_GROUP || st->ctx < 1 || st->slot < 0 ||
        st->slot >= st->num_blocks * st->block_size)
        return 1;
    const int group = heads / kvh, qkv_n = (heads + 2 * kvh) * D;
    const int widest = H > heads * D ? (H > st->inter ? H : st->inter) : (heads * D > st->inter ? heads * D : st->inter);
    const int threads = num_threads > 0 ? num_threads : 1;
    const size_t att_floats = attend_scratch_floats(group, D, st->block_size, st->ctx);
    /* x (a norm's output), q|k|v, the attention's output, gate|up and the activation in dtype; x as
     * floats for the projections; each thread's attention scratch */
    const size_t typed = (size_t)H + qkv_n + (size_t)heads * D + 2 * (size_t)st->inter + st->inter;
    char *mem = malloc(typed * elem + sizeof(float) * ((size_t)widest + att_floats * threads) + 64);
    if (!mem) return 2;
    char *x = mem, *qkv = x + (size_t)H * elem, *att = qkv + (size_t)qkv_n * elem;
    char *gu = att + (size_t)heads * D * elem, *act = gu + 2 * (size_t)st->inter * elem;
    float *xf = (float *)(((uintptr_t)(act + (size_t)st->inter * elem) + 63) & ~(uintptr_t)63);
    float *att_scratch = xf + widest;
    const void *xh = dtype == DTYPE_BF16 ? x : NULL; /* bfloat16 inputs are dotted as stored */
    const void *atth = dtype == DTYPE_BF16 ? att : NULL, *acth = dtype == DTYPE_BF16 ? act : NULL;
    const int64_t cache_slots = st->num_blocks * st->block_size;
#pragma omp parallel num_threads(threads)
    {
        float *mine = att_scratch + att_floats * (size_t)omp_get_thread_num();
        for (int l = 0; l < num_layers; ++l) {
            const row_layer_t *L = layers + l;
#pragma omp single
            {
                if (l == 0) { /* the first norm has no residual yet: it is the embedding */
                    memcpy(residual, hidden, (size_t)H * elem);
                    rms_norm(hidden, H, 0, NULL, 0, L->input_norm, st->norm_dtype, x, H, 0, 1, 1, H, st->eps, dtype, 1);
                } else {
                    rms_norm(hidden, H, 0, residual, H, L->input_norm, st->norm_dtype, x, H, 0, 1, 1, H, st->eps,
                             dtype, 1);
                }
                to_float(x, dtype, xf, H);
            }
            linear_row_team(&L->qkv, xf, xh, qkv, dtype);
#pragma omp single
            {
                rotary(qkv, 0, D, 1, heads + kvh, D, st->cos, st->sin, 0, dtype, 1); /* q and k, side by side */
                const char *k = qkv + (size_t)heads * D * elem, *v = k + (size_t)kvh * D * elem;
                store_kv(k, 0, D, v, 0, D, &st->slot, 1, kvh, D, L->k_cache, L->v_cache, cache_slots, dtype);
            }
#pragma omp for schedule(static)
            for (int h = 0; h < kvh; ++h)
                attend_one(L->k_cache, L->v_cache, st->num_blocks, st->block_size, st->table, st->ctx, h,
                           qkv + (size_t)h * group * D * elem, (int64_t)D * elem, st->scale, group, D, dtype, mine,
                           att + (size_t)h * group * D * elem, (int64_t)D * elem);
#pragma omp single
            to_float(att, dtype, xf, heads * D);
            linear_row_team(&L->o, xf, atth, hidden, dtype);
#pragma omp single
            {
                rms_norm(hidden, H, 0, residual, H, L->post_norm, st->norm_dtype, x, H, 0, 1, 1, H, st->eps, dtype, 1);
                to_float(x, dtype, xf, H);
            }
            linear_row_team(&L->gate_up, xf, xh, gu, dtype);
#pragma omp single
            {
                silu_and_mul(gu, 2 * st->inter, act, st->inter, 1, st->inter, dtype, 1);
                to_float(act, dtype, xf, st->inter);
            }
            linear_row_team(&L->down, xf, acth, hidden, dtype);
        }
    }
    free(mem);
    return 0;
#endif
}
