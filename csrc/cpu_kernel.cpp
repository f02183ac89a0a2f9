// The fused CPU kernel: one pass over memory, the elements of all tensors split evenly between
// threads with at::parallel_for; the loops are written for the compiler's auto-vectoriser
// (restrict pointers, no branches), fp32, fp64 and bf16 in place; fp16 runs the same maths
// on vector registers where F16C is (cpu_half_lanes.h), elsewhere through small fp32 tiles.
// Built with -ffp-contract=off like every file that does element maths (setup.py): no FMA
// contraction, so it is bitwise equal to the emulated CUDA block body (emulated_cuda.cpp).
#include "cpu_kernel.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_elements.h"
#include "cpu_half_lanes.h"

namespace pnm {
namespace {

constexpr int64_t kCpuTile = 512;

// The loops take a local copy of the coefficients: through a reference GCC cannot rule out
// aliasing with the arrays, and does not vectorise the AdaPNM loop.
template <bool kDecoupled, typename S, typename C>
PNM_CPU_INLINE void cpu_loop_body(PnmAlgo<kDecoupled>, S* const* x, int64_t n,
                                  const Coeffs<C> coeffs, C gf) {
  S* __restrict__ p = x[0];
  const S* __restrict__ g = x[1];
  S* __restrict__ m = x[2];
  const S* __restrict__ m_other = x[3];
  for (int64_t i = 0; i < n; ++i) {
    C pi = load(p, i), mi = load(m, i);
    pnm_element<kDecoupled>(pi, load(g, i) * gf, mi, load(m_other, i), coeffs);
    store(p, i, pi);
    store(m, i, mi);
  }
}

// Arrays as restrict parameters: taken from x[] inside, GCC does not vectorise six of them.
template <bool kDecoupled, bool kAmsgrad, typename S, typename C>
PNM_CPU_INLINE void adapnm_loop(S* __restrict__ p, const S* __restrict__ g, S* __restrict__ m,
                                const S* __restrict__ m_other, S* __restrict__ v,
                                S* __restrict__ v_max, int64_t n, const Coeffs<C> coeffs,
                                C gf) {
  for (int64_t i = 0; i < n; ++i) {
    C pi = load(p, i), mi = load(m, i), vi = load(v, i);
    C vmi = kAmsgrad ? load(v_max, i) : C(0);
    adapnm_element<kDecoupled, kAmsgrad>(pi, load(g, i) * gf, mi, load(m_other, i), vi, vmi,
                                         coeffs);
    store(p, i, pi);
    store(m, i, mi);
    store(v, i, vi);
    if constexpr (kAmsgrad) store(v_max, i, vmi);
  }
}

template <bool kDecoupled, bool kAmsgrad, typename S, typename C>
PNM_CPU_INLINE void cpu_loop_body(AdaPnmAlgo<kDecoupled, kAmsgrad>, S* const* x, int64_t n,
                                  const Coeffs<C> coeffs, C gf) {
  adapnm_loop<kDecoupled, kAmsgrad>(x[0], x[1], x[2], x[3], x[4], kAmsgrad ? x[5] : nullptr, n,
                                    coeffs, gf);
}

template <typename T, class Algo>
struct CpuTensorWork {
  T* ptr[Algo::kLists];  // parity already applied: ptr[2] is this step's buffer
  Coeffs<opmath_t<T>> coeffs;
};

// One range of one tensor. fp32, fp64 and bf16 run the loop in place; fp16 in vector registers
// where F16C is (AVX2, AVX-512), its last few elements and the baseline build through fp32
// tiles.
template <typename T, class Algo, CpuIsa kIsa>
PNM_CPU_INLINE void cpu_range_body(const CpuTensorWork<T, Algo>& w, int64_t begin, int64_t end,
                                   opmath_t<T> gf) {
  constexpr int L = Algo::kLists;
  if constexpr (!std::is_same_v<T, c10::Half>) {
    T* x[L];
    for (int l = 0; l < L; ++l) x[l] = w.ptr[l] + begin;
    cpu_loop_body(Algo{}, x, end - begin, w.coeffs, gf);
  } else {
#ifdef PNM_X86_AVX2
    if constexpr (kIsa != CpuIsa::kBaseline) {
      using H = std::conditional_t<kIsa == CpuIsa::kAvx512, HalfLanes16, HalfLanes8>;
      c10::Half* x[L];
      for (int l = 0; l < L; ++l) x[l] = w.ptr[l] + begin;
      begin += half_lanes_loop<H, Algo>(x, end - begin, w.coeffs, gf);
    }
#endif
    float tile[L][kCpuTile];
    float* x[L];
    for (int l = 0; l < L; ++l) x[l] = tile[l];
    for (int64_t t0 = begin; t0 < end; t0 += kCpuTile) {
      const int64_t n = std::min(kCpuTile, end - t0);
      for (int l = 0; l < L; ++l) tile_in<kIsa>(w.ptr[l] + t0, tile[l], n);
      cpu_loop_body(Algo{}, x, n, w.coeffs, gf);
      for (int l = 0; l < L; ++l) {
        if (is_written(l)) tile_out<kIsa>(tile[l], w.ptr[l] + t0, n);
      }
    }
  }
}

// The range loop compiled three times: for the x86-64 baseline (SSE2), for AVX2 (+F16C) and
// for AVX-512 (F, BW, VL), picked at run time. AVX-512 halves the instructions per element,
// which is what bf16 and fp16 steps (conversions in and out) are bound by. No FMA (the build
// passes -ffp-contract=off; AVX-512 targets would contract otherwise): the CPU kernel stays
// bitwise equal to the emulated CUDA path, whose tests compare the two on every ISA.
template <typename T, class Algo>
void cpu_range_baseline(const CpuTensorWork<T, Algo>& w, int64_t begin, int64_t end,
                        opmath_t<T> gf) {
  cpu_range_body<T, Algo, CpuIsa::kBaseline>(w, begin, end, gf);
}

#ifdef PNM_X86_AVX2
template <typename T, class Algo>
__attribute__((target("avx2,f16c"), flatten)) void cpu_range_avx2(
    const CpuTensorWork<T, Algo>& w, int64_t begin, int64_t end, opmath_t<T> gf) {
  cpu_range_body<T, Algo, CpuIsa::kAvx2>(w, begin, end, gf);
}

template <typename T, class Algo>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c"), flatten)) void cpu_range_avx512(
    const CpuTensorWork<T, Algo>& w, int64_t begin, int64_t end, opmath_t<T> gf) {
  cpu_range_body<T, Algo, CpuIsa::kAvx512>(w, begin, end, gf);
}
#endif

CpuIsa best_cpu_isa() {
  for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2}) {
    if (cpu_supports(isa)) return isa;
  }
  return CpuIsa::kBaseline;
}

