/* The per-layer elementwise work of a decoder on the CPU, fused into one pass each:
 * residual add + RMSNorm, SiLU(gate) * up, rotary embedding in place, the KV-cache store; and
 * the sampler's greedy argmax.
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
#endif

#define PIECE 1024       /* rows are converted to float this many elements at a time */
#define PARALLEL_MIN_ELEMENTS (1 << 16) /* below this, one thread: waking others costs more */

static inline const char *at(const void *base, int64_t index, int elem) {
    return (const char *)base + index * elem;
}

/* For r in rows (each [outer][inner] pair): with residual, residual[r] += x[r] and the norm is
 * taken of that sum; out[r] = sum / rms(sum) * weight. Rows of any width, in pieces of PIECE: the
 * first pass forms the (rounded, stored) sum and its sum of squares, the second scales. */
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

/* out[r] = silu(x[r, :width]) * x[r, width:], for any width, in pieces of PIECE */
int silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t out_stride, int rows, int width,
                 int dtype, int num_threads) {
    const int elem = elem_size(dtype);
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * width >= PARALLEL_MIN_ELEMENTS)
    for (int r = 0; r < rows; ++r) {
        for (int lo = 0; lo < width; lo += PIECE) {
            const int n = width - lo < PIECE ? width - lo : PIECE;
            float gate[PIECE], up[PIECE];
            to_float(at(x, r * x_stride + lo, elem), dtype, gate, n);
            to_float(at(x, r * x_stride + width + lo, elem), dtype, up, n);
            silu_mul_in_place(gate, up, n);
            from_float(gate, 1.f, dtype, (char *)out + (r * out_stride + lo) * elem, n);
        }
    }
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

/* out[r] = the index of the first largest value of row r of float32 logits (of the first NaN when
 * the row has one, as torch.argmax answers; -0 and +0 are equal, as there).
 *
 * On AVX-512, one pass keeps, per lane of four interleaved vector chains, the largest value seen
 * and its index (replaced only by a strictly larger value: the first stays), and whether a NaN
 * went by; the lanes are then merged (largest value, smallest index among equals): ~0.1 ns a
 * value with the rows in L2. The portable pass keeps each chunk's largest order key (an integer
 * reduction the compiler vectorizes) and scans the first chunk holding the row's largest, as the
 * AVX-512 path did before (~0.2 ns a value: the per-chunk reductions and the re-scan). */

static inline int64_t first_nan(const float *row) {
    int64_t i = 0;
    while (!isnan(row[i])) ++i;
    return i;
}

#if defined(__AVX512F__)
#define ARGMAX_CHAINS 4
static int64_t argmax_row(const float *row, int width) {
    const __m512 lowest = _mm512_set1_ps(-INFINITY);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 best[ARGMAX_CHAINS];
    __m512i at[ARGMAX_CHAINS];
    for (int c = 0; c < ARGMAX_CHAINS; ++c) {
        best[c] = lowest;
        at[c] = _mm512_setzero_si512();
    }
    __mmask16 nan = 0;
    int i = 0;
    for (; i + 16 * ARGMAX_CHAINS <= width; i += 16 * ARGMAX_CHAINS) {
        for (int c = 0; c < ARGMAX_CHAINS; ++c) {
            const __m512 v = _mm512_loadu_ps(row + i + 16 * c);
            const __mmask16 larger = _mm512_cmp_ps_mask(v, best[c], _CMP_GT_OQ);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            best[c] = _mm512_mask_mov_ps(best[c], larger, v);
            at[c] = _mm512_mask_mov_epi32(at[c], larger, _mm512_add_epi32(lanes, _mm512_set1_epi32(i + 16 * c)));
        }
    }
    for (; i < width; i += 16) { /* the tail, into chain 0 (its indices are larger than any there) */
        const __mmask16 k = width - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (width - i)) - 1u);
        const __m512 v = _mm512_mask_loadu_ps(lowest, k, row + i);
        const __mmask16 larger = _mm512_cmp_ps_mask(v, best[0], _CMP_GT_OQ);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best[0] = _mm512_mask_mov_ps(best[0], larger, v);
        at[0] = _mm512_mask_mov_epi32(at[0], larger, _mm512_add_epi32(lanes, _mm512_set1_epi32(i)));
    }
    if (nan) return first_nan(row);
    for (int c = 1; c < ARGMAX_CHAINS; ++c) { /* per lane: the larger value, the smaller index among equals */
        const __mmask16 take = _mm512_cmp_ps_mask(best[c], best[0], _CMP_GT_OQ)
                               | (_mm512_cmp_ps_mask(best[c], best[0], _CMP_EQ_OQ)
                                  & _mm512_cmplt_epi32_mask(at[c], at[0]));
        best[0] = _mm512_mask_mov_ps(best[0], take, best[c]);
        at[0] = _mm512_mask_mov_epi32(at[0], take, at[c]);
    }
    const float m = _mm512_reduce_max_ps(best[0]);
    const __mmask16 holders = _mm512_cmp_ps_mask(best[0], _mm512_set1_ps(m), _CMP_EQ_OQ);
    /* every lane still at -inf (a row of -inf) holds index 0, the answer */
    return _mm512_mask_reduce_min_epi32(holders, at[0]);
}
#else
#define ARGMAX_CHUNK 256
/* A float's bits as an int32 whose order is the floats' order, -0 and +0 one key */
static inline int32_t argmax_key(int32_t bits) {
    bits = bits == INT32_MIN ? 0 : bits;
    return bits ^ ((bits >> 31) & 0x7fffffff);
}

