/* The int8 GEMM of GGUF block weights for prefill chunks (engine/layers/gguf_linear.py calls it
 * from PANEL_FROM_ROWS activation rows up; docs/design/gguf_kquants.md). The activations are
 * kq_quantize's (int8 per 256 values, a float scale, the sums of each 16). Each thread takes
 * panels of KG_LANES weight rows: it unpacks the panel's blocks once into a buffer of its own
 * (a byte per value, KG_LANES rows interleaved 4 values at a time, so that an int32 lane holds one
 * weight row; per sub-block of 32 values, 16 for Q6_K, a float scale and minimum a row), then
 * every activation row passes over it: 4 activation bytes broadcast, multiplied into all the
 * lanes (vpdpbusd on AVX512-VNNI; maddubs then madd on AVX2), each sub-block's int32 sums
 * converted and weighted by its scale in float, its minimum taken off through the block sums.
 * The panel lives in L2 (~1.25 bytes a value), so the weight is read from memory once a product
 * and unpacked once for all the rows, not once for every 8 as the few-row dots do. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kquant.h"

#define KG_BIT(t) (1u << ((t) - GGML_Q4_0)) /* a type's bit in kq_gemm_types' masks */

#if KQ_ISA == 512
#include <immintrin.h>
#define KG_LANES 16 /* weight rows a panel: one int32 lane each */
#define KG_ROWS 8   /* activation rows a tile: 8 x 3 accumulators + 3 of the panel, of 32 registers */
#define KG_TYPES (KG_BIT(GGML_Q4_0) | KG_BIT(GGML_Q8_0) | KG_BIT(GGML_Q4_K) | KG_BIT(GGML_Q5_K) | KG_BIT(GGML_Q6_K))
#elif KQ_ISA == 256
#include <immintrin.h>
#define KG_LANES 8
#define KG_ROWS 4
/* maddubs sums two u8 x s8 products into int16: Q8_0's values offset to 0..255 would saturate, so
 * its tile multiplies the signed values by sign (tile's q8) */
#define KG_TYPES (KG_BIT(GGML_Q4_0) | KG_BIT(GGML_Q8_0) | KG_BIT(GGML_Q4_K) | KG_BIT(GGML_Q5_K) | KG_BIT(GGML_Q6_K))
#else
#define KG_LANES 1
#define KG_ROWS 1
#define KG_TYPES 0u
#endif

/* Which types a prefill chunk takes this GEMM for rather than the alternatives, per CPU class
 * (measured: docs/design/gguf_kquants.md): every type it has, on every class (AVX512-BF16's
 * bfloat16 panels included: 1.2-1.5x slower at 256 rows, 2-6x without BF16 or AVX-512). For a
 * type or width it does not take, the block dots beat dequantized panels into csrc/gemm.c except
 * where that GEMM has AVX512-BF16 (AVX2 Q8_0, before this GEMM took it: 17 ms against 48 at 256 rows). */
#define KG_PREFERRED KG_TYPES
/* the types whose rows kq_gemm computes bit for bit as the block dots do (kquant_avx512.c's
 * canonical order): a product may take either path at any row count and each row is the same */
#if KQ_ISA == 512
#define KG_ALIKE (KG_BIT(GGML_Q4_K) | KG_BIT(GGML_Q5_K) | KG_BIT(GGML_Q6_K))
#else
#define KG_ALIKE 0u
#endif
#if KQ_ISA != 0 && !defined(__AVX512BF16__)
#define KG_DOTS_OVER_PANELS 0x7fffu
#else
#define KG_DOTS_OVER_PANELS 0u
#endif

/* 0: the types kq_gemm multiplies on this build; 1: those a prefill chunk should give it; 2: those
 * whose prefill chunks, where not given it, take the block dots rather than dequantized panels; 3:
 * those whose rows it computes as the dots do, bit for bit (KG_ALIKE) (a bit per ggml type code t
 * at 1 << (t - GGML_Q4_0)). Read by kernels/cpu/kquant.py. */