CpuIsa& active_cpu_isa() {
  static CpuIsa isa = best_cpu_isa();
  return isa;
}
template <typename T, class Algo>
void cpu_range(const CpuTensorWork<T, Algo>& w, int64_t begin, int64_t end, opmath_t<T> gf) {
#ifdef PNM_X86_AVX2
  switch (active_cpu_isa()) {
    case CpuIsa::kAvx512: return cpu_range_avx512<T, Algo>(w, begin, end, gf);
    case CpuIsa::kAvx2: return cpu_range_avx2<T, Algo>(w, begin, end, gf);
    case CpuIsa::kBaseline: break;
  }
#endif
  cpu_range_baseline<T, Algo>(w, begin, end, gf);
}

template <typename T, class Algo>
void run_cpu_fused(const StepCall& call, const StepArgs& args) {
  if (step_skipped(args.found_inf)) return;
  const int64_t n = call.size();
  const double lr = step_lr(args);
  using C = opmath_t<T>;
  const C gf = grad_factor<C>(args.hyper.maximize, args.grad_scale);
  std::vector<CpuTensorWork<T, Algo>> work(n);
  std::vector<int64_t> offsets(n + 1, 0);  // tensor i: elements [offsets[i], offsets[i + 1])
  double coeffs_step = -1.0;  // tensors mostly share a step count: compute its pow()s once
  Coeffs<C> coeffs{};
  for (int64_t i = 0; i < n; ++i) {
    // Types were checked with the call: the untyped pointers skip a check per tensor.
    const double step = *static_cast<double*>(call.steps[i].data_ptr()) + 1.0;
    for (int l = 0; l < Algo::kLists; ++l) {
      work[i].ptr[l] = static_cast<T*>(call.lists[l][i].data_ptr());
    }
    if ((static_cast<int64_t>(step) & 1) == 0) std::swap(work[i].ptr[2], work[i].ptr[3]);
    if (step != coeffs_step) {
      coeffs = make_coeffs<C>(args.hyper, lr, step, Algo::kAdaptive);
      coeffs_step = step;
    }
    work[i].coeffs = coeffs;
    offsets[i + 1] = offsets[i] + call.lists[0][i].numel();
  }
  for_each_share(offsets, n, [&](int64_t i, int64_t begin, int64_t end) {
    cpu_range(work[i], begin, end, gf);
  });
  for (int64_t i = 0; i < n; ++i) *static_cast<double*>(call.steps[i].data_ptr()) += 1.0;
}

}  // namespace

bool cpu_supports(CpuIsa isa) {
#ifdef PNM_X86_AVX2
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  switch (isa) {
    case CpuIsa::kBaseline: return true;
    case CpuIsa::kAvx2: return avx2;
    case CpuIsa::kAvx512:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  }
#endif
  return isa == CpuIsa::kBaseline;
}

CpuIsa current_cpu_isa() { return active_cpu_isa(); }

void set_active_cpu_isa(CpuIsa isa) { active_cpu_isa() = isa; }

void cpu_fused_step(const StepCall& call) {
  if (call.size() == 0) return;
  const StepArgs args = make_step_args(call);
  dispatch_step(call, [&](auto t, auto a) {
    run_cpu_fused<typename decltype(t)::type, typename decltype(a)::type>(call, args);
  });
}

}  // namespace pnm
