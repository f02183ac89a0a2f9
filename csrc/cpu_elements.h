// Element access of the fused CPU kernels (cpu_kernel.cpp, cpu_state_kernel.cpp,
// cpu_int8_kernel.cpp): each storage type loaded into and stored from its arithmetic type,
// written so that GCC vectorises the loops that use them.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_half_lanes.h"
#include "stochastic_rounding.h"

namespace pnm {
// Internal linkage, as for the rest of each kernel.
namespace {

// std::bit_cast, which the C++17 that older torch builds extensions with lacks.
template <class To, class From>
PNM_CPU_INLINE To bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}

// Element access in the arithmetic type for the storage types the loops run on directly:
// fp32 and fp64 as they are, bf16 in fp32 (a shift in, round-to-nearest-even out), all of
// which the compiler vectorises. fp16 does not: see cpu_range_body.
PNM_CPU_INLINE float load(const float* a, int64_t i) { return a[i]; }
PNM_CPU_INLINE void store(float* a, int64_t i, float v) { a[i] = v; }
PNM_CPU_INLINE double load(const double* a, int64_t i) { return a[i]; }
PNM_CPU_INLINE void store(double* a, int64_t i, double v) { a[i] = v; }

PNM_CPU_INLINE float load(const c10::BFloat16* a, int64_t i) {
  return bit_cast<float>(static_cast<uint32_t>(a[i].x) << 16);
}

// Rounds to nearest even and makes NaN 0x7FC0: bitwise what c10::BFloat16(float) gives.
PNM_CPU_INLINE void store(c10::BFloat16* a, int64_t i, float v) {
  const uint32_t u = bit_cast<uint32_t>(v);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  a[i].x = v != v ? static_cast<uint16_t>(0x7FC0) : rounded;
}

// fp16 one element at a time (c10's conversion, round to nearest even): the state kernel's
// 16-bit parameters; the fused kernel's fp16 path has its own lanes (cpu_half_lanes.h).
PNM_CPU_INLINE float load(const c10::Half* a, int64_t i) { return static_cast<float>(a[i]); }
PNM_CPU_INLINE void store(c10::Half* a, int64_t i, float v) { a[i] = static_cast<c10::Half>(v); }

// For the kernels of state in a dtype of its own (cpu_state_kernel.cpp, cpu_int8_kernel.cpp).
// A parameter element stored in its dtype: to nearest, or (a bfloat16 parameter with
// bf16_stochastic_round) stochastically with the low 16 bits of mix32(hash).
template <typename T>
PNM_CPU_INLINE void store_param(T* a, int64_t i, float v, bool stochastic, uint32_t hash) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (stochastic) {
      a[i].x = bf16_bits_stochastic(v, bit_cast<uint32_t>(v), mix32(hash) & 0xFFFFu);
      return;
    }
  }
  store(a, i, v);
}

constexpr int64_t kCpuChunk = 1 << 15;  // the fewest elements worth a thread of their own

// The elements of n tensors (tensor i: [offsets[i], offsets[i + 1])) as one run, split between
// threads by element count (a split by tensor or by chunk count leaves one thread with more
// work when sizes differ), each thread's share at least kCpuChunk: a step over many tiny
// tensors stays on the calling thread instead of paying to wake the others for microseconds
// of work. Calls range(i, begin, end) for each tensor's part of a share.
template <class Range>
void for_each_share(const std::vector<int64_t>& offsets, int64_t n, Range&& range) {
  at::parallel_for(0, offsets[n], kCpuChunk, [&](int64_t lo, int64_t hi) {
    // The first tensor with elements at or after lo (empty tensors share its offset).
    int64_t i = std::upper_bound(offsets.begin(), offsets.end(), lo) - offsets.begin() - 1;
    for (; i < n && offsets[i] < hi; ++i) {
      const int64_t begin = std::max(lo, offsets[i]) - offsets[i];
      const int64_t end = std::min(hi, offsets[i + 1]) - offsets[i];
      if (begin < end) range(i, begin, end);
    }
  });
}

}  // namespace
}  // namespace pnm
