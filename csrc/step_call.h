// Host-side view of one op call, shared by the CPU, emulated-CUDA and CUDA implementations:
// the argument checks (done once, before anything is written) and the dtype/mode dispatch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <array>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "multi_tensor_apply.h"

namespace pnm {

struct StepCall {
  // Lists in the table order of multi_tensor_apply.h; num_lists of them are used. Views of
  // the op's arguments (no copies: a StepCall lives only as long as the op call).
  at::TensorList lists[6];
  int num_lists = 0;
  at::TensorList steps;
  Hyper hyper{};
  double lr = 0.0;
  std::optional<at::Tensor> lr_tensor, grad_scale, found_inf;
  // One int32 counter, zero between steps, with which a small CUDA step is a single launch
  // that increments the step counters itself (multi_tensor_apply.h); the CPU kernel has no
  // use for it.
  std::optional<at::Tensor> blocks_done;
  bool adaptive = false, decoupled = true, amsgrad = false;
  // State in a dtype of its own (the *_state_ ops, docs/design.md §7): the buffers' dtype,
  // each parameter's seed (int64) and the elements of the whole parameter before it.
  bool own_state_dtype = false;
  bool bf16_stochastic_round = false;  // bfloat16 parameters written stochastically too
  at::TensorList seeds;
  at::IntArrayRef offsets;
  // int8 state (the *_int8_ ops, docs/design.md §8): the buffers hold codes (int8 momenta,
  // uint8 second moments) and `scales` each buffer's block scales, buffer after buffer
  // (scales[(l - 2) * size() + i] for list l of tensor i).
  bool int8_state = false;
  at::TensorList scales;

  int64_t size() const { return static_cast<int64_t>(lists[0].size()); }
};

// Where a tensor's elements are: its storage, the storage's memory and its offset in it (none
// for a tensor without storage). `t.data = other` and `t.set_(...)` change the storage or
// offset; `t.share_memory_()` and a storage resized to nothing and back (FSDP1's freeing)
// move the memory under the same storage, where another storage may then alias it
// (`torch.from_dlpack(t)`), unseen by spans kept from where it was. The data pointer costs
// a load from the storage, which the kernel's arguments read anyway.
struct Memory {
  const void* storage;
  const void* data;
  int64_t offset;
  bool lazy;  // read through a lazy negation or conjugation (is_lazy_view)
  bool operator!=(const Memory& other) const {
    return storage != other.storage || data != other.data || offset != other.offset ||
           lazy != other.lazy;
  }
};

// A tensor whose elements are its memory negated or conjugated when read (`.conj()`,
// `torch._neg_view`, `z.conj().imag`): the kernels read and write the memory itself, so no
// step takes one. As is_neg() || is_conj(), a test of the dispatch keys.
inline bool is_lazy_view(const at::Tensor& t) {
  return t.defined() && (t.is_neg() || t.is_conj());
}

// The length of an int8-state parameter's rows (its dim-0 slices): from its shape, not
// numel / rows, as an FSDP2 shard of a parameter with fewer rows than ranks holds none.
inline int64_t int8_row_length(const at::Tensor& p) {
  int64_t length = 1;
  for (int64_t d = 1; d < p.dim(); ++d) length *= p.size(d);
  return length;
}

inline Memory memory_of(const at::Tensor& t) {
  if (!t.defined()) return {nullptr, nullptr, 0, false};
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
  return {storage, storage != nullptr ? storage->data_ptr().get() : nullptr,
          impl->storage_offset(), is_lazy_view(t)};
}

// The memory of held lists' tensors (StepLists): blocks of params, buffer0..3 and steps.
using HeldMemory = std::array<std::vector<Memory>, 6>;

// For the length of one op call from held lists, the memory each tensor of the call must be
// at (`at`: each tensor's index in the held lists, for a call over some of them; null for
// all): check_call compares it as it checks each tensor, in the pass it makes over them
// anyway (a pass of its own cost a cache miss a tensor, every step), and refuses a tensor
// given other memory since the lists were made.
class ExpectMemory {
 public:
  ExpectMemory(const HeldMemory& memory, const std::vector<int64_t>* at);
  ~ExpectMemory();  // restores the expectation before it (a call made inside this one)
  ExpectMemory(const ExpectMemory&) = delete;
  ExpectMemory& operator=(const ExpectMemory&) = delete;

  const HeldMemory* memory;
  const std::vector<int64_t>* at;

