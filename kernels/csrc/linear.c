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
 * Built and loaded by kernels/cpu_kernels.py; linear_row returns 1 where it was not built for
 * AVX-512 (the caller then takes small_linear).
 */
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

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

/* y[m][n0 + j] (rows n_out apart) for dot_block's results: scaled (int8 weights), biased,
 * rounded once */
static inline void finish_block(const lin_t *L, int n0, int NX, int NW, const float *acc, int dtype, void *y) {
    const int elem = elem_size(dtype);
    for (int j = 0; j < NW; ++j) {
        float s = 1.f, b = 0.f;
        if (L->scales != NULL) to_float((const char *)L->scales + (int64_t)(n0 + j) * elem, dtype, &s, 1);
        if (L->bias != NULL) to_float((const char *)L->bias + (int64_t)(n0 + j) * elem, dtype, &b, 1);
        for (int m = 0; m < NX; ++m) {
            const float v = acc[m * NW + j] * s + b;
            from_float(&v, 1.f, dtype, (char *)y + ((int64_t)m * L->n_out + n0 + j) * elem, 1);
        }
    }
}

/* The team's share of y = x w^T for NX rows of x, NW rows of w at a time (then one at a time
 * for the last n_out % NW). */
static inline __attribute__((always_inline)) void rows_team(const lin_t *L, const int NX, const int NW,
                                                            const float *xf, const char *xh, void *y, int dtype,
                                                            const int kind) {
    const int blocks = L->n_out / NW, k_in = L->k_in;
    const int64_t row_bytes = L->row_bytes;
    const char *w = (const char *)L->w, *end = w + (int64_t)blocks * NW * row_bytes;
    float acc[MAX_FUSED_ROWS * ROWS_AT_ONCE / 2];
#pragma omp for schedule(static) nowait
    for (int b = 0; b < blocks; ++b) {
        /* the rows PREFETCH_BYTES ahead of this block: the hardware prefetcher alone leaves the
         * core waiting on memory (the model's one-row projections, two threads: 11.6 -> 9.0 ms in
         * bfloat16, 9.3 -> 5.5 ms in int8, 8 to 32 KiB ahead alike) */
        const char *block = w + (int64_t)b * NW * row_bytes;
        for (int64_t off = 0; off < NW * row_bytes; off += 64)
            if (block + PREFETCH_BYTES + off < end) _mm_prefetch(block + PREFETCH_BYTES + off, PREFETCH_HINT);
        dot_block(xf, xh, NX, block, row_bytes, NW, kind, k_in, acc);
        finish_block(L, b * NW, NX, NW, acc, dtype, y);
    }
#pragma omp for schedule(static)
    for (int n = blocks * NW; n < L->n_out; ++n) {
        dot_block(xf, xh, NX, w + (int64_t)n * row_bytes, row_bytes, 1, kind, k_in, acc);
        finish_block(L, n, NX, 1, acc, dtype, y);
    }
}

/* NX rows: four weight rows at a time up to four rows of x, two beyond (the accumulators stay
 * within the 32 vector registers) */
#define ROWS_CASE(NX, KIND) \
    case NX: rows_team(L, NX, (NX) <= 4 ? ROWS_AT_ONCE : ROWS_AT_ONCE / 2, xf, h, y, dtype, KIND); return;
#define ROWS_SWITCH(KIND) \
    switch (rows) { \
        ROWS_CASE(1, KIND) ROWS_CASE(2, KIND) ROWS_CASE(3, KIND) ROWS_CASE(4, KIND) \
        ROWS_CASE(5, KIND) ROWS_CASE(6, KIND) ROWS_CASE(7, KIND) ROWS_CASE(8, KIND) \
        default: return; \
    }

/* y = x w^T for rows (1..MAX_FUSED_ROWS) rows of x, by every thread of the enclosing team (each
 * call site is reached by all of them; ends with a barrier). xf: x as floats, k_in apart; xh: x
 * itself when it is bfloat16 (the weight's pairs are then dotted as stored), else NULL. y: rows
 * of n_out elements. */
void linear_rows_team(const lin_t *L, int rows, const float *xf, const void *xh, void *y, int dtype) {
    const char *h = (const char *)xh;
    if (L->kind == W_BF16) {
        ROWS_SWITCH(W_BF16)
    } else if (L->kind == W_INT8) {
        h = NULL;
        ROWS_SWITCH(W_INT8)
    } else {
        h = NULL;
        ROWS_SWITCH(W_F32)
    }
}

/* y = x L^T for one row of x, in a team of its own (linear_rows_team is a team's part, for
 * several rows): x and y of dtype (DTYPE_*), L as cpu_kernels.py's CpuKernels.linear_of makes
 * it. 0 on success, 2 when memory could not be had. */
int linear_row(const lin_t *L, const void *x, void *y, int dtype, int num_threads) {
    float *xf = malloc(sizeof(float) * (size_t)L->k_in);
    if (!xf) return 2;
    to_float(x, dtype, xf, L->k_in);
#pragma omp parallel num_threads(num_threads)
    linear_rows_team(L, 1, xf, dtype == DTYPE_BF16 ? x : NULL, y, dtype);
    free(xf);
    return 0;
}
#else
void linear_rows_team(const lin_t *L, int rows, const float *xf, const void *xh, void *y, int dtype) {
    (void)L, (void)rows, (void)xf, (void)xh, (void)y, (void)dtype;
}

int linear_row(const lin_t *L, const void *x, void *y, int dtype, int num_threads) {
    (void)L, (void)x, (void)y, (void)dtype, (void)num_threads;
    return 1;
}
#endif
