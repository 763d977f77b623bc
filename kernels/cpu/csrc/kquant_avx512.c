/* The GGUF block dots of kquant.c on AVX512-VNNI (kquant.h): vpdpbusd multiplies unsigned weight
 * bytes by signed activation bytes and sums each four products into an int32 lane in one
 * instruction; a K-quant superblock takes 4 of them (two sub-blocks a vector), the lanes weighted
 * by their sub-block's scale in integers, then one float multiply per superblock. Intel Cascade
 * Lake and Ice Lake Xeons have VNNI without AVX512-BF16; every AVX-512 class kvserve builds for
 * takes this file (testing/process.py CLASSES). */
#include "kquant.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
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

static float dot_q4_0(const uint8_t *w, const kq_act_t *a, int k) {
    const __m256i low = _mm256_set1_epi8(15);
    __m256 acc = _mm256_setzero_ps();
    float off = 0.f;
    for (int b = 0; b < k / 32; ++b) {
        const uint8_t *blk = w + 18 * b;
        const kq_act_t *A = a + b / 8;
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low);
        const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), v, load32(A->qs + (b % 8) * 32));
        const float d = half_at(blk) * A->d;
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d), acc);
        off += d * (float)(8 * (A->bsums[(b % 8) * 2] + A->bsums[(b % 8) * 2 + 1]));
    }
    return hsum8(acc) - off;
}

/* Q8_0 times R rows (R a constant where inlined): signed weights against the activations offset
 * to unsigned (x + 128, an xor), the offset taken off per lane as 128 times the lane's weight sum
 * (one vpdpbusd by ones, shared by the rows); two blocks a vector, a last odd block on its own */
KQ_ROWS_FN q8_0_rows(const uint8_t *w, const kq_act_t *a, int64_t row_blocks, int k, const int R, float *out) {
    const __m512i flip = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
    __m512 acc[KQ_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const int blocks = k / 32;
    for (int b = 0; b < blocks; b += 2) {
        const uint8_t *b0 = w + 34 * b, *b1 = b + 1 < blocks ? b0 + 34 : NULL;
        const __m256i q0 = load32(b0 + 2), q1 = b1 ? load32(b1 + 2) : _mm256_setzero_si256();
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
        const __m512i offset = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, q), 7);
        const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), offset);
        const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(half_at(b0)), _mm256_set1_ps(b1 ? half_at(b1) : 0.f), 1);
        for (int r = 0; r < R; ++r) {
            const kq_act_t *A = a + r * row_blocks + b / 8;
            const int8_t *x = A->qs + (b % 8) * 32; /* b even: b and b + 1 share an activation block */
            const __m512i xv = b1 ? _mm512_loadu_si512(x) : _mm512_castsi256_si512(load32(x));
            const __m512i p = _mm512_dpbusd_epi32(start, _mm512_xor_si512(xv, flip), q);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d, _mm512_set1_ps(A->d)), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* int16 lane t of vector c holds entry t / per + c * (32 / per) of a 16-entry int16 table: the
 * sub-block (per 16: Q4_K/Q5_K's 32 values) or scale group (per 8: Q6_K's 16) of the two values
 * that maddubs summed into that lane; step holds t / per */
static const short __attribute__((aligned(64))) STEP16[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                              1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
static const short __attribute__((aligned(64))) STEP8[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                             2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};

static inline __m512i lane_scales(__m256i table, const short step[32], int per, int c) {
    const __m512i idx = _mm512_add_epi16(_mm512_load_si512(step), _mm512_set1_epi16((short)(c * (32 / per))));
    return _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(table));
}

/* Q4_K, and Q5_K where five, times R rows (R a constant where inlined: every row's arithmetic is
 * the same at any R): a 32-byte chunk's low then high nibbles make one vector of 64 values in
 * order (sub-blocks 2c and 2c + 1) against 64 contiguous activation bytes; Q5_K adds 16 where bit
 * j of qh[l] is set (j the sub-block). Per superblock the 12 scale bytes become 8 scales and 8
 * minimums in four word operations (as llama.cpp's utmp), each vector's int16 lane scales one
 * permute; per row, maddubs (unsigned weights times signed activations, pairs summed into int16:
 * at most 2 x 31 x 128) then vpdpwssd by the lane scales sums the superblock in int32 lanes. */
