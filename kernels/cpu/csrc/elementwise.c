/* The per-layer elementwise work of a decoder on the CPU, fused into one pass each:
 * residual add + RMSNorm, SiLU(gate) * up and GELU-tanh(gate) * up, rotary embedding in place, the KV-cache store; and the
 * portable few-row linears (small_linear). The sampler's kernels are in sampling.c.
 *
 * In eager torch each of these is several ops (RMSNorm alone: add, pow, mean, rsqrt, two
 * multiplies), each with its own allocation and its own fork/join of the thread pool; at decode
 * batch sizes that overhead is most of their cost. Here each is one loop over rows, in float32,
 * rounded to the element type once at the end (the residual sum is rounded before it is
 * normalized, as the torch path does). Rows run in parallel only when there are enough of them
 * to pay for waking the threads.
 *
 * Built and loaded by kernels/cpu_kernels.py. Strides are in elements; the last dimension is
 * contiguous everywhere.
 */
#include <math.h> /* sqrtf, INFINITY */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__SSE__)
#include <xmmintrin.h>
#endif

#define PIECE 1024       /* rows are converted to float this many elements at a time */

static inline const char *at(const void *base, int64_t index, int elem) {
    return (const char *)base + index * elem;
}

#if defined(__AVX512F__)
/* 16 weights at w (bfloat16 or float32) as floats */
static inline __m512 weight16(const void *w, int weight_dtype, int d) {
    return weight_dtype == DTYPE_BF16 ? bf16_load16((const uint16_t *)w + d) : _mm512_loadu_ps((const float *)w + d);
}

/* rms_norm's row in bfloat16, 16 lanes at a time (width a multiple of 16): the same rounding of
 * the residual sum and of the output; the squares summed in 16 lanes, then across them (the
 * scalar loop's one chain of dependent adds was most of its time). */
static void rms_norm_row_bf16(const uint16_t *src, uint16_t *res, const void *weight, int weight_dtype,
                              uint16_t *dst, int width, float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (int d = 0; d < width; d += 16) {
        __m512 x = bf16_load16(src + d);
        if (res != NULL) {
            const __m256i sum = bf16_round16(_mm512_add_ps(x, bf16_load16(res + d)));
            _mm256_storeu_si256((__m256i *)(res + d), sum);
            x = bf16_load16(res + d); /* the rounded sum, as stored */
        }
        ss = _mm512_fmadd_ps(x, x, ss);
    }
    const float inv = 1.f / sqrtf(_mm512_reduce_add_ps(ss) / width + eps);
    const uint16_t *normed = res != NULL ? res : src;
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int d = 0; d < width; d += 16) {
        const __m512 y = _mm512_mul_ps(bf16_load16(normed + d), _mm512_mul_ps(vinv, weight16(weight, weight_dtype, d)));
        _mm256_storeu_si256((__m256i *)(dst + d), bf16_round16(y));
    }
}
#endif

/* For r in rows (each [outer][inner] pair): with residual, residual[r] += x[r] and the norm is
 * taken of that sum; out[r] = sum / rms(sum) * weight. Rows of any width, in pieces of PIECE: the
 * first pass forms the (rounded, stored) sum and its sum of squares, the second scales. bfloat16
 * rows of a multiple of 16 with AVX-512: rms_norm_row_bf16. */
