// The methods of StepLists, StateLists and HeldLayouts (step_lists.h).
#include "step_lists.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <utility>

#include "step_call.h"

namespace pnm {
namespace {

// Some tensors of a list, borrowed: a list for a call, without a reference-count increment
// and decrement for each tensor. A step where some held parameters lack a gradient takes the
// others from six lists: copied, the host time of a 2,000-tensor AdaPNM step with 10 % of its
// gradients missing was 0.48-0.52 ms, borrowed 0.36-0.39 (0.34-0.38 with none missing;
// docs/performance.md). The list it borrows from must outlive it (StepLists holds its lists).
class BorrowedSubset {
 public:
  BorrowedSubset(const std::vector<at::Tensor>& list, const std::vector<int64_t>& at) {
    if (list.empty()) return;  // a buffer this optimizer does not hold (buffer3 without AMSGrad)
    tensors_.reserve(at.size());
    for (int64_t i : at) {
      const at::Tensor& t = list[static_cast<size_t>(i)];
      tensors_.push_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t));
    }
  }
  ~BorrowedSubset() {
    for (at::Tensor& t : tensors_) c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
  }
  BorrowedSubset(const BorrowedSubset&) = delete;
  BorrowedSubset& operator=(const BorrowedSubset&) = delete;
  const std::vector<at::Tensor>& get() const { return tensors_; }

 private:
  std::vector<at::Tensor> tensors_;
};

template <class Fn>
c10::TypedOperatorHandle<Fn> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// A held buffer still fits its parameter as the kernels need (what check_call asks of it).
inline bool buffer_fits(const at::Tensor& b, const at::Tensor& p) {
  return b.scalar_type() == p.scalar_type() && b.device() == p.device() &&
         b.sizes().equals(p.sizes()) && dense_like(b, p);
}

// A held step counter is still what the kernels read and write (what check_call asks of it),
// of shape () as the planned step leaves every counter (a one-element one of another shape,
// given by hand through .data, is put back in that shape there: counters.as_step).
inline bool counter_fits(const at::Tensor& s, const at::Tensor& p) {
  return s.defined() && s.scalar_type() == at::kDouble && s.dim() == 0 &&
         s.device() == p.device() && counts_whole_steps(s);
}

// Gradients handed to held lists must not be lazy negative or conjugate views: the
// dispatcher's fallback would step a resolved copy of them where the planned step refuses
// them (check_param), naming them (the deferred step's refusal is explained so).
void check_grads_resolved(const std::vector<at::Tensor>& grads) {
  for (size_t i = 0; i < grads.size(); ++i) {
    TORCH_CHECK(!is_lazy_view(grads[i]), "pnm_kernels: grads[", i,
                "] is an unresolved negative or conjugate view");
  }
}

}  // namespace

void StepLists::pnm_step(std::vector<at::Tensor> grads, bool emulate, double lr, double beta1,
                         double beta0, double weight_decay, bool decoupled, bool maximize,
                         std::optional<at::Tensor> lr_tensor,
                         std::optional<at::Tensor> grad_scale,
                         std::optional<at::Tensor> found_inf) {
  check_grads_resolved(grads);
  pnm_step_on(params, grads, buffer0, buffer1, steps, nullptr, emulate, lr, beta1, beta0,
              weight_decay, decoupled, maximize, lr_tensor, grad_scale, found_inf);
}

void StepLists::adapnm_step(std::vector<at::Tensor> grads, bool emulate, double lr,
                            double beta1, double beta2, double beta0, double eps,
                            double weight_decay, bool amsgrad, bool decoupled, bool maximize,
                            std::optional<at::Tensor> lr_tensor,
                            std::optional<at::Tensor> grad_scale,
                            std::optional<at::Tensor> found_inf) {
  check_grads_resolved(grads);
  adapnm_step_on(params, grads, buffer0, buffer1, buffer2, buffer3, steps, nullptr, emulate, lr,
                 beta1, beta2, beta0, eps, weight_decay, amsgrad, decoupled, maximize, lr_tensor,
                 grad_scale, found_inf);
}

