/*
 * out = x W^T with W kept in GGUF's Q4_1 or Q8_0 blocks (32 weights along a row), dequantised
 * on the fly, never all of it at once.
 *
 * Layout (repacked once at load by gguf_linear.py). Rows go in panels of PANEL = 8 (the last
 * padded with zero rows); a panel is the sequence, for each group g of four blocks and each of
 * its rows, of one record:
 *   Q4_1 (96 bytes): 16 little-endian 32-bit lanes, byte b of lane j being the file's qs[j] of
 *     block 4g + b (low nibble: element j, high nibble: element j + 16); then (d, m) of the
 *     four blocks as float32.
 *   Q8_0 (144 bytes): the four blocks' 128 int8 values as in the file; then their d as float32.
 * (d and m are the file's fp16 values, converted exactly; a last, partial group is zero-padded.)
 * A panel is one sequential stream, which the hardware prefetcher follows: batch-1 decoding is
 * a stream of weights, and this is what keeps the memory busy. In Q4_1 with AVX-512 a block's
 * sixteen possible values d q + m are one 16-float table that a permute indexes by each lane's
 * low four bits, so sixteen weights cost a shift and a permute; with AVX2 (an 8-entry permute
 * only) the codes are converted to floats and each gets its fma(q, d, m), the table's values.
 * Dequantised values equal gguf's: d q is exact in float32, so fma(q, d, m) = d q + m rounded
 * once. With AVX2 a register block's panel streams through once, group by group, its
 * accumulators parked between groups.
 *
 * Every output element (m, n) is computed the same way whatever the batch, the tiling or the
 * thread count: 16 float lanes, lane j accumulating x[m][k] w[n][k] for k = j (mod 16) with
 * fma in increasing k, then a fixed tree (lane j + lane j + 8, then + 4, + 2, + 1). So a row's
 * bits never depend on the rows it is multiplied with (speculative decoding's verify step and
 * its decode step agree). The paths differ only in where the dequantised weights live: in
 * registers, block by block, for a few rows (decode and verify sizes), or in a per-thread
 * float32 tile reused over all the rows (larger batches; with AVX2 every row count stays in
 * registers, blocks of 6 rows per panel). The AVX2 path holds the 16 lanes in two 8-lane
 * registers, and the plain C path (neither) performs the same operations one output
 * at a time: both in the same order, with the same bits. Built with
 * -ffp-contract=off, so that every fused multiply-add is one written as such.
 *
 * Built at first use by specbatch/kernels/gguf_linear.py (cc -O3 -march=native -fopenmp) and
 * called through ctypes; no Python or torch headers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define VECTOR_PATH /* AVX-512, or AVX2 with FMA: else the plain C path */
#include <immintrin.h>
#endif

#define BLOCK 32
#define LANES 16
#define GROUP 4   /* blocks per record */
#define PANEL 8   /* rows per panel */
#define TILE_N 16 /* outputs per work unit (and per scratch tile): whole panels */
/* Measured on SmolLM2-135M's shapes (benchmarks/gguf_linear.py): */
#define DIRECT_ROWS 6      /* Q4_1 up to this many rows (one register block): no scratch */
#define DIRECT_ROWS_Q8 2   /* Q8_0 likewise (its 3 to 6-row blocks are slower than a tile) */
#define TILE_M 6           /* at most this many rows per register block over a scratch tile */
/* AVX2 (16 registers): every row count in registers, blocks of up to 6 rows per panel (a
 * panel streamed once, group by group), no scratch tile. Against a scratch tile from 3 rows
 * (Q4_1) or 7 (Q8_0): SmolLM2's 120 Q4_1 products at 5 / 6 rows 17.3 / 19.3 ms against 24.4 /
 * 27.0, its LM head 2.7 / 3.5 against 5.1 / 5.8; against a tile from 7 rows, all products and
 * the head at 16 / 64 / 256 rows 47-50 / 190-201 / 826-903 ms against 63-94 / 223-242 /
 * 968-1069 (AMD EPYC, 2 cores, 2026-12-05, alternated runs) */
