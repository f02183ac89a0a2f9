// The CUDA kernels' body for int8 state (docs/design.md §8): a warp per quantisation block.
// Lane l holds elements l, l + 32, l + 64 and l + 96 of its block (each access coalesced
// across the warp); it decodes them, steps them with pnm_math.h's element maths, writes the
// parameter, and keeps the new buffer values; the warp's largest magnitude is the block's
// new scale, and each lane encodes its values with it (int8_codes.h). Host and device alike:
// the CUDA launcher (pnm_cuda.cu) reduces over the warp with shuffles, its CPU emulation
// (emulated_cuda.cpp) walks the lanes in a loop; both give the fused CPU kernel's bits.
#pragma once

#include <algorithm>
#include <vector>

#include "int8_codes.h"
#include "state_block.h"
#include "step_call.h"

namespace pnm {

constexpr int kWarpSize = 32;
constexpr int kPerLane = static_cast<int>(kInt8Block) / kWarpSize;

// multi_tensor_apply.h's LaunchTable for int8 state, counted in quantisation blocks: a
// tensor's "numel" is its number of blocks (rows x blocks per row), a chunk chunk_size of
// them. With each buffer's scales, seed, offset and row length: fewer tensors a launch.
template <int kLists>
struct Int8Table {
  static constexpr int kMaxBlocks = 1 << 30;
  static constexpr int kMaxTensors = 30000 / (16 * kLists + 32);
  void* ptrs[kLists][kMaxTensors];
  float* scales[kLists - 2][kMaxTensors];
  double* steps[kMaxTensors];
  int64_t numels[kMaxTensors];  // quantisation blocks
  int32_t block_begin[kMaxTensors];
  int32_t first_chunk[kMaxTensors];
  const int64_t* seeds[kMaxTensors];
  int64_t offsets[kMaxTensors];  // elements of the whole parameter before this shard
  int64_t row_lengths[kMaxTensors];
  int64_t chunk_size;  // quantisation blocks a thread block
  unsigned int* blocks_done;  // unused: these steps are never a single launch
  int num_tensors;
  int num_blocks;
};

// Fills each slot's scales, seed, offset and row length as plan_launches adds its tensor.
struct Int8Slots {
  float* const* scales;  // tensor-major: buffers a tensor
  int buffers;
  const int64_t* const* seeds;
  const int64_t* offsets;
  const int64_t* row_lengths;
  template <class Table>
  void operator()(Table& table, int slot, int tensor) const {
    for (int b = 0; b < buffers; ++b) table.scales[b][slot] = scales[tensor * buffers + b];
    table.seeds[slot] = seeds[tensor];
    table.offsets[slot] = offsets[tensor];
    table.row_lengths[slot] = row_lengths[tensor];
  }
};

// What one thread block's chunk shares: its tensor, its quantisation blocks, the step's
// constants.
struct Int8Chunk {
  int slot;
  int64_t first, end;  // quantisation blocks [first, end) of the tensor
  Coeffs<float> coeffs;
  float grad_factor;
  bool odd;
  uint32_t seed, step;
};

template <int kLists>
PNM_HOST_DEVICE Int8Chunk int8_chunk(const Int8Table<kLists>& tab, const StepArgs& args,
                                     bool adaptive, int block) {
  const BlockChunk where = block_chunk(tab, block);
  Int8Chunk c;
  c.slot = where.slot;
  c.first = where.chunk * tab.chunk_size;
  const int64_t left = tab.numels[c.slot] - c.first;
  c.end = c.first + (left < tab.chunk_size ? left : tab.chunk_size);
  const double step = *tab.steps[c.slot] + 1.0;  // incremented after every block read it
  c.odd = (static_cast<int64_t>(step) & 1) != 0;
  c.coeffs = make_coeffs<float>(args.hyper, step_lr(args), step, adaptive);
  c.grad_factor = grad_factor<float>(args.hyper.maximize, args.grad_scale);
  c.seed = static_cast<uint32_t>(*tab.seeds[c.slot]);
  c.step = static_cast<uint32_t>(static_cast<uint64_t>(step));
  return c;
}

// One quantisation block of a chunk's tensor: where its elements are, and the key of their
// random bits.
struct CodeBlock {
  int64_t index;   // among the tensor's blocks
  int64_t begin;   // its first element in the tensor
  uint64_t first;  // that element's index in the whole parameter
  uint32_t key;    // rounding_key for the high 32 bits of `first`
  int n;           // its elements: kInt8Block, or fewer at a row's end
};

template <int kLists>
PNM_HOST_DEVICE CodeBlock code_block(const Int8Table<kLists>& tab, const Int8Chunk& c,
                                     int64_t index) {
  const int64_t row_length = tab.row_lengths[c.slot];
  const int64_t per_row = (row_length + kInt8Block - 1) / kInt8Block;
  const int64_t row = index / per_row, in_row = index - row * per_row;
  const int64_t left = row_length - in_row * kInt8Block;
  CodeBlock q;
  q.index = index;
  q.begin = row * row_length + in_row * kInt8Block;
  q.first = static_cast<uint64_t>(tab.offsets[c.slot] + q.begin);
  q.key = rounding_key(c.seed, c.step, static_cast<uint32_t>(q.first >> 32));
  q.n = static_cast<int>(left < kInt8Block ? left : kInt8Block);
  return q;
}

// The random bits of element i of a block; computed where they are used (in both halves of
// a lane's work), as keeping them took registers that AdaPNM-AMSGrad spilled for.
PNM_HOST_DEVICE uint32_t code_block_hash(const Int8Chunk& c, const CodeBlock& q, int i) {
  const uint64_t index = q.first + static_cast<uint64_t>(i);
  const auto hi = static_cast<uint32_t>(index >> 32);  // a block may cross 2^32
  const uint32_t key =
      hi == static_cast<uint32_t>(q.first >> 32) ? q.key : rounding_key(c.seed, c.step, hi);
  return element_hash(key, static_cast<uint32_t>(index));
}

// A lane's part of a block between the step and the encode: the new values of the buffers
// the step wrote (the momentum of its parity, the second moment and its maximum), and the
// lane's largest scale_bits of each.
template <class Algo>
struct Int8Lane {
  static constexpr int kWritten = Algo::kLists - 3;
  float value[kWritten][kPerLane];
  uint32_t largest[kWritten];
};

// List l's codes of a slot, parity applied (list 2 is this step's momentum buffer).
PNM_HOST_DEVICE int list_of(int l, bool odd) {
  return (l == 2 || l == 3) && !odd ? 5 - l : l;
}

// The first half of a lane's work: decode, step, write the parameter (stochastically with
// param_stochastic), keep the buffers' new values.
template <typename T, class Algo>
PNM_HOST_DEVICE void int8_lane_step(const Int8Table<Algo::kLists>& tab, const Int8Chunk& c,
                                    const CodeBlock& q, bool param_stochastic, int lane,
                                    Int8Lane<Algo>& out) {
  constexpr int L = Algo::kLists;
  const int s = c.slot;
  T* p = static_cast<T*>(tab.ptrs[0][s]) + q.begin;
  const T* g = static_cast<const T*>(tab.ptrs[1][s]) + q.begin;
  const int8_t* m = static_cast<const int8_t*>(tab.ptrs[list_of(2, c.odd)][s]) + q.begin;
  const int8_t* m_other =
      static_cast<const int8_t*>(tab.ptrs[list_of(3, c.odd)][s]) + q.begin;
  const float m_scale = tab.scales[list_of(2, c.odd) - 2][s][q.index];
  const float m_other_scale = tab.scales[list_of(3, c.odd) - 2][s][q.index];
PNM_UNROLL
  for (int w = 0; w < Int8Lane<Algo>::kWritten; ++w) out.largest[w] = 0;
PNM_UNROLL
  for (int k = 0; k < kPerLane; ++k) {
    const int i = lane + k * kWarpSize;
    float e[L];
PNM_UNROLL
    for (int l = 0; l < L; ++l) e[l] = 0.0f;
    if (i < q.n) {
      e[0] = widen(p[i]);
      e[1] = widen(g[i]) * c.grad_factor;
      e[2] = SignedCodes::decode(m[i], m_scale);
      e[3] = SignedCodes::decode(m_other[i], m_other_scale);
      if constexpr (L > 4) {
        const uint8_t* v = static_cast<const uint8_t*>(tab.ptrs[4][s]) + q.begin;
        e[4] = UnsignedCodes::decode(v[i], tab.scales[2][s][q.index]);
      }
      if constexpr (L > 5) {
        const uint8_t* v_max = static_cast<const uint8_t*>(tab.ptrs[5][s]) + q.begin;
        e[5] = UnsignedCodes::decode(v_max[i], tab.scales[3][s][q.index]);
      }
      Algo::apply(e, c.coeffs);
      store_param(p, i, e[0], param_stochastic,
                  param_stochastic ? code_block_hash(c, q, i) : 0u);
    }
    out.value[0][k] = e[2];
    if constexpr (L > 4) out.value[1][k] = e[4];
    if constexpr (L > 5) out.value[2][k] = e[5];
PNM_UNROLL
    for (int w = 0; w < Int8Lane<Algo>::kWritten; ++w) {
      const float x = out.value[w][k];
      const uint32_t b = w == 0 ? SignedCodes::scale_bits(x) : UnsignedCodes::scale_bits(x);
      out.largest[w] = b > out.largest[w] ? b : out.largest[w];
    }
  }
}

// The second half: the lane's codes with the block's scales (each the largest of the warp's
// `largest`); lane 0 writes the scales.
template <class Algo>
PNM_HOST_DEVICE void int8_lane_encode(const Int8Table<Algo::kLists>& tab, const Int8Chunk& c,
                                      const CodeBlock& q, int lane, const Int8Lane<Algo>& in,
                                      const uint32_t* block_largest) {
  constexpr int kWritten = Int8Lane<Algo>::kWritten;
  const int s = c.slot;
  const int momentum_list = list_of(2, c.odd);
  float lift[kWritten], inverse[kWritten];
PNM_UNROLL
  for (int w = 0; w < kWritten; ++w) {
    const float scale = w == 0 ? SignedCodes::block_scale(block_largest[w])
                               : UnsignedCodes::block_scale(block_largest[w]);
    lift[w] = SignedCodes::lift(block_largest[w]);
    inverse[w] = SignedCodes::lifted_inverse(scale, lift[w]);
    if (lane == 0) tab.scales[(w == 0 ? momentum_list : w + 3) - 2][s][q.index] = scale;
  }
PNM_UNROLL
  for (int k = 0; k < kPerLane; ++k) {
    const int i = lane + k * kWarpSize;
    if (i >= q.n) continue;
    // The high 16 bits round the momentum, the low ones the second moment and its maximum.
    const uint32_t hash = code_block_hash(c, q, i);
    static_cast<int8_t*>(tab.ptrs[momentum_list][s])[q.begin + i] =
        static_cast<int8_t>(
            SignedCodes::encode(in.value[0][k], lift[0], inverse[0], hash >> 16));
PNM_UNROLL
    for (int w = 1; w < kWritten; ++w) {
      static_cast<uint8_t*>(tab.ptrs[w + 3][s])[q.begin + i] = static_cast<uint8_t>(
          UnsignedCodes::encode(in.value[w][k], lift[w], inverse[w], hash & 0xFFFFu));
    }
  }
}

// Host side: the launch tables of an int8 step over the call's tensors (checked by
// check_int8_call), from their gathered pointers (which the counters' launch takes too). A
// thread block's chunk is the dtype's chunk of elements in whole quantisation blocks
// (default_chunk_size / kInt8Block, at least one).
template <int kLists>
std::vector<Int8Table<kLists>> plan_int8_launches(const StepCall& call, const GatheredPointers& g,
                                                  size_t element_size) {
  const GatheredSeeds seeds = gather_seeds(call);
  const int n = static_cast<int>(call.size());
  const int buffers = kLists - 2;
  std::vector<int64_t> blocks(n), row_lengths(n);
  std::vector<float*> scales(static_cast<size_t>(n) * buffers);
  for (int i = 0; i < n; ++i) {
    const at::Tensor& p = call.lists[0][i];
    row_lengths[i] = int8_row_length(p);
    blocks[i] = p.size(0) * ((row_lengths[i] + kInt8Block - 1) / kInt8Block);
    for (int b = 0; b < buffers; ++b) {
      scales[i * buffers + b] = static_cast<float*>(call.scales[b * n + i].data_ptr());
    }
  }
  LaunchLimits limits = launch_limits();
  const int64_t elements =
      limits.chunk_size > 0 ? limits.chunk_size : default_chunk_size(element_size);
  limits.chunk_size = std::max<int64_t>(1, elements / kInt8Block);
  return plan_launches<kLists, Int8Table<kLists>>(
      n, g.ptrs.data(), g.steps.data(), blocks.data(), element_size, limits, 0,
      Int8Slots{scales.data(), buffers, seeds.seeds.data(), seeds.offsets.data(),
                row_lengths.data()});
}

}  // namespace pnm