bool StepLists::pnm_step_own_grads(bool use_taken, bool emulate, double lr, double beta1,
                                   double beta0, double weight_decay, bool decoupled,
                                   bool maximize, std::optional<at::Tensor> lr_tensor,
                                   std::optional<at::Tensor> grad_scale,
                                   std::optional<at::Tensor> found_inf) {
  OwnGrads own;
  if (!own_or_taken_grads(use_taken, own)) return false;
  if (own.grads.empty()) return true;  // no parameter has a gradient: none steps
  if (own.present.empty()) {
    pnm_step(std::move(own.grads), emulate, lr, beta1, beta0, weight_decay, decoupled, maximize,
             lr_tensor, grad_scale, found_inf);
  } else {
    const auto& at = own.present;
    pnm_step_on(BorrowedSubset(params, at).get(), own.grads, BorrowedSubset(buffer0, at).get(),
                BorrowedSubset(buffer1, at).get(), BorrowedSubset(steps, at).get(), &at, emulate,
                lr, beta1, beta0, weight_decay, decoupled, maximize, lr_tensor, grad_scale,
                found_inf);
  }
  return true;
}

bool StepLists::adapnm_step_own_grads(bool use_taken, bool emulate, double lr, double beta1,
                                      double beta2, double beta0, double eps,
                                      double weight_decay, bool amsgrad, bool decoupled,
                                      bool maximize, std::optional<at::Tensor> lr_tensor,
                                      std::optional<at::Tensor> grad_scale,
                                      std::optional<at::Tensor> found_inf) {
  OwnGrads own;
  if (!own_or_taken_grads(use_taken, own)) return false;
  if (own.grads.empty()) return true;  // no parameter has a gradient: none steps
  if (own.present.empty()) {
    adapnm_step(std::move(own.grads), emulate, lr, beta1, beta2, beta0, eps, weight_decay,
                amsgrad, decoupled, maximize, lr_tensor, grad_scale, found_inf);
  } else {
    const auto& at = own.present;
    adapnm_step_on(BorrowedSubset(params, at).get(), own.grads,
                   BorrowedSubset(buffer0, at).get(), BorrowedSubset(buffer1, at).get(),
                   BorrowedSubset(buffer2, at).get(), BorrowedSubset(buffer3, at).get(),
                   BorrowedSubset(steps, at).get(), &at, emulate, lr, beta1, beta2, beta0, eps,
                   weight_decay, amsgrad, decoupled, maximize, lr_tensor, grad_scale,
                   found_inf);
  }
  return true;
}

bool StepLists::take_own_grads() {
  drop_taken_grads();
  OwnGrads own;
  if (!own_grads(own) || !held_lists_ok()) return false;
  taken = std::move(own);
  has_taken = true;
  return true;
}

void StepLists::drop_taken_grads() {
  taken = OwnGrads();
  has_taken = false;
}

void StepLists::hold_outside(std::vector<at::Tensor> params_without_state) {
  outside = std::move(params_without_state);
}

HeldMemory StepLists::memory_now() const {
  HeldMemory memory;
  int block = 0;
  for (const std::vector<at::Tensor>* list :
       {&params, &buffer0, &buffer1, &buffer2, &buffer3, &steps}) {
    for (const at::Tensor& t : *list) memory[block].push_back(memory_of(t));
    ++block;
  }
  return memory;
}

bool StepLists::memory_unchanged() const {
  int block = 0;
  for (const std::vector<at::Tensor>* list :
       {&params, &buffer0, &buffer1, &buffer2, &buffer3, &steps}) {
    const std::vector<Memory>& held = memory_[block++];
    if (held.size() != list->size()) return false;
    for (size_t i = 0; i < held.size(); ++i) {
      if (memory_of((*list)[i]) != held[i]) return false;
    }
  }
  return true;
}

bool StepLists::held_lists_ok() const {
  const size_t n = params.size();
  if (buffer0.size() != n || steps.size() != n || !memory_unchanged()) return false;
  // The buffers held (a list with tensors), each needing one tensor per parameter.
  const std::vector<at::Tensor>* held[4];
  int num_held = 0;
  for (const std::vector<at::Tensor>* list : {&buffer0, &buffer1, &buffer2, &buffer3}) {
    if (list->empty()) continue;
    if (list->size() != n) return false;
    held[num_held++] = list;
  }
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    for (int l = 0; l < num_held; ++l) {
      if (!buffer_fits((*held[l])[i], p)) return false;
    }
    if (!counter_fits(steps[i], p)) return false;
  }
  return true;
}

void StepLists::bump_versions(int64_t num_buffers) {
  const std::vector<at::Tensor>* lists[] = {&params, &buffer0, &buffer1, &buffer2, &buffer3};
  for (int64_t l = 0; l < 1 + num_buffers && l < 5; ++l) bump_versions_of(*lists[l]);
  bump_versions_of(steps);
}

at::Tensor StepLists::own_grad_pointers(bool use_taken, int64_t num_buffers) {
  OwnGrads own;
  if (!own_or_taken_grads(use_taken, own) || own.grads.size() != params.size() ||
      params.empty() || (!use_taken && !held_lists_ok())) {
    return at::empty({0}, at::kLong);
  }
  return pointers(std::move(own.grads), num_buffers);
}

