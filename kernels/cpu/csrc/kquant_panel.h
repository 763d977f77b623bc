/* The panels of csrc/kquant_gemm.c's int8 GEMM, unpacked in vectors (included by it and, for the
 * repack, csrc/kquant_x16.c, on their vector builds: KQ_ISA 512 with KG_LANES 16, 256 with 8). A panel holds KG_LANES weight rows,
 * superblock after superblock; per sub-block of S values (32, Q6_K's 16) S / 4 runs of KG_LANES x 4
 * bytes (run c: values S s + 4c .. + 3 of each row, row r at byte 4r, so an int32 lane holds one
 * weight row), then the rows' scales. Per superblock every row's 256 values are unpacked into a
 * row of a small buffer with AVX2 (the dots' unpacking: a nibble mask and shift, Q5_K's and Q6_K's
 * high bits or'd in), then the buffer's KG_LANES rows of int32 are transposed in registers into the
 * runs (a 16 x 16 transpose on AVX-512, 8 x 8 on AVX2): the same bytes as one value at a time
 * (kquant_gemm's rows stay bit for bit what they were), ~10x faster. The scales stay scalar (8 or
 * 16 a row and superblock, against 256 values). */
#ifndef KVSERVE_KQUANT_PANEL_H
#define KVSERVE_KQUANT_PANEL_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kquant.h"

#if KQ_ISA == 512
/* acc += the unsigned bytes of w by the 4 signed bytes at x broadcast, the broadcast embedded in the
 * instruction (compilers load it apart with set1 of a loaded int: 1.03-1.08x slower, measured) */
static inline __attribute__((always_inline)) __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
    return acc;
}
#endif

static inline float half_of(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* superblock i (256 values) of a weight row as unsigned bytes, value = scale v - minimum (Q8_0's
 * signed values offset by 128, Q4_0's 8 and Q6_K's 32 taken off as minimums) */
static inline void unpack_values(const uint8_t *w, int type, int64_t i, uint8_t v[KQ_BLOCK]) {
    const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1), two = _mm256_set1_epi8(3);
    if (type == GGML_Q8_0) {
        for (int b = 0; b < 8; ++b)
            _mm256_storeu_si256((__m256i *)(v + 32 * b),
                                _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + (i * 8 + b) * 34 + 2)),
                                                 _mm256_set1_epi8((char)0x80)));
    } else if (type == GGML_Q4_0) { /* a block's 16 bytes: values 0-15 the low nibbles, 16-31 the high */
        for (int b = 0; b < 8; ++b) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(w + (i * 8 + b) * 18 + 2));
            _mm256_storeu_si256((__m256i *)(v + 32 * b), _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low));
        }
    } else if (type == GGML_Q6_K) { /* per 128 values: 64 bytes of low nibbles, 32 of 2 high bits */
        const uint8_t *blk = w + 210 * i;
        for (int n = 0; n < 2; ++n) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            const __m256i parts[4] = {
                _mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                _mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
            for (int p = 0; p < 4; ++p) { /* part p's high bits: bits 2p, 2p + 1 of each byte of h */
                const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(h, 2 * p), two);
                _mm256_storeu_si256((__m256i *)(v + 128 * n + 32 * p), _mm256_or_si256(parts[p], _mm256_slli_epi16(hb, 4)));
            }
        }
    } else { /* Q4_K, Q5_K: 32-byte chunk c's low nibbles are sub-block 2c, its high ones 2c + 1 */
        const int five = type == GGML_Q5_K;
        const uint8_t *blk = w + (five ? 176 : 144) * i, *qs = blk + (five ? 48 : 16);
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
            if (five) { /* bit j of qh[l] is 16 on value l of sub-block j */
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
            }
            _mm256_storeu_si256((__m256i *)(v + 64 * c), lo);
            _mm256_storeu_si256((__m256i *)(v + 64 * c + 32), hi);
        }
    }
}

/* KG_LANES rows of 256 unpacked values (vals, 256 bytes apart) into a panel superblock's runs
 * (P: its start, sub: the bytes of a sub-block of S values, runs first) */