#define DIRECT_ROWS_AVX2 6
#define CHUNK_K 768        /* at most this many weights of a row per chunk over a tile */
#define PREFETCH_GROUPS 12 /* prefetch distance: the streamed weights arrive in time */

enum { Q4_1 = 0, Q8_0 = 1 };

typedef struct {
    int kind;
    const uint8_t *data;
    int64_t n, k, blocks, groups;
    int64_t record, code_bytes; /* bytes per record, and of its codes (the scales follow) */
} Weights;

static Weights make_weights(int kind, const void *data, int64_t n, int64_t k) {
    const int64_t code_bytes = kind == Q4_1 ? GROUP * BLOCK / 2 : GROUP * BLOCK;
    const int64_t scale_bytes = (kind == Q4_1 ? 2 : 1) * GROUP * (int64_t)sizeof(float);
    const int64_t blocks = k / BLOCK;
    const Weights w = {kind, (const uint8_t *)data, n, k, blocks, (blocks + GROUP - 1) / GROUP,
                       code_bytes + scale_bytes, code_bytes};
    return w;
}

/* The record of row n, group g; the next group's record of the same row is PANEL records on. */
static inline const uint8_t *record_of(const Weights *w, int64_t n, int64_t g) {
    return w->data + ((n / PANEL * w->groups + g) * PANEL + n % PANEL) * w->record;
}

/* Block s of a record, dequantised to 32 floats (the reference the vector paths
 * equal, and an embedding lookup's rows). */
static void dequantize_block(const Weights *w, const uint8_t *record, int s, float *out) {
    const float *scales = (const float *)(record + w->code_bytes);
    if (w->kind == Q4_1) {
        const float d = scales[2 * s], m = scales[2 * s + 1];
        for (int j = 0; j < LANES; j++) {
            const uint8_t byte = record[4 * j + s];
            out[j] = fmaf((float)(byte & 0xF), d, m);
            out[j + LANES] = fmaf((float)(byte >> 4), d, m);
        }
    } else {
        const int8_t *q = (const int8_t *)record + s * BLOCK;
        for (int j = 0; j < BLOCK; j++) out[j] = scales[s] * (float)q[j];
    }
}

#ifdef VECTOR_PATH

/* Asks for bytes [start, start + size) ahead of use (past the end of the weights: harmless). */
static inline void prefetch(const uint8_t *start, int64_t size) {
    for (int64_t line = 0; line < size; line += 64)
        _mm_prefetch((const char *)start + line, _MM_HINT_T0);
}

#define KIND_DISPATCH(call, ...)                                                                 \
    do {                                                                                        \
        if (w->kind == Q4_1) call(w, Q4_1, __VA_ARGS__);                                        \
        else call(w, Q8_0, __VA_ARGS__);                                                        \
    } while (0)

#endif

#ifdef __AVX512F__

/*
 * The fixed reduction of four outputs' accumulators at once, stored to out[0 .. count - 1].
 * Each step adds lane j and lane j + step of every accumulator, as reduce_lanes does, with the
 * accumulators interleaved so that one add serves several.
 */
static inline void reduce4_store(const __m512 *acc, float *out, int count) {
    /* j + 8: [acc0 | acc1] and [acc2 | acc3], eight partial sums each */
    const __m512 t0 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[0], acc[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(acc[0], acc[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 t1 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2], acc[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(acc[2], acc[3], _MM_SHUFFLE(3, 2, 3, 2)));
    /* j + 4: 128-bit lane i holds accumulator i's four partial sums */
    const __m512 s4 = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)));
    /* j + 2, then j + 1, inside each 128-bit lane: the sums land in lanes 0, 4, 8, 12 */
    const __m512 s2 = _mm512_add_ps(s4, _mm512_permute_ps(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512 s1 = _mm512_add_ps(s2, _mm512_permute_ps(s2, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << count) - 1), _mm512_permutexvar_ps(pick, s1));
}