KQ_ROWS_FN k45_rows(const uint8_t *w, const kq_act_t *a, int64_t row_blocks, int k, const int R, const int five,
                    float *out) {
    const int bytes = five ? 176 : 144;
    const __m256i low = _mm256_set1_epi8(15);
    const __m512i sixteen = _mm512_set1_epi8(16);
    const __m256i min_idx = _mm256_setr_epi16(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    __m512 acc[KQ_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int i = 0; i < k / KQ_BLOCK; ++i) {
        const uint8_t *blk = w + (int64_t)bytes * i, *qs = blk + (five ? 48 : 16);
        uint32_t u[4];
        memcpy(u, blk + 4, 12);
        u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
        const uint32_t m03 = u[1] & 0x3f3f3f3fu;
        u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
        u[2] = m03;
        u[0] &= 0x3f3f3f3fu;
        const __m256i table = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)u)); /* 8 scales, 8 mins */
        const __m256i m16 = _mm256_permutexvar_epi16(min_idx, table);
        const __m512i qh = five ? _mm512_broadcast_i64x4(load32(blk + 16)) : _mm512_setzero_si512();
        __m512i v[4], s[4];
        for (int c = 0; c < 4; ++c) {
            const __m256i q = load32(qs + 32 * c);
            v[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, low)),
                                      _mm256_and_si256(_mm256_srli_epi16(q, 4), low), 1);
            if (five) {
                const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * c))),
                                                        _mm256_set1_epi8((char)(1 << (2 * c + 1))), 1);
                v[c] = _mm512_mask_add_epi8(v[c], _mm512_test_epi8_mask(qh, bits), v[c], sixteen);
            }
            s[c] = lane_scales(table, STEP16, 16, c);
        }
        const __m512 d = _mm512_set1_ps(half_at(blk)), dmin = _mm512_set1_ps(half_at(blk + 2));
        for (int r = 0; r < R; ++r) {
            const kq_act_t *A = a + r * row_blocks + i;
            __m512i sums = _mm512_setzero_si512();
            for (int c = 0; c < 4; ++c)
                sums = _mm512_dpwssd_epi32(sums, _mm512_maddubs_epi16(v[c], _mm512_loadu_si512(A->qs + 64 * c)), s[c]);
            const __m256i mm = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)A->bsums), m16);
            /* the weight's scales first (shared by the rows), then the row's: one broadcast a row */
            const __m512 t = _mm512_fnmadd_ps(_mm512_zextps256_ps512(_mm256_cvtepi32_ps(mm)), dmin,
                                              _mm512_mul_ps(_mm512_cvtepi32_ps(sums), d));
            acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(A->d), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* Q6_K times R rows (as k45_rows): per 128 values, 64 bytes of low 4 bits (their low nibbles are
 * values 0-63 in order, their high nibbles 64-127) and 32 bytes of high 2 bits (bits 2p of qh[l],
 * part p = 32 values); values 0..63 (maddubs pairs at most 2 x 63 x 128), the offset of 32 taken
 * off through the block sums; int16 lane t of vector c sums values 64 c + 2t, + 1 (scale group
 * 4 c + t / 8) */
KQ_ROWS_FN q6_k_rows(const uint8_t *w, const kq_act_t *a, int64_t row_blocks, int k, const int R, float *out) {
    const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3);
    const __m512i shift_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i shift_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    __m512 acc[KQ_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int i = 0; i < k / KQ_BLOCK; ++i) {
        const uint8_t *blk = w + 210 * i;
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        __m512i v[4], s[4]; /* values 64 c .. 64 c + 63 of the superblock, and their lanes' scales */
        for (int n = 0; n < 2; ++n) {
            const __m512i ql = _mm512_loadu_si512(blk + 64 * n);
            const __m512i qh = _mm512_broadcast_i64x4(load32(blk + 128 + 32 * n));
            v[2 * n] = _mm512_or_si512(_mm512_and_si512(ql, low),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_lo), two), 4));
            v[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_hi), two), 4));
        }
        for (int c = 0; c < 4; ++c) s[c] = lane_scales(sc16, STEP8, 8, c);
        const float d = half_at(blk + 208);
        for (int r = 0; r < R; ++r) {
            const kq_act_t *A = a + r * row_blocks + i;
            const __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)A->bsums), sc16);
            __m512i sums = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5)));
            for (int c = 0; c < 4; ++c)
                sums = _mm512_dpwssd_epi32(sums, _mm512_maddubs_epi16(v[c], _mm512_loadu_si512(A->qs + 64 * c)), s[c]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(A->d * d), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

KQ_ONE_AND_MANY(q8_0, q8_0_rows, KQ_ROWS)
KQ_ONE_AND_MANY(q4_k, KQ_Q4_K_ROWS, KQ_ROWS)
KQ_ONE_AND_MANY(q5_k, KQ_Q5_K_ROWS, KQ_ROWS)
KQ_ONE_AND_MANY(q6_k, q6_k_rows, KQ_ROWS)
KQ_TABLES(avx512)
#else
KQ_NO_TABLES(avx512)
#endif
