// The CUDA kernels' block body for state in a dtype of its own (docs/design.md §7): bfloat16
// buffers written with stochastic rounding, float32 buffers of 16-bit parameters, bfloat16
// parameters rounded stochastically (bf16_stochastic_round). Host and device alike: the CUDA
// launcher (pnm_cuda.cu) and its CPU emulation (emulated_cuda.cpp) run it, and the emulation
// gives the fused CPU kernel's bits (cpu_state_kernel.cpp): the same element functions, the
// same random bits.
#pragma once

#include <type_traits>

#include "multi_tensor_apply.h"
#include "stochastic_rounding.h"

namespace pnm {

// multi_tensor_apply.h's LaunchTable with each tensor's seed and offset (the elements of the
// whole parameter before it): 16 bytes more a tensor, so fewer tensors a launch.
template <int kLists>
struct SeededTable {
  static constexpr int kMaxBlocks = 1 << 30;
  static constexpr int kMaxTensors = 30000 / (8 * kLists + 40);
  void* ptrs[kLists][kMaxTensors];
  double* steps[kMaxTensors];
  int64_t numels[kMaxTensors];
  int32_t block_begin[kMaxTensors];
  int32_t first_chunk[kMaxTensors];
  const int64_t* seeds[kMaxTensors];  // null where nothing rounds stochastically
  int64_t offsets[kMaxTensors];
  int64_t chunk_size;
  unsigned int* blocks_done;  // unused: these steps are never a single launch
  int num_tensors;
  int num_blocks;
};

// Fills each slot's seed and offset as plan_launches adds its tensor.
struct SeedsAndOffsets {
  const int64_t* const* seeds;  // per tensor; null entries where nothing rounds
  const int64_t* offsets;
  template <class Table>
  void operator()(Table& table, int slot, int tensor) const {
    table.seeds[slot] = seeds[tensor];
    table.offsets[slot] = offsets[tensor];
  }
};

template <typename T>
PNM_HOST_DEVICE void store_param(T* a, int64_t i, float v, bool stochastic, uint32_t hash) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (stochastic) {
      a[i].x = bf16_bits_stochastic(v, float_bits(v), mix32(hash) & 0xFFFFu);
      return;
    }
  }
  a[i] = static_cast<T>(v);
}

// One chunk of one tensor, element by element (each thread every block_dim-th element):
// 2- and 4-byte lists side by side do not share one vector width. float32 arithmetic.
template <typename T, typename S, class Algo>
PNM_HOST_DEVICE void state_step_block(const SeededTable<Algo::kLists>& tab, const StepArgs& args,
                                      bool param_stochastic, int block, int thread,
                                      int block_dim) {
  constexpr int L = Algo::kLists;
  if (step_skipped(args.found_inf)) return;
  const BlockChunk where = block_chunk(tab, block);
  const int slot = where.slot;
  const int64_t begin = where.chunk * tab.chunk_size;
  const int64_t left = tab.numels[slot] - begin;
  const int64_t n = left < tab.chunk_size ? left : tab.chunk_size;
  const double step = *tab.steps[slot] + 1.0;  // incremented after every block read it
  const bool odd = (static_cast<int64_t>(step) & 1) != 0;
  const Coeffs<float> c = make_coeffs<float>(args.hyper, step_lr(args), step, Algo::kAdaptive);
  const float gf = grad_factor<float>(args.hyper.maximize, args.grad_scale);

  T* p = static_cast<T*>(tab.ptrs[0][slot]) + begin;
  const T* g = static_cast<const T*>(tab.ptrs[1][slot]) + begin;
  S* m = static_cast<S*>(tab.ptrs[odd ? 2 : 3][slot]) + begin;
  const S* m_other = static_cast<const S*>(tab.ptrs[odd ? 3 : 2][slot]) + begin;
  S* v = L > 4 ? static_cast<S*>(tab.ptrs[L > 4 ? 4 : 0][slot]) + begin : nullptr;
  S* v_max = L > 5 ? static_cast<S*>(tab.ptrs[L - 1][slot]) + begin : nullptr;

  const int64_t* seed_ptr = tab.seeds[slot];
  const uint32_t seed = seed_ptr != nullptr ? static_cast<uint32_t>(*seed_ptr) : 0u;
  const auto t32 = static_cast<uint32_t>(static_cast<uint64_t>(step));
  const auto first = static_cast<uint64_t>(tab.offsets[slot] + begin);
  const auto hi0 = static_cast<uint32_t>(first >> 32);
  const uint32_t key0 = rounding_key(seed, t32, hi0);
  for (int64_t i = thread; i < n; i += block_dim) {
    const uint64_t index = first + static_cast<uint64_t>(i);
    const auto hi = static_cast<uint32_t>(index >> 32);  // a chunk may cross 2^32
    const uint32_t key = hi == hi0 ? key0 : rounding_key(seed, t32, hi);
    const uint32_t h = seed_ptr != nullptr ? element_hash(key, static_cast<uint32_t>(index)) : 0u;
    float e[L];
    e[0] = widen(p[i]);
    e[1] = widen(g[i]) * gf;
    e[2] = widen(m[i]);
    e[3] = widen(m_other[i]);
    if constexpr (L > 4) e[4] = widen(v[i]);
    if constexpr (L > 5) e[5] = widen(v_max[i]);
    Algo::apply(e, c);
    store_param(p, i, e[0], param_stochastic, h);
    store_buffer(m, i, e[2], h >> 16);
    if constexpr (L > 4) store_buffer(v, i, e[4], h & 0xFFFFu);
    if constexpr (L > 5) store_buffer(v_max, i, e[5], h & 0xFFFFu);
  }
}

}  // namespace pnm