at::Tensor StepLists::pointers(std::vector<at::Tensor> grads, int64_t num_buffers) {
  TORCH_CHECK(grads.size() == params.size() && num_buffers >= 0 && num_buffers <= 4,
              "pnm_kernels: StepLists.pointers: ", grads.size(), " grads for ", params.size(),
              " params, ", num_buffers, " buffers");
  const std::vector<at::Tensor>* lists[] = {&params, &grads, &buffer0, &buffer1, &buffer2,
                                            &buffer3};
  const int64_t n = static_cast<int64_t>(params.size());
  at::Tensor out = at::empty({(4 + num_buffers) * n}, at::kLong);
  int64_t* dst = out.data_ptr<int64_t>();
  for (int64_t l = 0; l < 2 + num_buffers; ++l) {
    TORCH_CHECK(static_cast<int64_t>(lists[l]->size()) == n,
                "pnm_kernels: StepLists.pointers: buffer ", l - 2, " is not held");
    for (const at::Tensor& t : *lists[l]) *dst++ = reinterpret_cast<intptr_t>(t.data_ptr());
  }
  for (const at::Tensor& t : steps) *dst++ = reinterpret_cast<intptr_t>(t.data_ptr());
  for (const at::Tensor& t : params) *dst++ = t.numel();
  return out;
}

bool StepLists::own_or_taken_grads(bool use_taken, OwnGrads& own) {
  if (!use_taken) return own_grads(own);
  TORCH_CHECK(has_taken, "pnm_kernels: StepLists: no gradients taken for this step");
  own = std::move(taken);
  drop_taken_grads();
  return true;
}

bool StepLists::own_grads(OwnGrads& own) const {
  for (const at::Tensor& p : outside) {
    if (p.grad().defined()) return false;
  }
  own.grads.reserve(params.size());
  own.present.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& g = params[i].grad();
    if (!g.defined()) continue;
    own.grads.push_back(g);
    own.present.push_back(static_cast<int64_t>(i));
  }
  if (own.grads.size() == params.size()) {
    own.present.clear();
    if (first_mismatched_grad(params, own.grads, /*same_layout=*/true) >= 0) return false;
  } else if (first_mismatched_grad(BorrowedSubset(params, own.present).get(), own.grads,
                                   /*same_layout=*/true) >= 0) {
    return false;
  }
  return !written_ || written_->first_met(own.grads) < 0;
}

void StepLists::watch_written(c10::intrusive_ptr<WrittenMemory> written) {
  written_ = std::move(written);
}

// Through the dispatcher, as a direct call from Python goes: the same checks, the same
// device's kernel (pnm_step_ on the params' device, or its emulation).
void StepLists::pnm_step_on(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g,
                            const std::vector<at::Tensor>& m,
                            const std::vector<at::Tensor>& m_other,
                            const std::vector<at::Tensor>& s,
                            const std::vector<int64_t>* at, bool emulate, double lr,
                            double beta1, double beta0, double weight_decay, bool decoupled,
                            bool maximize, const std::optional<at::Tensor>& lr_tensor,
                            const std::optional<at::Tensor>& grad_scale,
                            const std::optional<at::Tensor>& found_inf) {
  static const auto op = find_op<PnmStepFn>("pnm_kernels::pnm_step_");
  static const auto emulated = find_op<PnmStepFn>("pnm_kernels::emulated_cuda_pnm_step_");
  const ExpectMemory expect(memory_, at);
  (emulate ? emulated : op)
      .call(p, g, m, m_other, s, blocks_done, lr, beta1, beta0, weight_decay,
            decoupled, maximize, lr_tensor, grad_scale, found_inf);
}

void StepLists::adapnm_step_on(
    const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g,
    const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& m_other,
    const std::vector<at::Tensor>& v, const std::vector<at::Tensor>& v_max,
    const std::vector<at::Tensor>& s, const std::vector<int64_t>* at, bool emulate, double lr,
    double beta1, double beta2, double beta0, double eps, double weight_decay, bool amsgrad,
    bool decoupled, bool maximize, const std::optional<at::Tensor>& lr_tensor,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  static const auto op = find_op<AdaPnmStepFn>("pnm_kernels::adapnm_step_");
  static const auto emulated =
      find_op<AdaPnmStepFn>("pnm_kernels::emulated_cuda_adapnm_step_");
  const ExpectMemory expect(memory_, at);
  (emulate ? emulated : op)
      .call(p, g, m, m_other, v, v_max, s, blocks_done, lr, beta1, beta2, beta0, eps,
            weight_decay, amsgrad, decoupled, maximize, lr_tensor, grad_scale, found_inf);
}

