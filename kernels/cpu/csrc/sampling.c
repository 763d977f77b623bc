/* The sampler's row kernels on the CPU, over float32 logits: the greedy argmax and the random
 * draw by inverse CDF (engine/layers/sampler.py calls them through kernels/cpu_kernels.py). Rows
 * are independent of each other and run in parallel when there are enough values to pay for
 * waking the threads.
 */
#include <math.h> /* isnan, INFINITY */
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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
/* One chain's step over the 16 values v at index i: a lane takes v where it is strictly larger */
static inline __attribute__((always_inline)) void argmax_step(__m512 v, int i, __m512 *best, __m512i *at,
                                                              __mmask16 *nan) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __mmask16 larger = _mm512_cmp_ps_mask(v, *best, _CMP_GT_OQ);
    *nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    *best = _mm512_mask_mov_ps(*best, larger, v);
    *at = _mm512_mask_mov_epi32(*at, larger, _mm512_add_epi32(lanes, _mm512_set1_epi32(i)));
}

static int64_t argmax_row(const float *row, int width) {
    const __m512 lowest = _mm512_set1_ps(-INFINITY);
    __m512 best[ARGMAX_CHAINS];
    __m512i at[ARGMAX_CHAINS];
    for (int c = 0; c < ARGMAX_CHAINS; ++c) {
        best[c] = lowest;
        at[c] = _mm512_setzero_si512();
    }
    __mmask16 nan = 0;
    int i = 0;
    for (; i + 16 * ARGMAX_CHAINS <= width; i += 16 * ARGMAX_CHAINS)
        for (int c = 0; c < ARGMAX_CHAINS; ++c)
            argmax_step(_mm512_loadu_ps(row + i + 16 * c), i + 16 * c, &best[c], &at[c], &nan);
    for (; i < width; i += 16) { /* the tail, into chain 0 (its indices are larger than any there) */
        const __mmask16 k = width - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (width - i)) - 1u);
        argmax_step(_mm512_mask_loadu_ps(lowest, k, row + i), i, &best[0], &at[0], &nan);
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

