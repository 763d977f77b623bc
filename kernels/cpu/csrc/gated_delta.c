/* The gated delta rule of the Gated DeltaNet layers (Qwen3.5, Qwen3-Next; the torch forms and the
 * arithmetic: engine/layers/gated_delta.py), in float32, on the recurrent states in place.
 *
 * Per value head h the state S [dk][dv] takes each token as
 *     S <- d S + k delta^T,  delta = beta (v - d S^T k),  out = S^T q = d S^T q + (k.q) delta
 * with d = exp(g), q and k L2-normalised (q also scaled by dk^-0.5), value head h reading key head
 * h / (H / Hk). Every column of S is independent of the others: the kernels split the state into
 * strips of GDN_STRIP value columns (dk x 16 floats, 8 KiB at dk = 128, which stays in L1) and run
 * each strip through all of its tokens, one pass over the strip per token (S^T k and S^T q in the
 * same pass, then the update). The work items share no data that one writes, so each parallel
 * loop has no barrier but its end (on a shared, busy machine a barrier can wait a scheduler slice).
 *
 * - gdn_conv: the causal convolution of a prompt's tokens, then SiLU: items of 16 channels.
 * - gdn_prefill: T tokens of one sequence, after its convolution (gdn_conv): items (value
 *   head, two strips), each through every token; a single sequence of the Qwen3.5 shapes (16
 *   heads of 128) gives 64 of them to the threads.
 * - gdn_decode: one token of each of B sequences from the input projection: items (sequence, key
 *   head): the convolution step of the head's channels over the sequence's window (conv_states
 *   row slots[b], moved on in place), SiLU, rounded to the model's dtype as torch's step is, then
 *   the rule for its value heads on states row slots[b] in place (gdn_decode_item).
 * - gdn_gates: beta and g of each token from the projection's b and a (gdn_gate_values);
 *   gdn_gated_norm: the gated RMSNorm after the rule (gdn_gated_norm_row); sigmoid_gate: the
 *   full-attention layers' output gate (sigmoid_gate_row). The row and item functions are what the
 *   fused decode step (decode_row.c decode_row_hybrid) runs too, so both paths give the same bits.
 *
 * Paths: AVX-512 (one zmm a strip), AVX2 with FMA (two ymm), else the portable loops. */
#include <math.h>

#include "common.h"

#define GDN_STRIP 16
#define GDN_MAX_KEY_DIM 256
/* values of one key head's value heads in a decode step's scratch (H / Hk x dv) */
#define GDN_MAX_GROUP_VALUES 4096

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

/* q and k of one head (float32, dk each) normalised in place; returns k.q */
static float normalise(float *restrict q, float *restrict k, int dk) {
    float qq = 0.f, kk = 0.f, dot = 0.f;
    for (int i = 0; i < dk; ++i) {
        qq += q[i] * q[i];
        kk += k[i] * k[i];
    }
    const float rq = 1.f / sqrtf(qq + 1e-6f), rk = 1.f / sqrtf(kk + 1e-6f), q_scale = 1.f / sqrtf((float)dk);
    for (int i = 0; i < dk; ++i) {
        q[i] = q[i] * rq * q_scale;
        k[i] = k[i] * rk;
        dot += q[i] * k[i];
    }
    return dot;
}

/* T tokens of one sequence. mixed: [T] rows row_stride elements apart of dtype, each [q | k | v]
 * after the convolution (Hk dk, Hk dk, H dv values); g, beta float32 [T, H]; state float32
 * [H, dk, dv]; out float32 [T, H, dv]. Work items (head, pair of strips) run through every token
 * with no barrier between tokens, each normalising its key head's q and k itself (a tenth of its
 * arithmetic). Returns 1 for a shape it does not take. */
