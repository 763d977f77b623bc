/* Decode attention over a paged, head-major KV cache, for the CPU.
 *
 * The cache of one layer is [kv_heads][num_blocks][block_size] rows of head_dim elements (the
 * torch backend's layout; an int8 cache's rows also carry a float32 scale, see below). Each work
 * item is one (decode sequence, KV head) pair: the query heads that share the KV head are loaded
 * once as float rows; then block by block, the block's keys are read once, in place, converted to
 * float and dotted with each of those rows; a float softmax over the scores; the values are read
 * once the same way and accumulated. No gather copy, no padding, nothing multiplied that does not
 * belong together. Items run in parallel on OpenMP threads (the runtime torch has already loaded:
 * the same libgomp.so.1).
 *
 * Where the compiler targets AVX-512 (-march=native on such a CPU), head dims 64 and 128 with up
 * to 8 query heads per KV head (and 256, Gemma's, with 1, 2, 4 or 8) take attend_fast: 16 keys' scores per vector (no horizontal sum
 * per key), bfloat16 keys dotted as stored with AVX512-BF16, the running maximum kept as the
 * scores come out, and each value row converted once for all the group's heads, whose
 * accumulators stay in registers (attention_avx512.h). Where it targets AVX2 with FMA (no AVX-512),
 * the same shapes take an 8-lane attend_fast (bfloat16 widened by pairs, attention_avx2.h).
 * Everything else takes the portable attend(), here.
 *
 * Prefill runs of PREFILL_TILE_MIN_RUN or more tokens of one sequence, in bfloat16 with
 * AVX512-BF16, go as tiles of 16 tokens x the group's heads instead (attend_tile below: the
 * tokens are the lanes, each key is read and dotted once for the whole tile): 2.1-2.2x faster
 * than one query per item for prompts of 250-2,048 tokens on the dev CPU. Under a sliding window
 * each lane also drops the keys before its own token's window (the tile starts at the block of
 * the first token's window: window_view). Runs with a soft cap or sinks go query by query, the
 * variants applied to the scores before the softmax (variant_t), in the fast paths as in attend().
 *
 * Element types: float32 and bfloat16 (DTYPE_* below) for queries and outputs; the cache holds
 * the same type, or KV_INT8 rows (common.h: int8 values and one float scale per token and KV
 * head), whose scales multiply the scores (keys) and the probabilities (values) instead of every
 * element. All arithmetic is in float32.
 * Built and loaded by kernels/cpu_kernels.py.
 */
#include <math.h> /* INFINITY */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "common.h"

#define MAX_ACC_VECTORS 8 /* head dims up to 128 accumulate in registers */
#define PARALLEL_MIN_BYTES (512 << 10) /* K and V bytes below which one thread reads them all */
#if defined(__AVX512BF16__)
#define TILE_TOKENS 16 /* prompt tokens per prefill tile (the lanes of one float vector) */
#else
#define TILE_TOKENS 8
#endif
#define TILE_RUN(len) ((len) > 1 ? TILE_TOKENS : 1) /* queries per item: a tile or one */

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
    int block_size, dtype, elem; /* the queries' and outputs' DTYPE_* and its size */
    int cdtype;                  /* the cache's: dtype, or KV_INT8 */
    int64_t row_bytes;           /* one token of one KV head in the cache (kv_row_bytes) */
} cache_t;

/* Prefetch schedule over one (sequence, KV head): the first blocks of keys before the keys' pass;
 * while reading keys block b, block b + PREFETCH_BLOCKS (past the keys: the first values); while
 * reading values block b, block b + PREFETCH_BLOCKS. */
static inline void prefetch_first_keys(const cache_t *c, const int32_t *table, int64_t head_base,
                                       int64_t block_bytes, int last) {
    for (int b = 0; b < PREFETCH_BLOCKS && b <= last; ++b)
        prefetch_block(c->k_cache + (head_base + table[b]) * block_bytes, block_bytes);
}

static inline void prefetch_while_keys(const cache_t *c, const int32_t *table, int64_t head_base,
                                       int64_t block_bytes, int b, int last) {
    const int ahead = b + PREFETCH_BLOCKS;
    if (ahead <= last)
        prefetch_block(c->k_cache + (head_base + table[ahead]) * block_bytes, block_bytes);
    else if (ahead - last - 1 <= last)
        prefetch_block(c->v_cache + (head_base + table[ahead - last - 1]) * block_bytes, block_bytes);
}

