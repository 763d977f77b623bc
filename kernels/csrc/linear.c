/* Linears of a few rows on AVX-512: y[m][n] = scale[n] * (x[m] . w[n]) + bias[n] for 1 to
 * MAX_FUSED_ROWS rows of x (a decode step of a few sequences), whose cost is reading w once.
 *
 * Each thread takes a range of w's rows, four at a time (two beyond four rows of x): one load of
 * each serves every pair, and the products are independent accumulator chains (one chain per row
 * waits on the FMA's latency at every step). The weight is read once, in a single pass: bfloat16 pairs are dotted
 * as stored with AVX512-BF16 (x is bfloat16 too), otherwise each 16 weights are widened to
 * float in registers (bfloat16 by a shift, int8 by sign extension and conversion) and multiplied
 * with x as floats. The portable small_linear in elementwise.c (several rows, any CPU) converted
 * each row into a float buffer first and summed in one chain: compute-bound below memory speed.
 *
 * int8 weights on CPUs with AVX512-VNNI (widths a multiple of 64): x is quantized too, per 32
 * values (scale = max|x| / 127, magnitudes rounded to nearest even, as llama.cpp does with its
 * Q8 activations), and 64 products at a time are summed in integers (vpdpbusd: x's magnitudes
 * as unsigned bytes against the weights negated where x is negative), then scaled per 32 values
 * in float. Widening each 16 weights to float took three instructions per 16 products and kept
 * the kernel compute-bound at ~28 GB/s even with the weight in cache; this takes four per 64
 * (one row of x; the model's int8 projections and LM head, 134 MB, two threads: ~1.7x faster).
 * int4 weights (W_INT4, GGUF Q4_1's scheme) take the same quantized x: their 4-bit values
 * are unsigned, so x's signed bytes multiply them directly, and each 32 values' minimum times
 * the sum of x's 32 values adds the rest. Without AVX512-VNNI int4 is not computed here
 * (linear_takes says so; the callers dequantize).
 *
 * Built and loaded by kernels/cpu_kernels.py; linear_rows returns 1 where it was not built for
 * AVX-512 or does not take the weight (the caller then takes elementwise.c's small_linear, or
 * dequantizes int4).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "common.h"

/* linear.c's own kinds: int8 and int4 weights against x quantized (q8_quantize) */
#define W_Q8 8
#define W_Q4 9
#define Q8_BLOCK 32 /* values of x per scale */
#define Q8_CHUNK 64 /* values per vpdpbusd: two blocks */

#if HAVE_AVX512_TEAM
#include <immintrin.h>

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif
#define ROWS_AT_ONCE 4 /* weight rows at a time: with 4 rows of x, 16 accumulators (as with 2 x 8) */