static inline __attribute__((always_inline)) void scatter_s(const uint8_t *vals, uint8_t *P, const int S,
                                                            int64_t sub) {
#if KQ_ISA == 512
    for (int c = 0; c < 4; ++c) { /* values 64 c .. 64 c + 63: 16 int32 of each row */
        __m512i r[16], t[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_load_si512(vals + 256 * j + 64 * c);
        for (int j = 0; j < 16; j += 2) {
            t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
            t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
        }
        /* r[4g + q]: in 128-bit lane L, int32 4L + q of rows 4g .. 4g + 3 */
        for (int g = 0; g < 4; ++g) {
            r[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
            r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
            r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
            r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
        }
        for (int q = 0; q < 4; ++q) {
            const __m512i a = _mm512_shuffle_i32x4(r[q], r[4 + q], 0x44), b = _mm512_shuffle_i32x4(r[q], r[4 + q], 0xee);
            const __m512i x = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0x44);
            const __m512i y = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0xee);
            const __m512i cols[4] = {_mm512_shuffle_i32x4(a, x, 0x88), _mm512_shuffle_i32x4(a, x, 0xdd),
                                     _mm512_shuffle_i32x4(b, y, 0x88), _mm512_shuffle_i32x4(b, y, 0xdd)};
            for (int L = 0; L < 4; ++L) { /* int32 4L + q of the 16 rows: values o .. o + 3 */
                const int o = 64 * c + 4 * (4 * L + q);
                _mm512_store_si512(P + (o / S) * sub + 64 * ((o % S) / 4), cols[L]);
            }
        }
    }
#else
    for (int c = 0; c < 8; ++c) { /* values 32 c .. 32 c + 31: 8 int32 of each row */
        __m256i r[8], t[8];
        for (int j = 0; j < 8; ++j) r[j] = _mm256_load_si256((const __m256i *)(vals + 256 * j + 32 * c));
        for (int j = 0; j < 8; j += 2) {
            t[j] = _mm256_unpacklo_epi32(r[j], r[j + 1]);
            t[j + 1] = _mm256_unpackhi_epi32(r[j], r[j + 1]);
        }
        for (int g = 0; g < 2; ++g) {
            r[4 * g] = _mm256_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
            r[4 * g + 1] = _mm256_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
            r[4 * g + 2] = _mm256_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
            r[4 * g + 3] = _mm256_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
        }
        for (int q = 0; q < 4; ++q) {
            const __m256i cols[2] = {_mm256_permute2x128_si256(r[q], r[4 + q], 0x20),
                                     _mm256_permute2x128_si256(r[q], r[4 + q], 0x31)};
            for (int L = 0; L < 2; ++L) {
                const int o = 32 * c + 4 * (4 * L + q);
                _mm256_store_si256((__m256i *)(P + (o / S) * sub + 32 * ((o % S) / 4)), cols[L]);
            }
        }
    }
#endif
}

/* a Q4_K/Q5_K superblock's 8 scales and 8 minimums from its 12 scale bytes, in four word
 * operations (kq_scale_min's values: sc[j], mn[j]) */
