/*
 * bfloat16 products on AMX tiles, a row's bits independent of the other rows (the bfloat16
 * mode's linears where Linux grants AMX; kernels/amx_linear.py).
 *
 * out[M][N] = x[M][K] W^T for bfloat16 x and W (W repacked once by pack_b into TDPBF16PS's B
 * tiles: per 16 outputs and 32 K, 16 rows of K pairs, 64 bytes each), accumulated in float32:
 * output (m, n) is C[m][n] summed over the K tiles in increasing order by TDPBF16PS, whatever
 * the row count or the blocking (2x2 tiles of 16 rows x 16 outputs, chunks of CHUNK_PAIRS
 * output pairs per thread): rows never meet. amx_linear_bf16 rounds each float32 output to
 * bfloat16 (to_bf16: to nearest even, as torch does), so the per-op path and a fused layer
 * calling it get the same bits. K is a multiple of 32. Measured against oneDNN's bfloat16
 * linear: benchmarks/amx_bf16.py (docs/notes.md, 2026-12-06).
 *
 * Built at first use (cbuild: -march=native); without AMX under -march=native, or where Linux
 * refuses the tile state, amx_available returns 0 and nothing else may be called.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* asks Linux for the tile data state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): 1 granted */
int amx_available(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* W [N][K] bfloat16 -> B tiles: per 16 outputs and 32 K, 16 rows of K pairs, 64 bytes each. */
void pack_b(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    const int64_t ntiles = (n + 15) / 16, ktiles = k / 32;
    for (int64_t nt = 0; nt < ntiles; nt++)
        for (int64_t kt = 0; kt < ktiles; kt++) {
            uint16_t *tile = out + (nt * ktiles + kt) * 512;
            for (int kp = 0; kp < 16; kp++)
                for (int c = 0; c < 16; c++)
                    for (int i = 0; i < 2; i++) {
                        const int64_t row = nt * 16 + c, col = kt * 32 + 2 * kp + i;
                        tile[kp * 32 + 2 * c + i] = row < n ? w[row * k + col] : 0;
                    }
        }
}

/* Tiles 0-1 (C) and 4 (A) hold the first 16-row block's rows, 2-3 and 5 the second's (either
 * may be short: a tile's rows are independent), 6-7 the B tiles. */
static void configure(int rows0, int rows1) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)rows0;
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)rows1;
    cfg.rows[6] = cfg.rows[7] = 16;
    _tile_loadconfig(&cfg);
}

/* to_bf16 on 16 floats (the same bits: to nearest even, a NaN made quiet) */
static inline void to_bf16x16(const float *src, uint16_t *dst) {
    v16u bits;
    memcpy(&bits, src, sizeof bits);
    const v16u nan = (v16u)((bits & 0x7fffffffu) > 0x7f800000u);
    const v16u rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const v16u quiet = (bits >> 16) | 0x40u;
    const v16h half = __builtin_convertvector((nan & quiet) | (~nan & rounded), v16h);
    memcpy(dst, &half, sizeof half);
}

/* A C tile's mr rows (16 floats each, in spill) rounded into out's columns col0 .. col0 + 15
 * (those below n). */
static void store_tile(const float *spill, int mr, int64_t n, int64_t col0, uint16_t *out) {
    for (int r = 0; r < mr; r++) {
        if (col0 + 16 <= n) {
            to_bf16x16(spill + r * 16, out + r * n + col0);
            continue;
        }
        for (int c = 0; col0 + c < n; c++) out[r * n + col0 + c] = to_bf16(spill[r * 16 + c]);
    }
}

#define CHUNK_PAIRS 16 /* output pairs per thread chunk: their B tiles stay in L2 */
#define STORE(t, rows, mrow, col0)                                                             \
    do {                                                                                        \
        _tile_stored(t, spill, 64);                                                             \
        store_tile(spill, rows, n, col0, out + (mrow) * n);                                     \
    } while (0)

/* out[M][N] = x[M][K] W^T rounded to bfloat16, by blocks of 32 rows x 32 outputs (C tiles 0-3:
 * two row blocks times two output tiles), chunk by chunk of outputs, each chunk's row blocks in
 * turn (a row block's A tiles stay in L1 across the chunk's outputs). */
static void amx_gemm(const uint16_t *x, int64_t m, int64_t k, const uint16_t *bp, int64_t n,
                     uint16_t *out, int threads) {
    const int64_t ntiles = (n + 15) / 16, ktiles = k / 32, pairs = (ntiles + 1) / 2;
    const int64_t chunks = (pairs + CHUNK_PAIRS - 1) / CHUNK_PAIRS;
#pragma omp parallel num_threads(threads)
    {
        int configured0 = -1, configured1 = -1;
        float spill[16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t chunk = 0; chunk < chunks; chunk++) {
            const int64_t end = (chunk + 1) * CHUNK_PAIRS;
            const int64_t last = end < pairs ? end : pairs;
            for (int64_t m0 = 0; m0 < m; m0 += 32) {
                const int64_t m1 = m0 + 16;
                const int rows0 = m - m0 < 16 ? (int)(m - m0) : 16;
                const int rows1 = m1 >= m ? 0 : (m - m1 < 16 ? (int)(m - m1) : 16);
                if (rows0 != configured0 || rows1 != configured1) {
                    configure(rows0, rows1 > 0 ? rows1 : rows0); /* tiles 2, 3, 5 unused */
                    configured0 = rows0, configured1 = rows1;
                }
                for (int64_t p = chunk * CHUNK_PAIRS; p < last; p++) {
                    const int64_t nt0 = 2 * p, nt1 = 2 * p + 1 < ntiles ? 2 * p + 1 : 2 * p;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t kt = 0; kt < ktiles; kt++) {
                        _tile_loadd(6, bp + (nt0 * ktiles + kt) * 512, 64);
                        _tile_loadd(7, bp + (nt1 * ktiles + kt) * 512, 64);
                        _tile_loadd(4, x + m0 * k + kt * 32, k * 2);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        if (rows1) {
                            _tile_loadd(5, x + m1 * k + kt * 32, k * 2);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    STORE(0, rows0, m0, nt0 * 16);
                    if (nt1 != nt0) STORE(1, rows0, m0, nt1 * 16);
                    if (rows1) {
                        STORE(2, rows1, m1, nt0 * 16);
                        if (nt1 != nt0) STORE(3, rows1, m1, nt1 * 16);
                    }
                }
            }
        }
        _tile_release();
    }
}

/* out ([M][N], bfloat16) = x W^T, each output rounded once from its float32 sum. */
int amx_linear_bf16(const uint16_t *x, int64_t m, int64_t k, const void *tiles, int64_t n,
                    uint16_t *out, int threads) {
    if (m > 0) amx_gemm(x, m, k, (const uint16_t *)tiles, n, out, threads);
    return 0;
}

#else

int amx_available(void) { return 0; }
void pack_b(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    (void)w, (void)n, (void)k, (void)out;
}
int amx_linear_bf16(const uint16_t *x, int64_t m, int64_t k, const void *tiles, int64_t n,
                    uint16_t *out, int threads) {
    (void)x, (void)m, (void)k, (void)tiles, (void)n, (void)out, (void)threads;
    return -1;
}

#endif