int rms_norm(const void *x, int64_t x_outer, int64_t x_inner, void *residual, int64_t res_outer,
             const void *weight, int weight_dtype, void *out, int64_t out_outer, int64_t out_inner,
             int outer, int inner, int width, float eps, int dtype, int num_threads) {
    if (residual != NULL && inner != 1) return 1;
    const int elem = elem_size(dtype), welem = elem_size(weight_dtype);
    const int rows = outer * inner;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * width >= PARALLEL_MIN_ELEMENTS)
    for (int r = 0; r < rows; ++r) {
        const int o = r / inner, i = r % inner;
        const char *src = at(x, o * x_outer + i * x_inner, elem);
        char *res_row = residual != NULL ? (char *)residual + o * res_outer * elem : NULL;
        const char *normed = res_row != NULL ? res_row : src; /* what the norm is taken of */
        char *dst = (char *)out + (o * out_outer + i * out_inner) * elem;
#if defined(__AVX512F__)
        if (dtype == DTYPE_BF16 && width % 16 == 0 && (weight_dtype == DTYPE_BF16 || weight_dtype == DTYPE_F32)) {
            rms_norm_row_bf16((const uint16_t *)src, (uint16_t *)res_row, weight, weight_dtype, (uint16_t *)dst,
                              width, eps);
            continue;
        }
#endif
        float row[PIECE], other[PIECE];
        float ss = 0.f;
        for (int lo = 0; lo < width; lo += PIECE) {
            const int n = width - lo < PIECE ? width - lo : PIECE;
            to_float(src + (int64_t)lo * elem, dtype, row, n);
            if (res_row != NULL) {
                to_float(res_row + (int64_t)lo * elem, dtype, other, n);
                for (int d = 0; d < n; ++d) row[d] += other[d];
                from_float(row, 1.f, dtype, res_row + (int64_t)lo * elem, n);
                to_float(res_row + (int64_t)lo * elem, dtype, row, n); /* the rounded sum, as stored */
            }
            for (int d = 0; d < n; ++d) ss += row[d] * row[d];
        }
        const float inv = 1.f / sqrtf(ss / width + eps);
        for (int lo = 0; lo < width; lo += PIECE) {
            const int n = width - lo < PIECE ? width - lo : PIECE;
            to_float(normed + (int64_t)lo * elem, dtype, row, n);
            to_float(at(weight, lo, welem), weight_dtype, other, n);
            for (int d = 0; d < n; ++d) row[d] *= inv * other[d];
            from_float(row, 1.f, dtype, dst + (int64_t)lo * elem, n);
        }
    }
    return 0;
}

/* gate[d] = silu(gate[d]) * up[d] = gate[d] / (1 + exp(-gate[d])) * up[d]. With AVX-512 the
 * division is a reciprocal estimate and one Newton step (float precision): vdivps takes one
 * 16-lane divide per 16 cycles, which made this loop compute-bound at a cycle per element. */
static inline void silu_mul_in_place(float *restrict gate, const float *restrict up, int n) {
    float denom[PIECE];
    for (int d = 0; d < n; ++d) denom[d] = 1.f + fast_exp(-gate[d]);
    int d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= n; d += 16) {
        const __m512 den = _mm512_loadu_ps(denom + d), est = _mm512_rcp14_ps(den);
        const __m512 inv = _mm512_mul_ps(est, _mm512_fnmadd_ps(den, est, _mm512_set1_ps(2.f)));
        const __m512 g = _mm512_mul_ps(_mm512_loadu_ps(gate + d), inv);
        _mm512_storeu_ps(gate + d, _mm512_mul_ps(g, _mm512_loadu_ps(up + d)));
    }
#endif
    for (; d < n; ++d) gate[d] = gate[d] / denom[d] * up[d];
}

/* out[:width] = silu(gate[:width]) * up[:width] for one row (elements of dtype); gemm.c's
 * gate|up projection calls it on each tile it has just computed. bfloat16 with AVX-512: 16 lanes
 * at a time straight from and to the row (exp16, the reciprocal as above, from_float's rounding),
 * ~3x faster than the pieces below on gemm.c's 48-wide tiles; the rest (a row's last width % 16
 * elements, float32, other CPUs) in pieces of PIECE. */
void silu_mul_row(const void *gate, const void *up, void *out, int width, int dtype) {
    const int elem = elem_size(dtype);
    int lo = 0;
#if defined(__AVX512F__)
    if (dtype == DTYPE_BF16) {
        const uint16_t *g16 = (const uint16_t *)gate, *u16 = (const uint16_t *)up;
        for (; lo + 16 <= width; lo += 16) {
            const __m512 g = bf16_load16(g16 + lo);
            const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
            const __m512 est = _mm512_rcp14_ps(den);
            const __m512 inv = _mm512_mul_ps(est, _mm512_fnmadd_ps(den, est, _mm512_set1_ps(2.f)));
            const __m512 y = _mm512_mul_ps(_mm512_mul_ps(g, inv), bf16_load16(u16 + lo));
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + lo), bf16_round16(y));
        }
    }