void StateLists::pnm_step(std::vector<at::Tensor> grads, bool emulate, double lr,
                          double beta1, double beta0, double weight_decay, bool decoupled,
                          bool maximize, std::optional<at::Tensor> lr_tensor,
                          std::optional<at::Tensor> grad_scale,
                          std::optional<at::Tensor> found_inf, bool bf16_stochastic_round) {
  check_grads_resolved(grads);
  if (int8) {
    static const auto op = find_op<PnmInt8StepFn>("pnm_kernels::pnm_int8_step_");
    static const auto emulated =
        find_op<PnmInt8StepFn>("pnm_kernels::emulated_cuda_pnm_int8_step_");
    (emulate ? emulated : op)
        .call(params, grads, buffer0, buffer1, steps, seeds, offsets, scales, lr, beta1, beta0,
              weight_decay, decoupled, maximize, lr_tensor, grad_scale, found_inf,
              bf16_stochastic_round);
    return;
  }
  static const auto op = find_op<PnmStateStepFn>("pnm_kernels::pnm_state_step_");
  static const auto emulated =
      find_op<PnmStateStepFn>("pnm_kernels::emulated_cuda_pnm_state_step_");
  (emulate ? emulated : op)
      .call(params, grads, buffer0, buffer1, steps, seeds, offsets, lr, beta1, beta0,
            weight_decay, decoupled, maximize, lr_tensor, grad_scale, found_inf,
            bf16_stochastic_round);
}

void StateLists::adapnm_step(std::vector<at::Tensor> grads, bool emulate, double lr,
                             double beta1, double beta2, double beta0, double eps,
                             double weight_decay, bool amsgrad, bool decoupled, bool maximize,
                             std::optional<at::Tensor> lr_tensor,
                             std::optional<at::Tensor> grad_scale,
                             std::optional<at::Tensor> found_inf, bool bf16_stochastic_round) {
  check_grads_resolved(grads);
  if (int8) {
    static const auto op = find_op<AdaPnmInt8StepFn>("pnm_kernels::adapnm_int8_step_");
    static const auto emulated =
        find_op<AdaPnmInt8StepFn>("pnm_kernels::emulated_cuda_adapnm_int8_step_");
    (emulate ? emulated : op)
        .call(params, grads, buffer0, buffer1, buffer2, buffer3, steps, seeds, offsets, scales,
              lr, beta1, beta2, beta0, eps, weight_decay, amsgrad, decoupled, maximize,
              lr_tensor, grad_scale, found_inf, bf16_stochastic_round);
    return;
  }
  static const auto op = find_op<AdaPnmStateStepFn>("pnm_kernels::adapnm_state_step_");
  static const auto emulated =
      find_op<AdaPnmStateStepFn>("pnm_kernels::emulated_cuda_adapnm_state_step_");
  (emulate ? emulated : op)
      .call(params, grads, buffer0, buffer1, buffer2, buffer3, steps, seeds, offsets, lr, beta1,
            beta2, beta0, eps, weight_decay, amsgrad, decoupled, maximize, lr_tensor,
            grad_scale, found_inf, bf16_stochastic_round);
}

HeldLayouts::HeldLayouts(std::vector<at::Tensor> tensors, std::vector<at::Tensor> counters)
    : tensors_(std::move(tensors)), counters_(std::move(counters)) {
  layouts_.reserve(tensors_.size());
  for (const at::Tensor& t : tensors_) {
    TORCH_CHECK(t.defined() && t.layout() == at::kStrided,
                "pnm_kernels: HeldLayouts holds dense tensors");
    layouts_.push_back(
        {t.scalar_type(), t.device(), t.sizes().vec(), t.strides().vec(), memory_of(t)});
  }
}

bool HeldLayouts::unchanged() const {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const at::Tensor& t = tensors_[i];
    const Layout& was = layouts_[i];
    if (t.scalar_type() != was.dtype || t.device() != was.device ||
        t.layout() != at::kStrided || t.sizes() != at::IntArrayRef(was.sizes) ||
        t.strides() != at::IntArrayRef(was.strides) || memory_of(t) != was.memory) {
      return false;
    }
  }
  // Laid out as before (among the tensors), so each is one float64 element still.
  for (const at::Tensor& c : counters_) {
    if (!counts_whole_steps(c)) return false;
  }
  return true;
}

}  // namespace pnm
