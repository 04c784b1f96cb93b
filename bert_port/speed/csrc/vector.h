/* What the C kernels share: vectors of W floats (GCC vector extensions rather than intrinsics), bf16
 * conversions and exp.
 *
 * W is the width of the instruction set the variant is built for (setup.py): 16 floats with AVX-512, 8 with
 * AVX, 4 with SSE. A vector wider than the registers is not split into registers: GCC keeps it on
 * the stack, and a scalar broadcast into it goes through memory, store-forwarding stalls on
 * every multiply-add (csrc/attention.c with 16-float vectors built for AVX2 ran 24x slower than
 * for AVX-512 on the same Xeon). The kernels' sums run in an order that does not depend on W. */
#ifndef BERT_PORT_VECTOR_H
#define BERT_PORT_VECTOR_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define W 16 /* floats per vector */
#elif defined(__AVX__)
#define W 8
#else
#define W 4
#endif
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
typedef float vfu __attribute__((vector_size(W * sizeof(float)), aligned(sizeof(float)))); /* unaligned */
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));
typedef uint16_t vhu __attribute__((vector_size(W * sizeof(uint16_t)), aligned(sizeof(uint16_t))));

static inline float bf16_to_float(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Round to nearest even, as torch's float -> bf16 cast (c10::round_to_nearest_even). */
static inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if (f != f) return 0x7fc0;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline vf pick(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }

/* W bf16 values (unaligned) as floats. */
static inline vf bf16_to_vf(const uint16_t *h) {
  return (vf)(__builtin_convertvector(*(const vhu *)h, vu) << 16);
}

/* W floats to bf16 (unaligned), rounded as float_to_bf16. */
static inline void vf_to_bf16(vf x, uint16_t *h) {
  const vu u = (vu)x;
  vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  rounded = (vu)pick(x != x, (vf)((vu){0} + 0x7fc0u), (vf)rounded);
  *(vhu *)h = __builtin_convertvector(rounded, vh);
}

/* exp(x) for x <= 0 (scores minus their row's maximum): Cephes' expf, a degree-7 polynomial on
 * x - n ln 2 scaled by 2^n; relative error at most 8.6e-8 on [-80, 0] against double exp. Below
 * -80 it returns 0 (e^-80 is 1.8e-35, which a softmax's sum of at least 1 cannot see), so that
 * no subnormal, many times slower to compute with, enters the sums. NaN stays NaN. */
static inline vf vexp(vf x) {
  const vf lowest = (vf){0} - 80.0f;
  const vi zero = x < lowest;
  x = pick(zero, lowest, x);
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x / ln 2) */
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = (vf){0} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi two_n = (__builtin_convertvector(n, vi) + 127) << 23;
  return pick(zero, (vf){0}, p * (vf)two_n);
}

#endif