#endif
    for (; lo < width; lo += PIECE) {
        const int n = width - lo < PIECE ? width - lo : PIECE;
        float g[PIECE], u[PIECE];
        to_float(at(gate, lo, elem), dtype, g, n);
        to_float(at(up, lo, elem), dtype, u, n);
        silu_mul_in_place(g, u, n);
        from_float(g, 1.f, dtype, (char *)out + (int64_t)lo * elem, n);
    }
}

/* out[r] = silu(x[r, :width]) * x[r, width:], for any width */
int silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t out_stride, int rows, int width,
                 int dtype, int num_threads) {
    const int elem = elem_size(dtype);
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * width >= PARALLEL_MIN_ELEMENTS)
    for (int r = 0; r < rows; ++r)
        silu_mul_row(at(x, r * x_stride, elem), at(x, r * x_stride + width, elem),
                     (char *)out + r * out_stride * elem, width, dtype);
    return 0;
}

/* out[:width] = gelu_tanh(gate) * up for one row (Gemma's GeGLU), gelu_tanh(g) = 0.5 g (1 + tanh(u)),
 * u = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + exp(-2u)) (the same value: 0.5 (1 +
 * tanh u) is the logistic of 2u) with fast_exp, in floats, rounded once; one pass where torch's
 * gelu and mul round twice. The fused decode step and the per-op path both run it. */
void gelu_tanh_mul_row(const void *gate, const void *up, void *out, int width, int dtype) {
    const int elem = elem_size(dtype);
    for (int lo = 0; lo < width; lo += PIECE) {
        const int n = width - lo < PIECE ? width - lo : PIECE;
        float g[PIECE], u[PIECE], z[PIECE];
        to_float(at(gate, lo, elem), dtype, g, n);
        to_float(at(up, lo, elem), dtype, u, n);
        for (int d = 0; d < n; ++d) z[d] = -1.5957691216057308f * (g[d] + 0.044715f * g[d] * g[d] * g[d]);
        for (int d = 0; d < n; ++d) z[d] = 1.f + fast_exp(z[d]);
        for (int d = 0; d < n; ++d) g[d] = g[d] / z[d] * u[d];
        from_float(g, 1.f, dtype, (char *)out + (int64_t)lo * elem, n);
    }
}

/* out[r] = gelu_tanh(x[r, :width]) * x[r, width:], for any width */
int gelu_tanh_and_mul(const void *x, int64_t x_stride, void *out, int64_t out_stride, int rows, int width,
                      int dtype, int num_threads) {
    const int elem = elem_size(dtype);
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * width >= PARALLEL_MIN_ELEMENTS)
    for (int r = 0; r < rows; ++r)
        gelu_tanh_mul_row(at(x, r * x_stride, elem), at(x, r * x_stride + width, elem),
                          (char *)out + r * out_stride * elem, width, dtype);
    return 0;
}

/* In place, for every token t and head h of x: the rotate-half rotary embedding with the
 * token's cos [width] and signed sin [width] rows (sin's first half negated, as the torch path
 * keeps them): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. */
int rotary(void *x, int64_t x_token, int64_t x_head, int tokens, int heads, int width, const void *cos,
           const void *sin, int64_t cs_stride, int dtype, int num_threads) {
    if (width > MAX_HEAD_DIM || width % 2) return 1;
    const int elem = elem_size(dtype), half = width / 2;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)tokens * heads * width >= PARALLEL_MIN_ELEMENTS)
    for (int t = 0; t < tokens; ++t) {
        float c[MAX_HEAD_DIM], s[MAX_HEAD_DIM], row[MAX_HEAD_DIM], rotated[MAX_HEAD_DIM];
        to_float(at(cos, t * cs_stride, elem), dtype, c, width);
        to_float(at(sin, t * cs_stride, elem), dtype, s, width);
        for (int h = 0; h < heads; ++h) {
            char *dst = (char *)x + (t * x_token + h * x_head) * elem;
            to_float(dst, dtype, row, width);
            for (int d = 0; d < half; ++d) {
                rotated[d] = row[d] * c[d] + row[d + half] * s[d];
                rotated[d + half] = row[d + half] * c[d + half] + row[d] * s[d + half];
            }
            from_float(rotated, 1.f, dtype, dst, width);
        }
    }
    return 0;
}