static inline void prefetch_while_values(const cache_t *c, const int32_t *table, int64_t head_base,
                                         int64_t block_bytes, int b, int last) {
    if (b + PREFETCH_BLOCKS <= last)
        prefetch_block(c->v_cache + (head_base + table[b + PREFETCH_BLOCKS]) * block_bytes, block_bytes);
}

/* s[p] = exp(s[p] - max) for the ctx scores of one head; returns their sum (the softmax's
 * denominator). */
static inline float exp_in_place(float *restrict s, int ctx, float max) {
    float sum = 0.f;
    for (int p = 0; p < ctx; ++p) {
        s[p] = fast_exp(s[p] - max);
        sum += s[p];
    }
    return sum;
}

/* n rows of D elements of a cache block as floats: a float32 cache is read in place, any other
 * is converted into the scratch block first (KV_INT8: each row times its scale). */
static inline const float *block_floats(const cache_t *c, const char *src, float *scratch, int n, int D) {
    if (c->cdtype == DTYPE_F32)
        return (const float *)src;
    if (c->cdtype == KV_INT8) {
        for (int t = 0; t < n; ++t) {
            const char *row = src + t * c->row_bytes;
            const int8_t *x = (const int8_t *)row;
            const float s = kv_row_scale(row, D);
            for (int d = 0; d < D; ++d) scratch[t * D + d] = (float)x[d] * s;
        }
        return scratch;
    }
    to_float(src, c->cdtype, scratch, (int64_t)n * D);
    return scratch;
}

/* Per-thread scratch: the query rows, the accumulators, one block as floats, the scores. */
typedef struct {
    float *q, *acc, *block, *scores;
} scratch_t;

/* The softmax variants of one item: each score s becomes cap * tanh(s / cap) (Gemma 2's logit soft
 * cap; cap 0: none), and a learned logit per query head joins the denominator and weighs no value
 * (gpt-oss's sinks; sinks[j] for the item's j-th query head, NULL: none). The fast paths and the
 * portable attend() take both (the prefill tiles neither: such runs go query by query). */
typedef struct {
    float cap;
    const float *sinks;
} variant_t;

/* cap * tanh(s / cap), by exp: tanh(x) = (1 - e) / (1 + e) with e = exp(-2|x|) and the sign put
 * back, or an odd polynomial for |x| < 1/16, where 1 - e would cancel (error under 1e-9 there) */
static inline float soft_cap(float s, float cap) {
    const float x = s / cap, ax = x < 0.f ? -x : x;
    float t;
    if (ax < 0.0625f) {
        const float x2 = ax * ax;
        t = ax * (1.f + x2 * (-1.f / 3.f + x2 * (2.f / 15.f)));
    } else {
        const float e = fast_exp(-2.f * ax);
        t = (1.f - e) / (1.f + e);
    }
    return cap * (x < 0.f ? -t : t);
}

/* var's part in query head j's softmax, before the exponentials: its scores from skip on capped
 * (those before skip are -inf already); returns what to subtract, m (the largest score before the
 * cap) capped, or the head's sink where larger. After them the sum gains the sink's term
 * (variant_sum). */
static inline float variant_scores(float *restrict s, int ctx, int skip, float m, const variant_t *var, int j) {
    if (var->cap > 0.f) {
        for (int p = skip; p < ctx; ++p) s[p] = soft_cap(s[p], var->cap);
        m = soft_cap(m, var->cap);
    }
    return var->sinks && var->sinks[j] > m ? var->sinks[j] : m;
}

static inline float variant_sum(float sum, float m, const variant_t *var, int j) {
    return var->sinks ? sum + fast_exp(var->sinks[j] - m) : sum;
}

/* One (sequence, KV head): D is a compile-time constant in the common instantiations below. The
 * first skip keys (fewer than a block: those of a sliding window's first block that lie before
 * the window) are read but weigh nothing. */
