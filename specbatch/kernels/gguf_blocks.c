/*
 * GGUF tensor blocks dequantised to float32, each value equal bit for bit to gguf's numpy
 * reference (gguf.quants.dequantize, gguf 0.19), and the embedding-row lookup over them.
 *
 * Layout: a tensor's bytes exactly as stored in the file, no repacking. Row r of an [n, k]
 * matrix is k / W blocks of B bytes (W weights each: 32, or 256 for the K-quants and IQ4_XS)
 * starting at byte r * (k / W) * B. F32, F16 and BF16 (blocks of one value in ggml) are taken
 * here as blocks of 32 values, so that every type has a block of 32 or 256 weights. The fp16
 * scales and packed fields are little-endian, as in the file (the host is assumed
 * little-endian for F32 values, as numpy's views in gguf assume).
 *
 * Why exact: gguf computes in float32, one numpy operation at a time, and every product it
 * forms is exact in float32 (an fp16 scale has 11 significant bits, a sub-block scale at most
 * 7, a code at most 7: never more than 24 together), so the only rounding is the one add or
 * subtract of the types with a minimum (Q4_1, Q5_1: d q + m; Q2_K, Q4_K, Q5_K: (d sc) q -
 * dmin m). Each function below forms the same float32 operations in gguf's order (which the
 * exactness leaves free for the products, not for the final add), and the file is built with
 * -ffp-contract=off, so no product is fused into that add. No operand or result is ever a
 * float32 subnormal (an fp16 subnormal is a normal float32), so denormals-are-zero modes
 * change nothing. Hence the same bits whether GCC vectorises the loops for AVX-512, AVX2 or
 * not at all (tests/kernels/test_gguf_blocks.py builds each). The fp16 conversion is bit
 * manipulation, exact for every pattern (NaN payloads kept unquieted, as numpy's conversion).
 *
 * The loops are plain C for the auto-vectoriser: fixed trip counts over a block's bytes, the
 * per-sub-block scales computed outside the inner loop, no branches inside it.
 *
 * Built at first use by specbatch/kernels/gguf_blocks.py (cc -O3 -march=native -fopenmp) and
 * called through ctypes; no Python or torch headers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "simd.h"

#define QK 32    /* weights per block of the 32-weight types */
#define QK_K 256 /* weights per block of the K-quants and IQ4_XS */

/* The type codes of gguf_block_info and gguf_block_rows (gguf_blocks.py's BlockType.code). */
enum {
    GGUF_F32,
    GGUF_F16,
    GGUF_BF16,
    GGUF_Q4_0,
    GGUF_Q4_1,
    GGUF_Q5_0,
    GGUF_Q5_1,
    GGUF_Q8_0,
    GGUF_Q2_K,
    GGUF_Q3_K,
    GGUF_Q4_K,
    GGUF_Q5_K,
    GGUF_Q6_K,
    GGUF_IQ4_NL,
    GGUF_IQ4_XS,
    GGUF_TYPES
};

static inline float bits_to_float(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint32_t float_to_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

static inline uint16_t read_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static inline uint32_t read_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* fp16 bits to float32, exact for every pattern. A subnormal m 2^-24 is computed from the
 * integer m, so no float32 subnormal is touched; inf and NaN keep their payload unquieted. */
static inline float fp16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exponent = h & 0x7C00, mantissa = h & 0x03FF;
    const uint32_t subnormal = float_to_bits((float)mantissa * 0x1p-24f);
    const uint32_t normal = ((uint32_t)(h & 0x7FFF) << 13) + ((uint32_t)(127 - 15) << 23);
    const uint32_t special = 0x7F800000u | mantissa << 13;
    /* masks, not a branch: the loops over this stay vectorisable */
    const uint32_t is_subnormal = 0u - (exponent == 0), is_special = 0u - (exponent == 0x7C00);
    const uint32_t magnitude = (subnormal & is_subnormal) | (special & is_special) |
                               (normal & ~(is_subnormal | is_special));
    return bits_to_float(sign | magnitude);
}

static inline float read_fp16(const uint8_t *p) { return fp16_to_float(read_u16(p)); }

/* A block's fp16 scale: F16C's conversion where there is one (exact, as fp16_to_float, but
 * for the quieting of a signalling NaN; ten scalar operations per block of 32 weights had
 * been a tenth of a block's work). */
static inline float read_scale(const uint8_t *p) {
#ifdef __F16C__
    return _cvtsh_ss(read_u16(p));
#else
    return read_fp16(p);
#endif
}

/* The non-linear 4-bit codebook of IQ4_NL and IQ4_XS. */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

static inline void dequantize_f32(const uint8_t *restrict block, float *restrict out) {
    memcpy(out, block, QK * sizeof(float)); /* a copy of the bits, NaNs included */
}

static inline void dequantize_f16(const uint8_t *restrict block, float *restrict out) {
    for (int j = 0; j < QK; j++) out[j] = read_fp16(block + 2 * j);
}

static inline void dequantize_bf16(const uint8_t *restrict block, float *restrict out) {
    for (int j = 0; j < QK; j++) out[j] = bits_to_float((uint32_t)read_u16(block + 2 * j) << 16);
}

/* d; 16 bytes: element j the low nibble of byte j, element j + 16 its high one; d (q - 8). */
static inline void plain_q4_0(const uint8_t *restrict block, float *restrict out) {
    const float d = read_fp16(block);
    const uint8_t *qs = block + 2;
    for (int j = 0; j < QK / 2; j++) {
        out[j] = d * (float)((qs[j] & 0xF) - 8);
        out[j + QK / 2] = d * (float)((qs[j] >> 4) - 8);
    }
}

/* d, m; nibbles as Q4_0; (d q) + m, rounded once. */
static inline void plain_q4_1(const uint8_t *restrict block, float *restrict out) {
    const float d = read_fp16(block), m = read_fp16(block + 2);
    const uint8_t *qs = block + 4;
    for (int j = 0; j < QK / 2; j++) {
        out[j] = d * (float)(qs[j] & 0xF) + m;
        out[j + QK / 2] = d * (float)(qs[j] >> 4) + m;
    }
}

/* d; 32 fifth bits (bit j: element j); nibbles as Q4_0; d (q - 16). */
static inline void plain_q5_0(const uint8_t *restrict block, float *restrict out) {
    const float d = read_fp16(block);
    const uint32_t qh = read_u32(block + 2);
    const uint8_t *qs = block + 6;
    for (int j = 0; j < QK / 2; j++) {
        const int lo = (qs[j] & 0xF) | (int)((qh >> j) & 1) << 4;
        const int hi = (qs[j] >> 4) | (int)((qh >> (j + QK / 2)) & 1) << 4;
        out[j] = d * (float)(lo - 16);
        out[j + QK / 2] = d * (float)(hi - 16);
    }
}