/* Block s of a record: its low (k = 32 b + j) and high (k = 32 b + 16 + j) dequantised weights. */
static inline __attribute__((always_inline)) void block_planes(int kind, const uint8_t *record,
                                                               int s, __m512 *lo, __m512 *hi) {
    if (kind == Q4_1) {
        const float *scales = (const float *)(record + GROUP * BLOCK / 2);
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(scales[2 * s]),
                                             _mm512_set1_ps(scales[2 * s + 1]));
        __m512i bits = _mm512_loadu_si512(record);
        bits = _mm512_srl_epi32(bits, _mm_cvtsi32_si128(8 * s));
        *lo = _mm512_permutexvar_ps(bits, table); /* reads each lane's low four bits */
        *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bits, 4), table);
    } else {
        const float *scales = (const float *)(record + GROUP * BLOCK);
        const __m512 d = _mm512_set1_ps(scales[s]);
        const __m128i q_lo = _mm_loadu_si128((const __m128i *)(record + s * BLOCK));
        const __m128i q_hi = _mm_loadu_si128((const __m128i *)(record + s * BLOCK + LANES));
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q_lo)), d);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q_hi)), d);
    }
}

/* A block's two planes stored as its 32 floats. */
static inline void store_planes(float *out, __m512 lo, __m512 hi) {
    _mm512_storeu_ps(out, lo);
    _mm512_storeu_ps(out + LANES, hi);
}

#elif defined(__AVX2__) && defined(__FMA__)

/*
 * AVX2 + FMA: the sixteen lanes as two 8-lane registers (lanes 0-7 and 8-15), the same fmas in
 * the same order and the same reduction tree, so the same bits. Sixteen registers (not 32) set
 * the block shapes: a register block holds at most eight accumulator registers.
 */
typedef struct {
    __m256 a, b; /* lanes 0-7, lanes 8-15 */
} Lanes16;

/* The fixed reduction of one output's 16 lanes: + 8, + 4, + 2, + 1, as reduce_lanes does. */
static inline float reduce16(Lanes16 acc) {
    const __m256 s8 = _mm256_add_ps(acc.a, acc.b);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* Eight int8 codes times d. */
static inline __m256 scaled8(const uint8_t *codes, __m256 d) {
    const __m128i q = _mm_loadl_epi64((const __m128i *)codes);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
}

/*
 * Block s of a record: its low (k = 32 b + j) and high (k = 32 b + 16 + j) dequantised weights.
 * Q4_1: fma(q, d, m) on the codes converted to floats, the table's values exactly; without a
 * 16-entry permute (two vpermps and a blend) SmolLM2's 120 products at 1 row take 7.5 ms, not
 * 10.5 (AMD EPYC, 2 cores, 2026-12-05, alternated runs).
 */
static inline __attribute__((always_inline)) void block_planes(int kind, const uint8_t *record,
                                                               int s, Lanes16 *lo, Lanes16 *hi) {
    if (kind == Q4_1) {
        const float *scales = (const float *)(record + GROUP * BLOCK / 2);
        const __m256 d = _mm256_set1_ps(scales[2 * s]), m = _mm256_set1_ps(scales[2 * s + 1]);
        const __m128i shift = _mm_cvtsi32_si128(8 * s);
        const __m256i nibble = _mm256_set1_epi32(0xF);
        const __m256i b0 = _mm256_srl_epi32(_mm256_loadu_si256((const __m256i *)record), shift);
        const __m256i b1 =
            _mm256_srl_epi32(_mm256_loadu_si256((const __m256i *)(record + 32)), shift);
        lo->a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, nibble)), d, m);
        lo->b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, nibble)), d, m);
        hi->a = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b0, 4), nibble)), d, m);
        hi->b = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b1, 4), nibble)), d, m);
    } else {
        const float *scales = (const float *)(record + GROUP * BLOCK);
        const __m256 d = _mm256_set1_ps(scales[s]);
        const uint8_t *codes = record + s * BLOCK;
        lo->a = scaled8(codes, d);
        lo->b = scaled8(codes + 8, d);
        hi->a = scaled8(codes + 16, d);
        hi->b = scaled8(codes + 24, d);
    }
}

/* acc += x[0 .. 31] times a block's planes, lane by lane in increasing k. */
static inline __attribute__((always_inline)) Lanes16 fma_block(const float *x, Lanes16 lo,
                                                               Lanes16 hi, Lanes16 acc) {
    acc.a = _mm256_fmadd_ps(_mm256_loadu_ps(x), lo.a, acc.a);
    acc.b = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), lo.b, acc.b);
    acc.a = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), hi.a, acc.a);
    acc.b = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), hi.b, acc.b);
    return acc;
}