static inline __attribute__((always_inline)) void attend(
        const cache_t *c, const int32_t *table, int ctx, int skip, int kv_head, int group, const int D,
        const scratch_t *w, const variant_t *var) {
    float *restrict qf = w->q, *restrict acc = w->acc, *restrict blk = w->block, *restrict scores = w->scores;
    const int bs = c->block_size;
    const int64_t head_base = (int64_t)kv_head * c->num_blocks;
    const int64_t block_bytes = (int64_t)bs * c->row_bytes;
    const int last = (ctx - 1) / bs;
    /* scores[j * ctx + pos] = q_j . k_pos */
    prefetch_first_keys(c, table, head_base, block_bytes, last);
    for (int pos0 = 0, b = 0; pos0 < ctx; pos0 += bs, ++b) {
        const int n = ctx - pos0 < bs ? ctx - pos0 : bs;
        prefetch_while_keys(c, table, head_base, block_bytes, b, last);
        const float *restrict keys = block_floats(c, c->k_cache + (head_base + table[b]) * block_bytes, blk, n, D);
        for (int j = 0; j < group; ++j) {
            const float *restrict qj = qf + j * D;
            float *restrict sj = scores + j * ctx + pos0;
            for (int t = 0; t < n; ++t) {
                const float *restrict kt = keys + t * D;
                float s = 0.f;
                for (int d = 0; d < D; ++d) s += qj[d] * kt[d];
                sj[t] = s;
            }
        }
    }
    /* softmax per query head, in place (var's cap and sink); 1 / sum kept in acc's tail */
    for (int j = 0; j < group; ++j) {
        float *restrict s = scores + j * ctx;
        float m = -INFINITY;
        for (int p = 0; p < skip; ++p) s[p] = -INFINITY;
        for (int p = skip; p < ctx; ++p) m = s[p] > m ? s[p] : m;
        m = variant_scores(s, ctx, skip, m, var, j);
        acc[group * D + j] = 1.f / variant_sum(exp_in_place(s, ctx, m), m, var, j);
    }
    memset(acc, 0, sizeof(float) * (size_t)group * D);
    for (int pos0 = 0, b = 0; pos0 < ctx; pos0 += bs, ++b) {
        const int n = ctx - pos0 < bs ? ctx - pos0 : bs;
        prefetch_while_values(c, table, head_base, block_bytes, b, last);
        const float *restrict vals = block_floats(c, c->v_cache + (head_base + table[b]) * block_bytes, blk, n, D);
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
                        memcpy(&x, vals + t * D + 16 * v, sizeof(v16f));
                        a[v] += pt * x;
                    }
                }
                for (int v = 0; v < D / 16; ++v) memcpy(aj + 16 * v, &a[v], sizeof(v16f));
            } else {
                for (int t = 0; t < n; ++t) {
                    const float pt = p[t];
                    const float *restrict vt = vals + t * D;
                    for (int d = 0; d < D; ++d) aj[d] += pt * vt[d];
                }
            }
        }
    }
}

/* The portable path for any head dim: the query rows as scaled floats, then attend(). */
static void attend_any(const cache_t *c, const int32_t *table, int ctx, int skip, int kv_head, const char *q,
                       int64_t q_head_bytes, float scale, int group, int head_dim, const scratch_t *w,
                       const variant_t *var) {
    for (int j = 0; j < group; ++j) {
        to_float(q + j * q_head_bytes, c->dtype, w->q + j * head_dim, head_dim);
        for (int d = 0; d < head_dim; ++d) w->q[j * head_dim + d] *= scale;
    }
    if (head_dim == 64)
        attend(c, table, ctx, skip, kv_head, group, 64, w, var);
    else if (head_dim == 128)
        attend(c, table, ctx, skip, kv_head, group, 128, w, var);
    else
        attend(c, table, ctx, skip, kv_head, group, head_dim, w, var);
}

/* row key of a paged cache (rows row_bytes apart, blocks of bs of them) */
static inline const char *key_row(const char *cache, const int32_t *table, int64_t head_base,
                                   int64_t block_bytes, int64_t row_bytes, int bs, int key) {
    return cache + (head_base + table[key / bs]) * block_bytes + (key % bs) * row_bytes;
}

#if defined(__AVX512F__)
#include "attention_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "attention_avx2.h"
#endif

#ifdef HAVE_TILES
#define TILE_CASE(G, D)                                                                                 \
    case (G) * 1000 + (D):                                                                              \
        attend_tile(c, table, ctx0, M, window, kv_head, q, q_token_bytes, q_head_bytes, scale, G, D, work, \
                    out, out_token_bytes, out_head_bytes);                                              \
        return;

