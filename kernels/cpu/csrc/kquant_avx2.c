/* The GGUF block dots of kquant.c on AVX2 (kquant.h): unsigned weight bytes times signed
 * activation bytes by maddubs (pairs summed into int16: at most 2 x 63 x 127, no saturation),
 * then madd by the sub-block scale into int32, so a whole superblock sums in integers before one
 * float multiply. Built where the compiler targets AVX2 with FMA and F16C (and not AVX512-VNNI,
 * whose kquant_avx512.c is used instead; tests reach this path with KVSERVE_CPU_MARCH). */
#include "kquant.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 32 unsigned bytes times 32 signed ones, summed in 8 int32 lanes, each pair of int16 lanes
 * weighted by the two 16-bit scales of `scale` */
static inline __m256i dot32(__m256i u, __m256i s, __m256i scale) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale);
}

static float dot_q4_0(const uint8_t *w, const kq_act_t *a, int k) {
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    float off = 0.f;
    for (int b = 0; b < k / 32; ++b) {
        const uint8_t *blk = w + 18 * b;
        const kq_act_t *A = a + b / 8;
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low);
        const float d = half_at(blk) * A->d;
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(v, load32(A->qs + (b % 8) * 32), ones)), _mm256_set1_ps(d), acc);
        off += d * (float)(8 * (A->bsums[(b % 8) * 2] + A->bsums[(b % 8) * 2 + 1]));
    }
    return hsum8(acc) - off;
}

/* The dots below take R activation rows (row r's blocks at a + r * row_blocks; R a constant where
 * inlined: 1, or up to AVX2_ROWS sharing each unpacked weight vector: sixteen vector registers
 * hold no more) and write out[r]. */
#define AVX2_ROWS 4

KQ_ROWS_FN q8_0_rows(const uint8_t *w, const kq_act_t *a, int64_t row_blocks, int k, const int R, float *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[AVX2_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < k / 32; ++b) {
        const uint8_t *blk = w + 34 * b;
        const __m256i q = load32(blk + 2), mag = _mm256_sign_epi8(q, q);
        const float d = half_at(blk);
        for (int r = 0; r < R; ++r) {
            const kq_act_t *A = a + r * row_blocks + b / 8;
            /* |q| times x with q's sign: maddubs wants its first operand unsigned */
            const __m256i p = dot32(mag, _mm256_sign_epi8(load32(A->qs + (b % 8) * 32), q), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * A->d), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]);
}

/* Q4_K, and Q5_K where five: sub-block j is the low (j even) or high nibbles of 32 bytes, plus 16
 * where bit j of qh[l] is set */
KQ_ROWS_FN k45_rows(const uint8_t *w, const kq_act_t *a, int64_t row_blocks, int k, const int R, const int five,
                 float *out) {
    const int bytes = five ? 176 : 144;
    const __m256i low = _mm256_set1_epi8(15);
    __m256 acc[AVX2_ROWS], mins[AVX2_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), mins[r] = _mm256_setzero_ps();
    for (int i = 0; i < k / KQ_BLOCK; ++i) {
        const uint8_t *blk = w + (int64_t)bytes * i, *qs = blk + (five ? 48 : 16);
        const __m256i qh = five ? load32(blk + 16) : _mm256_setzero_si256();
        int sc[8], m[8];
        for (int j = 0; j < 8; ++j) kq_scale_min(j, blk + 4, &sc[j], &m[j]);
        __m256i sums[AVX2_ROWS];
        for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
            const __m256i q = load32(qs + 32 * c);
            for (int h = 0; h < 2; ++h) {
                const int j = 2 * c + h;
                __m256i v = _mm256_and_si256(h ? _mm256_srli_epi16(q, 4) : q, low);
                if (five) {
                    const __m256i bit = _mm256_set1_epi8((char)(1 << j));
                    v = _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit),
                                                            _mm256_set1_epi8(16)));
                }
                const __m256i scale = _mm256_set1_epi16((short)sc[j]);
                for (int r = 0; r < R; ++r)
                    sums[r] = _mm256_add_epi32(sums[r], dot32(v, load32(a[r * row_blocks + i].qs + 32 * j), scale));
            }
        }
        const float d = half_at(blk), dmin = half_at(blk + 2);
        const __m256i m16 = kq_mins16(m);
        for (int r = 0; r < R; ++r) {
            const kq_act_t *A = a + r * row_blocks + i;
            const __m256i mm = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)A->bsums), m16);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(A->d * d), acc[r]);
            mins[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_set1_ps(A->d * dmin), mins[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]) - hsum8(mins[r]);
}

/* Q6_K: per 128 values, 64 bytes of low 4 bits (values l and l + 32 in the low nibbles of bytes l
 * and 32 + l, values 64 + l and 96 + l in their high nibbles) and 32 of high 2 bits (bits 2p of
 * qh[l] for part p); values are 0..63, the offset of 32 taken off through the block sums */
KQ_ROWS_FN q6_k_rows(const uint8_t *w, const kq_act_t *a, int64_t row_blocks, int k, const int R, float *out) {
    const __m256i low = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
    __m256 acc[AVX2_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int i = 0; i < k / KQ_BLOCK; ++i) {
        const uint8_t *blk = w + 210 * i;
        const int8_t *sc = (const int8_t *)(blk + 192);
        __m256i sums[AVX2_ROWS];
        for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
        for (int n = 0; n < 2; ++n) {
            const __m256i l0 = load32(blk + 64 * n), l1 = load32(blk + 64 * n + 32), qh = load32(blk + 128 + 32 * n);
            for (int p = 0; p < 4; ++p) {
                const __m256i lo = _mm256_and_si256(p < 2 ? (p ? l1 : l0) : _mm256_srli_epi16(p == 2 ? l0 : l1, 4), low);
                const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), two), 4);
                const __m256i v = _mm256_or_si256(lo, hi);
                const int g = 8 * n + 2 * p; /* the 32 values' two scale groups: g, g + 1 */
                const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
                for (int r = 0; r < R; ++r)
                    sums[r] = _mm256_add_epi32(sums[r], dot32(v, load32(a[r * row_blocks + i].qs + 16 * g), scale));
            }
        }
        const float d = half_at(blk + 208);
        for (int r = 0; r < R; ++r) {
            const kq_act_t *A = a + r * row_blocks + i;
            int offset = 0;
            for (int g = 0; g < 16; ++g) offset += sc[g] * A->bsums[g];
            sums[r] = _mm256_sub_epi32(sums[r], _mm256_setr_epi32(32 * offset, 0, 0, 0, 0, 0, 0, 0));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(A->d * d), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]);
}

KQ_ONE_AND_MANY(q8_0, q8_0_rows, AVX2_ROWS)
KQ_ONE_AND_MANY(q4_k, KQ_Q4_K_ROWS, AVX2_ROWS)
KQ_ONE_AND_MANY(q5_k, KQ_Q5_K_ROWS, AVX2_ROWS)
KQ_ONE_AND_MANY(q6_k, q6_k_rows, AVX2_ROWS)
KQ_TABLES(avx2)
#else
KQ_NO_TABLES(avx2)
#endif
