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
 * to 8 query heads per KV head take attend_fast: 16 keys' scores per vector (no horizontal sum
 * per key), bfloat16 keys dotted as stored with AVX512-BF16, the running maximum kept as the
 * scores come out, and each value row converted once for all the group's heads, whose
 * accumulators stay in registers. Where it targets AVX2 with FMA (no AVX-512), the same shapes take
 * an 8-lane attend_fast (bfloat16 widened by pairs). Everything else takes the portable attend().
 *
 * Prefill runs of PREFILL_TILE_MIN_RUN or more tokens of one sequence, in bfloat16 with
 * AVX512-BF16, go as tiles of 16 tokens x the group's heads instead (attend_tile below: the
 * tokens are the lanes, each key is read and dotted once for the whole tile): 2.1-2.2x faster
 * than one query per item for prompts of 250-2,048 tokens on the dev CPU.
 *
 * Element types: float32 and bfloat16 (DTYPE_* below) for queries and outputs; the cache holds
 * the same type, or KV_INT8 rows (common.h: int8 values and one float scale per token and KV
 * head), whose scales multiply the scores (keys) and the probabilities (values) instead of every
 * element. All arithmetic is in float32.
 * Built and loaded by kernels/cpu_kernels.py.
 */
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

/* One (sequence, KV head): D is a compile-time constant in the common instantiations below. */
static inline __attribute__((always_inline)) void attend(
        const cache_t *c, const int32_t *table, int ctx, int kv_head, int group, const int D,
        const scratch_t *w) {
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
    /* softmax per query head, in place; 1 / sum kept in acc's tail */
    for (int j = 0; j < group; ++j) {
        float *restrict s = scores + j * ctx;
        float m = s[0];
        for (int p = 1; p < ctx; ++p) m = s[p] > m ? s[p] : m;
        acc[group * D + j] = 1.f / exp_in_place(s, ctx, m);
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
static void attend_any(const cache_t *c, const int32_t *table, int ctx, int kv_head, const char *q,
                       int64_t q_head_bytes, float scale, int group, int head_dim, const scratch_t *w) {
    for (int j = 0; j < group; ++j) {
        to_float(q + j * q_head_bytes, c->dtype, w->q + j * head_dim, head_dim);
        for (int d = 0; d < head_dim; ++d) w->q[j * head_dim + d] *= scale;
    }
    if (head_dim == 64)
        attend(c, table, ctx, kv_head, group, 64, w);
    else if (head_dim == 128)
        attend(c, table, ctx, kv_head, group, 128, w);
    else
        attend(c, table, ctx, kv_head, group, head_dim, w);
}

/* row key of a paged cache (rows row_bytes apart, blocks of bs of them) */
static inline const char *key_row(const char *cache, const int32_t *table, int64_t head_base,
                                   int64_t block_bytes, int64_t row_bytes, int bs, int key) {
    return cache + (head_base + table[key / bs]) * block_bytes + (key % bs) * row_bytes;
}

#if defined(__AVX512F__)
/* The AVX-512 path for head dims 64 and 128 and up to 8 query heads per KV head (every model
 * here): the scores of 16 keys come out of one vector instead of one horizontal sum per key, the
 * keys are dotted in bfloat16 pairs where the CPU has AVX512-BF16 (no conversion: products of
 * bfloat16 values are exact in float32), and the values are converted once per row and
 * accumulated into every query head's registers at once. */
#include <immintrin.h>
#include <math.h> /* INFINITY */

#define FAST_KEYS 16

/* r[i] = the sum of v[i]'s 16 lanes: pairs interleaved and added, then 64-bit halves, then
 * 128-bit lanes twice (15 adds and 30 shuffles for 16 sums). */
static inline __m512 sum_lanes16(const __m512 *v) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; ++i)
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

/* 16 elements at p (DTYPE_*, or KV_INT8: the int8 values, unscaled) as floats */
static inline __m512 load16(const char *p, int dtype) {
    if (dtype == DTYPE_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    if (dtype == KV_INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    return _mm512_loadu_ps((const float *)p);
}

/* The lane-wise partial products of one key row at k with a query (floats qf, or bfloat16 pairs
 * qh where the CPU dots them directly): summing the lanes gives the score. */
#if defined(__AVX512BF16__)
#define QH(j) qh[j]
static inline __attribute__((always_inline)) __m512 dot_key(const char *k, const __m512 *qf, const __m512bh *qh,
                                                            int dtype, const int D) {
    __m512 s = _mm512_setzero_ps();
    if (dtype == DTYPE_BF16) {
        for (int v = 0; v < D / 32; ++v) s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(k + v * 64), qh[v]);
        return s;
    }
#else
#define QH(j) NULL
static inline __attribute__((always_inline)) __m512 dot_key(const char *k, const __m512 *qf, const void *qh,
                                                            int dtype, const int D) {
    (void)qh;
    __m512 s = _mm512_setzero_ps();
#endif
    const int elem = kv_elem_size(dtype);
    for (int v = 0; v < D / 16; ++v) s = _mm512_fmadd_ps(load16(k + v * 16 * elem, dtype), qf[v], s);
    return s;
}

/* One (sequence, KV head) with G query heads of D dims; q points at the first query head's row
 * (heads q_head_stride elements apart), unscaled. The scores are scaled as they come out (by the
 * keys' scales too in a KV_INT8 cache; the values' scales go into the probabilities). */
static inline __attribute__((always_inline)) void attend_fast(
        const cache_t *c, const int32_t *table, int ctx, int kv_head, const char *q, int64_t q_head_bytes,
        float scale, const int G, const int D, const scratch_t *w) {
    enum { MAXV = 8 };
    const int V = D / 16; /* float vectors per row */
    float *restrict scores = w->scores, *restrict acc = w->acc;
    const int bs = c->block_size, elem = c->elem, cd = c->cdtype, celem = kv_elem_size(cd), quant = cd == KV_INT8;
    const int64_t head_base = (int64_t)kv_head * c->num_blocks;
    const int64_t row_bytes = c->row_bytes, block_bytes = bs * row_bytes;
    const int last = (ctx - 1) / bs;
    const __m512 vscale = _mm512_set1_ps(scale);
#if defined(__AVX512BF16__)
    __m512bh qh[8][MAXV / 2]; /* pairs of bfloat16 as stored */
    if (cd == DTYPE_BF16)
        for (int j = 0; j < G; ++j)
            for (int v = 0; v < V / 2; ++v)
                qh[j][v] = (__m512bh)_mm512_loadu_si512(q + j * q_head_bytes + v * 64);
#endif
    __m512 qf[8][MAXV]; /* as floats: read by dot_key unless it dots bfloat16 pairs */
#if defined(__AVX512BF16__)
    if (cd != DTYPE_BF16)
#endif
        for (int j = 0; j < G; ++j)
            for (int v = 0; v < V; ++v) qf[j][v] = load16(q + j * q_head_bytes + v * 16 * elem, c->dtype);

    __m512 vmax[8]; /* each head's running maximum score, lane-wise */
    for (int j = 0; j < G; ++j) vmax[j] = _mm512_set1_ps(-INFINITY);
    prefetch_first_keys(c, table, head_base, block_bytes, last);
    for (int pos0 = 0, b = 0; pos0 < ctx; pos0 += bs, ++b) {
        const int n = ctx - pos0 < bs ? ctx - pos0 : bs;
        prefetch_while_keys(c, table, head_base, block_bytes, b, last);
        const char *kb = c->k_cache + (head_base + table[b]) * block_bytes;
        for (int t0 = 0; t0 < n; t0 += FAST_KEYS) {
            const int m = n - t0 < FAST_KEYS ? n - t0 : FAST_KEYS;
            const char *k0 = kb + t0 * row_bytes;
            __m512 kscale = vscale; /* the softmax scale, times each key's in a KV_INT8 cache */
            if (quant) {
                float ks[FAST_KEYS];
                for (int t = 0; t < FAST_KEYS; ++t) ks[t] = t < m ? kv_row_scale(k0 + t * row_bytes, D) : 0.f;
                kscale = _mm512_mul_ps(vscale, _mm512_loadu_ps(ks));
            }
            for (int j = 0; j < G; ++j) {
                __m512 part[FAST_KEYS];
                if (m == FAST_KEYS) {
#pragma GCC unroll 16
                    for (int t = 0; t < FAST_KEYS; ++t) part[t] = dot_key(k0 + t * row_bytes, qf[j], QH(j), cd, D);
                } else {
                    for (int t = 0; t < FAST_KEYS; ++t)
                        part[t] = t < m ? dot_key(k0 + t * row_bytes, qf[j], QH(j), cd, D) : _mm512_setzero_ps();
                }
                const __m512 sums = _mm512_mul_ps(sum_lanes16(part), kscale);
                const __mmask16 valid = (__mmask16)((1u << m) - 1u);
                _mm512_mask_storeu_ps(scores + j * ctx + pos0 + t0, valid, sums);
                vmax[j] = _mm512_mask_max_ps(vmax[j], valid, vmax[j], sums);
            }
        }
    }
    /* softmax per query head, in place; 1 / sum kept in acc's tail */
    for (int j = 0; j < G; ++j) {
        float *restrict s = scores + j * ctx;
        acc[G * D + j] = 1.f / exp_in_place(s, ctx, _mm512_reduce_max_ps(vmax[j]));
    }
    __m512 a[8][MAXV];
    for (int j = 0; j < G; ++j)
        for (int v = 0; v < V; ++v) a[j][v] = _mm512_setzero_ps();
    for (int pos0 = 0, b = 0; pos0 < ctx; pos0 += bs, ++b) {
        const int n = ctx - pos0 < bs ? ctx - pos0 : bs;
        prefetch_while_values(c, table, head_base, block_bytes, b, last);
        const char *vb = c->v_cache + (head_base + table[b]) * block_bytes;
        for (int t = 0; t < n; ++t) {
            __m512 row[MAXV];
            const char *vt = vb + t * row_bytes;
            for (int v = 0; v < V; ++v) row[v] = load16(vt + v * 16 * celem, cd);
            const float vs = quant ? kv_row_scale(vt, D) : 1.f;
            for (int j = 0; j < G; ++j) {
                const __m512 p = _mm512_set1_ps(scores[j * ctx + pos0 + t] * vs);
                for (int v = 0; v < V; ++v) a[j][v] = _mm512_fmadd_ps(p, row[v], a[j][v]);
            }
        }
    }
    for (int j = 0; j < G; ++j)
        for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + j * D + 16 * v, a[j][v]);
}

#if defined(__AVX512BF16__)
/* Prefill tiles (bfloat16 queries over a bfloat16 cache): up to TILE_TOKENS consecutive prompt
 * tokens of one sequence with the G query heads of one KV head. One query per item reads every
 * key once per token and sums 16 lanes per score; a tile turns the product around: its queries,
 * transposed once, make the lanes (token m in lane m, one vector per head), so each key's bfloat16
 * pairs are broadcast and dotted with every token of the tile at once, and each score vector comes
 * out whole, with no horizontal sum. The causal limit (token m sees ctx0 + m keys) is a lane mask
 * on the tile's last keys. The softmax runs lane-wise over the score vectors; the probabilities
 * are then rounded to bfloat16 and paired by key, the values interleaved the same way once per
 * tile, so that the weighted sum takes two keys per vdpbf16ps into float accumulators in
 * registers (as flash attention multiplies its bfloat16 probabilities; the sums stay float). Only runs of at least
 * PREFILL_TILE_MIN_RUN tokens are tiled: decodes and speculative verification rows (at most
 * 1 + MAX_SPECULATIVE_TOKENS of a sequence) keep the per-query arithmetic, so a verified row equals
 * the plain decode row bit for bit. */

/* Floats of scratch one thread needs for a tile of G heads of D dims over up to max_ctx keys:
 * the transposed queries, the score vectors, the sums, the probabilities and values in key pairs. */
static size_t tile_scratch_floats(int group, int head_dim, int max_ctx) {
    const size_t pairs = ((size_t)max_ctx + 1) / 2; /* of keys, for the values' pass */
    return (size_t)TILE_TOKENS * group * ((size_t)head_dim / 2 + (size_t)max_ctx + 1) +
           pairs * ((size_t)TILE_TOKENS * group + (size_t)head_dim);
}

/* The M (<= TILE_TOKENS) tokens at q (q_token_bytes apart; heads q_head_bytes apart) of which the
 * first sees ctx0 keys and each next one more; their outputs likewise at out. */
static inline __attribute__((always_inline)) void attend_tile(
        const cache_t *c, const int32_t *table, int ctx0, int M, int kv_head, const char *q,
        int64_t q_token_bytes, int64_t q_head_bytes, float scale, const int G, const int D, float *work,
        char *out, int64_t out_token_bytes, int64_t out_head_bytes) {
    const int KB = G <= 1 ? 8 : (G <= 4 ? 4 : 2); /* keys per pass: G * KB accumulators */
    const int RC = D <= 64 ? 6 : 3, V = D / 16;   /* rows per pass over the values: RC * V accumulators */
    const int PAIRS = D / 2, T = ctx0 + M - 1;   /* T: the keys the tile's last token sees */
    const int bs = c->block_size;
    const int64_t row_bytes = c->row_bytes, block_bytes = bs * row_bytes;
    const int64_t head_base = (int64_t)kv_head * c->num_blocks;
    const __mmask16 lanes = (__mmask16)((1u << M) - 1u);
    uint32_t *qt = (uint32_t *)work; /* [PAIRS][G][16]: pair p of head j of token m */
    float *scores = work + (size_t)PAIRS * G * TILE_TOKENS, *sums = scores + (size_t)T * G * TILE_TOKENS;
    for (int j = 0; j < G; ++j)
        for (int m = 0; m < TILE_TOKENS; ++m) {
            const uint32_t *src = (const uint32_t *)(q + m * q_token_bytes + j * q_head_bytes);
            for (int p = 0; p < PAIRS; ++p) qt[(p * G + j) * TILE_TOKENS + m] = m < M ? src[p] : 0u;
        }
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    __m512 vmax[8];
    for (int j = 0; j < G; ++j) vmax[j] = ninf;
    for (int t = 0; t < T; t += KB) {
        const int nk = T - t < KB ? T - t : KB;
        const uint32_t *kp[8];
        for (int i = 0; i < KB; ++i)
            kp[i] = (const uint32_t *)key_row(c->k_cache, table, head_base, block_bytes, row_bytes, bs,
                                              t + (i < nk ? i : nk - 1));
        __m512 acc[8][8];
        for (int i = 0; i < KB; ++i)
            for (int j = 0; j < G; ++j) acc[i][j] = _mm512_setzero_ps();
        for (int p = 0; p < PAIRS; ++p) {
            __m512bh kb[8];
            for (int i = 0; i < KB; ++i) kb[i] = (__m512bh)_mm512_set1_epi32((int)kp[i][p]);
            for (int j = 0; j < G; ++j) {
                const __m512bh qv = (__m512bh)_mm512_loadu_si512(qt + (p * G + j) * TILE_TOKENS);
                for (int i = 0; i < KB; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], qv, kb[i]);
            }
        }
        for (int i = 0; i < KB; ++i) { /* keys from T on: unseen by every token, rows to spare */
            const int key = t + i; /* token m sees it when key < ctx0 + m */
            const __mmask16 seen = key < ctx0 ? lanes : (__mmask16)(lanes & (0xFFFFu << (key - ctx0 + 1)));
            for (int j = 0; j < G; ++j) {
                const __m512 s = _mm512_mul_ps(acc[i][j], vscale);
                vmax[j] = _mm512_mask_max_ps(vmax[j], seen, vmax[j], s);
                _mm512_storeu_ps(scores + ((size_t)key * G + j) * TILE_TOKENS, _mm512_mask_mov_ps(ninf, seen, s));
            }
        }
    }
    /* probabilities in place (unseen keys and unused lanes: exp(-inf) = 0), their sums by lane */
    for (int j = 0; j < G; ++j) {
        const __m512 mx = _mm512_mask_mov_ps(_mm512_setzero_ps(), lanes, vmax[j]);
        __m512 sum = _mm512_setzero_ps();
        for (int key = 0; key < T; ++key) {
            float *s = scores + ((size_t)key * G + j) * TILE_TOKENS;
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s), mx));
            _mm512_storeu_ps(s, e);
            sum = _mm512_add_ps(sum, e);
        }
        _mm512_storeu_ps(sums + j * TILE_TOKENS, sum);
    }
    /* the values, two keys per product: pp[kp][j][m] holds token m's (head j's) probabilities of
     * keys 2kp and 2kp + 1 as a bfloat16 pair, vv[kp][v] the two keys' values of dims 16v.. side by
     * side, so that one vdpbf16ps adds both keys' parts for 16 dims (a missing last key: 0) */
    const int kpairs = (T + 1) / 2;
    uint32_t *pp = (uint32_t *)(sums + G * TILE_TOKENS), *vv = pp + (size_t)kpairs * G * TILE_TOKENS;
    for (int kp = 0; kp < kpairs; ++kp) {
        const int k0 = 2 * kp, k1 = k0 + 1;
        for (int j = 0; j < G; ++j) {
            const __m512 e0 = _mm512_loadu_ps(scores + ((size_t)k0 * G + j) * TILE_TOKENS);
            const __m512 e1 = k1 < T ? _mm512_loadu_ps(scores + ((size_t)k1 * G + j) * TILE_TOKENS) : _mm512_setzero_ps();
            const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e0));
            const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e1)), 16);
            _mm512_storeu_si512(pp + ((size_t)kp * G + j) * TILE_TOKENS, _mm512_or_si512(lo, hi));
        }
        const char *v0 = key_row(c->v_cache, table, head_base, block_bytes, row_bytes, bs, k0);
        const char *v1 = k1 < T ? key_row(c->v_cache, table, head_base, block_bytes, row_bytes, bs, k1) : NULL;
        for (int v = 0; v < V; ++v) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + v * 32)));
            const __m512i hi = v1 == NULL ? _mm512_setzero_si512()
                : _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v1 + v * 32))), 16);
            _mm512_storeu_si512(vv + ((size_t)kp * V + v) * 16, _mm512_or_si512(lo, hi));
        }
    }
    /* RC rows (token m, head j) at a time, row r = m * G + j */
    for (int r0 = 0; r0 < M * G; r0 += RC) {
        const int nr = M * G - r0 < RC ? M * G - r0 : RC;
        const int keys = ctx0 + (r0 + nr - 1) / G; /* what the pass's last token sees */
        int at[6]; /* each row's probability pair within a key pair's [G][16] */
        for (int i = 0; i < RC; ++i) {
            const int r = r0 + (i < nr ? i : 0);
            at[i] = (r % G) * TILE_TOKENS + r / G;
        }
        __m512 a[6][8];
        for (int i = 0; i < RC; ++i)
            for (int v = 0; v < V; ++v) a[i][v] = _mm512_setzero_ps();
        for (int kp = 0; kp < (keys + 1) / 2; ++kp) {
            __m512bh row[8];
            for (int v = 0; v < V; ++v) row[v] = (__m512bh)_mm512_loadu_si512(vv + ((size_t)kp * V + v) * 16);
            const uint32_t *pk = pp + (size_t)kp * G * TILE_TOKENS;
            for (int i = 0; i < RC; ++i) {
                const __m512bh pr = (__m512bh)_mm512_set1_epi32((int)pk[at[i]]);
                for (int v = 0; v < V; ++v) a[i][v] = _mm512_dpbf16_ps(a[i][v], row[v], pr);
            }
        }
        for (int i = 0; i < nr; ++i) {
            const int r = r0 + i, m = r / G, j = r % G;
            float acc[128];
            for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + 16 * v, a[i][v]);
            from_float(acc, 1.f / sums[j * TILE_TOKENS + m], DTYPE_BF16,
                       out + m * out_token_bytes + j * out_head_bytes, D);
        }
    }
}

