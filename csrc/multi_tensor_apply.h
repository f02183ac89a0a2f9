// Multi-tensor apply for the CUDA kernels, written so the same code also runs on the host.
//
// A step over many tensors is cut into chunks; one launch covers every chunk of up to
// kMaxTensors tensors (about 400 to 530). The whole chunk map travels as a kernel argument
// (__grid_constant__, < 32 KiB, CUDA >= 12.1), so a launch needs no host-to-device copy and a
// CUDA graph captures it as it is. step_block() is the body of one thread block; the CUDA
// launcher calls it from a __global__ function, the CPU emulation (CI has no GPU) calls it from
// a loop over blocks and threads. Nothing here uses threadIdx/blockIdx or shared memory.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "pnm_math.h"

namespace pnm {

constexpr int kBlockSize = 512;
// Elements a block updates, by element size. Smaller than torch's 65,536: a part-empty last
// wave of large blocks is idle bandwidth. On an H200, side by side in one process, every fp32
// step of 16M-1.2G elements took 0.9-2.9 % less time with 4,096 than with 16,384 (which had
// taken 1.4-10 % less than 65,536); bf16 AdaPNM took 7-35 % more with 4,096 and up to 6.5 %
// more with 8,192, bf16 PNM within 2.2 % either way: 16-bit types keep 16,384 (a likely cause,
// not measured apart: every thread computes its tensor's constants, AdaPNM's with two double
// pows, and a small chunk of a 2-byte type gives that work few bytes to hide behind). fp64
// takes fp32's size (PNM 1.0-3.7 % slower with larger chunks, AdaPNM 1.4-2.6 % faster with
// 16,384; kept one rule). The measurements: docs/performance.md. Steps that fit one launch
// only with larger chunks: step_chunk_size.
// Must equal pnm_kernels._ops.cuda_chunk_size.
constexpr int64_t default_chunk_size(size_t element_size) {
  return element_size >= 4 ? 4096 : 16384;
}
constexpr int kVecBytes = 16;  // one 128-bit load or store per list and thread
// int8 state's blocks (pnm_kernels/quantization.py's BLOCK): a row of dim 0 is cut into blocks
// of this many elements, each with one float32 scale.
constexpr int64_t kInt8Block = 128;

// Lists, in this order in every table: 0 param, 1 grad, 2 positive buffer (pos_momentum /
// exp_avg), 3 negative buffer (neg_momentum / neg_exp_avg), 4 exp_avg_sq, 5 max_exp_avg_sq.
// Only the buffer of the step's parity is written; grads and the other buffer are read only.
PNM_HOST_DEVICE constexpr bool is_written(int list) { return list != 1 && list != 3; }

template <bool kDecoupledWd>
struct PnmAlgo {
  static constexpr int kLists = 4;
  static constexpr bool kAdaptive = false;
  static constexpr bool kDecoupled = kDecoupledWd;
  template <typename C>
  PNM_HOST_DEVICE static void apply(C* e, const Coeffs<C>& c) {
    pnm_element<kDecoupledWd>(e[0], e[1], e[2], e[3], c);
  }
};

template <bool kDecoupledWd, bool kAmsgradOn>
struct AdaPnmAlgo {
  static constexpr int kLists = kAmsgradOn ? 6 : 5;
  static constexpr bool kAdaptive = true;
  static constexpr bool kDecoupled = kDecoupledWd;
  static constexpr bool kAmsgrad = kAmsgradOn;
  template <typename C>
  PNM_HOST_DEVICE static void apply(C* e, const Coeffs<C>& c) {
    // Without AMSGrad, v_max is never touched; e[kLists - 1] only fills the slot.
    adapnm_element<kDecoupledWd, kAmsgradOn>(e[0], e[1], e[2], e[3], e[4], e[kLists - 1], c);
  }
};

template <int kLists>
struct LaunchTable {
  // A launch is cut only by its tensor slots: a table names each tensor's first block and
  // first chunk, not every block, so one launch covers a whole large step (an earlier table of
  // 1,280 blocks cut a 1G-element step into 13 launches).
  static constexpr int kMaxBlocks = 1 << 30;
  static constexpr int kMaxTensors = 30000 / (8 * kLists + 24);
  void* ptrs[kLists][kMaxTensors];
  double* steps[kMaxTensors];  // float64: exact to 2^53 steps
  int64_t numels[kMaxTensors];
  int32_t block_begin[kMaxTensors];  // the slot's first block; its blocks end where the next
                                     // slot's blocks begin (an empty tensor owns none)
  int32_t first_chunk[kMaxTensors];  // chunk index inside the tensor of the slot's first block
  int64_t chunk_size;
  // Set when this launch is the whole step and increments its counters itself (see
  // finish_launch); null otherwise.
  unsigned int* blocks_done;
  int num_tensors;
  int num_blocks;
};

// Which chunk of which tensor slot a block updates. The slot is the last one beginning at or
// before the block (an empty tensor begins where the next one does, so it is never the last):
// a binary search over the table.
struct BlockChunk {
  int slot;
  int64_t chunk;  // inside its tensor
};

template <class Table>
PNM_HOST_DEVICE BlockChunk block_chunk(const Table& tab, int block) {
  int lo = 0;
  int hi = tab.num_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tab.block_begin[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return {lo, tab.first_chunk[lo] + static_cast<int64_t>(block - tab.block_begin[lo])};
}

// Step counters are incremented by a second, tiny launch after the launches that read them,
// unless the step is a single launch given a blocks_done counter.
struct StepCounterTable {
  static constexpr int kMax = 1024;
  double* steps[kMax];
  int count;
};

// Scalars shared by every block of a step. Pointers are device pointers (host ones when
// emulated); lr_ptr, lr_f64_ptr, grad_scale and found_inf may be null.
struct StepArgs {
  Hyper hyper;
  double lr;
  // An lr tensor on the params' device, read by the kernel: float32, or float64 (whose digits
  // float64 parameters need in full). Neither: the host's lr above.
  const float* lr_ptr;
  const double* lr_f64_ptr;
  const float* grad_scale;
  const float* found_inf;
};

PNM_HOST_DEVICE double step_lr(const StepArgs& args) {
  if (args.lr_f64_ptr != nullptr) return *args.lr_f64_ptr;
  return args.lr_ptr != nullptr ? static_cast<double>(*args.lr_ptr) : args.lr;
}

// Test hook: smaller chunks and tables make chunk and launch boundaries reachable with small
// tensors. Zero means "the default (default_chunk_size) / the table's capacity".
struct LaunchLimits {
  int64_t chunk_size = 0;
  int max_tensors = 0;
  int max_blocks = 0;
  // The most blocks a step may have to be a single launch: the device's SM count on a GPU
  // (one block per SM, so the single-launch kernel can have all the registers it likes),
  // no limit in the emulation.
  int max_single_launch_blocks = 0;
};
LaunchLimits& launch_limits();

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Storage to its arithmetic type (fp32; fp64 for fp64). bf16 is widened by a shift, which is
// what c10's conversion computes, but on the GPU c10 goes through __bfloat162float on the
// element's address, and that took bf16 AdaPNM-AMSGrad from 63 to 104 registers a thread (one
// block per SM instead of two).
template <typename T>
PNM_HOST_DEVICE opmath_t<T> widen(T v) {
  return static_cast<opmath_t<T>>(v);
}

template <>
PNM_HOST_DEVICE float widen(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  memcpy(&out, &bits, sizeof(out));
  return out;
}

// An inf/NaN found in the gradients (AMP): the step changes nothing, counters included.
PNM_HOST_DEVICE bool step_skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.0f;
}

// The body of one thread block: one chunk of one tensor.
template <typename T, class Algo>
PNM_HOST_DEVICE void step_block(const LaunchTable<Algo::kLists>& tab, const StepArgs& args,
                                int block, int thread, int block_dim) {
  using C = opmath_t<T>;
  constexpr int L = Algo::kLists;
  constexpr int kVec = kVecBytes / sizeof(T);
  if (step_skipped(args.found_inf)) return;

  const BlockChunk where = block_chunk(tab, block);
  const int slot = where.slot;
  const int64_t begin = where.chunk * tab.chunk_size;
  const int64_t left = tab.numels[slot] - begin;
  const int64_t n = left < tab.chunk_size ? left : tab.chunk_size;
  // The counter is incremented only after every block has read it: this step is t = old + 1.
  const double step = static_cast<double>(*tab.steps[slot]) + 1.0;
  const bool odd = (static_cast<int64_t>(step) & 1) != 0;
  const double lr = step_lr(args);
  const Coeffs<C> c = make_coeffs<C>(args.hyper, lr, step, Algo::kAdaptive);
  const C gf = grad_factor<C>(args.hyper.maximize, args.grad_scale);

  T* ptr[L];
  bool aligned = true;
PNM_UNROLL
  for (int l = 0; l < L; ++l) {
    ptr[l] = static_cast<T*>(tab.ptrs[l][slot]) + begin;
    aligned = aligned && reinterpret_cast<uintptr_t>(ptr[l]) % kVecBytes == 0;
  }
  if (!odd) {  // even steps update the negative buffer and read the positive one
    T* tmp = ptr[2];
    ptr[2] = ptr[3];
    ptr[3] = tmp;
  }

  int64_t scalar_begin = 0;
  if (aligned) {
    const int64_t n_vec = n / kVec;
    for (int64_t v = thread; v < n_vec; v += block_dim) {
      // Elements stay packed in their storage type and are widened one at a time: widening
      // all of them first took twice the registers with 2-byte types (123 for bf16 AdaPNM
      // against 60 for fp32), which halved the blocks an SM could hold.
      Pack<T, kVec> pack[L];
PNM_UNROLL
      for (int l = 0; l < L; ++l) pack[l] = reinterpret_cast<const Pack<T, kVec>*>(ptr[l])[v];
PNM_UNROLL
      for (int j = 0; j < kVec; ++j) {
        C e[L];
PNM_UNROLL
        for (int l = 0; l < L; ++l) e[l] = widen(pack[l].v[j]);
        e[1] *= gf;
        Algo::apply(e, c);
PNM_UNROLL
        for (int l = 0; l < L; ++l) {
          if (is_written(l)) pack[l].v[j] = static_cast<T>(e[l]);
        }
      }
PNM_UNROLL
      for (int l = 0; l < L; ++l) {
        if (is_written(l)) reinterpret_cast<Pack<T, kVec>*>(ptr[l])[v] = pack[l];
      }
    }
    scalar_begin = n_vec * kVec;
  }
  // Masked path: the tail of an aligned chunk, or a whole chunk with a misaligned tensor.
  for (int64_t i = scalar_begin + thread; i < n; i += block_dim) {
    C e[L];
PNM_UNROLL
    for (int l = 0; l < L; ++l) e[l] = widen(ptr[l][i]);
    e[1] *= gf;
    Algo::apply(e, c);
PNM_UNROLL
    for (int l = 0; l < L; ++l) {
      if (is_written(l)) ptr[l][i] = static_cast<T>(e[l]);
    }
  }
}

PNM_HOST_DEVICE void increment_steps(const StepCounterTable& tab, const float* found_inf,
                                     int thread, int block_dim) {
  if (step_skipped(found_inf)) return;
  for (int i = thread; i < tab.count; i += block_dim) *tab.steps[i] += 1.0;
}

// A step that is a single launch given a blocks_done counter (zero between steps) needs no
// second launch for its counters: each block takes a ticket once it is done, so once it has
// read its counter, and the block that takes the last ticket, knowing every other block has
// read theirs, calls this to increment them all and zero blocks_done for the next step. No
// ticket is taken in a step skipped for found_inf.
template <int kLists>
PNM_HOST_DEVICE void finish_launch(const LaunchTable<kLists>& tab, int thread, int block_dim) {
  for (int i = thread; i < tab.num_tensors; i += block_dim) *tab.steps[i] += 1.0;
  if (thread == 0) *tab.blocks_done = 0;
}

// The chunk size of a step: the default for its element size, or, where that makes the step
// too many blocks for one launch (more than max_single_blocks; zero: no cap, no need) and
// chunks of kSingleLaunchChunk would not, those: the step is then one launch instead of the
// step and the counter launches. That takes an fp32 step of 0.54M-2.2M elements (on a GPU of
// 132 SMs) to one launch. On an H200 (docs/performance.md; a chunk size set for flat1M gave
// it exactly this plan), fp32 flat1M took 0.044 ms a PNM step with 16,384-element chunks
// against 0.055 with 4,096 (AdaPNM 0.048 against 0.054): steps of this size are host-bound,
// and a launch less is host time less.
// A chunk size set through the test hook is kept as it is.
constexpr int64_t kSingleLaunchChunk = 16384;
inline int64_t step_chunk_size(int num_tensors, const int64_t* numels, size_t element_size,
                               const LaunchLimits& limits, int max_single_blocks) {
  if (limits.chunk_size > 0) return limits.chunk_size;
  const int64_t standard = default_chunk_size(element_size);
  if (max_single_blocks <= 0 || standard >= kSingleLaunchChunk) return standard;
  auto fits = [&](int64_t chunk) {  // stops counting past the cap: steps of many tensors
    int64_t total = 0;
    for (int i = 0; i < num_tensors && total <= max_single_blocks; ++i) {
      total += (numels[i] + chunk - 1) / chunk;
    }
    return total <= max_single_blocks;
  };
  if (fits(standard)) return standard;
  return fits(kSingleLaunchChunk) ? kSingleLaunchChunk : standard;
}

// Host side: cut tensors into chunks and fill launch tables. ptrs[i * kLists + l] is list l's
// pointer for tensor i. A tensor whose chunks do not fit is continued in the next table. An
// empty tensor gets a slot but no block: its counter is counted in a single-launch step.
// Chunks are step_chunk_size's; max_single_blocks: the most blocks a single launch of this
// step may have (zero where it has no blocks_done counter).
// A table type with more per-tensor fields (state_block.h's SeededTable) fills them in
// fill_slot(table, slot, tensor index).
struct NoSlotExtras {
  template <class Table>
  void operator()(Table&, int, int) const {}
};

template <int kLists, class Table = LaunchTable<kLists>, class FillSlot = NoSlotExtras>
std::vector<Table> plan_launches(int num_tensors, void* const* ptrs, double* const* steps,
                                 const int64_t* numels, size_t element_size,
                                 const LaunchLimits& limits, int max_single_blocks,
                                 FillSlot fill_slot = {}) {
  const int64_t chunk_size =
      step_chunk_size(num_tensors, numels, element_size, limits, max_single_blocks);
  const int max_tensors = limits.max_tensors > 0 && limits.max_tensors < Table::kMaxTensors
                              ? limits.max_tensors : Table::kMaxTensors;
  const int max_blocks = limits.max_blocks > 0 && limits.max_blocks < Table::kMaxBlocks
                             ? limits.max_blocks : Table::kMaxBlocks;
  // Room for every table up front: a table is ~30 KB, and growing the vector copied them all
  // (for 2,000 small tensors that was 100 us of a step's host time, the rest 5 us).
  int64_t chunks_total = 0;
  for (int i = 0; i < num_tensors; ++i) {
    chunks_total += (numels[i] + chunk_size - 1) / chunk_size;
  }
  std::vector<Table> tables;
  tables.reserve(num_tensors / max_tensors + chunks_total / max_blocks + 2);
  Table* cur = nullptr;
  auto open_table = [&]() {
    tables.emplace_back();
    cur = &tables.back();
    cur->chunk_size = chunk_size;
    cur->blocks_done = nullptr;
    cur->num_tensors = 0;
    cur->num_blocks = 0;
  };
  auto add_tensor = [&](int i, int64_t first_chunk) {
    const int slot = cur->num_tensors++;
    for (int l = 0; l < kLists; ++l) cur->ptrs[l][slot] = ptrs[i * kLists + l];
    cur->steps[slot] = steps[i];
    cur->numels[slot] = numels[i];
    cur->block_begin[slot] = cur->num_blocks;
    cur->first_chunk[slot] = static_cast<int32_t>(first_chunk);
    fill_slot(*cur, slot, i);
  };
  for (int i = 0; i < num_tensors; ++i) {
    if (cur == nullptr || cur->num_tensors == max_tensors) open_table();
    add_tensor(i, 0);
    const int64_t chunks = (numels[i] + chunk_size - 1) / chunk_size;
    for (int64_t chunk = 0; chunk < chunks;) {
      if (cur->num_blocks == max_blocks) {  // continued in the next table
        open_table();
        add_tensor(i, chunk);
      }
      const int64_t room = max_blocks - cur->num_blocks;
      const int64_t take = chunks - chunk < room ? chunks - chunk : room;
      cur->num_blocks += static_cast<int>(take);
      chunk += take;
    }
  }
  return tables;
}

// Whether a step planned as these tables runs as one launch that also increments the counters
// (it has a blocks_done counter, one table, and few enough blocks); if so, the table is set
// up for it.
template <int kLists>
bool make_single_launch(std::vector<LaunchTable<kLists>>& tables, unsigned int* blocks_done,
                        int max_blocks) {
  if (blocks_done == nullptr || tables.size() != 1) return false;
  if (max_blocks > 0 && tables[0].num_blocks > max_blocks) return false;
  tables[0].blocks_done = blocks_done;
  return true;
}

// A single launch of empty tensors only is one block without a chunk (it counts them).
template <int kLists>
int single_launch_grid(const LaunchTable<kLists>& table) {
  return table.num_blocks > 0 ? table.num_blocks : 1;
}

inline std::vector<StepCounterTable> plan_step_counters(int num_tensors, double* const* steps) {
  std::vector<StepCounterTable> tables;
  for (int i = 0; i < num_tensors; ++i) {
    if (i % StepCounterTable::kMax == 0) {
      tables.emplace_back();
      tables.back().count = 0;
    }
    tables.back().steps[tables.back().count++] = steps[i];
  }
  return tables;
}

}  // namespace pnm
