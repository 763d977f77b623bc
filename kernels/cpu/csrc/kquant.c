/* GGUF block-format weights multiplied as stored (engine/layers/gguf_linear.py calls these through
 * kernels/cpu/bindings.py): the activations quantized once per call (kq_quantize), then every
 * weight row's dot with every activation row (kq_matmul), in tiles of weight rows by activation
 * rows so that a tile's weight rows stay in cache while the activation rows pass over them; rows
 * of a weight dequantized (kq_dequantize: embedding lookups, and panels where no vector dots were
 * built). The dots: kquant_avx512.c (AVX512-VNNI), kquant_avx2.c (AVX2), the portable loops here
 * (every CPU; also what tests compare the vector paths with). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kquant.h"

_Static_assert(sizeof(kq_act_t) == KQ_ACT_BYTES, "kq_act_t is KQ_ACT_BYTES (kquant.py reads it)");

/* ---- the portable dots: integer sums per sub-block, one float multiply per sub-block scale ---- */

static float dot_q4_0(const uint8_t *w, const kq_act_t *a, int k) {
    float sum = 0.f;
    for (int b = 0; b < k / 32; ++b) {
        const uint8_t *blk = w + 18 * b;
        const kq_act_t *A = a + b / 8;
        const int8_t *x = A->qs + (b % 8) * 32;
        int s = 0;
        for (int l = 0; l < 16; ++l) s += (blk[2 + l] & 15) * x[l] + (blk[2 + l] >> 4) * x[16 + l];
        s -= 8 * (A->bsums[(b % 8) * 2] + A->bsums[(b % 8) * 2 + 1]);
        sum += kq_half(blk) * A->d * (float)s;
    }
    return sum;
}

static float dot_q8_0(const uint8_t *w, const kq_act_t *a, int k) {
    float sum = 0.f;
    for (int b = 0; b < k / 32; ++b) {
        const uint8_t *blk = w + 34 * b;
        const int8_t *q = (const int8_t *)(blk + 2), *x = a[b / 8].qs + (b % 8) * 32;
        int s = 0;
        for (int l = 0; l < 32; ++l) s += q[l] * x[l];
        sum += kq_half(blk) * a[b / 8].d * (float)s;
    }
    return sum;
}

/* Q4_K (fifth bits NULL) and Q5_K: sub-block j's values are the low (j even) or high nibbles of
 * qs[32 (j / 2) ..], plus 16 for bit j of qh[l] */
static float dot_k45(const uint8_t *w, const kq_act_t *a, int k, int five) {
    const int bytes = five ? 176 : 144;
    float sum = 0.f;
    for (int i = 0; i < k / KQ_BLOCK; ++i) {
        const uint8_t *blk = w + (int64_t)bytes * i, *qh = five ? blk + 16 : NULL, *qs = blk + (five ? 48 : 16);
        int acc = 0, macc = 0;
        for (int j = 0; j < 8; ++j) {
            int sc, m;
            kq_scale_min(j, blk + 4, &sc, &m);
            const uint8_t *q = qs + 32 * (j / 2);
            const int8_t *x = a[i].qs + 32 * j;
            const int shift = 4 * (j & 1);
            int s = 0;
            for (int l = 0; l < 32; ++l) {
                const int v = ((q[l] >> shift) & 15) | (qh ? ((qh[l] >> j) & 1) << 4 : 0);
                s += v * x[l];
            }
            acc += sc * s;
            macc += m * (a[i].bsums[2 * j] + a[i].bsums[2 * j + 1]);
        }
        sum += a[i].d * (kq_half(blk) * (float)acc - kq_half(blk + 2) * (float)macc);
    }
    return sum;
}

static float dot_q4_k(const uint8_t *w, const kq_act_t *a, int k) { return dot_k45(w, a, k, 0); }
static float dot_q5_k(const uint8_t *w, const kq_act_t *a, int k) { return dot_k45(w, a, k, 1); }

/* the 128 values (0..63, the stored offset of 32 not taken off) of Q6_K chunk n, in order: low 4
 * bits from 64 bytes (values l and l + 32 in the low nibbles of bytes l and 32 + l, values 64 + l
 * and 96 + l in their high nibbles), high 2 bits from 32 (bits 2p of byte l for part p) */
