/*
 * Paged attention for short queries (decodes, verify queries, tree nodes) on the CPU, reading
 * K/V in place through the block table: no gather, no padding to the longest sequence.
 *
 * One work unit is (sequence, KV head, chunk of positions): the G query heads that share the
 * KV head and the sequence's Q query tokens (G * Q query rows) walk the chunk's blocks in
 * position order; each K/V row is read from the cache once for all of them. Softmax is online,
 * per block of positions, in float32; the chunks of a (sequence, KV head) are then merged in
 * position order. The order of every floating-point sum depends only on the sequence's own
 * positions (fixed 16-lane dot products, blocks and chunks in order, chunk boundaries at
 * absolute positions), never on the batch it is in or the number of threads, so a row's result
 * is bit-for-bit the same alone or in any batch.
 *
 * Built at first use by specbatch/kernels/attention/cpu_paged.py (cc -O3 -march=native
 * -fopenmp) and called through ctypes; no Python or torch headers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

static inline float bf16_to_float(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* One cache row (head_dim values) as float32: in place for a float32 cache, else converted
 * into scratch. */
static inline const float *load_row(const void *cache, int bf16, int64_t offset, int64_t dim,
                                    float *scratch) {
    if (!bf16) return (const float *)cache + offset;
    const uint16_t *row = (const uint16_t *)cache + offset;
    for (int64_t d = 0; d < dim; d++) scratch[d] = bf16_to_float(row[d]);
    return scratch;
}

/*
 * exp(x) for x <= 0 in plain arithmetic (so that loops over it vectorize, unlike libm's expf):
 * x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (relative error
 * below 2e-7), 2^n put into the exponent bits. Below -87, where float32 underflows, 0.
 */
static inline float exp_nonpositive(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = floorf(clamped * log2e + 0.5f);
    const float r = clamped - n * ln2_hi - n * ln2_lo;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

/* Dot product in a fixed order: LANES partial sums, then a fixed pairwise reduction. */
static inline float dot(const float *a, const float *b, int64_t dim) {
    float part[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= dim; d += LANES)
        for (int lane = 0; lane < LANES; lane++) part[lane] += a[d + lane] * b[d + lane];
    for (int lane = 0; d < dim; d++, lane++) part[lane] += a[d] * b[d];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int lane = 0; lane < width; lane++) part[lane] += part[lane + width];
    return part[0];
}

/* Partial attention of one work unit: a chunk of positions, not yet normalised. */
typedef struct {
    float *best;  /* [rows] running maximum of the scores (-inf: nothing visible) */
    float *total; /* [rows] sum of exp(score - best) */
    float *acc;   /* [rows, head_dim] sum of exp(score - best) * value */
} Partial;

typedef struct {
    const float *q;
    int64_t q_stride_t, q_stride_h;
    const void *key_cache, *value_cache;
    int bf16;
    const int64_t *q_start, *q_len, *seq_len, *block_tables;
    int64_t bt_stride;
    const uint8_t *tree;
    int64_t tree_stride, group, num_kv_heads, head_dim, block_size, row_stride;
    float scale;
} Step;

/* Attend rows of (sequence s, KV head kvh) over positions [from, to) into part. */
static void attend_chunk(const Step *st, int64_t s, int64_t kvh, int64_t from, int64_t to,
                         Partial part) {
    const int64_t group = st->group, head_dim = st->head_dim, block_size = st->block_size;
    const int64_t qn = st->q_len[s], rows = qn * group, len = st->seq_len[s];
    const int64_t first_new = len - qn, row_stride = st->row_stride;
    /* sized per unit (the caller bounds rows, head_dim and block_size) */
    float queries[rows][head_dim], scores[rows][block_size];
    float kscratch[head_dim], vscratch[head_dim];
    int64_t last_visible[rows];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = r / group, h = kvh * group + r % group;
        const float *src = st->q + (st->q_start[s] + i) * st->q_stride_t + h * st->q_stride_h;
        for (int64_t d = 0; d < head_dim; d++) queries[r][d] = src[d] * st->scale;
        memset(part.acc + r * head_dim, 0, (size_t)head_dim * sizeof(float));
        part.best[r] = -INFINITY;
        part.total[r] = 0.0f;
        /* causal among the new tokens; with a tree mask, the mask alone decides them */
        last_visible[r] = st->tree != NULL ? len - 1 : first_new + i;
    }
    const int64_t *table = st->block_tables + s * st->bt_stride;
    for (int64_t start = from; start < to; start += block_size) {
        const int64_t count = to - start < block_size ? to - start : block_size;
        const int64_t base = table[start / block_size] * block_size * row_stride + kvh * head_dim;
        /* scores of every row against the block's positions (-inf where hidden) */
        for (int64_t j = 0; j < count; j++) {
            const int64_t position = start + j;
            const float *krow =
                load_row(st->key_cache, st->bf16, base + j * row_stride, head_dim, kscratch);
            for (int64_t r = 0; r < rows; r++) {
                int visible = position <= last_visible[r];
                if (visible && st->tree != NULL && position >= first_new) {
                    const int64_t row = st->q_start[s] + r / group;
                    visible = st->tree[row * st->tree_stride + (position - first_new)];
                }
                scores[r][j] = visible ? dot(queries[r], krow, head_dim) : -INFINITY;
            }
        }
        /* online softmax: rescale what was accumulated to the block's new maximum */
        for (int64_t r = 0; r < rows; r++) {
            float top = part.best[r];
            for (int64_t j = 0; j < count; j++) top = scores[r][j] > top ? scores[r][j] : top;
            if (top == -INFINITY) continue; /* nothing visible yet */
            const float shrink =
                part.best[r] == -INFINITY ? 0.0f : exp_nonpositive(part.best[r] - top);
            float *restrict row = scores[r];
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < count; j++) {
                const float weight = row[j] == -INFINITY ? 0.0f : exp_nonpositive(row[j] - top);
                row[j] = weight;
                sum += weight;
            }
            float *restrict acc = part.acc + r * head_dim;
            for (int64_t d = 0; d < head_dim; d++) acc[d] *= shrink;
            part.total[r] = part.total[r] * shrink + sum;
            part.best[r] = top;
        }
        for (int64_t j = 0; j < count; j++) {
            const float *restrict vrow =
                load_row(st->value_cache, st->bf16, base + j * row_stride, head_dim, vscratch);
            for (int64_t r = 0; r < rows; r++) {
                const float weight = scores[r][j];
                if (weight == 0.0f) continue;
                float *restrict acc = part.acc + r * head_dim;
                for (int64_t d = 0; d < head_dim; d++) acc[d] += weight * vrow[d];
            }
        }
    }
}

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
 * chunk:   positions per work unit (a multiple of block_size). Units are (sequence, KV head,
 *   chunk of positions), spread over the threads; each (sequence, KV head) then merges its
 *   chunks in position order. Chunk boundaries are absolute positions, so neither the batch
 *   nor the thread count changes a row's arithmetic.
 * Returns 0, or -1 when the scratch memory cannot be allocated (out is then untouched).
 */