static int64_t argmax_row(const float *row, int width) {
    const int32_t *bits = (const int32_t *)row;
    int32_t best = INT32_MIN;
    int best_chunk = 0, nan = 0;
    for (int lo = 0, c = 0; lo < width; lo += ARGMAX_CHUNK, ++c) {
        const int hi = lo + ARGMAX_CHUNK < width ? lo + ARGMAX_CHUNK : width;
        int32_t m = INT32_MIN;
        for (int i = lo; i < hi; ++i) {
            const int32_t k = argmax_key(bits[i]);
            m = k > m ? k : m;
            nan |= (bits[i] & 0x7fffffff) > 0x7f800000;
        }
        if (m > best) {
            best = m;
            best_chunk = c;
        }
    }
    if (nan) return first_nan(row);
    int64_t index = (int64_t)best_chunk * ARGMAX_CHUNK;
    while (argmax_key(bits[index]) != best) ++index;
    return index;
}
#endif

int argmax_rows(const float *x, int64_t stride, int rows, int width, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * width >= 4 * PARALLEL_MIN_ELEMENTS)
    for (int r = 0; r < rows; ++r) out[r] = argmax_row(x + r * stride, width);
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

/* A float's bits as an int32 whose order is the floats' order (-inf < ... < -0 < +0 < ... < +inf):
 * the largest key is an integer reduction the compiler vectorizes, and exact. */
static inline int32_t order_key(int32_t bits) { return bits ^ ((bits >> 31) & 0x7fffffff); }

/* The sampler's draw, in place over float32 logits: per row, p_i = exp(x_i - max) (masked -inf
 * entries give 0), and out[r] = the first i whose running sum of p exceeds uniforms[r] * sum(p)
 * (kept below the sum). Sums in double, chunk by chunk (vectorized); only the chunk that holds
 * the target is walked element by element. Rows are independent of each other: a seeded row
 * draws the same token in any batch. */
#define DRAW_CHUNK 256
int inverse_cdf_draw(float *logits, int64_t stride, int rows, int width, const float *uniforms, int64_t *out,
                     int num_threads) {
    const int chunks = (width + DRAW_CHUNK - 1) / DRAW_CHUNK;
    double *chunk_sums = malloc(sizeof(double) * (size_t)chunks * rows);
    if (!chunk_sums) return 2;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * width >= PARALLEL_MIN_ELEMENTS)
    for (int r = 0; r < rows; ++r) {
        float *row = logits + r * stride;
        const int32_t *bits = (const int32_t *)row;
        double *sums = chunk_sums + (size_t)r * chunks;
        int32_t key = INT32_MIN;
        for (int i = 0; i < width; ++i) {
            const int32_t k = order_key(bits[i]);
            key = k > key ? k : key;
        }
        bits32 top = {.u = (uint32_t)(key ^ ((key >> 31) & 0x7fffffff))};
        const float m = top.f;
        if (m == -INFINITY) { /* nothing allowed at all: the torch path would return garbage too */
            out[r] = 0;
            continue;
        }
        double total = 0.0;
        for (int c = 0, lo = 0; c < chunks; ++c, lo += DRAW_CHUNK) {
            const int hi = lo + DRAW_CHUNK < width ? lo + DRAW_CHUNK : width;
            float s = 0.f;
            for (int i = lo; i < hi; ++i) {
                row[i] = fast_exp(row[i] - m);
                s += row[i];
            }
            sums[c] = s;
            total += s;
        }
        double target = (double)uniforms[r] * total;
        int c = 0;
        while (c < chunks - 1 && target >= sums[c]) target -= sums[c++];
        const int lo = c * DRAW_CHUNK, hi = lo + DRAW_CHUNK < width ? lo + DRAW_CHUNK : width;
        int64_t index = hi - 1;
        double acc = 0.0;
        for (int i = lo; i < hi; ++i) {
            acc += row[i];
            if (acc > target) {
                index = i;
                break;
            }
        }
        while (index > 0 && row[index] == 0.f) --index; /* never a masked token (rounding at the end) */
        out[r] = index;
    }
    free(chunk_sums);
    return 0;
}

