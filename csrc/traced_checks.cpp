// The compiled step's checks (traced_checks.h).
#include "traced_checks.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "step_call.h"
#include "written_memory.h"

namespace pnm {
namespace {

namespace py = pybind11;

constexpr int64_t kDtypeNotCompared = 255;

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

// A tensor's device as layouts carry it.
int64_t device_code(const at::Tensor& t) { return t.device().is_cpu() ? -1 : t.device().index(); }

// A tensor's entry in `layouts` (traced_checks.h), its head read.
struct Entry {
  int64_t dtype, device, dims;
  bool contiguous;
  size_t length;  // of the entry: its head, sizes, strides
};

Entry entry_at(at::IntArrayRef layouts, size_t at) {
  TORCH_CHECK(at < layouts.size(), "check_traced_tensors: a layout for each tensor");
  const int64_t head = layouts[at];
  Entry e{head & 255, ((head >> 8) & 255) - 1, ((head >> 16) & 255) - 1, ((head >> 24) & 1) != 0,
          1};
  if (e.dims > 0) e.length += e.contiguous ? e.dims : 2 * e.dims;
  TORCH_CHECK(at + e.length <= layouts.size(), "check_traced_tensors: a layout for each tensor");
  return e;
}

bool laid_out_as(const at::Tensor& t, const Entry& e, const int64_t* shape) {
  if (is_lazy_view(t)) return false;  // never traced so (the eager checks refuse it)
  if ((e.dtype != kDtypeNotCompared && e.dtype != dtype_code(t.scalar_type())) ||
      e.device != device_code(t)) {
    return false;
  }
  if (e.dims < 0) return true;
  if (t.dim() != e.dims || t.is_contiguous() != e.contiguous) return false;
  for (int64_t d = 0; d < e.dims; ++d) {
    if (t.size(d) != shape[d] || (!e.contiguous && t.stride(d) != shape[e.dims + d])) {
      return false;
    }
  }
  return true;
}

// Raises through traced._refuse_changed_tensor: `t`, laid out otherwise than `e` (whose
// sizes and strides follow it at `shape`) says.
[[noreturn]] void refuse_changed(const at::Tensor& t, const Entry& e, const int64_t* shape,
                                 uintptr_t optimizer) {
  const uintptr_t where =
      t.has_storage() && t.numel() > 0 ? reinterpret_cast<uintptr_t>(t.const_data_ptr()) : 0;
  {
    py::gil_scoped_acquire gil;
    py::object sizes = py::none(), strides = py::none();
    if (e.dims >= 0) {
      py::list size_list, stride_list;
      std::vector<int64_t> dense(e.dims, 1);
      for (int64_t d = e.dims - 2; d >= 0; --d) {
        dense[d] = dense[d + 1] * std::max<int64_t>(shape[d + 1], 1);
      }
      for (int64_t d = 0; d < e.dims; ++d) {
        size_list.append(shape[d]);
        stride_list.append(e.contiguous ? dense[d] : shape[e.dims + d]);
      }
      sizes = size_list;
      strides = stride_list;
    }
    call_traced("_refuse_changed_tensor", optimizer, where, t.numel(), e.dtype, e.device, sizes,
                strides);
  }
  TORCH_CHECK(false, "pnm_kernels: a tensor of the compiled step is not laid out as traced");
}

// Raises if one of the tensors of `lists`, in turn, is not laid out as its entry in `layouts`
// says.
void check_layouts(std::initializer_list<at::TensorList> lists, at::IntArrayRef layouts,
                   uintptr_t optimizer) {
  size_t at = 0;
  for (at::TensorList tensors : lists) {
    for (const at::Tensor& t : tensors) {
      const Entry e = entry_at(layouts, at);
      const int64_t* shape = layouts.data() + at + 1;
      if (!laid_out_as(t, e, shape)) refuse_changed(t, e, shape, optimizer);
      at += e.length;
    }
  }
  TORCH_CHECK(at == layouts.size(), "check_traced_tensors: a layout for each tensor");
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
    if (is_lazy_view(step)) continue;  // check_traced_tensors, next, refuses it naming it
    const double v = step.scalar_type() == at::kDouble
                         ? *static_cast<const double*>(step.const_data_ptr())
                         : step.item<double>();
    if (!is_whole_count(v)) {
      call_traced("_refuse_step_count", groups[i], places[i], v);
    }
  }
}

int64_t dtype_code(at::ScalarType dtype) { return static_cast<int64_t>(dtype); }

void check_traced_tensors(at::TensorList steps, at::TensorList written, at::TensorList read,
                          at::IntArrayRef layouts) {
  // First: a tensor laid out otherwise has other extents too.
  check_layouts({steps, written, read}, layouts, optimizer_of(written));
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
