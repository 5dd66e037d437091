/*
 * Small per-layer CPU operations in C, where torch's per-op dispatch costs more than the work
 * at decode sizes. Each output row depends only on its own input row, in a fixed order (no
 * dependence on the batch or threads).
 *
 * Built at first use by specbatch/kernels/cpu_ops.py (see cbuild.py) and called through ctypes.
 */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* Element i of a float32 (bf16 == 0) or bfloat16 array, as float32; and the store back. */
static inline float load_at(const void *base, int bf16, int64_t i) {
    return bf16 ? from_bf16(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void store_at(void *base, int bf16, int64_t i, float value) {
    if (bf16)
        ((uint16_t *)base)[i] = to_bf16(value);
    else
        ((float *)base)[i] = value;
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight over rows of dim elements (x rows x_stride
 * apart, out rows contiguous), computed in float32. Rows, weight and out are float32, or
 * bfloat16 (bf16 != 0), where, as HF Llama does, the normalised row is rounded to bfloat16
 * before the weight multiplies it. The sum of squares runs in 16 lanes, folded by fold16. */
void rms_norm(const void *x, int64_t rows, int64_t dim, int64_t x_stride, const void *weight,
              float eps, void *out, int bf16, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = r * x_stride;
        float lanes[16] = {0};
        int64_t d = 0;
        for (; d + 16 <= dim; d += 16)
            for (int lane = 0; lane < 16; lane++) {
                const float value = load_at(x, bf16, row + d + lane);
                lanes[lane] += value * value;
            }
        for (int lane = 0; d < dim; d++, lane++) {
            const float value = load_at(x, bf16, row + d);
            lanes[lane] += value * value;
        }
        const float scale = 1.0f / sqrtf(fold16(lanes) / (float)dim + eps);
        for (d = 0; d < dim; d++) {
            float normed = load_at(x, bf16, row + d) * scale;
            if (bf16) normed = from_bf16(to_bf16(normed));
            store_at(out, bf16, r * dim + d, normed * load_at(weight, bf16, d));
        }
    }
}

/* n elements of a float32 (bf16 == 0) or bfloat16 array from `offset`, as float32; and back.
 * The per-element work then runs on plain float arrays, which the compiler vectorises. */
static inline void load_floats(const void *base, int bf16, int64_t offset, int64_t n,
                               float *out) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) out[i] = from_bf16(src[i]);
    } else {
        memcpy(out, (const float *)base + offset, (size_t)n * sizeof(float));
    }
}

static inline void store_floats(void *base, int bf16, int64_t offset, int64_t n,
                                const float *in) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = to_bf16(in[i]);
    } else {
        memcpy((float *)base + offset, in, (size_t)n * sizeof(float));
    }
}

#define MAX_DIM 512 /* rotary head dims, and gated-activation chunks */

/* Rotate the first `heads` heads of each row in place (HF's half-split layout): element d
 * becomes x[d] cos[d] + x[(d + half) mod dim] sin[d], with rotate-half's sign already in sin,
 * in float32 (rounded once to bfloat16 for bfloat16 rows). Row t's heads start at element
 * t * row_stride, head_stride apart; cos and sin are [T, dim] of the rows' dtype; dim <=
 * MAX_DIM. */
void rotary(void *x, int64_t tokens, int64_t heads, int64_t dim, int64_t row_stride,
            int64_t head_stride, const void *cos, const void *sin, int bf16) {
    const int64_t half = dim / 2;
    float c[MAX_DIM], s[MAX_DIM], v[MAX_DIM], out[MAX_DIM];
    for (int64_t t = 0; t < tokens; t++) {
        load_floats(cos, bf16, t * dim, dim, c);
        load_floats(sin, bf16, t * dim, dim, s);
        for (int64_t h = 0; h < heads; h++) {
            const int64_t head = t * row_stride + h * head_stride;
            load_floats(x, bf16, head, dim, v);
#pragma omp simd
            for (int64_t d = 0; d < half; d++) out[d] = v[d] * c[d] + v[d + half] * s[d];
#pragma omp simd
            for (int64_t d = half; d < dim; d++) out[d] = v[d] * c[d] + v[d - half] * s[d];
            store_floats(x, bf16, head, dim, out);
        }
    }
}

/* out[t] = act(gate) * up for rows [gate | up] of 2 * width elements, in float32 (rounded once
 * for bfloat16 rows), 16 lanes at a time over chunks of MAX_DIM (the tail's extra lanes are
 * computed on zeros and not stored). act is silu (SwiGLU), or with `gelu` tanh-GELU (Gemma's
 * GeGLU): gelu_tanh(g) = g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(u) = 1 - 2 /
 * (exp(2u) + 1). exp16 saturates at both ends, so 1 + exp(-gate) is finite and at least 1 for
 * every finite gate, and tanh stays in [-1, 1]. */
