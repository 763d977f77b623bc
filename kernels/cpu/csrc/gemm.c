/* bfloat16 GEMM for the CPU's projections of more than a few rows: y[m][n] = x[m] . w[n] + b[n],
 * x and y bfloat16, products summed in float, over a copy of w packed once.
 *
 * The packed copy (gemm_bf16_pack) keeps w's values in blocks of 16 output features: for each
 * pair of inputs (k, k + 1), the 16 features' two weights side by side, 64 bytes, one vector. A
 * tile of GEMM_MR rows of x and GEMM_NR such blocks (48 outputs) then runs down k one pair at a
 * time: GEMM_NR vector loads of weights, each row's pair of x broadcast, GEMM_MR x GEMM_NR
 * vdpbf16ps into accumulators that stay in registers (24 of the 32), each accumulator lane one
 * output, so nothing is summed across lanes at the end. Each row's sum runs over k in the same
 * order whatever rows are beside it: a row's result does not depend on the batch it is in.
 *
 * A panel of weights (GEMM_NR blocks x k) is read from memory once per GEMM_MC rows of x and
 * serves every tile of them from the cache; the threads share the panels (static schedule).
 * Faster than oneDNN's packed bfloat16 GEMM up to ~128 rows and as fast beyond (without AMX;
 * figures by instruction set in docs/performance/step_profile.md).
 *
 * A gate|up projection can give silu(gate) * up instead of its product (glu, panels_team): a
 * thread computes a tile of the gate panel and the same features' up tile, and the activation
 * comes out of the cache, the product never stored (the separate pass over it read 2x and wrote
 * 1x the activation's bytes). Same bits as the separate silu_and_mul.
 *
 * Built for three instruction sets, each in a file of its own, each output's sum over k in one
 * order whatever rows are beside it: AVX512-BF16 (vdpbf16ps on bfloat16 x, gemm_avx512.h), AVX-512 F
 * without BF16 (Ice Lake, Cascade Lake: each pair widened to floats in zmm registers, float FMAs
 * against x widened once per thread and GEMM_MC rows, gemm_avx512.h) and AVX2 with FMA (the same in
 * 256-bit halves, gemm_avx2.h; the last two give the same bits). Elsewhere every entry point
 * answers 1 (not taken) and the caller keeps oneDNN or torch.
 */
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

#if HAVE_AVX512_TEAM
#define GEMM_BUILT 1
#define GEMM_AVX512 1 /* gemm_avx512.h: vdpbf16ps with AVX512-BF16, else floats in zmm registers */
#define GEMM_QUANTIZED 1 /* int8/int4 panels: dequantize.c and the 16-lane transposes */
#elif defined(__AVX2__) && defined(__FMA__)
#define GEMM_BUILT 1
#define GEMM_AVX512 0 /* gemm_avx2.h */
#define GEMM_QUANTIZED 1 /* int8/int4 panels: dequantize.c's plain C, transposed in plain C */
#else
#define GEMM_BUILT 0
#define GEMM_AVX512 0
#define GEMM_QUANTIZED 0
#endif

#if GEMM_BUILT
#include <immintrin.h>

#if GEMM_AVX512
#include "gemm_avx512.h"
#else
#define GEMM_X_FLOATS 1
#include "gemm_avx2.h"
#endif

#if GEMM_X_FLOATS
/* A thread's scratch (OpenMP keeps its threads): x's rows of the current GEMM_MC chunk as floats,
 * k apart, widened once per thread and chunk, not once per panel (each thread runs its panels
 * over all of the chunk's rows: no barrier, the threads keep a copy each). */
static __thread float *rows_scratch;
static __thread size_t rows_scratch_floats;

static const float *rows_as_floats(const uint16_t *x, int64_t x_stride, int rows, int k) {
    const size_t need = (size_t)rows * (size_t)k;
    if (need > rows_scratch_floats) {
        free(rows_scratch);
        rows_scratch = aligned_alloc(64, (sizeof(float) * need + 63) & ~(size_t)63);
        rows_scratch_floats = rows_scratch != NULL ? need : 0;
        if (rows_scratch == NULL) abort(); /* GEMM_MC rows: a few MiB per thread at most */
    }
    for (int m = 0; m < rows; ++m) to_float(x + m * x_stride, DTYPE_BF16, rows_scratch + (int64_t)m * k, k);
    return rows_scratch;
}
#endif

