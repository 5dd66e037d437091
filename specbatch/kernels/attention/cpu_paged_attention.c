/*
 * Paged attention for short queries (decodes, verify queries, tree nodes) on the CPU, reading
 * K/V in place through the block table: no gather, no padding to the longest sequence.
 *
 * One work unit is (sequence, chunk of positions): every query row of the sequence (its Q
 * query tokens times H heads) walks the chunk's blocks in position order; each position's K
 * and V rows (all KV heads, contiguous in the cache) are read once for all of them, GQA folded
 * (a row uses its KV head's slice). Softmax is online, per block of positions, in float32; the
 * chunks of a sequence are then merged in position order. The order of every floating-point
 * sum depends only on the sequence's own positions (fixed-lane dot products, blocks and chunks
 * in order, chunk boundaries at absolute positions), never on the batch it is in or the number
 * of threads, so a row's result is bit-for-bit the same alone or in any batch.
 *
 * Without AVX-512 (AVX2 with FMA), the vector path works on 8-lane halves where GCC would
 * otherwise spill 16-lane vectors or compare them lane by lane: the same operations on every
 * lane, so the same bits (1.6-4x faster on an AVX2 EPYC, old and new builds alternated:
 * docs/notes.md, 2026-12-05).
 *
 * Built at first use by specbatch/kernels/attention/cpu_paged.py (cc -O3 -march=native
 * -fopenmp) and called through ctypes; no Python or torch headers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../simd.h"

/* AVX2 with FMA and no AVX-512: the vector path on 8-lane halves (see above). The tests build
 * with -DSIXTEEN_LANES to compare it with the 16-lane path it replaces. */
#if defined(__AVX__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(SIXTEEN_LANES)
#define HALVES
#endif

typedef struct {
    const float *q;
    int64_t q_stride_t, q_stride_h;
    const void *key_cache, *value_cache;
    int bf16;
    const int64_t *q_start, *q_len, *seq_len, *block_tables;
    int64_t bt_stride;
    const uint8_t *tree;
    int64_t tree_stride, num_heads, group, head_dim, block_size, row_width;
    float scale;
    int64_t window; /* positions a query sees, itself included (sliding layers); 0: all */
    float softcap;  /* scores become softcap tanh(score / softcap) (Gemma 2); 0: as they are */
} Step;

/* softcap tanh(x / softcap) as 1 - 2 / (exp(2 y) + 1) for y = x / softcap (exp saturates, so
 * the quotient stays finite), on one float, 16 lanes and 8: the same operations. */
#define CAPPED(exp, x, softcap) ((softcap) * (1.0f - 2.0f / (exp(2.0f * ((x) / (softcap))) + 1.0f)))
static inline float capped(float x, float softcap) { return CAPPED(exp1f, x, softcap); }
static inline v16f capped16(v16f x, float softcap) { return CAPPED(exp16, x, softcap); }
#ifdef HALVES
static inline v8f capped8(v8f x, float softcap) { return CAPPED(exp8, x, softcap); }
#endif

/* A score as the softmax takes it: soft-capped where the layer caps. */
static inline float score(const Step *st, float x) {
    return st->softcap > 0.0f ? capped(x, st->softcap) : x;
}

/* Partial attention of one work unit (a chunk of positions), not yet normalised. */
typedef struct {
    float *best;  /* [rows] running maximum of the scores (-inf: nothing visible) */
    float *total; /* [rows] sum of exp(score - best) */
    float *acc;   /* [rows, head_dim] sum of exp(score - best) * value */
} Partial;

/* Row r of a sequence is query token r / num_heads, head r % num_heads. */
static inline int visible(const Step *st, int64_t s, int64_t r, int64_t position) {
    const int64_t qn = st->q_len[s], len = st->seq_len[s], first_new = len - qn;
    const int64_t i = r / st->num_heads;
    if (position < first_new) return 1;
    if (st->tree == NULL) return position <= first_new + i; /* causal among the new tokens */
    return st->tree[(st->q_start[s] + i) * st->tree_stride + (position - first_new)];
}

