/* What the CPU kernels share: element types and their conversion to and from float, the shape
 * limits. */
#ifndef KVSERVE_COMMON_H
#define KVSERVE_COMMON_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

/* below this many values a row-parallel kernel runs on one thread: waking the others costs more */
#define PARALLEL_MIN_ELEMENTS (1 << 16)

/* Bytes per element of a DTYPE_* */
static inline int elem_size(int dtype) { return dtype == DTYPE_BF16 ? 2 : 4; }

/* A KV cache's element kind: DTYPE_F32 or DTYPE_BF16 (the model's), or KV_INT8: each row (one
 * token of one KV head) is head_dim int8 values followed by their float32 scale (value = int8 *
 * scale, scale = the row's largest magnitude / 127); cpu_kernels.py reads KV_INT8. */
#define KV_INT8 2
#define KV_SCALE_BYTES 4
/* bytes of one value in a cache of this kind (a KV_INT8 row's scale aside) */
static inline int kv_elem_size(int cache_dtype) { return cache_dtype == KV_INT8 ? 1 : elem_size(cache_dtype); }
static inline int64_t kv_row_bytes(int cache_dtype, int head_dim) {
    return (int64_t)head_dim * kv_elem_size(cache_dtype) + (cache_dtype == KV_INT8 ? KV_SCALE_BYTES : 0);
}
/* whether a cache of cache_dtype goes with queries and K/V of dtype: the same type, or KV_INT8 */
static inline int kv_cache_takes(int dtype, int cache_dtype) {
    return cache_dtype == dtype || cache_dtype == KV_INT8;
}
static inline float kv_row_scale(const char *row, int head_dim) {
    float s;
    memcpy(&s, row + head_dim, sizeof s);
    return s;
}

/* The longest head the kernels take, and the most query heads per KV head (attention); also read
 * by cpu_kernels.py. */
#ifndef MAX_HEAD_DIM
#define MAX_HEAD_DIM 512
#endif
/* prompt tokens of one sequence in a row that the attention kernel takes as tiles (attention.c);
 * shorter runs, decodes and speculative verification rows (at most 1 + MAX_SPECULATIVE_TOKENS of
 * engine/config.py) are one query per item, all with the same arithmetic */
#define PREFILL_TILE_MIN_RUN 32
#ifndef MAX_GROUP
#define MAX_GROUP 64
#endif

typedef union { uint32_t u; float f; } bits32;

/* Few-row linears (linear.c), shared with the fused decode row (decode_row.c). */
/* a weight's element kind (W_F32 and W_BF16 are the DTYPE_* codes; cpu_kernels.py reads W_INT8 and
 * W_INT4) */
#define W_F32 0
#define W_BF16 1
#define W_INT8 2
/* int4: two 4-bit values a byte, per INT4_GROUP inputs a scale and a minimum: w = scale * q + min
 * (Q4_1's scheme), rows in linear.c's superblocks of SB_GROUPS groups (INT4_GROUP and SB_GROUPS
 * are also read by quantization.py) */
#define W_INT4 3
#define INT4_GROUP 32
#define SB_GROUPS 16
/* int4 rows' widths are multiples of this (the kernels take x 64 values at a time) */
#define INT4_WIDTH 64
/* a GGUF block-format weight (csrc/kquant.c multiplies it; gemm.c refuses it): lin_t.w points to
 * row_bytes kq_part_t (kquant.h), its output rows in order */
#define W_GGUF 4

/* int4 weights: superblocks of 16 groups of INT4_GROUP inputs (512 inputs; a row's last one may
 * hold fewer groups, G). vpdpbusd's int32 lanes each sum 4 products; a group's 32 values are 8
 * quads, spread over P = 16 / G lanes (G dividing 16; else P = 1) and S = 8 / P steps: quad u of
 * group g sits in step u / P at lane g P + u % P (bytes 4 lane .. 4 lane + 3). Two steps share a
 * vector of 4 G P bytes (step 2t in the low 4 bits, 2t + 1 in the high ones); a single step (G =
 * 2) is 32 bytes, its first 32 values low, the rest high. After a superblock's steps the lanes
 * hold whole groups' sums (P lanes each): one conversion and one multiply-add by the groups'
 * scales finish up to 16 groups. (quantization.py's _pack_int4 writes this layout; quant_dots.h
 * multiplies it, dequantize.c unpacks it.) */
