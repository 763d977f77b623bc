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

/* The K-quants' rows are computed in one canonical order, which csrc/kquant_gemm.c's int8 GEMM
 * follows too, so that a row's bits do not depend on which path or how many rows computed it:
 * per superblock i, the integers S_i = sum_j sc_j <q_j, x_j> (Q6_K: less 32 sum_g sc_g bsum_g) and
 * (Q4_K/Q5_K) M_i = sum_j m_j bsum_j, exact in int32 whatever order they are summed in; then in
 * float, i ascending from acc = 0: Q4_K/Q5_K t = fnmadd(M_i, dmin, S_i d), acc = fma(t, a_d, acc);
 * Q6_K acc = fma(S_i, a_d d, acc). The dots below sum each superblock in 16 int32 lanes; a unit is
 * the vector [8 lanes adding up to S | 8 adding up to M (Q6_K: to the rest of S)], and totals8
 * turns 8 units (8 rows' at 8 rows, else 8 superblocks' of one row) into their 16 totals. */
static inline __m512i totals8(const __m512i v[8]) {
    __m512i w[4];
    for (int p = 0; p < 4; ++p)
        w[p] = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2 * p], v[2 * p + 1], 0x88),
                                _mm512_shuffle_i32x4(v[2 * p], v[2 * p + 1], 0xdd));
    const __m512 z0 = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_unpacklo_epi64(w[0], w[1]), _mm512_unpackhi_epi64(w[0], w[1])));
    const __m512 z1 = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_unpacklo_epi64(w[2], w[3]), _mm512_unpackhi_epi64(w[2], w[3])));
    const __m512i s = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(z0, z1, 0x88)),
                                       _mm512_castps_si512(_mm512_shuffle_ps(z0, z1, 0xdd)));
    /* lanes now: S of units 0 2 4 6, M of 0 2 4 6, S of 1 3 5 7, M of 1 3 5 7 */
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15), s);
}

/* the canonical float step of 8 superblock-rows at once (lanes: rows, or superblocks) */
static inline __m256 k_step(__m512i totals, int q6, __m256 d, __m256 dmin, __m256 ad, __m256 acc) {
    const __m256i s = _mm512_castsi512_si256(totals), m = _mm512_extracti64x4_epi64(totals, 1);
    if (q6) return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s, m)), _mm256_mul_ps(ad, d), acc);
    return _mm256_fmadd_ps(_mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), dmin, _mm256_mul_ps(_mm256_cvtepi32_ps(s), d)), ad, acc);
}

/* the 8 floats at p, p + stride, ... (bytes), 0 past the first n */
static inline __m256 gather8(const void *p, int64_t stride, int n) {
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)stride));
    return _mm256_mmask_i32gather_ps(_mm256_setzero_ps(), (__mmask8)((1u << n) - 1), idx, p, 1);
}

/* the float16 in the high half of the 32-bit words at p, p + stride, ... (high: the word may
 * start before the half, never end past it), 0 past the first n; low: the low halves */
static inline __m256 halves8(const uint8_t *p, int64_t stride, int n, int high) {
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)stride));
    __m256i words = _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), (__mmask8)((1u << n) - 1), idx, p, 1);
    if (high) words = _mm256_srli_epi32(words, 16);
    return _mm256_cvtph_ps(_mm256_cvtepi32_epi16(words));
}

/* Q4_K, and Q5_K where five, superblock i's units for R rows: a 32-byte chunk's low then high
 * nibbles make one vector of 64 values in order (sub-blocks 2c and 2c + 1) against 64 contiguous
 * activation bytes; Q5_K adds 16 where bit j of qh[l] is set (j the sub-block). The 12 scale bytes
 * become 8 scales and 8 minimums in four word operations (as llama.cpp's utmp), each vector's
 * int16 lane scales one permute; per row, maddubs (unsigned weights times signed activations,
 * pairs summed into int16: at most 2 x 31 x 128) then vpdpwssd by the lane scales. */
KQ_ROWS_FN k45_units(const uint8_t *blk, const kq_act_t *a, int64_t row_blocks, const int R, const int five,
                     __m512i *unit, int64_t unit_stride) {
    const __m256i low = _mm256_set1_epi8(15);
    const __m512i sixteen = _mm512_set1_epi8(16);
    const __m256i min_idx = _mm256_setr_epi16(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    const uint8_t *qs = blk + (five ? 48 : 16);
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
    for (int r = 0; r < R; ++r) {
        const kq_act_t *A = a + r * row_blocks;
        __m512i sums = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c)
            sums = _mm512_dpwssd_epi32(sums, _mm512_maddubs_epi16(v[c], _mm512_loadu_si512(A->qs + 64 * c)), s[c]);
        const __m256i mm = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)A->bsums), m16);
        const __m256i folded = _mm256_add_epi32(_mm512_castsi512_si256(sums), _mm512_extracti64x4_epi64(sums, 1));
        unit[r * unit_stride] = _mm512_inserti64x4(_mm512_castsi256_si512(folded), mm, 1);
    }
}

/* Q6_K superblock i's units for R rows: per 128 values, 64 bytes of low 4 bits (their low nibbles
 * are values 0-63 in order, their high nibbles 64-127) and 32 bytes of high 2 bits (bits 2p of
 * qh[l], part p = 32 values); values 0..63 (maddubs pairs at most 2 x 63 x 128), the offset of 32
 * taken off through the block sums; int16 lane t of vector c sums values 64 c + 2t, + 1 (scale
 * group 4 c + t / 8) */
