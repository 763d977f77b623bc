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
 * in float. Widening each 16 weights to float takes three instructions per 16 products and
 * leaves the kernel compute-bound even with the weight in cache; this takes four per 64
 * (docs/serving/quantization.md has the figures).
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

#include "quant_dots.h"

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
         * core waiting on memory on one-row projections (docs/serving/quantization.md) */
        const char *block = w + (int64_t)b * NW * row_bytes;
        for (int64_t off = 0; off < NW * row_bytes; off += 64)
            if (block + PREFETCH_BYTES + off < end) _mm_prefetch(block + PREFETCH_BYTES + off, PREFETCH_HINT);
        dot(xf, xh, q, NX, block, row_bytes, groups + (int64_t)b * NW * group_bytes, group_bytes, NW, kind, k_in,
            acc);
        finish_block(L, b * NW, NX, NW, acc, dtype, y);
    }
#pragma omp for schedule(static) nowait
    for (int n = blocks * NW; n < L->n_out; ++n) {
        dot(xf, xh, q, NX, w + (int64_t)n * row_bytes, row_bytes, groups + (int64_t)n * group_bytes, group_bytes, 1,
            kind, k_in, acc);
        finish_block(L, n, NX, 1, acc, dtype, y);
    }
}

/* Weight rows at a time for NX rows of x, so that the accumulators stay within the 32 vector
 * registers: four up to four rows of x, two beyond; int4 keeps two sets (the integer sums of a
 * superblock and the float totals), so four up to 3 rows, two up to 6, one beyond. A row's result
 * does not depend on it (each output's sums run in the same order). */
#define ROWS_NW(NX, KIND) \
    ((KIND) == W_Q4 ? ((NX) <= 3 ? ROWS_AT_ONCE : (NX) <= 6 ? ROWS_AT_ONCE / 2 : 1) \
                    : ((NX) <= 4 ? ROWS_AT_ONCE : ROWS_AT_ONCE / 2))
#define ROWS_CASE(NX, KIND) \
    case NX: rows_team(L, NX, ROWS_NW(NX, KIND), xf, h, q, y, dtype, KIND); return;
#define ROWS_SWITCH(KIND) \
    switch (rows) { \
        ROWS_CASE(1, KIND) ROWS_CASE(2, KIND) ROWS_CASE(3, KIND) ROWS_CASE(4, KIND) \
        ROWS_CASE(5, KIND) ROWS_CASE(6, KIND) ROWS_CASE(7, KIND) ROWS_CASE(8, KIND) \
        default: return; \
    }

/* y = x w^T for rows (1..MAX_FUSED_ROWS) rows of x, by every thread of the enclosing team (each
 * call site is reached by all of them; no barrier at the end: y is whole once every thread has
 * returned, so the caller waits for the team before reading it). xf: x as floats, k_in apart; xh: x
 * itself when it is bfloat16 (the weight's pairs are then dotted as stored), else NULL. y: rows
 * of n_out elements. L must be one linear_takes takes. */
void linear_rows_team(const lin_t *L, int rows, const float *xf, const void *xh, void *y, int dtype) {
    const char *h = (const char *)xh;
    const q8_rows_t *q = NULL;
    if (!linear_takes(L)) { /* a caller's bug: below, int4 bytes would be read as floats */
        fprintf(stderr, "kvserve kernels: linear_rows_team called with a weight linear_takes refuses\n");
        abort();
    }
    if (L->kind == W_GGUF) {
        kq_linear_team(L, rows, xf, xh, y, dtype);
        return;
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

/* whether linear_rows_team computes L: int4 weights need AVX512-VNNI and widths a multiple of 64;
 * GGUF weights the block dots (kquant.c) */
int linear_takes(const lin_t *L) {
    return L->kind < W_INT4 || (L->kind == W_INT4 && HAVE_Q8 && int4_layout(L)) ||
           (L->kind == W_GGUF && kq_linear_takes(L));
}

#elif !HAVE_AVX2_ROWS /* (linear_avx2.c has them there) */
void linear_rows_team(const lin_t *L, int rows, const float *xf, const void *xh, void *y, int dtype) {
    (void)L, (void)rows, (void)xf, (void)xh, (void)y, (void)dtype;
}

int linear_takes(const lin_t *L) {
    (void)L;
    return 0;
}
#endif

/* y = x L^T for rows (1..MAX_FUSED_ROWS) contiguous rows of x, in a team of its own
 * (linear_rows_team is a team's part): x and y of dtype (DTYPE_*), L as cpu_kernels.py's
 * CpuKernels.linear_of makes it. 0 on success, 1 for a linear or row count it does not take
 * (no kernel built here for it), 2 when memory could not be had. */
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

#ifndef HAVE_Q8
#define HAVE_Q8 0
#endif
/* How int8 and int4 weights multiply x of width k_in in linear_rows_team: Q8_BLOCK (x quantized
 * per that many values, the integer path: AVX512-VNNI, or linear_avx2.c's on AVX2), or 0 (x as
 * floats; int4 not at all). Read by cpu_kernels.py. */
int quantized_activation_block(int k_in) {
    return (HAVE_Q8 || HAVE_AVX2_ROWS) && k_in % Q8_CHUNK == 0 ? Q8_BLOCK : 0;
}
