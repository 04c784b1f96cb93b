/* The per-row glue around oneDNN's int8 matmul (bert_port/quantization.py has the scheme):
 * quantize each row by its own range, and dequantize each row of the int32 products with its
 * own step. In PyTorch each is a chain of 3-5 elementwise ops over the whole (N, K) or (N, M)
 * tensor, each a pass through memory; here a row is read once while it sits in L1.
 *
 * Built at install (setup.py, -ffp-contract=off) and called as torch ops (speed/kernels.py) on
 * contiguous float32 rows. No fused multiply-add: every product is
 * rounded before its sum, as in the PyTorch fallback (torch's own kernels may still fuse). The
 * rows are independent: a row's result never depends on the others, nor on the thread count,
 * which the caller passes (torch.get_num_threads()). A NaN in a row makes the row's step NaN, so
 * that the row's outputs are NaN, as on the PyTorch path. */
#include <math.h>
#include <stdint.h>

#define SIGNED_LEVELS 63.0f    /* signed rows: -63..63 around the zero point 64 */
#define UNSIGNED_LEVELS 127.0f /* unsigned rows: 0..127 above the floor */
#define ZERO_POINT 64.0f
#define TINY 1.17549435e-38f /* FLT_MIN: the smallest step, for an all-zero row */

/* x: n rows of k floats, row i at x + i * ld. scale, offset: NULL or (k,), x' = offset + x * scale
 * per channel (shift and smoothing). has_floor: unsigned rows, (x - floor) / step in 0..127;
 * else signed rows, x' / step in -63..63 stored as 64 + that. Round half up: + 0.5, truncate.
 * Writes q (n, k) and steps (n,). */
void quantize_rows(const float *x, int64_t n, int64_t k, int64_t ld, const float *scale, const float *offset,
                   int has_floor, float floor, uint8_t *q, float *steps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; i++) {
    const float *row = x + i * ld;
    uint8_t *out = q + i * k;
    float hi = -INFINITY, lo = INFINITY;
    int nan = 0;
    if (scale) {
#pragma omp simd reduction(max : hi) reduction(min : lo) reduction(| : nan)
      for (int64_t j = 0; j < k; j++) {
        float v = offset[j] + row[j] * scale[j];
        hi = v > hi ? v : hi;
        lo = v < lo ? v : lo;
        nan |= v != v;
      }
    } else {
#pragma omp simd reduction(max : hi) reduction(min : lo) reduction(| : nan)
      for (int64_t j = 0; j < k; j++) {
        hi = row[j] > hi ? row[j] : hi;
        lo = row[j] < lo ? row[j] : lo;
        nan |= row[j] != row[j];
      }
    }
    float step = has_floor ? (hi - floor) / UNSIGNED_LEVELS : fmaxf(hi, -lo) / SIGNED_LEVELS;
    step = step < TINY ? TINY : step;
    if (nan) { /* a NaN converts to no integer: zeros, and a NaN step makes the row's outputs NaN */
      for (int64_t j = 0; j < k; j++) out[j] = 0;
      steps[i] = NAN;
      continue;
    }
    float inverse = 1.0f / step;
    float add = has_floor ? 0.5f - floor * inverse : ZERO_POINT + 0.5f;
    if (scale) {
#pragma omp simd
      for (int64_t j = 0; j < k; j++) out[j] = (uint8_t)(int32_t)((offset[j] + row[j] * scale[j]) * inverse + add);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < k; j++) out[j] = (uint8_t)(int32_t)(row[j] * inverse + add);
    }
    steps[i] = step;
  }
}

/* In place, row i of the (n, m) products, in this order: acc = bias + acc * steps[i]; + the float32
 * outlier channels if f > 0, extra[i * ld + c] * extra_weight[c * m + j] for c = 0, 1, ..., f - 1 (a
 * fixed order per row, where a float32 GEMM's changes with the row count); + residual (n, m) if given.
 * (GELU stays with PyTorch: its vectorized erf, on SLEEF's exp, ran faster than a portable one here.) */
void dequantize_rows(float *acc, int64_t n, int64_t m, const float *steps, const float *bias, const float *extra,
                     int64_t ld, const float *extra_weight, int64_t f, const float *residual, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; i++) {
    float *row = acc + i * m;
    const float step = steps[i];
#pragma omp simd
    for (int64_t j = 0; j < m; j++) row[j] = bias[j] + row[j] * step;
    for (int64_t c = 0; c < f; c++) {
      const float x = extra[i * ld + c];
      const float *w = extra_weight + c * m;
#pragma omp simd
      for (int64_t j = 0; j < m; j++) row[j] += x * w[j];
    }
    if (residual) {
      const float *res = residual + i * m;
#pragma omp simd
      for (int64_t j = 0; j < m; j++) row[j] += res[j];
    }
  }
}