int gemm_bf16_pack(const void *w, int64_t w_stride, int n, int k, void *packed, int num_threads) {
    if (n % GEMM_VEC != 0 || k % 2 != 0 || w_stride % 2 != 0 || n <= 0 || k <= 0) return 1;
    const uint32_t *src = (const uint32_t *)w; /* pairs of bfloat16 */
    uint32_t *dst = (uint32_t *)packed;
    const int pairs = k / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int blk = 0; blk < n / GEMM_VEC; ++blk)
        for (int p = 0; p < pairs; ++p)
            for (int c = 0; c < GEMM_VEC; ++c)
                dst[((int64_t)blk * pairs + p) * GEMM_VEC + c] = src[((int64_t)blk * GEMM_VEC + c) * (w_stride / 2) + p];
    return 0;
}

#if GEMM_QUANTIZED
/* A thread's panel of a quantized weight in the packed layout (GEMM_NR blocks) and a block's rows
 * dequantized, kept as long as the thread (OpenMP keeps its threads): a fresh one per call would be
 * mapped and faulted in again at every projection. */
static __thread uint16_t *quantized_panel;
static __thread size_t quantized_panel_bytes;

/* r[i] lane c -> r[c] lane i for 16 vectors of 16 32-bit lanes: 4x4 transposes inside each
 * 128-bit lane (unpack), then of the 128-bit lanes across each four vectors (shuffle_i32x4) */
#if GEMM_AVX512
static inline void transpose16(__m512i r[16]) {
    __m512i u[16];
    for (int q = 0; q < 16; q += 4) { /* u[q + j] lane k: element 4k + j of rows q..q+3 */
        const __m512i t0 = _mm512_unpacklo_epi32(r[q], r[q + 1]), t1 = _mm512_unpackhi_epi32(r[q], r[q + 1]);
        const __m512i t2 = _mm512_unpacklo_epi32(r[q + 2], r[q + 3]), t3 = _mm512_unpackhi_epi32(r[q + 2], r[q + 3]);
        u[q] = _mm512_unpacklo_epi64(t0, t2), u[q + 1] = _mm512_unpackhi_epi64(t0, t2);
        u[q + 2] = _mm512_unpacklo_epi64(t1, t3), u[q + 3] = _mm512_unpackhi_epi64(t1, t3);
    }
    for (int j = 0; j < 4; ++j) { /* column 4k + j: lane k of u[j], u[4 + j], u[8 + j], u[12 + j] */
        const __m512i x0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), x1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
        const __m512i x2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        const __m512i x3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(x0, x2, 0x88), r[4 + j] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(x1, x3, 0x88), r[12 + j] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
    }
}
#endif

/* blocks b0 .. b0 + nr - 1 of L's int8 or int4 weight, dequantized to bfloat16 (dequantize_row,
 * a block's GEMM_VEC rows into rows) and laid out as gemm_bf16_pack lays out a bfloat16 weight
 * (a block's pairs of inputs as 16 x 16 transposes), at panel (blocks bstride apart) */
static void dequantize_panel(const lin_t *L, int b0, int nr, int64_t bstride, uint16_t *panel, uint16_t *rows) {
    const int k = L->k_in, pairs = k / 2;
    for (int j = 0; j < nr; ++j) {
        for (int c = 0; c < GEMM_VEC; ++c) dequantize_row(L, (b0 + j) * GEMM_VEC + c, DTYPE_BF16, rows + (int64_t)c * k);
        uint32_t *dst = (uint32_t *)(panel + j * bstride);
        const uint32_t *src = (const uint32_t *)rows; /* row c's pair p at src[c * pairs + p] */
        int p = 0;
#if GEMM_AVX512
        for (; p + GEMM_VEC <= pairs; p += GEMM_VEC) {
            __m512i r[GEMM_VEC];
            for (int c = 0; c < GEMM_VEC; ++c) r[c] = _mm512_loadu_si512(src + (int64_t)c * pairs + p);
            transpose16(r);
            for (int i = 0; i < GEMM_VEC; ++i) _mm512_storeu_si512(dst + (int64_t)(p + i) * GEMM_VEC, r[i]);
        }
#endif
        for (; p < pairs; ++p)
            for (int c = 0; c < GEMM_VEC; ++c) dst[(int64_t)p * GEMM_VEC + c] = src[(int64_t)c * pairs + p];
    }
}

#endif

