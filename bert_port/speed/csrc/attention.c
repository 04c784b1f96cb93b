/* Self-attention of packed sequences on the CPU (bert_port/attention.py, `packed_attention`):
 * every sequence and every head of a batch in one call, one parallel region, where the PyTorch
 * path makes three small calls per sequence (scores, softmax, weighted values) and, in bf16, a
 * float32 copy of the whole (N, 3H) input and a cast of the output.
 *
 * Built at install (setup.py) with fused multiply-adds (the pragma below; int8_rows.c has none)
 * and called as the torch op bert_port::packed_attention (speed/kernels.py). Inputs are float32 or bf16, the
 * sums and the softmax float32, as on the PyTorch path, whose bits it does not try to match (its
 * own order of summation; the values agree within the fp32 tolerance,
 * tests/test_native_attention.py). One thread computes a (sequence, head) pair from start to end,
 * in an order fixed by the sequence's length and the head size alone: its bits never depend on
 * the other sequences of the batch, nor on the thread count, nor on the vector width (vector.h: 16
 * floats with AVX-512, 8 with AVX, 4 with SSE) where the instruction set has FMA (SSE2 has none,
 * and rounds each product). */
#pragma GCC optimize("fp-contract=fast") /* fused multiply-adds here (see above) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tasks.h"
#include "vector.h"

/* n floats from element `at` of a float32 or bf16 array: a loop the compiler vectorises (a memcpy
 * call per row of a few tens of floats costs more than the copy). */