static inline v16f silu16(v16f g) { return g / (1.0f + exp16(-g)); }

static inline v16f gelu_tanh16(v16f g) {
    const v16f u = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
    const v16f tanh_u = 1.0f - 2.0f / (exp16(2.0f * u) + 1.0f);
    return 0.5f * g * (1.0f + tanh_u);
}

void glu_mul(const void *gate_up, int64_t tokens, int64_t width, void *out, int bf16, int gelu,
             int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens > 16)
    for (int64_t t = 0; t < tokens; t++) {
        v16f gate[MAX_DIM / 16], up[MAX_DIM / 16], result[MAX_DIM / 16];
        for (int64_t i = 0; i < width; i += MAX_DIM) {
            const int64_t n = width - i < MAX_DIM ? width - i : MAX_DIM;
            memset(gate, 0, sizeof gate);
            memset(up, 0, sizeof up);
            load_floats(gate_up, bf16, t * 2 * width + i, n, (float *)gate);
            load_floats(gate_up, bf16, t * 2 * width + width + i, n, (float *)up);
            for (int64_t j = 0; j < (n + 15) / 16; j++)
                result[j] = (gelu ? gelu_tanh16(gate[j]) : silu16(gate[j])) * up[j];
            store_floats(out, bf16, t * width + i, n, (const float *)result);
        }
    }
}

/* ---------------- a whole decoder layer in one call (quantized linears) ---------------- */

/* The kernels of the other libraries, by address (gguf_linear.c, cpu_paged_attention.c): the
 * layer calls the very functions the per-op path calls, so both give the same bits. */
typedef int (*linear_fn)(int kind, const float *x, int64_t rows, int64_t k, const void *data,
                         int64_t n, float *out, int threads);
typedef int (*attention_fn)(const float *q, int64_t q_stride_t, int64_t q_stride_h, float *out,
                            int64_t out_stride_t, int64_t out_stride_h, const void *key_cache,
                            const void *value_cache, int bf16, const int64_t *q_start,
                            const int64_t *q_len, const int64_t *seq_len,
                            const int64_t *block_tables, int64_t bt_stride, const uint8_t *tree,
                            int64_t tree_stride, int64_t num_seqs, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            int64_t chunk, float scale, int64_t window, float softcap,
                            int num_threads);
typedef void (*write_fn)(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                         void *key_cache, void *value_cache, const int64_t *slots, int64_t tokens,
                         int64_t kv_width, int64_t elem_size);

/* MKL's cblas_sgemm_compute (kernels/sgemm.py hands its address over once): float32 rows times
 * a matrix packed by cblas_sgemm_pack, behind the linear_fn signature, called with the very
 * arguments the per-op path passes it from Python, so both give the same bits. */
typedef void (*sgemm_compute_fn)(int layout, int trans_a, int trans_b, int m, int n, int k,
                                 const float *a, int lda, const void *b, int ldb, float beta,
                                 float *c, int ldc);
static sgemm_compute_fn sgemm_compute = NULL;

void set_sgemm_compute(void *compute) { sgemm_compute = (sgemm_compute_fn)compute; }

int sgemm_linear(int kind, const float *x, int64_t rows, int64_t k, const void *data, int64_t n,
                 float *out, int threads) {
    (void)kind, (void)threads; /* MKL keeps torch's thread count */
    if (sgemm_compute == NULL || rows > INT_MAX || k > INT_MAX || n > INT_MAX) return -1;
    if (rows > 0)
        sgemm_compute(101 /* row major */, 111 /* x as is */, 151 /* packed */, (int)rows, (int)n,
                      (int)k, x, (int)k, data, (int)k, 0.0f, out, (int)n);
    return 0;
}

/* One part of a stacked weight (kernels/weight_forms.py's StackedWeight): its kernel, kind,
 * bytes and outputs. */
typedef struct {
    linear_fn fn;
    int kind;
    const void *data;
    int64_t n;
} StackedPart;

/* out = x [W_0; W_1; ...]^T for a weight stacked along its outputs from parts of different
 * forms (a q/k/v projection whose shards a file stores in different types): each part's own
 * kernel into a scratch, copied into its columns (the linear_fn signature: `count` parts at
 * `parts`, their outputs summing to n). The per-op path concatenates the same products. */
