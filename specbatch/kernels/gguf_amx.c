/*
 * out = x W^T for float32 x and W in GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
 * IQ4_NL, IQ4_XS), on
 * AMX tiles (TDPBF16PS), with the weights' values as stored and a row's bits independent of its
 * batch-mates.
 *
 * Why this is exact to the file: a block's integer codes (Q4_0: -8..7, Q4_1 and Q4_K: 0..15,
 * Q5_0: -16..15, Q5_1 and Q5_K: 0..31, Q8_0: -128..127, the IQ4 code book's integers) are
 * exactly bfloat16 values, and a
 * float32 activation is exactly the sum of three bfloat16 parts (hi = x with its low 16 bits
 * cut, mid = the same of x - hi, lo = x - hi - mid: 8 + 8 + 8 significant bits; parts below
 * 2^-126 are flushed by the tile unit). So one block's integer sum C = sum_k q_k x_k is
 * TDPBF16PS over the hi, then the mid, then the lo parts into one zeroed float32 tile, every
 * product exact and the sums float32. Each block of 32 K's C is then scaled as the file says:
 * acc = fma(d, C, acc), and for the types with a minimum acc = fma(m, S, acc) with S the
 * block's sum of x (a fixed tree), block by block in increasing order. (The K-quants' blocks
 * are their sub-blocks of 32: d = d_super * sc and m = -(dmin * m_sub), IQ4_XS's d * (ls - 32),
 * exact in float32.) A
 * tile's rows never meet, so an output (row, n) has the same bits at any row count, tiling and
 * thread count.
 *
 * Layout (gguf_amx_pack, once at load): records per 16 outputs (a tile column) and block of 32
 * K, tile column outer: the codes in TDPBF16PS's B order (row p of the tile holds, for each of
 * the 16 outputs, the pair of K = 2p, 2p + 1), then the 16 outputs' d (and m): fp16 as in the
 * file for the 32-blocks (the file's bytes rearranged, no larger), float32 for the K-quants'
 * products. 4-bit codes: 8 chunks of 32 bytes, byte j of chunk c holding tile element 64c + j
 * in its low nibble and 64c + 32 + j in its high one; 5-bit codes add a plane of 512 bits, bit
 * e the fifth bit of tile element e; 8-bit codes are one byte per element.
 *
 * Built at first use (cbuild: -march=native); without AMX, or where Linux refuses the tile
 * state, gguf_amx_available returns 0 and nothing else may be called.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

/* kind codes (gguf_tiles.py's _KIND) */
enum { Q4_1 = 0, Q8_0 = 1, Q4_0 = 2, Q5_0 = 3, Q5_1 = 4, Q4_K = 5, Q5_K = 6, IQ4_NL = 7, IQ4_XS = 8, KINDS = 9 };
/* IQ4_NL's and IQ4_XS's code book (ggml's kvalues_iq4nl) */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
#define TN 16 /* outputs per tile column */
#define TK 32 /* K per block (one tile's depth) */
#define TILE 512 /* bfloat16 values per tile */
#define SUPER 256 /* K per K-quant super-block */

int gguf_amx_available(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

static int code_bits(int kind) {
    return kind == Q8_0 ? 8 : kind == Q5_0 || kind == Q5_1 || kind == Q5_K ? 5 : 4;
}
static int has_min(int kind) { return kind == Q4_1 || kind == Q5_1 || kind == Q4_K || kind == Q5_K; }
static int wide_scales(int kind) { return kind == Q4_K || kind == Q5_K || kind == IQ4_XS; }
/* the value of code q (its bfloat16 table) */
static int code_value(int kind, int q) {
    if (kind == IQ4_NL || kind == IQ4_XS) return IQ4_VALUES[q & 15];
    return kind == Q4_0 ? q - 8 : kind == Q5_0 ? q - 16 : kind == Q8_0 ? (int8_t)q : q;
}
static int64_t code_bytes(int kind) {
    const int bits = code_bits(kind);
    return bits == 8 ? TILE : bits == 5 ? TILE / 2 + TILE / 8 : TILE / 2;
}
static int64_t scale_bytes(int kind) { return wide_scales(kind) ? 4 : 2; }
int64_t gguf_amx_record_bytes(int kind) {
    if (kind < 0 || kind >= KINDS) return 0;
    return code_bytes(kind) + TN * scale_bytes(kind) * (has_min(kind) ? 2 : 1);
}

/* Bytes of one file block, and K per block. */
static int64_t file_block_bytes(int kind) {
    static const int64_t bytes[KINDS] = {20, 34, 18, 22, 24, 144, 176, 18, 136};
    return bytes[kind];
}
static int64_t file_block_k(int kind) {
    return kind == Q4_K || kind == Q5_K || kind == IQ4_XS ? SUPER : TK;
}

static float fp16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The K-quants' 6-bit scale and minimum of sub-block s (ggml's get_scale_min_k4). */
static void scale_min_k4(const uint8_t *scales, int s, int *sc, int *mn) {
    if (s < 4) {
        *sc = scales[s] & 63;
        *mn = scales[s + 4] & 63;
    } else {
        *sc = (scales[s + 4] & 0xF) | ((scales[s - 4] >> 6) << 4);
        *mn = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
    }
}