static void attend_tile_dispatch(const cache_t *c, const int32_t *table, int ctx0, int M, int window, int kv_head,
                                 const char *q, int64_t q_token_bytes, int64_t q_head_bytes, float scale,
                                 int group, int head_dim, float *work, char *out, int64_t out_token_bytes,
                                 int64_t out_head_bytes) {
    switch (group * 1000 + head_dim) {
        TILE_CASE(1, 64) TILE_CASE(2, 64) TILE_CASE(3, 64) TILE_CASE(4, 64)
        TILE_CASE(5, 64) TILE_CASE(6, 64) TILE_CASE(7, 64) TILE_CASE(8, 64)
        TILE_CASE(1, 128) TILE_CASE(2, 128) TILE_CASE(3, 128) TILE_CASE(4, 128)
        TILE_CASE(5, 128) TILE_CASE(6, 128) TILE_CASE(7, 128) TILE_CASE(8, 128)
        default: return;
    }
}

/* whether tiles take these shapes (else every query is an item of its own) */
static int tiles_take(int dtype, int cache_dtype, int group, int head_dim) {
    return dtype == DTYPE_BF16 && cache_dtype == DTYPE_BF16 && group <= 8 && (head_dim == 64 || head_dim == 128);
}
#endif

#ifdef HAVE_FAST_PATH
#define FAST_CASE(G, D) \
    case (G) * 1000 + (D): attend_fast(c, table, ctx, skip, kv_head, q, q_head_bytes, scale, G, D, w, var); return 1;

/* 1 when the fast path took this item (accumulators and 1 / sums in w->acc), else 0. It stays in
 * this file, static: moved into a translation unit of its own (with a shared header) the decode
 * kernel ran 20-30% slower (batch 48 x 300, 30 layers: 26-28 vs 21-22 ms, alternating runs). */
static int attend_fast_dispatch(const cache_t *c, const int32_t *table, int ctx, int skip, int kv_head,
                                const char *q, int64_t q_head_bytes, float scale, int group, int head_dim,
                                const scratch_t *w, const variant_t *var) {
    switch (group * 1000 + head_dim) {
        FAST_CASE(1, 64) FAST_CASE(2, 64) FAST_CASE(3, 64) FAST_CASE(4, 64)
        FAST_CASE(5, 64) FAST_CASE(6, 64) FAST_CASE(7, 64) FAST_CASE(8, 64)
        FAST_CASE(1, 128) FAST_CASE(2, 128) FAST_CASE(3, 128) FAST_CASE(4, 128)
        FAST_CASE(5, 128) FAST_CASE(6, 128) FAST_CASE(7, 128) FAST_CASE(8, 128)
        /* Gemma's 256-dim heads, in the groups its sizes have (1B: 4; 4B to 27B, Gemma 2: 2) */
        FAST_CASE(1, 256) FAST_CASE(2, 256) FAST_CASE(4, 256) FAST_CASE(8, 256)
        default: return 0;
    }
}
#else
static int attend_fast_dispatch(const cache_t *c, const int32_t *table, int ctx, int skip, int kv_head,
                                const char *q, int64_t q_head_bytes, float scale, int group, int head_dim,
                                const scratch_t *w, const variant_t *var) {
    (void)c, (void)table, (void)ctx, (void)skip, (void)kv_head, (void)q, (void)q_head_bytes, (void)scale;
    (void)group, (void)head_dim, (void)w, (void)var;
    return 0;
}
#endif

/* Floats of scratch one thread needs for attend_one over contexts of up to max_ctx keys. */
size_t attend_scratch_floats(int group, int head_dim, int block_size, int max_ctx) {
    const size_t q_len = (size_t)group * head_dim, acc_len = q_len + group;
    return q_len + acc_len + (size_t)block_size * head_dim + (size_t)group * (size_t)max_ctx;
}

