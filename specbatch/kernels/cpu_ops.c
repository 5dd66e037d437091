/*
 * Small per-layer CPU operations in C, where torch's per-op dispatch costs more than the work
 * at decode sizes (a 576-wide RMSNorm row: ~10 us through torch, ~1 us here). Each output row
 * depends only on its own input row, in a fixed order (no dependence on the batch or threads).
 *
 * Built at first use by specbatch/kernels/cpu_ops.py (see cbuild.py) and called through ctypes.
 */
#include <math.h>
#include <stdint.h>

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, float32 rows of dim elements (x rows
 * x_stride apart, out rows contiguous). The sum of squares runs in 16 lanes, folded in a fixed
 * order. */
void rms_norm(const float *x, int64_t rows, int64_t dim, int64_t x_stride, const float *weight,
              float eps, float *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * x_stride;
        float lanes[16] = {0};
        int64_t d = 0;
        for (; d + 16 <= dim; d += 16)
            for (int lane = 0; lane < 16; lane++) lanes[lane] += row[d + lane] * row[d + lane];
        for (int lane = 0; d < dim; d++, lane++) lanes[lane] += row[d] * row[d];
        for (int width = 8; width > 0; width /= 2)
            for (int lane = 0; lane < width; lane++) lanes[lane] += lanes[lane + width];
        const float scale = 1.0f / sqrtf(lanes[0] / (float)dim + eps);
        float *dst = out + r * dim;
        for (d = 0; d < dim; d++) dst[d] = row[d] * scale * weight[d];
    }
}