/* d, m; fifth bits and nibbles as Q5_0; (d q) + m, rounded once. */
static inline void plain_q5_1(const uint8_t *restrict block, float *restrict out) {
    const float d = read_fp16(block), m = read_fp16(block + 2);
    const uint32_t qh = read_u32(block + 4);
    const uint8_t *qs = block + 8;
    for (int j = 0; j < QK / 2; j++) {
        const int lo = (qs[j] & 0xF) | (int)((qh >> j) & 1) << 4;
        const int hi = (qs[j] >> 4) | (int)((qh >> (j + QK / 2)) & 1) << 4;
        out[j] = d * (float)lo + m;
        out[j + QK / 2] = d * (float)hi + m;
    }
}

/* d; 32 int8 codes; q d. */
static inline void plain_q8_0(const uint8_t *restrict block, float *restrict out) {
    const float d = read_fp16(block);
    const int8_t *qs = (const int8_t *)(block + 2);
    for (int j = 0; j < QK; j++) out[j] = (float)qs[j] * d;
}

/*
 * 16 scale bytes (low nibble: sub-block scale, high: its min), 64 code bytes, d, dmin. Element
 * 128 g + 32 s + j is bits 2s, 2s + 1 of byte 32 g + j; sub-blocks are 16 elements.
 * (d sc) q - (dmin m), rounded once (the products are exact).
 */
static inline void plain_q2_k(const uint8_t *restrict block, float *restrict out) {
    const uint8_t *scales = block, *qs = block + QK_K / 16;
    const float d = read_fp16(block + 80), dmin = read_fp16(block + 82);
    for (int sub = 0; sub < QK_K / 16; sub++) {
        const float dl = d * (float)(scales[sub] & 0xF), ml = dmin * (float)(scales[sub] >> 4);
        const uint8_t *q = qs + 32 * (sub / 8) + 16 * (sub % 2);
        const int shift = 2 * (sub / 2 % 4);
        float *o = out + 16 * sub;
        for (int j = 0; j < 16; j++) o[j] = dl * (float)((q[j] >> shift) & 3) - ml;
    }
}

/* Q3_K's 16 signed 6-bit scales: low nibbles in bytes 0-7 (sub-blocks 8-15 the high
 * nibbles), the two high bits in bytes 8-11 (sub-block s: bits 2 (s / 4) of byte 8 + s % 4). */
static void q3_k_scales(const uint8_t *packed, int *scales) {
    for (int sub = 0; sub < 16; sub++) {
        const int low = (packed[sub % 8] >> (4 * (sub / 8))) & 0xF;
        const int high = (packed[8 + sub % 4] >> (2 * (sub / 4))) & 3;
        scales[sub] = (low | high << 4) - 32;
    }
}

/*
 * 32 hmask bytes, 64 code bytes (low two bits as Q2_K), 12 packed scale bytes, d. The code's
 * third bit of element i is bit i / 32 of hmask byte i % 32, and a zero bit subtracts 4.
 * (d sc) q: exact.
 */
static inline void plain_q3_k(const uint8_t *restrict block, float *restrict out) {
    const uint8_t *hmask = block, *qs = block + QK_K / 8;
    const float d = read_fp16(block + 108);
    int scales[16];
    q3_k_scales(block + 96, scales);
    for (int sub = 0; sub < QK_K / 16; sub++) {
        const float dl = d * (float)scales[sub];
        const uint8_t *q = qs + 32 * (sub / 8) + 16 * (sub % 2), *h = hmask + 16 * (sub % 2);
        const int shift = 2 * (sub / 2 % 4), bit = sub / 2;
        float *o = out + 16 * sub;
        for (int j = 0; j < 16; j++) {
            const int low = (q[j] >> shift) & 3, missing = ((h[j] >> bit) & 1) ^ 1;
            o[j] = dl * (float)(low - (missing << 2));
        }
    }
}

/* Q4_K's and Q5_K's eight 6-bit scales and mins from 12 bytes: sub-blocks 0-3 in the low six
 * bits of bytes 0-3 (scales) and 4-7 (mins), 4-7 in the nibbles of bytes 8-11 with their high
 * bits in the top two bits of bytes 0-3 (scales) and 4-7 (mins). */
static void k_scales_mins(const uint8_t *packed, int *scales, int *mins) {
    for (int j = 0; j < 4; j++) {
        scales[j] = packed[j] & 63;
        mins[j] = packed[j + 4] & 63;
        scales[j + 4] = (packed[j + 8] & 0xF) | (packed[j] >> 6) << 4;
        mins[j + 4] = (packed[j + 8] >> 4) | (packed[j + 4] >> 6) << 4;
    }
}

/*
 * d, dmin, 12 packed scale bytes, 128 code bytes: sub-block b (32 elements) is the low (b
 * even) or high (b odd) nibbles of bytes 32 (b / 2) ... + 31. (d sc) q - (dmin m), rounded once.
 */
static inline void plain_q4_k(const uint8_t *restrict block, float *restrict out) {
    const float d = read_fp16(block), dmin = read_fp16(block + 2);
    const uint8_t *qs = block + 16;
    int scales[8], mins[8];
    k_scales_mins(block + 4, scales, mins);
    for (int sub = 0; sub < QK_K / 32; sub++) {
        const float dl = d * (float)scales[sub], ml = dmin * (float)mins[sub];
        const uint8_t *q = qs + 32 * (sub / 2);
        const int shift = 4 * (sub % 2);
        float *o = out + 32 * sub;
        for (int j = 0; j < 32; j++) o[j] = dl * (float)((q[j] >> shift) & 0xF) - ml;
    }
}

/* As Q4_K with 32 qh bytes before the codes: element j of sub-block b has the fifth bit b of
 * qh byte j. (d sc) q - (dmin m), rounded once. */
static inline void plain_q5_k(const uint8_t *restrict block, float *restrict out) {
    const float d = read_fp16(block), dmin = read_fp16(block + 2);
    const uint8_t *qh = block + 16, *qs = block + 48;
    int scales[8], mins[8];
    k_scales_mins(block + 4, scales, mins);
    for (int sub = 0; sub < QK_K / 32; sub++) {
        const float dl = d * (float)scales[sub], ml = dmin * (float)mins[sub];
        const uint8_t *q = qs + 32 * (sub / 2);
        const int shift = 4 * (sub % 2);
        float *o = out + 32 * sub;
        for (int j = 0; j < 32; j++) {
            const int code = ((q[j] >> shift) & 0xF) | ((qh[j] >> sub) & 1) << 4;
            o[j] = dl * (float)code - ml;
        }
    }
}