/* The last position row r may see (a tree may still hide some before it). */
static inline int64_t last_position(const Step *st, int64_t s, int64_t r) {
    const int64_t len = st->seq_len[s];
    return st->tree != NULL ? len - 1 : len - st->q_len[s] + r / st->num_heads;
}

/* The first position row r may see: its sliding window's first (cpu_paged.py never sends a
 * tree with a window), else 0. */
static inline int64_t first_position(const Step *st, int64_t s, int64_t r) {
    const int64_t first = last_position(st, s, r) - st->window + 1;
    return st->window > 0 && first > 0 ? first : 0;
}

/* Online softmax over one block: scores[r][0..count) become weights, best/total/acc rescale. */
static void softmax_block(Partial part, int64_t r0, int64_t r1, int64_t count, int64_t width,
                          int64_t head_dim, float *scores) {
    for (int64_t r = r0; r < r1; r++) {
        float *restrict row = scores + (r - r0) * width;
        float top = part.best[r];
        for (int64_t j = 0; j < count; j++) top = row[j] > top ? row[j] : top;
        if (top == -INFINITY) { /* nothing visible yet */
            /* weights 0, not the -inf scores: attend_chunk adds weight * value for every
             * nonzero weight, and a later block's rescale by 0 would turn -inf into NaN */
            memset(row, 0, (size_t)count * sizeof *row);
            continue;
        }
        const float shrink = part.best[r] == -INFINITY ? 0.0f : exp1f(part.best[r] - top);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < count; j++) {
            const float weight = row[j] == -INFINITY ? 0.0f : exp1f(row[j] - top);
            row[j] = weight;
            sum += weight;
        }
        float *restrict acc = part.acc + r * head_dim;
        for (int64_t d = 0; d < head_dim; d++) acc[d] *= shrink;
        part.total[r] = part.total[r] * shrink + sum;
        part.best[r] = top;
    }
}

/* ---------------- the generic path: any head_dim and block_size ---------------- */

/* Dot product in a fixed order: 16 partial sums, then a fixed pairwise reduction. */
static inline float dot(const float *a, const float *b, int64_t dim) {
    float part[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16)
        for (int lane = 0; lane < 16; lane++) part[lane] += a[d + lane] * b[d + lane];
    for (int lane = 0; d < dim; d++, lane++) part[lane] += a[d] * b[d];
    return fold16(part);
}

/* One position's K or V row (every KV head) as float32: in place, or converted into scratch. */
static inline const float *load_row(const void *cache, int bf16, int64_t offset, int64_t width,
                                    float *scratch) {
    if (!bf16) return (const float *)cache + offset;
    const uint16_t *row = (const uint16_t *)cache + offset;
    for (int64_t d = 0; d < width; d++) scratch[d] = from_bf16(row[d]);
    return scratch;
}

static void attend_chunk(const Step *st, int64_t s, int64_t from, int64_t to, int64_t r0,
                         int64_t r1, Partial part, const float *queries, float *scores,
                         float *scratch) {
    const int64_t heads = st->num_heads, dim = st->head_dim, width = st->block_size;
    const int64_t row_width = st->row_width;
    const int64_t *table = st->block_tables + s * st->bt_stride;
    for (int64_t start = from; start < to; start += width) {
        const int64_t count = to - start < width ? to - start : width;
        const int64_t base = table[start / width] * width * row_width;
        for (int64_t j = 0; j < count; j++) {
            const float *k = load_row(st->key_cache, st->bf16, base + j * row_width, row_width,
                                      scratch);
            for (int64_t r = r0; r < r1; r++) {
                const int64_t kvh = (r % heads) / st->group;
                scores[(r - r0) * width + j] = start + j <= last_position(st, s, r) &&
                                                start + j >= first_position(st, s, r) &&
                                                visible(st, s, r, start + j)
                                            ? score(st, dot(queries + r * dim, k + kvh * dim, dim))
                                            : -INFINITY;
            }
        }
        softmax_block(part, r0, r1, count, width, dim, scores);
        for (int64_t j = 0; j < count; j++) {
            const float *v = load_row(st->value_cache, st->bf16, base + j * row_width, row_width,
                                      scratch);
            for (int64_t r = r0; r < r1; r++) {
                const float weight = scores[(r - r0) * width + j];
                if (weight == 0.0f) continue;
                const float *restrict value = v + ((r % heads) / st->group) * dim;
                float *restrict acc = part.acc + r * dim;
                for (int64_t d = 0; d < dim; d++) acc[d] += weight * value[d];
            }
        }
    }
}