/* attend_one with the softmax variants of var (cap 0 and no sinks: plain). */
static void attend_item(const void *k_cache, const void *v_cache, int64_t num_blocks, int block_size,
                        const int32_t *table, int ctx, int skip, int kv_head, const char *q0, int64_t q_head_bytes,
                        float scale, int group, int head_dim, int dtype, int cache_dtype, float *scratch,
                        char *out0, int64_t out_head_bytes, const variant_t *var) {
    const cache_t cache = {(const char *)k_cache, (const char *)v_cache, num_blocks, block_size, dtype,
                           elem_size(dtype), cache_dtype, kv_row_bytes(cache_dtype, head_dim)};
    const size_t q_len = (size_t)group * head_dim, acc_len = q_len + group;
    const scratch_t w = {scratch, scratch + q_len, scratch + q_len + acc_len,
                         scratch + q_len + acc_len + (size_t)block_size * head_dim};
    if (!attend_fast_dispatch(&cache, table, ctx, skip, kv_head, q0, q_head_bytes, scale, group, head_dim, &w, var))
        attend_any(&cache, table, ctx, skip, kv_head, q0, q_head_bytes, scale, group, head_dim, &w, var);
    for (int j = 0; j < group; ++j)
        from_float(w.acc + j * head_dim, w.acc[group * head_dim + j], dtype, out0 + j * out_head_bytes, head_dim);
}

/* The group query heads at q0 (q_head_bytes apart) that share KV head kv_head, over the first
 * ctx keys and values in table's blocks but the first skip (< block_size) of them; head j's output
 * goes to out0 + j * out_head_bytes. soft_cap > 0 caps each score (Gemma 2; 0: none); sinks: NULL,
 * or the group query heads' learned logits (gpt-oss).
 * scratch: attend_scratch_floats(group, head_dim, block_size, >= ctx) floats of this thread's. */
void attend_one(const void *k_cache, const void *v_cache, int64_t num_blocks, int block_size,
                const int32_t *table, int ctx, int skip, int kv_head, const char *q0, int64_t q_head_bytes,
                float scale, int group, int head_dim, int dtype, int cache_dtype, float *scratch, char *out0,
                int64_t out_head_bytes, float soft_cap, const float *sinks) {
    const variant_t var = {soft_cap > 0.f ? soft_cap : 0.f, sinks};
    attend_item(k_cache, v_cache, num_blocks, block_size, table, ctx, skip, kv_head, q0, q_head_bytes, scale,
                group, head_dim, dtype, cache_dtype, scratch, out0, out_head_bytes, &var);
}

/* For each i: out[tokens[i]] = attention of q[tokens[i]] over the first ctx_lens[i] keys and
 * values in the blocks of block_tables[seq_ids[i]] (a decode sees its whole context, a prefill
 * token the keys up to its own position); with window > 0 over the last window of them only, read
 * from the block of the first on (the blocks before it may be freed). soft_cap > 0: each score
 * capped (variant_t); sinks: NULL, or num_heads float32 logits joining the softmax's denominators.
 * Strides are in elements.
 * Returns 0, 1 for shapes it does not take, 2 when scratch memory could not be had. */
