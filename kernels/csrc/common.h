/* What the CPU kernels share: element types and their conversion to and from float, the shape
 * limits. */
#ifndef KVSERVE_COMMON_H
#define KVSERVE_COMMON_H
#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

/* Bytes per element of a DTYPE_* */
static inline int elem_size(int dtype) { return dtype == DTYPE_BF16 ? 2 : 4; }

/* The longest head the kernels take, and the most query heads per KV head (attention); also read
 * by cpu_kernels.py. attention.c repeats them after including this file (the same values). */
#ifndef MAX_HEAD_DIM
#define MAX_HEAD_DIM 512
#endif
#ifndef MAX_GROUP
#define MAX_GROUP 64
#endif

typedef union { uint32_t u; float f; } bits32;

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

#endif