/* One KV row (width elements of src, DTYPE_*) as KV_INT8: round(x / scale) with scale = max|x| /
 * 127, then the scale (an all-zero row stores zeros and scale 0). Division, rounding half to
 * even: the same arithmetic as engine/layers/kv_quant.py, so both paths store the same bytes.
 * src is overwritten with the values the row now holds (q * scale in dtype): the step's own
 * attention over its fresh K/V then sees what later steps read from the cache. */
static void quantize_row(void *src, int dtype, int width, char *dst) {
    float x[MAX_HEAD_DIM];
    to_float(src, dtype, x, width);
    float amax = 0.f;
    for (int d = 0; d < width; ++d) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float scale = amax / 127.f;
    int8_t *q = (int8_t *)dst;
    for (int d = 0; d < width; ++d) {
        const float r = scale > 0.f ? nearbyintf(x[d] / scale) : 0.f;
        q[d] = (int8_t)(r > 127.f ? 127.f : (r < -127.f ? -127.f : r));
        x[d] = (float)q[d] * scale;
    }
    memcpy(dst + width, &scale, sizeof scale);
    from_float(x, 1.f, dtype, src, width);
}

/* cache[h][slots[t]] = src[t][h] for K and V; caches are [kv_heads][cache_slots] rows of
 * kv_row_bytes; a slot of -1 is skipped. A float cache takes a plain copy, a KV_INT8 one the
 * quantized row (and k and v the values it holds: quantize_row). */
int store_kv(void *k, int64_t k_token, int64_t k_head, void *v, int64_t v_token, int64_t v_head,
             const int64_t *slots, int tokens, int kv_heads, int width, void *k_cache, void *v_cache,
             int64_t cache_slots, int dtype, int cache_dtype) {
    if (!kv_cache_takes(dtype, cache_dtype) || (cache_dtype == KV_INT8 && width > MAX_HEAD_DIM))
        return 1; /* quantize_row's buffer holds MAX_HEAD_DIM floats */
    const int elem = elem_size(dtype);
    const int64_t row = kv_row_bytes(cache_dtype, width);
    for (int t = 0; t < tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        if (slot >= cache_slots) return 1;
        for (int h = 0; h < kv_heads; ++h) {
            const int64_t dst = ((int64_t)h * cache_slots + slot) * row;
            void *ks = (char *)k + (t * k_token + h * k_head) * elem;
            void *vs = (char *)v + (t * v_token + h * v_head) * elem;
            if (cache_dtype == KV_INT8) {
                quantize_row(ks, dtype, width, (char *)k_cache + dst);
                quantize_row(vs, dtype, width, (char *)v_cache + dst);
            } else {
                memcpy((char *)k_cache + dst, ks, (size_t)row);
                memcpy((char *)v_cache + dst, vs, (size_t)row);
            }
        }
    }
    return 0;
}

/* y[m][n] = x[m] . w[n] (+ bias[n]) for a few rows m: a decode step at small batch is a
 * matrix-vector product whose cost is reading w once; torch's bfloat16 matmul at one row runs
 * far below memory speed on the CPU. Each thread takes a range of w's rows; each row of w is
 * converted to float once, in pieces that stay in L1, and dotted with every row of x (at most
 * SMALL_ROWS of them, as floats). x, w, y, bias share the element type; w rows contiguous. */
#define SMALL_ROWS 8
#define K_PIECE 512