#endif

#ifdef __AVX512F__

/* Outputs n0 .. n1 - 1 (whole panels, or up to N) dequantised into tile ([n1 - n0][K]),
 * reading the panels in order. */
static void dequantize_tile(const Weights *w, int64_t n0, int64_t n1, float *tile) {
    for (int64_t g = 0; g < w->groups; g++) {
        const int blocks = w->blocks - g * GROUP < GROUP ? (int)(w->blocks - g * GROUP) : GROUP;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *record = record_of(w, n, g);
            prefetch(record + PREFETCH_GROUPS * PANEL * w->record, w->record);
            float *out = tile + (n - n0) * w->k + g * GROUP * BLOCK;
            for (int s = 0; s < blocks; s++) {
                __m512 lo, hi;
                if (w->kind == Q4_1) block_planes(Q4_1, record, s, &lo, &hi);
                else block_planes(Q8_0, record, s, &lo, &hi);
                store_planes(out + s * BLOCK, lo, hi);
            }
        }
    }
}

#endif

#ifdef __AVX512F__

/*
 * The MR rows of x times outputs n0 .. n0 + NR - 1 (NR 4 or 8, inside one panel), the weights
 * dequantised in registers block by block and used for all MR rows. An accumulator takes two
 * dependent fmas per block, so one or two rows need eight outputs to hide the fma latency.
 * Padding outputs (n >= N) are computed and not stored.
 */
static inline __attribute__((always_inline)) void direct_micro(const Weights *w, int kind,
                                                               const float *x, int MR, int NR,
                                                               int64_t n0, float *out) {
    const uint8_t *first = record_of(w, n0, 0);
    const int64_t group_stride = PANEL * w->record;
    __m512 acc[DIRECT_ROWS][PANEL];
    for (int r = 0; r < MR; r++)
        for (int i = 0; i < NR; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < w->blocks; b++) {
        const uint8_t *records = first + b / GROUP * group_stride;
        if (b % GROUP == 0) prefetch(records + PREFETCH_GROUPS * group_stride, NR * w->record);
        __m512 x_lo[DIRECT_ROWS], x_hi[DIRECT_ROWS];
        for (int r = 0; r < MR; r++) {
            const float *row = x + r * w->k + b * BLOCK;
            x_lo[r] = _mm512_loadu_ps(row);
            x_hi[r] = _mm512_loadu_ps(row + LANES);
        }
        for (int i = 0; i < NR; i++) {
            __m512 lo, hi;
            block_planes(kind, records + i * w->record, (int)(b % GROUP), &lo, &hi);
            for (int r = 0; r < MR; r++) {
                acc[r][i] = _mm512_fmadd_ps(x_lo[r], lo, acc[r][i]);
                acc[r][i] = _mm512_fmadd_ps(x_hi[r], hi, acc[r][i]);
            }
        }
    }
    for (int i = 0; i < NR && n0 + i < w->n; i += 4) {
        const int count = w->n - n0 - i < 4 ? (int)(w->n - n0 - i) : 4;
        for (int r = 0; r < MR; r++)
            reduce4_store(&acc[r][i], out + r * w->n + n0 + i, count);
    }
}

/* All the rows (at most DIRECT_ROWS) times outputs [n0, n1) (whole panels, or up to N). */
static void direct_tile(const Weights *w, const float *x, int64_t rows, int64_t n0, int64_t n1,
                        float *out) {
    for (int64_t n = n0; n < n1; n += PANEL) {
        /* constant counts, so that the accumulators stay in registers */
        switch (rows) {
        case 1: KIND_DISPATCH(direct_micro, x, 1, 8, n, out); continue;
        case 2: KIND_DISPATCH(direct_micro, x, 2, 8, n, out); continue;
        }
        for (int64_t half = n; half < n + PANEL && half < n1; half += 4) {
            switch (rows) {
            case 3: KIND_DISPATCH(direct_micro, x, 3, 4, half, out); break;
            case 4: KIND_DISPATCH(direct_micro, x, 4, 4, half, out); break;
            case 5: KIND_DISPATCH(direct_micro, x, 5, 4, half, out); break;
            case 6: KIND_DISPATCH(direct_micro, x, 6, 4, half, out); break;
            }
        }
    }
}