/*
 * 128 ql bytes, 64 qh bytes, 16 int8 scales, d. Element 128 g + r: low nibble from ql byte
 * 64 g + r % 64 (its high nibble when r >= 64), two high bits from bits 2 (r / 32) of qh byte
 * 32 g + r % 32; the code minus 32. (d sc) q in that order (both products exact).
 */
static inline void plain_q6_k(const uint8_t *restrict block, float *restrict out) {
    const uint8_t *ql = block, *qh = block + QK_K / 2;
    const int8_t *scales = (const int8_t *)(block + 192);
    const float d = read_fp16(block + 208);
    for (int sub = 0; sub < QK_K / 16; sub++) {
        const float ds = d * (float)scales[sub];
        const int g = sub / 8, r = 16 * (sub % 8);
        const uint8_t *low = ql + 64 * g + r % 64, *high = qh + 32 * g + r % 32;
        const int low_shift = 4 * (r / 64), high_shift = 2 * (r / 32);
        float *o = out + 16 * sub;
        for (int j = 0; j < 16; j++) {
            const int code = ((low[j] >> low_shift) & 0xF) | ((high[j] >> high_shift) & 3) << 4;
            o[j] = ds * (float)(code - 32);
        }
    }
}

/* d; nibbles as Q4_0, each an index into IQ4_VALUES; d v. */
static inline void plain_iq4_nl(const uint8_t *restrict block, float *restrict out) {
    const float d = read_fp16(block);
    const uint8_t *qs = block + 2;
    for (int j = 0; j < QK / 2; j++) {
        out[j] = d * (float)IQ4_VALUES[qs[j] & 0xF];
        out[j + QK / 2] = d * (float)IQ4_VALUES[qs[j] >> 4];
    }
}

/*
 * d, 16 bits of scale highs (two per sub-block), 4 bytes of scale low nibbles, 128 code bytes:
 * sub-block b (32 elements) is the low then high nibbles of bytes 16 b ... + 15, each an index
 * into IQ4_VALUES; its scale is the 6-bit value minus 32. (d sc) v: exact.
 */
static inline void plain_iq4_xs(const uint8_t *restrict block, float *restrict out) {
    const float d = read_fp16(block);
    const uint16_t scales_high = read_u16(block + 2);
    const uint8_t *scales_low = block + 4, *qs = block + 8;
    for (int sub = 0; sub < QK_K / 32; sub++) {
        const int low = (scales_low[sub / 2] >> (4 * (sub % 2))) & 0xF;
        const int high = (scales_high >> (2 * sub)) & 3;
        const float dl = d * (float)((low | high << 4) - 32);
        const uint8_t *q = qs + 16 * sub;
        float *o = out + 32 * sub;
        for (int j = 0; j < 16; j++) {
            o[j] = dl * (float)IQ4_VALUES[q[j] & 0xF];
            o[j + 16] = dl * (float)IQ4_VALUES[q[j] >> 4];
        }
    }
}

/* ---------------- the same values on vectors (AVX-512: 16 lanes, AVX2: 8) ----------------
 *
 * The plain functions above are the reference (and the path without AVX2/FMA); these form the
 * very same float32 operations lane by lane (conversions of small integers are exact, each
 * product is exact, the one add or subtract is fused into an fma only where its product is
 * exact, so that it still rounds once), so the bits are the same (tested against the plain
 * build). Auto-vectorised, the plain loops ran 4-8x slower than the weights stream in.
 */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define VECTOR_BLOCKS
