// Compressed state's rounding (docs/design.md §7; the ground truth is
// pnm_kernels/rounding.py): counter-based random bits and stochastic rounding of float to
// bfloat16, the same bits on every path. Host and device alike.
#pragma once

#include <cstdint>

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

// The key of one buffer of one parameter at step t, for the elements whose index in the
// whole parameter has these high 32 bits: one per tensor a step (and per 2^32 elements).
PNM_HOST_DEVICE uint32_t rounding_key(uint32_t seed, uint32_t step, uint32_t slot,
                                      uint32_t index_hi) {
  uint32_t key = mix32(slot + 4u * index_hi + 0x9E3779B9u);
  key = mix32(key ^ step);
  return mix32(key ^ seed);
}

// The 16 random bits of the element whose index has these low 32 bits.
PNM_HOST_DEVICE uint32_t random_bits(uint32_t key, uint32_t index_lo) {
  return mix32(index_lo ^ key) >> 16;
}

// v's bit pattern rounded to bfloat16 with the random bits: up with probability equal to
// the fraction cut off. Infinities and NaN round to nearest (NaN to 0x7FC0, as c10 does).
PNM_HOST_DEVICE uint16_t bf16_bits_stochastic(uint32_t u, uint32_t bits) {
  const bool finite = (u & 0x7F800000u) != 0x7F800000u;
  const bool nan = !finite && (u & 0x007FFFFFu) != 0;
  const uint16_t rounded = static_cast<uint16_t>((u + bits) >> 16);
  return finite ? rounded : (nan ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(u >> 16));
}

}  // namespace pnm