/* -------- the vector path: head_dim and block_size multiples of 16 (64 and 16 for Llama) -------- */

static inline v16f load16(const void *cache, int bf16, int64_t offset) {
    if (bf16) return from_bf16x16((const uint16_t *)cache + offset);
    v16f out;
    memcpy(&out, (const float *)cache + offset, sizeof out);
    return out;
}

static inline v16f fold(v16f a, v16f b, v16i low, v16i high) {
    return __builtin_shuffle(a, b, low) + __builtin_shuffle(a, b, high);
}

/* Lane j of the result is the sum of the 16 lanes of p[j], in a fixed order: four levels of
 * pairwise folds (16 vectors -> 8 -> 4 -> 2 -> 1) instead of 16 separate horizontal sums.
 * Feeding the vectors in bit-reversed order leaves the sums in natural lane order. */
static inline v16f reduce16(const v16f p[16]) {
    static const int bitrev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    const v16i lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16i lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const v16i hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const v16i lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const v16i hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const v16i lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const v16i hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    v16f level1[8], level2[4], level3[2];
    for (int i = 0; i < 8; i++) level1[i] = fold(p[bitrev[2 * i]], p[bitrev[2 * i + 1]], lo8, hi8);
    for (int i = 0; i < 4; i++) level2[i] = fold(level1[2 * i], level1[2 * i + 1], lo4, hi4);
    for (int i = 0; i < 2; i++) level3[i] = fold(level2[2 * i], level2[2 * i + 1], lo2, hi2);
    return fold(level3[0], level3[1], lo1, hi1);
}

#ifdef HALVES
/*
 * Without AVX-512 a 16-lane vector is two registers and GCC builds reduce16's two-source
 * shuffles through the stack (each fold a spill and a stalled reload). The same sums in
 * 8-lane registers: p[j]'s two halves added (lane l + lane l + 8), then lane l + l + 4 across
 * 128-bit halves, l + l + 2 and l + l + 1 within them, each step for several positions at
 * once; the last leaves positions in natural order. Same operands, same order, same bits.
 */
typedef union {
    v16f v;
    __m256 h[2];
} Halves;

