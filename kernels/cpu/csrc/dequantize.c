/* Quantized weights dequantized for the GEMM path (a prefill chunk, decode steps beyond
 * MAX_FUSED_ROWS rows): int8 rows times their scale, int4 superblocks (common.h) unpacked to
 * scale * q + min, in the activations' dtype, on every thread. Built and loaded with the other
 * kernels by kernels/cpu/bindings.py (CpuKernels.dequantize): AVX-512 below, plain C elsewhere. */
#include <stdint.h>

#include "common.h"

#if HAVE_AVX512_TEAM
#include <immintrin.h>

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

/* A whole int4 superblock's 512 values (steps as dot_block_q4 reads them: int32 l of step u is
 * values 4u..4u+3 of group l) as scale * q + min in dtype at out: the 8 x 16 int32s transposed
 * (unpacks, then a two-source permute that puts groups j and 4 + j, or 8 + j and 12 + j, side by
 * side), so that each group's 32 values lie in order in a 256-bit half; a gather per group took
 * most of the time before. */
static inline void dequantize_superblock(const int32_t steps[8][SB_GROUPS], const uint16_t *scales,
                                         const uint16_t *mins, int dtype, char *out) {
    const int elem = elem_size(dtype);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)mins));
    __m512i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm512_unpacklo_epi32(_mm512_loadu_si512(steps[i]), _mm512_loadu_si512(steps[i + 1]));
        t[i + 1] = _mm512_unpackhi_epi32(_mm512_loadu_si512(steps[i]), _mm512_loadu_si512(steps[i + 1]));
    }
    for (int h = 0; h < 8; h += 4) { /* u[h + j] lane k: column 4k + j of steps h .. h + 3 */
        u[h] = _mm512_unpacklo_epi64(t[h], t[h + 2]), u[h + 1] = _mm512_unpackhi_epi64(t[h], t[h + 2]);
        u[h + 2] = _mm512_unpacklo_epi64(t[h + 1], t[h + 3]), u[h + 3] = _mm512_unpackhi_epi64(t[h + 1], t[h + 3]);
    }
    const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), high = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int j = 0; j < 4; ++j)
        for (int half = 0; half < 2; ++half) { /* groups j, 4 + j (half 0) or 8 + j, 12 + j (half 1) */
            const __m512i both = _mm512_permutex2var_epi64(u[j], half ? high : low, u[4 + j]);
            for (int p = 0; p < 4; ++p) { /* 16 values: group 8 half + 4 (p / 2) + j, values 16 (p % 2) .. */
                const int g = 8 * half + 4 * (p / 2) + j;
                __m128i bytes;
                switch (p) {
                    case 0: bytes = _mm512_castsi512_si128(both); break;
                    case 1: bytes = _mm512_extracti32x4_epi32(both, 1); break;
                    case 2: bytes = _mm512_extracti32x4_epi32(both, 2); break;
                    default: bytes = _mm512_extracti32x4_epi32(both, 3); break;
                }
                const __m512i lane = _mm512_set1_epi32(g);
                const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
                store16(_mm512_add_ps(_mm512_mul_ps(v, _mm512_permutexvar_ps(lane, d)), _mm512_permutexvar_ps(lane, m)),
                        dtype, out + ((int64_t)g * INT4_GROUP + 16 * (p % 2)) * elem);
            }
        }
}


/* row [k_in] (dtype) = row n of L's int8 or int4 weight dequantized (scale * q; scale * q + min,
 * rounded to dtype once); L one dequantize_takes takes, an int8 weight's scales of dtype. */