static inline void row_to_float(float *dst, const void *src, int64_t at, int64_t n, int bf16) {
  if (bf16) {
    const uint16_t *x = (const uint16_t *)src + at;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(x[i]);
  } else {
    const float *x = (const float *)src + at;
    int64_t i = 0;
    for (; i + W <= n; i += W) *(vfu *)(dst + i) = *(const vfu *)(x + i);
    for (; i < n; i++) dst[i] = x[i];
  }
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* One thread's scratch for a sequence of L tokens, in floats: q transposed (hs, Lp) at 0, k (L, hs)
 * at k, v (L, hp) at v and the scores transposed (Lr, Lp) at st, each a multiple of W (aligned);
 * `floats` in all, which grows with L (a scratch sized for the longest sequence fits every one).
 * k and v are copies where the head is bf16 or its size not a multiple of W (see `head`). */
struct layout {
  int64_t Lr, Lp, hp, k, v, st, floats;
};

static struct layout layout_of(int64_t L, int64_t hs) {
  struct layout s = {.Lr = round_up(L, 4), .Lp = round_up(L, W), .hp = round_up(hs, W)};
  s.k = hs * s.Lp;
  s.v = s.k + round_up(L * hs, W);
  s.st = s.v + L * s.hp;
  s.floats = s.st + s.Lr * s.Lp;
  return s;
}

/* The scores transposed, key j by query i: st[j][i] = scale * sum_d k[j][d] q[i][d], d in order
 * (k's rows `ldk` floats apart). Queries lie along the vector lanes, so that the softmax over the
 * keys needs no sum across lanes. 4 keys by 2 vectors of queries at a time (by 1 for an odd last
 * vector): 8 independent sums in flight, what two FMA units of 4 cycles' latency need. Rows L..Lr-1
 * of st repeat key L-1's scores; nothing reads them. */
static void scores(const float *qt, const float *k, int64_t ldk, float *st, int64_t L, int64_t Lr, int64_t Lp,
                   int64_t hs, float scale) {
  for (int64_t j = 0; j < Lr; j += 4) {
    const float *k0 = k + j * ldk, *k1 = j + 1 < L ? k0 + ldk : k0, *k2 = j + 2 < L ? k1 + ldk : k1,
                *k3 = j + 3 < L ? k2 + ldk : k2; /* (never a row past the sequence's last) */
    for (int64_t i = 0; i < Lp; i += 2 * W) {
      const int two = i + W < Lp; /* (a branch the same for every d: the loop stays vectorised) */
      vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
      for (int64_t d = 0; d < hs; d++) {
        const vf q = *(const vf *)(qt + d * Lp + i);
        a0 += k0[d] * q;
        a1 += k1[d] * q;
        a2 += k2[d] * q;
        a3 += k3[d] * q;
        if (two) {
          const vf r = *(const vf *)(qt + d * Lp + i + W);
          b0 += k0[d] * r;
          b1 += k1[d] * r;
          b2 += k2[d] * r;
          b3 += k3[d] * r;
        }
      }
      float *row = st + j * Lp + i;
      *(vf *)row = a0 * scale;
      *(vf *)(row + Lp) = a1 * scale;
      *(vf *)(row + 2 * Lp) = a2 * scale;
      *(vf *)(row + 3 * Lp) = a3 * scale;
      if (two) {
        *(vf *)(row + W) = b0 * scale;
        *(vf *)(row + Lp + W) = b1 * scale;
        *(vf *)(row + 2 * Lp + W) = b2 * scale;
        *(vf *)(row + 3 * Lp + W) = b3 * scale;
      }
    }
  }
}

/* Softmax over the L keys of every query, W queries at a time, in place: the maximum, exp(score -
 * maximum) and their sum, j in order, then a multiplication by 1 / sum. */
static void softmax(float *st, int64_t L, int64_t Lp) {
  for (int64_t i = 0; i < Lp; i += W) {
    vf top = *(const vf *)(st + i);
    for (int64_t j = 1; j < L; j++) {
      const vf x = *(const vf *)(st + j * Lp + i);
      top = pick(x > top, x, top);
    }
    vf sum = {0};
    for (int64_t j = 0; j < L; j++) {
      vf *x = (vf *)(st + j * Lp + i);
      *x = vexp(*x - top);
      sum += *x;
    }
    const vf inverse = 1.0f / sum;
    for (int64_t j = 0; j < L; j++) *(vf *)(st + j * Lp + i) *= inverse;
  }
}

/* Query rows per call of `weighted_values`: 2R sums in flight, 8, what two FMA units of 4 cycles'
 * latency need (R = 8 was 3-5% slower on MiniLM's heads with AVX-512's 32 registers). */
#define R 4

/* Context rows i..i+R-1 (those under `rows`) from W channels of sums: row r of `a` to channels c.. */
static void write_rows(const vf a[R], int64_t i, int64_t rows, int64_t c, int64_t hs, void *out, int bf16,
                       int64_t ldo) {
  const int64_t n = hs - c < W ? hs - c : W;
  for (int64_t r = 0; r < R && i + r < rows; r++) {
    if (bf16) {
      uint16_t *y = (uint16_t *)out + (i + r) * ldo + c;
      for (int64_t d = 0; d < n; d++) y[d] = float_to_bf16(a[r][d]);
    } else if (n == W) {
      *(vfu *)((float *)out + (i + r) * ldo + c) = a[r];
    } else {
      float *y = (float *)out + (i + r) * ldo + c;
      for (int64_t d = 0; d < n; d++) y[d] = a[r][d];
    }
  }
}

/* Context rows i..i+R-1: out[i][c] = sum_j p[i][j] v[j][c], j in order (p transposed in pt; v's
 * rows `ldv` floats apart, hp channels of them read), 2 vectors of channels at a time (1 for an odd
 * last one). R divides W, so the R columns of pt read lie within its Lp. */
static void weighted_values(const float *pt, const float *v, int64_t ldv, int64_t L, int64_t Lp, int64_t hs,
                            int64_t hp, int64_t i, int64_t rows, void *out, int bf16, int64_t ldo) {
  for (int64_t c = 0; c < hp; c += 2 * W) {
    const int two = c + W < hp;
    vf a[R] = {{0}}, b[R] = {{0}};
    for (int64_t j = 0; j < L; j++) {
      const float *p = pt + j * Lp + i;
      const vf x = *(const vfu *)(v + j * ldv + c);
      for (int r = 0; r < R; r++) a[r] += p[r] * x;
      if (two) {
        const vf y = *(const vfu *)(v + j * ldv + c + W);
        for (int r = 0; r < R; r++) b[r] += p[r] * y;
      }
    }
    write_rows(a, i, rows, c, hs, out, bf16, ldo);
    if (two) write_rows(b, i, rows, c + W, hs, out, bf16, ldo);
  }
}

#if W == 16 || W == 8
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* Rows t and t + 2^k of r (bit k of t clear) trade the halves that swap bit k of the row index with
 * bit k of the lane index: after log2(W) stages, r is transposed. */
#define STAGE(k)                                                                                        \
  for (int t = 0; t < W; t++)                                                                           \
    if (!(t & (1 << k))) {                                                                              \
      const vf a = r[t], b = r[t + (1 << k)];                                                           \
      r[t] = SHUFFLE(a, b, LOWER_##k);                                                                  \
      r[t + (1 << k)] = SHUFFLE(a, b, UPPER_##k);                                                       \
    }
#if W == 16
#define LOWER_0 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define UPPER_0 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define LOWER_1 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define UPPER_1 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define LOWER_2 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define UPPER_2 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define LOWER_3 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define UPPER_3 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#else
#define LOWER_0 0, 8, 2, 10, 4, 12, 6, 14
#define UPPER_0 1, 9, 3, 11, 5, 13, 7, 15
#define LOWER_1 0, 1, 8, 9, 4, 5, 12, 13
#define UPPER_1 2, 3, 10, 11, 6, 7, 14, 15
#define LOWER_2 0, 1, 2, 3, 8, 9, 10, 11
#define UPPER_2 4, 5, 6, 7, 12, 13, 14, 15
#endif

/* A W x W block of floats, one vector a row, transposed in registers (W log2(W) two-vector
 * shuffles, where a scalar copy makes W^2 loads and W^2 stores). */
static inline void transpose_block(vf r[W]) {
  STAGE(0)
  STAGE(1)
  STAGE(2)
#if W == 16
  STAGE(3)
#endif
}

/* q's L rows (row stride ld, hs a multiple of W) transposed to qt (hs, Lp), zero past L. */
static void transpose_q(const float *q, int64_t ld, int64_t L, int64_t Lp, int64_t hs, float *qt) {
  for (int64_t i = 0; i < Lp; i += W)
    for (int64_t d = 0; d < hs; d += W) {
      vf r[W];
      for (int t = 0; t < W; t++) r[t] = i + t < L ? *(const vfu *)(q + (i + t) * ld + d) : (vf){0};
      transpose_block(r);
      for (int t = 0; t < W; t++) *(vf *)(qt + (d + t) * Lp + i) = r[t];
    }
}
#else
/* The same, element by element (SSE's 4-float vectors: the copy is a smaller share of the work). */
static void transpose_q(const float *q, int64_t ld, int64_t L, int64_t Lp, int64_t hs, float *qt) {
  for (int64_t d = 0; d < hs; d++)
    for (int64_t i = 0; i < Lp; i++) qt[d * Lp + i] = i < L ? q[i * ld + d] : 0.0f;
}
#endif

/* One head of one sequence: its L rows of qkv (row stride ld; q, k and v at 0, H and 2H, this head
 * at h * hs) -> its L rows of out (row stride ldo, at h * hs). A float32 head of whole vectors has
 * its k and v read where they lie and its q transposed (W x W in registers where vectors are 8 or
 * 16 floats); a bf16 one, or one of another size, is copied as float32 first (v padded with zeros to
 * whole vectors). */
static void head(const void *qkv, int bf16, int64_t ld, int64_t H, int64_t L, int64_t hs, float scale, void *out,
                 int64_t ldo, float *scratch) {
  const struct layout s = layout_of(L, hs);
  const int64_t Lr = s.Lr, Lp = s.Lp, hp = s.hp;
  float *qt = scratch, *st = scratch + s.st;
  const float *k, *v;
  int64_t ldk, ldv;
  if (!bf16 && hs % W == 0) {
    transpose_q((const float *)qkv, ld, L, Lp, hs, qt);
    k = (const float *)qkv + H, ldk = ld;
    v = (const float *)qkv + 2 * H, ldv = ld;
  } else {
    float *kc = scratch + s.k, *vc = scratch + s.v;
    /* q transposed: float32 read down each column (the L rows stay in L1), bf16 converted a row
     * at a time through v's row i and scattered (each the faster here). */
    for (int64_t d = 0; d < hs && !bf16; d++)
      for (int64_t i = 0; i < L; i++) qt[d * Lp + i] = ((const float *)qkv)[i * ld + d];
    for (int64_t i = 0; i < L && bf16; i++) {
      row_to_float(vc + i * hp, qkv, i * ld, hs, bf16);
      for (int64_t d = 0; d < hs; d++) qt[d * Lp + i] = vc[i * hp + d];
    }
    for (int64_t d = 0; d < hs; d++)
      for (int64_t i = L; i < Lp; i++) qt[d * Lp + i] = 0.0f;
    for (int64_t j = 0; j < L; j++) row_to_float(kc + j * hs, qkv, j * ld + H, hs, bf16);
    for (int64_t j = 0; j < L; j++) {
      row_to_float(vc + j * hp, qkv, j * ld + 2 * H, hs, bf16);
      for (int64_t c = hs; c < hp; c++) vc[j * hp + c] = 0.0f;
    }
    k = kc, ldk = hs, v = vc, ldv = hp;
  }
  scores(qt, k, ldk, st, L, Lr, Lp, hs, scale);
  softmax(st, L, Lp);
  for (int64_t i = 0; i < L; i += R) weighted_values(st, v, ldv, L, Lp, hs, hp, i, L, out, bf16, ldo);
}

/* qkv (N, 3H) rows of nseq packed sequences, sequence t at rows starts[t] .. starts[t] + lens[t]
 * (ascending for row affinity; any order is correct); float32 (bf16 = 0) or bf16 (bf16 = 1), row
 * stride ld. Writes each sequence's context to the same rows of out (N, H), row stride ldo, in
 * the same dtype; other rows are left alone. Returns 0, or -1 when no thread could allocate its
 * scratch (out is then incomplete; a thread without one takes no task, the others take its
 * range). Each thread starts on the sequences in its own rows as ATen splits the N rows
 * (tasks.h), where the layer's other ops leave them in its cache. */
int packed_attention(const void *qkv, int bf16, int64_t ld, const int64_t *starts, const int64_t *lens, int64_t nseq,
                     int64_t N, int64_t heads, int64_t hs, float scale, void *out, int64_t ldo, int threads) {
  const int64_t H = heads * hs, size = bf16 ? 2 : 4;
  int64_t max_len = 1;
  for (int64_t t = 0; t < nseq; t++) max_len = lens[t] > max_len ? lens[t] : max_len;
  const size_t bytes = (size_t)layout_of(max_len, hs).floats * sizeof(float);
  if (threads < 1) return -1;
  struct task_range ranges[threads];
  int64_t t = 0;
  for (int k = 0; k < threads; k++) {
    const int64_t first = t;
    while (t < nseq && (k == threads - 1 || starts[t] < split_start(N, threads, k + 1))) t++;
    ranges[k] = (struct task_range){.next = 0, .end = (t - first) * heads, .first = first, .rows = t - first};
  }
  int allocated = 0;
#pragma omp parallel num_threads(threads)
  {
    float *scratch = aligned_alloc(64, round_up(bytes, 64));
    if (scratch) {
#pragma omp atomic
      allocated++;
    }
    int cursor = 0, k;
    for (int64_t task; scratch && (task = next_task(ranges, threads, omp_get_thread_num(), &cursor, &k)) >= 0;) {
      const int64_t t = ranges[k].first + task / heads, h = task % heads;
      if (lens[t] > 0)
        head((const char *)qkv + (starts[t] * ld + h * hs) * size, bf16, ld, H, lens[t], hs, scale,
             (char *)out + (starts[t] * ldo + h * hs) * size, ldo, scratch);
    }
    free(scratch);
  }
  return allocated ? 0 : -1;
}