/* 16 weights at p as floats; lanes outside m are 0 */
static inline __attribute__((always_inline)) __m512 load_w16(const char *p, const int kind, __mmask16 m) {
    if (kind == W_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
    if (kind == W_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
    return _mm512_maskz_loadu_ps(m, p);
}

/* int4 weights: superblocks of 16 groups of INT4_GROUP inputs (512 inputs; a row's last one may
 * hold fewer groups, G). vpdpbusd's int32 lanes each sum 4 products; a group's 32 values are 8
 * quads, spread over P = 16 / G lanes (G dividing 16; else P = 1) and S = 8 / P steps: quad u of
 * group g sits in step u / P at lane g P + u % P (bytes 4 lane .. 4 lane + 3). Two steps share a
 * vector of 4 G P bytes (step 2t in the low 4 bits, 2t + 1 in the high ones); a single step (G =
 * 2) is 32 bytes, its first 32 values low, the rest high. After a superblock's steps the lanes
 * hold whole groups' sums (P lanes each): one conversion and one multiply-add by the groups'
 * scales finish up to 16 groups. (quantization.py's _pack_int4 writes this layout.) */
#define SB_INPUTS (SB_GROUPS * INT4_GROUP)
/* groups in superblock sb of a row of num_groups groups, and lanes per group in one of G groups */
static inline int sb_size(int num_groups, int sb) {
    return num_groups - sb * SB_GROUPS < SB_GROUPS ? num_groups - sb * SB_GROUPS : SB_GROUPS;
}
static inline int sb_lanes(int G) { return SB_GROUPS % G == 0 ? SB_GROUPS / G : 1; }
/* bytes of an int4 row's per-group scales and minimums (lin_t.groups) */
static inline int64_t group_row_bytes(int k_in) { return (int64_t)(k_in / INT4_GROUP) * 4; }

/* NX rows of x quantized for the integer dots (for one kind of weight: q8_quantize fills that
 * kind's arrays only), each row k_in values. int8 weights: per value its
 * magnitude (mag); per 64 values a mask of the negative ones (neg) and 16 float lanes of scales
 * (scale: lanes 0-7 the first 32 values' scale, lanes 8-15 the second's; vpdpbusd's 16 int32
 * sums each cover 4 consecutive values). int4 weights: the signed values in the superblock
 * layout above (sq, 512 bytes a superblock, zeros past a short last one) and per superblock 16
 * groups' scales and sums (gscale, gsum; zeros past a short one). */
typedef struct {
    const uint8_t *mag;
    const int8_t *sq;
    const uint64_t *neg;
    const float *scale, *gscale, *gsum;
    int chunks, superblocks;
} q8_rows_t;

#if defined(__AVX512VNNI__)
#define HAVE_Q8 1

/* Each team thread quantizes x into a buffer of its own (every thread gets the same bytes; no
 * barrier needed); the buffer lives as long as the thread (OpenMP keeps its threads). */
static __thread char *q8_buffer;
static __thread size_t q8_capacity;

static int q8_quantize(const float *xf, int rows, int k_in, int for_int4, q8_rows_t *q) {
    const int chunks = k_in / Q8_CHUNK, superblocks = (k_in + SB_INPUTS - 1) / SB_INPUTS;
    const size_t per_row = (size_t)k_in + (size_t)superblocks * (SB_INPUTS + 2 * SB_GROUPS * sizeof(float)) +
                           (size_t)chunks * (sizeof(uint64_t) + 16 * sizeof(float));
    const size_t need = (size_t)rows * per_row;
    if (need > q8_capacity) {
        free(q8_buffer);
        q8_capacity = 0;
        q8_buffer = aligned_alloc(64, (need + 63) & ~(size_t)63);
        if (q8_buffer == NULL) return 0;
        q8_capacity = need;
    }
    /* k_in and SB_INPUTS are multiples of 64: every array below starts 64-byte aligned */
    uint8_t *mag = (uint8_t *)q8_buffer;
    int8_t *sq = (int8_t *)(mag + (size_t)rows * k_in);
    float *gscale = (float *)(sq + (size_t)rows * superblocks * SB_INPUTS);
    float *gsum = gscale + (size_t)rows * superblocks * SB_GROUPS;
    float *scale = gsum + (size_t)rows * superblocks * SB_GROUPS;
    uint64_t *neg = (uint64_t *)(scale + (size_t)rows * chunks * 16);
    if (for_int4) memset(sq, 0, (size_t)rows * superblocks * (SB_INPUTS + 2 * SB_GROUPS * sizeof(float)));
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int r = 0; r < rows; ++r) {
        for (int c = 0; c < chunks; ++c) {
            const int64_t at = (int64_t)r * k_in + (int64_t)c * Q8_CHUNK, lanes = ((int64_t)r * chunks + c) * 16;
            __m512 v[4], a[4];
            __mmask16 negative[4];
            for (int i = 0; i < 4; ++i) {
                v[i] = _mm512_loadu_ps(xf + at + 16 * i);
                a[i] = _mm512_andnot_ps(sign, v[i]);
                negative[i] = _mm512_cmp_ps_mask(v[i], _mm512_setzero_ps(), _CMP_LT_OQ);
            }
            float d[2];
            for (int h = 0; h < 2; ++h) {
                const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a[2 * h], a[2 * h + 1]));
                const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
                __m512i block_sum = _mm512_setzero_si512();
                int8_t group[INT4_GROUP];
                for (int i = 2 * h; i < 2 * h + 2; ++i) {
                    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(a[i], inv)); /* nearest even */
                    const __m512i si = _mm512_mask_sub_epi32(qi, negative[i], _mm512_setzero_si512(), qi);
                    if (for_int4) {
                        _mm_storeu_si128((__m128i *)(group + 16 * (i - 2 * h)), _mm512_cvtsepi32_epi8(si));
                        block_sum = _mm512_add_epi32(block_sum, si);
                    } else {
                        _mm_storeu_si128((__m128i *)(mag + at + 16 * i), _mm512_cvtusepi32_epi8(qi));
                    }
                }
                d[h] = amax / 127.f;
                if (!for_int4) continue;
                const int g = 2 * c + h, sb = g / SB_GROUPS, l = g % SB_GROUPS; /* into the superblock layout */
                const int P = sb_lanes(sb_size(k_in / INT4_GROUP, sb));
                const int64_t slot = (int64_t)r * superblocks + sb;
                for (int u = 0; u < 8; ++u) /* quad u: step u / P, lane l P + u % P */
                    memcpy(sq + slot * SB_INPUTS + (u / P) * 64 + 4 * (l * P + u % P), group + 4 * u, 4);
                gscale[slot * SB_GROUPS + l] = d[h];
                gsum[slot * SB_GROUPS + l] = d[h] * (float)_mm512_reduce_add_epi32(block_sum); /* exact sum */
            }
            if (for_int4) continue;
            neg[(int64_t)r * chunks + c] = (uint64_t)negative[0] | (uint64_t)negative[1] << 16 |
                                           (uint64_t)negative[2] << 32 | (uint64_t)negative[3] << 48;
            _mm512_storeu_ps(scale + lanes,
                             _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(d[0]), _mm512_set1_ps(d[1])));
        }
    }
    q->mag = mag, q->sq = sq, q->neg = neg, q->scale = scale, q->gscale = gscale, q->gsum = gsum;
    q->chunks = chunks, q->superblocks = superblocks;
    return 1;
}

