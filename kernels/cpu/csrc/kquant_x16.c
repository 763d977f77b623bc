/* The K-quants repacked at load (kquant.h KQ_Q4_K_X16, KQ_Q6_K_X16; AVX512-VNNI builds only;
 * docs/design/gguf_kquants.md "Repack"): the repack itself from csrc/kquant_gemm.c's stored-panel
 * layout (pack_panel_k), the tiles that read the repacked panels as they are, a panel's rows by
 * blocks of activation rows superblock by superblock (each superblock read from memory once, the one
 * KG_X16_AHEAD on prefetched), and the product every path takes (kq_gemm_x16: kq_gemm's,
 * kq_matmul's and, by ranges of rows, the fused decode step's kq_linear_team). The rows are the block
 * dots' bits (the canonical order of csrc/kquant_avx512.c). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kquant.h"

#if KQ_ISA == 512
#include <immintrin.h>
#define KG_LANES KQ_X16_LANES /* weight rows a panel: one int32 lane each */
#define KG_ROWS 8             /* activation rows a tile */
#include "kquant_panel.h"
#define KG_TILE_FN static inline __attribute__((always_inline)) void

/* as tile_k for Q4_K, on a repacked panel (kquant.h KQ_Q4_K_X16), one superblock P of it for R rows:
 * each 64-byte vector's low and high nibbles are two runs, masked and shifted in registers; the
 * scales, minimum pairs and d, dmin widened from bytes and float16 as loaded; the same integers and
 * float steps into acc[r], so the same bits. a, pb: the rows' superblock i (rows nsb apart) */
KG_TILE_FN super_x16(const uint8_t *P, const kq_act_t *a, const int32_t *pb, int nsb, const int R, __m512 *acc) {
    const __m512i low = _mm512_set1_epi8(15);
    __m512i tot[KG_ROWS], part[KG_ROWS];
    for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s) {
        for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
            const __m512i q = _mm512_loadu_si512(P + 256 * s + 64 * c);
            const __m512i lo = _mm512_and_si512(q, low), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
            for (int r = 0; r < R; ++r) {
                const int8_t *x = a[(int64_t)r * nsb].qs + 32 * s + 4 * c;
                part[r] = dpbusd_bcast(part[r], lo, x);
                part[r] = dpbusd_bcast(part[r], hi, x + 16);
            }
        }
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(P + 2048 + 16 * s)));
        for (int r = 0; r < R; ++r) tot[r] = _mm512_add_epi32(tot[r], _mm512_mullo_epi32(part[r], sc));
    }
    for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_si512();
    for (int q = 0; q < 4; ++q) {
        const __m512i mv = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(P + 2176 + 32 * q)));
        for (int r = 0; r < R; ++r)
            part[r] = _mm512_dpwssd_epi32(part[r], mv, _mm512_set1_epi32(pb[(int64_t)r * nsb * 4 + q]));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(P + 2304)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(P + 2336)));
    for (int r = 0; r < R; ++r) {
        const __m512 ad = _mm512_set1_ps(a[(int64_t)r * nsb].d);
        const __m512 t = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(part[r]), dmin, _mm512_mul_ps(_mm512_cvtepi32_ps(tot[r]), d));
        acc[r] = _mm512_fmadd_ps(t, ad, acc[r]);
    }
}

/* a KQ_Q6_K_X16 superblock's values as tile_k's Q6_K runs (value 16 s + 4 c + b of row l at byte
 * 64 (4 s + c) + 4 l + b, 0..63): each 64-byte vector two runs' low bits by a mask or a shift, the
 * high bits of four runs shifted into bits 4-5 (16-bit shifts: what crosses into a byte is masked) */
