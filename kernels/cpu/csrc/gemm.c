/* bfloat16 GEMM for the CPU's projections of more than a few rows: y[m][n] = x[m] . w[n] + b[n],
 * x and y bfloat16, products summed in float with AVX512-BF16, over a copy of w packed once.
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
 * Against oneDNN's packed bfloat16 GEMM (2 threads, AVX512-BF16 without AMX; the bundled model's
 * 30 layers' four projections in turn, weights from memory, same run): 8 rows 139 -> 207 GFLOP/s,
 * 16 221 -> 260, 32 291 -> 331, 64 355 -> 365, 128 386 -> 400, 684 and 2048 rows ~420 both; a
 * decode step of 32 sequences ~8% shorter (docs/performance/step_profile.md).
 *
 * A gate|up projection can give silu(gate) * up instead of its product (glu, panels_team): a
 * thread computes a tile of the gate panel and the same features' up tile, and the activation
 * comes out of the cache, the product never stored (the separate pass over it read 2x and wrote
 * 1x the activation's bytes). Same bits as the separate silu_and_mul.
 *
 * Built where the compiler targets AVX512-BF16, and where it targets AVX2
 * with FMA: there the same packed layout is read as two 256-bit halves of 8 features, each
 * bfloat16 pair widened to floats by a shift (the even input) and a mask (the odd one), and
 * multiplied in float FMAs against x widened once per thread and GEMM_MC rows; each output's sum
 * again runs over k in one order whatever rows are beside it. Elsewhere every entry point answers 1 (not taken)
 * and the caller keeps oneDNN or torch.
 */
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

#if HAVE_AVX512_TEAM && defined(__AVX512BF16__)
#define GEMM_BUILT 1
#define GEMM_AVX512 1
#define GEMM_QUANTIZED 1 /* int8/int4 panels: dequantize.c and the 16-lane transposes */
#elif defined(__AVX2__) && defined(__FMA__)
#define GEMM_BUILT 1
#define GEMM_AVX512 0
#define GEMM_QUANTIZED 1 /* int8/int4 panels: dequantize.c's plain C, transposed in plain C */
#else
#define GEMM_BUILT 0
#define GEMM_AVX512 0
#define GEMM_QUANTIZED 0
#endif

#if GEMM_BUILT
#include <immintrin.h>

#if GEMM_AVX512
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
/* AVX2 tiles take up to TILE_M rows of x, widened to floats beforehand (rows_as_floats), then
 * multiplied six rows at a time against each packed block (block6), the last few rows up to
 * AVX2_MR at a time (block_rows). Widened once per tile and panel instead, x's conversion took
 * ~8% of a tile's instructions (twice that for gate|up): 512-2,048 rows 1.08x faster without. */
#ifndef AVX2_MR
#define AVX2_MR 4
#endif
#define AVX2_BLOCK 6
#ifndef TILE_M
#define TILE_M 48
#endif

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

/* Up to AVX2_MR rows of x (floats, k apart) against one packed block (16 features), into
 * acc[m][half]: per pair of inputs the block's two 256-bit halves widened to the even input's
 * floats (the low bfloat16 of each lane, shifted up), an FMA per half and row, then the odd
 * input's (the high one, masked) and theirs: 2 * NX accumulators, 2 weight vectors and their two
 * widenings and a broadcast in the 16 registers. */
static inline __attribute__((always_inline)) void block_rows(const float *xf, int k, const int NX,
                                                             const uint16_t *wb, __m256 acc[AVX2_BLOCK][2]) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 a0[AVX2_MR], a1[AVX2_MR]; /* locals, stored once at the end: acc itself stayed in memory */
    for (int m = 0; m < NX; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
    for (int p = 0; p < k / 2; ++p) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + (int64_t)p * 2 * GEMM_VEC));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + (int64_t)p * 2 * GEMM_VEC + GEMM_VEC));
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
        const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
        for (int m = 0; m < NX; ++m) {
            const __m256 xe = _mm256_broadcast_ss(xf + (int64_t)m * k + 2 * p);
            a0[m] = _mm256_fmadd_ps(e0, xe, a0[m]);
            a1[m] = _mm256_fmadd_ps(e1, xe, a1[m]);
        }
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, high));
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, high));
        for (int m = 0; m < NX; ++m) {
            const __m256 xo = _mm256_broadcast_ss(xf + (int64_t)m * k + 2 * p + 1);
            a0[m] = _mm256_fmadd_ps(o0, xo, a0[m]);
            a1[m] = _mm256_fmadd_ps(o1, xo, a1[m]);
        }
    }
    for (int m = 0; m < NX; ++m) acc[m][0] = a0[m], acc[m][1] = a1[m];
}

