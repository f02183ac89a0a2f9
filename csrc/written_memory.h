// WrittenMemory, the custom class torch.classes.pnm_kernels.WrittenMemory: where the tensors a
// step writes lie (held parameters, buffers, step counters), so that a gradient put into that
// memory between steps (`p.grad = q.data`, a buffer of q's state) is seen by the steps that
// build no lists, where every tensor's memory was checked (docs/edits.md).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace pnm {

struct StepLists;

// A cached batch's parameters, held in C++ so that WrittenMemory reads their gradients there:
// a planned step converts none of them from Python for the check.
struct HeldParams : torch::CustomClassHolder {
  explicit HeldParams(std::vector<at::Tensor> params) : params(std::move(params)) {}
  std::vector<at::Tensor> params;
};

// Whether two of `written` share a byte of their extents, or one of `read` meets one of them:
// the compiled step's check of the memory it was given (traced.py), where nothing is held
// between steps. Extents, not elements: a hit is then checked element by element.
bool extents_meet(at::TensorList written, at::TensorList read);
struct ExtentsMeet {
  bool among_written = false;  // two of `written`
  bool read_in_written = false;  // one of `read` and one of `written`
};
ExtentsMeet where_extents_meet(at::TensorList written, at::TensorList read);

// A tensor's extent counted from its storage's start. A storage's memory can move without any
// tensor of it changing (`storage.resize_()`, `t.share_memory_()`), leaving an extent in
// memory where it was: a gradient in the same storage is found by these.
struct StorageSpan {
  uintptr_t storage;  // the StorageImpl's address
  uintptr_t begin, end;
};

class WrittenMemory : public torch::CustomClassHolder {
 public:
  // The memory of these tensors (a cached batch's, from Python), or of a StepLists' params,
  // buffers and counters (the repeated step's, read in C++).
  void add(std::vector<at::Tensor> tensors);
  void add_lists(const c10::intrusive_ptr<StepLists>& lists);
  void clear();

  // Whether a gradient of these parameters (a reused batch's), or one of these gradients,
  // meets memory added.
  bool params_grads_met(const c10::intrusive_ptr<HeldParams>& held);
  bool grads_met(std::vector<at::Tensor> grads);
  // The index of the first of these gradients that meets memory added; -1 when none does.
  int64_t first_met(const std::vector<at::Tensor>& grads);

 private:
  struct Span {
    uintptr_t begin, end;  // bytes [begin, end): a strided tensor's whole extent
  };
  using StorageSpan = pnm::StorageSpan;
  void add_tensor(const at::Tensor& t);
  void seal();  // sorts and merges the spans, and fills the filters
  bool meets(uintptr_t begin, uintptr_t end) const;
  bool meets_in_storage(const StorageSpan& span) const;
  bool met(const at::Tensor& grad) const;  // sealed

  std::vector<Span> spans_;
  std::vector<StorageSpan> storage_spans_;
  bool sealed_ = true;
  // Filters of hashed granules of memory (written_memory.cpp says which): a gradient none
  // of whose granules is marked meets no span, found with a bit test or two where a search
  // of the spans costs a dozen cache-missing comparisons; thousands of gradients a step.
  struct Filter {
    std::vector<uint64_t> words;
    int bits = 0;
    void size(uintptr_t granules);
    void mark(uintptr_t begin, uintptr_t end, int shift);
    bool marked(uintptr_t begin, uintptr_t end, int shift) const;
  };
  Filter fine_, coarse_;
  Filter storages_;  // the storages of storage_spans_, as one-byte granules at their address
};

}  // namespace pnm
