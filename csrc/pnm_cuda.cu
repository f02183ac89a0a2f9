// CUDA launcher: the block body and launch tables of multi_tensor_apply.h on the GPU.
// Everything but the launch itself is shared with the CPU emulation that CI executes.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "int8_block.h"
#include "state_block.h"
#include "step_call.h"

namespace pnm {
namespace {

// __grid_constant__: the table is read in place from kernel-parameter memory, never copied
// into per-thread local memory.
template <typename T, class Algo>
__global__ void __launch_bounds__(kBlockSize)
    step_kernel(const __grid_constant__ LaunchTable<Algo::kLists> table, const StepArgs args) {
  step_block<T, Algo>(table, args, blockIdx.x, threadIdx.x, blockDim.x);
}

// A whole step in one launch, counters included (finish_launch). Used only for a grid of at
// most one block per SM, so its register count costs no occupancy: the (kBlockSize, 1) bound
// lets ptxas use what it likes (with step_kernel's bound, the ticket code made it spill).
template <typename T, class Algo>
__global__ void __launch_bounds__(kBlockSize, 1)
    single_launch_step_kernel(const __grid_constant__ LaunchTable<Algo::kLists> table,
                              const StepArgs args) {
  if (step_skipped(args.found_inf)) return;
  // A table of empty tensors only is launched as one block without a chunk.
  if (static_cast<int>(blockIdx.x) < table.num_blocks) {
    step_block<T, Algo>(table, args, blockIdx.x, threadIdx.x, blockDim.x);
  }
  // The ticket, taken once every thread of the block is done, behind a fence; the block that
  // takes the last one fences again before it writes the counters.
  __shared__ bool took_last_ticket;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    took_last_ticket = atomicAdd(table.blocks_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!took_last_ticket) return;
  __threadfence();
  finish_launch(table, threadIdx.x, blockDim.x);
}

__global__ void increment_kernel(const __grid_constant__ StepCounterTable table,
                                 const float* found_inf) {
  increment_steps(table, found_inf, threadIdx.x, blockDim.x);
}

// State in a dtype of its own (state_block.h). Not named *step_kernel: those are the
// vectorised kernels tests/test_cuda_ptx.py inspects for 128-bit accesses (its no-spill
// check covers these too). Two blocks an SM stated outright: bounded by the block size alone,
// ptxas spilled 4 bytes in bf16-parameter AdaPNM-AMSGrad at 40 registers.
template <typename T, typename S, class Algo>
__global__ void __launch_bounds__(kBlockSize, 2)
    own_state_kernel(const __grid_constant__ SeededTable<Algo::kLists> table, const StepArgs args,
                     bool param_stochastic) {
  state_step_block<T, S, Algo>(table, args, param_stochastic, blockIdx.x, threadIdx.x,
                               blockDim.x);
}

// int8 state (int8_block.h): a warp per quantisation block, its largest magnitudes reduced
// with shuffles between the step and the encode. Two blocks an SM stated outright, as for
// own_state_kernel: bounded by the block size alone, ptxas spilled PNM's at 40 registers.
template <typename T, class Algo>
__global__ void __launch_bounds__(kBlockSize, 2)
    int8_state_kernel(const __grid_constant__ Int8Table<Algo::kLists> table, const StepArgs args,
                      bool param_stochastic) {
  constexpr int kWarps = kBlockSize / kWarpSize;
  constexpr int kWritten = Int8Lane<Algo>::kWritten;
  if (step_skipped(args.found_inf)) return;
  const Int8Chunk c = int8_chunk(table, args, Algo::kAdaptive, blockIdx.x);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int64_t b = c.first + warp; b < c.end; b += kWarps) {  // the same for the whole warp
    const CodeBlock q = code_block(table, c, b);
    Int8Lane<Algo> mine;
    int8_lane_step<T, Algo>(table, c, q, param_stochastic, lane, mine);
    uint32_t largest[kWritten];
#pragma unroll
    for (int w = 0; w < kWritten; ++w) {
      largest[w] = mine.largest[w];
#pragma unroll
      for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        largest[w] = max(largest[w], __shfl_xor_sync(0xFFFFFFFFu, largest[w], offset));
      }
    }
    int8_lane_encode<Algo>(table, c, q, lane, mine, largest);
  }
}

