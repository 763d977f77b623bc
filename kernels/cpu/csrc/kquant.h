/* GGUF block formats multiplied as stored (kquant.c drives them; the dots live in kquant.c for
 * the portable loops, kquant_avx2.c for AVX2 and kquant_avx512.c for AVX512-VNNI). The block
 * layouts are ggml's (docs/design/gguf_kquants.md); the activations are quantized per KQ_BLOCK
 * values to int8 with one float scale and the sums of each 16 (what the minimums and offsets of
 * the weights multiply). */
#ifndef KVSERVE_KQUANT_H
#define KVSERVE_KQUANT_H
#include <stdint.h>

#include "common.h"

/* ggml's type codes (also read by engine/layers/gguf_linear.py) */
#define GGML_Q4_0 2
#define GGML_Q8_0 8
#define GGML_Q4_K 12
#define GGML_Q5_K 13
#define GGML_Q6_K 14

/* values per superblock (K-quants) and per activation block */
#define KQ_BLOCK 256

/* one activation block: int8 values (zeros past a row's end), their scale (value = d q) and the
 * sums of each 16 values; sizeof(kq_act_t) is KQ_ACT_BYTES (read by kernels/cpu/bindings.py) */
typedef struct {
    float d;
    int8_t qs[KQ_BLOCK];
    int16_t bsums[KQ_BLOCK / 16];
} kq_act_t;
#define KQ_ACT_BYTES 292

/* Q4_K repacked at load into the int8 GEMM's panels (kquant_x16.c, AVX512-VNNI builds only;
 * docs/design/gguf_kquants.md): a weight of n_out rows (a multiple of KQ_X16_LANES) as n_out / 16
 * panels of 16 rows, each k / 256 superblocks of KQ_X16_SUPER bytes: per sub-block s of 32 values,
 * 4 vectors of 64 bytes at 256 s (vector c: byte 4 l + b holds value 32 s + 4 c + b of row l in its
 * low nibble and value 32 s + 16 + 4 c + b in its high one), then the rows' 6-bit scales (a byte a
 * row, 16 bytes a sub-block, at 2048), the minimums as byte pairs (m_2q, m_2q+1) a row (32 bytes a
 * pair q, at 2176) and the rows' d and dmin as float16 (at 2304 and 2336): 2368 bytes against the
 * 16 rows' 2304 as stored. A kernel reads it as it is, no unpacking into a buffer: the GEMM's rows
 * are the block dots' bit for bit (the dots' canonical order). Its type code is not ggml's. */
#define KQ_Q4_K_X16 268
#define KQ_X16_LANES 16
#define KQ_X16_SUPER 2368
/* Q6_K repacked likewise (KQ_Q6_K_X16), panels of 16 rows, k / 256 superblocks of KQ_Q6X16_SUPER
 * bytes: per pair t of 16-value sub-blocks (2t, 2t + 1), 4 vectors of 64 bytes at 256 t (vector c:
 * byte 4 l + b holds the low 4 bits of value 32 t + 4 c + b of row l in its low nibble, of value
 * 32 t + 16 + 4 c + b in its high one); per quad u of sub-blocks, 4 vectors at 2048 + 256 u (vector
 * c: byte 4 l + b holds the 2 high bits of value 16 (4 u + j) + 4 c + b at bits 2 j, 2 j + 1); then
 * the rows' int8 scales (16 bytes a sub-block, at 3072), the same as pairs (sc_2q, sc_2q+1) a row (32
 * bytes a pair q, at 3328) and the rows' d as float16 (at 3584): 3616 bytes against the 16 rows'
 * 3360 as stored. A kernel rebuilds each superblock's bytes once for all its activation rows. */
#define KQ_Q6_K_X16 269
#define KQ_Q6X16_SUPER 3616
#define KQ_IS_X16(t) ((t) == KQ_Q4_K_X16 || (t) == KQ_Q6_K_X16)