static inline void q6_chunk(const uint8_t *blk, int n, uint8_t v[128]) {
    const uint8_t *L = blk + 64 * n, *H = blk + 128 + 32 * n;
    for (int l = 0; l < 32; ++l) {
        v[l] = (uint8_t)((L[l] & 15) | ((H[l] & 3) << 4));
        v[l + 32] = (uint8_t)((L[l + 32] & 15) | (((H[l] >> 2) & 3) << 4));
        v[l + 64] = (uint8_t)((L[l] >> 4) | (((H[l] >> 4) & 3) << 4));
        v[l + 96] = (uint8_t)((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4));
    }
}

static float dot_q6_k(const uint8_t *w, const kq_act_t *a, int k) {
    float sum = 0.f;
    for (int i = 0; i < k / KQ_BLOCK; ++i) {
        const uint8_t *blk = w + 210 * i;
        const int8_t *sc = (const int8_t *)(blk + 192);
        int acc = 0;
        for (int n = 0; n < 2; ++n) {
            uint8_t v[128];
            q6_chunk(blk, n, v);
            for (int g = 0; g < 8; ++g) {
                const int8_t *x = a[i].qs + 128 * n + 16 * g;
                int s = 0;
                for (int l = 0; l < 16; ++l) s += v[16 * g + l] * x[l];
                acc += sc[8 * n + g] * (s - 32 * a[i].bsums[8 * n + g]);
            }
        }
        sum += a[i].d * kq_half(blk + 208) * (float)acc;
    }
    return sum;
}

kq_dot_fn kq_dot_portable(int type) {
    switch (type) {
        case GGML_Q4_0: return dot_q4_0;
        case GGML_Q8_0: return dot_q8_0;
        case GGML_Q4_K: return dot_q4_k;
        case GGML_Q5_K: return dot_q5_k;
        case GGML_Q6_K: return dot_q6_k;
        default: return NULL;
    }
}

/* the one-row and several-row dots of the best instruction set built here (isa 0), or the
 * portable ones (isa 1: one row at a time, no several-row dots) */
#if KQ_ISA == 512
#define KQ_BEST(kind) kq_##kind##_avx512
#elif KQ_ISA == 256
#define KQ_BEST(kind) kq_##kind##_avx2
#else
#define KQ_BEST(kind) kq_##kind##_portable
static kq_dots_fn kq_dots_portable(int type) {
    (void)type;
    return NULL;
}
#endif

static kq_dot_fn dot_for(int type, int isa) { return isa == 1 ? kq_dot_portable(type) : KQ_BEST(dot)(type); }
static kq_dots_fn dots_for(int type, int isa) { return isa == 1 ? NULL : KQ_BEST(dots)(type); }

/* Which dots kq_matmul runs with isa 0: 512, 256 or 0 (read by kernels/cpu/bindings.py). */
int kq_isa(void) { return KQ_ISA; }

/* ---- activations ---- */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* a whole block as quantize_block computes it, 16 values a vector: the same maximum (a NaN
 * skipped as fmaxf skips it), the same products and the same rounding, half away from zero
 * (|v| + 0.5 truncated, the sign given back), so the same bytes on every build */
static void quantize_full_block(const float *x, kq_act_t *out) {
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < KQ_BLOCK; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), m);
    const float amax = _mm512_reduce_max_ps(m);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    out->d = amax / 127.f;
    const __m512 scale = _mm512_set1_ps(inv), half = _mm512_set1_ps(0.5f);
    for (int i = 0; i < KQ_BLOCK; i += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), scale);
        __m512i q = _mm512_cvttps_epi32(_mm512_add_ps(_mm512_abs_ps(v), half));
        q = _mm512_mask_sub_epi32(q, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_si512(), q);
        _mm_storeu_si128((__m128i *)(out->qs + i), _mm512_cvtepi32_epi8(q));
        out->bsums[i / 16] = (int16_t)_mm512_reduce_add_epi32(q);
    }
}
#endif

