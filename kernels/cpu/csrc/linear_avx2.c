/* Few-row linears of int8 and int4 weights on CPUs with AVX2 but not AVX-512 (most AMD Zen 1-3,
 * Intel client cores): y[m][n] = scale[n] * (x[m] . w[n]) + bias[n] for 1 to MAX_FUSED_ROWS rows
 * of x, the work of a decode step of a few sequences, whose cost should be reading w once.
 *
 * Without these the quantized weights would be dequantized at every step, slower than bfloat16
 * (docs/serving/quantization.md, "AVX2 CPUs without AVX-512"). Here x is
 * quantized per Q8_BLOCK values (scale = max|x| / 127, magnitudes rounded to nearest even, as
 * linear.c does on AVX512-VNNI and llama.cpp does with its Q8 activations) and the products are
 * summed in integers: vpmaddubsw multiplies unsigned bytes by signed ones and adds pairs into
 * 16 bits, vpmaddwd by ones adds those pairs into 32 bits, so each int32 lane sums 4 products as
 * vpdpbusd's do. int8 weights: x's magnitudes against the weights with x's signs (vpsignb; no
 * overflow: |w|, |x| <= 127, so a pair is at most 32258); int4 weights (common.h's superblock
 * layout, the one linear.c reads) are unsigned 4-bit values against x's signed bytes, and each
 * group's minimum times the sum of its 32 x values adds the rest. Per x block (int8) or per
 * superblock (int4) the integer sums are converted and scaled once.
 *
 * Each output's sums run in the same order whatever rows are beside it (the rows of x only share
 * the weight's loads), so a row's result does not depend on the batch: a speculative step's k + 1
 * verification rows give the bits a one-row step gives. bfloat16 and float32 weights stay with
 * gemm.c and elementwise.c (linear_takes refuses them here).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if HAVE_AVX2_ROWS
#include <immintrin.h>

#define PREFETCH_BYTES 8192

/* NX rows of x quantized (for one kind of weight): int8 weights: the values in order (sx, k_in a
 * row) and each block's scale (scale, k_in / Q8_BLOCK a row); int4 weights: the values in the
 * superblock layout (sq, SB_INPUTS a superblock, zeros past a short last one) and per superblock
 * the groups' scales and scaled sums (gscale, gsum, SB_GROUPS each, zeros past a short one). */
typedef struct {
    const int8_t *sx, *sq;
    const float *scale, *gscale, *gsum;
    int superblocks;
} qx_t;

/* Each team thread quantizes x into a buffer of its own (every thread gets the same bytes; no
 * barrier); the buffer lives as long as the thread (OpenMP keeps its threads). */
static __thread char *qx_buffer;
static __thread size_t qx_capacity;

static int quantize_x(const float *xf, int rows, int k_in, int for_int4, qx_t *q) {
    const int blocks = k_in / Q8_BLOCK, superblocks = (k_in + SB_INPUTS - 1) / SB_INPUTS;
    const size_t per_row = for_int4 ? (size_t)superblocks * (SB_INPUTS + 2 * SB_GROUPS * sizeof(float))
                                    : (size_t)k_in + (size_t)blocks * sizeof(float);
    const size_t need = (size_t)rows * per_row;
    if (need > qx_capacity) {
        free(qx_buffer);
        qx_capacity = 0;
        qx_buffer = aligned_alloc(64, (need + 63) & ~(size_t)63);
        if (qx_buffer == NULL) return 0;
        qx_capacity = need;
    }
    int8_t *values = (int8_t *)qx_buffer; /* sx or sq; k_in and SB_INPUTS are multiples of 64 */
    float *scale = (float *)(values + (size_t)rows * (for_int4 ? (size_t)superblocks * SB_INPUTS : (size_t)k_in));
    float *gsum = scale + (size_t)rows * superblocks * SB_GROUPS;
    if (for_int4) memset(qx_buffer, 0, need);
    for (int r = 0; r < rows; ++r) {
        for (int g = 0; g < blocks; ++g) {
            const float *v = xf + (int64_t)r * k_in + (int64_t)g * Q8_BLOCK;
            float amax = 0.f;
            for (int i = 0; i < Q8_BLOCK; ++i) { const float a = __builtin_fabsf(v[i]); amax = a > amax ? a : amax; }
            const float inv = amax > 0.f ? 127.f / amax : 0.f, d = amax / 127.f;
            int8_t block[Q8_BLOCK];
            int sum = 0;
            for (int i = 0; i < Q8_BLOCK; ++i) {
                const int magnitude = (int)__builtin_rintf(__builtin_fabsf(v[i]) * inv); /* nearest even */
                block[i] = (int8_t)(v[i] < 0.f ? -magnitude : magnitude);
                sum += block[i];
            }
            if (!for_int4) {
                memcpy(values + (int64_t)r * k_in + (int64_t)g * Q8_BLOCK, block, Q8_BLOCK);
                scale[(int64_t)r * blocks + g] = d;
                continue;
            }
            const int sb = g / SB_GROUPS, l = g % SB_GROUPS, P = sb_lanes(sb_size(blocks, sb));
            const int64_t slot = (int64_t)r * superblocks + sb;
            for (int u = 0; u < 8; ++u) /* quad u: step u / P, lane l P + u % P */
                memcpy(values + slot * SB_INPUTS + (u / P) * 64 + 4 * (l * P + u % P), block + 4 * u, 4);
            scale[slot * SB_GROUPS + l] = d;
            gsum[slot * SB_GROUPS + l] = d * (float)sum; /* the sum is exact */
        }
    }
    q->sx = q->sq = values, q->scale = q->gscale = scale, q->gsum = gsum, q->superblocks = superblocks;
    return 1;
}