static inline __attribute__((always_inline)) void unpack_q6x16(const uint8_t *P, uint8_t *runs) {
    const __m512i low = _mm512_set1_epi8(15), high = _mm512_set1_epi8(0x30);
    for (int u = 0; u < 4; ++u)
        for (int c = 0; c < 4; ++c) {
            const __m512i h = _mm512_loadu_si512(P + 2048 + 256 * u + 64 * c);
            const __m512i hj[4] = {_mm512_slli_epi16(h, 4), _mm512_slli_epi16(h, 2), h, _mm512_srli_epi16(h, 2)};
            for (int t = 2 * u; t < 2 * u + 2; ++t) {
                const __m512i n = _mm512_loadu_si512(P + 256 * t + 64 * c);
                const int j = 2 * (t - 2 * u); /* sub-block 2t is run j of the quad, 2t + 1 run j + 1 */
                _mm512_store_si512(runs + 64 * (4 * (2 * t) + c),
                                   _mm512_or_si512(_mm512_and_si512(n, low), _mm512_and_si512(hj[j], high)));
                _mm512_store_si512(runs + 64 * (4 * (2 * t + 1) + c),
                                   _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n, 4), low),
                                                   _mm512_and_si512(hj[j + 1], high)));
            }
        }
}

/* as tile_k for Q6_K, one superblock P of a KQ_Q6_K_X16 panel (its runs unpacked, unpack_q6x16) for R
 * rows: the same integers (each sub-block's sum times its scale; 32 x the scale pairs by the block
 * sums) and float steps into acc[r], so the same bits. a: the rows' superblock i (rows nsb apart) */
KG_TILE_FN super_q6x16(const uint8_t *runs, const uint8_t *P, const kq_act_t *a, int nsb, const int R, __m512 *acc) {
    __m512i tot[KG_ROWS], part[KG_ROWS];
    for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_si512();
    for (int s = 0; s < 16; ++s) {
        for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
            const __m512i wv = _mm512_load_si512(runs + 64 * (4 * s + c));
            for (int r = 0; r < R; ++r) part[r] = dpbusd_bcast(part[r], wv, a[(int64_t)r * nsb].qs + 16 * s + 4 * c);
        }
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(P + 3072 + 16 * s)));
        for (int r = 0; r < R; ++r) tot[r] = _mm512_add_epi32(tot[r], _mm512_mullo_epi32(part[r], sc));
    }
    for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_si512();
    for (int q = 0; q < 8; ++q) {
        const __m512i mv = _mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(P + 3328 + 32 * q))), 5);
        for (int r = 0; r < R; ++r) {
            int32_t x;
            memcpy(&x, a[(int64_t)r * nsb].bsums + 2 * q, 4);
            part[r] = _mm512_dpwssd_epi32(part[r], mv, _mm512_set1_epi32(x));
        }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(P + 3584)));
    for (int r = 0; r < R; ++r) {
        const __m512 ad = _mm512_set1_ps(a[(int64_t)r * nsb].d);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(tot[r], part[r])), _mm512_mul_ps(ad, d), acc[r]);
    }
}

/* rows (at most KG_X16_BLOCK) of activations by a repacked panel (q6: KQ_Q6_K_X16, else
 * KQ_Q4_K_X16), superblock by superblock: each of the panel's superblocks read once (from memory,
 * the first time; a Q6_K one's runs rebuilt once) for all the rows, in tiles of KG_ROWS, else 4, 2,
 * 1 (each count its own inlined tile); a row's steps are tile_k's, in order */
#define KG_X16_BLOCK 32
#define KG_X16_AHEAD 4
static void block_x16(const uint8_t *panel, const kq_act_t *a, const int32_t *pb, int nsb, int rows, int q6,
                      float *out) {
    const int64_t super = q6 ? KQ_Q6X16_SUPER : KQ_X16_SUPER;
    uint8_t runs[KQ_X16_LANES * KQ_BLOCK] __attribute__((aligned(64)));
    __m512 acc[KG_X16_BLOCK];
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int i = 0; i < nsb; ++i) {
        const uint8_t *P = panel + (int64_t)i * super;
        for (int line = 0; line < super; line += 64) /* the superblock KG_X16_AHEAD on, every line */
            _mm_prefetch((const char *)(P + KG_X16_AHEAD * super + line), _MM_HINT_T1);
        if (q6) unpack_q6x16(P, runs);
        for (int m = 0; m < rows;) {
            const kq_act_t *am = a + (int64_t)m * nsb + i;
            const int32_t *pm = q6 ? NULL : pb + ((int64_t)m * nsb + i) * 4;
            const int left = rows - m, R = left >= KG_ROWS ? KG_ROWS : left >= 4 ? 4 : left >= 2 ? 2 : 1;
#define KG_SUPER(R) (q6 ? super_q6x16(runs, P, am, nsb, (R), acc + m) : super_x16(P, am, pm, nsb, (R), acc + m))
            if (R == KG_ROWS) KG_SUPER(KG_ROWS);
            else if (R == 4) KG_SUPER(4);
            else if (R == 2) KG_SUPER(2);
            else KG_SUPER(1);
#undef KG_SUPER
            m += R;
        }
    }
    for (int r = 0; r < rows; ++r) _mm512_storeu_ps(out + KG_LANES * r, acc[r]);
}

