// The fused CPU kernel for int8 state (docs/design.md §8; the ground truth is
// pnm_kernels/quantization.py with reference.py): one pass, a block of kInt8Block elements at a
// time. Each block's codes are decoded with their scale, the element maths of pnm_math.h runs
// in float32, and each buffer the step changed is encoded again: its new scale is the block's
// largest magnitude, each code rounded stochastically with the element's random bits
// (stochastic_rounding.h). The momentum the step only reads keeps its codes. Blocks are split
// between threads. Built with -ffp-contract=off (setup.py): bitwise the reference's
// quantisation of the same float32 values.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_elements.h"
#include "cpu_kernel.h"
#include "int8_codes.h"
#include "stochastic_rounding.h"

namespace pnm {
namespace {

constexpr int kBlock = static_cast<int>(kInt8Block);
constexpr int64_t kBlocksPerShare = 256;  // 32K elements: kCpuChunk's worth a thread

// A buffer's codes a block at a time, with int8_codes.h's element functions.
template <bool kSigned>
struct BlockCodes {
  using Map = CodeMap<kSigned>;
  using Code = typename Map::Code;

  static PNM_CPU_INLINE void decode(const Code* codes, float scale, int n, float* out) {
    for (int i = 0; i < n; ++i) out[i] = Map::decode(codes[i], scale);
  }