static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* out[m * NW + j] = x_m . w_j (unscaled by w's row scale) for int8 weight rows w + j row_bytes */
static inline __attribute__((always_inline)) void dot_q8(const qx_t *q, const int NX, const char *w,
                                                         int64_t row_bytes, const int NW, int k_in, float *out) {
    __m256 acc[MAX_FUSED_ROWS * 4];
    #pragma GCC unroll 16
    for (int i = 0; i < NX * NW; ++i) acc[i] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    const int blocks = k_in / Q8_BLOCK;
    for (int c = 0; c < blocks; ++c) {
        __m256i wv[4];
        #pragma GCC unroll 16
        for (int j = 0; j < NW; ++j) wv[j] = _mm256_loadu_si256((const __m256i *)(w + j * row_bytes + c * Q8_BLOCK));
        #pragma GCC unroll 16
        for (int m = 0; m < NX; ++m) {
            const __m256i xv = _mm256_load_si256((const __m256i *)(q->sx + (int64_t)m * k_in + c * Q8_BLOCK));
            const __m256i magnitude = _mm256_sign_epi8(xv, xv);
            const __m256 scale = _mm256_set1_ps(q->scale[(int64_t)m * blocks + c]);
            #pragma GCC unroll 16
            for (int j = 0; j < NW; ++j) {
                const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(wv[j], xv));
                const __m256i sums = _mm256_madd_epi16(pairs, ones);
                acc[m * NW + j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[m * NW + j]);
            }
        }
    }
    #pragma GCC unroll 16
    for (int i = 0; i < NX * NW; ++i) out[i] = hsum8(acc[i]);
}

/* out[m * NW + j] = x_m . w_j for int4 weight rows w + j row_bytes (groups: their scales, then
 * minimums, float16, group_bytes a row): per group scale * (x . q) + min * sum(x), x . q summed
 * in integers over a superblock's steps before one conversion. A 64-byte step vector of linear.c
 * is two halves here: int32 lanes 0-7 and 8-15. */