int gdn_prefill(const void *mixed, int64_t row_stride, int dtype, const float *g, const float *beta, int T,
                int Hk, int H, int dk, int dv, float *state, float *out, int num_threads) {
    if (!gdn_shape_ok(Hk, H, dk, dv) || T < 0) return 1;
    const int strips = dv / GDN_STRIP, span = strips % 2 == 0 ? 2 : 1, groups = strips / span;
    const int elem = elem_size(dtype);
    const int64_t stride_bytes = row_stride * elem;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int item = 0; item < H * groups; ++item) {
        const int h = item / groups, hk = h / (H / Hk), j0 = item % groups * span * GDN_STRIP;
        float q[GDN_MAX_KEY_DIM], k[GDN_MAX_KEY_DIM], v[2 * GDN_STRIP];
        float S[2 * GDN_MAX_KEY_DIM * GDN_STRIP];  /* the strips, rows together (in place, rows dv
                                                      apart, they would fall into few L1 sets) */
        float *home = state + (int64_t)h * dk * dv + j0;
        for (int i = 0; i < dk; ++i)
            for (int s = 0; s < span; ++s)
                memcpy(S + (s * dk + i) * GDN_STRIP, home + (int64_t)i * dv + s * GDN_STRIP, sizeof(float) * GDN_STRIP);
        for (int t = 0; t < T; ++t) {
            const char *row = (const char *)mixed + t * stride_bytes;
            to_float(row + (int64_t)hk * dk * elem, dtype, q, dk);
            to_float(row + (int64_t)(Hk + hk) * dk * elem, dtype, k, dk);
            to_float(row + ((int64_t)2 * Hk * dk + (int64_t)h * dv + j0) * elem, dtype, v, span * GDN_STRIP);
            const float kq = normalise(q, k, dk), decay = expf(g[(int64_t)t * H + h]);
            const float b = beta[(int64_t)t * H + h];
            float *o = out + ((int64_t)t * H + h) * dv + j0;
            for (int s = 0; s < span; ++s)
                strip_step(S + s * dk * GDN_STRIP, GDN_STRIP, dk, k, q, kq, v + s * GDN_STRIP, decay, b,
                           o + s * GDN_STRIP);
        }
        for (int i = 0; i < dk; ++i)
            for (int s = 0; s < span; ++s)
                memcpy(home + (int64_t)i * dv + s * GDN_STRIP, S + (s * dk + i) * GDN_STRIP, sizeof(float) * GDN_STRIP);
    }
    return 0;
}

/* x rounded to dtype (and back to float) */
static inline float round_to(float x, int dtype) {
    float r;
    uint16_t h;
    if (dtype != DTYPE_BF16) return x;
    from_float(&x, 1.f, DTYPE_BF16, &h, 1);
    to_float(&h, DTYPE_BF16, &r, 1);
    return r;
}

/* The convolution of T tokens of one sequence, as torch's conv1d then SiLU (each rounded to
 * dtype): x [T] rows row_stride elements apart of dtype, C channels; window [C, K - 1] of dtype,
 * the inputs before the first token, left holding the last K - 1; conv_w [C, K] of dtype; y [T, C]
 * of dtype, contiguous. Items: 16 channels each, through every token. */
int gdn_conv(const void *x, int64_t row_stride, int dtype, const void *conv_w, void *window, int K, int T,
             int C, void *y, int num_threads) {
    if (K < 2 || K > 16 || T < 0 || C < 1) return 1;
    const int elem = elem_size(dtype);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int c0 = 0; c0 < C; c0 += 16) {
        const int n = C - c0 < 16 ? C - c0 : 16;
        float w[16][16] = {{0}}, hist[16][16] = {{0}}, in[16] = {0}, acc[16], tap[16];
        for (int c = 0; c < n; ++c) {
            to_float((const char *)conv_w + (int64_t)(c0 + c) * K * elem, dtype, tap, K);
            for (int j = 0; j < K; ++j) w[j][c] = tap[j];
            to_float((const char *)window + (int64_t)(c0 + c) * (K - 1) * elem, dtype, tap, K - 1);
            for (int j = 0; j < K - 1; ++j) hist[j][c] = tap[j];
        }
        for (int t = 0; t < T; ++t) {
            to_float((const char *)x + ((int64_t)t * row_stride + c0) * elem, dtype, in, n);
            for (int c = 0; c < 16; ++c) acc[c] = 0.f;
            for (int j = 0; j < K - 1; ++j)
                for (int c = 0; c < 16; ++c) acc[c] += w[j][c] * hist[j][c];
            for (int c = 0; c < 16; ++c) {
                const float a = round_to(acc[c] + w[K - 1][c] * in[c], dtype);
                acc[c] = a / (1.f + fast_exp(-a));
            }
            from_float(acc, 1.f, dtype, (char *)y + ((int64_t)t * C + c0) * elem, n);
            for (int j = 0; j + 1 < K - 1; ++j) memcpy(hist[j], hist[j + 1], sizeof hist[j]);
            memcpy(hist[K - 2], in, sizeof in);
        }
        for (int c = 0; c < n; ++c) {
            for (int j = 0; j < K - 1; ++j) tap[j] = hist[j][c];
            from_float(tap, 1.f, dtype, (char *)window + (int64_t)(c0 + c) * (K - 1) * elem, K - 1);
        }
    }
    return 0;
}