/* Output row `row`'s block b of 32 K in the file: its codes q[32] (0..15, 0..31 or a byte), d
 * and m (0 without a minimum), each as the file's dequantisation uses them. */
static void file_block(int kind, const uint8_t *row, int64_t b, uint8_t *q, float *d, float *m) {
    const uint8_t *block = row + b * TK / file_block_k(kind) * file_block_bytes(kind);
    *m = 0.0f;
    if (kind == Q4_K || kind == Q5_K) {
        const int s = (int)(b % 8);
        int sc, mn;
        scale_min_k4(block + 4, s, &sc, &mn);
        *d = fp16_at(block) * (float)sc;
        *m = -(fp16_at(block + 2) * (float)mn);
        const uint8_t *qs = block + (kind == Q4_K ? 16 : 48), *qh = block + 16;
        for (int l = 0; l < TK; l++) {
            const uint8_t byte = qs[32 * (s / 2) + l];
            q[l] = s % 2 ? byte >> 4 : byte & 0xF;
            if (kind == Q5_K) q[l] |= (uint8_t)(((qh[l] >> s) & 1) << 4);
        }
        return;
    }
    if (kind == IQ4_XS) { /* 6-bit signed sub-block scales: d (ls - 32) */
        const int s = (int)(b % 8);
        uint16_t high;
        memcpy(&high, block + 2, 2);
        const int ls = ((block[4 + s / 2] >> (4 * (s % 2))) & 0xF) | (((high >> (2 * s)) & 3) << 4);
        *d = fp16_at(block) * (float)(ls - 32);
        const uint8_t *qs = block + 8 + 16 * s;
        for (int l = 0; l < TK; l++) q[l] = l < 16 ? qs[l] & 0xF : qs[l - 16] >> 4;
        return;
    }
    *d = fp16_at(block);
    if (kind == Q8_0) {
        memcpy(q, block + 2, TK);
        return;
    }
    if (kind == Q4_1 || kind == Q5_1) *m = fp16_at(block + 2);
    const int minimum = kind == Q4_1 || kind == Q5_1;
    const uint8_t *qs = block + 2 + 2 * minimum + (code_bits(kind) == 5 ? 4 : 0);
    uint32_t qh = 0;
    if (code_bits(kind) == 5) memcpy(&qh, block + 2 + 2 * minimum, 4);
    for (int l = 0; l < TK; l++) {
        q[l] = l < 16 ? qs[l] & 0xF : qs[l - 16] >> 4;
        if (code_bits(kind) == 5) q[l] |= (uint8_t)(((qh >> l) & 1) << 4);
    }
}

static void store_scale(int kind, uint8_t *at, float value) {
    if (wide_scales(kind)) {
        memcpy(at, &value, 4);
    } else { /* an fp16 from the file: converted back exactly */
        const uint16_t h = _cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT);
        memcpy(at, &h, 2);
    }
}