/* lane j of out: positions j of a (j < 4) and of b (j >= 4) summed l + l + 4, per 128 bits */
static inline __m256 fold4(__m256 a, __m256 b) {
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* The reduced sums of eight positions' first-level folds a[0..7] (lanes 0-7 each), in order. */
static inline __m256 reduce8(const __m256 a[8]) {
    const __m256 b04 = fold4(a[0], a[4]), b15 = fold4(a[1], a[5]);
    const __m256 b26 = fold4(a[2], a[6]), b37 = fold4(a[3], a[7]);
    /* l + l + 2: [0 1 | 4 5] and [2 3 | 6 7], two lanes each */
    const __m256 c0 = _mm256_add_ps(_mm256_shuffle_ps(b04, b15, 0x44),
                                    _mm256_shuffle_ps(b04, b15, 0xEE));
    const __m256 c1 = _mm256_add_ps(_mm256_shuffle_ps(b26, b37, 0x44),
                                    _mm256_shuffle_ps(b26, b37, 0xEE));
    /* l + l + 1: [0 1 2 3 | 4 5 6 7] */
    return _mm256_add_ps(_mm256_shuffle_ps(c0, c1, 0x88), _mm256_shuffle_ps(c0, c1, 0xDD));
}

/* reduce16 of p[j] = the 16 lanes of query . key j, computed position by position. */
static inline __attribute__((always_inline)) Halves scores16(const v16f *query, const v16f *keys,
                                                           int64_t per_row, int64_t per_head,
                                                           int64_t n) {
    Halves out;
    for (int half = 0; half < 2; half++) {
        __m256 folded[8];
        for (int64_t j = 0; j < 8; j++) {
            Halves sum = {.v = {0}};
            if (8 * half + j < n)
                for (int64_t c = 0; c < per_head; c++)
                    sum.v += query[c] * keys[(8 * half + j) * per_row + c];
            folded[j] = _mm256_add_ps(sum.h[0], sum.h[1]);
        }
        out.h[half] = reduce8(folded);
    }
    return out;
}
#endif

/* The last position each row of [r0, r1) may see, and where its KV head's slice starts in a
 * position's K/V row. Rows of one query token are consecutive, so limits never decrease. */
static void row_layout(const Step *st, int64_t s, int64_t r0, int64_t r1, int64_t *limit,
                       int64_t *lowest, int64_t *kv_offset) {
    for (int64_t r = r0; r < r1; r++) {
        limit[r - r0] = last_position(st, s, r);
        lowest[r - r0] = first_position(st, s, r);
        kv_offset[r - r0] = ((r % st->num_heads) / st->group) * st->head_dim;
    }
}

#define MAX_PER_HEAD 16 /* head dim 256 */

/* One row over one block, vectorised: the scores of 16 positions at a time as vector FMAs and
 * one reduce16, masked, the online softmax step on 16 lanes (positions past the block weigh 0),
 * then the block's values accumulated into the row's accumulator, held in registers for the
 * whole block. per_head is a constant where inlined. row: room for the block's scores rounded
 * up to 16. */
static inline __attribute__((always_inline)) void attend_row16(
    const Step *st, int64_t s, int64_t r, int64_t start, int64_t count, int64_t limit,
    int64_t lowest, int64_t per_head, const v16f *query, const v16f *keys, const v16f *values, int64_t per_row,
    int64_t kv_vec, Partial part, float *row) {
#ifdef HALVES
    /* the same steps as below, on each 16-lane vector's two 8-lane halves */
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const v8f hidden8 = splat8(-INFINITY);
    const int64_t groups = (count + 15) / 16;
    const int64_t seen = limit - start + 1; /* positions start + j, j < seen, are causal */
    /* and j >= below inside the window (a clamp keeps it an int32 lane value) */
    const int32_t below = (int32_t)(lowest - start > 0 ? lowest - start : 0);
    v8f top8[2] = {splat8(part.best[r]), splat8(part.best[r])};
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n = count - 16 * g < 16 ? count - 16 * g : 16;
        Halves sums = scores16(query, keys + 16 * g * per_row + kv_vec, per_row, per_head, n);
        if (st->softcap > 0.0f)
            for (int h = 0; h < 2; h++) sums.h[h] = (__m256)capped8((v8f)sums.h[h], st->softcap);
        const int32_t shown = (int32_t)(n + 16 * g < seen ? n + 16 * g : seen);
        for (int h = 0; h < 2; h++) {
            const v8i index = lane + (int32_t)(16 * g + 8 * h);
            const v8f scores = select8((index < shown) & (index >= below), (v8f)sums.h[h], hidden8);
            memcpy(row + 16 * g + 8 * h, &scores, sizeof scores);
        }
        if (st->tree != NULL)
            for (int64_t j = 0; j < n; j++)
                if (!visible(st, s, r, start + 16 * g + j)) row[16 * g + j] = -INFINITY;
        for (int h = 0; h < 2; h++) {
            v8f scores;
            memcpy(&scores, row + 16 * g + 8 * h, sizeof scores);
            top8[h] = select8(scores > top8[h], scores, top8[h]);
        }
    }
    float top = top8[0][0]; /* a maximum is exact in any order */
    for (int i = 1; i < 16; i++) top = top8[i / 8][i % 8] > top ? top8[i / 8][i % 8] : top;
    if (top == -INFINITY) return; /* nothing visible yet */
    const float shrink = part.best[r] == -INFINITY ? 0.0f : exp1f(part.best[r] - top);
    float sum = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        v8f weights[2];
        for (int h = 0; h < 2; h++) {
            v8f scores;
            memcpy(&scores, row + 16 * g + 8 * h, sizeof scores);
            weights[h] = select8(scores == hidden8, splat8(0.0f), exp8(scores - top));
            memcpy(row + 16 * g + 8 * h, &weights[h], sizeof weights[h]);
        }
        sum += sum8x2(weights[0], weights[1]);
    }