/* SiLU(conv) of n channels from c0 of one token (in: the token's row of dtype), window: the
 * sequence's [C, K - 1] inputs (moved one input on, in place), w [C, K]; the outputs rounded to
 * dtype as torch's step's are, as floats in dst */
static void conv_step(const char *in, char *window, const char *w, int64_t c0, int n, int K, int dtype,
                      float *restrict dst) {
    const int elem = elem_size(dtype);
    for (int64_t c = c0; c < c0 + n; ++c) {
        float joined[16], wc[16], acc = 0.f;
        char *win = window + c * (K - 1) * elem;
        to_float(win, dtype, joined, K - 1);
        to_float(in + c * elem, dtype, joined + K - 1, 1);
        to_float(w + c * K * elem, dtype, wc, K);
        for (int i = 0; i < K; ++i) acc += joined[i] * wc[i];
        from_float(joined + 1, 1.f, dtype, win, K - 1);
        acc = round_to(acc, dtype);
        acc = acc / (1.f + expf(-acc));
        from_float(&acc, 1.f, dtype, joined, 1);
        to_float(joined, dtype, dst + (c - c0), 1);
    }
}

/* The gates of value heads h0 .. h0 + n - 1 of one token, from its projection's b and a (H values
 * each, of dtype): beta = sigmoid(b) rounded to dtype (torch's b.sigmoid()), g = -exp(A_log)
 * softplus(a + dt_bias) in float32 (softplus: a + dt_bias itself above 20, as torch's). Written at
 * g[h], beta[h]. The per-op path (gdn_gates) and the fused step (decode_row.c) both come here. */
void gdn_gate_values(const void *b, const void *a, int dtype, const float *A_log, const float *dt_bias, int h0,
                     int n, float *g, float *beta) {
    const int elem = elem_size(dtype);
    for (int h = h0; h < h0 + n; ++h) {
        float bv, av;
        to_float((const char *)b + (int64_t)h * elem, dtype, &bv, 1);
        to_float((const char *)a + (int64_t)h * elem, dtype, &av, 1);
        beta[h] = round_to(1.f / (1.f + expf(-bv)), dtype);
        const float x = av + dt_bias[h];
        g[h] = -expf(A_log[h]) * (x > 20.f ? x : log1pf(expf(x)));
    }
}

/* gdn_gate_values of T tokens: ba [T] rows row_stride elements apart of dtype, each b (H values) then
 * a (H); g, beta float32 [T, H]. */
int gdn_gates(const void *ba, int64_t row_stride, int dtype, const float *A_log, const float *dt_bias, int T, int H,
              float *g, float *beta) {
    if (T < 0 || H < 1) return 1;
    const int elem = elem_size(dtype);
    for (int t = 0; t < T; ++t) {
        const char *row = (const char *)ba + (int64_t)t * row_stride * elem;
        gdn_gate_values(row, row + (int64_t)H * elem, dtype, A_log, dt_bias, 0, H, g + (int64_t)t * H,
                        beta + (int64_t)t * H);
    }
    return 0;
}

int gdn_decode_takes(int Hk, int H, int dk, int dv, int K) {
    return gdn_shape_ok(Hk, H, dk, dv) && K >= 2 && K <= 16 && H / Hk * dv <= GDN_MAX_GROUP_VALUES;
}