#define HAVE_TILES 1
#endif /* __AVX512BF16__ */
#define HAVE_FAST_PATH 1
#elif defined(__AVX2__) && defined(__FMA__)
/* The AVX2 path (no AVX-512), for the same shapes: 8 keys' scores out of one vector, the running
 * maximum and the softmax's exponentials 8 lanes at a time. A bfloat16 row is widened by pairs: a
 * 32-bit lane holds elements 2i and 2i + 1, whose floats are the lane shifted up 16 bits and the
 * lane with its low half cleared (two operations per 16 elements). The queries are taken apart the
 * same way, so a score sums the same products in another order; the value accumulators keep even
 * and odd elements apart until the end. Value rows go through the group's accumulators a few
 * vectors at a time (AVX2 has 16 registers). Before this path the portable loop ran the decode
 * attention on such CPUs at 2.6 GB/s of K/V (benchmarks/attention_cpu.py). */
#include <immintrin.h>
#include <math.h> /* INFINITY */

#define FAST_KEYS 8

/* r[i] = the sum of v[i]'s 8 lanes */
static inline __m256 sum_lanes8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d); /* v0..v3 | v4..v7, by halves */
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

static inline float max_lanes8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* n (even) float vectors of the row at p: a bfloat16 row in pair order (even elements, then odd
 * ones, of each 16), others in order (KV_INT8: the int8 values, unscaled) */