/* dot_block for int8 weights against x quantized by q8_quantize: x's magnitudes (unsigned) against
 * the weights negated where x is negative */
static inline __attribute__((always_inline)) void dot_block_q8(const q8_rows_t *q, const int NX, const char *w,
                                                               int64_t row_bytes, const int NW, int k_in,
                                                               float *out) {
    __m512 acc[MAX_FUSED_ROWS * ROWS_AT_ONCE / 2];
    for (int i = 0; i < NX * NW; ++i) acc[i] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    for (int c = 0; c < q->chunks; ++c) {
        __m512i wv[ROWS_AT_ONCE];
        for (int j = 0; j < NW; ++j) wv[j] = _mm512_loadu_si512(w + j * row_bytes + (int64_t)c * Q8_CHUNK);
        for (int m = 0; m < NX; ++m) {
            const __m512i xv = _mm512_loadu_si512(q->mag + (int64_t)m * k_in + (int64_t)c * Q8_CHUNK);
            const __mmask64 negative = q->neg[(int64_t)m * q->chunks + c];
            const __m512 scale = _mm512_loadu_ps(q->scale + ((int64_t)m * q->chunks + c) * 16);
            for (int j = 0; j < NW; ++j) {
                const __m512i signed_w = _mm512_mask_sub_epi8(wv[j], negative, zero, wv[j]);
                const __m512i sums = _mm512_dpbusd_epi32(zero, xv, signed_w);
                acc[m * NW + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[m * NW + j]);
            }
        }
    }
    for (int i = 0; i < NX * NW; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}

/* dot_block for int4 weights (W_INT4, in the superblock layout; groups: per row the groups'
 * float16 scales, then their minimums, group_bytes apart per row) against x quantized by
 * q8_quantize: per group, x . w = scale * (x . q) + min * sum(x), with x . q summed in integers (q
 * unsigned, x signed) over a superblock's 8 steps before one conversion. */
static inline __attribute__((always_inline)) void dot_block_q4(const q8_rows_t *q, const int NX, const char *w,
                                                               int64_t row_bytes, const char *groups,
                                                               int64_t group_bytes, const int NW, int k_in,
                                                               float *out) {
    __m512 acc[MAX_FUSED_ROWS * ROWS_AT_ONCE / 2];
    for (int i = 0; i < NX * NW; ++i) acc[i] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int num_groups = k_in / INT4_GROUP;
    for (int sb = 0; sb < q->superblocks; ++sb) {
        const int G = sb_size(num_groups, sb), P = sb_lanes(G), S = 8 / P, vb = 4 * G * P; /* lanes a group, steps, bytes a step */
        const __mmask64 bytes = vb == 64 ? ~(__mmask64)0 : (((__mmask64)1 << vb) - 1);
        const __mmask16 lanes = (__mmask16)((1u << G) - 1u);
        const char *block = w + (int64_t)sb * (SB_INPUTS / 2); /* the superblocks before are whole */
        __m512i sums[MAX_FUSED_ROWS * ROWS_AT_ONCE / 2];
        for (int i = 0; i < NX * NW; ++i) sums[i] = _mm512_setzero_si512();
        for (int t = 0; t < (S + 1) / 2; ++t) {
            for (int j = 0; j < NW; ++j) {
                __m512i lo, hi;
                if (S == 1) { /* one step in 32 bytes: values 0-31 low, 32-63 high */
                    const __m256i packed = _mm256_loadu_si256((const __m256i *)(block + j * row_bytes));
                    const __m256i l4 = _mm512_castsi512_si256(low4);
                    lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, l4)),
                                            _mm256_and_si256(_mm256_srli_epi16(packed, 4), l4), 1);
                    hi = _mm512_setzero_si512();
                } else {
                    const __m512i packed = _mm512_maskz_loadu_epi8(bytes, block + j * row_bytes + (int64_t)t * vb);
                    lo = _mm512_and_si512(packed, low4);
                    hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
                }
                for (int m = 0; m < NX; ++m) {
                    const int8_t *x = q->sq + ((int64_t)m * q->superblocks + sb) * SB_INPUTS + (int64_t)t * 128;
                    sums[m * NW + j] = _mm512_dpbusd_epi32(sums[m * NW + j], lo, _mm512_loadu_si512(x));
                    if (S > 1) sums[m * NW + j] = _mm512_dpbusd_epi32(sums[m * NW + j], hi, _mm512_loadu_si512(x + 64));
                }
            }
        }
        /* lane l of the sums belongs to group l / P */
        const __m512i group_of_lane = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                        P == 8 ? 3 : (P == 4 ? 2 : (P == 2 ? 1 : 0)));
        for (int j = 0; j < NW; ++j) {
            const char *scales = groups + j * group_bytes + (int64_t)sb * SB_GROUPS * 2;
            const __m512 wscale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, scales));
            const __m512 wmin = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, scales + num_groups * 2));
            for (int m = 0; m < NX; ++m) {
                const int64_t slot = ((int64_t)m * q->superblocks + sb) * SB_GROUPS;
                const __m512 xscale = _mm512_loadu_ps(q->gscale + slot), xsum = _mm512_loadu_ps(q->gsum + slot);
                const __m512 a = _mm512_fmadd_ps(wmin, xsum, acc[m * NW + j]);
                const __m512 scale = _mm512_permutexvar_ps(group_of_lane, _mm512_mul_ps(wscale, xscale));
                acc[m * NW + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[m * NW + j]), scale, a);
            }
        }
    }
    for (int i = 0; i < NX * NW; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}