#else
    const v16f zero = {0}, hidden = splat16(-INFINITY);
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const int64_t groups = (count + 15) / 16;
    const int64_t seen = limit - start + 1; /* positions start + j, j < seen, are causal */
    /* and j >= below inside the window (a clamp keeps it an int32 lane value) */
    const int32_t below = (int32_t)(lowest - start > 0 ? lowest - start : 0);
    v16f top16 = splat16(part.best[r]);
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n = count - 16 * g < 16 ? count - 16 * g : 16;
        v16f partials[16];
        for (int64_t j = 0; j < 16; j++) {
            v16f sum = zero;
            if (j < n)
                for (int64_t c = 0; c < per_head; c++)
                    sum += query[c] * keys[(16 * g + j) * per_row + kv_vec + c];
            partials[j] = sum;
        }
        v16f sums = reduce16(partials);
        if (st->softcap > 0.0f) sums = capped16(sums, st->softcap);
        const v16i index = lane + (int32_t)(16 * g);
        const int32_t shown = (int32_t)(n + 16 * g < seen ? n + 16 * g : seen);
        v16f scores = select16((index < shown) & (index >= below), sums, hidden);
        if (st->tree != NULL)
            for (int64_t j = 0; j < n; j++)
                if (!visible(st, s, r, start + 16 * g + j)) scores[j] = -INFINITY;
        top16 = select16(scores > top16, scores, top16);
        memcpy(row + 16 * g, &scores, sizeof scores);
    }
    float top = top16[0]; /* a maximum is exact in any order */
    for (int i = 1; i < 16; i++) top = top16[i] > top ? top16[i] : top;
    if (top == -INFINITY) return; /* nothing visible yet */
    const float shrink = part.best[r] == -INFINITY ? 0.0f : exp1f(part.best[r] - top);
    float sum = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        v16f scores;
        memcpy(&scores, row + 16 * g, sizeof scores);
        const v16f weights = select16(scores == hidden, zero, exp16(scores - top));
        memcpy(row + 16 * g, &weights, sizeof weights);
        sum += sum16(weights);
    }
#endif
    part.total[r] = part.total[r] * shrink + sum;
    part.best[r] = top;
#ifdef HALVES
    /* 8-lane registers: GCC moves an array of 16-lane vectors through general registers */
    float *acc = part.acc + r * per_head * 16;
    __m256 out[2 * MAX_PER_HEAD];
    const __m256 shrink8 = _mm256_set1_ps(shrink);
    for (int64_t c = 0; c < 2 * per_head; c++)
        out[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), shrink8);
    for (int64_t j = 0; j < count; j++) {
        const float weight = row[j];
        if (weight == 0.0f) continue;
        const float *value = (const float *)(values + j * per_row + kv_vec);
        const __m256 weights = _mm256_set1_ps(weight);
        for (int64_t c = 0; c < 2 * per_head; c++)
            out[c] = _mm256_fmadd_ps(weights, _mm256_loadu_ps(value + 8 * c), out[c]);
    }
    for (int64_t c = 0; c < 2 * per_head; c++) _mm256_storeu_ps(acc + 8 * c, out[c]);
#else
    v16f acc[MAX_PER_HEAD];
    memcpy(acc, part.acc + r * per_head * 16, (size_t)per_head * sizeof(v16f));
    for (int64_t c = 0; c < per_head; c++) acc[c] *= shrink;
    for (int64_t j = 0; j < count; j++) {
        const float weight = row[j];
        if (weight == 0.0f) continue;
        const v16f *value = values + j * per_row + kv_vec;
        const v16f weights = splat16(weight);
        for (int64_t c = 0; c < per_head; c++) acc[c] += weights * value[c];
    }
    memcpy(part.acc + r * per_head * 16, acc, (size_t)per_head * sizeof(v16f));
#endif
}

/* Rows [r0, r1) of sequence s over positions [from, to), block by block: each block's K and V
 * rows are loaded (converted from bfloat16 where needed) once into keys/values and read by
 * every row. A row whose causal limit is before the block skips it: a block it cannot see would
 * leave its state unchanged (rescaling by exp(0) = 1, adding 0). */
