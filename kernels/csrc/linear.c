/* One-row linears on AVX-512: y[n] = scale[n] * (x . w[n]) + bias[n], a single stream's decode
 * step, whose cost is reading w once.
 *
 * Each thread takes a range of w's rows, four at a time: one load of x serves four rows, and the
 * four products are four independent accumulator chains (one chain per row waits on the FMA's
 * latency at every step). The weight is read once, in a single pass: bfloat16 pairs are dotted
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

enum { W_F32 = 0, W_BF16 = 1, W_INT8 = 2 }; /* the weight's element kind */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif
#ifndef ROWS_AT_ONCE
#define ROWS_AT_ONCE 4
#endif

/* 16 weights at p as floats; lanes outside m are 0 */
static inline __attribute__((always_inline)) __m512 load_w16(const char *p, const int kind, __mmask16 m) {
    if (kind == W_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
    if (kind == W_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
    return _mm512_maskz_loadu_ps(m, p);
}

/* out[j] = xf . w_j for the R rows w + j * row_bytes (R a compile-time constant). xf: k floats;
 * xh: the same x as bfloat16 (used by the bfloat16-pairs path, else NULL). */
static inline __attribute__((always_inline)) void dot_rows(
        const float *xf, const char *xh, const char *w, int64_t row_bytes, const int kind, const int R,
        int k_in, float *out) {
    const int welem = kind == W_BF16 ? 2 : (kind == W_INT8 ? 1 : 4);
    (void)xh; /* read only where AVX512-BF16 dots bfloat16 pairs */
    __m512 acc[ROWS_AT_ONCE];
    for (int j = 0; j < R; ++j) acc[j] = _mm512_setzero_ps();
    int k = 0;
#if defined(__AVX512BF16__)
    if (kind == W_BF16 && xh != NULL) {
        for (; k + 32 <= k_in; k += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xh + 2 * k);
            for (int j = 0; j < R; ++j)
                acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(w + j * row_bytes + 2 * k), xv);
        }
    }
#endif
    for (; k + 16 <= k_in; k += 16) {
        const __m512 xv = _mm512_loadu_ps(xf + k);
        for (int j = 0; j < R; ++j)
            acc[j] = _mm512_fmadd_ps(load_w16(w + j * row_bytes + (int64_t)k * welem, kind, 0xFFFF), xv, acc[j]);
    }
    if (k < k_in) {
        const __mmask16 m = (__mmask16)((1u << (k_in - k)) - 1u);
        const __m512 xv = _mm512_maskz_loadu_ps(m, xf + k);
        for (int j = 0; j < R; ++j)
            acc[j] = _mm512_fmadd_ps(load_w16(w + j * row_bytes + (int64_t)k * welem, kind, m), xv, acc[j]);
    }
    for (int j = 0; j < R; ++j) out[j] = _mm512_reduce_add_ps(acc[j]);
}

static inline __attribute__((always_inline)) void rows_of(
        const float *xf, const char *xh, const char *w, int64_t row_bytes, const int kind, int n_out, int k_in,
        float *yf, int num_threads) {
    const int blocks = n_out / ROWS_AT_ONCE;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static) nowait
        for (int b = 0; b < blocks; ++b) {
            /* the rows PREFETCH_BYTES ahead of this block: the hardware prefetcher alone leaves
             * the core waiting on memory (the model's one-row projections, two threads: 11.6 -> 9.0 ms in
             * bfloat16, 9.3 -> 5.5 ms in int8, 8 to 32 KiB ahead alike) */
            const char *block = w + (int64_t)b * ROWS_AT_ONCE * row_bytes;
            const char *end = w + (int64_t)blocks * ROWS_AT_ONCE * row_bytes;
            for (int64_t off = 0; off < ROWS_AT_ONCE * row_bytes; off += 64)
                if (block + PREFETCH_BYTES + off < end) _mm_prefetch(block + PREFETCH_BYTES + off, PREFETCH_HINT);
            dot_rows(xf, xh, w + (int64_t)b * ROWS_AT_ONCE * row_bytes, row_bytes, kind, ROWS_AT_ONCE, k_in,
                     yf + b * ROWS_AT_ONCE);
        }
#pragma omp for schedule(static)
        for (int n = blocks * ROWS_AT_ONCE; n < n_out; ++n)
            dot_rows(xf, xh, w + (int64_t)n * row_bytes, row_bytes, kind, 1, k_in, yf + n);
    }
}

/* y = x w^T (one row of x): x, y, bias (may be NULL) and scales (int8 weights only) of dtype
 * (DTYPE_*); w [n_out][k_in] of dtype, or int8 when w_int8 (rows w_stride elements apart).
 * 0 on success, 2 when memory could not be had. */
int linear_row(const void *x, const void *w, int64_t w_stride, int w_int8, const void *scales, const void *bias,
               void *y, int n_out, int k_in, int dtype, int num_threads) {
    const int elem = elem_size(dtype);
    const int kind = w_int8 ? W_INT8 : (dtype == DTYPE_BF16 ? W_BF16 : W_F32);
    const int64_t row_bytes = w_stride * (w_int8 ? 1 : elem);
    float *buf = malloc(sizeof(float) * ((size_t)k_in + (size_t)n_out));
    if (!buf) return 2;
    float *xf = buf, *yf = buf + k_in;
    to_float(x, dtype, xf, k_in);
    const char *xh = dtype == DTYPE_BF16 ? (const char *)x : NULL;
    if (kind == W_BF16)
        rows_of(xf, xh, (const char *)w, row_bytes, W_BF16, n_out, k_in, yf, num_threads);
    else if (kind == W_INT8)
        rows_of(xf, NULL, (const char *)w, row_bytes, W_INT8, n_out, k_in, yf, num_threads);
    else
        rows_of(xf, NULL, (const char *)w, row_bytes, W_F32, n_out, k_in, yf, num_threads);
    if (scales != NULL) {
        float s[16];
        for (int n0 = 0; n0 < n_out; n0 += 16) {
            const int len = n_out - n0 < 16 ? n_out - n0 : 16;
            to_float((const char *)scales + (int64_t)n0 * elem, dtype, s, len);
            for (int i = 0; i < len; ++i) yf[n0 + i] *= s[i];
        }
    }
    if (bias != NULL) {
        float b[16];
        for (int n0 = 0; n0 < n_out; n0 += 16) {
            const int len = n_out - n0 < 16 ? n_out - n0 : 16;
            to_float((const char *)bias + (int64_t)n0 * elem, dtype, b, len);
            for (int i = 0; i < len; ++i) yf[n0 + i] += b[i];
        }
    }
    from_float(yf, 1.f, dtype, y, n_out);
    free(buf);
    return 0;
}
#else
int linear_row(const void *x, const void *w, int64_t w_stride, int w_int8, const void *scales, const void *bias,
               void *y, int n_out, int k_in, int dtype, int num_threads) {
    (void)x, (void)w, (void)w_stride, (void)w_int8, (void)scales, (void)bias, (void)y, (void)n_out;
    (void)k_in, (void)dtype, (void)num_threads;
    return 1;
}
#endif