static void quantize_block(const float *x, int n, kq_act_t *out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (n == KQ_BLOCK) {
        quantize_full_block(x, out);
        return;
    }
#endif
    float amax = 0.f;
    for (int i = 0; i < n; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    out->d = amax / 127.f;
    for (int i = 0; i < KQ_BLOCK; ++i) {
        const float v = i < n ? x[i] * inv : 0.f;
        out->qs[i] = (int8_t)(v >= 0.f ? (int)(v + 0.5f) : -(int)(0.5f - v));
    }
    for (int g = 0; g < KQ_BLOCK / 16; ++g) {
        int s = 0;
        for (int l = 0; l < 16; ++l) s += out->qs[16 * g + l];
        out->bsums[g] = (int16_t)s;
    }
}

/* one row of k values of dtype into its ceil(k / KQ_BLOCK) blocks */
static void quantize_row(const char *x, int k, int dtype, kq_act_t *act) {
    const int elem = elem_size(dtype);
    float buf[KQ_BLOCK];
    for (int b = 0; b * KQ_BLOCK < k; ++b) {
        const int n = k - b * KQ_BLOCK < KQ_BLOCK ? k - b * KQ_BLOCK : KQ_BLOCK;
        to_float(x + (int64_t)b * KQ_BLOCK * elem, dtype, buf, n);
        quantize_block(buf, n, act + b);
    }
}

/* rows of x (dtype, rows x_stride elements apart, k values each) quantized per KQ_BLOCK values
 * into act: ceil(k / KQ_BLOCK) kq_act_t a row, a short last block zero-padded. 0 on success, 1
 * for a width that is not a multiple of 32. */
int kq_quantize(const void *x, int64_t x_stride, int rows, int k, int dtype, void *act, int num_threads) {
    if (k <= 0 || k % 32) return 1;
    const int nb = (k + KQ_BLOCK - 1) / KQ_BLOCK, elem = elem_size(dtype);
    const int threads = (int64_t)rows * k >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < rows; ++r) quantize_row((const char *)x + (int64_t)r * x_stride * elem, k, dtype, (kq_act_t *)act + (int64_t)r * nb);
    return 0;
}

/* ---- products ---- */

/* weight rows per tile, and activation rows per tile beyond the few-row case (a tile of 32 rows'
 * activations is ~75 KB at k = 2048: it stays in L2 while each weight row of the tile is read) */
#define KQ_TILE_N 16
#define KQ_TILE_M 32
/* widths whose quantized rows kq_linear_team keeps on the stack (wider: the heap), MAX_FUSED_ROWS
 * of them: ~110 KiB at 12288 */
#define KQ_MAX_WIDTH 12288

/* y[m][n] = dot(row, activation row m) + b for m in m0 .. m1 - 1 (act: row 0's blocks, nb a row;
 * y's rows y_stride elements of dtype apart): the several-row dots where they take the rows, one
 * row at a time for the rest */
static void row_products(const uint8_t *row, kq_dot_fn dot, kq_dots_fn dots, const kq_act_t *act, int nb, int k,
                         int m0, int m1, float b, void *y, int64_t y_stride, int n, int dtype) {
    const int elem = elem_size(dtype);
    for (int m = m0; m < m1;) {
        float v[KQ_ROWS];
        const kq_act_t *A = act + (int64_t)m * nb;
        int n_rows = dots != NULL && m1 - m >= 2 ? dots(row, A, nb, k, m1 - m, v) : 0;
        if (n_rows == 0) {
            v[0] = dot(row, A, k);
            n_rows = 1;
        }
        for (int r = 0; r < n_rows; ++r) {
            v[r] += b;
            from_float(&v[r], 1.f, dtype, (char *)y + ((int64_t)(m + r) * y_stride + n) * elem, 1);
        }
        m += n_rows;
    }
}

/* y[m][n] = dot(weight row n, activation row m) (+ bias[n]) for the rows of act (kq_quantize's,
 * of width k) and n_out weight rows of ggml type `type`, row_bytes apart (a shard of a wider
 * tensor may leave gaps); y and bias of dtype, y's rows y_stride elements apart. isa 1: the
 * portable dots whatever was built (tests). 0 on success, 1 for a type or width it does not take. */