int multiprocessor_count(int device) {
  int count = 0;  // a driver-cached attribute: no need to cache it here
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

template <typename T, class Algo>
void run_cuda(const StepCall& call, const StepArgs& args) {
  const GatheredPointers g = gather_pointers(call);
  const int n = static_cast<int>(call.size());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  unsigned int* const blocks_done = blocks_done_ptr(call);
  const LaunchLimits& limits = launch_limits();
  int max_single_blocks = 0;  // one block per SM at most (see single_launch_step_kernel)
  if (blocks_done != nullptr) {
    max_single_blocks = limits.max_single_launch_blocks > 0
                            ? limits.max_single_launch_blocks
                            : multiprocessor_count(call.lists[0][0].get_device());
  }
  auto tables = plan_launches<Algo::kLists>(n, g.ptrs.data(), g.steps.data(), g.numels.data(),
                                            sizeof(T), limits, max_single_blocks);
  if (make_single_launch(tables, blocks_done, max_single_blocks)) {
    single_launch_step_kernel<T, Algo>
        <<<single_launch_grid(tables[0]), kBlockSize, 0, stream>>>(tables[0], args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  for (const auto& table : tables) {
    if (table.num_blocks == 0) continue;  // empty tensors only
    step_kernel<T, Algo><<<table.num_blocks, kBlockSize, 0, stream>>>(table, args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  for (const auto& counters : plan_step_counters(n, g.steps.data())) {
    increment_kernel<<<1, 256, 0, stream>>>(counters, args.found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename T, typename S, class Algo>
void run_cuda_state(const StepCall& call, const StepArgs& args) {
  const GatheredPointers g = gather_pointers(call);
  const GatheredSeeds seeds = gather_seeds(call);
  const int n = static_cast<int>(call.size());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto tables = plan_launches<Algo::kLists, SeededTable<Algo::kLists>>(
      n, g.ptrs.data(), g.steps.data(), g.numels.data(), sizeof(T), launch_limits(), 0,
      SeedsAndOffsets{seeds.seeds.data(), seeds.offsets.data()});
  for (const auto& table : tables) {
    if (table.num_blocks == 0) continue;
    own_state_kernel<T, S, Algo><<<table.num_blocks, kBlockSize, 0, stream>>>(
        table, args, call.bf16_stochastic_round);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  for (const auto& counters : plan_step_counters(n, g.steps.data())) {
    increment_kernel<<<1, 256, 0, stream>>>(counters, args.found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename T, class Algo>
void run_cuda_int8(const StepCall& call, const StepArgs& args) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const GatheredPointers g = gather_pointers(call);
  for (const auto& table : plan_int8_launches<Algo::kLists>(call, g, sizeof(T))) {
    if (table.num_blocks == 0) continue;
    int8_state_kernel<T, Algo><<<table.num_blocks, kBlockSize, 0, stream>>>(
        table, args, call.bf16_stochastic_round);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  for (const auto& counters : plan_step_counters(static_cast<int>(call.size()), g.steps.data())) {
    increment_kernel<<<1, 256, 0, stream>>>(counters, args.found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

struct CudaInt8 {
  static constexpr c10::DeviceType kDevice = c10::DeviceType::CUDA;
  static void run(const StepCall& call) {
    if (call.size() == 0) return;
    const c10::cuda::CUDAGuard guard(call.lists[0][0].device());
    const StepArgs args = make_step_args(call);
    dispatch_int8_step(call, [&](auto t, auto a) {
      run_cuda_int8<typename decltype(t)::type, typename decltype(a)::type>(call, args);
    });
  }
};

struct CudaState {
  static constexpr c10::DeviceType kDevice = c10::DeviceType::CUDA;
  static void run(const StepCall& call) {
    if (call.size() == 0) return;
    const c10::cuda::CUDAGuard guard(call.lists[0][0].device());
    const StepArgs args = make_step_args(call);
    dispatch_state_step(call, [&](auto t, auto s, auto a) {
      run_cuda_state<typename decltype(t)::type, typename decltype(s)::type,
                     typename decltype(a)::type>(call, args);
    });
  }
};

struct Cuda {
  static constexpr c10::DeviceType kDevice = c10::DeviceType::CUDA;
  static void run(const StepCall& call) {
    if (call.size() == 0) return;
    const c10::cuda::CUDAGuard guard(call.lists[0][0].device());
    const StepArgs args = make_step_args(call);
    dispatch_step(call, [&](auto t, auto a) {
      run_cuda<typename decltype(t)::type, typename decltype(a)::type>(call, args);
    });
  }
};

}  // namespace
}  // namespace pnm

TORCH_LIBRARY_IMPL(pnm_kernels, CUDA, m) {
  m.impl("pnm_step_", &pnm::pnm_step_op<pnm::Cuda>);
  m.impl("adapnm_step_", &pnm::adapnm_step_op<pnm::Cuda>);
  m.impl("pnm_state_step_", &pnm::pnm_state_step_op<pnm::CudaState>);
  m.impl("adapnm_state_step_", &pnm::adapnm_state_step_op<pnm::CudaState>);
  m.impl("pnm_int8_step_", &pnm::pnm_int8_step_op<pnm::CudaInt8>);
  m.impl("adapnm_int8_step_", &pnm::adapnm_int8_step_op<pnm::CudaInt8>);
}