static inline __attribute__((always_inline)) void load_row8(const char *p, int dtype, __m256 *out, const int n) {
    if (dtype == DTYPE_BF16) {
        const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
        for (int u = 0; u < n / 2; ++u) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(p + 32 * u));
            out[2 * u] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
            out[2 * u + 1] = _mm256_castsi256_ps(_mm256_and_si256(x, high));
        }
    } else if (dtype == KV_INT8) {
        for (int v = 0; v < n; ++v)
            out[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * v))));
    } else {
        for (int v = 0; v < n; ++v) out[v] = _mm256_loadu_ps((const float *)p + 8 * v);
    }
}

/* fast_exp's arithmetic on 8 lanes (rounding to nearest even instead of away from zero) */
static inline __m256 exp8(__m256 x) {
    const __m256 c = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-06f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), c));
    __m256 p = _mm256_set1_ps(1.f / 5040.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* exp_in_place 8 scores at a time; returns their sum */
static inline float exp_in_place8(float *restrict s, int ctx, float max) {
    const __m256 vm = _mm256_set1_ps(max);
    __m256 sum = _mm256_setzero_ps();
    int p = 0;
    for (; p + 8 <= ctx; p += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), vm));
        _mm256_storeu_ps(s + p, e);
        sum = _mm256_add_ps(sum, e);
    }
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    float total = _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
    for (; p < ctx; ++p) {
        s[p] = fast_exp(s[p] - max);
        total += s[p];
    }
    return total;
}