  // Codes for x[0, n) with 16 random bits each (bits[i] < 2^16); returns the block's scale.
  // The largest magnitude is an integer reduction over bit patterns, which vectorises.
  static PNM_CPU_INLINE float encode(const float* x, const uint32_t* bits, int n, Code* codes) {
    uint32_t largest = 0;
    for (int i = 0; i < n; ++i) {
      const uint32_t b = Map::scale_bits(x[i]);
      largest = b > largest ? b : largest;
    }
    const float scale = Map::block_scale(largest);
    const float lift = Map::lift(largest);
    const float inverse = Map::lifted_inverse(scale, lift);
    if (lift != 1.0f) {  // a subnormal scale: rare, kept out of the usual loop
      for (int i = 0; i < n; ++i) {
        codes[i] = static_cast<Code>(Map::encode(x[i], lift, inverse, bits[i]));
      }
      return scale;
    }
    for (int i = 0; i < n; ++i) {
      codes[i] = static_cast<Code>(Map::encode(x[i], 1.0f, inverse, bits[i]));
    }
    return scale;
  }
};

using Signed = BlockCodes<true>;
using Unsigned = BlockCodes<false>;

// One tensor of one step. codes/scales: m, m_other, v, v_max (parity applied: [0] is this
// step's momentum buffer).
template <typename T>
struct Int8Work {
  T* param;
  const T* grad;
  void* codes[4];
  float* scales[4];
  Coeffs<float> coeffs;
  int64_t offset;  // elements of the whole parameter before this tensor (a shard)
  int64_t row_length, blocks_per_row;
  uint32_t seed, step;
  bool param_stochastic;
};

// Block b of tensor w, of n elements from `begin`: decode, step, encode. kFull: n is
// kBlock, a constant, so that every loop over the block has a fixed trip count.
template <typename T, class Algo, bool kFull>
PNM_CPU_INLINE void int8_block_of(const Int8Work<T>& w, int64_t b, int64_t begin, int count,
                                  float gf) {
  const int n = kFull ? kBlock : count;
  float m[kBlock], m_other[kBlock], v[kBlock], v_max[kBlock], p[kBlock];
  uint32_t hash[kBlock], high[kBlock], low[kBlock];
  Signed::decode(static_cast<const int8_t*>(w.codes[0]) + begin, w.scales[0][b], n, m);
  Signed::decode(static_cast<const int8_t*>(w.codes[1]) + begin, w.scales[1][b], n, m_other);
  if constexpr (Algo::kAdaptive) {
    Unsigned::decode(static_cast<const uint8_t*>(w.codes[2]) + begin, w.scales[2][b], n, v);
    if constexpr (Algo::kAmsgrad) {
      Unsigned::decode(static_cast<const uint8_t*>(w.codes[3]) + begin, w.scales[3][b], n,
                       v_max);
    }
  }
  const uint64_t first = static_cast<uint64_t>(w.offset + begin);
  const uint32_t first_lo = static_cast<uint32_t>(first);
  const uint32_t key = rounding_key(w.seed, w.step, static_cast<uint32_t>(first >> 32));
  for (int i = 0; i < n; ++i) hash[i] = element_hash(key, first_lo + static_cast<uint32_t>(i));
  if (static_cast<uint64_t>(first_lo) + static_cast<uint64_t>(n) > (uint64_t{1} << 32)) {
    // A block across a multiple of 2^32: its elements past it take the next key.
    const uint32_t next = rounding_key(w.seed, w.step, static_cast<uint32_t>(first >> 32) + 1);
    for (int i = 0; i < n; ++i) {
      const uint32_t lo = first_lo + static_cast<uint32_t>(i);
      if (lo < first_lo) hash[i] = element_hash(next, lo);
    }
  }
  for (int i = 0; i < n; ++i) {
    high[i] = hash[i] >> 16;
    low[i] = hash[i] & 0xFFFFu;
  }
  for (int i = 0; i < n; ++i) {
    float pi = load(w.param, begin + i);
    const float gi = load(w.grad, begin + i) * gf;
    if constexpr (Algo::kAdaptive) {
      float vmi = Algo::kAmsgrad ? v_max[i] : 0.0f;
      adapnm_element<Algo::kDecoupled, Algo::kAmsgrad>(pi, gi, m[i], m_other[i], v[i], vmi,
                                                       w.coeffs);
      if constexpr (Algo::kAmsgrad) v_max[i] = vmi;
    } else {
      pnm_element<Algo::kDecoupled>(pi, gi, m[i], m_other[i], w.coeffs);
    }
    p[i] = pi;
  }
  for (int i = 0; i < n; ++i) {
    store_param(w.param, begin + i, p[i], w.param_stochastic, hash[i]);
  }
  w.scales[0][b] = Signed::encode(m, high, n, static_cast<int8_t*>(w.codes[0]) + begin);
  if constexpr (Algo::kAdaptive) {
    w.scales[2][b] = Unsigned::encode(v, low, n, static_cast<uint8_t*>(w.codes[2]) + begin);
    if constexpr (Algo::kAmsgrad) {
      w.scales[3][b] = Unsigned::encode(v_max, low, n,
                                        static_cast<uint8_t*>(w.codes[3]) + begin);
    }
  }
}

template <typename T, class Algo>
PNM_CPU_INLINE void int8_block(const Int8Work<T>& w, int64_t b, float gf) {
  const int64_t row = b / w.blocks_per_row, in_row = b % w.blocks_per_row;
  const int64_t begin = row * w.row_length + in_row * kBlock;
  const int64_t n = std::min<int64_t>(kBlock, w.row_length - in_row * kBlock);
  if (n == kBlock) {
    int8_block_of<T, Algo, true>(w, b, begin, kBlock, gf);
  } else {
    int8_block_of<T, Algo, false>(w, b, begin, static_cast<int>(n), gf);
  }
}

// Blocks [b0, b1) of tensor w, for the x86-64 baseline, AVX2 and AVX-512, picked at run time
// as in cpu_kernel.cpp (no FMA: -ffp-contract=off; flatten inlines the element maths, which
// the vectoriser then compiles for the target).
template <typename T, class Algo>
PNM_CPU_INLINE void int8_blocks_body(const Int8Work<T>& w, int64_t b0, int64_t b1, float gf) {
  for (int64_t b = b0; b < b1; ++b) int8_block<T, Algo>(w, b, gf);
}

template <typename T, class Algo>
void int8_blocks_baseline(const Int8Work<T>& w, int64_t b0, int64_t b1, float gf) {
  int8_blocks_body<T, Algo>(w, b0, b1, gf);
}

#ifdef PNM_X86_AVX2
template <typename T, class Algo>
__attribute__((target("avx2,f16c"), flatten)) void int8_blocks_avx2(const Int8Work<T>& w,
                                                                    int64_t b0, int64_t b1,
                                                                    float gf) {
  int8_blocks_body<T, Algo>(w, b0, b1, gf);
}

template <typename T, class Algo>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c"), flatten)) void int8_blocks_avx512(
    const Int8Work<T>& w, int64_t b0, int64_t b1, float gf) {
  int8_blocks_body<T, Algo>(w, b0, b1, gf);
}
#endif

template <typename T, class Algo>
void int8_blocks(const Int8Work<T>& w, int64_t b0, int64_t b1, float gf) {
#ifdef PNM_X86_AVX2
  switch (current_cpu_isa()) {
    case CpuIsa::kAvx512: int8_blocks_avx512<T, Algo>(w, b0, b1, gf); return;
    case CpuIsa::kAvx2: int8_blocks_avx2<T, Algo>(w, b0, b1, gf); return;
    case CpuIsa::kBaseline: break;
  }
#endif
  int8_blocks_baseline<T, Algo>(w, b0, b1, gf);
}

template <typename T, class Algo>
void run_int8_step(const StepCall& call, const StepArgs& args) {
  if (step_skipped(args.found_inf)) return;
  const int64_t n = call.size();
  const double lr = step_lr(args);
  const float gf = grad_factor<float>(args.hyper.maximize, args.grad_scale);
  const int buffers = call.num_lists - 2;
  std::vector<Int8Work<T>> work(n);
  std::vector<int64_t> first_block(n + 1, 0);  // tensor i: blocks [first_block[i], [i + 1])
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& param = call.lists[0][i];
    const double step = *static_cast<double*>(call.steps[i].data_ptr()) + 1.0;
    Int8Work<T>& w = work[i];
    w.param = static_cast<T*>(param.data_ptr());
    w.grad = static_cast<const T*>(call.lists[1][i].data_ptr());
    for (int l = 0; l < buffers; ++l) {
      w.codes[l] = call.lists[l + 2][i].data_ptr();
      w.scales[l] = static_cast<float*>(call.scales[l * n + i].data_ptr());
    }
    if ((static_cast<int64_t>(step) & 1) == 0) {
      std::swap(w.codes[0], w.codes[1]);
      std::swap(w.scales[0], w.scales[1]);
    }
    w.coeffs = make_coeffs<float>(args.hyper, lr, step, Algo::kAdaptive);
    w.param_stochastic = std::is_same_v<T, c10::BFloat16> && call.bf16_stochastic_round;
    w.offset = call.offsets[i];
    w.seed = static_cast<uint32_t>(*static_cast<const int64_t*>(call.seeds[i].data_ptr()));
    w.step = static_cast<uint32_t>(static_cast<uint64_t>(step));
    w.row_length = int8_row_length(param);
    w.blocks_per_row = (w.row_length + kBlock - 1) / kBlock;
    first_block[i + 1] = first_block[i] + param.size(0) * w.blocks_per_row;
  }
  at::parallel_for(0, first_block[n], kBlocksPerShare, [&](int64_t lo, int64_t hi) {
    int64_t i = std::upper_bound(first_block.begin(), first_block.end(), lo) -
                first_block.begin() - 1;
    for (int64_t b = lo; b < hi; ++i) {  // each tensor's part of this share
      const int64_t end = std::min(hi, first_block[i + 1]);
      if (b < end) int8_blocks<T, Algo>(work[i], b - first_block[i], end - first_block[i], gf);
      b = std::max(b, end);
    }
  });
  for (int64_t i = 0; i < n; ++i) *static_cast<double*>(call.steps[i].data_ptr()) += 1.0;
}

}  // namespace

void cpu_int8_step(const StepCall& call) {
  if (call.size() == 0) return;
  const StepArgs args = make_step_args(call);
  dispatch_int8_step(call, [&](auto t, auto a) {
    run_int8_step<typename decltype(t)::type, typename decltype(a)::type>(call, args);
  });
}

}  // namespace pnm