static void attend_chunk16(const Step *st, int64_t s, int64_t from, int64_t to, int64_t r0,
                           int64_t r1, Partial part, const v16f *queries, const int64_t *limit,
                           const int64_t *lowest, const int64_t *kv_offset, float *row, v16f *keys, v16f *values) {
    const int64_t width = st->block_size, per_head = st->head_dim / 16;
    const int64_t per_row = st->row_width / 16, row_width = st->row_width;
    const int64_t *table = st->block_tables + s * st->bt_stride;
    for (int64_t start = from; start < to && start <= limit[r1 - 1 - r0]; start += width) {
        const int64_t count = to - start < width ? to - start : width;
        if (start + count <= lowest[0]) continue; /* before every row's window */
        const int64_t base = table[start / width] * width * row_width;
        for (int64_t j = 0; j < count; j++)
            for (int64_t c = 0; c < per_row; c++) {
                keys[j * per_row + c] = load16(st->key_cache, st->bf16, base + j * row_width + 16 * c);
                values[j * per_row + c] =
                    load16(st->value_cache, st->bf16, base + j * row_width + 16 * c);
            }
        for (int64_t r = r0; r < r1; r++) {
            if (start > limit[r - r0] || start + count <= lowest[r - r0]) continue;
            const v16f *query = queries + (r - r0) * per_head;
            const int64_t kv_vec = kv_offset[r - r0] / 16;
            if (per_head == 4) /* head dim 64: the accumulator lives in four registers */
                attend_row16(st, s, r, start, count, limit[r - r0], lowest[r - r0], 4, query,
                             keys, values,
                             per_row, kv_vec, part, row);
            else
                attend_row16(st, s, r, start, count, limit[r - r0], lowest[r - r0], per_head,
                             query, keys,
                             values, per_row, kv_vec, part, row);
        }
    }
}

/* Rows of a work unit. Rows are independent, so how they are cut into units changes no row's
 * arithmetic; a unit's rows share each block's K/V while it is in L1. */
#define UNIT_ROWS 288

/* One work unit: rows [r0, r1) of sequence s over positions [from, to), into part (indexed by
 * the sequence's row). Queries are loaded scaled. */
static int attend_unit(const Step *st, int64_t s, int64_t from, int64_t to, int64_t r0,
                       int64_t r1, Partial part) {
    const int64_t heads = st->num_heads, dim = st->head_dim, width = st->block_size;
    const int64_t rows = r1 - r0;
    const int vector = dim % 16 == 0 && width % 16 == 0;
    /* queries, row layout, scores, and K/V scratch: heap, sized for this unit, each part
     * 64-byte aligned (the vector path loads K/V scratch as aligned vectors) */
    const size_t query_bytes = (size_t)(rows * dim) * sizeof(float);
    const size_t layout_bytes = ((size_t)(3 * rows) * sizeof(int64_t) + 63) / 64 * 64;
    const size_t score_bytes = (size_t)(vector ? 64 : 16) * (size_t)width * sizeof(float);
    const size_t kv_bytes = (size_t)(2 * (vector ? width : 16) * st->row_width) * sizeof(float);
    const size_t total = query_bytes + layout_bytes + score_bytes + kv_bytes;
    char *memory = aligned_alloc(64, (total + 63) / 64 * 64);
    if (memory == NULL) return -1;
    float *queries = (float *)memory;
    int64_t *limit = (int64_t *)(memory + query_bytes), *lowest = limit + rows;
    int64_t *kv_offset = lowest + rows;
    float *scores = (float *)(memory + query_bytes + layout_bytes);
    float *scratch = (float *)(memory + query_bytes + layout_bytes + score_bytes);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t i = r / heads, h = r % heads;
        const float *src = st->q + (st->q_start[s] + i) * st->q_stride_t + h * st->q_stride_h;
        for (int64_t d = 0; d < dim; d++) queries[(r - r0) * dim + d] = src[d] * st->scale;
        memset(part.acc + r * dim, 0, (size_t)dim * sizeof(float));
        part.best[r] = -INFINITY;
        part.total[r] = 0.0f;
    }
    if (vector) {
        row_layout(st, s, r0, r1, limit, lowest, kv_offset);
        attend_chunk16(st, s, from, to, r0, r1, part, (const v16f *)queries, limit, lowest,
                       kv_offset,
                       scores, (v16f *)scratch, (v16f *)scratch + width * st->row_width / 16);
    } else {
        for (int64_t t0 = r0; t0 < r1; t0 += 16) { /* the generic path, 16 rows at a time */
            const int64_t t1 = t0 + 16 < r1 ? t0 + 16 : r1;
            attend_chunk(st, s, from, to, t0, t1, part, queries - r0 * dim, scores, scratch);
        }
    }
    free(memory);
    return 0;
}