/* File blocks raw [n][row bytes] -> records (out: ceil(n / 16) * k / 32 of them). */
int gguf_amx_pack(int kind, const uint8_t *raw, int64_t n, int64_t k, uint8_t *out) {
    if (kind < 0 || kind >= KINDS || k % file_block_k(kind)) return 1;
    const int64_t blocks = k / TK, row_bytes = k / file_block_k(kind) * file_block_bytes(kind);
    const int64_t record = gguf_amx_record_bytes(kind), codes = code_bytes(kind);
    const int64_t sb = scale_bytes(kind), columns = (n + TN - 1) / TN;
    const int bits = code_bits(kind);
#pragma omp parallel for schedule(static)
    for (int64_t col = 0; col < columns; col++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *rec = out + (col * blocks + b) * record;
            memset(rec, 0, (size_t)record);
            for (int c = 0; c < TN; c++) {
                const int64_t row = col * TN + c;
                if (row >= n) continue; /* zero codes and scales */
                uint8_t q[TK];
                float d, m;
                file_block(kind, raw + row * row_bytes, b, q, &d, &m);
                store_scale(kind, rec + codes + c * sb, d);
                if (has_min(kind)) store_scale(kind, rec + codes + (TN + c) * sb, m);
                for (int kk = 0; kk < TK; kk++) {
                    const int e = (kk / 2) * 32 + 2 * c + kk % 2; /* tile element */
                    if (bits == 8) {
                        rec[e] = q[kk];
                        continue;
                    }
                    const int chunk = e / 64, pos = e % 64;
                    rec[chunk * 32 + pos % 32] |= (uint8_t)(pos < 32 ? q[kk] & 0xF : (q[kk] & 0xF) << 4);
                    if (bits == 5 && q[kk] >> 4) rec[TILE / 2 + e / 8] |= (uint8_t)(1u << (e % 8));
                }
            }
        }
    return 0;
}

/* A record's code of tile element e (0..15, 0..31 or a byte). */
static int record_code(int kind, const uint8_t *rec, int e) {
    if (code_bits(kind) == 8) return rec[e];
    const uint8_t byte = rec[(e / 64) * 32 + e % 32];
    int q = e % 64 < 32 ? byte & 0xF : byte >> 4;
    if (code_bits(kind) == 5) q |= ((rec[TILE / 2 + e / 8] >> (e % 8)) & 1) << 4;
    return q;
}

static float scale_at(int kind, const uint8_t *at) {
    if (!wide_scales(kind)) return fp16_at(at);
    float value;
    memcpy(&value, at, 4);
    return value;
}

/* Rows ids of W dequantised (an embedding lookup): d q (+ m) rounded once, as gguf's. */
int gguf_amx_rows(int kind, const void *data, int64_t n, int64_t k, const int64_t *ids,
                  int64_t count, float *out) {
    const int64_t blocks = k / TK, record = gguf_amx_record_bytes(kind), codes = code_bytes(kind);
    const int64_t sb = scale_bytes(kind);
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return 1;
    for (int64_t i = 0; i < count; i++) {
        const int64_t col = ids[i] / TN, c = ids[i] % TN;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *rec = (const uint8_t *)data + (col * blocks + b) * record;
            const float d = scale_at(kind, rec + codes + c * sb);
            const float m = has_min(kind) ? scale_at(kind, rec + codes + (TN + c) * sb) : 0.0f;
            float *row = out + i * k + b * TK;
            for (int kk = 0; kk < TK; kk++) {
                const int e = (kk / 2) * 32 + 2 * (int)c + kk % 2;
                const float q = (float)code_value(kind, record_code(kind, rec, e));
                row[kk] = has_min(kind) ? fmaf(q, d, m) : d * q;
            }
        }
    }
    return 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* tiles 0 and 6: C; 1-3: A (hi, mid, lo); 4 and 5: B */
static void configure(int rows) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) cfg.colsb[t] = 64;
    for (int t = 0; t < 4; t++) cfg.rows[t] = (uint8_t)rows;
    cfg.rows[4] = cfg.rows[5] = 16;
    cfg.rows[6] = (uint8_t)rows;
    _tile_loadconfig(&cfg);
}

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Row m's three parts into the A tiles' buffer ([row tile][block][part][tile rows][32]: tile
 * rows = the row count up to 16, else 16), and (types with a minimum) its block sums. */
static void split_row(const float *x, int64_t k, int64_t m, int tile_rows, uint16_t *parts,
                      float *sums) {
    const int64_t blocks = k / TK, tile_row = m / 16, r = m % 16, size = tile_rows * TK;
    for (int64_t b = 0; b < blocks; b++) {
        uint16_t *base = parts + ((tile_row * blocks + b) * 3) * size + r * TK;
        const float *xb = x + b * TK;
        for (int j = 0; j < TK; j++) {
            const uint32_t u = bits_of(xb[j]);
            const float hi = float_of(u & 0xFFFF0000u);
            const float rest = xb[j] - hi;
            const uint32_t v = bits_of(rest);
            const float mid = float_of(v & 0xFFFF0000u);
            const float lo = rest - mid;
            base[j] = (uint16_t)(u >> 16);
            base[size + j] = (uint16_t)(v >> 16);
            base[2 * size + j] = (uint16_t)(bits_of(lo) >> 16);
        }
        if (sums) { /* a fixed tree over the 32 values */
            float t[16];
            for (int j = 0; j < 16; j++) t[j] = xb[j] + xb[j + 16];
            for (int w = 8; w; w /= 2)
                for (int j = 0; j < w; j++) t[j] += t[j + w];
            sums[m * blocks + b] = t[0];
        }
    }
}