int kq_matmul(const void *w, int64_t row_bytes, int type, int n_out, int k, const void *act, int rows,
              const void *bias, void *y, int64_t y_stride, int dtype, int isa, int num_threads) {
    if (KQ_IS_X16(type)) /* repacked: the GEMM's tiles at any row count (no portable dots) */
        return isa == 1 ? 1 : kq_gemm(w, row_bytes, type, n_out, k, act, rows, bias, y, y_stride, dtype, num_threads);
    const kq_dot_fn dot = dot_for(type, isa);
    const kq_dots_fn dots = dots_for(type, isa);
    const int block = type == GGML_Q4_0 || type == GGML_Q8_0 ? 32 : KQ_BLOCK;
    if (dot == NULL || k <= 0 || k % block || rows < 0 || n_out < 0) return 1;
    const int nb = (k + KQ_BLOCK - 1) / KQ_BLOCK, elem = elem_size(dtype);
    const int tile_m = rows <= MAX_FUSED_ROWS ? (rows > 0 ? rows : 1) : KQ_TILE_M;
    const int tiles_n = (n_out + KQ_TILE_N - 1) / KQ_TILE_N, tiles_m = (rows + tile_m - 1) / tile_m;
    const int threads = (int64_t)n_out * k * (rows > 0 ? rows : 1) >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int tn = 0; tn < tiles_n; ++tn)
        for (int tm = 0; tm < tiles_m; ++tm) {
            const int n_end = (tn + 1) * KQ_TILE_N < n_out ? (tn + 1) * KQ_TILE_N : n_out;
            const int m_end = (tm + 1) * tile_m < rows ? (tm + 1) * tile_m : rows;
            for (int n = tn * KQ_TILE_N; n < n_end; ++n) {
                const uint8_t *row = (const uint8_t *)w + (int64_t)n * row_bytes;
                float b = 0.f;
                if (bias != NULL) to_float((const char *)bias + (int64_t)n * elem, dtype, &b, 1);
                row_products(row, dot, dots, (const kq_act_t *)act, nb, k, tm * tile_m, m_end, b, y, y_stride, n,
                             dtype);
            }
        }
    return 0;
}

/* ---- a GGUF weight in the fused decode step (csrc/decode_row.c, through linear_rows_team) ---- */

/* whether kq_linear_team takes L: vector dots built, each part's type among them, its parts' rows
 * adding up to n_out, its width whole blocks of every part's type */
int kq_linear_takes(const lin_t *L) {
    if (L->kind != W_GGUF || KQ_ISA == 0 || L->w == NULL || L->row_bytes < 1 || L->k_in <= 0) return 0;
    const kq_part_t *parts = (const kq_part_t *)L->w;
    int rows = 0;
    for (int64_t p = 0; p < L->row_bytes; ++p) {
        const int block = parts[p].type == GGML_Q4_0 || parts[p].type == GGML_Q8_0 ? 32 : KQ_BLOCK;
        const int x16 = KQ_IS_X16(parts[p].type);
        if (x16 ? KQ_ISA != 512 || parts[p].rows % KQ_X16_LANES : dot_for(parts[p].type, 0) == NULL) return 0;
        if (L->k_in % block || parts[p].rows < 1) return 0;
        rows += parts[p].rows;
    }
    return rows == L->n_out;
}

/* the output rows [*begin, *end) that thread t of a team of T takes in kq_linear_team: one run of
 * rows, the runs' weight bytes as even as runs of TEAM_ROWS allow (parts of different types have
 * rows of different sizes), so that each thread streams one contiguous stretch of every part it
 * meets. (Runs of 16 rows dealt out in turn, as a static schedule of 16 gives, read the weights at
 * half the rate at one row: docs/design/gguf_kquants.md.) */
#define TEAM_ROWS 32 /* 64 bytes of bfloat16 outputs: no cache line of y written by two threads */
/* a part's bytes a row (an X16 part's row_bytes are a panel's, of KQ_X16_LANES rows) */
static int64_t bytes_a_row(const kq_part_t *part) {
    return KQ_IS_X16(part->type) ? part->row_bytes / KQ_X16_LANES : part->row_bytes;
}