 private:
  const ExpectMemory* previous_;
};

// Builds and validates a call; throws (c10::Error) naming the argument and tensor index.
StepCall make_pnm_call(at::TensorList params, at::TensorList grads, at::TensorList pos_momentums,
                       at::TensorList neg_momentums, at::TensorList steps, double lr,
                       double beta1, double beta0, double weight_decay, bool decoupled,
                       bool maximize, const std::optional<at::Tensor>& lr_tensor,
                       const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf,
                       const std::optional<at::Tensor>& blocks_done, c10::DeviceType device_type,
                       at::TensorList seeds = {}, at::IntArrayRef offsets = {},
                       bool own_state_dtype = false, bool bf16_stochastic_round = false,
                       at::TensorList scales = {});

StepCall make_adapnm_call(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList neg_exp_avgs, at::TensorList exp_avg_sqs,
                          at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr,
                          double beta1, double beta2, double beta0, double eps,
                          double weight_decay, bool amsgrad, bool decoupled, bool maximize,
                          const std::optional<at::Tensor>& lr_tensor,
                          const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf,
                          const std::optional<at::Tensor>& blocks_done,
                          c10::DeviceType device_type, at::TensorList seeds = {},
                          at::IntArrayRef offsets = {}, bool own_state_dtype = false,
                          bool bf16_stochastic_round = false, at::TensorList scales = {});

// Same memory layout: equal strides on every dimension that has more than one element.
inline bool same_layout_as(const at::Tensor& a, const at::Tensor& b) {
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

// What the kernels need of every list: dense, and laid out like the parameter. Both
// contiguous is the common case, answered from cached flags. Inline: the checks of a step
// over thousands of tensors call it for each.
inline bool dense_like(const at::Tensor& t, const at::Tensor& p) {
  return (t.is_contiguous() && p.is_contiguous()) ||
         (t.is_non_overlapping_and_dense() && same_layout_as(t, p));
}

// A step counter (one float64 element, checked before) the kernels may advance: on the CPU, a
// whole number of steps >= 0, as the reference asks (at -1 AdaPNM divides by a bias
// correction of 0; at 2.5 the kernels would use 3.5 where the reference uses 3). It can be
// filled in place between steps, so held lists read it at every step. One on a device is not
// read: that would synchronise.
inline bool is_whole_count(double v) {
  return std::isfinite(v) && v >= 0.0 && v == std::floor(v);
}

inline bool counts_whole_steps(const at::Tensor& step) {
  if (!step.device().is_cpu()) return true;
  return is_whole_count(*static_cast<const double*>(step.const_data_ptr()));
}

// The optimizer's per-step gradient check for a batch, without a Python loop: the index of
// the first gradient that does not fit its parameter, -1 if all do. With same_layout, a
// gradient that is not dense and laid out like its parameter, or shares its memory, counts too.
int64_t first_mismatched_grad(at::TensorList params, at::TensorList grads, bool same_layout);

// Bumps the version counter of every tensor the op may write (all but the grads), as torch's
// in-place ops do: autograd then refuses a backward through a graph that saved a parameter
// the step changed, instead of using the new values. Inference tensors have no counter
// (torch.autograd.graph.increment_version skips them too).
void bump_versions(const StepCall& call);
void bump_versions_of(at::TensorList tensors);

// Kernel scalars. Device-resident scalars become pointers; an lr tensor on the CPU is read here.
StepArgs make_step_args(const StepCall& call);

// Raw pointers in the layout plan_launches() takes.
struct GatheredPointers {
  std::vector<void*> ptrs;  // tensor-major, num_lists per tensor
  std::vector<double*> steps;
  std::vector<int64_t> numels;
};
GatheredPointers gather_pointers(const StepCall& call);

// The call's blocks_done counter as the launch tables take it; null without one.
inline unsigned int* blocks_done_ptr(const StepCall& call) {
  return call.blocks_done.has_value() ? static_cast<unsigned int*>(call.blocks_done->data_ptr())
                                      : nullptr;
}

template <class T>
struct Tag {
  using type = T;
};

// Calls f(Tag<scalar_t>{}, Tag<Algo>{}) with the compile-time types the call needs.
template <class F>
void dispatch_step(const StepCall& call, F&& f) {
  auto by_mode = [&](auto dtype_tag) {
    if (!call.adaptive) {
      if (call.decoupled) f(dtype_tag, Tag<PnmAlgo<true>>{});
      else f(dtype_tag, Tag<PnmAlgo<false>>{});
    } else if (call.amsgrad) {
      if (call.decoupled) f(dtype_tag, Tag<AdaPnmAlgo<true, true>>{});
      else f(dtype_tag, Tag<AdaPnmAlgo<false, true>>{});
    } else {
      if (call.decoupled) f(dtype_tag, Tag<AdaPnmAlgo<true, false>>{});
      else f(dtype_tag, Tag<AdaPnmAlgo<false, false>>{});
    }
  };
  switch (call.lists[0][0].scalar_type()) {
    case at::kFloat: by_mode(Tag<float>{}); break;
    case at::kDouble: by_mode(Tag<double>{}); break;
    case at::kHalf: by_mode(Tag<c10::Half>{}); break;
    case at::kBFloat16: by_mode(Tag<c10::BFloat16>{}); break;
    default: TORCH_CHECK(false, "pnm_kernels: unsupported dtype ", call.lists[0][0].scalar_type());
  }
}

// For the state ops: calls f(Tag<param type>, Tag<state type>, Tag<Algo>): bfloat16 state
// beside float32, float16 or bfloat16 parameters, float32 state beside 16-bit ones (the
// call's checks allowed no other pair).
template <class F>
void dispatch_state_step(const StepCall& call, F&& f) {
  dispatch_step(call, [&](auto dtype_tag, auto algo_tag) {
    using T = typename decltype(dtype_tag)::type;
    if constexpr (std::is_same_v<T, double>) {
      TORCH_CHECK(false, "pnm_kernels: float64 parameters keep float64 state");
    } else if (call.lists[2][0].scalar_type() == at::kBFloat16) {
      f(dtype_tag, Tag<c10::BFloat16>{}, algo_tag);
    } else if constexpr (!std::is_same_v<T, float>) {
      f(dtype_tag, Tag<float>{}, algo_tag);
    } else {
      TORCH_CHECK(false, "pnm_kernels: float32 state of float32 parameters is the plain step");
    }
  });
}

// For the int8 ops: calls f(Tag<param type>, Tag<Algo>) for float32, float16 and bfloat16
// parameters (float64 ones keep float64 state; the optimizer never asks).
template <class F>
void dispatch_int8_step(const StepCall& call, F&& f) {
  dispatch_step(call, [&](auto dtype_tag, auto algo_tag) {
    if constexpr (std::is_same_v<typename decltype(dtype_tag)::type, double>) {
      TORCH_CHECK(false, "pnm_kernels: float64 parameters keep float64 state");
    } else {
      f(dtype_tag, algo_tag);
    }
  });
}

// The state ops' seeds and offsets as the launch tables take them: a pointer to each
// tensor's seed (none where nothing rounds stochastically) and its offset.
struct GatheredSeeds {
  std::vector<const int64_t*> seeds;
  std::vector<int64_t> offsets;
};
GatheredSeeds gather_seeds(const StepCall& call);

// A list of none or one tensor (an optional argument the op writes: ops.cpp says why) as
// the optional it stands for.
inline std::optional<at::Tensor> one_or_none(at::TensorList list, const char* name) {
  TORCH_CHECK(list.size() <= 1, "pnm_kernels: ", name, " takes none or one tensor, got ",
              list.size());
  return list.empty() ? std::nullopt : std::optional<at::Tensor>(list[0]);
}

// The op entry points, one per schema; Impl supplies kDevice and run(const StepCall&).
template <class Impl>
void pnm_step_op(at::TensorList params, at::TensorList grads, at::TensorList pos_momentums,
                 at::TensorList neg_momentums, at::TensorList steps,
                 at::TensorList blocks_done, double lr, double beta1,
                 double beta0, double weight_decay, bool decoupled, bool maximize,
                 const std::optional<at::Tensor>& lr_tensor,
                 const std::optional<at::Tensor>& grad_scale,
                 const std::optional<at::Tensor>& found_inf) {
  const StepCall call =
      make_pnm_call(params, grads, pos_momentums, neg_momentums, steps, lr, beta1, beta0,
                    weight_decay, decoupled, maximize, lr_tensor, grad_scale, found_inf,
                    one_or_none(blocks_done, "blocks_done"), Impl::kDevice);
  bump_versions(call);
  Impl::run(call);
}

template <class Impl>
void adapnm_step_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList neg_exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList max_exp_avg_sqs, at::TensorList steps,
                    at::TensorList blocks_done, double lr, double beta1,
                    double beta2, double beta0, double eps, double weight_decay, bool amsgrad,
                    bool decoupled, bool maximize, const std::optional<at::Tensor>& lr_tensor,
                    const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf) {
  const StepCall call =
      make_adapnm_call(params, grads, exp_avgs, neg_exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                       steps, lr, beta1, beta2, beta0, eps, weight_decay, amsgrad, decoupled,
                       maximize, lr_tensor, grad_scale, found_inf,
                       one_or_none(blocks_done, "blocks_done"), Impl::kDevice);
  bump_versions(call);
  Impl::run(call);
}

// The ops with state in a dtype of its own (CPU only): the same arguments and seeds, offsets.
template <class Impl>
void pnm_state_step_op(at::TensorList params, at::TensorList grads,
                       at::TensorList pos_momentums, at::TensorList neg_momentums,
                       at::TensorList steps, at::TensorList seeds, at::IntArrayRef offsets,
                       double lr, double beta1, double beta0, double weight_decay,
                       bool decoupled, bool maximize, const std::optional<at::Tensor>& lr_tensor,
                       const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf, bool bf16_stochastic_round) {
  const StepCall call = make_pnm_call(
      params, grads, pos_momentums, neg_momentums, steps, lr, beta1, beta0, weight_decay,
      decoupled, maximize, lr_tensor, grad_scale, found_inf, std::nullopt, Impl::kDevice, seeds,
      offsets, /*own_state_dtype=*/true, bf16_stochastic_round);
  bump_versions(call);
  Impl::run(call);
}

template <class Impl>
void adapnm_state_step_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList neg_exp_avgs, at::TensorList exp_avg_sqs,
                          at::TensorList max_exp_avg_sqs, at::TensorList steps,
                          at::TensorList seeds, at::IntArrayRef offsets, double lr,
                          double beta1, double beta2, double beta0, double eps,
                          double weight_decay, bool amsgrad, bool decoupled, bool maximize,
                          const std::optional<at::Tensor>& lr_tensor,
                          const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf,
                          bool bf16_stochastic_round) {
  const StepCall call = make_adapnm_call(
      params, grads, exp_avgs, neg_exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1,
      beta2, beta0, eps, weight_decay, amsgrad, decoupled, maximize, lr_tensor, grad_scale,
      found_inf, std::nullopt, Impl::kDevice, seeds, offsets, /*own_state_dtype=*/true,
      bf16_stochastic_round);
  bump_versions(call);
  Impl::run(call);
}

