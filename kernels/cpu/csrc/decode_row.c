/* A decode step through every decoder layer in one call: the Llama layer (input RMSNorm, q|k|v
 * projection, rotary, KV store, attention, output projection, residual RMSNorm, gate|up
 * projection, SiLU*up, down projection) for one token of each sequence, with the same kernels and
 * the same roundings as the per-op path (kernels/cpu/bindings.py), in one OpenMP team. The
 * projections run in gemm.c's tiles where every one has its packed copy (bfloat16; any number of
 * rows), else in linear.c's row kernel (up to MAX_FUSED_ROWS rows).
 *
 * Per op, that path opens a parallel region for each projection and the attention (~5 a layer)
 * and runs Python in between; at one token a step is mostly weight reads of a few hundred
 * microseconds each, so the wake-up of the other thread (tens of microseconds here) and the
 * Python between ops were a third of it. Here the team lives for the whole step: the elementwise
 * work runs on one thread (omp single), the projections and the attention are shared out, and a
 * barrier separates each stage from the next. The order of the stages is LlamaDecoderLayer.forward's
 * (engine/models/llama.py), layer 0's residual rule included: a change there belongs here too; a
 * layer with Gemma's four norms follows Gemma2DecoderLayer.forward's (engine/models/gemma2.py),
 * with QK-norm (Gemma 3), a rotary table per layer, the attention logit soft cap and GELU-tanh.
 * Each layer reads its own KV cache group's block tables and slots (several groups: window and
 * full layers, engine/kv_cache/groups.py).
 *
 * decode_row_hybrid (at the end) does the same for a hybrid's layers (Qwen3.5: Gated DeltaNet and
 * gated full attention), with csrc/gated_delta.c's item and row functions.
 *
 * Built and loaded by kernels/cpu_kernels.py; engine/models/decode_row.py decides when it runs. On
 * x86 CPUs without AVX-512 it takes the steps whose projections all go through gemm.c (its AVX2
 * build: bfloat16 weights with their packed copies), or all through linear_avx2.c's row kernel
 * (int8 and int4 weights, up to MAX_FUSED_ROWS rows).
 */
#include <limits.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <omp.h>

#include "common.h"
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h> /* __rdtsc, _mm_pause */
#define HAVE_FUSED_STEP 1
#else
#define HAVE_FUSED_STEP 0
#endif

typedef struct {
    const void *input_norm, *post_norm; /* [hidden] of norm_dtype */
    lin_t qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* this layer's [kv_heads][num_blocks][block_size] rows (kv_row_bytes) */
    int window;              /* its sliding window in keys, 0 for none */
    int rope;                /* q and k turn by rotary table rope - 1 of the step; 0: unrotated (SmolLM3's NoPE layers) */
    /* Gemma's layer (engine/models/gemma2.py) where both are set: post_norm norms the attention's
     * output alone, pre_mlp_norm adds it to the residual and norms the sum for the MLP, post_mlp_norm
     * norms the MLP's output; NULL: Llama's (post_norm adds and norms) */
    const void *pre_mlp_norm, *post_mlp_norm;
    const void *q_norm, *k_norm; /* [head_dim] of norm_dtype: each q and k head normed before the rotary (Gemma 3), or NULL */
    float soft_cap;              /* attention scores capped at soft_cap (Gemma 2), 0: none */
    int act;                     /* the MLP's gate: ACT_SILU or ACT_GELU_TANH */
    int group;                   /* its KV cache group: the step's block tables and slots it reads */
} row_layer_t;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