static inline __attribute__((always_inline)) void dot_q4(const qx_t *q, const int NX, const char *w,
                                                         int64_t row_bytes, const char *groups, int64_t group_bytes,
                                                         const int NW, int k_in, float *out) {
    __m256 acc[MAX_FUSED_ROWS * 4];
    #pragma GCC unroll 16
    for (int i = 0; i < NX * NW; ++i) acc[i] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int num_groups = k_in / INT4_GROUP;
    for (int sb = 0; sb < q->superblocks; ++sb) {
        const int G = sb_size(num_groups, sb), P = sb_lanes(G), S = 8 / P, vb = 4 * G * P;
        const char *block = w + (int64_t)sb * (SB_INPUTS / 2); /* the superblocks before are whole */
        __m256i sums[MAX_FUSED_ROWS * 4][2];
        #pragma GCC unroll 16
        for (int i = 0; i < NX * NW; ++i) sums[i][0] = sums[i][1] = _mm256_setzero_si256();
        for (int t = 0; t < (S + 1) / 2; ++t) {
            #pragma GCC unroll 16
            for (int j = 0; j < NW; ++j) {
                const char *at = block + j * row_bytes + (int64_t)t * vb;
                __m256i lo[2], hi[2];
                if (S == 1) { /* one step in 32 bytes: values 0-31 low (lanes 0-7), 32-63 high */
                    const __m256i packed = _mm256_loadu_si256((const __m256i *)at);
                    lo[0] = _mm256_and_si256(packed, low4), lo[1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
                    hi[0] = hi[1] = _mm256_setzero_si256();
                } else {
                    __m256i packed[2];
                    if (vb == 64) {
                        packed[0] = _mm256_loadu_si256((const __m256i *)at);
                        packed[1] = _mm256_loadu_si256((const __m256i *)(at + 32));
                    } else { /* a short superblock's step: vb bytes, zeros after */
                        char bytes[64] = {0};
                        memcpy(bytes, at, (size_t)vb);
                        packed[0] = _mm256_loadu_si256((const __m256i *)bytes);
                        packed[1] = _mm256_loadu_si256((const __m256i *)(bytes + 32));
                    }
                    #pragma GCC unroll 16
                    for (int h = 0; h < 2; ++h) {
                        lo[h] = _mm256_and_si256(packed[h], low4);
                        hi[h] = _mm256_and_si256(_mm256_srli_epi16(packed[h], 4), low4);
                    }
                }
                #pragma GCC unroll 16
                for (int m = 0; m < NX; ++m) {
                    const int8_t *x = q->sq + ((int64_t)m * q->superblocks + sb) * SB_INPUTS + (int64_t)t * 128;
                    #pragma GCC unroll 16
                    for (int h = 0; h < 2; ++h) {
                        __m256i s = _mm256_maddubs_epi16(lo[h], _mm256_load_si256((const __m256i *)(x + 32 * h)));
                        if (S > 1)
                            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[h], _mm256_load_si256((const __m256i *)(x + 64 + 32 * h))));
                        sums[m * NW + j][h] = _mm256_add_epi32(sums[m * NW + j][h], _mm256_madd_epi16(s, ones));
                    }
                }
            }
        }
        /* the G groups' float16 scales and minimums, two a 32-bit lane (G is even: widths are
         * multiples of 64), zeros past them (a masked load: no bytes past the row read, and no
         * store-to-load stall of a copy) */
        const __m128i quad = _mm_setr_epi32(0, 1, 2, 3);
        const __m128i in_lo = _mm_cmpgt_epi32(_mm_set1_epi32(G / 2), quad);
        const __m128i in_hi = _mm_cmpgt_epi32(_mm_set1_epi32(G / 2 - 4), quad);
        /* lane l of the sums belongs to group l / P; the minimums' terms go in lane g */
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const int shift = __builtin_ctz((unsigned)P);
        const __m256i of_lo = _mm256_srli_epi32(lane, shift), of_hi = _mm256_srli_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32(8)), shift);
        #pragma GCC unroll 16
        for (int j = 0; j < NW; ++j) {
            const uint16_t *ws = (const uint16_t *)(groups + j * group_bytes) + sb * SB_GROUPS, *wm = ws + num_groups;
            const __m256 ws_lo = _mm256_cvtph_ps(_mm_maskload_epi32((const int *)ws, in_lo));
            const __m256 ws_hi = _mm256_cvtph_ps(_mm_maskload_epi32((const int *)(ws + 8), in_hi));
            const __m256 wm_lo = _mm256_cvtph_ps(_mm_maskload_epi32((const int *)wm, in_lo));
            const __m256 wm_hi = _mm256_cvtph_ps(_mm_maskload_epi32((const int *)(wm + 8), in_hi));
            #pragma GCC unroll 16
            for (int m = 0; m < NX; ++m) {
                const int64_t slot = ((int64_t)m * q->superblocks + sb) * SB_GROUPS;
                const float *xs = q->gscale + slot, *xsum = q->gsum + slot;
                const __m256 gs_lo = _mm256_mul_ps(ws_lo, _mm256_load_ps(xs));
                const __m256 gs_hi = _mm256_mul_ps(ws_hi, _mm256_load_ps(xs + 8));
                __m256 a = _mm256_fmadd_ps(wm_lo, _mm256_load_ps(xsum), acc[m * NW + j]);
                a = _mm256_fmadd_ps(wm_hi, _mm256_load_ps(xsum + 8), a);
                const __m256 sc_lo = P == 1 ? gs_lo : _mm256_permutevar8x32_ps(gs_lo, of_lo);
                const __m256 sc_hi = P == 1 ? gs_hi : _mm256_permutevar8x32_ps(gs_lo, of_hi);
                a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[m * NW + j][0]), sc_lo, a);
                acc[m * NW + j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[m * NW + j][1]), sc_hi, a);
            }
        }
    }
    #pragma GCC unroll 16
    for (int i = 0; i < NX * NW; ++i) out[i] = hsum8(acc[i]);
}

/* The team's share of y = x w^T for NX rows of x, NW rows of w at a time (then one at a time for
 * the last n_out % NW); kind W_INT8 or W_INT4, a compile-time constant. */
