// The fused CPU kernel for state kept in a dtype of its own (docs/design.md §7): bfloat16
// buffers written with stochastic rounding, or float32 buffers beside 16-bit parameters.
// One pass, as cpu_kernel.cpp: the elements of all tensors split between threads, the loops
// written for the auto-vectoriser; the element maths is pnm_math.h's, in float32, and each
// buffer this step changes is stored with the random bits of stochastic_rounding.h. Built
// with -ffp-contract=off (setup.py): bitwise pnm_kernels/reference.py's step.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_elements.h"
#include "cpu_kernel.h"
#include "stochastic_rounding.h"

namespace pnm {
namespace {

// Each element's hash, only where something rounds with it (float32 state of parameters
// rounded to nearest does not). A loop-invariant test: GCC unswitches the loop on it.
template <typename S>
PNM_CPU_INLINE uint32_t hash_for(uint32_t key, uint32_t index_lo, bool param_stochastic) {
  if (std::is_same_v<S, c10::BFloat16> || param_stochastic) return element_hash(key, index_lo);
  return 0;
}

// One tensor of one step: its lists (parity applied: buf[0] is this step's momentum buffer),
// coefficients and what picks its random bits.
template <typename T, typename S>
struct StateWork {
  T* param;
  const T* grad;
  S* buf[4];  // m, m_other, v, v_max
  Coeffs<float> coeffs;
  int64_t offset;  // elements of the whole parameter before this tensor (a shard)
  uint32_t seed, step;
  bool param_stochastic;  // a bfloat16 parameter written stochastically
};

// The element index's low 32 bits run as a uint32 counter beside i: derived from the int64
// i, GCC widened every lane to 64 bits and narrowed it back.
template <bool kDecoupled, typename T, typename S>
PNM_CPU_INLINE void pnm_state_loop(T* __restrict__ p, const T* __restrict__ g,
                                   S* __restrict__ m, const S* __restrict__ m_other, int64_t n,
                                   const Coeffs<float> coeffs, float gf, uint32_t key,
                                   uint32_t index_lo, bool param_stochastic) {
  uint32_t lo = index_lo;
  for (int64_t i = 0; i < n; ++i, ++lo) {
    float pi = load(p, i), mi = load(m, i);
    pnm_element<kDecoupled>(pi, load(g, i) * gf, mi, load(m_other, i), coeffs);
    const uint32_t h = hash_for<S>(key, lo, param_stochastic);
    store_param(p, i, pi, param_stochastic, h);
    store_buffer(m, i, mi, h >> 16);
  }
}

template <bool kDecoupled, bool kAmsgrad, typename T, typename S>
PNM_CPU_INLINE void adapnm_state_loop(T* __restrict__ p, const T* __restrict__ g,
                                      S* __restrict__ m, const S* __restrict__ m_other,
                                      S* __restrict__ v, S* __restrict__ v_max, int64_t n,
                                      const Coeffs<float> coeffs, float gf, uint32_t key,
                                      uint32_t index_lo, bool param_stochastic) {
  uint32_t lo = index_lo;
  for (int64_t i = 0; i < n; ++i, ++lo) {
    float pi = load(p, i), mi = load(m, i), vi = load(v, i);
    float vmi = kAmsgrad ? load(v_max, i) : 0.0f;
    adapnm_element<kDecoupled, kAmsgrad>(pi, load(g, i) * gf, mi, load(m_other, i), vi, vmi,
                                         coeffs);
    const uint32_t h = hash_for<S>(key, lo, param_stochastic);
    store_param(p, i, pi, param_stochastic, h);
    store_buffer(m, i, mi, h >> 16);
    store_buffer(v, i, vi, h & 0xFFFFu);
    if constexpr (kAmsgrad) store_buffer(v_max, i, vmi, h & 0xFFFFu);
  }
}

// Elements [begin, end) of one tensor, whose indices in the whole parameter share their
// high 32 bits (the caller splits ranges there).
template <typename T, typename S, class Algo>
PNM_CPU_INLINE void state_range_body(const StateWork<T, S>& w, int64_t begin, int64_t end,
                                     float gf) {
  const uint64_t first = static_cast<uint64_t>(w.offset + begin);
  const auto hi = static_cast<uint32_t>(first >> 32);
  const auto lo = static_cast<uint32_t>(first);
  const uint32_t key = rounding_key(w.seed, w.step, hi);
  const int64_t n = end - begin;
  if constexpr (!Algo::kAdaptive) {
    pnm_state_loop<Algo::kDecoupled>(w.param + begin, w.grad + begin, w.buf[0] + begin,
                                     w.buf[1] + begin, n, w.coeffs, gf, key, lo,
                                     w.param_stochastic);
  } else {
    adapnm_state_loop<Algo::kDecoupled, Algo::kAmsgrad>(
        w.param + begin, w.grad + begin, w.buf[0] + begin, w.buf[1] + begin, w.buf[2] + begin,
        Algo::kAmsgrad ? w.buf[3] + begin : nullptr, n, w.coeffs, gf, key, lo,
        w.param_stochastic);
  }
}

// The range loop for the x86-64 baseline, AVX2 and AVX-512, picked at run time as in
// cpu_kernel.cpp (no FMA: -ffp-contract=off).
template <typename T, typename S, class Algo>
void state_range_baseline(const StateWork<T, S>& w, int64_t begin, int64_t end, float gf) {
  state_range_body<T, S, Algo>(w, begin, end, gf);
}

#ifdef PNM_X86_AVX2
template <typename T, typename S, class Algo>
__attribute__((target("avx2,f16c"), flatten)) void state_range_avx2(const StateWork<T, S>& w,
                                                                    int64_t begin, int64_t end,
                                                                    float gf) {
  state_range_body<T, S, Algo>(w, begin, end, gf);
}

template <typename T, typename S, class Algo>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c"), flatten)) void state_range_avx512(
    const StateWork<T, S>& w, int64_t begin, int64_t end, float gf) {
  state_range_body<T, S, Algo>(w, begin, end, gf);
}
#endif

template <typename T, typename S, class Algo>
void state_range(const StateWork<T, S>& w, int64_t begin, int64_t end, float gf) {
  // Split where the index in the whole parameter crosses a multiple of 2^32 (its key changes).
  while (begin < end) {
    const int64_t next_boundary = (((w.offset + begin) >> 32) + 1) << 32;
    const int64_t stop = std::min(end, next_boundary - w.offset);
#ifdef PNM_X86_AVX2
    switch (current_cpu_isa()) {
      case CpuIsa::kAvx512: state_range_avx512<T, S, Algo>(w, begin, stop, gf); break;
      case CpuIsa::kAvx2: state_range_avx2<T, S, Algo>(w, begin, stop, gf); break;
      case CpuIsa::kBaseline: state_range_baseline<T, S, Algo>(w, begin, stop, gf); break;
    }
#else
    state_range_baseline<T, S, Algo>(w, begin, stop, gf);
#endif
    begin = stop;
  }
}

template <typename T, typename S, class Algo>
void run_state_step(const StepCall& call, const StepArgs& args) {
  if (step_skipped(args.found_inf)) return;
  const int64_t n = call.size();
  const double lr = step_lr(args);
  const float gf = grad_factor<float>(args.hyper.maximize, args.grad_scale);
  std::vector<StateWork<T, S>> work(n);
  std::vector<int64_t> offsets(n + 1, 0);  // tensor i: elements [offsets[i], offsets[i + 1])
  for (int64_t i = 0; i < n; ++i) {
    const double step = *static_cast<double*>(call.steps[i].data_ptr()) + 1.0;
    const bool odd = (static_cast<int64_t>(step) & 1) == 1;
    StateWork<T, S>& w = work[i];
    w.param = static_cast<T*>(call.lists[0][i].data_ptr());
    w.grad = static_cast<const T*>(call.lists[1][i].data_ptr());
    for (int l = 2; l < Algo::kLists; ++l) w.buf[l - 2] = static_cast<S*>(call.lists[l][i].data_ptr());
    if (!odd) std::swap(w.buf[0], w.buf[1]);
    w.coeffs = make_coeffs<float>(args.hyper, lr, step, Algo::kAdaptive);
    w.param_stochastic = std::is_same_v<T, c10::BFloat16> && call.bf16_stochastic_round;
    if (!call.seeds.empty()) {  // what rounds stochastically (the op checked they are there)
      w.offset = call.offsets[i];
      w.seed = static_cast<uint32_t>(*static_cast<const int64_t*>(call.seeds[i].data_ptr()));
    } else {
      w.offset = 0;
      w.seed = 0;
    }
    w.step = static_cast<uint32_t>(static_cast<uint64_t>(step));
    offsets[i + 1] = offsets[i] + call.lists[0][i].numel();
  }
  for_each_share(offsets, n, [&](int64_t i, int64_t begin, int64_t end) {
    state_range<T, S, Algo>(work[i], begin, end, gf);
  });
  for (int64_t i = 0; i < n; ++i) *static_cast<double*>(call.steps[i].data_ptr()) += 1.0;
}

}  // namespace

void cpu_state_step(const StepCall& call) {
  if (call.size() == 0) return;
  const StepArgs args = make_step_args(call);
  dispatch_state_step(call, [&](auto t, auto s, auto a) {
    run_state_step<typename decltype(t)::type, typename decltype(s)::type,
                   typename decltype(a)::type>(call, args);
  });
}

}  // namespace pnm