KQ_ROWS_FN q6_units(const uint8_t *blk, const kq_act_t *a, int64_t row_blocks, const int R, __m512i *unit,
                    int64_t unit_stride) {
    const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3);
    const __m512i shift_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i shift_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
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
    for (int r = 0; r < R; ++r) {
        const kq_act_t *A = a + r * row_blocks;
        const __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)A->bsums), sc16);
        __m512i sums = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5)));
        for (int c = 0; c < 4; ++c)
            sums = _mm512_dpwssd_epi32(sums, _mm512_maddubs_epi16(v[c], _mm512_loadu_si512(A->qs + 64 * c)), s[c]);
        unit[r * unit_stride] = sums;
    }
}

/* a K-quant (type 0: Q4_K, 1: Q5_K, 2: Q6_K) times R rows (R a constant where inlined): at 8 rows
 * the rows' units of each superblock go to totals8 together and the float step runs with the rows
 * in lanes; below 8 each row's units of 8 superblocks do, and the float step runs one superblock
 * at a time (scalar fma), the same operations in the same order either way */
KQ_ROWS_FN k_rows(const uint8_t *w, const kq_act_t *a, int64_t row_blocks, int k, const int R, const int type,
                  float *out) {
    const int bytes = type == 2 ? 210 : type ? 176 : 144, q6 = type == 2, nsb = k / KQ_BLOCK;
    const int64_t ab = (int64_t)sizeof(kq_act_t);
    if (R == KQ_ROWS) {
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < nsb; ++i) {
            const uint8_t *blk = w + (int64_t)bytes * i;
            __m512i unit[KQ_ROWS];
            if (q6) q6_units(blk, a + i, row_blocks, KQ_ROWS, unit, 1);
            else k45_units(blk, a + i, row_blocks, KQ_ROWS, type, unit, 1);
            const __m256 d = _mm256_set1_ps(half_at(blk + (q6 ? 208 : 0)));
            const __m256 dmin = _mm256_set1_ps(q6 ? 0.f : half_at(blk + 2));
            acc = k_step(totals8(unit), q6, d, dmin, gather8(&a[i].d, row_blocks * ab, KQ_ROWS), acc);
        }
        _mm256_storeu_ps(out, acc);
        return;
    }
    __m128 acc[KQ_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps();
    for (int i0 = 0; i0 < nsb; i0 += 8) {
        const int n = nsb - i0 < 8 ? nsb - i0 : 8;
        __m512i unit[KQ_ROWS][8];
        for (int ii = 0; ii < 8; ++ii) {
            if (ii >= n) {
                for (int r = 0; r < R; ++r) unit[r][ii] = _mm512_setzero_si512();
                continue;
            }
            const uint8_t *blk = w + (int64_t)bytes * (i0 + ii);
            if (q6) q6_units(blk, a + i0 + ii, row_blocks, R, &unit[0][ii], 8);
            else k45_units(blk, a + i0 + ii, row_blocks, R, type, &unit[0][ii], 8);
        }
        /* d (and dmin) of the 8 superblocks: Q4_K/Q5_K's the two halves of their first word, Q6_K's
         * the high half of the word at 206 (a word at 208 would end past the block) */
        const uint8_t *blk0 = w + (int64_t)bytes * i0;
        const __m256 d = halves8(blk0 + (q6 ? 206 : 0), bytes, n, q6), dmin = q6 ? d : halves8(blk0, bytes, n, 1);
        for (int r = 0; r < R; ++r) {
            float t[8], ad[8];
            const __m256 adv = gather8(&a[r * row_blocks + i0].d, ab, n);
            /* Q6_K: t = S, ad = a_d d; else t = fnmadd(M, dmin, S d), ad = a_d; then fma'd in order */
            const __m512i tot = totals8(unit[r]);
            const __m256i s = _mm512_castsi512_si256(tot), m = _mm512_extracti64x4_epi64(tot, 1);
            _mm256_storeu_ps(ad, q6 ? _mm256_mul_ps(adv, d) : adv);
            _mm256_storeu_ps(t, q6 ? _mm256_cvtepi32_ps(_mm256_add_epi32(s, m))
                                   : _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), dmin, _mm256_mul_ps(_mm256_cvtepi32_ps(s), d)));
            for (int ii = 0; ii < n; ++ii) /* lane 0 is the row's sum (the others: t's, unused) */
                acc[r] = _mm_fmadd_ss(_mm_load_ss(&t[ii]), _mm_load_ss(&ad[ii]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = _mm_cvtss_f32(acc[r]);
}

KQ_ONE_AND_MANY(q8_0, q8_0_rows, KQ_ROWS)
#define K_Q4_K(w, a, rb, k, R, out) k_rows(w, a, rb, k, R, 0, out)
#define K_Q5_K(w, a, rb, k, R, out) k_rows(w, a, rb, k, R, 1, out)
#define K_Q6_K(w, a, rb, k, R, out) k_rows(w, a, rb, k, R, 2, out)
KQ_ONE_AND_MANY(q4_k, K_Q4_K, KQ_ROWS)
KQ_ONE_AND_MANY(q5_k, K_Q5_K, KQ_ROWS)
KQ_ONE_AND_MANY(q6_k, K_Q6_K, KQ_ROWS)
KQ_TABLES(avx512)
#else
KQ_NO_TABLES(avx512)
#endif