/* One (sequence, KV head), as the AVX-512 attend_fast above: G query heads of D dims at q. */
static inline __attribute__((always_inline)) void attend_fast(
        const cache_t *c, const int32_t *table, int ctx, int kv_head, const char *q, int64_t q_head_bytes,
        float scale, const int G, const int D, const scratch_t *w) {
    enum { MAXV = 16 };
    const int V = D / 8;                        /* float vectors per row */
    const int VC = G == 1 ? 8 : (G == 2 ? 4 : 2); /* of them per pass over a value block */
    float *restrict scores = w->scores, *restrict acc = w->acc;
    const int bs = c->block_size, cd = c->cdtype, celem = kv_elem_size(cd), quant = cd == KV_INT8;
    const int64_t head_base = (int64_t)kv_head * c->num_blocks;
    const int64_t row_bytes = c->row_bytes, block_bytes = bs * row_bytes;
    const int last = (ctx - 1) / bs;
    const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 qf[8][MAXV]; /* in the keys' order: pairs when the cache is bfloat16 (then so is q) */
    for (int j = 0; j < G; ++j) {
        const char *qj = q + j * q_head_bytes;
        if (cd == DTYPE_BF16 || c->dtype == DTYPE_F32) {
            load_row8(qj, c->dtype, qf[j], V);
        } else { /* bfloat16 queries over an int8 cache: in order */
            for (int v = 0; v < V; ++v)
                qf[j][v] = _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(qj + 16 * v))), 16));
        }
    }
    __m256 vmax[8];
    for (int j = 0; j < G; ++j) vmax[j] = ninf;
    prefetch_first_keys(c, table, head_base, block_bytes, last);
    for (int pos0 = 0, b = 0; pos0 < ctx; pos0 += bs, ++b) {
        const int n = ctx - pos0 < bs ? ctx - pos0 : bs;
        prefetch_while_keys(c, table, head_base, block_bytes, b, last);
        const char *kb = c->k_cache + (head_base + table[b]) * block_bytes;
        for (int t0 = 0; t0 < n; t0 += FAST_KEYS) {
            const int m = n - t0 < FAST_KEYS ? n - t0 : FAST_KEYS;
            const char *k0 = kb + t0 * row_bytes;
            __m256 kscale = vscale;
            if (quant) {
                float ks[FAST_KEYS];
                for (int t = 0; t < FAST_KEYS; ++t) ks[t] = t < m ? kv_row_scale(k0 + t * row_bytes, D) : 0.f;
                kscale = _mm256_mul_ps(vscale, _mm256_loadu_ps(ks));
            }
            const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(m), iota);
            for (int j = 0; j < G; ++j) {
                __m256 part[FAST_KEYS];
                for (int t = 0; t < FAST_KEYS; ++t) {
                    part[t] = _mm256_setzero_ps();
                    if (t >= m) continue;
                    __m256 row[MAXV];
                    load_row8(k0 + t * row_bytes, cd, row, V);
                    for (int v = 0; v < V; ++v) part[t] = _mm256_fmadd_ps(row[v], qf[j][v], part[t]);
                }
                const __m256 sums = _mm256_mul_ps(sum_lanes8(part), kscale);
                _mm256_maskstore_ps(scores + j * ctx + pos0 + t0, valid, sums);
                vmax[j] = _mm256_max_ps(vmax[j], _mm256_blendv_ps(ninf, sums, _mm256_castsi256_ps(valid)));
            }
        }
    }
    /* softmax per query head, in place; 1 / sum kept in acc's tail */
    for (int j = 0; j < G; ++j) acc[G * D + j] = 1.f / exp_in_place8(scores + j * ctx, ctx, max_lanes8(vmax[j]));
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int pos0 = 0, b = 0; pos0 < ctx; pos0 += bs, ++b) {
        const int n = ctx - pos0 < bs ? ctx - pos0 : bs;
        prefetch_while_values(c, table, head_base, block_bytes, b, last);
        const char *vb = c->v_cache + (head_base + table[b]) * block_bytes;
        if (quant) /* the values' scales into the probabilities */
            for (int t = 0; t < n; ++t) {
                const float vs = kv_row_scale(vb + t * row_bytes, D);
                for (int j = 0; j < G; ++j) scores[j * ctx + pos0 + t] *= vs;
            }
        for (int c0 = 0; c0 < V; c0 += VC) {
            __m256 a[8][8];
            for (int j = 0; j < G; ++j)
                for (int v = 0; v < VC; ++v) a[j][v] = _mm256_loadu_ps(acc + j * D + 8 * (c0 + v));
            for (int t = 0; t < n; ++t) {
                __m256 row[8];
                load_row8(vb + t * row_bytes + 8 * c0 * celem, cd, row, VC);
                for (int j = 0; j < G; ++j) {
                    const __m256 p = _mm256_broadcast_ss(scores + j * ctx + pos0 + t);
                    for (int v = 0; v < VC; ++v) a[j][v] = _mm256_fmadd_ps(p, row[v], a[j][v]);
                }
            }
            for (int j = 0; j < G; ++j)
                for (int v = 0; v < VC; ++v) _mm256_storeu_ps(acc + j * D + 8 * (c0 + v), a[j][v]);
        }
    }
    if (cd == DTYPE_BF16) /* pair order back to element order */
        for (int j = 0; j < G; ++j)
            for (int u = 0; u < V / 2; ++u) {
                float *x = acc + j * D + 16 * u;
                const __m256 even = _mm256_loadu_ps(x), odd = _mm256_loadu_ps(x + 8);
                const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
                _mm256_storeu_ps(x, _mm256_permute2f128_ps(lo, hi, 0x20));
                _mm256_storeu_ps(x + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
            }
}

