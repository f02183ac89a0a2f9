// The held lists, custom classes under torch.classes.pnm_kernels: StepLists, the lists of a
// batch that stay the same from step to step, held in C++ so that a repeated step converts
// only its gradients from Python; StateLists, the same for a batch of state in a dtype of its
// own; HeldLayouts, the layouts of such a batch's tensors as they were checked.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <optional>
#include <vector>

#include "step_call.h"
#include "written_memory.h"

namespace pnm {

// The lists of a batch that stay the same from step to step (parameters, buffers, step
// counters), converted from Python once: an eager step then converts only its gradients,
// which for thousands of small tensors is most of the host time. Each step goes through the
// registered ops, so every check and every device's kernel is the same as for a direct call.
// The batch's own blocks_done counter (none or one, as the ops take it) lets a CUDA step be a
// single launch.
// Buffers it does not hold (buffer2 and buffer3 for PNM, buffer3 without AMSGrad) are empty
// lists.
struct StepLists : torch::CustomClassHolder {
  std::vector<at::Tensor> params, buffer0, buffer1, buffer2, buffer3, steps;
  std::vector<at::Tensor> blocks_done;

  StepLists(std::vector<at::Tensor> params, std::vector<at::Tensor> buffer0,
            std::vector<at::Tensor> buffer1, std::vector<at::Tensor> buffer2,
            std::vector<at::Tensor> buffer3, std::vector<at::Tensor> steps,
            std::optional<at::Tensor> blocks_done)
      : params(std::move(params)), buffer0(std::move(buffer0)), buffer1(std::move(buffer1)),
        buffer2(std::move(buffer2)), buffer3(std::move(buffer3)), steps(std::move(steps)),
        blocks_done(blocks_done.has_value() ? std::vector<at::Tensor>{*blocks_done}
                                            : std::vector<at::Tensor>{}),
        memory_(memory_now()) {}

  void pnm_step(std::vector<at::Tensor> grads, bool emulate, double lr, double beta1,
                double beta0, double weight_decay, bool decoupled, bool maximize,
                std::optional<at::Tensor> lr_tensor, std::optional<at::Tensor> grad_scale,
                std::optional<at::Tensor> found_inf);

  void adapnm_step(std::vector<at::Tensor> grads, bool emulate, double lr, double beta1,
                   double beta2, double beta0, double eps, double weight_decay, bool amsgrad,
                   bool decoupled, bool maximize, std::optional<at::Tensor> lr_tensor,
                   std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf);

  // A step with the held parameters' own gradients (read here, so none cross over from
  // Python), or with those take_own_grads() took for it (use_taken). A parameter without a
  // gradient does not step, as on the careful path. Returns false, having done nothing,
  // when a gradient is not dense and laid out like its parameter, or a parameter outside
  // the lists (hold_outside) has one: the optimizer then takes its careful path, which
  // copies it, makes its state or says what is wrong.
  bool pnm_step_own_grads(bool use_taken, bool emulate, double lr, double beta1, double beta0,
                          double weight_decay, bool decoupled, bool maximize,
                          std::optional<at::Tensor> lr_tensor,
                          std::optional<at::Tensor> grad_scale,
                          std::optional<at::Tensor> found_inf);

  bool adapnm_step_own_grads(bool use_taken, bool emulate, double lr, double beta1,
                             double beta2, double beta0, double eps, double weight_decay,
                             bool amsgrad, bool decoupled, bool maximize,
                             std::optional<at::Tensor> lr_tensor,
                             std::optional<at::Tensor> grad_scale,
                             std::optional<at::Tensor> found_inf);

  // A step over several batches first takes every batch's gradients, so that none steps
  // unless all can (a gradient laid out unlike its parameter, or a parameter, buffer or
  // counter given new data: see held_lists_ok); each batch's step then uses what it took,
  // and the gradients are read once. False, holding nothing, when this batch cannot step.
  bool take_own_grads();