void dequantize_row(const lin_t *L, int n, int dtype, void *out) {
    const int k_in = L->k_in, elem = elem_size(dtype);
    const int64_t group_bytes = group_row_bytes(k_in);
    const char *w = (const char *)L->w + (int64_t)n * L->row_bytes;
    char *row = (char *)out;
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
        return;
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
        if (G == SB_GROUPS) { /* a whole superblock: step u's lane l is quad u of group l */
            dequantize_superblock(steps, scales + sb * SB_GROUPS, mins + sb * SB_GROUPS, dtype,
                                  row + (int64_t)sb * SB_INPUTS * elem);
            continue;
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

#else
/* The same in plain C for every other CPU (the compiler vectorises it for its target): gemm.c's
 * AVX2 build dequantizes its panels with it. The values are the AVX-512 path's: scale * q (+ min),
 * rounded to dtype once (an int4 q times its float16 scale is exact in float, so a fused
 * multiply-add rounds as the separate product and sum do). */

/* an IEEE half (the int4 groups' scales and minimums) as a float, exactly */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24 */
        const float f = (float)mantissa * 0x1p-24f;
        return sign ? -f : f;
    }
    bits32 b = {.u = sign | (exponent == 31 ? 0x7F800000u : (exponent + 112u) << 23) | mantissa << 13};
    return b.f;
}

void dequantize_row(const lin_t *L, int n, int dtype, void *out) {
    const int k_in = L->k_in, elem = elem_size(dtype), num_groups = k_in / INT4_GROUP;
    const uint8_t *w = (const uint8_t *)L->w + (int64_t)n * L->row_bytes;
    float values[SB_INPUTS];
    if (L->kind == W_INT8) {
        float s;
        to_float((const char *)L->scales + (int64_t)n * elem, dtype, &s, 1);
        for (int k0 = 0; k0 < k_in; k0 += SB_INPUTS) {
            const int len = k_in - k0 < SB_INPUTS ? k_in - k0 : SB_INPUTS;
            for (int k = 0; k < len; ++k) values[k] = (float)(int8_t)w[k0 + k] * s;
            from_float(values, 1.f, dtype, (char *)out + (int64_t)k0 * elem, len);
        }
        return;
    }
    const uint16_t *scales = (const uint16_t *)((const char *)L->groups + (int64_t)n * group_row_bytes(k_in));
    const uint16_t *mins = scales + num_groups;
    for (int sb = 0; sb * SB_GROUPS < num_groups; ++sb) { /* the layout linear.c's dot_block_q4 reads */
        const int G = sb_size(num_groups, sb), P = sb_lanes(G), S = 8 / P, vb = 4 * G * P;
        const uint8_t *block = w + (int64_t)sb * (SB_INPUTS / 2);
        uint8_t steps[8][4 * SB_GROUPS]; /* byte 4 l + i of step u: value i of lane l's quad */
        if (S == 1) {
            for (int i = 0; i < 32; ++i) steps[0][i] = block[i] & 0x0F, steps[0][32 + i] = block[i] >> 4;
        }
        for (int t = 0; 2 * t < S && S > 1; ++t)
            for (int i = 0; i < vb; ++i)
                steps[2 * t][i] = block[t * vb + i] & 0x0F, steps[2 * t + 1][i] = block[t * vb + i] >> 4;
        for (int l = 0; l < G; ++l) {
            const int g = sb * SB_GROUPS + l;
            const float d = half_to_float(scales[g]), m = half_to_float(mins[g]);
            for (int u = 0; u < 8; ++u) /* quad u: step u / P, lane l P + u % P */
                for (int i = 0; i < 4; ++i) values[l * INT4_GROUP + 4 * u + i] = (float)steps[u / P][4 * (l * P + u % P) + i] * d + m;
        }
        from_float(values, 1.f, dtype, (char *)out + (int64_t)sb * SB_INPUTS * elem, G * INT4_GROUP);
    }
}

#endif

/* Whether dequantize_row takes L: int8, or int4 of a width that is a multiple of 64. */
int dequantize_takes(const lin_t *L) { return L->kind == W_INT8 || (L->kind == W_INT4 && int4_layout(L)); }

/* out [n_out][k_in] (dtype) = L's int8 or int4 weight dequantized, by num_threads threads: for
 * multiplying many rows in a GEMM other than gemm.c's (float32 activations). 0, or 1 for a
 * weight dequantize_takes refuses. */
int dequantize_weight(const lin_t *L, void *out, int dtype, int num_threads) {
    if (!dequantize_takes(L)) return 1;
    const int64_t row_bytes = (int64_t)L->k_in * elem_size(dtype);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int n = 0; n < L->n_out; ++n) dequantize_row(L, n, dtype, (char *)out + n * row_bytes);
    return 0;
}