/* Prefill tiles as the AVX-512 ones above, 8 tokens to a vector and in floats throughout: the
 * tile's queries transposed (qt[d][j]: dim d of head j, token m in lane m), its keys and then its
 * values widened to floats once (kv[key][d]), so that a key's dim is one broadcast from memory,
 * multiplied into every token's score at once (KB keys x G heads of accumulators); the softmax
 * lane-wise; the weighted sum again with the tokens as lanes, DB dims x G heads at a time, each
 * value one broadcast. Decodes and speculative verification rows keep attend_fast, as there. */
static size_t tile_scratch_floats(int group, int head_dim, int max_ctx) {
    const size_t keys = (size_t)max_ctx + 8; /* score rows up to a whole pass of keys beyond the last */
    return (size_t)TILE_TOKENS * group * ((size_t)head_dim + keys + 1) + (size_t)max_ctx * head_dim;
}

/* the first n rows of a cache (bfloat16, D wide) from key 0 on, as floats at dst (D apart) */
static inline void rows_to_floats(const char *cache, const int32_t *table, int64_t head_base, int64_t block_bytes,
                                  int64_t row_bytes, int bs, int n, const int D, float *dst) {
    for (int key = 0; key < n; ++key) {
        const char *src = key_row(cache, table, head_base, block_bytes, row_bytes, bs, key);
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(dst + (int64_t)key * D + d, _mm256_castsi256_ps(_mm256_slli_epi32(
                                 _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2 * d))), 16)));
    }
}

