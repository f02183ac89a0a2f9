// The compiled step's checks (traced_checks.h).
#include "traced_checks.h"

#include <pybind11/pybind11.h>

#include <cstdint>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "step_call.h"
#include "written_memory.h"

namespace pnm {
namespace {

namespace py = pybind11;

// Calls pnm_kernels.traced.<name>(args...). Its exception travels up as
// py::error_already_set, which torch's op binding raises again in Python unchanged.
template <typename... Args>
void call_traced(const char* name, Args&&... args) {
  py::gil_scoped_acquire gil;
  py::module_::import("pnm_kernels.traced").attr(name)(std::forward<Args>(args)...);
}

// Where the optimizer whose step this is can be found (traced._traced_optimizer): the first
// of these tensors (its parameters, then its state) with memory. No constant of the graph
// names the optimizer: the compiled code would differ in every process, and inductor's
// caches never hit. (Not the counters: an op declared as writing them may get copies.)
uintptr_t optimizer_of(at::TensorList tensors) {
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.has_storage() && t.numel() > 0) {
      return reinterpret_cast<uintptr_t>(t.const_data_ptr());
    }
  }
  return 0;
}

// Where each tensor lies and how it is laid out: what decides whether elements meet.
uint64_t layout_hash(const std::vector<at::Tensor>& claimed) {
  uint64_t h = 0x9E3779B97F4A7C15ull;
  const auto mix = [&h](uint64_t v) { h = (h ^ v) * 0x100000001B3ull + (h >> 29); };
  mix(claimed.size());
  for (const at::Tensor& t : claimed) {
    if (!t.defined() || !t.has_storage()) {
      mix(0);
      continue;
    }
    mix(reinterpret_cast<uintptr_t>(t.const_data_ptr()));
    mix(t.element_size());
    for (int64_t d = 0; d < t.dim(); ++d) {
      mix(static_cast<uint64_t>(t.size(d)));
      mix(static_cast<uint64_t>(t.stride(d)));
    }
  }
  return h;
}

constexpr size_t kClearedLayouts = 64;
std::mutex cleared_mutex;
std::unordered_set<uint64_t> cleared_layouts;

}  // namespace

void check_step_counts(at::TensorList steps, at::IntArrayRef groups, at::IntArrayRef places) {
  TORCH_CHECK(groups.size() == steps.size() && places.size() == steps.size(),
              "check_step_counts: a group and a place for each counter");
  for (size_t i = 0; i < steps.size(); ++i) {
    const at::Tensor& step = steps[i];
    if (!step.device().is_cpu()) continue;  // not read: that would synchronise
    const double v = step.scalar_type() == at::kDouble
                         ? *static_cast<const double*>(step.const_data_ptr())
                         : step.item<double>();
    if (!is_whole_count(v)) {
      call_traced("_refuse_step_count", groups[i], places[i], v);
    }
  }
}

void check_memory_apart(at::TensorList steps, at::TensorList written, at::TensorList read) {
  std::vector<at::Tensor> claimed = steps.vec();
  claimed.insert(claimed.end(), written.begin(), written.end());
  const ExtentsMeet meet = where_extents_meet(claimed, read);
  if (meet.read_in_written) {  // gradients are new every step: not remembered
    call_traced("_refuse_shared_memory", optimizer_of(written));
  } else if (meet.among_written) {
    // Extents of what the step writes meet where elements may not (strided views that
    // interleave): a layout the element-wise check passed is not sent to Python again at
    // every step.
    const uint64_t layout = layout_hash(claimed);
    {
      std::lock_guard<std::mutex> lock(cleared_mutex);
      if (cleared_layouts.count(layout)) return;
    }
    call_traced("_refuse_shared_memory", optimizer_of(written));  // raises, or passes:
    std::lock_guard<std::mutex> lock(cleared_mutex);
    if (cleared_layouts.size() >= kClearedLayouts) cleared_layouts.clear();
    cleared_layouts.insert(layout);
  }
}

}  // namespace pnm
