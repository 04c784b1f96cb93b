/* fp32 dense layers on AVX2 (bert_port/speed/gemm.py, `_f32_linear`): y = x W^T + b + r for rows
 * x (N, K), in one call for all N rows, with a row's bits independent of N and of the thread count
 * by construction.
 *
 * Every element of y is one chain of fused multiply-adds over k = 0, 1, ..., K - 1 from zero, then
 * + b, then + r: the same arithmetic whichever rows share its block, whatever block or thread
 * computes it (a block of fewer than 6 rows computes copies of its last row in the missing ones
 * and stores none of them). oneDNN's AVX2 GEMM, the alternative, ran 15-20% slower at MiniLM's
 * shapes on an AMD EPYC, where this simple kernel runs near the FMA units' peak
 * (docs/architecture.md has the figures).
 *
 * The weight is packed once (`_f32_pack` in gemm.py, a torch permute): for each 16 outputs, for each
 * k, their 16 weights, as the kernel's two 8-float loads read them. The 6 x 16 block of y lives in
 * 12 registers; each k broadcasts 6 inputs and does 12 fused multiply-adds. Rows are taken in
 * blocks of ROW_BLOCK (inputs stay in L2 while a panel of weights, in L1, passes over them).
 *
 * Built into the variants with AVX2 and FMA; elsewhere `f32_linear` returns -1 and gemm.py does not
 * call it. */
#include <stdint.h>

#include "tasks.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define MR 6           /* rows of a block of y */
#define NR 16          /* columns of a block of y: one packed panel */
#define ROW_BLOCK 96   /* rows per task: 96 x K inputs stay in L2 */
#define COLUMNS 128    /* columns per task */

int f32_linear_ready(void) { return 1; }

#define FMA_ROW(i)                                   \
  {                                                  \
    const __m256 ai = _mm256_broadcast_ss(a##i + k); \
    y##i##0 = _mm256_fmadd_ps(ai, w0, y##i##0);      \
    y##i##1 = _mm256_fmadd_ps(ai, w1, y##i##1);      \
  }

#define STORE_ROW(i)                                                                        \
  if (i < rows) {                                                                           \
    __m256 lo = _mm256_add_ps(y##i##0, b0), hi = _mm256_add_ps(y##i##1, b1);                \
    if (res) {                                                                              \
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(res + i * ldr));                               \
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(res + i * ldr + 8));                           \
    }                                                                                       \
    _mm256_storeu_ps(out + i * ldo, lo);                                                    \
    _mm256_storeu_ps(out + i * ldo + 8, hi);                                                \
  }

/* The `rows` (1 to 6) x 16 block of y at x's rows and the panel wp: rows past `rows` read the last
 * real one. bias and res are at the block's first column (res at its first row), or NULL. */
static void block(int rows, const float *x, int64_t ldx, const float *wp, int64_t K, const float *bias,
                  const float *res, int64_t ldr, float *out, int64_t ldo) {
  const float *a0 = x, *a1 = x + (rows > 1 ? 1 : rows - 1) * ldx, *a2 = x + (rows > 2 ? 2 : rows - 1) * ldx,
              *a3 = x + (rows > 3 ? 3 : rows - 1) * ldx, *a4 = x + (rows > 4 ? 4 : rows - 1) * ldx,
              *a5 = x + (rows > 5 ? 5 : rows - 1) * ldx;
  __m256 y00 = _mm256_setzero_ps(), y01 = y00, y10 = y00, y11 = y00, y20 = y00, y21 = y00, y30 = y00, y31 = y00,
         y40 = y00, y41 = y00, y50 = y00, y51 = y00;
  for (int64_t k = 0; k < K; k++) {
    const __m256 w0 = _mm256_loadu_ps(wp + k * NR), w1 = _mm256_loadu_ps(wp + k * NR + 8);
    FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5)
  }
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps(), b1 = bias ? _mm256_loadu_ps(bias + 8) : b0;
  STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5)
}

/* The rows r0..r0+n-1 and columns c0..c0+cols-1 of y (cols a multiple of 16; M outputs in all).
 * Before each block of rows, a share of the next panel's K cache lines (one k of a panel is one
 * line) is prefetched into L1, so that the panel's first block finds its weights there instead of in
 * L3 or memory: a model's weights do not stay in a shared L3 from one call to the next (the gain is
 * in docs/architecture.md). The next panel of the last one is the first: the next row block's. */
static void task(const float *x, int64_t ldx, int64_t K, const float *wp, int64_t M, const float *bias,
                 const float *res, int64_t ldr, float *out, int64_t ldo, int64_t r0, int64_t n, int64_t c0,
                 int64_t cols) {
  const int64_t blocks = (n + MR - 1) / MR, share = (K + blocks - 1) / blocks; /* lines per block */
  for (int64_t c = c0; c < c0 + cols; c += NR) {
    const float *next = wp + (c + NR < M ? c + NR : 0) * K;
    int64_t line = 0;
    for (int64_t r = r0; r < r0 + n; r += MR) {
      for (const int64_t end = line + share < K ? line + share : K; line < end; line++)
        _mm_prefetch((const char *)(next + line * NR), _MM_HINT_T0);
      block(r0 + n - r < MR ? (int)(r0 + n - r) : MR, x + r * ldx, ldx, wp + c * K, K, bias ? bias + c : NULL,
            res ? res + r * ldr + c : NULL, ldr, out + r * ldo + c, ldo);
    }
  }
}

/* x (N, K) float32, row stride ldx; wp the packed weight of M outputs (M a multiple of 16); bias (M)
 * or NULL; res (N, M), row stride ldr, or NULL; out (N, M), row stride ldo. Returns 0, or -1
 * (nothing written) for shapes it does not take. */
int f32_linear(const float *x, int64_t N, int64_t K, int64_t ldx, const float *wp, int64_t M, const float *bias,
               const float *res, int64_t ldr, float *out, int64_t ldo, int threads) {
  if (N < 1 || K < 1 || M < NR || M % NR || ldx < K || ldo < M || (res && ldr < M) || threads < 1) return -1;
  /* Row blocks split among the threads as ATen splits rows (tasks.h), each block's column chunks
   * in turn. */
  const int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK, chunks = (M + COLUMNS - 1) / COLUMNS;
  if (threads > blocks * chunks) threads = (int)(blocks * chunks);
  struct task_range ranges[threads];
  for (int k = 0; k < threads; k++) {
    const int64_t first = split_start(blocks, threads, k), rows = split_start(blocks, threads, k + 1) - first;
    ranges[k] = (struct task_range){.next = 0, .end = rows * chunks, .first = first, .rows = rows};
  }
#pragma omp parallel num_threads(threads)
  {
    int cursor = 0, k;
    for (int64_t t; (t = next_task(ranges, threads, omp_get_thread_num(), &cursor, &k)) >= 0;) {
      const int64_t r0 = (ranges[k].first + t / chunks) * ROW_BLOCK, c0 = t % chunks * COLUMNS;
      task(x, ldx, K, wp, M, bias, res, ldr, out, ldo, r0, N - r0 < ROW_BLOCK ? N - r0 : ROW_BLOCK, c0,
           M - c0 < COLUMNS ? M - c0 : COLUMNS);
    }
  }
  return 0;
}

#else
int f32_linear_ready(void) { return 0; }

int f32_linear(const float *x, int64_t N, int64_t K, int64_t ldx, const float *wp, int64_t M, const float *bias,
               const float *res, int64_t ldr, float *out, int64_t ldo, int threads) {
  return -1;
}
#endif