#else
#define HAVE_Q8 0
#endif

/* acc[m * NW + j] = x_m . w_j for the NX rows of x (xf: floats, k_in apart; xh: the same rows
 * as bfloat16, used by the bfloat16-pairs path, else NULL) and the NW rows w + j * row_bytes (NX,
 * NW compile-time constants; NX * NW accumulators stay in registers). */
static inline __attribute__((always_inline)) void dot_block(
        const float *xf, const char *xh, const int NX, const char *w, int64_t row_bytes, const int NW,
        const int kind, int k_in, float *out) {
    const int welem = kind == W_BF16 ? 2 : (kind == W_INT8 ? 1 : 4);
    (void)xh; /* read only where AVX512-BF16 dots bfloat16 pairs */
    __m512 acc[MAX_FUSED_ROWS * ROWS_AT_ONCE / 2];
    for (int i = 0; i < NX * NW; ++i) acc[i] = _mm512_setzero_ps();
    int k = 0;
#if defined(__AVX512BF16__)
    if (kind == W_BF16 && xh != NULL) {
        for (; k + 32 <= k_in; k += 32) {
            __m512bh wv[ROWS_AT_ONCE];
            for (int j = 0; j < NW; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * row_bytes + 2 * k);
            for (int m = 0; m < NX; ++m) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xh + 2 * ((int64_t)m * k_in + k));
                for (int j = 0; j < NW; ++j) acc[m * NW + j] = _mm512_dpbf16_ps(acc[m * NW + j], wv[j], xv);
            }
        }
    }