int kq_gemm_types(int which) {
    return (int)(which == 3 ? KG_ALIKE : which == 2 ? KG_DOTS_OVER_PANELS : which == 1 ? KG_PREFERRED : KG_TYPES);
}

/* A tight loop of n x 12 independent vpdpbusd (64 u8 x s8 multiply-adds each) on each of
 * num_threads threads, on AVX512-VNNI: the benchmarks time it for the int8 peak in the same run as
 * the GEMM (benchmarks/scale/kernels.py). Returns a lane of the sums (so the loop is kept); -1
 * where the build has no VNNI. */
int kq_vnni_peak(int n, int num_threads) {
#if KQ_ISA == 512
    int out = 0;
#pragma omp parallel num_threads(num_threads) reduction(^ : out)
    {
        __m512i acc[12];
        for (int j = 0; j < 12; ++j) acc[j] = _mm512_set1_epi32(j + omp_get_thread_num());
        const __m512i u = _mm512_set1_epi8(1), s = _mm512_set1_epi8((char)n);
        for (int i = 0; i < n; ++i)
            for (int j = 0; j < 12; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], u, s);
        for (int j = 1; j < 12; ++j) acc[0] = _mm512_xor_si512(acc[0], acc[j]);
        out ^= _mm_cvtsi128_si32(_mm512_castsi512_si128(acc[0]));
    }
    return out == -1 ? 0 : out;
#else
    (void)n, (void)num_threads;
    return -1;
#endif
}

#if KQ_ISA != 0 /* the panels (csrc/kquant_panel.h) and tiles of the vector builds */
#include "kquant_panel.h"

/* out[r][l] = the product of activation row r (blocks at a + r nsb, block sums as floats at
 * fb + r nsb subs) with the panel's row l, for R rows (a constant where inlined: every row's
 * arithmetic is the same at any R) and sub-blocks of S values */
#define KG_TILE_FN static inline __attribute__((always_inline)) void
#if KQ_ISA == 512
KG_TILE_FN tile(const uint8_t *panel, const kq_act_t *a, const float *fb, int nsb, const int R, const int S,
                const int q8, float *out) {
    (void)q8; /* vpdpbusd takes Q8_0's offset bytes: u8 x s8 into int32, no int16 to saturate */
    const int subs = KQ_BLOCK / S;
    __m512 acc[KG_ROWS], t[KG_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int i = 0; i < nsb; ++i) {
        const uint8_t *P = panel + (int64_t)i * super_bytes(S);
        for (int r = 0; r < R; ++r) t[r] = _mm512_setzero_ps();
        for (int s = 0; s < subs; ++s) {
            const uint8_t *B = P + s * sub_bytes(S);
            __m512i sums[KG_ROWS];
            for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
            for (int c = 0; c < S / 4; ++c) {
                const __m512i wv = _mm512_load_si512(B + 64 * c);
                for (int r = 0; r < R; ++r) {
                    int32_t x;
                    memcpy(&x, a[(int64_t)r * nsb + i].qs + S * s + 4 * c, 4);
                    sums[r] = _mm512_dpbusd_epi32(sums[r], wv, _mm512_set1_epi32(x));
                }
            }
            const __m512 sc = _mm512_load_ps((const float *)(B + S * KG_LANES));
            const __m512 mn = _mm512_load_ps((const float *)(B + S * KG_LANES) + KG_LANES);
            for (int r = 0; r < R; ++r) {
                t[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), sc, t[r]);
                t[r] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(fb[((int64_t)r * nsb + i) * subs + s]), t[r]);
            }
        }
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(t[r], _mm512_set1_ps(a[(int64_t)r * nsb + i].d), acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + KG_LANES * r, acc[r]);
}
#elif KQ_ISA == 256
/* maddubs of two 4-value runs summed in int16 (values at most 63: 2 x 2 x 63 x 127 < 32768),
 * then madd by ones into the int32 lanes. q8 (Q8_0, bytes offset to 0..255): the bytes back to the
 * signed values w, maddubs of |w| by the activation signed as w (w x, a pair at most 2 x 128 x 127
 * < 32768), each run into int32 alone, and no minimum (the sums are of w, not of w + 128) */