/* The team's share of y = x w^T + bias over w's panels (an OpenMP for over them per GEMM_MC rows
 * of x, no barrier: the caller waits for the team before reading y): each panel read from packed (gemm_bf16_pack's copy), or, with L,
 * dequantized from L into the thread's scratch first (dequantize_panel). glu: w is gate|up, n / 2
 * rows each; a thread takes a gate panel with the up panel of the same features, runs each tile
 * of both into its cache and writes silu(gate) * up (elementwise.c's silu_mul_row over the
 * rounded halves, as silu_and_mul computes it from the stored product): y [m][n / 2], and the
 * gate|up product is never stored. scratch holds (glu ? 2 : 1) panels and a block's rows. */
static void panels_team(const uint16_t *x, int64_t x_stride, int m, const uint16_t *packed, const lin_t *L,
                        uint16_t *scratch, const uint16_t *bias, int n, int k, uint16_t *y, int glu) {
    const int64_t bstride = (int64_t)(k / 2) * 2 * GEMM_VEC; /* elements from one block to the next */
    const int out_n = glu ? n / 2 : n, blocks = out_n / GEMM_VEC, panels = (blocks + GEMM_NR - 1) / GEMM_NR;
    const int up_blocks = glu ? blocks : 0; /* the up panel's first block, from the gate panel's */
    for (int m0 = 0; m0 < m; m0 += GEMM_MC) {
        const int m1 = m - m0 < GEMM_MC ? m : m0 + GEMM_MC;
#if !GEMM_X_FLOATS
        const uint16_t *xs = x + (int64_t)m0 * x_stride; /* vdpbf16ps reads bfloat16 x as it is */
        const int64_t xs_stride = x_stride;
#else
        const float *xs = rows_as_floats(x + (int64_t)m0 * x_stride, x_stride, m1 - m0, k);
        const int64_t xs_stride = k;
#endif
#pragma omp for schedule(dynamic, 1) nowait
        for (int panel = 0; panel < panels; ++panel) {
            const int b0 = panel * GEMM_NR, nr = blocks - b0 < GEMM_NR ? blocks - b0 : GEMM_NR;
            const uint16_t *wp = scratch, *up = scratch + GEMM_NR * bstride;
#if GEMM_QUANTIZED
            if (L != NULL) {
                uint16_t *rows = scratch + (glu ? 2 : 1) * GEMM_NR * bstride;
                dequantize_panel(L, b0, nr, bstride, scratch, rows);
                if (glu) dequantize_panel(L, b0 + up_blocks, nr, bstride, scratch + GEMM_NR * bstride, rows);
            } else {
                wp = packed + (int64_t)b0 * bstride;
                up = packed + (int64_t)(b0 + up_blocks) * bstride;
            }
#else
            (void)L, (void)scratch;
            wp = packed + (int64_t)b0 * bstride, up = packed + (int64_t)(b0 + up_blocks) * bstride;
#endif
            const uint16_t *bp = bias == NULL ? NULL : bias + b0 * GEMM_VEC;
            const uint16_t *bu = bias == NULL ? NULL : bias + (b0 + up_blocks) * GEMM_VEC;
            for (int r = m0; r < m1; r += TILE_M) {
                const int rows = m1 - r < TILE_M ? m1 - r : TILE_M;
                uint16_t *yt = y + (int64_t)r * out_n + b0 * GEMM_VEC;
                if (!glu) {
                    tile_any(xs + (int64_t)(r - m0) * xs_stride, xs_stride, rows, wp, bstride, nr, k, bp, yt, out_n);
                    continue;
                }
                uint16_t g[TILE_M * GEMM_NR * GEMM_VEC], u[TILE_M * GEMM_NR * GEMM_VEC];
                const int w = GEMM_NR * GEMM_VEC;
                tile_any(xs + (int64_t)(r - m0) * xs_stride, xs_stride, rows, wp, bstride, nr, k, bp, g, w);
                tile_any(xs + (int64_t)(r - m0) * xs_stride, xs_stride, rows, up, bstride, nr, k, bu, u, w);
                if (nr == GEMM_NR) { /* the tile's rows are contiguous in g and u: one pass, then copied */
                    uint16_t o[TILE_M * GEMM_NR * GEMM_VEC];
                    silu_mul_row(g, u, o, rows * w, DTYPE_BF16);
                    for (int i = 0; i < rows; ++i)
                        __builtin_memcpy(yt + (int64_t)i * out_n, o + i * w, sizeof(uint16_t) * w);
                } else {
                    for (int i = 0; i < rows; ++i)
                        silu_mul_row(g + i * w, u + i * w, yt + (int64_t)i * out_n, nr * GEMM_VEC, DTYPE_BF16);
                }
            }
        }
    }
}

