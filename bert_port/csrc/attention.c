/* Self-attention of packed sequences on the CPU (bert_port/attention.py, `packed_attention`):
 * every sequence and every head of a batch in one call, one parallel region, where the PyTorch
 * path makes three small calls per sequence (scores, softmax, weighted values) and, in bf16, a
 * float32 copy of the whole (N, 3H) input and a cast of the output.
 *
 * Built by bert_port/native.py (cc -O3 -march=native -ffp-contract=fast -fopenmp: fused
 * multiply-adds, unlike int8_rows.c) and called through ctypes. Inputs are float32 or bf16, the
 * sums and the softmax float32, as on the PyTorch path, whose bits it does not try to match (its
 * own order of summation; the values agree within the fp32 tolerance,
 * tests/test_native_attention.py). One thread computes a (sequence, head) pair from start to end,
 * in an order fixed by the sequence's length and the head size alone: its bits never depend on
 * the other sequences of the batch, nor on the thread count. Vectors of 16 floats (vector.h). */
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

/* One thread's scratch for a sequence of L tokens, in floats: q transposed (hs, Lp) at 0, k (Lr, hs)
 * at k, v (L, hp) at v and the scores transposed (Lr, Lp) at st, each a multiple of W (aligned);
 * `floats` in all, which grows with L (a scratch sized for the longest sequence fits every one). */
struct layout {
  int64_t Lr, Lp, hp, k, v, st, floats;
};

static struct layout layout_of(int64_t L, int64_t hs) {
  struct layout s = {.Lr = round_up(L, 4), .Lp = round_up(L, W), .hp = round_up(hs, W)};
  s.k = hs * s.Lp;
  s.v = s.k + round_up(s.Lr * hs, W);
  s.st = s.v + L * s.hp;
  s.floats = s.st + s.Lr * s.Lp;
  return s;
}

/* The scores transposed, key j by query i: st[j][i] = scale * sum_d k[j][d] q[i][d], d in order.
 * Queries lie along the vector lanes, so that the softmax over the keys needs no sum across lanes.
 * 4 keys by 2 vectors of queries at a time (by 1 for an odd last vector): 8 independent sums in
 * flight, what two FMA units of 4 cycles' latency need. */
static void scores(const float *qt, const float *k, float *st, int64_t Lr, int64_t Lp, int64_t hs, float scale) {
  for (int64_t j = 0; j < Lr; j += 4) {
    const float *k0 = k + j * hs, *k1 = k0 + hs, *k2 = k1 + hs, *k3 = k2 + hs;
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

/* Context rows i..i+3 (4 rows up to `rows`) from W channels of sums: row r of `a` to channels c.. */
static void write_rows(const vf a[4], int64_t i, int64_t rows, int64_t c, int64_t hs, void *out, int bf16,
                       int64_t ldo) {
  const int64_t n = hs - c < W ? hs - c : W;
  for (int64_t r = 0; r < 4 && i + r < rows; r++) {
    if (bf16) {
      uint16_t *y = (uint16_t *)out + (i + r) * ldo + c;
      for (int64_t d = 0; d < n; d++) y[d] = float_to_bf16(a[r][d]);
    } else {
      float *y = (float *)out + (i + r) * ldo + c;
      for (int64_t d = 0; d < n; d++) y[d] = a[r][d];
    }
  }
}

/* Context rows i..i+3: out[i][c] = sum_j p[i][j] v[j][c], j in order (p transposed in pt), 2
 * vectors of channels at a time (1 for an odd last one): 8 independent sums in flight. */
static void weighted_values(const float *pt, const float *v, int64_t L, int64_t Lp, int64_t hs, int64_t hp, int64_t i,
                            int64_t rows, void *out, int bf16, int64_t ldo) {
  for (int64_t c = 0; c < hp; c += 2 * W) {
    const int two = c + W < hp;
    vf a[4] = {{0}, {0}, {0}, {0}}, b[4] = {{0}, {0}, {0}, {0}};
    for (int64_t j = 0; j < L; j++) {
      const float *p = pt + j * Lp + i;
      const vf x = *(const vf *)(v + j * hp + c);
      a[0] += p[0] * x;
      a[1] += p[1] * x;
      a[2] += p[2] * x;
      a[3] += p[3] * x;
      if (two) {
        const vf y = *(const vf *)(v + j * hp + c + W);
        b[0] += p[0] * y;
        b[1] += p[1] * y;
        b[2] += p[2] * y;
        b[3] += p[3] * y;
      }
    }
    write_rows(a, i, rows, c, hs, out, bf16, ldo);
    if (two) write_rows(b, i, rows, c + W, hs, out, bf16, ldo);
  }
}

/* One head of one sequence: its L rows of qkv (row stride ld; q, k and v at 0, H and 2H, this head
 * at h * hs) -> its L rows of out (row stride ldo, at h * hs). */
static void head(const void *qkv, int bf16, int64_t ld, int64_t H, int64_t L, int64_t hs, float scale, void *out,
                 int64_t ldo, float *scratch) {
  const struct layout s = layout_of(L, hs);
  const int64_t Lr = s.Lr, Lp = s.Lp, hp = s.hp;
  float *qt = scratch, *k = scratch + s.k, *v = scratch + s.v, *st = scratch + s.st;
  /* q transposed: float32 read down each column (the L rows stay in L1), bf16 converted a row at
   * a time through v's row i and scattered (each the faster here). */
  for (int64_t d = 0; d < hs && !bf16; d++)
    for (int64_t i = 0; i < L; i++) qt[d * Lp + i] = ((const float *)qkv)[i * ld + d];
  for (int64_t i = 0; i < L && bf16; i++) {
    row_to_float(v + i * hp, qkv, i * ld, hs, bf16);
    for (int64_t d = 0; d < hs; d++) qt[d * Lp + i] = v[i * hp + d];
  }
  for (int64_t d = 0; d < hs; d++)
    for (int64_t i = L; i < Lp; i++) qt[d * Lp + i] = 0.0f;
  for (int64_t j = 0; j < L; j++) row_to_float(k + j * hs, qkv, j * ld + H, hs, bf16);
  memset(k + L * hs, 0, (Lr - L) * hs * sizeof(float));
  for (int64_t j = 0; j < L; j++) {
    row_to_float(v + j * hp, qkv, j * ld + 2 * H, hs, bf16);
    for (int64_t c = hs; c < hp; c++) v[j * hp + c] = 0.0f;
  }
  scores(qt, k, st, Lr, Lp, hs, scale);
  softmax(st, L, Lp);
  for (int64_t i = 0; i < L; i += 4) weighted_values(st, v, L, Lp, hs, hp, i, L, out, bf16, ldo);
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