/* Key head hk of one token (gdn_decode's work item): in, the token's row of the projection (the
 * conv channels first, C = 2 Hk dk + H dv, of dtype); window, its sequence's [C, K - 1] inputs
 * (moved on in place); S, its states [H, dk, dv] (in place); g, beta: [H] (the head's value heads
 * read); out: the token's [H, dv] (the head's value heads written). */
void gdn_decode_item(const char *in, const void *conv_w, char *window, int K, int dtype, const float *g,
                     const float *beta, int Hk, int H, int dk, int dv, int hk, float *S, float *out) {
    const int rep = H / Hk;
    float q[GDN_MAX_KEY_DIM], k[GDN_MAX_KEY_DIM], v[GDN_MAX_GROUP_VALUES];
    conv_step(in, window, conv_w, (int64_t)hk * dk, dk, K, dtype, q);
    conv_step(in, window, conv_w, (int64_t)(Hk + hk) * dk, dk, K, dtype, k);
    conv_step(in, window, conv_w, (int64_t)2 * Hk * dk + (int64_t)hk * rep * dv, rep * dv, K, dtype, v);
    const float kq = normalise(q, k, dk);
    for (int h = hk * rep; h < (hk + 1) * rep; ++h) {
        float *Sh = S + (int64_t)h * dk * dv, *o = out + (int64_t)h * dv;
        const float decay = expf(g[h]), bt = beta[h];
        for (int j = 0; j < dv; j += GDN_STRIP)
            strip_step(Sh + j, dv, dk, k, q, kq, v + (h - hk * rep) * dv + j, decay, bt, o + j);
    }
}

/* One token of each of B sequences. mixed: [B] rows row_stride elements apart of dtype, the conv
 * channels before the convolution (C = 2 Hk dk + H dv); conv_w [C, K] of dtype; conv_states
 * [slots, C, K - 1] of dtype and states float32 [slots, H, dk, dv], rows slots[b] read and
 * written in place; g, beta float32 [B, H]; out float32 [B, H, dv]. A work item is one key head
 * of one sequence (gdn_decode_item): the channels of its q, k and its value heads' v are its own
 * (their windows too), so the items need no barrier. */
int gdn_decode(const void *mixed, int64_t row_stride, int dtype, const void *conv_w, void *conv_states, int K,
               const int64_t *slots, int B, const float *g, const float *beta, int Hk, int H, int dk, int dv,
               float *states, float *out, int num_threads) {
    if (!gdn_decode_takes(Hk, H, dk, dv, K) || B < 1) return 1;
    const int64_t width = (int64_t)2 * Hk * dk + (int64_t)H * dv;
    const int elem = elem_size(dtype);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int item = 0; item < B * Hk; ++item) {
        const int b = item / Hk;
        gdn_decode_item((const char *)mixed + b * row_stride * elem, conv_w,
                        (char *)conv_states + slots[b] * width * (K - 1) * elem, K, dtype, g + (int64_t)b * H,
                        beta + (int64_t)b * H, Hk, H, dk, dv, item % Hk, states + slots[b] * (int64_t)H * dk * dv,
                        out + (int64_t)b * H * dv);
    }
    return 0;
}