/* whether gemm.c takes a weight of n outputs by k inputs (glu: gate|up halves of whole blocks) */
static int gemm_shape(int n, int k, int glu) { return n % ((glu ? 2 : 1) * GEMM_VEC) == 0 && k % 2 == 0; }

void gemm_bf16_team(const void *xv, int64_t x_stride, int m, const void *packed, const void *biasv, int n, int k,
                    void *yv, int glu) {
    panels_team((const uint16_t *)xv, x_stride, m, (const uint16_t *)packed, NULL, NULL, (const uint16_t *)biasv,
                n, k, (uint16_t *)yv, glu);
}

int gemm_bf16(const void *xv, int64_t x_stride, int m, const void *packed, const void *biasv, int n, int k,
              void *yv, int glu, int num_threads) {
    if (!gemm_shape(n, k, glu) || m <= 0) return 1;
#pragma omp parallel num_threads(num_threads)
    gemm_bf16_team(xv, x_stride, m, packed, biasv, n, k, yv, glu);
    return 0;
}

#if GEMM_QUANTIZED
/* y = x L^T + bias for bfloat16 x (m rows, x_stride apart) and an int8 (bfloat16 scales) or int4
 * weight L, any m: each thread dequantizes a panel of the weight into its cache-sized buffer, in
 * gemm_bf16_pack's layout, and runs gemm_bf16's tiles over it, so the weight is read in its
 * quantized bytes once per GEMM_MC rows and no dequantized copy of it is ever written out. Each
 * row's sum runs as gemm_bf16 runs it over the dequantized weight: a row's result does not
 * depend on the batch. 0, 1 for a weight or shape it does not take, 2 when memory could not be
 * had. */
int gemm_bf16_quantized(const lin_t *L, const void *xv, int64_t x_stride, int m, void *yv, int glu,
                        int num_threads) {
    const int n = L->n_out, k = L->k_in;
    if (!dequantize_takes(L) || (L->kind == W_INT8 && L->scales == NULL) || !gemm_shape(n, k, glu) || m <= 0)
        return 1;
    const int64_t bstride = (int64_t)(k / 2) * 2 * GEMM_VEC;
    const size_t need = sizeof(uint16_t) * (size_t)((glu ? 2 : 1) * GEMM_NR * bstride + GEMM_VEC * k);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        if (need > quantized_panel_bytes) {
            free(quantized_panel);
            quantized_panel = aligned_alloc(64, (need + 63) & ~(size_t)63);
            quantized_panel_bytes = quantized_panel != NULL ? need : 0;
        }
        if (quantized_panel == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed)
            panels_team((const uint16_t *)xv, x_stride, m, NULL, L, quantized_panel, (const uint16_t *)L->bias, n, k,
                        (uint16_t *)yv, glu);
    }
    return failed ? 2 : 0;
}

#endif

int gemm_bf16_available(void) { return 1; }
#else

void gemm_bf16_team(const void *xv, int64_t x_stride, int m, const void *packed, const void *biasv, int n, int k,
                    void *yv, int glu) {
    (void)xv, (void)x_stride, (void)m, (void)packed, (void)biasv, (void)n, (void)k, (void)yv, (void)glu;
}

int gemm_bf16_pack(const void *w, int64_t w_stride, int n, int k, void *packed, int num_threads) {
    (void)w, (void)w_stride, (void)n, (void)k, (void)packed, (void)num_threads;
    return 1;
}

int gemm_bf16(const void *xv, int64_t x_stride, int m, const void *packed, const void *biasv, int n, int k,
              void *yv, int glu, int num_threads) {
    (void)xv, (void)x_stride, (void)m, (void)packed, (void)biasv, (void)n, (void)k, (void)yv, (void)glu;
    (void)num_threads;
    return 1;
}

int gemm_bf16_available(void) { return 0; }
#endif

int gemm_bf16_quantized_available(void) { return GEMM_QUANTIZED; }

#if !GEMM_QUANTIZED
int gemm_bf16_quantized(const lin_t *L, const void *xv, int64_t x_stride, int m, void *yv, int glu,
                        int num_threads) {
    (void)L, (void)xv, (void)x_stride, (void)m, (void)yv, (void)glu, (void)num_threads;
    return 1;
}
#endif
