/* AMX's tile registers and the five tile instructions amx_linear.c uses, emulated in plain C for
 * the variants built without AMX: the kernel's own code (blocking, weight layout, epilogue, work
 * sharing) then runs and is tested on any CPU (tests/test_amx_linear.py), against the same float32
 * maths the hardware is tested against.
 *
 * TDPBF16PS as Intel's SDM writes it: for each row m and column n of the float32 tile, over the
 * pairs k in order, acc += a[m][2k] b[k][2n], then acc += a[m][2k+1] b[k][2n+1] (each product of two
 * bf16 values exact in float32, each sum rounded to nearest even), subnormal inputs read as zero
 * and subnormal results flushed to zero. Each thread has its own 8 tiles of 16 rows of 64 bytes. */
#ifndef BERT_PORT_AMX_EMULATED_H
#define BERT_PORT_AMX_EMULATED_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector.h"

static __thread uint8_t emulated_tiles[8][16][64] __attribute__((aligned(64)));

static inline float flush_subnormal(float v) { return fabsf(v) < 1.17549435e-38f ? copysignf(0.0f, v) : v; }

static inline void tile_load(int t, const void *base, int64_t stride) {
  for (int row = 0; row < 16; row++) memcpy(emulated_tiles[t][row], (const char *)base + row * stride, 64);
}

static inline void tile_store(int t, void *base, int64_t stride) {
  for (int row = 0; row < 16; row++) memcpy((char *)base + row * stride, emulated_tiles[t][row], 64);
}

static inline void tile_dpbf16ps(int c, int a, int b) {
  for (int m = 0; m < 16; m++) {
    float *acc = (float *)emulated_tiles[c][m];
    const uint16_t *x = (const uint16_t *)emulated_tiles[a][m];
    for (int k = 0; k < 16; k++) {
      const uint16_t *w = (const uint16_t *)emulated_tiles[b][k];
      const float x0 = flush_subnormal(bf16_to_float(x[2 * k])), x1 = flush_subnormal(bf16_to_float(x[2 * k + 1]));
      for (int n = 0; n < 16; n++) {
        const float p0 = x0 * flush_subnormal(bf16_to_float(w[2 * n]));
        const float p1 = x1 * flush_subnormal(bf16_to_float(w[2 * n + 1]));
        acc[n] = flush_subnormal(acc[n] + p0);
        acc[n] = flush_subnormal(acc[n] + p1);
      }
    }
  }
}

#define _tile_zero(t) memset(emulated_tiles[t], 0, sizeof emulated_tiles[t])
#define _tile_loadd(t, base, stride) tile_load(t, base, stride)
#define _tile_stored(t, base, stride) tile_store(t, base, stride)
#define _tile_dpbf16ps(c, a, b) tile_dpbf16ps(c, a, b)
#define _tile_release() ((void)0)
static inline void configure_tiles(void) {}

#endif
