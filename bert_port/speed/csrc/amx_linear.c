/* bf16 dense layers on Intel AMX (bert_port/gemm.py, `_amx_linear`): y = act(x W^T + b) + r for
 * packed rows x (N, K), in one call for all N rows, with a row's bits independent of N and of the
 * thread count by construction.
 *
 * Each 32 x 32 block of y is computed by one thread from start to end: four 16 x 16 float32 tiles
 * accumulate TDPBF16PS products over K in steps of 32, always in the same order, so that a row's
 * result depends on its own inputs and the weight alone, never on the rows beside it (AMX computes
 * each row of a tile on its own). oneDNN, the alternative, picks its blocking of K by N and had to
 * be called on fixed blocks of 128 rows for that guarantee (gemm.py).
 *
 * The weight is packed once (`_amx_pack` in gemm.py, a torch permute) into the tiles
 * TDPBF16PS reads: for each 16 columns, for each step of 32 along K, 16 rows of 16 column pairs of
 * consecutive k (VNNI). The epilogue runs on the float32 accumulator: the bias, then GELU (erf) or
 * ReLU, then the residual, then one rounding to bf16 (to nearest even), as oneDNN's post-ops do.
 *
 * Built at install into the AMX variant of the kernels' extension (setup.py). In the variants
 * built without AMX, `amx_ready` returns 0 and speed/gemm.py never calls `amx_linear`; the tiles are
 * emulated there (amx_emulated.h), for the tests. */
#pragma GCC optimize("fp-contract=fast") /* fused multiply-adds here (see above) */
#include <stdint.h>

#include "tasks.h"
#include "vector.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out AMX's tile state only on request, once per process. */
int amx_ready(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }
int amx_emulated(void) { return 0; }

struct tile_config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

/* Tiles 0-3: the 2 x 2 float32 accumulators of a 32 x 32 block; 4, 5: 16 rows of x by 32 k each;
 * 6, 7: 16 k pairs by 16 columns each. Every tile is 16 rows of 64 bytes. */