/*
 * Rows m0 .. m0 + MR - 1 times the tile's rows i0 .. i0 + 3 (clamped to nt, those not stored)
 * over k in [k0, k1). Between chunks the accumulators wait in `partial` (a float stored and
 * loaded back is the same float); the last chunk reduces them into out.
 */
static inline __attribute__((always_inline)) void tile_micro(const float *tile, int64_t nt,
                                                             int64_t k, const float *x,
                                                             int64_t m0, int MR, int64_t i0,
                                                             int64_t k0, int64_t k1,
                                                             float *partial, float *out,
                                                             int64_t ldo) {
    const float *wrow[4];
    for (int i = 0; i < 4; i++) wrow[i] = tile + (i0 + i < nt ? i0 + i : nt - 1) * k;
    __m512 acc[TILE_M][4];
    for (int r = 0; r < MR; r++)
        for (int i = 0; i < 4; i++)
            acc[r][i] = k0 == 0 ? _mm512_setzero_ps()
                                : _mm512_loadu_ps(partial + ((m0 + r) * 4 + i) * LANES);
    for (int64_t p = k0; p < k1; p += LANES) {
        __m512 wv[4];
        for (int i = 0; i < 4; i++) {
            wv[i] = _mm512_loadu_ps(wrow[i] + p);
            __asm__("" : "+v"(wv[i])); /* one load each: GCC would fold them into the fmas */
        }
        for (int r = 0; r < MR; r++) {
            __m512 xv = _mm512_loadu_ps(x + (m0 + r) * k + p);
            __asm__("" : "+v"(xv));
            for (int i = 0; i < 4; i++) acc[r][i] = _mm512_fmadd_ps(xv, wv[i], acc[r][i]);
        }
    }
    if (k1 < k) {
        for (int r = 0; r < MR; r++)
            for (int i = 0; i < 4; i++)
                _mm512_storeu_ps(partial + ((m0 + r) * 4 + i) * LANES, acc[r][i]);
        return;
    }
    const int count = nt - i0 < 4 ? (int)(nt - i0) : 4;
    for (int r = 0; r < MR; r++) reduce4_store(acc[r], out + (m0 + r) * ldo + i0, count);
}

/*
 * Outputs [n0, n1) for all rows: the tile dequantised once, then for each four outputs, chunk
 * by chunk of K (so that the four weight rows stay in L1 while the rows of x go by), blocks of
 * TILE_M rows.
 */