/* acc's rows (+ bias b, floats) rounded to bfloat16 as from_float rounds, into y (rows n apart) */
static inline void store_rows(__m256 acc[AVX2_BLOCK][2], int rows, const float *b, uint16_t *y, int64_t n) {
    for (int m = 0; m < rows; ++m) {
        float out[GEMM_VEC];
        _mm256_storeu_ps(out, _mm256_add_ps(acc[m][0], _mm256_loadu_ps(b)));
        _mm256_storeu_ps(out + 8, _mm256_add_ps(acc[m][1], _mm256_loadu_ps(b + 8)));
        from_float(out, 1.f, DTYPE_BF16, y + m * n, GEMM_VEC);
    }
}

/* Six rows of x against one packed block, as block_rows computes them (each output's FMAs in the
 * same order, the same bits) with the registers laid out by hand: 12 accumulators (ymm0-11), the
 * block's two halves widened (ymm12-13), a broadcast (ymm14), the odd inputs' mask (ymm15).
 * Twelve independent sums keep both FMA pipes fed through the 4-cycle latency (block_rows' eight
 * of four rows sit at that edge), and the four widenings are shared by 24 FMAs instead of 16;
 * written in C, the compiler spilled at five rows already. */
static void block6(const float *xf, int k, const uint16_t *wb, __m256 acc[AVX2_BLOCK][2]) {
    static const uint32_t high[8] __attribute__((aligned(32))) = {
        0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u};
    const int64_t s = (int64_t)k * 4, s3 = 3 * s, s5 = 5 * s; /* bytes from one row of x to the next */
    int64_t pairs = k / 2;
    const float *x = xf;
    const uint16_t *w = wb;
    float out[AVX2_BLOCK * 2 * 8] __attribute__((aligned(32)));
#define KV_FMA2(ROW, A, B) "vbroadcastss " ROW ", %%ymm14\n\t"                      \
                           "vfmadd231ps %%ymm14, %%ymm12, %%ymm" #A "\n\t" \
                           "vfmadd231ps %%ymm14, %%ymm13, %%ymm" #B "\n\t"
#define KV_ROWS(OFF) KV_FMA2(OFF "(%[x])", 0, 1) KV_FMA2(OFF "(%[x],%[s],1)", 2, 3)       \
                     KV_FMA2(OFF "(%[x],%[s],2)", 4, 5) KV_FMA2(OFF "(%[x],%[s3],1)", 6, 7) \
                     KV_FMA2(OFF "(%[x],%[s],4)", 8, 9) KV_FMA2(OFF "(%[x],%[s5],1)", 10, 11)
    __asm__ volatile(
        "vxorps %%ymm0, %%ymm0, %%ymm0\n\t" "vxorps %%ymm1, %%ymm1, %%ymm1\n\t"
        "vxorps %%ymm2, %%ymm2, %%ymm2\n\t" "vxorps %%ymm3, %%ymm3, %%ymm3\n\t"
        "vxorps %%ymm4, %%ymm4, %%ymm4\n\t" "vxorps %%ymm5, %%ymm5, %%ymm5\n\t"
        "vxorps %%ymm6, %%ymm6, %%ymm6\n\t" "vxorps %%ymm7, %%ymm7, %%ymm7\n\t"
        "vxorps %%ymm8, %%ymm8, %%ymm8\n\t" "vxorps %%ymm9, %%ymm9, %%ymm9\n\t"
        "vxorps %%ymm10, %%ymm10, %%ymm10\n\t" "vxorps %%ymm11, %%ymm11, %%ymm11\n\t"
        "vmovdqa %[high], %%ymm15\n\t"
        "1:\n\t"
        "vmovdqu (%[w]), %%ymm12\n\t"
        "vmovdqu 32(%[w]), %%ymm13\n\t"
        "vpslld $16, %%ymm12, %%ymm12\n\t"
        "vpslld $16, %%ymm13, %%ymm13\n\t"
        KV_ROWS("")
        "vpand (%[w]), %%ymm15, %%ymm12\n\t"
        "vpand 32(%[w]), %%ymm15, %%ymm13\n\t"
        KV_ROWS("4")
        "add $64, %[w]\n\t"
        "add $8, %[x]\n\t"
        "dec %[pairs]\n\t"
        "jnz 1b\n\t"
        "vmovaps %%ymm0, (%[out])\n\t" "vmovaps %%ymm1, 32(%[out])\n\t"
        "vmovaps %%ymm2, 64(%[out])\n\t" "vmovaps %%ymm3, 96(%[out])\n\t"
        "vmovaps %%ymm4, 128(%[out])\n\t" "vmovaps %%ymm5, 160(%[out])\n\t"
        "vmovaps %%ymm6, 192(%[out])\n\t" "vmovaps %%ymm7, 224(%[out])\n\t"
        "vmovaps %%ymm8, 256(%[out])\n\t" "vmovaps %%ymm9, 288(%[out])\n\t"
        "vmovaps %%ymm10, 320(%[out])\n\t" "vmovaps %%ymm11, 352(%[out])\n\t"
        : [x] "+r"(x), [w] "+r"(w), [pairs] "+r"(pairs)
        : [s] "r"(s), [s3] "r"(s3), [s5] "r"(s5), [out] "r"(out), [high] "m"(*(const uint32_t(*)[8])high)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
          "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc");
#undef KV_ROWS
#undef KV_FMA2
    for (int m = 0; m < 6; ++m) acc[m][0] = _mm256_load_ps(out + 16 * m), acc[m][1] = _mm256_load_ps(out + 16 * m + 8);
}