int paged_decode(const void *q, int64_t q_token_stride, int64_t q_head_stride, const void *k_cache,
                 const void *v_cache, int64_t num_blocks, int block_size, const int32_t *block_tables,
                 int64_t table_stride, const int32_t *seq_ids,
                 const int32_t *tokens, const int32_t *ctx_lens, int num_queries, int num_heads, int num_kv_heads, int head_dim,
                 float scale, void *out, int64_t out_token_stride, int64_t out_head_stride, int dtype,
                 int cache_dtype, int window, float soft_cap, const float *sinks, int num_threads) {
    const int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    if (head_dim > MAX_HEAD_DIM || group < 1 || group > MAX_GROUP || group * num_kv_heads != num_heads ||
        (dtype != DTYPE_F32 && dtype != DTYPE_BF16) || !kv_cache_takes(dtype, cache_dtype))
        return 1;
    const int elem = elem_size(dtype);
    int max_ctx = 1;
    int64_t keys = 0;
    for (int i = 0; i < num_queries; ++i) {
        max_ctx = ctx_lens[i] > max_ctx ? ctx_lens[i] : max_ctx;
        keys += ctx_lens[i] > 0 ? ctx_lens[i] : 0;
    }
    /* a call that reads little (a single stream's step: one query, a few hundred keys) runs on
     * this thread: waking the others for it cost more than the reading (~50 us a wake-up here) */
    if (keys * num_kv_heads * 2 * kv_row_bytes(cache_dtype, head_dim) < PARALLEL_MIN_BYTES) num_threads = 1;
    /* the work: runs of queries, each one query, or a tile of consecutive tokens of one sequence */
    int32_t *runs = malloc(sizeof(int32_t) * 2 * (size_t)(num_queries > 0 ? num_queries : 1));
    if (!runs) return 2;
    int num_runs = 0;
    size_t tile_floats = 0;
#ifdef HAVE_TILES
    /* tiles: no soft cap or sinks (a window: each lane's own lower bound) */
    const int tiled = soft_cap == 0.f && !sinks && tiles_take(dtype, cache_dtype, group, head_dim);
#else
    const int tiled = 0;
#endif
    for (int i = 0; i < num_queries;) {
        int len = 1;
        while (tiled && i + len < num_queries && seq_ids[i + len] == seq_ids[i] &&
               tokens[i + len] == tokens[i] + len && ctx_lens[i + len] == ctx_lens[i] + len && ctx_lens[i] > 0)
            ++len;
        if (len < PREFILL_TILE_MIN_RUN) len = 1;
        for (int done = 0; done < len; done += TILE_RUN(len)) {
            runs[2 * num_runs] = i + done;
            runs[2 * num_runs + 1] = len - done < TILE_RUN(len) ? len - done : TILE_RUN(len);
            ++num_runs;
        }
        i += len;
    }
#ifdef HAVE_TILES
    if (tiled) tile_floats = tile_scratch_floats(group, head_dim, max_ctx);
#endif
    const int items = num_runs * num_kv_heads;
    /* every thread's scratch in one allocation, made before the team starts: each thread reaches
     * the worksharing loop, and a decode step allocates once per layer, not four times a thread */
    size_t per_thread = attend_scratch_floats(group, head_dim, block_size, max_ctx);
    per_thread = tile_floats > per_thread ? tile_floats : per_thread;
    per_thread = (per_thread + 15) & ~(size_t)15;
    const int threads = num_threads > 0 ? num_threads : 1;
    float *scratch = malloc(sizeof(float) * per_thread * threads);
    if (!scratch) {
        free(runs);
        return 2;
    }
#pragma omp parallel num_threads(threads)
    {
        float *mine = scratch + per_thread * (size_t)omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; ++item) {
            const int run = item / num_kv_heads, kv_head = item % num_kv_heads;
            const int i = runs[2 * run], count = runs[2 * run + 1];
            const int seq = seq_ids[i];
            int ctx = ctx_lens[i], skip = 0;
            if (ctx <= 0) continue;
            const int64_t token = tokens[i];
            const int h0 = kv_head * group;
            const char *q0 = (const char *)q + (token * q_token_stride + h0 * q_head_stride) * elem;
            char *out0 = (char *)out + (token * out_token_stride + h0 * out_head_stride) * elem;
            const int32_t *table = window_view(block_tables + (int64_t)seq * table_stride, window, block_size,
                                               &ctx, &skip);
#ifdef HAVE_TILES
            if (count > 1) {
                const cache_t cache = {(const char *)k_cache, (const char *)v_cache, num_blocks, block_size,
                                       dtype, elem, cache_dtype, kv_row_bytes(cache_dtype, head_dim)};
                attend_tile_dispatch(&cache, table, ctx, count, window, kv_head, q0, q_token_stride * elem,
                                     q_head_stride * elem, scale, group, head_dim, mine, out0,
                                     out_token_stride * elem, out_head_stride * elem);
                continue;
            }
#endif
            (void)count;
            const variant_t var = {soft_cap > 0.f ? soft_cap : 0.f, sinks ? sinks + h0 : NULL};
            attend_item(k_cache, v_cache, num_blocks, block_size, table, ctx, skip, kv_head, q0,
                        q_head_stride * elem, scale, group, head_dim, dtype, cache_dtype, mine, out0,
                        out_head_stride * elem, &var);
        }
    }
    free(runs);
    free(scratch);
    return 0;
}

/* The vector width of the fast path the attention kernels were built with: 512 (16 keys' scores a
 * vector; the prefill tiles with AVX512-BF16), 256 (AVX2 with FMA: 8 keys' scores a vector,
 * prefill tiles of 8 tokens in floats), 0 (the portable loop only, several times slower than torch's SDPA at prefills). */
int attention_vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(HAVE_FAST_PATH)
    return 256;
#else
    return 0;
#endif
}
