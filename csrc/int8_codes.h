// int8 state's codes, element by element (docs/design.md §8; the ground truth is
// pnm_kernels/quantization.py): the map from a code to its value and the stochastic rounding
// of a value to a code. Host and device alike: the fused CPU kernel (cpu_int8_kernel.cpp),
// the CUDA block body (int8_block.h) and its CPU emulation all call these, so a code is the
// same wherever it was written.
#pragma once

#include <cstdint>
#include <type_traits>

#include "pnm_math.h"
#include "stochastic_rounding.h"

namespace pnm {

// A product never contracted with a following addition into an FMA (nvcc contracts by
// default): the rounding decision compares it, and must see the same float everywhere.
PNM_HOST_DEVICE float product_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;  // host code is built with -ffp-contract=off
#endif
}

// A buffer's map: momenta in signed codes (int8, up to 127, values (c/127)^2 of the scale),
// second moments in unsigned ones (uint8, up to 255, values (c/255)^4).
template <bool kSigned>
struct CodeMap {
  using Code = std::conditional_t<kSigned, int8_t, uint8_t>;
  static constexpr float kMax = kSigned ? 127.0f : 255.0f;
  static constexpr int kPower = kSigned ? 2 : 4;
  static constexpr float kInverseMax = static_cast<float>(1.0 / (kSigned ? 127.0 : 255.0));

  // (code / kMax)^kPower, multiplied out as the reference does.
  static PNM_HOST_DEVICE float magnitude(float code) {
    float t = product_rn(code, kInverseMax);
    t = product_rn(t, t);
    return kPower == 4 ? product_rn(t, t) : t;
  }

  static PNM_HOST_DEVICE float decode(int code, float scale) {
    const float m = product_rn(magnitude(static_cast<float>(code < 0 ? -code : code)), scale);
    return code < 0 ? -m : m;
  }

  // What a value contributes to its block's scale: the bits of its magnitude, whose order is
  // that of non-negative floats (NaN and inf above every finite value); for unsigned codes a
  // negative value (not -0.0) counts as NaN. The scale is the block's largest: block_scale.
  static PNM_HOST_DEVICE uint32_t scale_bits(float x) {
    const uint32_t u = float_bits(x);
    const uint32_t negative = !kSigned && u > 0x80000000u ? 0xFFFFFFFFu : 0u;
    return (u & 0x7FFFFFFFu) | negative;  // no branch: the CPU kernel's reduction vectorises
  }

  // The scale of a block from the largest of its values' scale_bits: NaN where one was not
  // finite (or, unsigned, negative).
  static PNM_HOST_DEVICE float block_scale(uint32_t largest) {
    return largest < 0x7F800000u ? float_from_bits(largest) : float_from_bits(0x7FC00000u);
  }

  // What a block's values and scale are multiplied by before the division (exact): 2^24
  // where the scale (from the largest scale_bits) is subnormal, whose inverse would overflow.
  static PNM_HOST_DEVICE float lift(uint32_t largest) {
    return largest < 0x00800000u ? 16777216.0f : 1.0f;
  }

  // The inverse of a block's scale, lifted: 1 / (scale * lift).
  static PNM_HOST_DEVICE float lifted_inverse(float scale, float lift) {
    return 1.0f / product_rn(scale, lift);
  }

  // x's code in a block of this scale (`inverse` = lifted_inverse(scale, lift)) with 16 random
  // bits: up with probability (a - below) / (above - below), compared without the division.
  // No branch on the value: the CPU kernel's loop over a block vectorises.
  static PNM_HOST_DEVICE int32_t encode(float x, float lift, float inverse, uint32_t bits) {
    // NaN where the scale is 0 or NaN: code 0.
    const float a = product_rn(product_rn(fabsf(x), lift), inverse);
    float root = sqrtf(a);
    if (kPower == 4) root = sqrtf(root);
    float low = floorf(product_rn(root, kMax));
    low = low >= 0.0f ? low : 0.0f;  // and NaN to 0
    low = low < kMax - 1.0f ? low : kMax - 1.0f;
    const float below = magnitude(low), above = magnitude(low + 1.0f);
    const float u = product_rn(static_cast<float>(static_cast<int32_t>(bits)), 1.0f / 65536.0f);
    const float gap = above - below, excess = a - below;
    const int32_t code = static_cast<int32_t>(low + (product_rn(u, gap) < excess ? 1.0f : 0.0f));
    return x < 0.0f ? -code : code;
  }
};

using SignedCodes = CodeMap<true>;
using UnsignedCodes = CodeMap<false>;

}  // namespace pnm
