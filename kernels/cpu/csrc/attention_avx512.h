/* attention.c's vector paths on AVX-512 (included by attention.c where AVX-512 F is targeted):
 * attend_fast for decode, and with AVX512-BF16 the prefill tiles (attend_tile). */
#ifndef KVSERVE_ATTENTION_AVX512_H
#define KVSERVE_ATTENTION_AVX512_H

/* The AVX-512 path for head dims 64 and 128 and up to 8 query heads per KV head (and 256: 1, 2, 4
 * or 8 of them): the scores of 16 keys come out of one vector instead of one horizontal sum per key, the
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
 * keys' scales too in a KV_INT8 cache; the values' scales go into the probabilities). The first
 * skip keys (a sliding window's, in its first block) score -inf. */
static inline __attribute__((always_inline)) void attend_fast(
        const cache_t *c, const int32_t *table, int ctx, int skip, int kv_head, const char *q,
        int64_t q_head_bytes, float scale, const int G, const int D, const scratch_t *w, const variant_t *var) {
    enum { MAXV = 16 };
    const int V = D / 16; /* float vectors per row */
    /* of them per pass over the values: all up to D 128 (as many accumulators as always); at 256,
     * as many as keep the G heads' accumulators and one row's chunk within the 32 registers */
    const int VC = D <= 128 ? V : (G <= 1 ? 16 : (G <= 2 ? 8 : (G <= 4 ? 4 : 2)));
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
                const int before = skip - pos0 - t0; /* of these 16 keys, those before the window */
                const __mmask16 seen = before <= 0 ? valid
                                       : before >= FAST_KEYS ? 0 : (__mmask16)(valid & (0xFFFFu << before));
                _mm512_mask_storeu_ps(scores + j * ctx + pos0 + t0, valid,
                                      _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, sums));
                vmax[j] = _mm512_mask_max_ps(vmax[j], seen, vmax[j], sums);
            }
        }
    }
    /* softmax per query head, in place (var's cap and sink); 1 / sum kept in acc's tail */
    for (int j = 0; j < G; ++j) {
        float *restrict s = scores + j * ctx;
        const float m = variant_scores(s, ctx, skip, _mm512_reduce_max_ps(vmax[j]), var, j);
        acc[G * D + j] = 1.f / variant_sum(exp_in_place(s, ctx, m), m, var, j);
    }
    for (int c0 = 0; c0 < V; c0 += VC) {
        __m512 a[8][MAXV];
        for (int j = 0; j < G; ++j)
            for (int v = 0; v < VC; ++v) a[j][v] = _mm512_setzero_ps();
        for (int pos0 = 0, b = 0; pos0 < ctx; pos0 += bs, ++b) {
            const int n = ctx - pos0 < bs ? ctx - pos0 : bs;
            if (c0 == 0) prefetch_while_values(c, table, head_base, block_bytes, b, last);
            const char *vb = c->v_cache + (head_base + table[b]) * block_bytes;
            for (int t = 0; t < n; ++t) {
                __m512 row[MAXV];
                const char *vt = vb + t * row_bytes;
                for (int v = 0; v < VC; ++v) row[v] = load16(vt + (c0 + v) * 16 * celem, cd);
                const float vs = quant ? kv_row_scale(vt, D) : 1.f;
                for (int j = 0; j < G; ++j) {
                    const __m512 p = _mm512_set1_ps(scores[j * ctx + pos0 + t] * vs);
                    for (int v = 0; v < VC; ++v) a[j][v] = _mm512_fmadd_ps(p, row[v], a[j][v]);
                }
            }
        }
        for (int j = 0; j < G; ++j)
            for (int v = 0; v < VC; ++v) _mm512_storeu_ps(acc + j * D + 16 * (c0 + v), a[j][v]);
    }
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
        const cache_t *c, const int32_t *table, int ctx0, int M, int window, int kv_head, const char *q,
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
            __mmask16 seen = key < ctx0 ? lanes : (__mmask16)(lanes & (0xFFFFu << (key - ctx0 + 1)));
            if (window > 0) { /* and token m's window starts at ctx0 + m - window: m <= key - ctx0 + window */
                const int h = key - ctx0 + window;
                seen &= h >= 15 ? (__mmask16)0xFFFFu : h < 0 ? (__mmask16)0 : (__mmask16)((1u << (h + 1)) - 1u);
            }
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

#endif
