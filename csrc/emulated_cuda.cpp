// The CUDA kernels' code executed on the host, for CPU tensors: the launch tables of
// multi_tensor_apply.h and the same block body as pnm_cuda.cu's kernels, walked block by block
// and thread by thread. CI has no GPU; the tests check the CUDA path's planning and
// arithmetic through this, and that the fused CPU kernel equals it bit for bit on every ISA
// (docs/design.md §4). Element maths: built with -ffp-contract=off (setup.py).
#include "emulated_cuda.h"

#include "int8_block.h"
#include "state_block.h"

namespace pnm {
namespace {

// In a single-launch step blocks take their tickets in order, so the last one to take one
// is the last block, as on the GPU.
template <typename T, class Algo>
void run_emulated_cuda(const StepCall& call, const StepArgs& args) {
  const GatheredPointers g = gather_pointers(call);
  const int n = static_cast<int>(call.size());
  unsigned int* const blocks_done = blocks_done_ptr(call);
  TORCH_CHECK(blocks_done == nullptr || *blocks_done == 0,
              "pnm_kernels: blocks_done must be zero when a step starts, got ", *blocks_done);
  const LaunchLimits& limits = launch_limits();
  const int max_single_blocks = blocks_done != nullptr ? limits.max_single_launch_blocks : 0;
  auto tables = plan_launches<Algo::kLists>(n, g.ptrs.data(), g.steps.data(), g.numels.data(),
                                            sizeof(T), limits, max_single_blocks);
  if (make_single_launch(tables, blocks_done, max_single_blocks)) {
    if (step_skipped(args.found_inf)) return;
    const LaunchTable<Algo::kLists>& table = tables[0];
    const int grid = single_launch_grid(table);
    for (int block = 0; block < grid; ++block) {
      if (block < table.num_blocks) {  // else the one block of a table of empty tensors
        for (int thread = 0; thread < kBlockSize; ++thread) {
          step_block<T, Algo>(table, args, block, thread, kBlockSize);
        }
      }
      if (++*blocks_done == static_cast<unsigned int>(grid)) {  // this block's ticket
        for (int thread = 0; thread < kBlockSize; ++thread) finish_launch(table, thread, kBlockSize);
      }
    }
    return;
  }
  for (const auto& table : tables) {
    for (int block = 0; block < table.num_blocks; ++block) {
      for (int thread = 0; thread < kBlockSize; ++thread) {
        step_block<T, Algo>(table, args, block, thread, kBlockSize);
      }
    }
  }
  for (const auto& counters : plan_step_counters(n, g.steps.data())) {
    for (int thread = 0; thread < kBlockSize; ++thread) {
      increment_steps(counters, args.found_inf, thread, kBlockSize);
    }
  }
}

// The state ops' launches (state_block.h): never a single launch; the counters' launch after.
template <typename T, typename S, class Algo>
void run_emulated_state(const StepCall& call, const StepArgs& args) {
  const GatheredPointers g = gather_pointers(call);
  const GatheredSeeds seeds = gather_seeds(call);
  const int n = static_cast<int>(call.size());
  const auto tables = plan_launches<Algo::kLists, SeededTable<Algo::kLists>>(
      n, g.ptrs.data(), g.steps.data(), g.numels.data(), sizeof(T), launch_limits(), 0,
      SeedsAndOffsets{seeds.seeds.data(), seeds.offsets.data()});
  const bool param_stochastic = call.bf16_stochastic_round;
  for (const auto& table : tables) {
    for (int block = 0; block < table.num_blocks; ++block) {
      for (int thread = 0; thread < kBlockSize; ++thread) {
        state_step_block<T, S, Algo>(table, args, param_stochastic, block, thread, kBlockSize);
      }
    }
  }
  for (const auto& counters : plan_step_counters(n, g.steps.data())) {
    for (int thread = 0; thread < kBlockSize; ++thread) {
      increment_steps(counters, args.found_inf, thread, kBlockSize);
    }
  }
}

// The int8 ops' launches (int8_block.h): each warp's lanes in turn, their largest magnitudes
// reduced between the two halves as the warp's shuffles do on the GPU.
template <typename T, class Algo>
void run_emulated_int8(const StepCall& call, const StepArgs& args) {
  constexpr int kWarps = kBlockSize / kWarpSize;
  constexpr int kWritten = Int8Lane<Algo>::kWritten;
  const GatheredPointers g = gather_pointers(call);
  const auto tables = plan_int8_launches<Algo::kLists>(call, g, sizeof(T));
  std::vector<Int8Lane<Algo>> lanes(kWarpSize);
  for (const auto& table : tables) {
    for (int block = 0; block < table.num_blocks; ++block) {
      if (step_skipped(args.found_inf)) break;
      const Int8Chunk c = int8_chunk(table, args, Algo::kAdaptive, block);
      for (int warp = 0; warp < kWarps; ++warp) {
        for (int64_t b = c.first + warp; b < c.end; b += kWarps) {
          const CodeBlock q = code_block(table, c, b);
          uint32_t largest[kWritten] = {};
          for (int lane = 0; lane < kWarpSize; ++lane) {
            int8_lane_step<T, Algo>(table, c, q, call.bf16_stochastic_round, lane, lanes[lane]);
            for (int w = 0; w < kWritten; ++w) {
              largest[w] = std::max(largest[w], lanes[lane].largest[w]);
            }
          }
          for (int lane = 0; lane < kWarpSize; ++lane) {
            int8_lane_encode<Algo>(table, c, q, lane, lanes[lane], largest);
          }
        }
      }
    }
  }
  for (const auto& counters : plan_step_counters(static_cast<int>(call.size()), g.steps.data())) {
    for (int thread = 0; thread < kBlockSize; ++thread) {
      increment_steps(counters, args.found_inf, thread, kBlockSize);
    }
  }
}

}  // namespace

void emulated_cuda_int8_step(const StepCall& call) {
  if (call.size() == 0) return;
  const StepArgs args = make_step_args(call);
  dispatch_int8_step(call, [&](auto t, auto a) {
    run_emulated_int8<typename decltype(t)::type, typename decltype(a)::type>(call, args);
  });
}

void emulated_cuda_state_step(const StepCall& call) {
  if (call.size() == 0) return;
  const StepArgs args = make_step_args(call);
  dispatch_state_step(call, [&](auto t, auto s, auto a) {
    run_emulated_state<typename decltype(t)::type, typename decltype(s)::type,
                       typename decltype(a)::type>(call, args);
  });
}

void emulated_cuda_step(const StepCall& call) {
  if (call.size() == 0) return;
  const StepArgs args = make_step_args(call);
  dispatch_step(call, [&](auto t, auto a) {
    run_emulated_cuda<typename decltype(t)::type, typename decltype(a)::type>(call, args);
  });
}

}  // namespace pnm
