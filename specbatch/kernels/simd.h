/*
 * Helpers the C kernels share (cpu_ops.c, attention/cpu_paged_attention.c): 16-lane float
 * vectors in GCC's vector extensions, one exp, one bfloat16 conversion, one fixed-order sum of
 * 16 lanes. One copy because the fused decoder layer mixes both libraries' kernels and their
 * bits must follow one definition; two copies had already drifted apart.
 *
 * Header only, all static inline: each kernel stays one translation unit, included by a
 * relative path (no -I). cbuild.py puts this file's bytes into every including library's cache
 * key, so editing it rebuilds them.
 */
#ifndef SPECBATCH_SIMD_H
#define SPECBATCH_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16f splat16(float value) {
#if defined(__AVX__) && !defined(__AVX512F__)
    /* two 8-lane broadcasts: GCC builds a 16-lane initializer lane by lane through memory */
    const __m256 half = _mm256_set1_ps(value);
    v16f out;
    memcpy(&out, &half, sizeof half);
    memcpy((char *)&out + sizeof half, &half, sizeof half);
    return out;
#else
    return (v16f){value, value, value, value, value, value, value, value,
                  value, value, value, value, value, value, value, value};
#endif
}

/* A bitwise blend: GCC's C (unlike its C++) has no ?: on vectors. */
static inline v16f select16(v16i mask, v16f yes, v16f no) {
    return (v16f)(((v16i)yes & mask) | ((v16i)no & ~mask));
}

/* ---------------- exp ---------------- */

/*
 * exp in plain arithmetic, because libm's expf does not vectorise: x = n ln2 + r with
 * |r| <= ln2 / 2 (ln2 split in two so that n ln2 loses nothing), exp(r) by its degree-6 Taylor
 * polynomial (relative error below 2e-7), 2^n put into the exponent bits.
 *
 * Inputs above 88 are taken as 88, so that n + 127 stays below the inf exponent: exp(88) is
 * finite, and a stray large score or SiLU input never turns into inf or NaN. Inputs below -87,
 * where float32 underflows anyway, give exactly 0 (a softmax weight of 0 lets the attention
 * kernels skip the position): they are taken as -88, whose n + 127 is 0, a scale of +0.
 * Both ends go through one comparison, |x - 0.5| > 87.5 (x - 0.5 is exact near +-87.5; NaN
 * fails it and stays NaN): without AVX-512, GCC does a comparison of 16 lanes one lane at a
 * time, so each one costs about as much as the polynomial. The 0 comes from the scale rather
 * than a select on the product, so that the final multiply still fuses with what the caller
 * adds to it (SiLU's 1 + exp(-x)).
 *
 * The polynomial is a macro so the scalar and the vector exp evaluate the very same operations:
 * exp1f(x) equals every lane of exp16(splat16(x)), bit for bit.
 */
#define EXP_OF_REMAINDER(x, n)                                                               \
    ({                                                                                       \
        const __auto_type r_ = (x) - (n) * 0.693359375f - (n) * -2.12194440e-4f;             \
        __auto_type p_ = (1.0f / 720.0f) * r_ + 1.0f / 120.0f;                               \
        p_ = p_ * r_ + 1.0f / 24.0f;                                                         \
        p_ = p_ * r_ + 1.0f / 6.0f;                                                          \
        p_ = p_ * r_ + 0.5f;                                                                 \
        p_ = p_ * r_ + 1.0f;                                                                 \
        p_ * r_ + 1.0f;                                                                      \
    })
#define EXP_LOG2E 1.44269504088896341f

/* The exp of a vector x of float type VF and matching int type VI (SPLAT and SELECT of that
 * width): one body for exp16 and exp8, so each lane's bits are the same at either width. */
#define EXP_VECTOR(VF, VI, SPLAT, SELECT, x)                                                  \
    ({                                                                                        \
        const VF distance_ = (VF)((VI)((x) - 0.5f) & 0x7fffffff); /* |x - 0.5| */             \
        const VF edge_ = (VF)((VI)SPLAT(88.0f) | ((VI)(x) & (int32_t)0x80000000u)); /* +-88 */ \
        const VF clamped_ = SELECT(distance_ > SPLAT(87.5f), edge_, (x));                      \
        /* floor by truncation, corrected where it rounded up: exact, and cheaper than a call */ \
        const VF y_ = clamped_ * EXP_LOG2E + 0.5f;                                             \
        VF n_ = __builtin_convertvector(__builtin_convertvector(y_, VI), VF);                  \
        n_ += __builtin_convertvector(n_ > y_, VF); /* true is -1 */                           \
        const VI bits_ = (__builtin_convertvector(n_, VI) + 127) << 23;                        \
        EXP_OF_REMAINDER(clamped_, n_) * (VF)bits_;                                            \
    })

static inline v16f exp16(v16f x) { return EXP_VECTOR(v16f, v16i, splat16, select16, x); }

#if defined(__AVX__) && !defined(__AVX512F__)
/* Eight lanes, which AVX compares natively (GCC compares 16-lane vectors lane by lane). */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f splat8(float value) { return (v8f)_mm256_set1_ps(value); }

static inline v8f select8(v8i mask, v8f yes, v8f no) {
    return (v8f)(((v8i)yes & mask) | ((v8i)no & ~mask));
}

static inline v8f exp8(v8f x) { return EXP_VECTOR(v8f, v8i, splat8, select8, x); }

/* sum16 of 16 lanes held as two 8-lane halves, lo (lanes 0-7) and hi (8-15): the same folds. */
static inline float sum8x2(v8f lo, v8f hi) {
    const __m256 s8 = _mm256_add_ps((__m256)lo, (__m256)hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

/* exp16 on one float, written as scalar code so that loops calling it still vectorise. */
static inline float exp1f(float x) {
    const float clamped = fabsf(x - 0.5f) > 87.5f ? copysignf(88.0f, x) : x;
    const float n = floorf(clamped * EXP_LOG2E + 0.5f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return EXP_OF_REMAINDER(clamped, n) * scale;
}

/* ---------------- bfloat16 ---------------- */

/* Widening is exact; narrowing rounds to nearest even, as torch does, so bfloat16 rows written
 * here equal torch's. */
static inline float from_bf16(uint16_t value) {
    const uint32_t bits = (uint32_t)value << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* from_bf16 on 16 consecutive values (src need not be aligned). */
static inline v16f from_bf16x16(const uint16_t *src) {
    v16h half;
    memcpy(&half, src, sizeof half);
    const v16u wide = __builtin_convertvector(half, v16u) << 16;
    v16f out;
    memcpy(&out, &wide, sizeof out);
    return out;
}

/* ---------------- sums in a fixed order ---------------- */

/* The sum of 16 partial sums, lane i + lane i + 8, then + 4, + 2, + 1: one order for every
 * reduction, so a result never depends on which kernel or path computed it. Folds in place. */
static inline float fold16(float lanes[16]) {
    for (int width = 8; width > 0; width /= 2)
        for (int lane = 0; lane < width; lane++) lanes[lane] += lanes[lane + width];
    return lanes[0];
}

static inline float sum16(v16f x) {
    float lanes[16];
    memcpy(lanes, &x, sizeof lanes);
    return fold16(lanes);
}

#endif