static void team_share(const kq_part_t *parts, int n_parts, int t, int T, int *begin, int *end) {
    int64_t total = 0;
    int rows = 0;
    for (int p = 0; p < n_parts; ++p) {
        total += (int64_t)parts[p].rows * bytes_a_row(&parts[p]);
        rows += parts[p].rows;
    }
    int at[2];
    for (int e = 0; e < 2; ++e) { /* the first row whose bytes before it reach (t + e) / T of the total */
        const int64_t goal = total * (t + e) / T;
        int64_t before = 0;
        int row = 0, p = 0;
        while (p < n_parts && before + (int64_t)parts[p].rows * bytes_a_row(&parts[p]) <= goal) {
            before += (int64_t)parts[p].rows * bytes_a_row(&parts[p]);
            row += parts[p++].rows;
        }
        if (p < n_parts) row += (int)((goal - before + bytes_a_row(&parts[p]) - 1) / bytes_a_row(&parts[p]));
        row = (row + TEAM_ROWS / 2) / TEAM_ROWS * TEAM_ROWS;
        at[e] = t + e == T ? rows : (row < rows ? row : rows);
    }
    *begin = at[0];
    *end = at[1];
}

/* y = x L^T (+ bias) for rows (1..MAX_FUSED_ROWS) rows of x, by every thread of the enclosing team,
 * no barrier at the end (as linear_rows_team): each thread quantizes the rows for itself (xh, the
 * bfloat16 input, where given, as the per-op path quantizes its bfloat16 rows; else xf) and takes
 * its share of the output rows (team_share); a row's products are those of kq_matmul. */
void kq_linear_team(const lin_t *L, int rows, const float *xf, const void *xh, void *y, int dtype) {
    if (!kq_linear_takes(L) || rows < 1 || rows > MAX_FUSED_ROWS) { /* a caller's bug */
        fprintf(stderr, "kvserve kernels: kq_linear_team called with a weight or row count it refuses\n");
        abort();
    }
    const int k = L->k_in, nb = (k + KQ_BLOCK - 1) / KQ_BLOCK;
    kq_act_t act[MAX_FUSED_ROWS * ((KQ_MAX_WIDTH + KQ_BLOCK - 1) / KQ_BLOCK)];
    kq_act_t *a = k <= KQ_MAX_WIDTH ? act : malloc(sizeof(kq_act_t) * (size_t)rows * (size_t)nb);
    if (a == NULL) {
        fprintf(stderr, "kvserve kernels: out of memory quantizing activations for a GGUF weight\n");
        abort();
    }
    for (int r = 0; r < rows; ++r) {
        if (xh != NULL)
            quantize_row((const char *)xh + (int64_t)r * k * elem_size(DTYPE_BF16), k, DTYPE_BF16, a + (int64_t)r * nb);
        else
            quantize_row((const char *)(xf + (int64_t)r * k), k, DTYPE_F32, a + (int64_t)r * nb);
    }
    const kq_part_t *parts = (const kq_part_t *)L->w;
    const int elem = elem_size(dtype);
    int32_t pairs[MAX_FUSED_ROWS * ((KQ_MAX_WIDTH + KQ_BLOCK - 1) / KQ_BLOCK) * 4];
    int32_t *pb = NULL; /* the rows' minimum pairs, made at the first X16 part */
    int begin, end; /* this thread's rows, in whichever parts they fall */
    team_share(parts, (int)L->row_bytes, omp_get_thread_num(), omp_get_num_threads(), &begin, &end);
    for (int p = 0, first = 0; p < L->row_bytes && first < end; first += parts[p++].rows) {
        const int lo = begin > first ? begin : first, hi = end < first + parts[p].rows ? end : first + parts[p].rows;
        if (KQ_IS_X16(parts[p].type)) {
            if (lo >= hi) continue;
            if (pb == NULL && parts[p].type == KQ_Q4_K_X16) {
                pb = k <= KQ_MAX_WIDTH ? pairs : malloc(sizeof(int32_t) * 4 * (size_t)rows * (size_t)nb);
                if (pb == NULL) {
                    fprintf(stderr, "kvserve kernels: out of memory for a GGUF weight's activation sums\n");
                    abort();
                }
                kq_min_pairs(a, (int64_t)rows * nb, pb);
            }
            kq_x16_range((const uint8_t *)parts[p].w, parts[p].row_bytes, parts[p].type, lo - first, hi - first, nb,
                         a, parts[p].type == KQ_Q4_K_X16 ? pb : NULL, rows, L->bias, y, L->n_out, first, dtype);
            continue;
        }
        const kq_dot_fn dot = dot_for(parts[p].type, 0);
        const kq_dots_fn dots = dots_for(parts[p].type, 0);
        for (int n = lo; n < hi; ++n) {
            const uint8_t *row = (const uint8_t *)parts[p].w + (int64_t)(n - first) * parts[p].row_bytes;
            float b = 0.f;
            if (L->bias != NULL) to_float((const char *)L->bias + (int64_t)n * elem, dtype, &b, 1);
            row_products(row, dot, dots, a, nb, k, 0, rows, b, y, L->n_out, n, dtype);
        }
    }
    if (a != act) free(a);
    if (pb != NULL && pb != pairs) free(pb);
}