/* one part of a W_GGUF lin_t (common.h): `rows` output rows of ggml type `type`, row_bytes apart */
typedef struct {
    const void *w;
    int64_t row_bytes;
    int32_t type, rows;
} kq_part_t;

/* a weight row's dot with a quantized activation row of k values (k a multiple of the type's
 * block) */
typedef float (*kq_dot_fn)(const uint8_t *w, const kq_act_t *a, int k);

/* a weight row's dots with the first n of `rows` (>= 2) quantized activation rows (row r's blocks
 * at a + r * row_blocks), each weight vector unpacked once for all of them: out[0 .. n - 1], n
 * returned (the most its instances take, at most rows; 0: none, dot one row at a time) */
#define KQ_ROWS 8
typedef int (*kq_dots_fn)(const uint8_t *w, const kq_act_t *a, int64_t row_blocks, int k, int rows, float *out);

/* The dots of a vector file are written once per type as an always-inlined function of R rows
 * (R a constant at each instance, so that every row's arithmetic is the same at any R):
 * KQ_ONE_AND_MANY(name, rows_fn, most) makes dot_<name> (R = 1) and dots_<name> (R = 8, 4 or 2,
 * none above `most`) of it; KQ_TABLES(isa) the file's kq_dot_<isa> and kq_dots_<isa> from them
 * (dot_q4_0 and the dots of Q8_0, Q4_K, Q5_K, Q6_K), KQ_NO_TABLES(isa) the two where a build
 * lacks the instructions: one dispatch for every instruction set. */
#define KQ_ROWS_FN static inline __attribute__((always_inline)) void
#define KQ_Q4_K_ROWS(w, a, rb, k, R, out) k45_rows(w, a, rb, k, R, 0, out)
#define KQ_Q5_K_ROWS(w, a, rb, k, R, out) k45_rows(w, a, rb, k, R, 1, out)
#define KQ_ONE_AND_MANY(name, call, most)                                                              \
    static float dot_##name(const uint8_t *w, const kq_act_t *a, int k) {                             \
        float out;                                                                                    \
        call(w, a, 0, k, 1, &out);                                                                    \
        return out;                                                                                   \
    }                                                                                                 \
    static int dots_##name(const uint8_t *w, const kq_act_t *a, int64_t row_blocks, int k, int rows, float *out) { \
        if ((most) >= 8 && rows >= 8) {                                                               \
            call(w, a, row_blocks, k, ((most) >= 8 ? 8 : 1), out);                                    \
            return 8;                                                                                 \
        }                                                                                             \
        if (rows >= 4) {                                                                              \
            call(w, a, row_blocks, k, 4, out);                                                        \
            return 4;                                                                                 \
        }                                                                                             \
        if (rows >= 2) {                                                                              \
            call(w, a, row_blocks, k, 2, out);                                                        \
            return 2;                                                                                 \
        }                                                                                             \
        return 0;                                                                                     \
    }
#define KQ_TABLES(isa)                                                                                 \
    kq_dot_fn kq_dot_##isa(int type) {                                                                \
        switch (type) {                                                                               \
            case GGML_Q4_0: return dot_q4_0;                                                          \
            case GGML_Q8_0: return dot_q8_0;                                                          \
            case GGML_Q4_K: return dot_q4_k;                                                          \
            case GGML_Q5_K: return dot_q5_k;                                                          \
            case GGML_Q6_K: return dot_q6_k;                                                          \
            default: return NULL;                                                                     \
        }                                                                                             \
    }                                                                                                 \
    kq_dots_fn kq_dots_##isa(int type) {                                                              \
        switch (type) {                                                                               \
            case GGML_Q8_0: return dots_q8_0;                                                         \
            case GGML_Q4_K: return dots_q4_k;                                                         \
            case GGML_Q5_K: return dots_q5_k;                                                         \
            case GGML_Q6_K: return dots_q6_k;                                                         \
            default: return NULL;                                                                     \
        }                                                                                             \
    }
