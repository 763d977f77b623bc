/* The gated delta rule of the Gated DeltaNet layers (Qwen3.5, Qwen3-Next; the torch forms and the
 * arithmetic: engine/layers/gated_delta.py), in float32, on the recurrent states in place.
 *
 * Per value head h the state S [dk][dv] takes each token as
 *     S <- d S + k delta^T,  delta = beta (v - d S^T k),  out = S^T q = d S^T q + (k.q) delta
 * with d = exp(g), q and k L2-normalised (q also scaled by dk^-0.5), value head h reading key head
 * h / (H / Hk). Every column of S is independent of the others: the kernels split the state into
 * strips of GDN_STRIP value columns (dk x 16 floats, 8 KiB at dk = 128, which stays in L1) and run
 * each strip through all of its tokens, one pass over the strip per token (S^T k and S^T q in the
 * same pass, then the update). Work items are (sequence, head, strip): a single sequence of the
 * Qwen3.5 shapes (16 heads of 128) gives 128 of them to the threads.
 *
 * - gdn_prefill: T tokens of one sequence, after its convolution (torch's conv1d), blocks of
 *   GDN_BLOCK tokens: their rows in float32 with q and k normalised (in parallel over tokens),
 *   then the strips over the block (in parallel over heads x strips).
 * - gdn_decode: one token of each of B sequences from the input projection: the convolution step
 *   over each sequence's window (conv_states row slots[b], shifted in place), SiLU, rounded to the
 *   model's dtype as torch's step is, then the rule on states row slots[b] in place.
 *
 * Paths: AVX-512 (one zmm a strip), AVX2 with FMA (two ymm), else the portable loops. */
#include <math.h>
#include <stdlib.h>

#include "common.h"

#define GDN_STRIP 16
#define GDN_MAX_KEY_DIM 256
#define GDN_BLOCK 256

