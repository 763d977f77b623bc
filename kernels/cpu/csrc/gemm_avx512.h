/* gemm.c's tiles on AVX-512 (included by gemm.c where AVX-512 F, BW and VL are targeted): a tile
 * of GEMM_MR rows of x by GEMM_NR packed blocks (48 outputs) runs down k one pair of inputs at a
 * time, its accumulators in registers, each lane one output, so nothing is summed across lanes. */
#ifndef KVSERVE_GEMM_AVX512_H
#define KVSERVE_GEMM_AVX512_H

#if defined(__AVX512BF16__)
/* The tile's NX rows (x: rows x_stride elements apart) by NR blocks of the panel wp (blocks
 * bstride elements apart) into y (rows n apart), bias added, rounded to bfloat16 once. */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t x_stride, const int NX,
                                                       const uint16_t *wp, int64_t bstride, const int NR,
                                                       int k, const uint16_t *bias, uint16_t *y, int64_t n) {
    __m512 acc[GEMM_MR][GEMM_NR];
    for (int m = 0; m < NX; ++m)
        for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
    const int pairs = k / 2;
    for (int p = 0; p < pairs; ++p) {
        __m512bh wv[GEMM_NR];
        for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wp + j * bstride + (int64_t)p * 2 * GEMM_VEC);
        for (int m = 0; m < NX; ++m) {
            int32_t two;
            __builtin_memcpy(&two, x + m * x_stride + 2 * p, sizeof two);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(two);
            for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xv);
        }
    }
    for (int j = 0; j < NR; ++j) {
        const __m512 b = bias == NULL ? _mm512_setzero_ps()
            : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                  _mm256_loadu_si256((const __m256i *)(bias + j * GEMM_VEC))), 16));
        for (int m = 0; m < NX; ++m)
            _mm256_storeu_si256((__m256i *)(y + m * n + j * GEMM_VEC),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], b)));
    }
}
#else
/* AVX-512 F without BF16 (Ice Lake and Cascade Lake Xeons): the tile of the same shape over x as
 * floats (gemm.c's rows_as_floats), each packed pair of 16 features widened to two vectors of
 * floats, the even input's (shifted up) and the odd input's (masked), each multiplied by the row's
 * input in float FMAs: per output the sum runs even then odd input over k, as the AVX2 tiles run it,
 * so both give the same bits (a bfloat16 product is exact in float). 24 accumulators, three widened
 * weights, a broadcast and the mask fill 29 of the 32 registers. */
#define GEMM_X_FLOATS 1
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, const int NX,
                                                       const uint16_t *wp, int64_t bstride, const int NR,
                                                       int k, const uint16_t *bias, uint16_t *y, int64_t n) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 acc[GEMM_MR][GEMM_NR];
    for (int m = 0; m < NX; ++m)
        for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
    const int pairs = k / 2;
    for (int p = 0; p < pairs; ++p) {
        const uint16_t *wk = wp + (int64_t)p * 2 * GEMM_VEC;
        __m512 wv[GEMM_NR];
        for (int j = 0; j < NR; ++j)
            wv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(wk + j * bstride), 16));
        for (int m = 0; m < NX; ++m) {
            const __m512 xe = _mm512_set1_ps(x[m * x_stride + 2 * p]);
            for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_fmadd_ps(wv[j], xe, acc[m][j]);
        }
        for (int j = 0; j < NR; ++j)
            wv[j] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(wk + j * bstride), high));
        for (int m = 0; m < NX; ++m) {
            const __m512 xo = _mm512_set1_ps(x[m * x_stride + 2 * p + 1]);
            for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_fmadd_ps(wv[j], xo, acc[m][j]);
        }
    }
    for (int j = 0; j < NR; ++j) {
        const __m512 b = bias == NULL ? _mm512_setzero_ps() : bf16_load16(bias + j * GEMM_VEC);
        for (int m = 0; m < NX; ++m)
            _mm256_storeu_si256((__m256i *)(y + m * n + j * GEMM_VEC), bf16_round16(_mm512_add_ps(acc[m][j], b)));
    }
}
#endif

#if GEMM_X_FLOATS
typedef float gemm_x_t;
#else
typedef uint16_t gemm_x_t;
#endif

#define TILE_M GEMM_MR
#define TILE_ROWS(NR)                                                                            \
    switch (rows) {                                                                              \
        case 1: tile(x, x_stride, 1, wp, bstride, NR, k, bias, y, n); break;                     \
        case 2: tile(x, x_stride, 2, wp, bstride, NR, k, bias, y, n); break;                     \
        case 3: tile(x, x_stride, 3, wp, bstride, NR, k, bias, y, n); break;                     \
        case 4: tile(x, x_stride, 4, wp, bstride, NR, k, bias, y, n); break;                     \
        case 5: tile(x, x_stride, 5, wp, bstride, NR, k, bias, y, n); break;                     \
        case 6: tile(x, x_stride, 6, wp, bstride, NR, k, bias, y, n); break;                     \
        case 7: tile(x, x_stride, 7, wp, bstride, NR, k, bias, y, n); break;                     \
        default: tile(x, x_stride, GEMM_MR, wp, bstride, NR, k, bias, y, n); break;              \
    }

/* rows (1..TILE_M) of x against nr (1..GEMM_NR) blocks */
static void tile_any(const gemm_x_t *x, int64_t x_stride, int rows, const uint16_t *wp, int64_t bstride, int nr,
                     int k, const uint16_t *bias, uint16_t *y, int64_t n) {
    if (nr == 3) {
        TILE_ROWS(3)
    } else if (nr == 2) {
        TILE_ROWS(2)
    } else {
        TILE_ROWS(1)
    }
}

#endif