/* The sequence whose range [starts[s], starts[s + 1]) holds index (binary search). */
static inline int64_t owner(const int64_t *starts, int64_t num_seqs, int64_t index) {
    int64_t s = 0;
    for (int64_t lo = 0, hi = num_seqs - 1; lo <= hi;) {
        const int64_t mid = (lo + hi) / 2;
        if (starts[mid] <= index) {
            s = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return s;
}

#define MAX_HEAD_DIM 256 /* cpu_paged.py sends longer heads to the reference path */

/*
 * q:       [T, H, D] float32, strides (q_stride_t, q_stride_h), rows of the listed sequences
 * out:     [T, H, D] float32, strides (out_stride_t, out_stride_h)
 * caches:  [num_blocks, block_size, KVH, D] contiguous, float32 (bf16 == 0) or bfloat16
 * per listed sequence s (num_seqs of them):
 *   q_start[s]  flat row of its first query token; q_len[s] its query tokens
 *   seq_len[s]  its K/V positions after this step's writes (queries are the last q_len)
 *   block_tables + s * bt_stride: its blocks in position order
 * tree (optional, may be NULL): [T, tree_stride] uint8; with it, query i of a sequence sees
 *   new token j (0-based among its q_len) iff tree[(q_start + i) * tree_stride + j]; cached
 *   positions are always visible. Without it the new tokens are causal.
 * window:  positions each query sees, itself included (a sliding layer's); 0: every one.
 * softcap: scores become softcap tanh(score / softcap) before the softmax; 0: no cap.
 * chunk:   positions per work unit, a multiple of block_size. Units (sequence, chunk) are
 *   spread over the threads; each sequence then merges its chunks in position order.
 * Returns 0, or -1 when scratch memory cannot be allocated (out is then incomplete).
 */
int paged_attention(
    const float *q, int64_t q_stride_t, int64_t q_stride_h,
    float *out, int64_t out_stride_t, int64_t out_stride_h,
    const void *key_cache, const void *value_cache, int bf16,
    const int64_t *q_start, const int64_t *q_len, const int64_t *seq_len,
    const int64_t *block_tables, int64_t bt_stride,
    const uint8_t *tree, int64_t tree_stride,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t chunk, float scale, int64_t window, float softcap,
    int num_threads) {
    const Step st = {q, q_stride_t, q_stride_h, key_cache, value_cache, bf16,
                     q_start, q_len, seq_len, block_tables, bt_stride, tree, tree_stride,
                     num_heads, num_heads / num_kv_heads, head_dim, block_size,
                     num_kv_heads * head_dim, scale, window > 0 ? window : 0,
                     softcap > 0.0f ? softcap : 0.0f};
    /* where each sequence's units, partial rows and output rows start */
    int64_t *unit_start = malloc((size_t)(3 * (num_seqs + 1)) * sizeof *unit_start);
    if (unit_start == NULL) return -1;
    int64_t *part_start = unit_start + num_seqs + 1, *row_start = part_start + num_seqs + 1;
    unit_start[0] = part_start[0] = row_start[0] = 0;
    /* Fewer (sequence, chunk) pairs than threads (a lone short sequence): cut its rows so every
     * thread gets some. Rows are independent: the cut changes no row's arithmetic. */
    int64_t pairs = 0, most_rows = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        pairs += (seq_len[s] + chunk - 1) / chunk;
        most_rows = q_len[s] * num_heads > most_rows ? q_len[s] * num_heads : most_rows;
    }
    int64_t unit_rows = UNIT_ROWS;
    if (pairs > 0 && pairs < num_threads) {
        const int64_t per_pair = (num_threads + pairs - 1) / pairs;
        unit_rows = (most_rows + per_pair - 1) / per_pair;
        unit_rows = unit_rows < 1 ? 1 : unit_rows > UNIT_ROWS ? UNIT_ROWS : unit_rows;
    }
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t chunks = (seq_len[s] + chunk - 1) / chunk, rows = q_len[s] * num_heads;
        unit_start[s + 1] = unit_start[s] + chunks * ((rows + unit_rows - 1) / unit_rows);
        part_start[s + 1] = part_start[s] + chunks * rows;
        row_start[s + 1] = row_start[s] + rows;
    }
    const int64_t units = unit_start[num_seqs], part_rows = part_start[num_seqs];
    float *scratch = malloc((size_t)part_rows * (size_t)(head_dim + 2) * sizeof(float));
    if (scratch == NULL) {
        free(unit_start);
        return -1;
    }
    float *best = scratch, *total = scratch + part_rows, *acc = scratch + 2 * part_rows;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < units; unit++) {
            const int64_t s = owner(unit_start, num_seqs, unit);
            const int64_t rows = q_len[s] * num_heads, tiles = (rows + unit_rows - 1) / unit_rows;
            const int64_t c = (unit - unit_start[s]) / tiles, tile = (unit - unit_start[s]) % tiles;
            const int64_t r0 = tile * unit_rows, r1 = r0 + unit_rows < rows ? r0 + unit_rows : rows;
            const int64_t first = part_start[s] + c * rows;
            const int64_t to = (c + 1) * chunk < seq_len[s] ? (c + 1) * chunk : seq_len[s];
            const Partial part = {best + first, total + first, acc + first * head_dim};
            if (attend_unit(&st, s, c * chunk, to, r0, r1, part) != 0) {
#pragma omp atomic write
                failed = 1;
            }
        }
        /* each row merges its chunks in position order: fixed arithmetic */