static void configure_tiles(void) {
  struct tile_config config = {.palette = 1};
  for (int t = 0; t < 8; t++) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

#else
/* Without AMX the same kernel runs on tiles emulated in plain C (amx_emulated.h): slow, never
 * called by gemm.py (`amx_ready` is 0), and there so that the kernel's blocking, weight layout,
 * epilogue and work sharing are tested on every CPU (tests/test_amx_linear.py). */
#include "amx_emulated.h"

int amx_ready(void) { return 0; }
int amx_emulated(void) { return 1; }
#endif

/* GELU's erf: Eigen's rational approximation (x times a polynomial in x^2 of degree 6 over one of
 * degree 4, on x clamped to [-4, 4], where erf is 1 to float precision beyond). Absolute error a
 * few 1e-7: GELU then has the bits of torch's on 99.7% of bf16 inputs (tested: at least 99.5%),
 * one bf16 step from it elsewhere except for x < -4, where GELU is below 4e-5 and off by at most
 * 4e-7 (tests/test_amx_linear.py). */
static inline vf verf(vf x) {
  x = pick(x > 4.0f, (vf){0} + 4.0f, pick(x < -4.0f, (vf){0} - 4.0f, x));
  const vf x2 = x * x;
  vf p = x2 * -2.72614225801306e-10f + 2.77068142495902e-08f;
  p = p * x2 - 2.10102402082508e-06f;
  p = p * x2 - 5.69250639462346e-05f;
  p = p * x2 - 7.34990630326855e-04f;
  p = p * x2 - 2.95459980854025e-03f;
  p = p * x2 - 1.60960333262415e-02f;
  vf q = x2 * -1.45660718464996e-05f - 2.13374055278905e-04f;
  q = q * x2 - 1.68282697438203e-03f;
  q = q * x2 - 7.37332916720468e-03f;
  q = q * x2 - 1.42647390514189e-02f;
  return x * p / q;
}

enum { ACT_NONE = 0, ACT_GELU = 1, ACT_RELU = 2 };

/* Where y goes and what the epilogue adds on the way. */
struct epilogue_args {
  const float *bias; /* (M), or NULL */
  int act;           /* ACT_* */
  const uint16_t *res;
  int64_t ldr; /* (N, M) bf16 with row stride ldr, or NULL */
  uint16_t *out;
  int64_t ldo; /* (N, M) bf16, row stride ldo */
};

/* Rows r+i0..r+i1-1, columns c..c+31 of y from the accumulators in acc (32 x 32 float32). */
static void epilogue(const float *acc, int64_t r, int64_t c, int64_t i0, int64_t i1, const struct epilogue_args *e) {
  for (int64_t i = i0; i < i1; i++) {
    for (int64_t h = 0; h < 32; h += W) {
      vf y = *(const vfu *)(acc + i * 32 + h);
      if (e->bias) y += *(const vfu *)(e->bias + c + h);
      if (e->act == ACT_GELU) y = 0.5f * y * (1.0f + verf(y * 0.70710678118654752f));
      if (e->act == ACT_RELU) y = pick(y < 0.0f, (vf){0}, y); /* NaN stays NaN */
      if (e->res) y += bf16_to_vf(e->res + (r + i) * e->ldr + c + h);
      vf_to_bf16(y, e->out + (r + i) * e->ldo + c + h);
    }
  }
}

/* Steps of 32 along K per pass over a task's columns: 12 x 32 rows of x (24 KiB) stay in L1 while
 * the columns' tiles of the weight stream from L2. */
#define STEPS_PER_PASS 12

/* Rows r..r+31 by columns c0..c0+cols-1 of y. The sums go to acc (one 32 x 32 float32 block after
 * another): K in passes of STEPS_PER_PASS steps, each over every 32 columns, the sums kept in acc
 * between passes (stored and loaded exactly). The steps along K run in order for every block,
 * however K is split: the same bits as one pass. In the last pass each block's epilogue runs a
 * few rows at a time between the next block's steps, on the vector units while AMX computes. */
static void task(const uint16_t *x, int64_t ldx, int64_t K, const uint16_t *wp, int64_t r, int64_t c0, int64_t cols,
                 float *acc, const struct epilogue_args *e) {
  const int64_t steps = K / 32, stride = ldx * 2;
  const uint16_t *x0 = x + r * ldx, *x1 = x0 + 16 * ldx;
  for (int64_t s0 = 0; s0 < steps; s0 += STEPS_PER_PASS) {
    const int64_t s1 = s0 + STEPS_PER_PASS < steps ? s0 + STEPS_PER_PASS : steps;
    for (int64_t c = 0; c < cols; c += 32) {
      const uint16_t *w0 = wp + ((c0 + c) / 16) * steps * 512, *w1 = w0 + steps * 512;
      float *a = acc + c * 32;
      /* rows of the previous block's epilogue per step: all 32 over this pass's steps */
      const int64_t per_step = s1 == steps && c > 0 ? (32 + s1 - s0 - 1) / (s1 - s0) : 0;
      if (s0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_loadd(0, a, 128);
        _tile_loadd(1, a + 16, 128);
        _tile_loadd(2, a + 16 * 32, 128);
        _tile_loadd(3, a + 16 * 32 + 16, 128);
      }
      for (int64_t s = s0, done = 0; s < s1; s++) {
        _tile_loadd(4, x0 + s * 32, stride);
        _tile_loadd(5, x1 + s * 32, stride);
        _tile_loadd(6, w0 + s * 512, 64);
        _tile_loadd(7, w1 + s * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (per_step) {
          const int64_t end = done + per_step < 32 ? done + per_step : 32;
          epilogue(a - 32 * 32, r, c0 + c - 32, done, end, e);
          done = end;
        }
      }
      _tile_stored(0, a, 128);
      _tile_stored(1, a + 16, 128);
      _tile_stored(2, a + 16 * 32, 128);
      _tile_stored(3, a + 16 * 32 + 16, 128);
    }
  }
  epilogue(acc + (cols - 32) * 32, r, c0 + cols - 32, 0, 32, e); /* the last block's */
}

/* The 32-row block where thread k's rows begin: ATen's split of the N rows (tasks.h), to the
 * nearest block. */
static int64_t block_start(int64_t N, int threads, int k) {
  return k == threads ? N / 32 : (split_start(N, threads, k) + 16) / 32;
}

/* x (N, K) bf16, row stride ldx; wp the packed weight of M outputs; bias (M) float32 or NULL;
 * act one of ACT_*; res (N, M) bf16, row stride ldr, or NULL; out (N, M) bf16, row stride ldo.
 * N, K and M must be multiples of 32, cols of 32 and at most MAX_COLS: the columns of y in one
 * task. Returns 0, or -1 (nothing written) for shapes or strides it does not take. */
#define MAX_COLS 256
int amx_linear(const uint16_t *x, int64_t N, int64_t K, int64_t ldx, const uint16_t *wp, int64_t M,
               const float *bias, int act, const uint16_t *res, int64_t ldr, uint16_t *out, int64_t ldo,
               int64_t cols, int threads) {
  if (N % 32 || K % 32 || M % 32 || K <= 0 || cols % 32 || cols <= 0 || cols > MAX_COLS || ldx < K || ldo < M ||
      (res && ldr < M) || threads < 1)
    return -1;
  /* Each thread's own rows as ATen splits them (tasks.h), column chunk by column chunk within them,
   * so that a chunk's weight stays in L2 while the thread's rows pass through. */
  const int64_t chunks = (M + cols - 1) / cols;
  struct task_range ranges[threads];
  for (int k = 0; k < threads; k++) {
    const int64_t first = block_start(N, threads, k), rows = block_start(N, threads, k + 1) - first;
    ranges[k] = (struct task_range){.next = 0, .end = rows * chunks, .first = first, .rows = rows};
  }
  const struct epilogue_args e = {bias, act, res, ldr, out, ldo};
#pragma omp parallel num_threads(threads)
  {
    float acc[32 * MAX_COLS] __attribute__((aligned(64)));
    configure_tiles();
    int cursor = 0, k;
    for (int64_t t; (t = next_task(ranges, threads, omp_get_thread_num(), &cursor, &k)) >= 0;) {
      const int64_t r = (ranges[k].first + t % ranges[k].rows) * 32, c0 = t / ranges[k].rows * cols;
      task(x, ldx, K, wp, r, c0, M - c0 < cols ? M - c0 : cols, acc, &e);
    }
    _tile_release();
  }
  return 0;
}