  void drop_taken_grads();

  // Parameters of the batch's param group that have no state and so are not held: a
  // gradient for one of them makes the own-gradient steps decline (the careful path then
  // makes its state). Checked here, not in Python: a model passed whole, most of it frozen,
  // has thousands.
  void hold_outside(std::vector<at::Tensor> params_without_state);

  // Whether the held tensors still fit together. Python can give any of them new data
  // (p.data = ..., buf.data = buf.data.double(), step.data = torch.tensor(3)), which changes
  // it under the held lists without the lists knowing; the optimizer then rebuilds the batch,
  // its state following the parameter. So every held buffer must still match its parameter
  // (dtype, device, shape, layout) and every step counter still be what the kernels read (one
  // float64 element on the parameter's device). A step over several batches, and a Triton
  // step (whose kernels check nothing), ask this first; it runs every repeated step, over
  // thousands of tensors, so the cheap comparisons come first.
  bool held_lists_ok() const;

  // Whether every held tensor still points at the memory it did when the lists were made.
  // `t.data = other` of the same dtype and shape fits as before, but may make a buffer share
  // memory with another (or with a parameter), which each backend would step another way;
  // the optimizer checked the memory when it built the batch (pnm_kernels/aliasing.py) and
  // builds it again, checking, when this says no. Asked by held_lists_ok; a step from the
  // held lists has check_call compare each tensor's memory in the pass it makes over them
  // anyway (ExpectMemory), and refuse.
  bool memory_unchanged() const;

  // The memory every held list of the repeated step writes (all its batches'): a step with
  // the held parameters' own gradients declines, having done nothing, when a gradient lies
  // in it (`p.grad = q.data` between steps), and the careful path then names it.
  void watch_written(c10::intrusive_ptr<WrittenMemory> written);

  // For the Triton step, which writes through raw pointers: the version counters of the
  // params, the first num_buffers buffers and the counters (see bump_versions in
  // step_call.h).
  void bump_versions(int64_t num_buffers);

  // For a repeated Triton step: pointers() with the held parameters' own gradients, read
  // here, or with those take_own_grads() took (use_taken). Empty, the gradients let go of,
  // when a held parameter has no gradient or one unlike it (dtype, device, shape, layout), a
  // parameter outside the lists has one, or a held tensor was given new data (held_lists_ok):
  // the kernels check nothing, so the optimizer's careful path then takes the step.
  at::Tensor own_grad_pointers(bool use_taken, int64_t num_buffers);

  // The data pointers of params, grads and the first num_buffers buffers (list-major), then
  // of the step counters, then the params' element counts, as one int64 CPU tensor: what the
  // Triton kernels' tables hold.
  at::Tensor pointers(std::vector<at::Tensor> grads, int64_t num_buffers);

 private:
  // A step's gradients, in the order of the held parameters that have one; `present` says
  // which those are, and is empty when every held parameter has one.
  struct OwnGrads {
    std::vector<at::Tensor> grads;
    std::vector<int64_t> present;
  };
  OwnGrads taken;  // see take_own_grads
  bool has_taken = false;
  std::vector<at::Tensor> outside;  // see hold_outside
  c10::intrusive_ptr<WrittenMemory> written_;  // see watch_written
  // The memory of params, buffer0..3 and steps (HeldMemory's blocks) when the lists were
  // made.
  HeldMemory memory_;

  HeldMemory memory_now() const;

  bool own_or_taken_grads(bool use_taken, OwnGrads& own);
  bool own_grads(OwnGrads& own) const;

  // One op call over the held lists, or (`at`: their indices) over some of them.
  void pnm_step_on(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g,
                   const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& m_other,
                   const std::vector<at::Tensor>& s, const std::vector<int64_t>* at,
                   bool emulate, double lr, double beta1,
                   double beta0, double weight_decay, bool decoupled, bool maximize,
                   const std::optional<at::Tensor>& lr_tensor,
                   const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf);