/* 4- or 5-bit codes -> bfloat16 tile (table: each code's bfloat16 value) */
static inline void decode_small(const uint8_t *codes, uint16_t *tile, __m512i table, int five) {
    const __m512i low = _mm512_set1_epi16(0xF), sixteen = _mm512_set1_epi16(16);
    for (int c = 0; c < 8; c++) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + 32 * c)));
        __m512i lo = _mm512_and_si512(v, low), hi = _mm512_srli_epi16(v, 4);
        if (five) {
            uint64_t plane;
            memcpy(&plane, codes + TILE / 2 + 8 * c, 8);
            lo = _mm512_mask_add_epi16(lo, (__mmask32)plane, lo, sixteen);
            hi = _mm512_mask_add_epi16(hi, (__mmask32)(plane >> 32), hi, sixteen);
        }
        _mm512_store_si512(tile + 64 * c, _mm512_permutexvar_epi16(lo, table));
        _mm512_store_si512(tile + 64 * c + 32, _mm512_permutexvar_epi16(hi, table));
    }
}

static inline void decode_q8_0(const uint8_t *codes, uint16_t *tile) {
    for (int p = 0; p < 16; p++) {
        const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 32 * p))));
        const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 32 * p + 16))));
        _mm512_store_si512(tile + 32 * p, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}

static inline void decode(int kind, const uint8_t *codes, uint16_t *tile, __m512i table) {
    if (kind == Q8_0) decode_q8_0(codes, tile);
    else decode_small(codes, tile, table, code_bits(kind) == 5);
}

/* 16 outputs' d (or m) of a record, as float32 */
static inline __m512 load_scales(int kind, const uint8_t *at) {
    if (wide_scales(kind)) return _mm512_loadu_ps(at);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
}