#define KQ_NO_TABLES(isa)                                                                              \
    kq_dot_fn kq_dot_##isa(int type) {                                                                \
        (void)type;                                                                                   \
        return NULL;                                                                                  \
    }                                                                                                 \
    kq_dots_fn kq_dots_##isa(int type) {                                                              \
        (void)type;                                                                                   \
        return NULL;                                                                                  \
    }

/* float of an IEEE half at p (unaligned) */
static inline float kq_half(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
    bits32 r;
    if (exp == 0x1f) {
        r.u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        r.u = sign | ((exp + 112) << 23) | (man << 13);
    } else { /* zero or subnormal: man * 2^-24 */
        r.f = (float)man * 5.9604644775390625e-08f;
        r.u |= sign;
    }
    return r.f;
}

/* scale and minimum of sub-block j of a Q4_K/Q5_K superblock's 12 scale bytes */
static inline void kq_scale_min(int j, const uint8_t *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

#if defined(__AVX2__)
#include <immintrin.h>
/* each of a Q4_K/Q5_K superblock's 8 minimums twice, as int16: madd with its 16 block sums gives
 * sub-block j's minimum times its sum in lane j (kept in vector lanes: a scalar sum over the
 * superblocks may be reassociated by the compiler differently for 1 and 4 rows) */
static inline __m256i kq_mins16(const int m[8]) {
    return _mm256_setr_epi16((short)m[0], (short)m[0], (short)m[1], (short)m[1], (short)m[2], (short)m[2],
                             (short)m[3], (short)m[3], (short)m[4], (short)m[4], (short)m[5], (short)m[5],
                             (short)m[6], (short)m[6], (short)m[7], (short)m[7]);
}
#endif

/* the dots of each instruction set, by type (NULL where a type has none there) */
kq_dot_fn kq_dot_portable(int type);
kq_dot_fn kq_dot_avx2(int type);
kq_dot_fn kq_dot_avx512(int type);
kq_dots_fn kq_dots_avx512(int type);
kq_dots_fn kq_dots_avx2(int type);

/* kquant_gemm.c's int8 GEMM (kq_matmul's arguments but isa); kq_matmul hands it X16 weights */
int kq_gemm(const void *w, int64_t row_bytes, int type, int n_out, int k, const void *act, int rows,
            const void *bias, void *y, int64_t y_stride, int dtype, int num_threads);
/* kq_gemm of an X16 weight (row_bytes: a panel's bytes), at any row count (kquant_x16.c) */
int kq_gemm_x16(const uint8_t *w, int64_t panel_bytes, int type, int n_out, int k, const void *act, int rows,
                const void *bias, void *y, int64_t y_stride, int dtype, int num_threads);
/* an X16 weight's output rows [lo, hi) (kquant_x16.c): y[m][col0 + n] = <row n, activation row m>
 * (+ bias[col0 + n]) for the `rows` activation rows of A (nsb blocks a row; pb their minimum pairs,
 * kq_min_pairs, for KQ_Q4_K_X16; NULL for KQ_Q6_K_X16), y of dtype with rows y_stride elements
 * apart; row n of the weight in panel n / 16, panels panel_bytes apart */
void kq_x16_range(const uint8_t *w, int64_t panel_bytes, int type, int lo, int hi, int nsb, const kq_act_t *A,
                  const int32_t *pb, int rows, const void *bias, void *y, int64_t y_stride, int col0, int dtype);
/* per activation block, its Q4_K minimum pairs (the sums of sub-blocks 2q and 2q + 1 as int16 in an
 * int32, q = 0..3): what the minimums' bytes multiply */
void kq_min_pairs(const kq_act_t *A, int64_t blocks, int32_t *pb);
/* row r of an X16 weight as floats (the values dequantize_row_f32 gives the row as stored) */
void kq_x16_dequantize_row(const uint8_t *w, int64_t panel_bytes, int type, int64_t r, int k, float *out);

/* which vector dots this build has: 512 (AVX512-VNNI), 256 (AVX2), 0 (the portable loops only) */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define KQ_ISA 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KQ_ISA 256
#else
#define KQ_ISA 0
#endif

#endif