typedef struct {
    int rows; /* tokens, one per sequence: 1..MAX_FUSED_ROWS, any number where every projection is packed */
    int hidden, heads, kv_heads, head_dim, inter;
    int dtype, norm_dtype, cache_dtype; /* cache_dtype: dtype, or KV_INT8 (common.h) */
    float eps, scale;
    int64_t num_blocks;
    int block_size;
    int num_groups;                /* KV cache groups (engine/kv_cache/groups.py), each with its own tables */
    const int32_t *const *tables;  /* per group: row r's block table at tables[g] + r * table_stride[g] */
    const int64_t *table_stride;
    const int32_t *ctx;            /* [rows]: keys each row sees, its own included (every group) */
    const int64_t *const *slots;   /* per group: [rows], where each row's K/V go */
    int num_rope;                  /* rotary tables (Gemma 3: local and global bases) */
    const void *const *cos, *const *sin; /* per table: [rows][head_dim] for their positions (RotaryEmbedding.cos_sin), dtype */
} row_step_t;

/* The team's barrier between the stages of a step. OpenMP's own barrier waits the way
 * GOMP_SPINCOUNT says; at the 1,000 rounds kvserve set until 2026-12-03, a thread that waited
 * more than a few microseconds at one of the step's ~10 barriers a layer went to sleep and was
 * woken by a futex (~120 context switches a one-row step). Inside a step the waits are
 * microseconds (a norm on one thread, an attention head more on one side), so here a waiting
 * thread spins up to SPIN_CYCLES of the time-stamp counter whatever GOMP_SPINCOUNT says, then
 * sleeps on a futex (a thread the OS took away from the team for longer does not keep a CPU busy
 * for nothing). The atomics are sequentially consistent: a sleeper announces itself before it
 * checks the generation, the last arrival moves the generation before it counts the sleepers,
 * so one of them sees the other. */
#if HAVE_FUSED_STEP /* (x86: the time-stamp counter; the fused step is built only there) */
/* ~70 us at the development VM's ~2.6 GHz time-stamp counter */
#define SPIN_CYCLES 200000

typedef struct {
    atomic_int arrived, generation, sleepers;
    int size;
} team_barrier_t;