int gguf_amx_linear(int kind, const float *x, int64_t rows, int64_t k, const void *data, int64_t n,
                    float *out, int threads) {
    if (rows <= 0) return 0;
    const int64_t blocks = k / TK, row_tiles = (rows + 15) / 16, columns = (n + TN - 1) / TN;
    if (kind < 0 || kind >= KINDS || k % TK) return 2;
    const int64_t record = gguf_amx_record_bytes(kind), codes = code_bytes(kind);
    const int64_t mins = codes + TN * scale_bytes(kind); /* where a record's m begin */
    const int minimum = has_min(kind);
    const int tile_rows = rows < 16 ? (int)rows : 16; /* rows per tile: one tile, or 16 */
    uint16_t *parts = aligned_alloc(64, (size_t)(row_tiles * blocks * 3 * tile_rows * TK * 2));
    float *sums = minimum ? malloc((size_t)(rows * blocks) * sizeof(float)) : NULL;
    const int64_t acc_floats = row_tiles * 16 * 32; /* per thread: two columns' outputs */
    float *accs = aligned_alloc(64, (size_t)(threads * acc_floats) * sizeof(float));
    if (!parts || (minimum && !sums) || !accs) {
        free(parts);
        free(sums);
        free(accs);
        return 1;
    }
    /* (a last row tile's missing rows are multiplied as they are and never read out) */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++) split_row(x + m * k, k, m, tile_rows, parts, sums);
        configure(tile_rows);
        uint16_t btile[2][2][TILE] __attribute__((aligned(64)));
        float spill[2 * 16 * 16] __attribute__((aligned(64)));
        float *acc = accs + omp_get_thread_num() * acc_floats;
        __m512i table;
        {
            uint16_t t[32];
            for (int i = 0; i < 32; i++)
                t[i] = (uint16_t)(bits_of((float)code_value(kind, code_bits(kind) == 5 ? i : i & 15)) >> 16);
            table = _mm512_loadu_si512(t);
        }
        /* Two tile columns at a time (C tiles 0 and 6, B tiles 4 and 5, B buffers 0 and 1):
         * the tile registers are not renamed, so two chains let one column's decode and
         * multiply overlap the other's. */
        const int64_t pairs = (columns + 1) / 2;
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < pairs; pair++) {
            const int64_t col0 = 2 * pair, ncols = col0 + 1 < columns ? 2 : 1;
            memset(acc, 0, (size_t)(rows * 32) * sizeof(float));
            const uint8_t *first = (const uint8_t *)data + col0 * blocks * record;
            decode(kind, first, btile[0][0], table);
            if (ncols == 2) decode(kind, first + blocks * record, btile[0][1], table);
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *rec0 = first + b * record;
                const uint8_t *rec1 = rec0 + blocks * record;
                /* the tiles load block b's codes, decoded one block ahead: the decode's
                 * stores have reached the cache by the time a tile loads them */
                _tile_loadd(4, btile[b & 1][0], 64);
                if (ncols == 2) _tile_loadd(5, btile[b & 1][1], 64);
                if (b + 1 < blocks) {
                    decode(kind, rec0 + record, btile[(b + 1) & 1][0], table);
                    if (ncols == 2) decode(kind, rec1 + record, btile[(b + 1) & 1][1], table);
                }
                for (int64_t t = 0; t < row_tiles; t++) {
                    const uint16_t *a = parts + ((t * blocks + b) * 3) * tile_rows * TK;
                    _tile_loadd(1, a, 64);
                    _tile_loadd(2, a + tile_rows * TK, 64);
                    _tile_loadd(3, a + 2 * tile_rows * TK, 64);
                    _tile_zero(0);
                    _tile_dpbf16ps(0, 1, 4);
                    if (ncols == 2) {
                        _tile_zero(6);
                        _tile_dpbf16ps(6, 1, 5);
                    }
                    _tile_dpbf16ps(0, 2, 4);
                    if (ncols == 2) _tile_dpbf16ps(6, 2, 5);
                    _tile_dpbf16ps(0, 3, 4);
                    if (ncols == 2) _tile_dpbf16ps(6, 3, 5);
                    _tile_stored(0, spill, 64);
                    if (ncols == 2) _tile_stored(6, spill + 256, 64);
                    const int64_t live = rows - t * 16 < 16 ? rows - t * 16 : 16;
                    for (int64_t j = 0; j < ncols; j++) {
                        const uint8_t *rec = j ? rec1 : rec0;
                        const __m512 d = load_scales(kind, rec + codes);
                        const __m512 mn = minimum ? load_scales(kind, rec + mins) : _mm512_setzero_ps();
                        for (int64_t r = 0; r < live; r++) {
                            float *row = acc + ((t * 16 + r) * 2 + j) * 16;
                            __m512 v = _mm512_fmadd_ps(d, _mm512_load_ps(spill + 256 * j + 16 * r), _mm512_load_ps(row));
                            if (minimum)
                                v = _mm512_fmadd_ps(mn, _mm512_set1_ps(sums[(t * 16 + r) * blocks + b]), v);
                            _mm512_store_ps(row, v);
                        }
                    }
                }
            }
            for (int64_t j = 0; j < ncols; j++) {
                const int64_t col = col0 + j, width = n - col * TN < TN ? n - col * TN : TN;
                for (int64_t m = 0; m < rows; m++)
                    memcpy(out + m * n + col * TN, acc + (m * 2 + j) * 16, (size_t)width * sizeof(float));
            }
        }
        _tile_release();
    }
    free(parts);
    free(sums);
    free(accs);
    return 0;
}

#else
int gguf_amx_available(void) { return 0; }
int64_t gguf_amx_record_bytes(int kind) {
    (void)kind;
    return 0;
}
int gguf_amx_pack(int kind, const uint8_t *raw, int64_t n, int64_t k, uint8_t *out) {
    (void)kind, (void)raw, (void)n, (void)k, (void)out;
    return 1;
}
int gguf_amx_rows(int kind, const void *data, int64_t n, int64_t k, const int64_t *ids,
                  int64_t count, float *out) {
    (void)kind, (void)data, (void)n, (void)k, (void)ids, (void)count, (void)out;
    return 1;
}
int gguf_amx_linear(int kind, const float *x, int64_t rows, int64_t k, const void *data, int64_t n,
                    float *out, int threads) {
    (void)kind, (void)x, (void)rows, (void)k, (void)data, (void)n, (void)out, (void)threads;
    return 1;
}
#endif