int stacked_linear(int count, const float *x, int64_t rows, int64_t k, const void *parts,
                   int64_t n, float *out, int threads) {
    const StackedPart *part = (const StackedPart *)parts;
    int64_t widest = 0, total = 0;
    for (int i = 0; i < count; i++) {
        widest = part[i].n > widest ? part[i].n : widest;
        total += part[i].n;
    }
    if (total != n) return -1;
    if (rows <= 0) return 0;
    float *scratch = NULL;
    if (posix_memalign((void **)&scratch, 64, (size_t)(rows * widest) * sizeof(float)) != 0)
        return -1;
    int status = 0;
    int64_t column = 0;
    for (int i = 0; i < count; i++) {
        const int64_t width = part[i].n;
        status |= part[i].fn(part[i].kind, x, rows, k, part[i].data, width, scratch, threads);
        for (int64_t r = 0; r < rows; r++)
            memcpy(out + r * n + column, scratch + r * width, (size_t)width * sizeof(float));
        column += width;
    }
    free(scratch);
    return status != 0 ? -1 : 0;
}

/* One linear's weight form as the layer multiplies it: its kernel (a bf16_linear_fn, below,
 * in a bfloat16 layer), the kind code that kernel takes, and the form's bytes. */
typedef struct {
    linear_fn fn;
    int kind;         /* e.g. gguf_linear's block kind (sgemm_linear ignores it) */
    const void *data; /* repacked blocks, MKL's packed matrix, AMX tiles */
} QuantLinear;

static inline int run_linear(const QuantLinear *linear, const float *x, int64_t rows, int64_t k,
                             int64_t n, float *out, int threads) {
    return linear->fn(linear->kind, x, rows, k, linear->data, n, out, threads);
}

/* What a layer holds (built once per layer and cache binding). */
typedef struct {
    const float *norm1, *norm2; /* the attention's and the MLP's input norms */
    float eps, scale;
    QuantLinear qkv, o, gate_up, down;
    const float *qkv_bias; /* or NULL */
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
    void *key_cache, *value_cache; /* float32 */
    /* the relatives' features (models/families.py); the float32 layer only */
    const float *q_norm, *k_norm;      /* per-head norms before rotary, or NULL */
    const float *post_attn, *post_mlp; /* norms of the attention's and MLP's outputs, or NULL */
    int64_t rotary_dim, window;        /* rotated dims of a head; sliding window (0: none) */
    float softcap;                     /* of the attention scores (0: none) */
    int gelu, local_rope;              /* GeGLU not SwiGLU; the step's local cos/sin */
} Layer;

/* x += out, normalised first by `norm` where there is one (a sandwich norm; `scratch` holds
 * its result), as the per-op path adds its tensors. */
static void add_output(float *x, const float *out, float *scratch, int64_t T, int64_t H,
                       const float *norm, float eps, int threads) {
    if (norm != NULL) {
        rms_norm(out, T, H, H, norm, eps, scratch, 0, threads);
        out = scratch;
    }
    for (int64_t i = 0; i < T * H; i++) x[i] += out[i];
}

/* What a step gives every layer (built once per step). */
typedef struct {
    int64_t tokens;
    const float *cos, *sin; /* [T, head_dim] */
    const int64_t *slots;   /* [T], negative: padding, not written */
    const int64_t *q_start, *q_len, *seq_len, *block_tables;
    int64_t bt_stride;
    const uint8_t *tree;
    int64_t tree_stride, num_seqs, chunk;
    int threads;
    attention_fn attention;
    write_fn write;
    const float *cos_local, *sin_local; /* sliding layers' own rotary (Gemma 3), or NULL */
    /* sliding layers' own cache group (cache/window_cache.py): their slots and block tables,
     * or NULL (every layer reads the step's) */
    const int64_t *window_slots, *window_tables;
    int64_t window_bt_stride;
} LayerStep;

/* Each token's `heads` heads of head_dim at rows + t * row_width normalised in place (the
 * per-op path normalises the same rows, [T * heads, head_dim], with rms_norm: row by row). */
static int norm_heads(float *rows, int64_t tokens, int64_t heads, int64_t head_dim,
                      int64_t row_width, const float *weight, float eps, int threads) {
    float *scratch = malloc((size_t)(heads * head_dim) * sizeof(float));
    if (scratch == NULL) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        float *row = rows + t * row_width;
        rms_norm(row, heads, head_dim, head_dim, weight, eps, scratch, 0, threads);
        memcpy(row, scratch, (size_t)(heads * head_dim) * sizeof(float));
    }
    free(scratch);
    return 0;
}