#define BLOCK_ROWS(R) \
    case R: block_rows(xf, k, R, wb, acc); break;

/* The tile with AVX2 and FMA: NX (1..TILE_M) rows of x as floats (k apart), each block of
 * the panel six rows at a time (the rest up to AVX2_MR at a time), bias added, rounded to bfloat16 once. A weight block widened
 * to floats once per tile and multiplied 5 rows at a time was 1.3-1.5x slower (the same bits):
 * its loads, not the FMAs, set the pace. */
static void tile(const float *x, int64_t x_stride, const int NX, const uint16_t *wp, int64_t bstride,
                 const int NR, int k, const uint16_t *bias, uint16_t *y, int64_t n) {
    (void)x_stride; /* rows_as_floats' rows, k apart */
    for (int j = 0; j < NR; ++j) {
        float b[GEMM_VEC] = {0};
        if (bias != NULL) to_float(bias + j * GEMM_VEC, DTYPE_BF16, b, GEMM_VEC);
        for (int m0 = 0, rows; m0 < NX; m0 += rows) {
            __m256 acc[AVX2_BLOCK][2];
            const int left = NX - m0;
            /* blocks of six rows, the last few as 6 + 3, 4 + 4, 4 + 3 or 4 + 1: a block of up to four
             * rows takes as long as one of four (its sums' latency sets the pace) */
            rows = left >= 9 || left == AVX2_BLOCK ? AVX2_BLOCK : left > AVX2_MR ? AVX2_MR : left;
            const float *xf = x + (int64_t)m0 * k;
            const uint16_t *wb = wp + j * bstride;
            switch (rows) { /* constant row counts: the accumulators stay in registers */
                BLOCK_ROWS(1)
#if AVX2_MR > 2
                BLOCK_ROWS(2)
#endif
#if AVX2_MR > 3
                BLOCK_ROWS(3)
#endif
#if AVX2_MR > 4
                BLOCK_ROWS(4)
#endif
#if AVX2_MR > 5
                BLOCK_ROWS(5)
#endif
                case AVX2_BLOCK: block6(xf, k, wb, acc); break;
                default: block_rows(xf, k, AVX2_MR, wb, acc); break;
            }
            store_rows(acc, rows, b, y + m0 * n + j * GEMM_VEC, n);
        }
    }
}
#endif

#if GEMM_AVX512
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
static void tile_any(const uint16_t *x, int64_t x_stride, int rows, const uint16_t *wp, int64_t bstride, int nr,
                     int k, const uint16_t *bias, uint16_t *y, int64_t n) {
    if (nr == 3) {
        TILE_ROWS(3)
    } else if (nr == 2) {
        TILE_ROWS(2)
    } else {
        TILE_ROWS(1)
    }
}
#else
static void tile_any(const float *x, int64_t x_stride, int rows, const uint16_t *wp, int64_t bstride, int nr,
                     int k, const uint16_t *bias, uint16_t *y, int64_t n) {
    tile(x, x_stride, rows, wp, bstride, nr, k, bias, y, n);
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
#if GEMM_AVX512
        const uint16_t *xs = x + (int64_t)m0 * x_stride; /* the tiles read bfloat16 x as it is */
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