#endif
    for (; k < k_in; k += 16) {
        const __mmask16 mask = k_in - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k_in - k)) - 1u);
        __m512 wv[ROWS_AT_ONCE];
        for (int j = 0; j < NW; ++j) wv[j] = load_w16(w + j * row_bytes + (int64_t)k * welem, kind, mask);
        for (int m = 0; m < NX; ++m) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, xf + (int64_t)m * k_in + k);
            for (int j = 0; j < NW; ++j) acc[m * NW + j] = _mm512_fmadd_ps(wv[j], xv, acc[m * NW + j]);
        }
    }
    for (int i = 0; i < NX * NW; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}

/* y[m][n0 + j] (rows n_out apart) for dot_block's results: scaled (int8 weights), biased,
 * rounded once */
static inline void finish_block(const lin_t *L, int n0, int NX, int NW, const float *acc, int dtype, void *y) {
    const int elem = elem_size(dtype);
    for (int j = 0; j < NW; ++j) {
        float s = 1.f, b = 0.f;
        if (L->scales != NULL) to_float((const char *)L->scales + (int64_t)(n0 + j) * elem, dtype, &s, 1);
        if (L->bias != NULL) to_float((const char *)L->bias + (int64_t)(n0 + j) * elem, dtype, &b, 1);
        for (int m = 0; m < NX; ++m) {
            const float v = acc[m * NW + j] * s + b;
            from_float(&v, 1.f, dtype, (char *)y + ((int64_t)m * L->n_out + n0 + j) * elem, 1);
        }
    }
}

/* dot_block, or the integer dots for W_Q8 and W_Q4 (kind is a compile-time constant in every
 * caller); groups: W_Q4's per-group scales and minimums of these rows */
static inline __attribute__((always_inline)) void dot(const float *xf, const char *xh, const q8_rows_t *q,
                                                      const int NX, const char *w, int64_t row_bytes,
                                                      const char *groups, int64_t group_bytes, const int NW,
                                                      const int kind, int k_in, float *out) {
#if HAVE_Q8
    if (kind == W_Q8) {
        dot_block_q8(q, NX, w, row_bytes, NW, k_in, out);
        return;
    }
    if (kind == W_Q4) {
        dot_block_q4(q, NX, w, row_bytes, groups, group_bytes, NW, k_in, out);
        return;
    }
#endif
    (void)q, (void)groups, (void)group_bytes;
    dot_block(xf, xh, NX, w, row_bytes, NW, kind, k_in, out);
}