int paged_attention_short(
    const float *q, int64_t q_stride_t, int64_t q_stride_h,
    float *out, int64_t out_stride_t, int64_t out_stride_h,
    const void *key_cache, const void *value_cache, int bf16,
    const int64_t *q_start, const int64_t *q_len, const int64_t *seq_len,
    const int64_t *block_tables, int64_t bt_stride,
    const uint8_t *tree, int64_t tree_stride,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t chunk, float scale, int num_threads) {
    const Step st = {q, q_stride_t, q_stride_h, key_cache, value_cache, bf16,
                     q_start, q_len, seq_len, block_tables, bt_stride, tree, tree_stride,
                     num_heads / num_kv_heads, num_kv_heads, head_dim, block_size,
                     num_kv_heads * head_dim, scale};
    const int64_t group = st.group, items = num_seqs * num_kv_heads;
    /* where each item's units and partials start */
    int64_t *unit_start = malloc((size_t)(items + 1) * sizeof *unit_start);
    int64_t *part_start = malloc((size_t)(items + 1) * sizeof *part_start);
    if (unit_start == NULL || part_start == NULL) {
        free(unit_start);
        free(part_start);
        return -1;
    }
    unit_start[0] = part_start[0] = 0;
    for (int64_t item = 0; item < items; item++) {
        const int64_t s = item / num_kv_heads, chunks = (seq_len[s] + chunk - 1) / chunk;
        unit_start[item + 1] = unit_start[item] + chunks;
        part_start[item + 1] = part_start[item] + chunks * q_len[s] * group;
    }
    const int64_t units = unit_start[items], part_rows = part_start[items];
    float *scratch = malloc((size_t)part_rows * (size_t)(head_dim + 2) * sizeof(float));
    if (scratch == NULL) {
        free(unit_start);
        free(part_start);
        return -1;
    }
    float *best = scratch, *total = scratch + part_rows, *acc = scratch + 2 * part_rows;

#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < units; unit++) {
            int64_t item = 0; /* the item owning this unit: binary search */
            for (int64_t lo = 0, hi = items - 1; lo <= hi;) {
                const int64_t mid = (lo + hi) / 2;
                if (unit_start[mid] <= unit) {
                    item = mid;
                    lo = mid + 1;
                } else {
                    hi = mid - 1;
                }
            }
            const int64_t s = item / num_kv_heads, kvh = item % num_kv_heads;
            const int64_t c = unit - unit_start[item], rows = q_len[s] * group;
            const int64_t first = part_start[item] + c * rows;
            const int64_t to = (c + 1) * chunk < seq_len[s] ? (c + 1) * chunk : seq_len[s];
            const Partial part = {best + first, total + first, acc + first * head_dim};
            attend_chunk(&st, s, kvh, c * chunk, to, part);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const int64_t s = item / num_kv_heads, kvh = item % num_kv_heads;
            const int64_t rows = q_len[s] * group, chunks = unit_start[item + 1] - unit_start[item];
            for (int64_t r = 0; r < rows; r++) {
                float top = -INFINITY;
                for (int64_t c = 0; c < chunks; c++) {
                    const float m = best[part_start[item] + c * rows + r];
                    top = m > top ? m : top;
                }
                float sum = 0.0f, merged[head_dim];
                memset(merged, 0, (size_t)head_dim * sizeof(float));
                for (int64_t c = 0; c < chunks; c++) { /* in position order: fixed arithmetic */
                    const int64_t at = part_start[item] + c * rows + r;
                    if (best[at] == -INFINITY) continue;
                    const float weight = exp_nonpositive(best[at] - top);
                    sum += total[at] * weight;
                    for (int64_t d = 0; d < head_dim; d++)
                        merged[d] += acc[at * head_dim + d] * weight;
                }
                const int64_t i = r / group, h = kvh * group + r % group;
                float *dst = out + (q_start[s] + i) * out_stride_t + h * out_stride_h;
                const float norm = sum > 0.0f ? 1.0f / sum : 0.0f;
                for (int64_t d = 0; d < head_dim; d++) dst[d] = merged[d] * norm;
            }
        }
    }
    free(scratch);
    free(unit_start);
    free(part_start);
    return 0;
}