static inline __attribute__((always_inline)) void attend_tile(
        const cache_t *c, const int32_t *table, int ctx0, int M, int kv_head, const char *q,
        int64_t q_token_bytes, int64_t q_head_bytes, float scale, const int G, const int D, float *work,
        char *out, int64_t out_token_bytes, int64_t out_head_bytes) {
    enum { L = TILE_TOKENS };
    /* keys and dims per pass: KB x G (DB x G) accumulators, G query (probability) vectors and a
     * broadcast in the 16 registers; every count constant, so that nothing lives in memory */
    const int KB = G <= 1 ? 8 : G <= 2 ? 6 : G <= 3 ? 4 : G <= 5 ? 2 : 1;
    const int DB = G <= 1 ? 8 : G <= 3 ? 4 : G <= 5 ? 2 : 1;
    const int T = ctx0 + M - 1, bs = c->block_size; /* T: the keys the tile's last token sees */
    const int64_t row_bytes = c->row_bytes, block_bytes = bs * row_bytes;
    const int64_t head_base = (int64_t)kv_head * c->num_blocks;
    float *qt = work, *scores = qt + (size_t)D * G * L, *sums = scores + (size_t)(T + 8) * G * L, *kv = sums + G * L;
    for (int j = 0; j < G; ++j)
        for (int m = 0; m < L; ++m) {
            const uint16_t *src = (const uint16_t *)(q + m * q_token_bytes + j * q_head_bytes);
            for (int d = 0; d < D; ++d) {
                uint32_t bits = m < M ? (uint32_t)src[d] << 16 : 0u;
                __builtin_memcpy(qt + ((size_t)d * G + j) * L + m, &bits, sizeof bits);
            }
        }
    rows_to_floats(c->k_cache, table, head_base, block_bytes, row_bytes, bs, T, D, kv);
    const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    /* token m sees the keys below ctx0 + m; lanes beyond M none */
    const __m256 limit = _mm256_blendv_ps(_mm256_set1_ps(-1.f),
                                          _mm256_add_ps(_mm256_set1_ps((float)ctx0), _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7)),
                                          _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(M),
                                                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
    __m256 vmax[8];
    for (int j = 0; j < G; ++j) vmax[j] = ninf;
    for (int t = 0; t < T; t += KB) {
        const int nk = T - t < KB ? T - t : KB;
        const float *kr[8];
        for (int i = 0; i < KB; ++i) kr[i] = kv + (int64_t)(t + (i < nk ? i : nk - 1)) * D;
        __m256 acc[8][8];
        for (int i = 0; i < KB; ++i)
            for (int j = 0; j < G; ++j) acc[i][j] = _mm256_setzero_ps();
        for (int d = 0; d < D; ++d) {
            __m256 qv[8];
            for (int j = 0; j < G; ++j) qv[j] = _mm256_loadu_ps(qt + ((size_t)d * G + j) * L);
            for (int i = 0; i < KB; ++i) {
                const __m256 kb = _mm256_broadcast_ss(kr[i] + d);
                for (int j = 0; j < G; ++j) acc[i][j] = _mm256_fmadd_ps(qv[j], kb, acc[i][j]);
            }
        }
        for (int i = 0; i < KB; ++i) { /* keys from T on: unseen by every token, rows to spare */
            const int key = t + i;
            const __m256 seen = _mm256_cmp_ps(_mm256_set1_ps((float)key), limit, _CMP_LT_OQ);
            for (int j = 0; j < G; ++j) {
                const __m256 s = _mm256_blendv_ps(ninf, _mm256_mul_ps(acc[i][j], vscale), seen);
                vmax[j] = _mm256_max_ps(vmax[j], s);
                _mm256_storeu_ps(scores + ((size_t)key * G + j) * L, s);
            }
        }
    }
    /* probabilities in place (unseen keys and unused lanes: exp(-inf) = 0), their sums by lane */
    for (int j = 0; j < G; ++j) {
        const __m256 mx = _mm256_blendv_ps(_mm256_setzero_ps(), vmax[j], _mm256_cmp_ps(vmax[j], ninf, _CMP_GT_OQ));
        __m256 sum = _mm256_setzero_ps();
        for (int key = 0; key < T; ++key) {
            float *sp = scores + ((size_t)key * G + j) * L;
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sp), mx));
            _mm256_storeu_ps(sp, e);
            sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(sums + j * L, sum);
    }
    rows_to_floats(c->v_cache, table, head_base, block_bytes, row_bytes, bs, T, D, kv);
    float *o = qt; /* the queries are done with: o[d][j] by lane, the outputs' sums */
    for (int d0 = 0; d0 < D; d0 += DB) {
        __m256 acc[8][8];
        for (int i = 0; i < DB; ++i)
            for (int j = 0; j < G; ++j) acc[i][j] = _mm256_setzero_ps();
        for (int key = 0; key < T; ++key) {
            __m256 pv[8];
            for (int j = 0; j < G; ++j) pv[j] = _mm256_loadu_ps(scores + ((size_t)key * G + j) * L);
            const float *vr = kv + (int64_t)key * D + d0;
            for (int i = 0; i < DB; ++i) {
                const __m256 vb = _mm256_broadcast_ss(vr + i);
                for (int j = 0; j < G; ++j) acc[i][j] = _mm256_fmadd_ps(pv[j], vb, acc[i][j]);
            }
        }
        for (int i = 0; i < DB; ++i)
            for (int j = 0; j < G; ++j) _mm256_storeu_ps(o + ((size_t)(d0 + i) * G + j) * L, acc[i][j]);
    }
    for (int m = 0; m < M; ++m)
        for (int j = 0; j < G; ++j) {
            float row[128];
            for (int d = 0; d < D; ++d) row[d] = o[((size_t)d * G + j) * L + m];
            from_float(row, 1.f / sums[j * L + m], DTYPE_BF16, out + m * out_token_bytes + j * out_head_bytes, D);
        }
}