static void team_barrier(team_barrier_t *b) {
    const int gen = atomic_load(&b->generation);
    if (atomic_fetch_add(&b->arrived, 1) == b->size - 1) {
        atomic_store(&b->arrived, 0);
        atomic_fetch_add(&b->generation, 1);
#ifdef __linux__
        if (atomic_load(&b->sleepers) > 0) syscall(SYS_futex, &b->generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
        return;
    }
    const uint64_t start = __rdtsc();
    while (atomic_load(&b->generation) == gen) {
        if (__rdtsc() - start < SPIN_CYCLES) {
            _mm_pause();
            continue;
        }
#ifdef __linux__
        atomic_fetch_add(&b->sleepers, 1);
        if (atomic_load(&b->generation) == gen) /* the futex sleeps only while it still holds gen */
            syscall(SYS_futex, &b->generation, FUTEX_WAIT_PRIVATE, gen, NULL, NULL, 0);
        atomic_fetch_sub(&b->sleepers, 1);
#else
        sched_yield();
#endif
    }
}
#endif

/* Whether gemm.c multiplies L here: bfloat16 with its packed copy. */
static int gemm_takes(const lin_t *L, int dtype) {
    return dtype == DTYPE_BF16 && L->kind == W_BF16 && L->packed != NULL && gemm_bf16_available() &&
           L->n_out % GEMM_VEC == 0 && L->k_in % 2 == 0;
}

/* y = x L^T for the step's rows, a team's part: in gemm.c's tiles over the packed copy (xh: x in
 * bfloat16) where every projection has one, as the per-op path multiplies them
 * (engine/layers/linear.py): a row's result then does not depend on how many rows the step has;
 * else in linear.c's row kernel (xf: x as floats; at most MAX_FUSED_ROWS rows). */
static void project(const lin_t *L, int rows, const float *xf, const void *xh, void *y, int dtype, int gemm,
                    int glu) {
    if (gemm)
        gemm_bf16_team(xh, L->k_in, rows, L->packed, L->bias, L->n_out, L->k_in, y, glu);
    else
        linear_rows_team(L, rows, xf, dtype == DTYPE_BF16 ? xh : NULL, y, dtype);
}

/* 2 where the library was built with the fused step and linear.c's row kernel (AVX-512 with BW and
 * VL): any weights the row kernel takes, up to MAX_FUSED_ROWS rows, and any rows where gemm.c
 * takes every projection; 1 where only the latter, and the weights linear_avx2.c takes (x86 with
 * AVX2: its int8 and int4 row kernel, gemm.c's bfloat16 build); else 0. */
int decode_row_available(void) {
    if (!HAVE_FUSED_STEP) return 0;
    return HAVE_AVX512_TEAM ? 2 : gemm_bf16_available();
}

/* hidden [rows][hidden]: in, the embedded tokens; out, the last layer's output. residual
 * [rows][hidden]: out, the running residual (the final norm adds the two). 0, or 1 for shapes it
 * does not take, 2 when memory could not be had. */
int decode_row(const row_layer_t *layers, int num_layers, const row_step_t *st, void *hidden, void *residual,
               int num_threads) {
#if !HAVE_FUSED_STEP
    (void)layers, (void)num_layers, (void)st, (void)hidden, (void)residual, (void)num_threads;
    return 1; /* decode_row_available says so */
#else
    const int R = st->rows, H = st->hidden, D = st->head_dim, heads = st->heads, kvh = st->kv_heads;
    const int I = st->inter, dtype = st->dtype, elem = elem_size(dtype);
    if (R < 1 || kvh < 1 || heads % kvh || D > MAX_HEAD_DIM || D % 2 ||
        heads / kvh > MAX_GROUP || !kv_cache_takes(dtype, st->cache_dtype))
        return 1;
    const int group = heads / kvh, qkv_n = (heads + 2 * kvh) * D;
    int gemm = 1; /* every projection packed for gemm.c: it multiplies them all (project) */
    int row_kernel = 1; /* the row kernel takes every projection (linear.c; linear_avx2.c: int8, int4) */
    for (int l = 0; l < num_layers; ++l) { /* the buffers below are sized from st: the weights must fit */
        const row_layer_t *L = layers + l;
        if (L->qkv.n_out != qkv_n || L->qkv.k_in != H || L->o.n_out != H || L->o.k_in != heads * D ||
            L->gate_up.n_out != 2 * I || L->gate_up.k_in != H || L->down.n_out != H || L->down.k_in != I)
            return 1;
        if (L->group < 0 || L->group >= st->num_groups || L->rope < 0 || L->rope > st->num_rope ||
            (L->act != ACT_SILU && L->act != ACT_GELU_TANH) || (L->pre_mlp_norm == NULL) != (L->post_mlp_norm == NULL))
            return 1;
        row_kernel = row_kernel && linear_takes(&L->qkv) && linear_takes(&L->o) && linear_takes(&L->gate_up) &&
                     linear_takes(&L->down);
        gemm = gemm && gemm_takes(&L->qkv, dtype) && gemm_takes(&L->o, dtype) && gemm_takes(&L->gate_up, dtype) &&
               L->gate_up.n_out % (2 * GEMM_VEC) == 0 &&
               gemm_takes(&L->down, dtype);
    }
    if (!gemm && (!row_kernel || R > MAX_FUSED_ROWS)) return 1; /* the row kernel's weights and limit */
    const int64_t cache_slots = st->num_blocks * st->block_size;
    int max_ctx = 1;
    for (int r = 0; r < R; ++r) {
        if (st->ctx[r] < 1) return 1;
        for (int g = 0; g < st->num_groups; ++g)
            if (st->slots[g][r] < 0 || st->slots[g][r] >= cache_slots) return 1;
        max_ctx = st->ctx[r] > max_ctx ? st->ctx[r] : max_ctx;
    }
    int widest = H > heads * D ? H : heads * D;
    widest = widest > I ? widest : I;
    const int threads = num_threads > 0 ? num_threads : 1;
    const size_t att_floats = attend_scratch_floats(group, D, st->block_size, max_ctx);
    /* per row: x (a norm's output), q|k|v, the attention's output, gate|up and the activation in
     * dtype; the projections' input as floats (row kernel only); then each thread's attention scratch */
    const size_t typed = (size_t)R * ((size_t)H + qkv_n + (size_t)heads * D + 3 * (size_t)I);
    const size_t as_floats = gemm ? 0 : (size_t)R * widest;
    char *mem = malloc(typed * elem + sizeof(float) * (as_floats + att_floats * threads) + 64);
    if (!mem) return 2;
    char *x = mem, *qkv = x + (size_t)R * H * elem, *att = qkv + (size_t)R * qkv_n * elem;
    char *gu = att + (size_t)R * heads * D * elem, *act = gu + (size_t)R * 2 * I * elem;
    float *xf = (float *)(((uintptr_t)(act + (size_t)R * I * elem) + 63) & ~(uintptr_t)63);
    float *att_scratch = xf + as_floats;
    team_barrier_t sync = {0, 0, 0, 0};
#pragma omp parallel num_threads(threads)
    {
        float *mine = att_scratch + att_floats * (size_t)omp_get_thread_num();
#pragma omp single
        sync.size = omp_get_num_threads(); /* (OpenMP's barrier ends it: every thread sees it) */
        /* each stage ends with team_barrier: the next one reads what every thread wrote */
        for (int l = 0; l < num_layers; ++l) {
            const row_layer_t *L = layers + l;
            const int gemma = L->pre_mlp_norm != NULL, glu = gemm && L->act == ACT_SILU;
#pragma omp single nowait
            {
                if (l == 0) { /* the first norm has no residual yet: it is the embedding */
                    memcpy(residual, hidden, (size_t)R * H * elem);
                    rms_norm(hidden, H, 0, NULL, 0, L->input_norm, st->norm_dtype, x, H, 0, R, 1, H, st->eps, dtype, 1);
                } else {
                    rms_norm(hidden, H, 0, residual, H, L->input_norm, st->norm_dtype, x, H, 0, R, 1, H, st->eps,
                             dtype, 1);
                }
                if (!gemm) to_float(x, dtype, xf, R * H); /* the row kernel's input */
            }
            team_barrier(&sync);
            project(&L->qkv, R, xf, x, qkv, dtype, gemm, 0);
            team_barrier(&sync);
#pragma omp single nowait
            {
                char *k = qkv + (size_t)heads * D * elem, *v = k + (size_t)kvh * D * elem;
                if (L->q_norm) /* per head, in place */
                    rms_norm(qkv, qkv_n, D, NULL, 0, L->q_norm, st->norm_dtype, qkv, qkv_n, D, R, heads, D, st->eps,
                             dtype, 1);
                if (L->k_norm)
                    rms_norm(k, qkv_n, D, NULL, 0, L->k_norm, st->norm_dtype, k, qkv_n, D, R, kvh, D, st->eps, dtype, 1);
                if (L->rope) /* q and k, side by side */
                    rotary(qkv, qkv_n, D, R, heads + kvh, D, st->cos[L->rope - 1], st->sin[L->rope - 1], D, dtype, 1);
                store_kv(k, qkv_n, D, v, qkv_n, D, st->slots[L->group], R, kvh, D, L->k_cache, L->v_cache, cache_slots,
                         dtype, st->cache_dtype);
            }
            team_barrier(&sync);
#pragma omp for schedule(dynamic, 1) nowait
            for (int item = 0; item < R * kvh; ++item) {
                const int r = item / kvh, h = item % kvh;
                int ctx = st->ctx[r], skip;
                const int32_t *table = window_view(st->tables[L->group] + r * st->table_stride[L->group], L->window,
                                                   st->block_size, &ctx, &skip);
                attend_one(L->k_cache, L->v_cache, st->num_blocks, st->block_size, table, ctx, skip, h, qkv + ((size_t)r * qkv_n + (size_t)h * group * D) * elem, (int64_t)D * elem,
                           st->scale, group, D, dtype, st->cache_dtype, mine, att + ((size_t)r * heads + (size_t)h * group) * D * elem,
                           (int64_t)D * elem, L->soft_cap, NULL);
            }
            team_barrier(&sync);
            if (!gemm) {
#pragma omp single nowait
                to_float(att, dtype, xf, R * heads * D); /* the row kernel's input */
                team_barrier(&sync);
            }
            project(&L->o, R, xf, att, hidden, dtype, gemm, 0);
            team_barrier(&sync);
#pragma omp single nowait
            {
                if (gemma) { /* the attention's output normed alone, then added and normed for the MLP */
                    rms_norm(hidden, H, 0, NULL, 0, L->post_norm, st->norm_dtype, hidden, H, 0, R, 1, H, st->eps, dtype, 1);
                    rms_norm(hidden, H, 0, residual, H, L->pre_mlp_norm, st->norm_dtype, x, H, 0, R, 1, H, st->eps,
                             dtype, 1);
                } else {
                    rms_norm(hidden, H, 0, residual, H, L->post_norm, st->norm_dtype, x, H, 0, R, 1, H, st->eps, dtype,
                             1);
                }
                if (!gemm) to_float(x, dtype, xf, R * H); /* the row kernel's input */
            }
            team_barrier(&sync);
            /* in gemm.c, silu(gate) * up comes out of the gate|up tiles (glu); the row kernel's
             * product, and GELU-tanh's, go through silu_and_mul or gelu_tanh_mul_row, the same
             * arithmetic as the per-op path's */
            project(&L->gate_up, R, xf, x, glu ? act : gu, dtype, gemm, glu);
            team_barrier(&sync);
            if (!glu) {
#pragma omp single nowait
                {
                    if (L->act == ACT_GELU_TANH)
                        for (int r = 0; r < R; ++r)
                            gelu_tanh_mul_row(gu + (size_t)r * 2 * I * elem, gu + ((size_t)r * 2 * I + I) * elem,
                                              act + (size_t)r * I * elem, I, dtype);
                    else
                        silu_and_mul(gu, 2 * I, act, I, R, I, dtype, 1);
                    if (!gemm) to_float(act, dtype, xf, R * I); /* the row kernel's input */
                }
                team_barrier(&sync);
            }
            project(&L->down, R, xf, act, hidden, dtype, gemm, 0);
            team_barrier(&sync);
            if (gemma) {
#pragma omp single nowait
                rms_norm(hidden, H, 0, NULL, 0, L->post_mlp_norm, st->norm_dtype, hidden, H, 0, R, 1, H, st->eps, dtype,
                         1);
                team_barrier(&sync);
            }
        }
    }
    free(mem);
    return 0;
#endif
}

/* A hybrid's layer (Qwen3.5, engine/models/qwen3_5.py; engine/models/decode_row_hybrid.py fills
 * it): a Gated DeltaNet layer or a gated full-attention layer, each with Qwen3.5's norms (Gemma's,
 * weights holding 1 + w) and a SiLU MLP. */
typedef struct {
    const void *input_norm, *post_norm; /* [hidden] of norm_dtype */
    lin_t mix, out, gate_up, down;       /* mix: the in-projection (conv channels | z | b | a) or q|gate, k, v */
    int linear;                          /* 1: Gated DeltaNet, 0: gated full attention */
    const void *conv_w;                  /* Gated DeltaNet: [C][K] of dtype */
    void *conv_states;                   /* [state slots][C][K - 1] of dtype, rows state_slots[r] in place */
    float *states;                       /* [state slots][H][dk][dv], rows state_slots[r] in place */
    const float *A_log, *dt_bias;        /* [H] */
    const void *gated_norm;              /* [dv] of dtype */
    void *k_cache, *v_cache;             /* full attention: as row_layer_t's */
    const void *q_norm, *k_norm;         /* [head_dim] of norm_dtype */
    int group;
} hyb_layer_t;

typedef struct {
    row_step_t row;          /* the attention's shapes, caches and rotary table (one), the MLP's, dtypes */
    int Hk, H, dk, dv, K;    /* the Gated DeltaNet layers' key heads, value heads, head dims, conv kernel */
    int rot_dim;             /* the first rot_dim of each q and k head turn */
    const int64_t *state_slots; /* [rows]: each row's state slot, distinct */
    int64_t num_state_slots;
} hyb_step_t;

/* Whether every projection of the hybrid's layers goes through gemm.c (1), or, failing that, all through
 * the row kernel (2); 0: neither. */
static int hybrid_projections(const hyb_layer_t *layers, int n, int dtype) {
    int gemm = 1, rows = 1;
    for (int l = 0; l < n; ++l) {
        const lin_t *P[4] = {&layers[l].mix, &layers[l].out, &layers[l].gate_up, &layers[l].down};
        for (int i = 0; i < 4; ++i) {
            gemm = gemm && gemm_takes(P[i], dtype);
            rows = rows && linear_takes(P[i]);
        }
        gemm = gemm && layers[l].gate_up.n_out % (2 * GEMM_VEC) == 0;
    }
    return gemm ? 1 : (rows ? 2 : 0);
}

/* decode_row for a hybrid (Qwen3.5): the same stages for the full-attention layers, with QK-norm over
 * the q half of each q|gate head, the partial rotary, and the attention's output gated by
 * sigmoid(gate) (sigmoid_gate_row); a Gated DeltaNet layer's mixer as GatedDeltaNet.forward's decode
 * (gates, conv step and rule: gdn_gate_values, gdn_decode_item, items of (row, key head); the gated
 * norm: gdn_gated_norm_row, items of (row, value head)). The kernels are the per-op path's. */
int decode_row_hybrid(const hyb_layer_t *layers, int num_layers, const hyb_step_t *hs, void *hidden,
                      void *residual, int num_threads) {
#if !HAVE_FUSED_STEP
    (void)layers, (void)num_layers, (void)hs, (void)hidden, (void)residual, (void)num_threads;
    return 1;
#else
    const row_step_t *st = &hs->row;
    const int R = st->rows, Hd = st->hidden, D = st->head_dim, heads = st->heads, kvh = st->kv_heads;
    const int I = st->inter, dtype = st->dtype, elem = elem_size(dtype);
    const int Hk = hs->Hk, H = hs->H, dk = hs->dk, dv = hs->dv, K = hs->K;
    if (R < 1 || kvh < 1 || heads % kvh || D > MAX_HEAD_DIM || D % 2 || heads / kvh > MAX_GROUP ||
        !kv_cache_takes(dtype, st->cache_dtype) || st->num_rope != 1 || hs->rot_dim < 2 || hs->rot_dim % 2 ||
        hs->rot_dim > D || !gdn_decode_takes(Hk, H, dk, dv, K) || H > GDN_MAX_HEADS)
        return 1;
    const int group = heads / kvh, qkv_n = (2 * heads + 2 * kvh) * D, conv_n = 2 * Hk * dk + H * dv;
    const int mix_n = conv_n + H * dv + 2 * H;
    for (int l = 0; l < num_layers; ++l) {
        const hyb_layer_t *L = layers + l;
        const int n = L->linear ? mix_n : qkv_n, out_k = L->linear ? H * dv : heads * D;
        if (L->mix.n_out != n || L->mix.k_in != Hd || L->out.n_out != Hd || L->out.k_in != out_k ||
            L->gate_up.n_out != 2 * I || L->gate_up.k_in != Hd || L->down.n_out != Hd || L->down.k_in != I ||
            L->group < 0 || L->group >= st->num_groups)
            return 1;
    }
    const int kind = hybrid_projections(layers, num_layers, dtype), gemm = kind == 1;
    if (kind == 0 || (!gemm && R > MAX_FUSED_ROWS)) return 1;
    const int64_t cache_slots = st->num_blocks * st->block_size;
    int max_ctx = 1;
    for (int r = 0; r < R; ++r) {
        if (st->ctx[r] < 1 || hs->state_slots[r] < 0 || hs->state_slots[r] >= hs->num_state_slots) return 1;
        for (int q = 0; q < r; ++q)
            if (hs->state_slots[q] == hs->state_slots[r]) return 1; /* a slot steps once per call */
        for (int g = 0; g < st->num_groups; ++g)
            if (st->slots[g][r] < 0 || st->slots[g][r] >= cache_slots) return 1;
        max_ctx = st->ctx[r] > max_ctx ? st->ctx[r] : max_ctx;
    }
    const int mix_w = mix_n > qkv_n ? mix_n : qkv_n, att_w = H * dv > heads * D ? H * dv : heads * D;
    int widest = Hd > att_w ? Hd : att_w;
    widest = widest > I ? widest : I;
    const int threads = num_threads > 0 ? num_threads : 1;
    const size_t att_floats = attend_scratch_floats(group, D, st->block_size, max_ctx);
    /* per row in dtype: x, the in-projection, the mixer's output, gate|up and the activation; as
     * floats: the rule's output, the projections' input (row kernel only), each thread's attention scratch */
    const size_t typed = (size_t)R * ((size_t)Hd + mix_w + att_w + 3 * (size_t)I);
    const size_t rule_floats = (size_t)R * H * dv, as_floats = gemm ? 0 : (size_t)R * widest;
    char *mem = malloc(typed * elem + sizeof(float) * (rule_floats + as_floats + att_floats * threads) + 64);
    if (!mem) return 2;
    char *x = mem, *mix = x + (size_t)R * Hd * elem, *att = mix + (size_t)R * mix_w * elem;
    char *gu = att + (size_t)R * att_w * elem, *act = gu + (size_t)R * 2 * I * elem;
    float *rule = (float *)(((uintptr_t)(act + (size_t)R * I * elem) + 63) & ~(uintptr_t)63);
    float *xf = rule + rule_floats, *att_scratch = xf + as_floats;
    const int64_t window_bytes = (int64_t)conv_n * (K - 1) * elem, state_floats = (int64_t)H * dk * dv;
    team_barrier_t sync = {0, 0, 0, 0};
#pragma omp parallel num_threads(threads)
    {
        float *mine = att_scratch + att_floats * (size_t)omp_get_thread_num();
#pragma omp single
        sync.size = omp_get_num_threads();
        for (int l = 0; l < num_layers; ++l) {
            const hyb_layer_t *L = layers + l;
            const int n = L->linear ? mix_n : qkv_n;
#pragma omp single nowait
            {
                if (l == 0) { /* the first norm has no residual yet: it is the embedding */
                    memcpy(residual, hidden, (size_t)R * Hd * elem);
                    rms_norm(hidden, Hd, 0, NULL, 0, L->input_norm, st->norm_dtype, x, Hd, 0, R, 1, Hd, st->eps, dtype, 1);
                } else {
                    rms_norm(hidden, Hd, 0, residual, Hd, L->input_norm, st->norm_dtype, x, Hd, 0, R, 1, Hd, st->eps,
                             dtype, 1);
                }
                if (!gemm) to_float(x, dtype, xf, R * Hd);
            }
            team_barrier(&sync);
            project(&L->mix, R, xf, x, mix, dtype, gemm, 0);
            team_barrier(&sync);
            if (L->linear) {
                const int rep = H / Hk;
#pragma omp for schedule(static) nowait
                for (int item = 0; item < R * Hk; ++item) {
                    const int r = item / Hk, hk = item % Hk;
                    const char *row = mix + (size_t)r * n * elem, *b = row + (size_t)(conv_n + H * dv) * elem;
                    float g[GDN_MAX_HEADS], beta[GDN_MAX_HEADS];
                    gdn_gate_values(b, b + (size_t)H * elem, dtype, L->A_log, L->dt_bias, hk * rep, rep, g, beta);
                    gdn_decode_item(row, L->conv_w, (char *)L->conv_states + hs->state_slots[r] * window_bytes, K, dtype,
                                    g, beta, Hk, H, dk, dv, hk, L->states + hs->state_slots[r] * state_floats,
                                    rule + (size_t)r * H * dv);
                }
                team_barrier(&sync);
#pragma omp for schedule(static) nowait
                for (int item = 0; item < R * H; ++item) {
                    const int r = item / H, h = item % H;
                    gdn_gated_norm_row(rule + (size_t)item * dv, mix + ((size_t)r * n + conv_n + (size_t)h * dv) * elem,
                                       L->gated_norm, dv, st->eps, dtype, att + (size_t)item * dv * elem);
                }
                team_barrier(&sync);
            } else {
#pragma omp single nowait
                {
                    char *k = mix + (size_t)2 * heads * D * elem, *v = k + (size_t)kvh * D * elem;
                    /* q: the first half of each q|gate head; normed in place, then q and k turn */
                    rms_norm(mix, qkv_n, 2 * D, NULL, 0, L->q_norm, st->norm_dtype, mix, qkv_n, 2 * D, R, heads, D,
                             st->eps, dtype, 1);
                    rms_norm(k, qkv_n, D, NULL, 0, L->k_norm, st->norm_dtype, k, qkv_n, D, R, kvh, D, st->eps, dtype, 1);
                    rotary(mix, qkv_n, 2 * D, R, heads, hs->rot_dim, st->cos[0], st->sin[0], hs->rot_dim, dtype, 1);
                    rotary(k, qkv_n, D, R, kvh, hs->rot_dim, st->cos[0], st->sin[0], hs->rot_dim, dtype, 1);
                    store_kv(k, qkv_n, D, v, qkv_n, D, st->slots[L->group], R, kvh, D, L->k_cache, L->v_cache,
                             cache_slots, dtype, st->cache_dtype);
                }
                team_barrier(&sync);
#pragma omp for schedule(dynamic, 1) nowait
                for (int item = 0; item < R * kvh; ++item) {
                    const int r = item / kvh, h = item % kvh;
                    int ctx = st->ctx[r], skip;
                    const int32_t *table = window_view(st->tables[L->group] + r * st->table_stride[L->group], 0,
                                                       st->block_size, &ctx, &skip);
                    attend_one(L->k_cache, L->v_cache, st->num_blocks, st->block_size, table, ctx, skip, h,
                               mix + ((size_t)r * qkv_n + (size_t)h * group * 2 * D) * elem, (int64_t)2 * D * elem,
                               st->scale, group, D, dtype, st->cache_dtype, mine,
                               att + ((size_t)r * heads + (size_t)h * group) * D * elem, (int64_t)D * elem, 0.f, NULL);
                }
                team_barrier(&sync);
#pragma omp single nowait
                for (int r = 0; r < R; ++r)
                    for (int h = 0; h < heads; ++h)
                        sigmoid_gate_row(att + ((size_t)r * heads + h) * D * elem,
                                         mix + ((size_t)r * qkv_n + (size_t)h * 2 * D + D) * elem, D, dtype);
                team_barrier(&sync);
            }
            if (!gemm) {
#pragma omp single nowait
                to_float(att, dtype, xf, R * L->out.k_in); /* the row kernel's input */
                team_barrier(&sync);
            }
            project(&L->out, R, xf, att, hidden, dtype, gemm, 0);
            team_barrier(&sync);
#pragma omp single nowait
            {
                rms_norm(hidden, Hd, 0, residual, Hd, L->post_norm, st->norm_dtype, x, Hd, 0, R, 1, Hd, st->eps, dtype, 1);
                if (!gemm) to_float(x, dtype, xf, R * Hd);
            }
            team_barrier(&sync);
            project(&L->gate_up, R, xf, x, gemm ? act : gu, dtype, gemm, gemm);
            team_barrier(&sync);
            if (!gemm) {
#pragma omp single nowait
                {
                    silu_and_mul(gu, 2 * I, act, I, R, I, dtype, 1);
                    to_float(act, dtype, xf, R * I);
                }
                team_barrier(&sync);
            }
            project(&L->down, R, xf, act, hidden, dtype, gemm, 0);
            team_barrier(&sync);
        }
    }
    free(mem);
    return 0;
#endif
}