static inline void k_scales_mins(const uint8_t *s12, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t u[3], o[4];
    memcpy(u, s12, 12);
    o[0] = u[0] & 0x3f3f3f3fu;
    o[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    o[2] = u[1] & 0x3f3f3f3fu;
    o[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    memcpy(sc, o, 8);
    memcpy(mn, o + 2, 8);
}

/* scatter_s with S a constant in each instance (the runs' offsets folded) */
static inline void scatter_runs(const uint8_t *vals, uint8_t *P, int S, int64_t sub) {
    if (S == 16) scatter_s(vals, P, 16, sub);
    else scatter_s(vals, P, 32, sub);
}

static inline int sub_values(int type) { return type == GGML_Q6_K ? 16 : 32; }
/* bytes of one sub-block in a float panel: its values, then KG_LANES float scales and minimums */
static inline int64_t sub_bytes(int S) { return (int64_t)S * KG_LANES + 8 * KG_LANES; }
static inline int64_t super_bytes(int S) { return (KQ_BLOCK / S) * sub_bytes(S); }

/* the bytes of a superblock's 256 values in a row of the type */
static inline int super_stored(int type) {
    return type == GGML_Q8_0 ? 272 : type == GGML_Q6_K ? 210 : type == GGML_Q5_K ? 176 : 144;
}

/* superblock i's values of rows n0 .. n0 + KG_LANES - 1 (zeros past n_out) into vals; each row's
 * superblock KG_AHEAD on prefetched (the rows are KG_LANES streams a prefetcher does not follow) */
#define KG_AHEAD 4
static inline void unpack_rows(const uint8_t *w, int64_t row_bytes, int type, int n0, int n_out, int64_t i,
                               int nsb, uint8_t *vals) {
    const int bytes = super_stored(type);
    for (int r = 0; r < KG_LANES; ++r) {
        if (n0 + r >= n_out) {
            memset(vals + KQ_BLOCK * r, 0, KQ_BLOCK);
            continue;
        }
        const uint8_t *row = w + (int64_t)(n0 + r) * row_bytes;
        if (i + KG_AHEAD < nsb)
            for (int at = 0; at < bytes; at += 64) _mm_prefetch((const char *)(row + (i + KG_AHEAD) * bytes + at), _MM_HINT_T0);
        unpack_values(row, type, i, vals + KQ_BLOCK * r);
    }
}

/* rows n0 .. n0 + KG_LANES - 1 of the weight (zeros past n_out) into a float panel: per superblock,
 * per sub-block s the runs, then the rows' scales and minimums as floats (value = scale v - min) */
static inline void pack_panel(const uint8_t *w, int64_t row_bytes, int type, int n0, int n_out, int nsb, uint8_t *panel) {
    const int S = sub_values(type), subs = KQ_BLOCK / S;
    uint8_t vals[KG_LANES * KQ_BLOCK] __attribute__((aligned(64)));
    for (int64_t i = 0; i < nsb; ++i) {
        uint8_t *P = panel + i * super_bytes(S);
        unpack_rows(w, row_bytes, type, n0, n_out, i, nsb, vals);
        scatter_runs(vals, P, S, sub_bytes(S));
        for (int r = 0; r < KG_LANES; ++r) {
            float scale[16] = {0}, minimum[16] = {0};
            const uint8_t *row = w + (int64_t)(n0 + r < n_out ? n0 + r : 0) * row_bytes;
            if (n0 + r >= n_out) {
                /* zeros: a row past the weight's end */
            } else if (type == GGML_Q4_0 || type == GGML_Q8_0) {
                for (int b = 0; b < 8; ++b) {
                    scale[b] = half_of(row + (i * 8 + b) * (type == GGML_Q8_0 ? 34 : 18));
                    minimum[b] = (type == GGML_Q8_0 ? 128.f : 8.f) * scale[b];
                }
            } else if (type == GGML_Q6_K) {
                const uint8_t *blk = row + 210 * i;
                for (int g = 0; g < 16; ++g) {
                    scale[g] = half_of(blk + 208) * (float)((const int8_t *)(blk + 192))[g];
                    minimum[g] = 32.f * scale[g];
                }
            } else {
                const uint8_t *blk = row + (type == GGML_Q5_K ? 176 : 144) * i;
                uint8_t sc[8], m[8];
                k_scales_mins(blk + 4, sc, m);
                for (int j = 0; j < 8; ++j) {
                    scale[j] = half_of(blk) * (float)sc[j];
                    minimum[j] = half_of(blk + 2) * (float)m[j];
                }
            }
            for (int s = 0; s < subs; ++s) {
                float *f = (float *)(P + s * sub_bytes(S) + (int64_t)S * KG_LANES);
                f[r] = scale[s];
                f[KG_LANES + r] = minimum[s];
            }
        }
    }
}

#if KQ_ISA == 512
/* A K-quant's panel for the rows in the dots' canonical order (kquant_gemm.c's tile_k): per
 * superblock, per sub-block its runs and its rows' scales as int32; then the minimums (Q4_K/Q5_K:
 * the pairs (m_2q, m_2q+1), Q6_K: (32 sc_2q, 32 sc_2q+1), int16 in each row's int32 lane), then
 * the rows' d and dmin as floats. */
static inline int k_pairs(int q6) { return q6 ? 8 : 4; }
static inline int64_t k_super_bytes(int q6) {
    const int S = q6 ? 16 : 32;
    return (KQ_BLOCK / S) * ((int64_t)S * KG_LANES + 4 * KG_LANES) + (k_pairs(q6) + 2) * 4 * KG_LANES;
}

static void pack_panel_k(const uint8_t *w, int64_t row_bytes, int type, int n0, int n_out, int nsb, uint8_t *panel) {
    const int q6 = type == GGML_Q6_K, S = q6 ? 16 : 32, subs = KQ_BLOCK / S, pairs = k_pairs(q6);
    const int64_t sub = (int64_t)S * KG_LANES + 4 * KG_LANES;
    uint8_t vals[KG_LANES * KQ_BLOCK] __attribute__((aligned(64)));
    for (int64_t i = 0; i < nsb; ++i) {
        uint8_t *P = panel + i * k_super_bytes(q6);
        unpack_rows(w, row_bytes, type, n0, n_out, i, nsb, vals);
        scatter_runs(vals, P, S, sub);
        int16_t *pairs16 = (int16_t *)(P + subs * sub);
        float *f = (float *)(P + subs * sub + (int64_t)pairs * 4 * KG_LANES);
        for (int r = 0; r < KG_LANES; ++r) {
            int sc[16] = {0}, mn[8] = {0};
            float d = 0.f, dmin = 0.f;
            if (n0 + r < n_out) {
                const uint8_t *row = w + (int64_t)(n0 + r) * row_bytes;
                if (q6) {
                    const uint8_t *blk = row + 210 * i;
                    d = half_of(blk + 208);
                    for (int g = 0; g < 16; ++g) sc[g] = ((const int8_t *)(blk + 192))[g];
                } else {
                    const uint8_t *blk = row + (type == GGML_Q5_K ? 176 : 144) * i;
                    uint8_t sc8[8], mn8[8];
                    d = half_of(blk), dmin = half_of(blk + 2);
                    k_scales_mins(blk + 4, sc8, mn8);
                    for (int j = 0; j < 8; ++j) sc[j] = sc8[j], mn[j] = mn8[j];
                }
            }
            for (int s = 0; s < subs; ++s) ((int32_t *)(P + s * sub + (int64_t)S * KG_LANES))[r] = sc[s];
            for (int q = 0; q < pairs; ++q) {
                pairs16[2 * (q * KG_LANES + r)] = (int16_t)(q6 ? 32 * sc[2 * q] : mn[2 * q]);
                pairs16[2 * (q * KG_LANES + r) + 1] = (int16_t)(q6 ? 32 * sc[2 * q + 1] : mn[2 * q + 1]);
            }
            f[r] = d;
            f[KG_LANES + r] = dmin;
        }
    }
}
#endif
#endif
