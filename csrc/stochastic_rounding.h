// Compressed state's rounding (docs/design.md §7; the ground truth is
// pnm_kernels/rounding.py): counter-based random bits and stochastic rounding of float to
// bfloat16, the same bits on every path. Host and device alike.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "pnm_math.h"

namespace pnm {

// "lowbias32" (C. Wellons' hash-prospector): a bijection of uint32 that mixes every bit.
PNM_HOST_DEVICE uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0xD35A2D97u;
  x ^= x >> 15;
  return x;
}

// The key of one parameter at step t, for the elements whose index in the whole parameter
// has these high 32 bits: one per tensor a step (and per 2^32 elements).
PNM_HOST_DEVICE uint32_t rounding_key(uint32_t seed, uint32_t step, uint32_t index_hi) {
  uint32_t key = mix32(index_hi + 0x9E3779B9u);
  key = mix32(key ^ step);
  return mix32(key ^ seed);
}

// The element's hash: its high 16 bits round the momentum buffer a step writes, its low 16
// the second moment and its maximum (pnm_kernels/rounding.py, HASH_SHIFT).
PNM_HOST_DEVICE uint32_t element_hash(uint32_t key, uint32_t index_lo) {
  return mix32(index_lo ^ key);
}

// A float's bit pattern (a register move on the GPU; memcpy through memory made ptxas spill).
PNM_HOST_DEVICE uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t u;
  memcpy(&u, &v, sizeof(u));
  return u;
#endif
}

// The float of a bit pattern.
PNM_HOST_DEVICE float float_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float v;
  memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

// v's bits rounded to bfloat16 with 16 random bits (in the low half of `bits`): up with
// probability equal to the fraction cut off. An infinity stays itself (its mantissa is
// zero: no carry); NaN becomes 0x7FC0, as c10 makes it.
PNM_HOST_DEVICE uint16_t bf16_bits_stochastic(float v, uint32_t u, uint32_t bits) {
  const auto rounded = static_cast<uint16_t>((u + bits) >> 16);
  return v != v ? static_cast<uint16_t>(0x7FC0) : rounded;
}

// A state buffer's element stored in its dtype: bfloat16 with 16 random bits (the low half of
// `bits`), float32 as it is. The fused CPU kernel and the CUDA block body both store so.
template <typename S>
PNM_HOST_DEVICE void store_buffer(S* a, int64_t i, float v, uint32_t bits) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    a[i].x = bf16_bits_stochastic(v, float_bits(v), bits);
  } else {
    a[i] = v;
  }
}

}  // namespace pnm