/* The body of small_linear and small_linear_int8: the weight is of x's type (int8 = 0) or int8
 * with one scale per row, in x's type (int8 = 1). */
static inline __attribute__((always_inline)) int portable_linear_rows(
        const void *x, int64_t x_stride, const void *w, int64_t w_stride, int int8, const void *scales,
        const void *bias, void *y, int64_t y_stride, int rows, int n_out, int k_in, int dtype, int num_threads) {
    if (rows > SMALL_ROWS || rows < 1) return 1;
    const int elem = elem_size(dtype), welem = int8 ? 1 : elem;
    float xf[rows * k_in]; /* x as floats, on the calling thread's stack (no malloc per call): 74 KiB
                            * for the one row of a decode into Qwen2.5-7B's 18,944-wide down_proj */
    for (int m = 0; m < rows; ++m) to_float(at(x, m * x_stride, elem), dtype, xf + (size_t)m * k_in, k_in);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int n = 0; n < n_out; ++n) {
        float acc[SMALL_ROWS] = {0};
        const char *wrow = (const char *)w + (int64_t)n * w_stride * welem;
        if (n + 1 < n_out) __builtin_prefetch(wrow + w_stride * welem, 0, 1);
        for (int k0 = 0; k0 < k_in; k0 += K_PIECE) {
            const int len = k_in - k0 < K_PIECE ? k_in - k0 : K_PIECE;
            float wf[K_PIECE];
            if (int8)
                for (int k = 0; k < len; ++k) wf[k] = (float)((const int8_t *)wrow)[k0 + k];
            else
                to_float(wrow + (int64_t)k0 * welem, dtype, wf, len);
            for (int m = 0; m < rows; ++m) {
                const float *restrict xm = xf + (size_t)m * k_in + k0;
                float s = 0.f;
                for (int k = 0; k < len; ++k) s += xm[k] * wf[k];
                acc[m] += s;
            }
        }
        float scale = 1.f, b = 0.f;
        if (int8) to_float(at(scales, n, elem), dtype, &scale, 1);
        if (bias != NULL) to_float(at(bias, n, elem), dtype, &b, 1);
        for (int m = 0; m < rows; ++m) {
            const float v = acc[m] * scale + b;
            from_float(&v, 1.f, dtype, (char *)y + ((int64_t)m * y_stride + n) * elem, 1);
        }
    }
    return 0;
}

int small_linear(const void *x, int64_t x_stride, const void *w, int64_t w_stride, const void *bias,
                 void *y, int64_t y_stride, int rows, int n_out, int k_in, int dtype, int num_threads) {
    return portable_linear_rows(x, x_stride, w, w_stride, 0, NULL, bias, y, y_stride, rows, n_out, k_in, dtype,
                       num_threads);
}

/* small_linear with an int8 weight and one scale per output row (weight-only int8):
 * y[m][n] = scale[n] * (x[m] . q[n]) (+ bias[n]). Reads one byte per weight. x, scales, bias, y
 * share the element type. */
int small_linear_int8(const void *x, int64_t x_stride, const int8_t *q, int64_t q_stride, const void *scales,
                      const void *bias, void *y, int64_t y_stride, int rows, int n_out, int k_in, int dtype,
                      int num_threads) {
    return portable_linear_rows(x, x_stride, q, q_stride, 1, scales, bias, y, y_stride, rows, n_out, k_in, dtype,
                       num_threads);
}

/* Every thread of a team of num_threads takes on the calling thread's floating-point mode (MXCSR:
 * flush-to-zero, denormals-are-zero). A thread starts with the mode of the thread that created it
 * and torch.set_flush_denormal sets only the calling thread's, so a pool made before the caller
 * set it would round denormal results (a tiny silu(gate) * up, say) unlike the caller: a row's
 * result would depend on which thread computed it. */
int share_fp_mode(int num_threads) {
#if defined(__SSE__)
    const unsigned int mode = _mm_getcsr();
#pragma omp parallel num_threads(num_threads)
    _mm_setcsr(mode);
#else
    (void)num_threads;
#endif
    return 0;
}
