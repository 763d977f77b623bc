/* gemm.c's tiles on AVX2 with FMA (included by gemm.c where no AVX-512 is targeted): the packed
 * layout read as two 256-bit halves of 8 features, each bfloat16 pair widened to floats by a shift
 * (the even input) and a mask (the odd one), multiplied in float FMAs against x widened once per
 * thread and GEMM_MC rows (gemm.c's rows_as_floats); each output's sum runs over k in one order
 * (even then odd input of each pair) whatever rows are beside it. */
#ifndef KVSERVE_GEMM_AVX2_H
#define KVSERVE_GEMM_AVX2_H

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

/* rows (1..TILE_M) of x against nr (1..GEMM_NR) blocks */
static void tile_any(const float *x, int64_t x_stride, int rows, const uint16_t *wp, int64_t bstride, int nr,
                     int k, const uint16_t *bias, uint16_t *y, int64_t n) {
    tile(x, x_stride, rows, wp, bstride, nr, k, bias, y, n);
}

#endif