KG_TILE_FN tile(const uint8_t *panel, const kq_act_t *a, const float *fb, int nsb, const int R, const int S,
                const int q8, float *out) {
    const int subs = KQ_BLOCK / S;
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[KG_ROWS], t[KG_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int i = 0; i < nsb; ++i) {
        const uint8_t *P = panel + (int64_t)i * super_bytes(S);
        for (int r = 0; r < R; ++r) t[r] = _mm256_setzero_ps();
        for (int s = 0; s < subs; ++s) {
            const uint8_t *B = P + s * sub_bytes(S);
            __m256i sums[KG_ROWS];
            for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
            for (int c = 0; c < S / 4; c += 2) {
                __m256i w0 = _mm256_load_si256((const __m256i *)(B + 32 * c));
                __m256i w1 = _mm256_load_si256((const __m256i *)(B + 32 * c + 32));
                const __m256i s0 = _mm256_xor_si256(w0, flip), s1 = _mm256_xor_si256(w1, flip);
                if (q8) w0 = _mm256_abs_epi8(s0), w1 = _mm256_abs_epi8(s1);
                for (int r = 0; r < R; ++r) {
                    const int8_t *x = a[(int64_t)r * nsb + i].qs + S * s + 4 * c;
                    int32_t x0, x1;
                    memcpy(&x0, x, 4);
                    memcpy(&x1, x + 4, 4);
                    if (q8) {
                        const __m256i p0 = _mm256_maddubs_epi16(w0, _mm256_sign_epi8(_mm256_set1_epi32(x0), s0));
                        const __m256i p1 = _mm256_maddubs_epi16(w1, _mm256_sign_epi8(_mm256_set1_epi32(x1), s1));
                        sums[r] = _mm256_add_epi32(sums[r], _mm256_add_epi32(_mm256_madd_epi16(p0, ones),
                                                                             _mm256_madd_epi16(p1, ones)));
                        continue;
                    }
                    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(x0)),
                                                       _mm256_maddubs_epi16(w1, _mm256_set1_epi32(x1)));
                    sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(p, ones));
                }
            }
            const __m256 sc = _mm256_load_ps((const float *)(B + S * KG_LANES));
            const __m256 mn = _mm256_load_ps((const float *)(B + S * KG_LANES) + KG_LANES);
            for (int r = 0; r < R; ++r) {
                t[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), sc, t[r]);
                if (!q8) t[r] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(fb[((int64_t)r * nsb + i) * subs + s]), t[r]);
            }
        }
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(t[r], _mm256_set1_ps(a[(int64_t)r * nsb + i].d), acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + KG_LANES * r, acc[r]);
}
#endif

#if KQ_ISA == 512
/* The K-quants on AVX512-VNNI compute each row in the dots' canonical order (csrc/kquant_avx512.c:
 * per superblock the integers S_i and M_i, then the same float steps, superblocks in order), so a
 * row's bits are the dots' whatever path or tile took it: KG_ALIKE (panels: pack_panel_k). */
/* as tile, for a K-quant's panel (pack_panel_k); pb: per row and superblock the activation's
 * minimum pairs (Q4_K/Q5_K: (bsum of sub-block 2q, of 2q + 1) as int16 in an int32, 4 a
 * superblock; Q6_K reads its block sums, already pairs of int16) */