#if defined(__AVX512F__)
#define W 16
typedef __m512i VI;
typedef __m512 VF;
static inline VI u8_lanes(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline VI i8_lanes(const uint8_t *p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}
#define V_SET _mm512_set1_epi32
#define V_AND _mm512_and_si512
#define V_OR _mm512_or_si512
#define V_XOR _mm512_xor_si512
#define V_SUB _mm512_sub_epi32
#define V_SRL(a, n) _mm512_srl_epi32(a, _mm_cvtsi32_si128(n))
#define V_SLLI _mm512_slli_epi32
#define V_SRLV _mm512_srlv_epi32
#define V_IOTA(base) _mm512_add_epi32(_mm512_set1_epi32(base), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))
#define F_CVT _mm512_cvtepi32_ps
#define F_SET _mm512_set1_ps
#define F_MUL _mm512_mul_ps
#define F_FMA _mm512_fmadd_ps
#define F_STORE _mm512_storeu_ps
/* table[idx & 15] for a 16-float table held as one register */
typedef __m512 Table16;
static inline Table16 table16(const float *values) { return _mm512_loadu_ps(values); }
static inline VF lookup16(Table16 table, VI idx) { return _mm512_permutexvar_ps(idx, table); }
#else
#define W 8
typedef __m256i VI;
typedef __m256 VF;
static inline VI u8_lanes(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline VI i8_lanes(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
#define V_SET _mm256_set1_epi32
#define V_AND _mm256_and_si256
#define V_OR _mm256_or_si256
#define V_XOR _mm256_xor_si256
#define V_SUB _mm256_sub_epi32
#define V_SRL(a, n) _mm256_srl_epi32(a, _mm_cvtsi32_si128(n))
#define V_SLLI _mm256_slli_epi32
#define V_SRLV _mm256_srlv_epi32
#define V_IOTA(base) _mm256_add_epi32(_mm256_set1_epi32(base), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define F_CVT _mm256_cvtepi32_ps
#define F_SET _mm256_set1_ps
#define F_MUL _mm256_mul_ps
#define F_FMA _mm256_fmadd_ps
#define F_STORE _mm256_storeu_ps
typedef struct {
    __m256 lo, hi; /* entries 0-7, 8-15 */
} Table16;
static inline Table16 table16(const float *values) {
    return (Table16){_mm256_loadu_ps(values), _mm256_loadu_ps(values + 8)};
}
static inline VF lookup16(Table16 table, VI idx) {
    const __m256 lo = _mm256_permutevar8x32_ps(table.lo, idx);
    const __m256 hi = _mm256_permutevar8x32_ps(table.hi, idx);
    const __m256i high = _mm256_slli_epi32(idx, 28); /* bit 3 into the sign bit */
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(high));
}
#endif

/* d (q - 8): 16 bytes of nibbles, low ones elements 0-15, high ones 16-31. */
#define BODY_Q4_0(block, EMIT) \
    do {                                                                                   \
        const VF d = F_SET(read_scale(block));                                                  \
        const VI eight = V_SET(8), nibble = V_SET(0xF);                                        \
        for (int j = 0; j < QK / 2; j += W) {                                                  \
            const VI q = u8_lanes(block + 2 + j);                                              \
            EMIT(j, F_MUL(d, F_CVT(V_SUB(V_AND(q, nibble), eight))));                          \
            EMIT(j + QK / 2, F_MUL(d, F_CVT(V_SUB(V_SRL(q, 4), eight))));                      \
        }                                                                                      \
    } while (0)

#define BODY_Q4_1(block, EMIT) \
    do {                                                                                   \
        const VF d = F_SET(read_scale(block)), m = F_SET(read_scale(block + 2));                 \
        const VI nibble = V_SET(0xF);                                                          \
        for (int j = 0; j < QK / 2; j += W) {                                                  \
            const VI q = u8_lanes(block + 4 + j);                                              \
            EMIT(j, F_FMA(d, F_CVT(V_AND(q, nibble)), m));                                     \
            EMIT(j + QK / 2, F_FMA(d, F_CVT(V_SRL(q, 4)), m));                                 \
        }                                                                                      \
    } while (0)

/* The fifth bits of elements base .. base + W - 1 (bit e of qh), at bit 4. */
static inline VI fifth_bits(uint32_t qh, int base) {
    return V_SLLI(V_AND(V_SRLV(V_SET((int)qh), V_IOTA(base)), V_SET(1)), 4);
}

#define BODY_Q5_0(block, EMIT) \
    do {                                                                                   \
        const VF d = F_SET(read_scale(block));                                                  \
        const uint32_t qh = read_u32(block + 2);                                               \
        const VI sixteen = V_SET(16), nibble = V_SET(0xF);                                     \
        for (int j = 0; j < QK / 2; j += W) {                                                  \
            const VI q = u8_lanes(block + 6 + j);                                              \
            const VI lo = V_OR(V_AND(q, nibble), fifth_bits(qh, j));                           \
            const VI hi = V_OR(V_SRL(q, 4), fifth_bits(qh, j + QK / 2));                       \
            EMIT(j, F_MUL(d, F_CVT(V_SUB(lo, sixteen))));                                      \
            EMIT(j + QK / 2, F_MUL(d, F_CVT(V_SUB(hi, sixteen))));                             \
        }                                                                                      \
    } while (0)

#define BODY_Q5_1(block, EMIT) \
    do {                                                                                   \
        const VF d = F_SET(read_scale(block)), m = F_SET(read_scale(block + 2));                 \
        const uint32_t qh = read_u32(block + 4);                                               \
        const VI nibble = V_SET(0xF);                                                          \
        for (int j = 0; j < QK / 2; j += W) {                                                  \
            const VI q = u8_lanes(block + 8 + j);                                              \
            const VI lo = V_OR(V_AND(q, nibble), fifth_bits(qh, j));                           \
            const VI hi = V_OR(V_SRL(q, 4), fifth_bits(qh, j + QK / 2));                       \
            EMIT(j, F_FMA(d, F_CVT(lo), m));                                                   \
            EMIT(j + QK / 2, F_FMA(d, F_CVT(hi), m));                                          \
        }                                                                                      \
    } while (0)

#define BODY_Q8_0(block, EMIT) \
    do {                                                                                   \
        const VF d = F_SET(read_scale(block));                                                  \
        for (int j = 0; j < QK; j += W) EMIT(j, F_MUL(F_CVT(i8_lanes(block + 2 + j)), d));     \
    } while (0)

/* (d sc) q - dmin m on 16-element sub-blocks of 2-bit codes (layout: plain_q2_k). */
#define BODY_Q2_K(block, EMIT) \
    do {                                                                                   \
        const uint8_t *scales = block, *qs = block + QK_K / 16;                                \
        const float d = read_scale(block + 80), dmin = read_scale(block + 82);                   \
        const VI three = V_SET(3);                                                             \
        for (int sub = 0; sub < QK_K / 16; sub++) {                                            \
            const VF dl = F_SET(d * (float)(scales[sub] & 0xF));                               \
            const VF ml = F_SET(-(dmin * (float)(scales[sub] >> 4)));                          \
            const uint8_t *q = qs + 32 * (sub / 8) + 16 * (sub % 2);                           \
            const int shift = 2 * (sub / 2 % 4);                                               \
            for (int j = 0; j < 16; j += W)                                                    \
                EMIT(16 * sub + j, F_FMA(dl, F_CVT(V_AND(V_SRL(u8_lanes(q + j), shift), three)), ml));\
        }                                                                                      \
    } while (0)

#define BODY_Q3_K(block, EMIT) \
    do {                                                                                   \
        const uint8_t *hmask = block, *qs = block + QK_K / 8;                                  \
        const float d = read_scale(block + 108);                                                \
        int scales[16];                                                                        \
        q3_k_scales(block + 96, scales);                                                       \
        const VI three = V_SET(3), one = V_SET(1);                                             \
        for (int sub = 0; sub < QK_K / 16; sub++) {                                            \
            const VF dl = F_SET(d * (float)scales[sub]);                                       \
            const uint8_t *q = qs + 32 * (sub / 8) + 16 * (sub % 2), *h = hmask + 16 * (sub % 2);\
            const int shift = 2 * (sub / 2 % 4), bit = sub / 2;                                \
            for (int j = 0; j < 16; j += W) {                                                  \
                const VI low = V_AND(V_SRL(u8_lanes(q + j), shift), three);                    \
                const VI missing = V_XOR(V_AND(V_SRL(u8_lanes(h + j), bit), one), one);        \
                EMIT(16 * sub + j, F_MUL(dl, F_CVT(V_SUB(low, V_SLLI(missing, 2)))));          \
            }                                                                                  \
        }                                                                                      \
    } while (0)

#define BODY_Q4_K(block, EMIT) \
    do {                                                                                   \
        const float d = read_scale(block), dmin = read_scale(block + 2);                         \
        const uint8_t *qs = block + 16;                                                        \
        int scales[8], mins[8];                                                                \
        k_scales_mins(block + 4, scales, mins);                                                \
        const VI nibble = V_SET(0xF);                                                          \
        for (int sub = 0; sub < QK_K / 32; sub++) {                                            \
            const VF dl = F_SET(d * (float)scales[sub]), ml = F_SET(-(dmin * (float)mins[sub]));\
            const uint8_t *q = qs + 32 * (sub / 2);                                            \
            const int shift = 4 * (sub % 2);                                                   \
            for (int j = 0; j < 32; j += W)                                                    \
                EMIT(32 * sub + j, F_FMA(dl, F_CVT(V_AND(V_SRL(u8_lanes(q + j), shift), nibble)), ml));\
        }                                                                                      \
    } while (0)

#define BODY_Q5_K(block, EMIT) \
    do {                                                                                   \
        const float d = read_scale(block), dmin = read_scale(block + 2);                         \
        const uint8_t *qh = block + 16, *qs = block + 48;                                      \
        int scales[8], mins[8];                                                                \
        k_scales_mins(block + 4, scales, mins);                                                \
        const VI nibble = V_SET(0xF), one = V_SET(1);                                          \
        for (int sub = 0; sub < QK_K / 32; sub++) {                                            \
            const VF dl = F_SET(d * (float)scales[sub]), ml = F_SET(-(dmin * (float)mins[sub]));\
            const uint8_t *q = qs + 32 * (sub / 2);                                            \
            const int shift = 4 * (sub % 2);                                                   \
            for (int j = 0; j < 32; j += W) {                                                  \
                const VI low = V_AND(V_SRL(u8_lanes(q + j), shift), nibble);                   \
                const VI high = V_SLLI(V_AND(V_SRL(u8_lanes(qh + j), sub), one), 4);           \
                EMIT(32 * sub + j, F_FMA(dl, F_CVT(V_OR(low, high)), ml));                     \
            }                                                                                  \
        }                                                                                      \
    } while (0)

#define BODY_Q6_K(block, EMIT) \
    do {                                                                                   \
        const uint8_t *ql = block, *qh = block + QK_K / 2;                                     \
        const int8_t *scales = (const int8_t *)(block + 192);                                  \
        const float d = read_scale(block + 208);                                                \
        const VI nibble = V_SET(0xF), three = V_SET(3), bias = V_SET(32);                      \
        for (int sub = 0; sub < QK_K / 16; sub++) {                                            \
            const VF ds = F_SET(d * (float)scales[sub]);                                       \
            const int g = sub / 8, r = 16 * (sub % 8);                                         \
            const uint8_t *low = ql + 64 * g + r % 64, *high = qh + 32 * g + r % 32;           \
            const int low_shift = 4 * (r / 64), high_shift = 2 * (r / 32);                     \
            for (int j = 0; j < 16; j += W) {                                                  \
                const VI lo = V_AND(V_SRL(u8_lanes(low + j), low_shift), nibble);              \
                const VI hi = V_SLLI(V_AND(V_SRL(u8_lanes(high + j), high_shift), three), 4);  \
                EMIT(16 * sub + j, F_MUL(ds, F_CVT(V_SUB(V_OR(lo, hi), bias))));               \
            }                                                                                  \
        }                                                                                      \
    } while (0)

static const float IQ4_FLOATS[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

#define BODY_IQ4_NL(block, EMIT) \
    do {                                                                                   \
        const VF d = F_SET(read_scale(block));                                                  \
        const Table16 values = table16(IQ4_FLOATS);                                            \
        const VI nibble = V_SET(0xF);                                                          \
        for (int j = 0; j < QK / 2; j += W) {                                                  \
            const VI q = u8_lanes(block + 2 + j);                                              \
            EMIT(j, F_MUL(d, lookup16(values, V_AND(q, nibble))));                             \
            EMIT(j + QK / 2, F_MUL(d, lookup16(values, V_SRL(q, 4))));                         \
        }                                                                                      \
    } while (0)

#define BODY_IQ4_XS(block, EMIT) \
    do {                                                                                   \
        const float d = read_scale(block);                                                      \
        const uint16_t scales_high = read_u16(block + 2);                                      \
        const uint8_t *scales_low = block + 4, *qs = block + 8;                                \
        const Table16 values = table16(IQ4_FLOATS);                                            \
        const VI nibble = V_SET(0xF);                                                          \
        for (int sub = 0; sub < QK_K / 32; sub++) {                                            \
            const int low = (scales_low[sub / 2] >> (4 * (sub % 2))) & 0xF;                    \
            const int high = (scales_high >> (2 * sub)) & 3;                                   \
            const VF dl = F_SET(d * (float)((low | high << 4) - 32));                          \
            for (int j = 0; j < 16; j += W) {                                                  \
                const VI q = u8_lanes(qs + 16 * sub + j);                                      \
                EMIT(32 * sub + j, F_MUL(dl, lookup16(values, V_AND(q, nibble))));             \
                EMIT(32 * sub + 16 + j, F_MUL(dl, lookup16(values, V_SRL(q, 4))));             \
            }                                                                                  \
        }                                                                                      \
    } while (0)

/* A block's values stored to out (the scratch tile, an embedding row). */
#define EMIT_STORE(offset, values) F_STORE(out + (offset), values)
#define VECTOR_OF(type, BODY)                                                                \
    static inline void vector_##type(const uint8_t *restrict block, float *restrict out) {   \
        BODY(block, EMIT_STORE);                                                             \
    }
VECTOR_OF(q4_0, BODY_Q4_0)
VECTOR_OF(q4_1, BODY_Q4_1)
VECTOR_OF(q5_0, BODY_Q5_0)
VECTOR_OF(q5_1, BODY_Q5_1)
VECTOR_OF(q8_0, BODY_Q8_0)
VECTOR_OF(q2_k, BODY_Q2_K)
VECTOR_OF(q3_k, BODY_Q3_K)
VECTOR_OF(q4_k, BODY_Q4_K)
VECTOR_OF(q5_k, BODY_Q5_K)
VECTOR_OF(q6_k, BODY_Q6_K)
VECTOR_OF(iq4_nl, BODY_IQ4_NL)
VECTOR_OF(iq4_xs, BODY_IQ4_XS)
#define DEQUANTIZE(type) vector_##type
#else
#define DEQUANTIZE(type) plain_##type
#endif

/* nt rows of `blocks` blocks each, row_bytes apart from `data`, into out (k floats apart). */
typedef void (*DequantizeRows)(const uint8_t *data, int64_t row_bytes, int64_t blocks,
                               int64_t nt, float *out, int64_t k);

/* A type's rows: its block function inlined into the loop (one indirect call per tile, not
 * per block of 32 weights: the call had cost more than the block's work). */
#define ROWS_OF(type, dequantize)                                                            \
    static void rows_##type(const uint8_t *data, int64_t row_bytes, int64_t blocks,           \
                            int64_t nt, float *out, int64_t k) {                              \
        const int64_t weights = k / blocks, bytes = row_bytes / blocks;                        \
        for (int64_t i = 0; i < nt; i++)                                                      \
            for (int64_t b = 0; b < blocks; b++)                                              \
                dequantize(data + i * row_bytes + b * bytes, out + i * k + b * weights);        \
    }
ROWS_OF(f32, dequantize_f32)
ROWS_OF(f16, dequantize_f16)
ROWS_OF(bf16, dequantize_bf16)
ROWS_OF(q4_0, DEQUANTIZE(q4_0))
ROWS_OF(q4_1, DEQUANTIZE(q4_1))
ROWS_OF(q5_0, DEQUANTIZE(q5_0))
ROWS_OF(q5_1, DEQUANTIZE(q5_1))
ROWS_OF(q8_0, DEQUANTIZE(q8_0))
ROWS_OF(q2_k, DEQUANTIZE(q2_k))
ROWS_OF(q3_k, DEQUANTIZE(q3_k))
ROWS_OF(q4_k, DEQUANTIZE(q4_k))
ROWS_OF(q5_k, DEQUANTIZE(q5_k))
ROWS_OF(q6_k, DEQUANTIZE(q6_k))
ROWS_OF(iq4_nl, DEQUANTIZE(iq4_nl))
ROWS_OF(iq4_xs, DEQUANTIZE(iq4_xs))

/* Bytes per block of each quantized type (as gguf.GGML_QUANT_SIZES). */
#define BLOCK_BYTES_Q4_0 18
#define BLOCK_BYTES_Q4_1 20
#define BLOCK_BYTES_Q5_0 22
#define BLOCK_BYTES_Q5_1 24
#define BLOCK_BYTES_Q8_0 34
#define BLOCK_BYTES_IQ4_NL 18
#define BLOCK_BYTES_Q2_K 84
#define BLOCK_BYTES_Q3_K 110
#define BLOCK_BYTES_Q4_K 144
#define BLOCK_BYTES_Q5_K 176
#define BLOCK_BYTES_Q6_K 210
#define BLOCK_BYTES_IQ4_XS 136

/* ---------------- products: the accumulators ---------------- */

#define TILE_N 16

#if defined(__AVX512F__)
#define MR 4 /* rows per register block: 16 accumulators of the 32 registers */
#define NR 4
typedef __m512 Lanes;
static inline Lanes lanes_zero(void) { return _mm512_setzero_ps(); }
static inline Lanes lanes_load(const float *p) { return _mm512_loadu_ps(p); }
static inline Lanes lanes_fma(Lanes x, Lanes w, Lanes acc) { return _mm512_fmadd_ps(x, w, acc); }
static inline float lanes_sum(Lanes acc) {
    float lanes[16];
    _mm512_storeu_ps(lanes, acc);
    return fold16(lanes);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define MR 2 /* 16 registers: 2 x 2 accumulators of two halves each */
#define NR 2
typedef struct {
    __m256 lo, hi; /* lanes 0-7, 8-15 */
} Lanes;
static inline Lanes lanes_zero(void) { return (Lanes){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline Lanes lanes_load(const float *p) {
    return (Lanes){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
static inline Lanes lanes_fma(Lanes x, Lanes w, Lanes acc) {
    return (Lanes){_mm256_fmadd_ps(x.lo, w.lo, acc.lo), _mm256_fmadd_ps(x.hi, w.hi, acc.hi)};
}
static inline float lanes_sum(Lanes acc) { return sum8x2((v8f)acc.lo, (v8f)acc.hi); }
#else
#define MR 1 /* plain C: the same operations one lane at a time */
#define NR 1
typedef struct {
    float v[16];
} Lanes;
static inline Lanes lanes_zero(void) {
    Lanes out;
    memset(&out, 0, sizeof out);
    return out;
}
static inline Lanes lanes_load(const float *p) {
    Lanes out;
    memcpy(out.v, p, sizeof out.v);
    return out;
}
static inline Lanes lanes_fma(Lanes x, Lanes w, Lanes acc) {
    for (int j = 0; j < 16; j++) acc.v[j] = fmaf(x.v[j], w.v[j], acc.v[j]);
    return acc;
}
static inline float lanes_sum(Lanes acc) { return fold16(acc.v); }
#endif


#ifdef VECTOR_BLOCKS
/* Up to DIRECT_ROWS rows multiply as the weights stream, each block dequantised in registers
 * and used for every row at once; DIRECT_NR outputs at a time, so that independent fma
 * chains hide the latency (an accumulator's lanes add in k order: one chain each). */
#if defined(__AVX512F__)
#define DIRECT_ROWS 4
#define DIRECT_NR 4
#define ACC_FMA(acc, x, values, offset) (acc) = _mm512_fmadd_ps(_mm512_loadu_ps(x), values, acc)
#else
#define DIRECT_ROWS 2
#define DIRECT_NR 2
/* 8 lanes: k = offset .. offset + 7 belong to the accumulator's low half when offset % 16 is
 * 0, its high half when 8 (offset is a constant once the block's loops unroll) */
#define ACC_FMA(acc, x, values, offset)                                                        \
    do {                                                                                       \
        if ((offset) & 8) (acc).hi = _mm256_fmadd_ps(_mm256_loadu_ps(x), values, (acc).hi);     \
        else (acc).lo = _mm256_fmadd_ps(_mm256_loadu_ps(x), values, (acc).lo);                 \
    } while (0)
#endif

/* A block's values into every row's accumulator of output i (names of direct_group's body). */
#define EMIT_FMA(offset, values)                                                               \
    do {                                                                                       \
        const VF values_ = (values);                                                           \
        for (int r = 0; r < mr; r++) ACC_FMA(acc[r][i], xb + r * k + (offset), values_, offset); \
    } while (0)

#define DIRECT_OF(type, BODY, BLOCK_WEIGHTS, BLOCK_BYTES)                                      \
    static inline __attribute__((always_inline)) void direct_group_##type(                    \
        const uint8_t *data, int64_t row_bytes, int64_t blocks, const float *x, int64_t k,      \
        int mr, int nr, float *out, int64_t ldo) {                                            \
        Lanes acc[DIRECT_ROWS][DIRECT_NR];                                                     \
        for (int r = 0; r < mr; r++)                                                          \
            for (int i = 0; i < nr; i++) acc[r][i] = lanes_zero();                             \
        for (int64_t b = 0; b < blocks; b++) {                                                \
            const float *xb = x + b * (BLOCK_WEIGHTS);                                         \
            for (int i = 0; i < nr; i++) {                                                    \
                const uint8_t *block = data + i * row_bytes + b * (BLOCK_BYTES);               \
                BODY(block, EMIT_FMA);                                                         \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < mr; r++)                                                          \
            for (int i = 0; i < nr; i++) out[r * ldo + i] = lanes_sum(acc[r][i]);              \
    }                                                                                          \
    static void direct_##type(const uint8_t *data, int64_t row_bytes, int64_t blocks,         \
                              const float *x, int64_t k, int64_t rows, int64_t nt, float *out, \
                              int64_t ldo) {                                                   \
        for (int64_t n = 0; n < nt; n += DIRECT_NR) {                                         \
            const uint8_t *d = data + n * row_bytes;                                           \
            if (nt - n < DIRECT_NR) {                                                          \
                for (int64_t i = n; i < nt; i++)                                               \
                    for (int64_t r = 0; r < rows; r++)                                         \
                        direct_group_##type(data + i * row_bytes, row_bytes, blocks,           \
                                            x + r * k, k, 1, 1, out + r * ldo + i, ldo);       \
                return;                                                                        \
            }                                                                                  \
            switch (rows) {                                                                    \
            case 1: direct_group_##type(d, row_bytes, blocks, x, k, 1, DIRECT_NR, out + n, ldo); break; \
            case 2: direct_group_##type(d, row_bytes, blocks, x, k, 2, DIRECT_NR, out + n, ldo); break; \
            DIRECT_CASES_3_4(type)                                                             \
            }                                                                                  \
        }                                                                                      \
    }
#if DIRECT_ROWS >= 4
#define DIRECT_CASES_3_4(type)                                                                 \
    case 3: direct_group_##type(d, row_bytes, blocks, x, k, 3, DIRECT_NR, out + n, ldo); break; \
    case 4: direct_group_##type(d, row_bytes, blocks, x, k, 4, DIRECT_NR, out + n, ldo); break;
#else
#define DIRECT_CASES_3_4(type)
#endif
DIRECT_OF(q4_0, BODY_Q4_0, QK, BLOCK_BYTES_Q4_0)
DIRECT_OF(q4_1, BODY_Q4_1, QK, BLOCK_BYTES_Q4_1)
DIRECT_OF(q5_0, BODY_Q5_0, QK, BLOCK_BYTES_Q5_0)
DIRECT_OF(q5_1, BODY_Q5_1, QK, BLOCK_BYTES_Q5_1)
DIRECT_OF(q8_0, BODY_Q8_0, QK, BLOCK_BYTES_Q8_0)
DIRECT_OF(iq4_nl, BODY_IQ4_NL, QK, BLOCK_BYTES_IQ4_NL)
DIRECT_OF(q2_k, BODY_Q2_K, QK_K, BLOCK_BYTES_Q2_K)
DIRECT_OF(q3_k, BODY_Q3_K, QK_K, BLOCK_BYTES_Q3_K)
DIRECT_OF(q4_k, BODY_Q4_K, QK_K, BLOCK_BYTES_Q4_K)
DIRECT_OF(q5_k, BODY_Q5_K, QK_K, BLOCK_BYTES_Q5_K)
DIRECT_OF(q6_k, BODY_Q6_K, QK_K, BLOCK_BYTES_Q6_K)
DIRECT_OF(iq4_xs, BODY_IQ4_XS, QK_K, BLOCK_BYTES_IQ4_XS)
#define DIRECT(type) direct_##type
#else
#define DIRECT(type) NULL
#endif

/* Rows x[0 .. rows) (k floats apart) times nt outputs of `blocks` blocks each (row_bytes apart
 * from `data`), dequantised in registers as they stream: into out (ldo apart). */
typedef void (*DirectProduct)(const uint8_t *data, int64_t row_bytes, int64_t blocks,
                              const float *x, int64_t k, int64_t rows, int64_t nt, float *out,
                              int64_t ldo);

typedef struct {
    int64_t weights; /* per block: 32 or 256 */
    int64_t bytes;   /* per block, as in the file */
    DequantizeRows rows;
    DirectProduct direct; /* NULL: the scratch tile serves every row count */
} BlockKind;

static const BlockKind BLOCK_KINDS[GGUF_TYPES] = {
    [GGUF_F32] = {QK, 4 * QK, rows_f32},
    [GGUF_F16] = {QK, 2 * QK, rows_f16, NULL},
    [GGUF_BF16] = {QK, 2 * QK, rows_bf16, NULL},
    [GGUF_Q4_0] = {QK, BLOCK_BYTES_Q4_0, rows_q4_0, DIRECT(q4_0)},
    [GGUF_Q4_1] = {QK, 20, rows_q4_1, DIRECT(q4_1)},
    [GGUF_Q5_0] = {QK, 22, rows_q5_0, DIRECT(q5_0)},
    [GGUF_Q5_1] = {QK, 24, rows_q5_1, DIRECT(q5_1)},
    [GGUF_Q8_0] = {QK, 34, rows_q8_0, DIRECT(q8_0)},
    [GGUF_Q2_K] = {QK_K, 84, rows_q2_k, DIRECT(q2_k)},
    [GGUF_Q3_K] = {QK_K, 110, rows_q3_k, DIRECT(q3_k)},
    [GGUF_Q4_K] = {QK_K, 144, rows_q4_k, DIRECT(q4_k)},
    [GGUF_Q5_K] = {QK_K, 176, rows_q5_k, DIRECT(q5_k)},
    [GGUF_Q6_K] = {QK_K, 210, rows_q6_k, DIRECT(q6_k)},
    [GGUF_IQ4_NL] = {QK, 18, rows_iq4_nl, DIRECT(iq4_nl)},
    [GGUF_IQ4_XS] = {QK_K, 136, rows_iq4_xs, DIRECT(iq4_xs)},
};

/* The table entry of a type code, or NULL for an unknown one. */
static const BlockKind *block_kind(int type) {
    return type >= 0 && type < GGUF_TYPES ? &BLOCK_KINDS[type] : NULL;
}

/* One row of `blocks` blocks from `row` (file bytes) into out. */
static void dequantize_row(const BlockKind *kind, const uint8_t *row, int64_t blocks,
                           float *out) {
    kind->rows(row, blocks * kind->bytes, blocks, 1, out, blocks * kind->weights);
}

/* Weights and bytes per block of a type code (as above). Returns 0, or -1 for an unknown
 * type (nothing written). */
int gguf_block_info(int type, int64_t *block_weights, int64_t *block_bytes) {
    const BlockKind *kind = block_kind(type);
    if (kind == NULL) return -1;
    *block_weights = kind->weights;
    *block_bytes = kind->bytes;
    return 0;
}

/*
 * Rows ids[0 .. count) of the [n, k] matrix `data` (a tensor's bytes as in the file) of type
 * code `type`, dequantised into out ([count][k] float32): an embedding lookup. Over `threads`
 * OpenMP threads for more than 16 rows; a row's values never depend on them. Returns 0; -2 for
 * an unknown type or a k that is not a positive multiple of the block, -1 when an id is
 * outside [0, n) (both before anything is written).
 */
int gguf_block_rows(int type, const uint8_t *data, int64_t n, int64_t k, const int64_t *ids,
                    int64_t count, float *out, int threads) {
    const BlockKind *kind = block_kind(type);
    if (kind == NULL || k <= 0 || k % kind->weights != 0) return -2;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return -1;
    const int64_t blocks = k / kind->weights, row_bytes = blocks * kind->bytes;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) if (count > 16)
    for (int64_t i = 0; i < count; i++)
        dequantize_row(kind, data + ids[i] * row_bytes, blocks, out + i * k);
    return 0;
}

/* ---------------- products: out = x W^T with W as stored ---------------- */

/*
 * Every output element (m, n) is summed the same way whatever the batch, the tiling, the
 * thread count or the instruction set, and the same way as gguf_linear.c's Q4_1/Q8_0 kernel:
 * 16 float lanes, lane j accumulating x[m][k] w[n][k] for k = j (mod 16) with fma in
 * increasing k, then fold16's tree (lane j + lane j + 8, then + 4, + 2, + 1). The weights are
 * the dequantised values above (exactly gguf's), so a row's bits never depend on the rows it is
 * multiplied with: a verify step and a decode step agree.
 *
 * A work unit is a tile of TILE_N outputs: their rows are dequantised once into a per-thread
 * float32 scratch of TILE_N x K (a decode's weights stream through it; at batch every row of x
 * reuses it), then register blocks of MR rows x NR outputs run over K. Units are split
 * statically over the threads, each thread's run of outputs contiguous in the file.
 */
/* Rows x[0 .. mr) (ldx apart) times outputs w[0 .. nr) (ldw apart) over k, into out (ldo
 * apart). Called with constant mr, nr, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void block_product(const float *x, int64_t ldx,
                                                                const float *w, int64_t ldw,
                                                                int64_t k, float *out,
                                                                int64_t ldo, int mr, int nr) {
    Lanes acc[MR][NR];
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < nr; i++) acc[r][i] = lanes_zero();
    for (int64_t c = 0; c < k; c += 16) {
        Lanes xs[MR];
        for (int r = 0; r < mr; r++) xs[r] = lanes_load(x + r * ldx + c);
        for (int i = 0; i < nr; i++) {
            const Lanes wv = lanes_load(w + i * ldw + c);
            for (int r = 0; r < mr; r++) acc[r][i] = lanes_fma(xs[r], wv, acc[r][i]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < nr; i++) out[r * ldo + i] = lanes_sum(acc[r][i]);
}

/* One shape of block_product per (mr, nr) up to (MR, NR), each with constant counts. */
#define BLOCK_CASE(a, b)                                                                     \
    case (a) * 16 + (b): block_product(x, ldx, w, ldw, k, out, ldo, a, b); return;
static void block_product_any(const float *x, int64_t ldx, const float *w, int64_t ldw,
                              int64_t k, float *out, int64_t ldo, int mr, int nr) {
    switch (mr * 16 + nr) {
#if MR >= 4
        BLOCK_CASE(4, 4) BLOCK_CASE(4, 3) BLOCK_CASE(4, 2) BLOCK_CASE(4, 1)
        BLOCK_CASE(3, 4) BLOCK_CASE(3, 3) BLOCK_CASE(3, 2) BLOCK_CASE(3, 1)
        BLOCK_CASE(2, 4) BLOCK_CASE(2, 3) BLOCK_CASE(1, 4) BLOCK_CASE(1, 3)
#endif
#if MR >= 2
        BLOCK_CASE(2, 2) BLOCK_CASE(2, 1) BLOCK_CASE(1, 2)
#endif
        BLOCK_CASE(1, 1)
    }
}

/* Rows x[0 .. rows) times the tile's nt outputs (dequantised, [nt][k]) into out (ldo apart). */
static void tile_product(const float *x, int64_t rows, int64_t k, const float *tile, int64_t nt,
                         float *out, int64_t ldo) {
    for (int64_t m = 0; m < rows; m += MR) {
        const int mr = rows - m < MR ? (int)(rows - m) : MR;
        for (int64_t i = 0; i < nt; i += NR) {
            const int nr = nt - i < NR ? (int)(nt - i) : NR;
            block_product_any(x + m * k, k, tile + i * k, k, k, out + m * ldo + i, ldo, mr, nr);
        }
    }
}

/*
 * out[rows][n] = x[rows][k] W^T, W the [n, k] matrix of type code `type` whose bytes as in
 * the file are `data` (cpu_ops.c's linear_fn signature, so a fused layer calls it by address).
 * Returns 0; -1 when scratch memory cannot be allocated; -2 for an unknown type or a k that is
 * not a positive multiple of its block or of 16.
 */
int gguf_block_linear(int type, const float *x, int64_t rows, int64_t k, const void *data,
                      int64_t n, float *out, int threads) {
    const BlockKind *kind = block_kind(type);
    if (kind == NULL || k <= 0 || k % kind->weights != 0 || k % 16 != 0) return -2;
    if (rows <= 0 || n <= 0) return 0;
    const int64_t blocks = k / kind->weights, row_bytes = blocks * kind->bytes;
    const int64_t units = (n + TILE_N - 1) / TILE_N;
#ifdef VECTOR_BLOCKS
    if (kind->direct != NULL && rows <= DIRECT_ROWS) {
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static) if (units > 1)
        for (int64_t unit = 0; unit < units; unit++) {
            const int64_t n0 = unit * TILE_N, nt = n - n0 < TILE_N ? n - n0 : TILE_N;
            kind->direct((const uint8_t *)data + n0 * row_bytes, row_bytes, blocks, x, k, rows, nt,
                         out + n0, n);
        }
        return 0;
    }
#endif
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (units > 1)
    {
        float *tile = NULL;
        const int ok = posix_memalign((void **)&tile, 64, (size_t)(TILE_N * k) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < units; unit++) {
            if (ok != 0) continue;
            const int64_t n0 = unit * TILE_N, nt = n - n0 < TILE_N ? n - n0 : TILE_N;
            kind->rows((const uint8_t *)data + n0 * row_bytes, row_bytes, blocks, nt, tile, k);
            tile_product(x, rows, k, tile, nt, out + n0, n);
        }
        if (ok != 0) {
#pragma omp atomic write
            failed = 1;
        }
        free(tile);
    }
    return failed ? -1 : 0;
}

/* Which vector path this build multiplies with: 0 plain C, 1 AVX2 with FMA, 2 AVX-512. */
int gguf_block_isa(void) {
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}