/* ---- dequantization ---- */

static void dequantize_row_f32(const uint8_t *w, int type, int k, float *out) {
    if (type == GGML_Q4_0 || type == GGML_Q8_0) {
        for (int b = 0; b < k / 32; ++b) {
            const uint8_t *blk = w + (type == GGML_Q4_0 ? 18 : 34) * b;
            const float d = kq_half(blk);
            for (int l = 0; l < 32; ++l)
                out[32 * b + l] = type == GGML_Q8_0 ? d * (float)(int8_t)blk[2 + l]
                                                    : d * (float)(((blk[2 + l % 16] >> (4 * (l / 16))) & 15) - 8);
        }
        return;
    }
    for (int i = 0; i < k / KQ_BLOCK; ++i) {
        float *o = out + KQ_BLOCK * i;
        if (type == GGML_Q6_K) {
            const uint8_t *blk = w + 210 * i;
            const float d = kq_half(blk + 208);
            for (int n = 0; n < 2; ++n) {
                uint8_t v[128];
                q6_chunk(blk, n, v);
                for (int j = 0; j < 128; ++j)
                    o[128 * n + j] = d * (float)((const int8_t *)(blk + 192))[(128 * n + j) / 16] * (float)(v[j] - 32);
            }
            continue;
        }
        const int five = type == GGML_Q5_K;
        const uint8_t *blk = w + (five ? 176 : 144) * i, *qs = blk + (five ? 48 : 16);
        const float d = kq_half(blk), dmin = kq_half(blk + 2);
        for (int j = 0; j < 8; ++j) {
            int sc, m;
            kq_scale_min(j, blk + 4, &sc, &m);
            for (int l = 0; l < 32; ++l) {
                const int q = ((qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 15) | (five ? ((blk[16 + l] >> j) & 1) << 4 : 0);
                o[32 * j + l] = d * (float)sc * (float)q - dmin * (float)m;
            }
        }
    }
}

/* out[i] = row ids[i] of the weight (rows 0 .. n - 1 where ids is NULL) in dtype, out's rows
 * out_stride elements apart. 0 on success, 1 for a type or width it does not take, 2 when memory
 * could not be had. */
int kq_dequantize(const void *w, int64_t row_bytes, int type, int k, const int64_t *ids, int n, void *out,
                  int64_t out_stride, int dtype, int num_threads) {
    const int block = type == GGML_Q4_0 || type == GGML_Q8_0 ? 32 : KQ_BLOCK;
    if ((!KQ_IS_X16(type) && kq_dot_portable(type) == NULL) || k <= 0 || k % block) return 1;
    const int elem = elem_size(dtype);
    const int threads = (int64_t)n * k >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
    float *bufs = malloc(sizeof(float) * (size_t)k * (size_t)threads);
    if (bufs == NULL) return 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int i = 0; i < n; ++i) {
        float *buf = bufs + (size_t)omp_get_thread_num() * (size_t)k;
        const int64_t r = ids != NULL ? ids[i] : i;
        if (KQ_IS_X16(type)) kq_x16_dequantize_row((const uint8_t *)w, row_bytes, type, r, k, buf);
        else dequantize_row_f32((const uint8_t *)w + r * row_bytes, type, k, buf);
        from_float(buf, 1.f, dtype, (char *)out + (int64_t)i * out_stride * elem, k);
    }
    free(bufs);
    return 0;
}