/* panel p's superblocks as pack_panel_k laid them out (Q4_K: sub-blocks of 8 runs and int32 scales,
 * minimum pairs as int16, d and dmin as floats) into the repacked layout */
static void x16_from_k(const uint8_t *K, uint8_t *X) {
    const int64_t sub = 32 * KG_LANES + 4 * KG_LANES;
    for (int s = 0; s < 8; ++s) {
        const uint8_t *B = K + s * sub;
        for (int c = 0; c < 4; ++c) {
            const __m512i lo = _mm512_load_si512(B + 64 * c), hi = _mm512_load_si512(B + 64 * (c + 4));
            _mm512_storeu_si512(X + 256 * s + 64 * c, _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)));
        }
        _mm_storeu_si128((__m128i *)(X + 2048 + 16 * s), _mm512_cvtepi32_epi8(_mm512_load_si512(B + 32 * KG_LANES)));
    }
    const uint8_t *Q = K + 8 * sub;
    for (int q = 0; q < 4; ++q)
        _mm256_storeu_si256((__m256i *)(X + 2176 + 32 * q), _mm512_cvtepi16_epi8(_mm512_load_si512(Q + 64 * q)));
    const float *f = (const float *)(Q + 4 * 64);
    _mm256_storeu_si256((__m256i *)(X + 2304), _mm512_cvtps_ph(_mm512_loadu_ps(f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm256_storeu_si256((__m256i *)(X + 2336), _mm512_cvtps_ph(_mm512_loadu_ps(f + KG_LANES), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* panel p's superblock as pack_panel_k laid it out for Q6_K (sub-blocks of 4 runs and int32 scales,
 * the pairs 32 sc as int16, d and dmin as floats) into the KQ_Q6_K_X16 layout */
static void q6x16_from_k(const uint8_t *K, uint8_t *X) {
    const int64_t sub = 16 * KG_LANES + 4 * KG_LANES;
    const __m512i low = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
    for (int c = 0; c < 4; ++c) {
        for (int t = 0; t < 8; ++t) {
            const __m512i v0 = _mm512_load_si512(K + 2 * t * sub + 64 * c), v1 = _mm512_load_si512(K + (2 * t + 1) * sub + 64 * c);
            _mm512_storeu_si512(X + 256 * t + 64 * c, _mm512_or_si512(_mm512_and_si512(v0, low),
                                                                     _mm512_slli_epi16(_mm512_and_si512(v1, low), 4)));
        }
        for (int u = 0; u < 4; ++u) {
            __m512i h = _mm512_setzero_si512();
            for (int j = 0; j < 4; ++j) {
                const __m512i hb = _mm512_and_si512(_mm512_srli_epi16(_mm512_load_si512(K + (4 * u + j) * sub + 64 * c), 4), three);
                h = _mm512_or_si512(h, _mm512_slli_epi16(hb, 2 * j));
            }
            _mm512_storeu_si512(X + 2048 + 256 * u + 64 * c, h);
        }
    }
    for (int s = 0; s < 16; ++s)
        _mm_storeu_si128((__m128i *)(X + 3072 + 16 * s), _mm512_cvtepi32_epi8(_mm512_load_si512(K + s * sub + 16 * KG_LANES)));
    const uint8_t *Q = K + 16 * sub;
    for (int q = 0; q < 8; ++q)
        _mm256_storeu_si256((__m256i *)(X + 3328 + 32 * q), _mm512_cvtepi16_epi8(_mm512_srai_epi16(_mm512_load_si512(Q + 64 * q), 5)));
    const float *f = (const float *)(Q + 8 * 64);
    _mm256_storeu_si256((__m256i *)(X + 3584), _mm512_cvtps_ph(_mm512_loadu_ps(f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

void kq_x16_range(const uint8_t *w, int64_t panel_bytes, int type, int lo, int hi, int nsb, const kq_act_t *A,
                  const int32_t *pb, int rows, const void *bias, void *y, int64_t y_stride, int col0, int dtype) {
#if KQ_ISA == 512
    const int elem = elem_size(dtype);
    for (int p = lo / KG_LANES; p * KG_LANES < hi; ++p) {
        const int n0 = p * KG_LANES, a0 = lo > n0 ? lo : n0, a1 = hi < n0 + KG_LANES ? hi : n0 + KG_LANES;
        float b[KG_LANES] = {0};
        if (bias != NULL) to_float((const char *)bias + (int64_t)(col0 + a0) * elem, dtype, b + (a0 - n0), a1 - a0);
        for (int m = 0; m < rows;) {
            float out[KG_X16_BLOCK * KG_LANES];
            const int done = rows - m < KG_X16_BLOCK ? rows - m : KG_X16_BLOCK, q6 = type == KQ_Q6_K_X16;
            block_x16(w + (int64_t)p * panel_bytes, A + (int64_t)m * nsb, q6 ? NULL : pb + (int64_t)m * nsb * 4, nsb,
                      done, q6, out);
            for (int r = 0; r < done; ++r) {
                float *o = out + KG_LANES * r;
                for (int l = a0 - n0; l < a1 - n0; ++l) o[l] += b[l];
                from_float(o + (a0 - n0), 1.f, dtype, (char *)y + ((int64_t)(m + r) * y_stride + col0 + a0) * elem, a1 - a0);
            }
            m += done;
        }
    }
#else
    (void)w, (void)panel_bytes, (void)type, (void)lo, (void)hi, (void)nsb, (void)A, (void)pb, (void)rows, (void)bias;
    (void)y, (void)y_stride, (void)col0, (void)dtype;
#endif
}

/* out = the Q4_K or Q6_K weight (n_out rows, row_bytes apart, k values a row) repacked (kquant.h
 * KQ_Q4_K_X16, KQ_Q6_K_X16), n_out / 16 panels of k / 256 superblocks of KQ_X16_SUPER or
 * KQ_Q6X16_SUPER bytes. 0 on success, 1 for a type, shape or build it does not take (AVX512-VNNI
 * only; n_out a multiple of 16, k of 256), 2 when memory could not be had. */
int kq_repack_x16(const void *w, int64_t row_bytes, int type, int n_out, int k, void *out, int num_threads) {
#if KQ_ISA == 512
    if ((type != GGML_Q4_K && type != GGML_Q6_K) || n_out <= 0 || n_out % KG_LANES || k <= 0 || k % KQ_BLOCK) return 1;
    const int nsb = k / KQ_BLOCK, panels = n_out / KG_LANES, q6 = type == GGML_Q6_K;
    const int64_t super = q6 ? KQ_Q6X16_SUPER : KQ_X16_SUPER, panel_bytes = (int64_t)nsb * super;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        uint8_t *buf = aligned_alloc(64, (size_t)nsb * (size_t)k_super_bytes(q6));
        failed = buf == NULL;
#pragma omp for schedule(static)
        for (int p = 0; p < panels; ++p) {
            if (buf == NULL) continue;
            pack_panel_k((const uint8_t *)w, row_bytes, type, p * KG_LANES, n_out, nsb, buf);
            for (int i = 0; i < nsb; ++i) {
                uint8_t *X = (uint8_t *)out + p * panel_bytes + (int64_t)i * super;
                if (q6) q6x16_from_k(buf + (int64_t)i * k_super_bytes(1), X);
                else x16_from_k(buf + (int64_t)i * k_super_bytes(0), X);
            }
        }
        free(buf);
    }
    return failed ? 2 : 0;
#else
    (void)w, (void)row_bytes, (void)type, (void)n_out, (void)k, (void)out, (void)num_threads;
    return 1;
#endif
}

void kq_x16_dequantize_row(const uint8_t *w, int64_t panel_bytes, int type, int64_t r, int k, float *out) {
    const int l = (int)(r % KQ_X16_LANES);
    const uint8_t *panel = w + (r / KQ_X16_LANES) * panel_bytes;
    for (int i = 0; i < k / KQ_BLOCK && type == KQ_Q6_K_X16; ++i) {
        const uint8_t *P = panel + (int64_t)i * KQ_Q6X16_SUPER;
        const float d = kq_half(P + 3584 + 2 * l);
        for (int s = 0; s < 16; ++s) {
            const int sc = (int8_t)P[3072 + 16 * s + l];
            for (int j = 0; j < 16; ++j) {
                const int at = 64 * (j / 4) + 4 * l + j % 4;
                const int lo = (P[256 * (s / 2) + at] >> (4 * (s % 2))) & 15;
                const int q = lo | ((P[2048 + 256 * (s / 4) + at] >> (2 * (s % 4))) & 3) << 4;
                out[KQ_BLOCK * i + 16 * s + j] = d * (float)sc * (float)(q - 32);
            }
        }
    }
    for (int i = 0; i < k / KQ_BLOCK && type == KQ_Q4_K_X16; ++i) {
        const uint8_t *P = panel + (int64_t)i * KQ_X16_SUPER;
        const float d = kq_half(P + 2304 + 2 * l), dmin = kq_half(P + 2336 + 2 * l);
        for (int s = 0; s < 8; ++s) {
            const int sc = P[2048 + 16 * s + l], m = P[2176 + 32 * (s / 2) + 2 * l + s % 2];
            for (int j = 0; j < 32; ++j) {
                const uint8_t byte = P[256 * s + 64 * (j % 16 / 4) + 4 * l + j % 4];
                const int q = j < 16 ? byte & 15 : byte >> 4;
                out[KQ_BLOCK * i + 32 * s + j] = d * (float)sc * (float)q - dmin * (float)m;
            }
        }
    }
}

/* kq_gemm of an X16 weight (row_bytes: a panel's bytes), at any row count: the panels as stored */
int kq_gemm_x16(const uint8_t *w, int64_t panel_bytes, int type, int n_out, int k, const void *act, int rows,
                const void *bias, void *y, int64_t y_stride, int dtype, int num_threads) {
    if (KQ_ISA != 512 || k <= 0 || k % KQ_BLOCK || rows < 0 || n_out < 0 || n_out % KQ_X16_LANES) return 1;
    const int nsb = k / KQ_BLOCK, panels = n_out / KQ_X16_LANES;
    const kq_act_t *A = (const kq_act_t *)act;
    int32_t *pb = NULL; /* Q4_K's minimum pairs (Q6_K's tile reads the block sums) */
    if (type == KQ_Q4_K_X16) {
        pb = malloc(sizeof(int32_t) * 4 * ((size_t)rows * (size_t)nsb + 1));
        if (pb == NULL) return 2;
        kq_min_pairs(A, (int64_t)rows * nsb, pb);
    }
    const int threads = (int64_t)n_out * k * (rows > 0 ? rows : 1) >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
    /* runs of panels a thread (4 a thread, each taken when the last is done): the panel after the
     * one being multiplied is most often the same thread's, so block_x16's prefetch is its own */
    const int run = panels / (4 * threads) > 1 ? panels / (4 * threads) : 1;
#pragma omp parallel for schedule(dynamic, run) num_threads(threads)
    for (int p = 0; p < panels; ++p)
        kq_x16_range(w, panel_bytes, type, p * KQ_X16_LANES, (p + 1) * KQ_X16_LANES, nsb, A, pb, rows, bias, y,
                     y_stride, 0, dtype);
    free(pb);
    return 0;
}
