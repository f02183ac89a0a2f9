// The compiled step's checks (traced_checks.h).
#include "traced_checks.h"

#include <pybind11/pybind11.h>

#include <cmath>
#include <vector>

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
    if (!(std::isfinite(v) && v >= 0.0 && v == std::floor(v))) {
      call_traced("_refuse_step_count", groups[i], places[i], v);
    }
  }
}

void check_memory_apart(at::TensorList steps, at::TensorList written, at::TensorList read,
                        int64_t optimizer) {
  std::vector<at::Tensor> claimed = steps.vec();
  claimed.insert(claimed.end(), written.begin(), written.end());
  if (extents_meet(claimed, read)) call_traced("_refuse_shared_memory", optimizer);
}

}  // namespace pnm
