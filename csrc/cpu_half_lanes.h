// The fp16 side of the fused CPU kernels (included through cpu_elements.h): fp16
// widened to fp32 in vector registers (Lanes), and the fp32 tiles that take the elements the
// registers leave. Every lane and tile element computes what the scalar fp32 loop computes,
// bit for bit (docs/design.md §4).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PNM_X86_AVX2 1
#endif

#include "cpu_kernel.h"

// The CPU kernel's helpers are inlined into the range loop of each instruction set.
#define PNM_CPU_INLINE inline __attribute__((always_inline))

namespace pnm {
// Internal linkage, as for the rest of the kernel: one translation unit uses these.
namespace {

// fp16 <-> fp32 for the tiles: c10's conversions, or F16C where the CPU has it.
PNM_CPU_INLINE void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

PNM_CPU_INLINE void from_float(const float* src, c10::Half* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

#ifdef PNM_X86_AVX2
// fp16 with the F16C instructions (every AVX2 CPU has them); IEEE round to nearest even, as
// c10::Half. Only the AVX2 build of the range loop calls these.
__attribute__((target("avx2,f16c"))) inline void to_float_f16c(const c10::Half* src, float* dst,
                                                                int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

__attribute__((target("avx2,f16c"))) inline void from_float_f16c(const float* src,
                                                                  c10::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

// The same, 16 at a time (AVX-512F has the 512-bit forms of both conversions).
__attribute__((target("avx512f,avx2,f16c"))) inline void to_float_avx512(const c10::Half* src,
                                                                          float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
  }
  to_float_f16c(src + i, dst + i, n - i);
}

__attribute__((target("avx512f,avx2,f16c"))) inline void from_float_avx512(const float* src,
                                                                            c10::Half* dst,
                                                                            int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
  }
  from_float_f16c(src + i, dst + i, n - i);
}
#endif

#ifdef PNM_X86_AVX2
// fp16 in registers: F16C widens 8 (AVX2) or 16 (AVX-512) elements at once and the element
// maths of pnm_math.h runs on them as GCC vector types, whose + * / act lane by lane with
// IEEE rounding (no FMA: -ffp-contract=off; nan_max and the square root below), so every
// lane computes what the scalar loop computes. This spares the fp32 tiles' store and reload
// of every array, in and out, which bound the fp16 step (on the transformer set AdaPNM went
// from 0.8 to 1.05 of torch's fused fp16 GB/s: docs/performance.md).
// (Vector types of their own: __m256/__m512 carry may_alias, which template arguments drop.)
typedef float F32x8 __attribute__((vector_size(32)));
typedef float F32x16 __attribute__((vector_size(64)));
template <class V>
struct Lanes {
  V v;
};
template <class V>
PNM_CPU_INLINE Lanes<V> operator+(Lanes<V> a, Lanes<V> b) { return {a.v + b.v}; }
template <class V>
PNM_CPU_INLINE Lanes<V> operator*(Lanes<V> a, Lanes<V> b) { return {a.v * b.v}; }
template <class V>
PNM_CPU_INLINE Lanes<V> operator/(Lanes<V> a, Lanes<V> b) { return {a.v / b.v}; }
template <class V>
PNM_CPU_INLINE Lanes<V> splat(float x) {
  Lanes<V> out;
  for (size_t i = 0; i < sizeof(V) / sizeof(float); ++i) out.v[i] = x;
  return out;
}

// The F16C conversions and the square root. Not always_inline: GCC refuses to force a
// target's instructions into the ISA-neutral templates above them; cpu_range_avx2/_avx512
// are `flatten`, which inlines them there, in a function of their target.
struct HalfLanes8 {
  using V = Lanes<F32x8>;
  static constexpr int kLanes = 8;
  __attribute__((target("avx2,f16c"))) static inline V load(const c10::Half* src) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)))};
  }
  __attribute__((target("avx2,f16c"))) static inline void store(c10::Half* dst, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                     _mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT));
  }
};
__attribute__((target("avx2,f16c"))) inline Lanes<F32x8> square_root(Lanes<F32x8> x) {
  return {_mm256_sqrt_ps(x.v)};
}
// pnm_math.h's nan_max lane by lane (found by argument-dependent lookup): a > b ? a : b,
// then a NaN b, then a NaN a wins. (Written with GCC's vector ?: instead, the 16-lane form
// compiled to one scalar compare per lane.)
__attribute__((target("avx2,f16c"))) inline Lanes<F32x8> nan_max(Lanes<F32x8> a,
                                                                   Lanes<F32x8> b) {
  __m256 r = _mm256_blendv_ps(b.v, a.v, _mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ));
  r = _mm256_blendv_ps(r, b.v, _mm256_cmp_ps(b.v, b.v, _CMP_UNORD_Q));
  return {_mm256_blendv_ps(r, a.v, _mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q))};
}