KG_TILE_FN tile_k(const uint8_t *panel, const kq_act_t *a, const int32_t *pb, int nsb, const int R, const int q6,
                  float *out) {
    const int S = q6 ? 16 : 32, subs = KQ_BLOCK / S, pairs = k_pairs(q6);
    const int64_t sub = (int64_t)S * KG_LANES + 4 * KG_LANES;
    __m512 acc[KG_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int i = 0; i < nsb; ++i) {
        const uint8_t *P = panel + (int64_t)i * k_super_bytes(q6);
        __m512i tot[KG_ROWS], part[KG_ROWS];
        for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_si512();
        for (int s = 0; s < subs; ++s) {
            const uint8_t *B = P + s * sub;
            for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_si512();
            for (int c = 0; c < S / 4; ++c) {
                const __m512i wv = _mm512_load_si512(B + 64 * c);
                for (int r = 0; r < R; ++r) part[r] = dpbusd_bcast(part[r], wv, a[(int64_t)r * nsb + i].qs + S * s + 4 * c);
            }
            const __m512i sc = _mm512_load_si512(B + (int64_t)S * KG_LANES);
            for (int r = 0; r < R; ++r) tot[r] = _mm512_add_epi32(tot[r], _mm512_mullo_epi32(part[r], sc));
        }
        const uint8_t *Q = P + subs * sub;
        for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_si512();
        for (int q = 0; q < pairs; ++q) {
            const __m512i mv = _mm512_load_si512(Q + 64 * q);
            for (int r = 0; r < R; ++r) {
                int32_t x;
                if (q6) memcpy(&x, a[(int64_t)r * nsb + i].bsums + 2 * q, 4);
                else x = pb[((int64_t)r * nsb + i) * 4 + q];
                part[r] = _mm512_dpwssd_epi32(part[r], mv, _mm512_set1_epi32(x));
            }
        }
        const __m512 d = _mm512_load_ps((const float *)(Q + 64 * pairs));
        const __m512 dmin = _mm512_load_ps((const float *)(Q + 64 * pairs) + KG_LANES);
        for (int r = 0; r < R; ++r) {
            const __m512 ad = _mm512_set1_ps(a[(int64_t)r * nsb + i].d);
            if (q6) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(tot[r], part[r])), _mm512_mul_ps(ad, d), acc[r]);
            } else {
                const __m512 t = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(part[r]), dmin, _mm512_mul_ps(_mm512_cvtepi32_ps(tot[r]), d));
                acc[r] = _mm512_fmadd_ps(t, ad, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + KG_LANES * r, acc[r]);
}

/* the rows a K-quant panel's tile takes (KG_ROWS, else 4, 2, 1 of the rows left), each count its
 * own inlined tile; kind 0: Q4_K/Q5_K's panel (pack_panel_k), 1: Q6_K's */
static int tiles_k(const uint8_t *panel, const kq_act_t *a, const int32_t *pb, int nsb, int rows, int kind,
                   float *out) {
#define KG_AT(R)                                                                 \
    if (rows >= (R)) {                                                           \
        if (kind) tile_k(panel, a, pb, nsb, (R), 1, out);                        \
        else tile_k(panel, a, pb, nsb, (R), 0, out);                             \
        return (R);                                                              \
    }
    KG_AT(KG_ROWS)
    KG_AT(4)
    KG_AT(2)
    KG_AT(1)
#undef KG_AT
    return 0;
}

#endif

/* the rows taken (KG_ROWS, else 4, 2, 1 of the rows left), each count its own inlined tile */
static int tiles(const uint8_t *panel, const kq_act_t *a, const float *fb, int nsb, int rows, int S, int q8,
                 float *out) {
#define KG_AT(R)                                                                 \
    if (rows >= (R)) {                                                           \
        if (S == 16) tile(panel, a, fb, nsb, (R), 16, 0, out);                   \
        else if (q8 && KQ_ISA == 256) tile(panel, a, fb, nsb, (R), 32, 1, out);  \
        else tile(panel, a, fb, nsb, (R), 32, 0, out);                           \
        return (R);                                                              \
    }
    KG_AT(KG_ROWS)
#if KG_ROWS > 4
    KG_AT(4)
#endif
    KG_AT(2)
    KG_AT(1)
#undef KG_AT
    return 0;
}
#endif

void kq_min_pairs(const kq_act_t *A, int64_t blocks, int32_t *pb) {
    for (int64_t b = 0; b < blocks; ++b)
        for (int q = 0; q < 4; ++q) {
            const int16_t p[2] = {(int16_t)(A[b].bsums[4 * q] + A[b].bsums[4 * q + 1]),
                                  (int16_t)(A[b].bsums[4 * q + 2] + A[b].bsums[4 * q + 3])};
            memcpy(&pb[b * 4 + q], p, 4);
        }
}