/* x (the residual stream, [T, hidden], updated in place) through one decoder layer:
 * x += o(attention(rotary(qkv(norm1(x))))); x += down(silu(gate) * up(norm2(x))), with the
 * Layer's features where it has them: q/k norms before rotary, GeGLU, norms of the attention's
 * and the MLP's outputs before their adds, a sliding window, soft-capped scores.
 * Returns 0, or -1 when scratch memory cannot be allocated or a kernel fails. */
int decoder_layer(const Layer *L, const LayerStep *S, float *x) {
    const int64_t T = S->tokens, H = L->hidden, hd = L->head_dim;
    const int64_t q_size = L->heads * hd, kv = L->kv_heads * hd, qkv_n = q_size + 2 * kv;
    const int64_t inter = L->intermediate;
    /* each buffer starts on a 64-byte line, as torch's tensors do for the per-op path */
    const int64_t widths[6] = {H, qkv_n, q_size, H, 2 * inter, inter};
    size_t offsets[6], floats = 0;
    for (int i = 0; i < 6; i++) {
        offsets[i] = floats;
        floats += ((size_t)(T * widths[i]) + 15) / 16 * 16;
    }
    float *memory = NULL;
    if (posix_memalign((void **)&memory, 64, (floats > 0 ? floats : 16) * sizeof(float)) != 0)
        return -1;
    float *h = memory + offsets[0], *qkv = memory + offsets[1], *attn = memory + offsets[2];
    float *o = memory + offsets[3], *gate_up = memory + offsets[4], *act = memory + offsets[5];
    int status = 0;
    rms_norm(x, T, H, H, L->norm1, L->eps, h, 0, S->threads);
    status |= run_linear(&L->qkv, h, T, H, qkv_n, qkv, S->threads);
    if (L->qkv_bias != NULL)
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < qkv_n; i++) qkv[t * qkv_n + i] += L->qkv_bias[i];
    if (L->q_norm != NULL) {
        status |= norm_heads(qkv, T, L->heads, hd, qkv_n, L->q_norm, L->eps, S->threads);
        status |= norm_heads(qkv + q_size, T, L->kv_heads, hd, qkv_n, L->k_norm, L->eps,
                             S->threads);
    }
    const int local = L->local_rope && S->cos_local != NULL;
    rotary(qkv, T, L->heads + L->kv_heads, L->rotary_dim, qkv_n, hd,
           local ? S->cos_local : S->cos, local ? S->sin_local : S->sin, 0);
    /* a sliding layer with its own cache group reads and writes through that group's tables */
    const int own_group = L->window > 0 && S->window_slots != NULL;
    const int64_t *slots = own_group ? S->window_slots : S->slots;
    const int64_t *tables = own_group ? S->window_tables : S->block_tables;
    const int64_t bt_stride = own_group ? S->window_bt_stride : S->bt_stride;
    S->write(qkv + q_size, qkv_n, qkv + q_size + kv, qkv_n, L->key_cache, L->value_cache,
             slots, T, kv, (int64_t)sizeof(float));
    status |= S->attention(qkv, qkv_n, hd, attn, q_size, hd, L->key_cache, L->value_cache, 0,
                           S->q_start, S->q_len, S->seq_len, tables, bt_stride,
                           S->tree, S->tree_stride, S->num_seqs, L->heads, L->kv_heads, hd,
                           L->block_size, S->chunk, L->scale, L->window, L->softcap, S->threads);
    status |= run_linear(&L->o, attn, T, q_size, H, o, S->threads);
    add_output(x, o, h, T, H, L->post_attn, L->eps, S->threads);
    rms_norm(x, T, H, H, L->norm2, L->eps, h, 0, S->threads);
    status |= run_linear(&L->gate_up, h, T, H, 2 * inter, gate_up, S->threads);
    glu_mul(gate_up, T, inter, act, 0, L->gelu, S->threads);
    status |= run_linear(&L->down, act, T, inter, H, o, S->threads);
    add_output(x, o, h, T, H, L->post_mlp, L->eps, S->threads);
    free(memory);
    return status != 0 ? -1 : 0;
}

/* ---------------- a whole bfloat16 decoder layer in one call (AMX linears) ---------------- */

/* amx_linear.c's amx_linear_bf16 (by address, as a QuantLinear's fn): bfloat16 rows times AMX
 * tiles, each output rounded to bfloat16. */
typedef int (*bf16_linear_fn)(const uint16_t *x, int64_t rows, int64_t k, const void *tiles,
                              int64_t n, uint16_t *out, int threads);