// The ops with int8 state (CPU only): the state ops' arguments and each buffer's scales.
template <class Impl>
void pnm_int8_step_op(at::TensorList params, at::TensorList grads,
                      at::TensorList pos_momentums, at::TensorList neg_momentums,
                      at::TensorList steps, at::TensorList seeds, at::IntArrayRef offsets,
                      at::TensorList scales, double lr, double beta1, double beta0,
                      double weight_decay, bool decoupled, bool maximize,
                      const std::optional<at::Tensor>& lr_tensor,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf, bool bf16_stochastic_round) {
  const StepCall call = make_pnm_call(
      params, grads, pos_momentums, neg_momentums, steps, lr, beta1, beta0, weight_decay,
      decoupled, maximize, lr_tensor, grad_scale, found_inf, std::nullopt, Impl::kDevice, seeds,
      offsets, /*own_state_dtype=*/true, bf16_stochastic_round, scales);
  bump_versions(call);
  bump_versions_of(scales);
  Impl::run(call);
}

template <class Impl>
void adapnm_int8_step_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList neg_exp_avgs, at::TensorList exp_avg_sqs,
                         at::TensorList max_exp_avg_sqs, at::TensorList steps,
                         at::TensorList seeds, at::IntArrayRef offsets, at::TensorList scales,
                         double lr, double beta1, double beta2, double beta0, double eps,
                         double weight_decay, bool amsgrad, bool decoupled, bool maximize,
                         const std::optional<at::Tensor>& lr_tensor,
                         const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf, bool bf16_stochastic_round) {
  const StepCall call = make_adapnm_call(
      params, grads, exp_avgs, neg_exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1,
      beta2, beta0, eps, weight_decay, amsgrad, decoupled, maximize, lr_tensor, grad_scale,
      found_inf, std::nullopt, Impl::kDevice, seeds, offsets, /*own_state_dtype=*/true,
      bf16_stochastic_round, scales);
  bump_versions(call);
  bump_versions_of(scales);
  Impl::run(call);
}

// The ops' C++ signatures, as the dispatcher's typed handles take them (StepLists calls the
// registered ops). Impl does not enter the signature.
using PnmStepFn = decltype(pnm_step_op<void>);
using AdaPnmStepFn = decltype(adapnm_step_op<void>);
using PnmStateStepFn = decltype(pnm_state_step_op<void>);
using AdaPnmStateStepFn = decltype(adapnm_state_step_op<void>);
using PnmInt8StepFn = decltype(pnm_int8_step_op<void>);
using AdaPnmInt8StepFn = decltype(adapnm_int8_step_op<void>);

}  // namespace pnm