/* The team's share of y = x w^T for NX rows of x, NW rows of w at a time (then one at a time
 * for the last n_out % NW). */
static inline __attribute__((always_inline)) void rows_team(const lin_t *L, const int NX, const int NW,
                                                            const float *xf, const char *xh, const q8_rows_t *q,
                                                            void *y, int dtype, const int kind) {
    const int blocks = L->n_out / NW, k_in = L->k_in;
    const int64_t row_bytes = L->row_bytes, group_bytes = group_row_bytes(k_in);
    const char *w = (const char *)L->w, *end = w + (int64_t)blocks * NW * row_bytes;
    const char *groups = (const char *)L->groups;
    float acc[MAX_FUSED_ROWS * ROWS_AT_ONCE / 2];
#pragma omp for schedule(static) nowait
    for (int b = 0; b < blocks; ++b) {
        /* the rows PREFETCH_BYTES ahead of this block: the hardware prefetcher alone leaves the
         * core waiting on memory (the model's one-row projections, two threads: 11.6 -> 9.0 ms in
         * bfloat16, 9.3 -> 5.5 ms in int8, 8 to 32 KiB ahead alike) */
        const char *block = w + (int64_t)b * NW * row_bytes;
        for (int64_t off = 0; off < NW * row_bytes; off += 64)
            if (block + PREFETCH_BYTES + off < end) _mm_prefetch(block + PREFETCH_BYTES + off, PREFETCH_HINT);
        dot(xf, xh, q, NX, block, row_bytes, groups + (int64_t)b * NW * group_bytes, group_bytes, NW, kind, k_in,
            acc);
        finish_block(L, b * NW, NX, NW, acc, dtype, y);
    }
#pragma omp for schedule(static)
    for (int n = blocks * NW; n < L->n_out; ++n) {
        dot(xf, xh, q, NX, w + (int64_t)n * row_bytes, row_bytes, groups + (int64_t)n * group_bytes, group_bytes, 1,
            kind, k_in, acc);
        finish_block(L, n, NX, 1, acc, dtype, y);
    }
}

/* NX rows: four weight rows at a time up to four rows of x, two beyond (the accumulators stay
 * within the 32 vector registers) */
#define ROWS_CASE(NX, KIND) \
    case NX: rows_team(L, NX, (NX) <= 4 ? ROWS_AT_ONCE : ROWS_AT_ONCE / 2, xf, h, q, y, dtype, KIND); return;
#define ROWS_SWITCH(KIND) \
    switch (rows) { \
        ROWS_CASE(1, KIND) ROWS_CASE(2, KIND) ROWS_CASE(3, KIND) ROWS_CASE(4, KIND) \
        ROWS_CASE(5, KIND) ROWS_CASE(6, KIND) ROWS_CASE(7, KIND) ROWS_CASE(8, KIND) \
        default: return; \
    }

/* y = x w^T for rows (1..MAX_FUSED_ROWS) rows of x, by every thread of the enclosing team (each
 * call site is reached by all of them; ends with a barrier). xf: x as floats, k_in apart; xh: x
 * itself when it is bfloat16 (the weight's pairs are then dotted as stored), else NULL. y: rows
 * of n_out elements. L must be one linear_takes takes. */
void linear_rows_team(const lin_t *L, int rows, const float *xf, const void *xh, void *y, int dtype) {
    const char *h = (const char *)xh;
    const q8_rows_t *q = NULL;
    if (!linear_takes(L)) { /* a caller's bug: below, int4 bytes would be read as floats */
        fprintf(stderr, "kvserve kernels: linear_rows_team called with a weight linear_takes refuses\n");
        abort();
    }
    if (L->kind == W_BF16) {
        ROWS_SWITCH(W_BF16)
    }
    h = NULL;
#if HAVE_Q8
    if ((L->kind == W_INT8 || L->kind == W_INT4) && L->k_in % Q8_CHUNK == 0) {
        q8_rows_t quantized;
        if (!q8_quantize(xf, rows, L->k_in, L->kind == W_INT4, &quantized)) {
            if (L->kind == W_INT4) { /* tens of KiB per thread not to be had: nothing else computes int4 here */
                fprintf(stderr, "kvserve kernels: out of memory quantizing activations for int4 weights\n");
                abort();
            }
        } else {
            q = &quantized;
            if (L->kind == W_INT4) {
                ROWS_SWITCH(W_Q4)
            }
            ROWS_SWITCH(W_Q8)
        }
    }
#endif
    if (L->kind == W_INT8) {
        ROWS_SWITCH(W_INT8)
    }
    ROWS_SWITCH(W_F32)
}