#define SB_INPUTS (SB_GROUPS * INT4_GROUP)
/* groups in superblock sb of a row of num_groups groups, and lanes per group in one of G groups */
static inline int sb_size(int num_groups, int sb) {
    return num_groups - sb * SB_GROUPS < SB_GROUPS ? num_groups - sb * SB_GROUPS : SB_GROUPS;
}
static inline int sb_lanes(int G) { return SB_GROUPS % G == 0 ? SB_GROUPS / G : 1; }
/* bytes of an int4 row's per-group scales and minimums (lin_t.groups) */
static inline int64_t group_row_bytes(int k_in) { return (int64_t)(k_in / INT4_GROUP) * 4; }
/* the kernels that need AVX-512 with BW and VL (linear.c's team kernel, decode_row.c, dequantize.c) */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512_TEAM 1
#else
#define HAVE_AVX512_TEAM 0
#endif
/* linear_avx2.c's few-row int8 and int4 kernels: CPUs with AVX2, FMA and F16C but not the above */
#if !HAVE_AVX512_TEAM && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_AVX2_ROWS 1
#else
#define HAVE_AVX2_ROWS 0
#endif
/* x quantized per this many values for the integer dots (both kernels), which take x this many
 * values at a time (widths a multiple of it) */
#define Q8_BLOCK 32
#define Q8_CHUNK 64
typedef struct {
    const void *w;           /* [n_out][k_in], rows row_bytes apart */
    int64_t row_bytes;
    int kind;                /* W_* */
    const void *scales;      /* int8 weights: one per row, in the activations' dtype; else NULL */
    const void *bias;        /* or NULL */
    int n_out, k_in;
    const void *groups;      /* int4 weights: per row, each INT4_GROUP inputs' scale, then their
                              * minimums (float16); else NULL */
    const void *packed;      /* bfloat16 weights: gemm.c's packed copy (gemm_bf16_pack), or NULL */
} lin_t;
/* whether L's int4 weight is one the kernels lay out (its scales and minimums given, its width a
 * multiple of INT4_WIDTH) */
static inline int int4_layout(const lin_t *L) { return L->k_in % INT4_WIDTH == 0 && L->groups != NULL; }
/* rows of x the team kernel takes (and the fused decode step); also read by cpu_kernels.py */
#define MAX_FUSED_ROWS 8
/* linear.c's few-row projection as a team's part (no barrier at the end) */
void linear_rows_team(const lin_t *L, int rows, const float *xf, const void *xh, void *y, int dtype);
/* the same for a W_GGUF weight (kquant.c: the block dots; linear.c and linear_avx2.c hand it over),
 * and whether it takes L (its parts' types have vector dots in this build) */
void kq_linear_team(const lin_t *L, int rows, const float *xf, const void *xh, void *y, int dtype);
int kq_linear_takes(const lin_t *L);
int linear_takes(const lin_t *L);
int linear_rows(const lin_t *L, int rows, const void *x, void *y, int dtype, int num_threads);

/* gemm.c's blocking: output features per packed block (one vector of floats), rows of x per
 * tile, blocks per tile, rows of x per pass over the weight panels (read by its tests) */
#define GEMM_VEC 16
#define GEMM_MR 8
#define GEMM_NR 3
#define GEMM_MC 512
/* gemm_bf16's work as a team's part (an OpenMP for over the panels, no barrier at the end); glu:
 * the weight is gate|up (n / 2 rows each) and y [m][n / 2] gets silu(gate) * up */
void gemm_bf16_team(const void *xv, int64_t x_stride, int m, const void *packed, const void *biasv, int n, int k,
                    void *yv, int glu);
int gemm_bf16_available(void);
/* dequantize.c: row n of an int8 or int4 weight in dtype (gemm.c dequantizes its panels with it) */
int dequantize_takes(const lin_t *L);
void dequantize_row(const lin_t *L, int n, int dtype, void *out);

/* The elementwise kernels (elementwise.c), shared with the fused decode row. */
int rms_norm(const void *x, int64_t x_outer, int64_t x_inner, void *residual, int64_t res_outer,
             const void *weight, int weight_dtype, void *out, int64_t out_outer, int64_t out_inner,
             int outer, int inner, int width, float eps, int dtype, int num_threads);
int rotary(void *x, int64_t x_token, int64_t x_head, int tokens, int heads, int width, const void *cos,
           const void *sin, int64_t cs_stride, int dtype, int num_threads);
int store_kv(void *k, int64_t k_token, int64_t k_head, void *v, int64_t v_token, int64_t v_head,
             const int64_t *slots, int tokens, int kv_heads, int width, void *k_cache, void *v_cache,
             int64_t cache_slots, int dtype, int cache_dtype);
int silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t out_stride, int rows, int width,
                 int dtype, int num_threads);
void silu_mul_row(const void *gate, const void *up, void *out, int width, int dtype);
void gelu_tanh_mul_row(const void *gate, const void *up, void *out, int width, int dtype);

/* Attention (attention.c), shared with the fused decode row. */

/* gated_delta.c: the pieces of a hybrid's layers (Qwen3.5) that the fused step (decode_row.c
 * decode_row_hybrid) shares with the per-op path's entry points, so both give the same bits */
#define GDN_MAX_HEADS 256
int gdn_decode_takes(int Hk, int H, int dk, int dv, int K);
void gdn_gate_values(const void *b, const void *a, int dtype, const float *A_log, const float *dt_bias, int h0,
                     int n, float *g, float *beta);
void gdn_decode_item(const char *in, const void *conv_w, char *window, int K, int dtype, const float *g,
                     const float *beta, int Hk, int H, int dk, int dv, int hk, float *S, float *out);
void gdn_gated_norm_row(const float *rule, const void *z, const void *w, int dv, float eps, int dtype, void *out);
void sigmoid_gate_row(void *x, const void *gate, int n, int dtype);

/* A sliding window of window keys (0: none) over a query that sees ctx keys: its block table from
 * the block of the window's first key on (blocks before it may be freed), the keys left in *ctx,
 * and in *skip those of that block before the window (fewer than a block: attend_one skips them). */
static inline const int32_t *window_view(const int32_t *table, int window, int block_size, int *ctx,
                                         int *skip) {
    *skip = 0;
    if (window <= 0 || *ctx <= window) return table;
    const int first = (*ctx - window) / block_size;
    *ctx -= first * block_size;
    *skip = *ctx - window;
    return table + first;
}
size_t attend_scratch_floats(int group, int head_dim, int block_size, int max_ctx);
void attend_one(const void *k_cache, const void *v_cache, int64_t num_blocks, int block_size,
                const int32_t *table, int ctx, int skip, int kv_head, const char *q0, int64_t q_head_bytes,
                float scale, int group, int head_dim, int dtype, int cache_dtype, float *scratch, char *out0,
                int64_t out_head_bytes, float soft_cap, const float *sinks);

/* n elements of src (DTYPE_*) as floats in dst */
static inline void to_float(const void *src, int dtype, float *restrict dst, int n) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int i = 0; i < n; ++i) {
            bits32 x = {.u = (uint32_t)s[i] << 16};
            dst[i] = x.f;
        }
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

static inline void from_float(const float *restrict src, float scale, int dtype, void *dst, int n) {
    if (dtype == DTYPE_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int i = 0; i < n; ++i) {
            bits32 x = {.f = src[i] * scale};
            const uint32_t rounded = (x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16; /* nearest even */
            d[i] = (uint16_t)((x.u & 0x7fffffffu) > 0x7f800000u ? (x.u >> 16) | 0x40u : rounded);
        }
    } else {
        float *d = (float *)dst;
        for (int i = 0; i < n; ++i) d[i] = src[i] * scale;
    }
}

/* y[m][n0 + j] (rows L->n_out apart) for NX rows' NW outputs' sums acc[m * NW + j]: scaled
 * (int8 weights), biased, rounded once (the few-row kernels' last step) */
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

/* exp(x) in a form the compiler vectorizes: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its
 * Taylor polynomial to r^7 (relative error < 2e-7 there), 2^n put into the exponent bits.
 * Below -87 the result is 0 (float's smallest normal is e^-87.3); above 88 it is e^88. */
static inline float fast_exp(float x) {
    const float clamped = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_roundf(clamped * 1.44269504088896341f);
    const float r = (clamped - n * 0.693145751953125f) - n * 1.42860682030941723e-06f;
    float p = 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    bits32 scale = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return x < -87.0f ? 0.f : p * scale.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* fast_exp's arithmetic on 16 lanes (rounding to nearest even instead of away from zero) */
static inline __m512 exp16(__m512 x) {
    const __m512 c = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-06f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), c));
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
    return _mm512_mask_mov_ps(_mm512_mul_ps(p, _mm512_castsi512_ps(e)), tiny, _mm512_setzero_ps());
}

/* from_float's rounding of 16 floats to bfloat16 (nearest even; a NaN stays a quiet NaN) */
static inline __m256i bf16_round16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                 _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

/* 16 bfloat16 values at p as floats */
static inline __m512 bf16_load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

#endif