static void scratch_tile(const Weights *w, const float *x, int64_t rows, int64_t n0, int64_t n1,
                         float *tile, float *partial, float *out) {
    const int64_t nt = n1 - n0, k = w->k;
    const int64_t chunks = (k + CHUNK_K - 1) / CHUNK_K;
    const int64_t chunk = ((k + chunks - 1) / chunks + LANES - 1) / LANES * LANES;
    const int64_t blocks = (rows + TILE_M - 1) / TILE_M; /* near-equal: no slow 1-row leftover */
    dequantize_tile(w, n0, n1, tile);
    float *o = out + n0;
    for (int64_t i = 0; i < nt; i += 4) {
        for (int64_t k0 = 0; k0 < k; k0 += chunk) {
            const int64_t k1 = k0 + chunk < k ? k0 + chunk : k;
            for (int64_t j = 0, m = 0; j < blocks; j++) {
                const int mr = (int)((rows - m) / (blocks - j));
                switch (mr) { /* constant counts: the accumulators stay in registers */
                case 1: tile_micro(tile, nt, k, x, m, 1, i, k0, k1, partial, o, w->n); break;
                case 2: tile_micro(tile, nt, k, x, m, 2, i, k0, k1, partial, o, w->n); break;
                case 3: tile_micro(tile, nt, k, x, m, 3, i, k0, k1, partial, o, w->n); break;
                case 4: tile_micro(tile, nt, k, x, m, 4, i, k0, k1, partial, o, w->n); break;
                case 5: tile_micro(tile, nt, k, x, m, 5, i, k0, k1, partial, o, w->n); break;
                case 6: tile_micro(tile, nt, k, x, m, 6, i, k0, k1, partial, o, w->n); break;
                }
                m += mr;
            }
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__)

/*
 * The MR rows of x times outputs n0 + i0 .. n0 + i0 + NR - 1 (inside one panel; MR * NR <= 4,
 * eight accumulator registers) over the blocks of group g: the accumulators come from and go
 * back to `acc` (a float stored and loaded back is the same float), the weights dequantised in
 * registers block by block and used for all MR rows.
 */
static inline __attribute__((always_inline)) void direct_group(const Weights *w, int kind,
                                                               const float *x, int MR, int NR,
                                                               int64_t n0, int i0, int64_t g,
                                                               Lanes16 acc[][PANEL]) {
    const uint8_t *records = record_of(w, n0 + i0, g);
    const int64_t b1 = (g + 1) * GROUP < w->blocks ? (g + 1) * GROUP : w->blocks;
    Lanes16 a[6][4];
    for (int r = 0; r < MR; r++)
        for (int i = 0; i < NR; i++) a[r][i] = acc[r][i0 + i];
    for (int64_t b = g * GROUP; b < b1; b++) {
        for (int i = 0; i < NR; i++) {
            Lanes16 lo, hi;
            block_planes(kind, records + i * w->record, (int)(b % GROUP), &lo, &hi);
            for (int r = 0; r < MR; r++)
                a[r][i] = fma_block(x + r * w->k + b * BLOCK, lo, hi, a[r][i]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int i = 0; i < NR; i++) acc[r][i0 + i] = a[r][i];
}

/*
 * The MR rows of x times the panel of outputs n0 .. n0 + 7, group by group: each group's
 * records (contiguous) are read once, in register blocks of NR outputs, so the panel streams
 * through once whatever NR is. Padding outputs (n >= N) are computed and not stored.
 */
static inline __attribute__((always_inline)) void direct_micro(const Weights *w, int kind,
                                                               const float *x, int MR, int NR,
                                                               int64_t n0, float *out) {
    Lanes16 acc[6][PANEL];
    for (int r = 0; r < MR; r++)
        for (int i = 0; i < PANEL; i++) acc[r][i].a = acc[r][i].b = _mm256_setzero_ps();
    const int64_t group_stride = PANEL * w->record;
    for (int64_t g = 0; g < w->groups; g++) {
        prefetch(record_of(w, n0, g) + PREFETCH_GROUPS * group_stride, group_stride);
        for (int i0 = 0; i0 < PANEL; i0 += NR) direct_group(w, kind, x, MR, NR, n0, i0, g, acc);
    }
    for (int i = 0; i < PANEL && n0 + i < w->n; i++)
        for (int r = 0; r < MR; r++) out[r * w->n + n0 + i] = reduce16(acc[r][i]);
}

/* All the rows times outputs [n0, n1) (whole panels, or up to N): per panel, blocks of up to
 * DIRECT_ROWS_AVX2 rows in turn, the panel's records staying in L1 between them. */
static void direct_tile(const Weights *w, const float *x, int64_t rows, int64_t n0, int64_t n1,
                        float *out) {
    for (int64_t n = n0; n < n1; n += PANEL) {
        for (int64_t m = 0; m < rows; m += DIRECT_ROWS_AVX2) {
            const float *xm = x + m * w->k;
            float *om = out + m * w->n;
            switch (rows - m < DIRECT_ROWS_AVX2 ? rows - m : DIRECT_ROWS_AVX2) {
            /* constant counts, so that the accumulators stay in registers */
            case 1: KIND_DISPATCH(direct_micro, xm, 1, 4, n, om); break;
            case 2: KIND_DISPATCH(direct_micro, xm, 2, 2, n, om); break;
            case 3: KIND_DISPATCH(direct_micro, xm, 3, 1, n, om); break;
            case 4: KIND_DISPATCH(direct_micro, xm, 4, 1, n, om); break;
            case 5: KIND_DISPATCH(direct_micro, xm, 5, 1, n, om); break;
            case 6: KIND_DISPATCH(direct_micro, xm, 6, 1, n, om); break;
            }
        }
    }
}

#else /* plain C: the same operations, one output at a time */

/* The fixed reduction of 16 lanes, as the vector path does it. */
static float reduce_lanes(float *lanes) {
    for (int step = LANES / 2; step >= 1; step /= 2)
        for (int j = 0; j < step; j++) lanes[j] += lanes[j + step];
    return lanes[0];
}

static float dot_lanes(const float *x, const float *w, int64_t k) {
    float lanes[LANES] = {0};
    for (int64_t p = 0; p < k; p += LANES)
        for (int j = 0; j < LANES; j++) lanes[j] = fmaf(x[p + j], w[p + j], lanes[j]);
    return reduce_lanes(lanes);
}

static void scratch_tile(const Weights *w, const float *x, int64_t rows, int64_t n0, int64_t n1,
                         float *tile, float *partial, float *out) {
    (void)partial;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t b = 0; b < w->blocks; b++)
            dequantize_block(w, record_of(w, n, b / GROUP), (int)(b % GROUP), tile + b * BLOCK);
        for (int64_t m = 0; m < rows; m++) out[m * w->n + n] = dot_lanes(x + m * w->k, tile, w->k);
    }
}

#endif

/* Rows ids[0 .. count) of W (N x K, the layout above) dequantised into out ([count][K]): an
 * embedding lookup (one row: 13 us against 81 for the same operations as torch calls, whose
 * bits it equals: tests/kernels/test_gguf_linear.py). Returns 0, or -1
 * (out untouched) when an id is outside [0, N). */
int gguf_rows(int kind, const void *data, int64_t n, int64_t k, const int64_t *ids, int64_t count,
              float *out) {
    const Weights w = make_weights(kind, data, n, k);
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return -1;
    for (int64_t i = 0; i < count; i++)
        for (int64_t b = 0; b < w.blocks; b++)
            dequantize_block(&w, record_of(&w, ids[i], b / GROUP), (int)(b % GROUP),
                             out + i * k + b * BLOCK);
    return 0;
}

/* Which vector path this build took: 2 AVX-512, 1 AVX2 with FMA, 0 the plain C one. */
int gguf_linear_isa(void) {
#ifdef __AVX512F__
    return 2;
#elif defined(VECTOR_PATH)
    return 1;
#else
    return 0;
#endif
}

/*
 * out[M][N] = x[M][K] W^T for W of the given kind (0: Q4_1, 1: Q8_0) in the layout above, K a
 * multiple of 32, x and out contiguous float32. Work units are tiles of TILE_N outputs spread
 * over `threads`. Returns 0, or -1 when scratch memory cannot be allocated (out is then
 * incomplete).
 */
int gguf_linear(int kind, const float *x, int64_t rows, int64_t k, const void *data, int64_t n,
                float *out, int threads) {
    const Weights w = make_weights(kind, data, n, k);
    const int64_t tiles = (n + TILE_N - 1) / TILE_N;
    int failed = 0;
#ifdef __AVX512F__
    const int direct = rows <= (kind == Q4_1 ? DIRECT_ROWS : DIRECT_ROWS_Q8);
#elif defined(__AVX2__) && defined(__FMA__)
    const int direct = 1;
#else
    const int direct = 0;
#endif
#pragma omp parallel num_threads(threads)
    {
        /* the dequantised tile, then the accumulators between chunks of K */
        const size_t floats = (size_t)(TILE_N * k + rows * 4 * LANES);
        float *tile = direct ? NULL : malloc(floats * sizeof(float));
        if (!direct && tile == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * TILE_N, n1 = n0 + TILE_N < n ? n0 + TILE_N : n;
#ifdef VECTOR_PATH
            if (direct) {
                direct_tile(&w, x, rows, n0, n1, out);
                continue;
            }
#endif
#if !defined(VECTOR_PATH) || defined(__AVX512F__) /* AVX2 always takes the direct path */
            if (tile != NULL) scratch_tile(&w, x, rows, n0, n1, tile, tile + TILE_N * k, out);
#endif
        }
        free(tile);
    }
    return failed ? -1 : 0;
}
