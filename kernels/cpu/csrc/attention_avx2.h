/* attention.c's vector paths on AVX2 with FMA (included by attention.c where no AVX-512 is
 * targeted): attend_fast for decode and the prefill tiles (attend_tile), 8 lanes. */
#ifndef KVSERVE_ATTENTION_AVX2_H
#define KVSERVE_ATTENTION_AVX2_H

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
        const cache_t *c, const int32_t *table, int ctx, int skip, int kv_head, const char *q,
        int64_t q_head_bytes, float scale, const int G, const int D, const scratch_t *w, const variant_t *var) {
    enum { MAXV = 32 };
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
            /* keys before a sliding window's first (the first skip) score -inf */
            const __m256 seen = _mm256_castsi256_ps(
                _mm256_and_si256(valid, _mm256_cmpgt_epi32(iota, _mm256_set1_epi32(skip - pos0 - t0 - 1))));
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
                const __m256 kept = _mm256_blendv_ps(ninf, sums, seen);
                _mm256_maskstore_ps(scores + j * ctx + pos0 + t0, valid, kept);
                vmax[j] = _mm256_max_ps(vmax[j], kept);
            }
        }
    }
    /* softmax per query head, in place (var's cap and sink); 1 / sum kept in acc's tail */
    for (int j = 0; j < G; ++j) {
        float *restrict s = scores + j * ctx;
        const float m = variant_scores(s, ctx, skip, max_lanes8(vmax[j]), var, j);
        acc[G * D + j] = 1.f / variant_sum(exp_in_place8(s, ctx, m), m, var, j);
    }
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
        const cache_t *c, const int32_t *table, int ctx0, int M, int window, int kv_head, const char *q,
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
    /* ... and, with a window, the keys from ctx0 + m - window on */
    const __m256 low = window > 0 ? _mm256_add_ps(_mm256_set1_ps((float)(ctx0 - window)),
                                                  _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7))
                                  : _mm256_set1_ps(-1.f);
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
            const __m256 seen = _mm256_and_ps(_mm256_cmp_ps(_mm256_set1_ps((float)key), limit, _CMP_LT_OQ),
                                              _mm256_cmp_ps(_mm256_set1_ps((float)key), low, _CMP_GE_OQ));
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