static inline __attribute__((always_inline)) void rows_team(const lin_t *L, const int NX, const int NW,
                                                            const qx_t *q, void *y, int dtype, const int kind) {
    const int blocks = L->n_out / NW, k_in = L->k_in;
    const int64_t row_bytes = L->row_bytes, group_bytes = group_row_bytes(k_in);
    const char *w = (const char *)L->w, *end = w + (int64_t)blocks * NW * row_bytes;
    const char *groups = (const char *)L->groups;
    const int ahead = (int)(PREFETCH_BYTES / row_bytes); /* rows */
    float acc[MAX_FUSED_ROWS * 4];
#pragma omp for schedule(static) nowait
    for (int b = 0; b < blocks; ++b) {
        const char *block = w + (int64_t)b * NW * row_bytes; /* the rows ahead, as linear.c does */
        for (int64_t off = 0; off < NW * row_bytes; off += 64)
            if (block + PREFETCH_BYTES + off < end) _mm_prefetch(block + PREFETCH_BYTES + off, _MM_HINT_T0);
        if (kind == W_INT4) /* and their scales and minimums (a waited-on load per superblock without) */
            for (int64_t off = 0; off < NW * group_bytes; off += 64)
                if (b * NW + ahead < L->n_out)
                    _mm_prefetch(groups + (int64_t)(b * NW + ahead) * group_bytes + off, _MM_HINT_T0);
        if (kind == W_INT4)
            dot_q4(q, NX, block, row_bytes, groups + (int64_t)b * NW * group_bytes, group_bytes, NW, k_in, acc);
        else
            dot_q8(q, NX, block, row_bytes, NW, k_in, acc);
        finish_block(L, b * NW, NX, NW, acc, dtype, y);
    }
#pragma omp for schedule(static) nowait
    for (int n = blocks * NW; n < L->n_out; ++n) {
        if (kind == W_INT4)
            dot_q4(q, NX, w + (int64_t)n * row_bytes, row_bytes, groups + (int64_t)n * group_bytes, group_bytes, 1,
                   k_in, acc);
        else
            dot_q8(q, NX, w + (int64_t)n * row_bytes, row_bytes, 1, k_in, acc);
        finish_block(L, n, NX, 1, acc, dtype, y);
    }
}

/* Weight rows at a time for NX rows of x, within the 16 vector registers: int8 keeps NX NW
 * accumulators, int4 two integer sums per output besides; a row's result does not depend on it */
#define AVX2_NW(NX, KIND) ((NX) <= 2 && (KIND) == W_INT8 ? 4 : (NX) <= 2 || ((NX) <= 4 && (KIND) == W_INT8) ? 2 : 1)
#define AVX2_CASE(NX, KIND) \
    case NX: rows_team(L, NX, AVX2_NW(NX, KIND), &q, y, dtype, KIND); return;
#define AVX2_SWITCH(KIND) \
    switch (rows) { \
        AVX2_CASE(1, KIND) AVX2_CASE(2, KIND) AVX2_CASE(3, KIND) AVX2_CASE(4, KIND) \
        AVX2_CASE(5, KIND) AVX2_CASE(6, KIND) AVX2_CASE(7, KIND) AVX2_CASE(8, KIND) \
        default: return; \
    }

/* y = x w^T for rows (1..MAX_FUSED_ROWS) rows of x (xf: floats, k_in apart), by every thread of
 * the enclosing team, no barrier at the end (as linear.c's; xh is read for GGUF weights only). L
 * must be one linear_takes takes. */
void linear_rows_team(const lin_t *L, int rows, const float *xf, const void *xh, void *y, int dtype) {
    qx_t q;
    if (L->kind == W_GGUF && kq_linear_takes(L)) {
        kq_linear_team(L, rows, xf, xh, y, dtype);
        return;
    }
    if (!linear_takes(L) || !quantize_x(xf, rows, L->k_in, L->kind == W_INT4, &q)) {
        fprintf(stderr, "kvserve kernels: linear_rows_team: a weight linear_takes refuses, or no memory "
                        "for the quantized activations\n");
        abort();
    }
    if (L->kind == W_INT4) {
        AVX2_SWITCH(W_INT4)
    }
    AVX2_SWITCH(W_INT8)
}

/* whether linear_rows_team computes L: int8 (with its scales) or int4 weights, widths a multiple
 * of Q8_CHUNK; GGUF weights the block dots (kquant.c) */
int linear_takes(const lin_t *L) {
    if (L->kind == W_GGUF) return kq_linear_takes(L);
    if (L->k_in % Q8_CHUNK) return 0;
    return (L->kind == W_INT8 && L->scales != NULL) || (L->kind == W_INT4 && int4_layout(L));
}
#endif