/* 16 floats as bfloat16, rounded to nearest even (finite values: weights) */
static inline __m256i bf16_of(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16));
#endif
}

/* 16 weights as dtype at out */
static inline void store16(__m512 v, int dtype, char *out) {
    if (dtype == DTYPE_BF16)
        _mm256_storeu_si256((__m256i *)out, bf16_of(v));
    else
        _mm512_storeu_ps((float *)out, v);
}

/* out [n_out][k_in] (dtype) = L's int8 or int4 weight dequantized (scale * q; scale * q + min),
 * by num_threads threads: for multiplying many rows (a prefill) in the GEMM. 0, or 1 for a weight
 * of another kind or an int4 width not a multiple of 64. */
int dequantize_weight(const lin_t *L, void *out, int dtype, int num_threads) {
    if (!(L->kind == W_INT8 || (L->kind == W_INT4 && L->k_in % Q8_CHUNK == 0 && L->groups != NULL))) return 1;
    const int k_in = L->k_in, elem = elem_size(dtype);
    const int64_t group_bytes = group_row_bytes(k_in);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int n = 0; n < L->n_out; ++n) {
        const char *w = (const char *)L->w + (int64_t)n * L->row_bytes;
        char *row = (char *)out + (int64_t)n * k_in * elem;
        if (L->kind == W_INT8) {
            float s;
            to_float((const char *)L->scales + (int64_t)n * elem, dtype, &s, 1);
            int k = 0;
            for (; k + 16 <= k_in; k += 16) {
                const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + k))));
                store16(_mm512_mul_ps(v, _mm512_set1_ps(s)), dtype, row + (int64_t)k * elem);
            }
            for (; k < k_in; ++k) {
                const float v = (float)(int8_t)w[k] * s;
                from_float(&v, 1.f, dtype, row + (int64_t)k * elem, 1);
            }
            continue;
        }
        const uint16_t *scales = (const uint16_t *)((const char *)L->groups + (int64_t)n * group_bytes);
        const uint16_t *mins = scales + k_in / INT4_GROUP;
        const int num_groups = k_in / INT4_GROUP;
        for (int sb = 0; sb * SB_GROUPS < num_groups; ++sb) { /* the layout dot_block_q4 reads */
            const int G = num_groups - sb * SB_GROUPS < SB_GROUPS ? num_groups - sb * SB_GROUPS : SB_GROUPS;
            const char *block = w + (int64_t)sb * (SB_INPUTS / 2);
            const int P = sb_lanes(G), S = 8 / P, vb = 4 * G * P;
            const __mmask64 bytes_in = vb == 64 ? ~(__mmask64)0 : (((__mmask64)1 << vb) - 1);
            int32_t steps[8][SB_GROUPS]; /* as dot_block_q4 reads them: int32 l of step s is 4 values */
            if (S == 1) {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)block), l4 = _mm256_set1_epi8(0x0F);
                _mm256_storeu_si256((__m256i *)steps[0], _mm256_and_si256(packed, l4));
                _mm256_storeu_si256((__m256i *)&steps[0][8], _mm256_and_si256(_mm256_srli_epi16(packed, 4), l4));
            }
            for (int t = 0; 2 * t < S && S > 1; ++t) {
                const __m512i packed = _mm512_maskz_loadu_epi8(bytes_in, block + (int64_t)t * vb);
                _mm512_storeu_si512(steps[2 * t], _mm512_and_si512(packed, _mm512_set1_epi8(0x0F)));
                _mm512_storeu_si512(steps[2 * t + 1], _mm512_and_si512(_mm512_srli_epi16(packed, 4), _mm512_set1_epi8(0x0F)));
            }
            /* quad u of a group: step u / P, lane u % P past the group's first */
            __m256i quad_at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            quad_at = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_srli_epi32(quad_at, __builtin_ctz(P)), _mm256_set1_epi32(SB_GROUPS)),
                                       _mm256_and_si256(quad_at, _mm256_set1_epi32(P - 1)));
            for (int l = 0; l < G; ++l) {
                const int g = sb * SB_GROUPS + l;
                const __m512 d = _mm512_set1_ps(_cvtsh_ss(scales[g])), m = _mm512_set1_ps(_cvtsh_ss(mins[g]));
                /* group l's 32 values in order: its int32 of each step */
                const __m256i values = _mm256_i32gather_epi32(&steps[0][l * P], quad_at, 4);
                for (int h = 0; h < 2; ++h) {
                    const __m128i bytes = h ? _mm256_extracti128_si256(values, 1) : _mm256_castsi256_si128(values);
                    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
                    store16(_mm512_add_ps(_mm512_mul_ps(v, d), m), dtype, row + ((int64_t)g * INT4_GROUP + 16 * h) * elem);
                }
            }
        }
    }
    return 0;
}