  void adapnm_step_on(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g,
                      const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& m_other,
                      const std::vector<at::Tensor>& v, const std::vector<at::Tensor>& v_max,
                      const std::vector<at::Tensor>& s, const std::vector<int64_t>* at,
                      bool emulate, double lr, double beta1,
                      double beta2, double beta0, double eps, double weight_decay, bool amsgrad,
                      bool decoupled, bool maximize, const std::optional<at::Tensor>& lr_tensor,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf);
};

// The lists of a cached batch of state in a dtype of its own (bfloat16 state, float32 state
// beside 16-bit parameters, int8 state: docs/design.md §5, §7, §8), held in C++ as StepLists
// holds a float32 batch's, so that its step converts only its gradients from Python: the
// parameters, buffers, step counters, seeds, offsets and, for int8 codes, each buffer's scales
// (buffer after buffer). Each step goes through the registered ops (the same checks and
// kernels as a direct call); HeldLayouts confirms the held tensors before it.
struct StateLists : torch::CustomClassHolder {
  std::vector<at::Tensor> params, buffer0, buffer1, buffer2, buffer3, steps, seeds, scales;
  std::vector<int64_t> offsets;
  bool int8;  // the int8 kernel's (with scales); else the state kernel's

  StateLists(std::vector<at::Tensor> params, std::vector<at::Tensor> buffer0,
             std::vector<at::Tensor> buffer1, std::vector<at::Tensor> buffer2,
             std::vector<at::Tensor> buffer3, std::vector<at::Tensor> steps,
             std::vector<at::Tensor> seeds, std::vector<int64_t> offsets,
             std::vector<at::Tensor> scales, bool int8)
      : params(std::move(params)), buffer0(std::move(buffer0)), buffer1(std::move(buffer1)),
        buffer2(std::move(buffer2)), buffer3(std::move(buffer3)), steps(std::move(steps)),
        seeds(std::move(seeds)), scales(std::move(scales)), offsets(std::move(offsets)),
        int8(int8) {}

  void pnm_step(std::vector<at::Tensor> grads, bool emulate, double lr, double beta1,
                double beta0, double weight_decay, bool decoupled, bool maximize,
                std::optional<at::Tensor> lr_tensor, std::optional<at::Tensor> grad_scale,
                std::optional<at::Tensor> found_inf, bool bf16_stochastic_round);

  void adapnm_step(std::vector<at::Tensor> grads, bool emulate, double lr, double beta1,
                   double beta2, double beta0, double eps, double weight_decay, bool amsgrad,
                   bool decoupled, bool maximize, std::optional<at::Tensor> lr_tensor,
                   std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf,
                   bool bf16_stochastic_round);
};

// The tensors of a cached batch of state in a dtype of its own (parameters, buffers, step
// counters, seeds, int8 scales), held with their layouts as when the batch was built and
// checked (the optimizer made each to fit its parameter). Python can give any of them new
// data (t.data = ...) without the cache knowing; unchanged() says whether each still has its
// dtype, device, shape, strides and memory (and each counter a count the kernels may
// advance: counts_whole_steps), so that the cached lists may be stepped again. Its
// kernels check their arguments too, but a step can be two calls (int8 and the short rows'
// bfloat16) or several batches, and none may start unless all can; Triton's check nothing.
struct HeldLayouts : torch::CustomClassHolder {
  // counters: the batch's step counters (among the tensors too), whose values are read again.
  HeldLayouts(std::vector<at::Tensor> tensors, std::vector<at::Tensor> counters);
  bool unchanged() const;

 private:
  struct Layout {
    at::ScalarType dtype;
    c10::Device device;
    std::vector<int64_t> sizes, strides;
    Memory memory;  // as StepLists::memory_unchanged
  };
  std::vector<at::Tensor> tensors_, counters_;
  std::vector<Layout> layouts_;
};

}  // namespace pnm