/* A bfloat16 layer's linear: its QuantLinear's kernel is a bf16_linear_fn. */
static inline int bf16_linear(const QuantLinear *linear, const uint16_t *x, int64_t rows,
                              int64_t k, int64_t n, uint16_t *out, int threads) {
    return ((bf16_linear_fn)(void *)linear->fn)(x, rows, k, linear->data, n, out, threads);
}

/* a + b rounded to bfloat16, as torch adds two bfloat16 tensors */
static inline uint16_t add_bf16(uint16_t a, uint16_t b) {
    return to_bf16(from_bf16(a) + from_bf16(b));
}

/* decoder_layer for a bfloat16 model (Layer's pointers are to bfloat16 weights, bias, caches;
 * LayerStep's cos/sin bfloat16, each QuantLinear's kernel a bf16_linear_fn), rounding to
 * bfloat16 wherever its per-op path does: each product's output, the bias and residual adds,
 * the norms' and gated activation's outputs, the attention output (the queries widened to float32 for
 * the kernel, as the backend does). */
int decoder_layer_bf16(const Layer *L, const LayerStep *S, uint16_t *x) {
    const int64_t T = S->tokens, H = L->hidden, hd = L->head_dim;
    const int64_t q_size = L->heads * hd, kv = L->kv_heads * hd, qkv_n = q_size + 2 * kv;
    const int64_t inter = L->intermediate;
    /* bfloat16: h, qkv, attention out, o, gate/up, act; float32: queries, attention out */
    const int64_t halves[6] = {H, qkv_n, q_size, H, 2 * inter, inter};
    size_t offsets[8], bytes = 0;
    for (int i = 0; i < 8; i++) {
        offsets[i] = bytes;
        const size_t size = i < 6 ? (size_t)(T * halves[i]) * 2 : (size_t)(T * q_size) * 4;
        bytes += (size + 63) / 64 * 64;
    }
    char *memory = NULL;
    if (posix_memalign((void **)&memory, 64, bytes > 0 ? bytes : 64) != 0) return -1;
    uint16_t *h = (uint16_t *)(memory + offsets[0]), *qkv = (uint16_t *)(memory + offsets[1]);
    uint16_t *attn = (uint16_t *)(memory + offsets[2]), *o = (uint16_t *)(memory + offsets[3]);
    uint16_t *gate_up = (uint16_t *)(memory + offsets[4]);
    uint16_t *act = (uint16_t *)(memory + offsets[5]);
    float *q32 = (float *)(memory + offsets[6]), *attn32 = (float *)(memory + offsets[7]);
    int status = 0;
    rms_norm(x, T, H, H, L->norm1, L->eps, h, 1, S->threads);
    status |= bf16_linear(&L->qkv, h, T, H, qkv_n, qkv, S->threads);
    if (L->qkv_bias != NULL) {
        const uint16_t *bias = (const uint16_t *)(const void *)L->qkv_bias;
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < qkv_n; i++)
                qkv[t * qkv_n + i] = add_bf16(qkv[t * qkv_n + i], bias[i]);
    }
    rotary(qkv, T, L->heads + L->kv_heads, hd, qkv_n, hd, S->cos, S->sin, 1);
    S->write(qkv + q_size, qkv_n, qkv + q_size + kv, qkv_n, L->key_cache, L->value_cache,
             S->slots, T, kv, 2);
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < q_size; i++) q32[t * q_size + i] = from_bf16(qkv[t * qkv_n + i]);
    status |= S->attention(q32, q_size, hd, attn32, q_size, hd, L->key_cache, L->value_cache, 1,
                           S->q_start, S->q_len, S->seq_len, S->block_tables, S->bt_stride,
                           S->tree, S->tree_stride, S->num_seqs, L->heads, L->kv_heads, hd,
                           L->block_size, S->chunk, L->scale, 0, 0.0f, S->threads);
    for (int64_t i = 0; i < T * q_size; i++) attn[i] = to_bf16(attn32[i]);
    status |= bf16_linear(&L->o, attn, T, q_size, H, o, S->threads);
    for (int64_t i = 0; i < T * H; i++) x[i] = add_bf16(x[i], o[i]);
    rms_norm(x, T, H, H, L->norm2, L->eps, h, 1, S->threads);
    status |= bf16_linear(&L->gate_up, h, T, H, 2 * inter, gate_up, S->threads);
    glu_mul(gate_up, T, inter, act, 1, 0, S->threads);
    status |= bf16_linear(&L->down, act, T, inter, H, o, S->threads);
    for (int64_t i = 0; i < T * H; i++) x[i] = add_bf16(x[i], o[i]);
    free(memory);
    return status != 0 ? -1 : 0;
}