/* v rounded to dtype in place (bfloat16: nearest even, as from_float; a NaN stays a quiet NaN) */
static inline void round_row(float *restrict v, int n, int dtype) {
    if (dtype != DTYPE_BF16) return;
    for (int i = 0; i < n; ++i) {
        bits32 x = {.f = v[i]};
        const uint32_t rounded = ((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16) << 16;
        x.u = (x.u & 0x7fffffffu) > 0x7f800000u ? (x.u | 0x400000u) & 0xffff0000u : rounded;
        v[i] = x.f;
    }
}

/* The layer's gated RMSNorm after the rule for one (token, value head) row, each rounding where
 * torch's form rounds (GatedDeltaNet._gated_norm): x = round(rule) (the rule's float32 output in the
 * model's dtype), n = round(x / rms(x)), out = round(round(w n) SiLU(z)). rule: dv floats; z, w,
 * out: dv values of dtype. The per-op path (gdn_gated_norm) and the fused step both come here. */
void gdn_gated_norm_row(const float *rule, const void *z, const void *w, int dv, float eps, int dtype, void *out) {
    float x[GDN_MAX_GROUP_VALUES], g[GDN_MAX_GROUP_VALUES], wf[GDN_MAX_GROUP_VALUES], lanes[16] = {0};
    memcpy(x, rule, sizeof(float) * (size_t)dv);
    round_row(x, dv, dtype);
    int i = 0;
    for (; i + 16 <= dv; i += 16)
        for (int l = 0; l < 16; ++l) lanes[l] += x[i + l] * x[i + l];
    for (; i < dv; ++i) lanes[0] += x[i] * x[i];
    float ss = 0.f;
    for (int l = 0; l < 16; ++l) ss += lanes[l];
    const float r = 1.f / sqrtf(ss / (float)dv + eps);
    for (i = 0; i < dv; ++i) x[i] *= r;
    round_row(x, dv, dtype);
    to_float(w, dtype, wf, dv);
    for (i = 0; i < dv; ++i) x[i] *= wf[i];
    round_row(x, dv, dtype);
    to_float(z, dtype, g, dv);
    for (i = 0; i < dv; ++i) x[i] *= g[i] / (1.f + fast_exp(-g[i]));
    from_float(x, 1.f, dtype, out, dv);
}

/* gdn_gated_norm_row over T tokens and H value heads: rule float32 [T, H, dv] contiguous; z [T] rows
 * z_stride elements apart of dtype, [H, dv] each; w [dv] of dtype; out [T, H dv] of dtype,
 * contiguous. Items: (token, head) rows. */
int gdn_gated_norm(const float *rule, const void *z, int64_t z_stride, const void *w, int T, int H, int dv,
                   float eps, int dtype, void *out, int num_threads) {
    if (T < 0 || H < 1 || dv < 1 || dv > GDN_MAX_GROUP_VALUES) return 1;
    const int elem = elem_size(dtype);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t row = 0; row < (int64_t)T * H; ++row) {
        const int64_t t = row / H, h = row % H;
        gdn_gated_norm_row(rule + row * dv, (const char *)z + (t * z_stride + h * dv) * elem, w, dv, eps, dtype,
                           (char *)out + row * dv * elem);
    }
    return 0;
}

/* The gated attention's output gate (engine/models/qwen3_5_attention.py), in place: x = round(x
 * round(sigmoid(gate))), as torch's `out * torch.sigmoid(gate)` of the model's dtype rounds. x: n
 * values of dtype; gate: n values of dtype. */
void sigmoid_gate_row(void *x, const void *gate, int n, int dtype) {
    float xf[GDN_MAX_GROUP_VALUES], gf[GDN_MAX_GROUP_VALUES];
    for (int i0 = 0; i0 < n; i0 += GDN_MAX_GROUP_VALUES) {
        const int m = n - i0 < GDN_MAX_GROUP_VALUES ? n - i0 : GDN_MAX_GROUP_VALUES;
        char *xp = (char *)x + (int64_t)i0 * elem_size(dtype);
        to_float(xp, dtype, xf, m);
        to_float((const char *)gate + (int64_t)i0 * elem_size(dtype), dtype, gf, m);
        for (int i = 0; i < m; ++i) xf[i] *= round_to(1.f / (1.f + expf(-gf[i])), dtype);
        from_float(xf, 1.f, dtype, xp, m);
    }
}

/* sigmoid_gate_row for rows tokens x heads: x [rows] rows x_stride elements apart, heads of width
 * contiguous; gate [rows] rows gate_stride apart, heads gate_head apart. */
int sigmoid_gate(void *x, int64_t x_stride, const void *gate, int64_t gate_stride, int64_t gate_head, int rows,
                 int heads, int width, int dtype) {
    if (rows < 0 || heads < 1 || width < 1) return 1;
    const int elem = elem_size(dtype);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h)
            sigmoid_gate_row((char *)x + (r * x_stride + h * width) * elem,
                             (const char *)gate + (r * gate_stride + h * gate_head) * elem, width, dtype);
    return 0;
}
