/* The integer dots of linear.c's few-row kernel (included there only, inside its AVX-512 part,
 * so that they inline into its team loop): x quantized per 32 values (q8_quantize) against int8
 * weights (dot_block_q8) and int4 weights in common.h's superblock layout (dot_block_q4), on
 * CPUs with AVX512-VNNI; HAVE_Q8 says whether they were built. */
#ifndef KVSERVE_QUANT_DOTS_H
#define KVSERVE_QUANT_DOTS_H

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

#endif