#pragma omp for schedule(static)
        for (int64_t flat = 0; flat < row_start[num_seqs]; flat++) {
            const int64_t s = owner(row_start, num_seqs, flat);
            const int64_t rows = q_len[s] * num_heads, r = flat - row_start[s];
            const int64_t chunks = (seq_len[s] + chunk - 1) / chunk;
            float top = -INFINITY;
            for (int64_t c = 0; c < chunks; c++) {
                const float m = best[part_start[s] + c * rows + r];
                top = m > top ? m : top;
            }
            float sum = 0.0f, merged[MAX_HEAD_DIM];
            memset(merged, 0, (size_t)head_dim * sizeof(float));
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t at = part_start[s] + c * rows + r;
                if (best[at] == -INFINITY) continue;
                const float weight = exp1f(best[at] - top);
                sum += total[at] * weight;
                for (int64_t d = 0; d < head_dim; d++) merged[d] += acc[at * head_dim + d] * weight;
            }
            const int64_t i = r / num_heads, h = r % num_heads;
            float *dst = out + (q_start[s] + i) * out_stride_t + h * out_stride_h;
            const float norm = sum > 0.0f ? 1.0f / sum : 0.0f;
            for (int64_t d = 0; d < head_dim; d++) dst[d] = merged[d] * norm;
        }
    }
    free(scratch);
    free(unit_start);
    return failed ? -1 : 0;
}

/*
 * The step's new K and V rows into their cache slots: row t of k (and of v) is kv_width
 * contiguous elements of elem_size bytes (the cache's own dtype: a plain copy) at
 * k + t * k_stride elements; slots[t] is its slot, or negative (padding) to skip. The caches
 * are [slots, kv_width] contiguous.
 */
void write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *key_cache,
              void *value_cache, const int64_t *slots, int64_t tokens, int64_t kv_width,
              int64_t elem_size) {
    const size_t row_bytes = (size_t)(kv_width * elem_size);
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy((char *)key_cache + slots[t] * row_bytes, (const char *)k + t * k_stride * elem_size,
               row_bytes);
        memcpy((char *)value_cache + slots[t] * row_bytes,
               (const char *)v + t * v_stride * elem_size, row_bytes);
    }
}