/* whether linear_rows_team computes L: int4 weights need AVX512-VNNI and widths a multiple of 64 */
int linear_takes(const lin_t *L) {
    return L->kind != W_INT4 || (HAVE_Q8 && L->k_in % Q8_CHUNK == 0 && L->groups != NULL);
}

/* y = x L^T for rows (1..MAX_FUSED_ROWS) contiguous rows of x, in a team of its own
 * (linear_rows_team is a team's part): x and y of dtype (DTYPE_*), L as cpu_kernels.py's
 * CpuKernels.linear_of makes it. 0 on success, 1 for a linear or row count it does not take,
 * 2 when memory could not be had. */
int linear_rows(const lin_t *L, int rows, const void *x, void *y, int dtype, int num_threads) {
    if (rows < 1 || rows > MAX_FUSED_ROWS || !linear_takes(L)) return 1;
    float *xf = malloc(sizeof(float) * (size_t)rows * (size_t)L->k_in);
    if (!xf) return 2;
    to_float(x, dtype, xf, rows * L->k_in);
#pragma omp parallel num_threads(num_threads)
    linear_rows_team(L, rows, xf, dtype == DTYPE_BF16 ? x : NULL, y, dtype);
    free(xf);
    return 0;
}
#else
void linear_rows_team(const lin_t *L, int rows, const float *xf, const void *xh, void *y, int dtype) {
    (void)L, (void)rows, (void)xf, (void)xh, (void)y, (void)dtype;
}

int linear_takes(const lin_t *L) {
    (void)L;
    return 0;
}

int dequantize_weight(const lin_t *L, void *out, int dtype, int num_threads) {
    (void)L, (void)out, (void)dtype, (void)num_threads;
    return 1;
}

int linear_rows(const lin_t *L, int rows, const void *x, void *y, int dtype, int num_threads) {
    (void)L, (void)rows, (void)x, (void)y, (void)dtype, (void)num_threads;
    return 1;
}
#endif

#ifndef HAVE_Q8
#define HAVE_Q8 0
#endif
/* How int8 and int4 weights multiply x of width k_in in linear_rows_team: Q8_BLOCK (x quantized
 * per that many values, the integer path), or 0 (x as floats; int4 not at all). Read by
 * cpu_kernels.py. */
int quantized_activation_block(int k_in) { return HAVE_Q8 && k_in % Q8_CHUNK == 0 ? Q8_BLOCK : 0; }