#if defined(__AVX512F__)
#include <immintrin.h>
#define GDN_VECTOR_BITS 512
typedef __m512 v16;
static inline v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, v16 a) { _mm512_storeu_ps(p, a); }
static inline v16 v_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GDN_VECTOR_BITS 256
typedef struct { __m256 lo, hi; } v16;
static inline v16 v_load(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v_store(float *p, v16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
static inline v16 v_set1(float x) { return (v16){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline v16 v_fma(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline v16 v_mul(v16 a, v16 b) { return (v16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline v16 v_add(v16 a, v16 b) { return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline v16 v_sub(v16 a, v16 b) { return (v16){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
#else
#define GDN_VECTOR_BITS 0
typedef struct { float x[GDN_STRIP]; } v16;
static inline v16 v_load(const float *p) { v16 r; memcpy(r.x, p, sizeof r.x); return r; }
static inline void v_store(float *p, v16 a) { memcpy(p, a.x, sizeof a.x); }
static inline v16 v_set1(float x) { v16 r; for (int i = 0; i < GDN_STRIP; ++i) r.x[i] = x; return r; }
static inline v16 v_fma(v16 a, v16 b, v16 c) {
    for (int i = 0; i < GDN_STRIP; ++i) c.x[i] += a.x[i] * b.x[i];
    return c;
}
static inline v16 v_mul(v16 a, v16 b) { for (int i = 0; i < GDN_STRIP; ++i) a.x[i] *= b.x[i]; return a; }
static inline v16 v_add(v16 a, v16 b) { for (int i = 0; i < GDN_STRIP; ++i) a.x[i] += b.x[i]; return a; }
static inline v16 v_sub(v16 a, v16 b) { for (int i = 0; i < GDN_STRIP; ++i) a.x[i] -= b.x[i]; return a; }
#endif

int gdn_vector_bits(void) { return GDN_VECTOR_BITS; }

/* the shapes the kernels take: whole strips, an even key dim the scratch holds, whole groups */
static int gdn_shape_ok(int Hk, int H, int dk, int dv) {
    return Hk > 0 && H > 0 && H % Hk == 0 && dk > 0 && dk % 2 == 0 && dk <= GDN_MAX_KEY_DIM && dv > 0
           && dv % GDN_STRIP == 0;
}

/* One token through one strip of S (rows ld floats apart): see the top of the file. */
static inline void strip_step(float *restrict S, int64_t ld, int dk, const float *restrict k,
                              const float *restrict q, float kq, const float *restrict v, float decay,
                              float beta, float *restrict out) {
    v16 sk0 = v_set1(0.f), sk1 = sk0, sq0 = sk0, sq1 = sk0;
    for (int i = 0; i < dk; i += 2) {
        const v16 r0 = v_load(S + i * ld), r1 = v_load(S + (i + 1) * ld);
        sk0 = v_fma(r0, v_set1(k[i]), sk0);
        sq0 = v_fma(r0, v_set1(q[i]), sq0);
        sk1 = v_fma(r1, v_set1(k[i + 1]), sk1);
        sq1 = v_fma(r1, v_set1(q[i + 1]), sq1);
    }
    const v16 d = v_set1(decay);
    const v16 delta = v_mul(v_sub(v_load(v), v_mul(d, v_add(sk0, sk1))), v_set1(beta));
    v_store(out, v_fma(d, v_add(sq0, sq1), v_mul(v_set1(kq), delta)));
    for (int i = 0; i < dk; ++i) {
        float *row = S + i * ld;
        v_store(row, v_fma(v_load(row), d, v_mul(v_set1(k[i]), delta)));
    }
}

/* Row x (float32, [q | k | v] of Hk, Hk and H heads): q and k normalised in place, kq[hk] = k.q */
static void normalise_row(float *restrict x, int Hk, int dk, float *restrict kq) {
    const float q_scale = 1.f / sqrtf((float)dk);
    for (int hk = 0; hk < Hk; ++hk) {
        float *q = x + (int64_t)hk * dk, *k = x + (int64_t)(Hk + hk) * dk;
        float qq = 0.f, kk = 0.f;
        for (int i = 0; i < dk; ++i) {
            qq += q[i] * q[i];
            kk += k[i] * k[i];
        }
        const float rq = 1.f / sqrtf(qq + 1e-6f), rk = 1.f / sqrtf(kk + 1e-6f);
        float dot = 0.f;
        for (int i = 0; i < dk; ++i) {
            q[i] = q[i] * rq * q_scale;
            k[i] = k[i] * rk;
            dot += q[i] * k[i];
        }
        kq[hk] = dot;
    }
}

/* Strip j of head h over rows 0..rows-1 of X ([rows, width] float32, normalised), with S the
 * strip's first column in the head's state, g and beta [rows, H], out [rows, H, dv]. */
static void run_strip(float *S, int dk, int dv, const float *X, int64_t width, int rows, int Hk, int H,
                      int h, int j, const float *g, const float *beta, const float *kq, float *out) {
    const int hk = h / (H / Hk);
    for (int r = 0; r < rows; ++r) {
        const float *x = X + r * width;
        strip_step(S, dv, dk, x + (int64_t)(Hk + hk) * dk, x + (int64_t)hk * dk, kq[(int64_t)r * Hk + hk],
                   x + (int64_t)2 * Hk * dk + (int64_t)h * dv + j, expf(g[(int64_t)r * H + h]),
                   beta[(int64_t)r * H + h], out + ((int64_t)r * H + h) * dv + j);
    }
}

/* T tokens of one sequence. mixed: [T] rows row_stride elements apart of dtype, each [q | k | v]
 * after the convolution (Hk dk, Hk dk, H dv values); g, beta float32 [T, H]; state float32
 * [H, dk, dv]; out float32 [T, H, dv]. Returns 1 for a shape it does not take, 2 out of memory. */
int gdn_prefill(const void *mixed, int64_t row_stride, int dtype, const float *g, const float *beta, int T,
                int Hk, int H, int dk, int dv, float *state, float *out, int num_threads) {
    if (!gdn_shape_ok(Hk, H, dk, dv) || T < 0) return 1;
    const int64_t width = (int64_t)2 * Hk * dk + (int64_t)H * dv;
    const int block = T < GDN_BLOCK ? (T > 0 ? T : 1) : GDN_BLOCK;
    float *X = malloc(sizeof(float) * (size_t)(block * width + (int64_t)block * Hk));
    if (X == NULL) return 2;
    float *kq = X + block * width;
    const int strips = dv / GDN_STRIP, elem = elem_size(dtype);
    const int64_t stride_bytes = row_stride * elem;
    for (int t0 = 0; t0 < T; t0 += block) {
        const int rows = T - t0 < block ? T - t0 : block;
#pragma omp parallel num_threads(num_threads)
        {
#pragma omp for schedule(static)
            for (int r = 0; r < rows; ++r) {
                to_float((const char *)mixed + (t0 + r) * stride_bytes, dtype, X + r * width, (int)width);
                normalise_row(X + r * width, Hk, dk, kq + (int64_t)r * Hk);
            }
#pragma omp for schedule(static)
            for (int item = 0; item < H * strips; ++item) {
                const int h = item / strips, j = item % strips * GDN_STRIP;
                run_strip(state + (int64_t)h * dk * dv + j, dk, dv, X, width, rows, Hk, H, h, j,
                          g + (int64_t)t0 * H, beta + (int64_t)t0 * H, kq, out + (int64_t)t0 * H * dv);
            }
        }
    }
    free(X);
    return 0;
}

/* One token of each of B sequences. mixed: [B] rows row_stride elements apart of dtype, the conv
 * channels before the convolution (C = 2 Hk dk + H dv); conv_w [C, K] of dtype; conv_states
 * [slots, C, K - 1] of dtype and states float32 [slots, H, dk, dv], rows slots[b] read and
 * written in place; g, beta float32 [B, H]; out float32 [B, H, dv]. */
int gdn_decode(const void *mixed, int64_t row_stride, int dtype, const void *conv_w, void *conv_states, int K,
               const int64_t *slots, int B, const float *g, const float *beta, int Hk, int H, int dk, int dv,
               float *states, float *out, int num_threads) {
    if (!gdn_shape_ok(Hk, H, dk, dv) || K < 2 || K > 16 || B < 1) return 1;
    const int64_t width = (int64_t)2 * Hk * dk + (int64_t)H * dv;
    float *X = malloc(sizeof(float) * (size_t)(B * width + (int64_t)B * Hk));
    if (X == NULL) return 2;
    float *kq = X + B * width;
    const int strips = dv / GDN_STRIP, elem = elem_size(dtype);
    const int64_t state_row = (int64_t)H * dk * dv;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int b = 0; b < B; ++b) {
            const char *in = (const char *)mixed + b * row_stride * elem;
            char *window = (char *)conv_states + slots[b] * width * (K - 1) * elem;
            float *x = X + b * width;
            for (int64_t c = 0; c < width; ++c) {
                float joined[16], w[16], acc = 0.f;
                char *win = window + c * (K - 1) * elem;
                to_float(win, dtype, joined, K - 1);
                to_float(in + c * elem, dtype, joined + K - 1, 1);
                to_float((const char *)conv_w + c * K * elem, dtype, w, K);
                for (int i = 0; i < K; ++i) acc += joined[i] * w[i];
                from_float(joined + 1, 1.f, dtype, win, K - 1);  /* the window moves one input on */
                acc = acc / (1.f + expf(-acc));
                from_float(&acc, 1.f, dtype, joined, 1);  /* the step's output in the model's dtype */
                to_float(joined, dtype, x + c, 1);
            }
            normalise_row(x, Hk, dk, kq + (int64_t)b * Hk);
        }
#pragma omp for schedule(static)
        for (int item = 0; item < B * H * strips; ++item) {
            const int b = item / (H * strips), h = item / strips % H, j = item % strips * GDN_STRIP;
            run_strip(states + slots[b] * state_row + (int64_t)h * dk * dv + j, dk, dv, X + b * width, width, 1,
                      Hk, H, h, j, g + (int64_t)b * H, beta + (int64_t)b * H, kq + (int64_t)b * Hk,
                      out + (int64_t)b * H * dv);
        }
    }
    free(X);
    return 0;
}