#define HAVE_TILES 1
#define HAVE_FAST_PATH 1
#endif

#ifdef HAVE_TILES
#define TILE_CASE(G, D)                                                                                 \
    case (G) * 1000 + (D):                                                                              \
        attend_tile(c, table, ctx0, M, kv_head, q, q_token_bytes, q_head_bytes, scale, G, D, work, out,   \
                    out_token_bytes, out_head_bytes);                                                   \
        return;

static void attend_tile_dispatch(const cache_t *c, const int32_t *table, int ctx0, int M, int kv_head,
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
    case (G) * 1000 + (D): attend_fast(c, table, ctx, kv_head, q, q_head_bytes, scale, G, D, w); return 1;

/* 1 when the fast path took this item (accumulators and 1 / sums in w->acc), else 0. It stays in
 * this file, static: moved into a translation unit of its own (with a shared header) the decode
 * kernel ran 20-30% slower (batch 48 x 300, 30 layers: 26-28 vs 21-22 ms, alternating runs). */
static int attend_fast_dispatch(const cache_t *c, const int32_t *table, int ctx, int kv_head, const char *q,
                                int64_t q_head_bytes, float scale, int group, int head_dim,
                                const scratch_t *w) {
    switch (group * 1000 + head_dim) {
        FAST_CASE(1, 64) FAST_CASE(2, 64) FAST_CASE(3, 64) FAST_CASE(4, 64)
        FAST_CASE(5, 64) FAST_CASE(6, 64) FAST_CASE(7, 64) FAST_CASE(8, 64)
        FAST_CASE(1, 128) FAST_CASE(2, 128) FAST_CASE(3, 128) FAST_CASE(4, 128)
        FAST_CASE(5, 128) FAST_CASE(6, 128) FAST_CASE(7, 128) FAST_CASE(8, 128)
        default: return 0;
    }
}
#else
static int attend_fast_dispatch(const cache_t *c, const int32_t *table, int ctx, int kv_head, const char *q,
                                int64_t q_head_bytes, float scale, int group, int head_dim,
                                const scratch_t *w) {
    (void)c, (void)table, (void)ctx, (void)kv_head, (void)q, (void)q_head_bytes, (void)scale;
    (void)group, (void)head_dim, (void)w;
    return 0;
}
#endif

/* Floats of scratch one thread needs for attend_one over contexts of up to max_ctx keys. */
size_t attend_scratch_floats(int group, int head_dim, int block_size, int max_ctx) {
    const size_t q_len = (size_t)group * head_dim, acc_len = q_len + group;
    return q_len + acc_len + (size_t)block_size * head_dim + (size_t)group * (size_t)max_ctx;
}

/* The group query heads at q0 (q_head_bytes apart) that share KV head kv_head, over the first
 * ctx keys and values in table's blocks; head j's output goes to out0 + j * out_head_bytes.
 * scratch: attend_scratch_floats(group, head_dim, block_size, >= ctx) floats of this thread's. */
void attend_one(const void *k_cache, const void *v_cache, int64_t num_blocks, int block_size,
                const int32_t *table, int ctx, int kv_head, const char *q0, int64_t q_head_bytes, float scale,
                int group, int head_dim, int dtype, int cache_dtype, float *scratch, char *out0,
                int64_t out_head_bytes) {
    const cache_t cache = {(const char *)k_cache, (const char *)v_cache, num_blocks, block_size, dtype,
                           elem_size(dtype), cache_dtype, kv_row_bytes(cache_dtype, head_dim)};
    const size_t q_len = (size_t)group * head_dim, acc_len = q_len + group;
    const scratch_t w = {scratch, scratch + q_len, scratch + q_len + acc_len,
                         scratch + q_len + acc_len + (size_t)block_size * head_dim};
    if (!attend_fast_dispatch(&cache, table, ctx, kv_head, q0, q_head_bytes, scale, group, head_dim, &w))
        attend_any(&cache, table, ctx, kv_head, q0, q_head_bytes, scale, group, head_dim, &w);
    for (int j = 0; j < group; ++j)
        from_float(w.acc + j * head_dim, w.acc[group * head_dim + j], dtype, out0 + j * out_head_bytes, head_dim);
}

/* For each i: out[tokens[i]] = attention of q[tokens[i]] over the first ctx_lens[i] keys and
 * values in the blocks of block_tables[seq_ids[i]] (a decode sees its whole context, a prefill
 * token the keys up to its own position). Strides are in elements. Returns 0, 1 for shapes it does
 * not take, 2 when scratch memory could not be had. */
int paged_decode(const void *q, int64_t q_token_stride, int64_t q_head_stride, const void *k_cache,
                 const void *v_cache, int64_t num_blocks, int block_size, const int32_t *block_tables,
                 int64_t table_stride, const int32_t *seq_ids,
                 const int32_t *tokens, const int32_t *ctx_lens, int num_queries, int num_heads, int num_kv_heads, int head_dim,
                 float scale, void *out, int64_t out_token_stride, int64_t out_head_stride, int dtype,
                 int cache_dtype, int num_threads) {
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
    const int tiled = tiles_take(dtype, cache_dtype, group, head_dim);
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
            const int seq = seq_ids[i], ctx = ctx_lens[i];
            if (ctx <= 0) continue;
            const int64_t token = tokens[i];
            const int h0 = kv_head * group;
            const char *q0 = (const char *)q + (token * q_token_stride + h0 * q_head_stride) * elem;
            char *out0 = (char *)out + (token * out_token_stride + h0 * out_head_stride) * elem;
            const int32_t *table = block_tables + (int64_t)seq * table_stride;
#ifdef HAVE_TILES
            if (count > 1) {
                const cache_t cache = {(const char *)k_cache, (const char *)v_cache, num_blocks, block_size,
                                       dtype, elem, cache_dtype, kv_row_bytes(cache_dtype, head_dim)};
                attend_tile_dispatch(&cache, table, ctx, count, kv_head, q0, q_token_stride * elem,
                                     q_head_stride * elem, scale, group, head_dim, mine, out0,
                                     out_token_stride * elem, out_head_stride * elem);
                continue;
            }
#endif
            (void)count;
            attend_one(k_cache, v_cache, num_blocks, block_size, table, ctx, kv_head, q0, q_head_stride * elem,
                       scale, group, head_dim, dtype, cache_dtype, mine, out0, out_head_stride * elem);
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