/* y[m][n] = dot(weight row n, activation row m) (+ bias[n]), as kq_matmul (the same arguments but
 * isa), for k a multiple of 256 and a type kq_gemm_types(0) has. 0 on success, 1 for a type or
 * width it does not take, 2 when memory could not be had. */
int kq_gemm(const void *w, int64_t row_bytes, int type, int n_out, int k, const void *act, int rows,
            const void *bias, void *y, int64_t y_stride, int dtype, int num_threads) {
    if (KQ_IS_X16(type)) return kq_gemm_x16((const uint8_t *)w, row_bytes, type, n_out, k, act, rows, bias, y, y_stride,
                                            dtype, num_threads);
    if (type < GGML_Q4_0 || type > GGML_Q6_K || !(KG_TYPES & KG_BIT(type)) || k <= 0 || k % KQ_BLOCK || rows < 0 ||
        n_out < 0)
        return 1;
#if KQ_ISA == 0
    (void)w, (void)row_bytes, (void)act, (void)bias, (void)y, (void)y_stride, (void)dtype, (void)num_threads;
    return 1;
#else
    const int nsb = k / KQ_BLOCK, S = sub_values(type), subs = KQ_BLOCK / S, elem = elem_size(dtype);
    const int alike = (KG_ALIKE & KG_BIT(type)) != 0, q6 = type == GGML_Q6_K;
    const kq_act_t *A = (const kq_act_t *)act;
    /* the activations' block sums: as floats (float panels), or Q4_K/Q5_K's int16 pairs (alike) */
    float *fb = malloc(sizeof(float) * ((size_t)rows * (size_t)nsb * (size_t)subs + 1));
    if (fb == NULL) return 2;
    int32_t *pb = (int32_t *)fb;
    if (alike && !q6) kq_min_pairs(A, (int64_t)rows * nsb, pb);
    for (int64_t b = 0; b < (int64_t)rows * nsb && !alike; ++b) {
        for (int s = 0; s < subs; ++s)
            fb[b * subs + s] = S == 16 ? (float)A[b].bsums[s] : (float)(A[b].bsums[2 * s] + A[b].bsums[2 * s + 1]);
    }
    const int panels = (n_out + KG_LANES - 1) / KG_LANES;
#if KQ_ISA == 512
    const size_t panel_bytes = (size_t)nsb * (size_t)(alike ? k_super_bytes(q6) : super_bytes(S));
#else
    const size_t panel_bytes = (size_t)nsb * (size_t)super_bytes(S);
#endif
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        uint8_t *panel = aligned_alloc(64, (panel_bytes + 63) & ~(size_t)63);
        failed = panel == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int p = 0; p < panels; ++p) {
            if (panel == NULL) continue;
            const int n0 = p * KG_LANES, lanes = n_out - n0 < KG_LANES ? n_out - n0 : KG_LANES;
#if KQ_ISA == 512
            if (alike) pack_panel_k((const uint8_t *)w, row_bytes, type, n0, n_out, nsb, panel);
            else
#endif
                pack_panel((const uint8_t *)w, row_bytes, type, n0, n_out, nsb, panel);
            float b[KG_LANES] = {0};
            if (bias != NULL) to_float((const char *)bias + (int64_t)n0 * elem, dtype, b, lanes);
            for (int m = 0; m < rows;) {
                float out[KG_ROWS * KG_LANES];
                int done;
#if KQ_ISA == 512
                if (alike) done = tiles_k(panel, A + (int64_t)m * nsb, pb + (int64_t)m * nsb * 4, nsb, rows - m, q6, out);
                else
#endif
                    done = tiles(panel, A + (int64_t)m * nsb, fb + (int64_t)m * nsb * subs, nsb, rows - m, S,
                                 type == GGML_Q8_0, out);
                for (int r = 0; r < done; ++r) {
                    for (int l = 0; l < lanes; ++l) out[KG_LANES * r + l] += b[l];
                    from_float(out + KG_LANES * r, 1.f, dtype, (char *)y + ((int64_t)(m + r) * y_stride + n0) * elem, lanes);
                }
                m += done;
            }
        }
        free(panel);
    }
    free(fb);
    return failed ? 2 : 0;
#endif
}