struct HalfLanes16 {
  using V = Lanes<F32x16>;
  static constexpr int kLanes = 16;
  __attribute__((target("avx512f,avx2,f16c"))) static inline V load(const c10::Half* src) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)))};
  }
  __attribute__((target("avx512f,avx2,f16c"))) static inline void store(c10::Half* dst, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT));
  }
};
__attribute__((target("avx512f,avx2,f16c"))) inline Lanes<F32x16> square_root(Lanes<F32x16> x) {
  return {_mm512_sqrt_ps(x.v)};
}
__attribute__((target("avx512f,avx2,f16c"))) inline Lanes<F32x16> nan_max(Lanes<F32x16> a,
                                                                           Lanes<F32x16> b) {
  __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ), b.v, a.v);
  r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(b.v, b.v, _CMP_UNORD_Q), r, b.v);
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), r, a.v)};
}

// One tensor's coefficients in every lane.
template <class H>
PNM_CPU_INLINE Coeffs<typename H::V> splat_coeffs(const Coeffs<float>& c) {
  using V = decltype(H::V::v);
  Coeffs<typename H::V> out;
  out.decay = splat<V>(c.decay);
  out.l2 = splat<V>(c.l2);
  out.b1_sq = splat<V>(c.b1_sq);
  out.one_minus_b1_sq = splat<V>(c.one_minus_b1_sq);
  out.b2 = splat<V>(c.b2);
  out.one_minus_b2 = splat<V>(c.one_minus_b2);
  out.pos_coef = splat<V>(c.pos_coef);
  out.neg_coef = splat<V>(c.neg_coef);
  out.inv_noise_norm = splat<V>(c.inv_noise_norm);
  out.neg_step_size = splat<V>(c.neg_step_size);
  out.bc2_sqrt = splat<V>(c.bc2_sqrt);
  out.eps = splat<V>(c.eps);
  return out;
}

// The whole vectors of an fp16 range, in registers; returns how many elements it did (the
// rest, fewer than kLanes, go through a tile).
template <class H, class Algo>
PNM_CPU_INLINE int64_t half_lanes_loop(c10::Half* const* x, int64_t n,
                                       const Coeffs<float>& coeffs, float gf) {
  using V = typename H::V;
  constexpr int L = Algo::kLists;
  const Coeffs<V> c = splat_coeffs<H>(coeffs);
  const V grad_factor = splat<decltype(V::v)>(gf);
  int64_t i = 0;
  for (; i + H::kLanes <= n; i += H::kLanes) {
    V e[L];
    for (int l = 0; l < L; ++l) e[l] = H::load(x[l] + i);
    e[1] = e[1] * grad_factor;
    Algo::apply(e, c);
    for (int l = 0; l < L; ++l) {
      if (is_written(l)) H::store(x[l] + i, e[l]);
    }
  }
  return i;
}
#endif

// The tiles' conversions for the build at hand: 512-bit or 256-bit F16C, c10's otherwise.
template <CpuIsa kIsa>
PNM_CPU_INLINE void tile_in(const c10::Half* src, float* dst, int64_t n) {
#ifdef PNM_X86_AVX2
  if constexpr (kIsa == CpuIsa::kAvx512) return to_float_avx512(src, dst, n);
  if constexpr (kIsa == CpuIsa::kAvx2) return to_float_f16c(src, dst, n);
#endif
  to_float(src, dst, n);
}

template <CpuIsa kIsa>
PNM_CPU_INLINE void tile_out(const float* src, c10::Half* dst, int64_t n) {
#ifdef PNM_X86_AVX2
  if constexpr (kIsa == CpuIsa::kAvx512) return from_float_avx512(src, dst, n);
  if constexpr (kIsa == CpuIsa::kAvx2) return from_float_f16c(src, dst, n);
#endif
  from_float(src, dst, n);
}

}  // namespace
}  // namespace pnm
