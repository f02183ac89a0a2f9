// The checks a torch.compile'd step runs inside its graph (pnm_kernels/traced.py), where
// dynamo guards layouts but neither a counter's value nor any tensor's memory: ops in C++, so
// that a step of thousands of tensors pays a pointer or a number a tensor, not a Python
// conversion. Where one finds something to refuse, the Python check named by the op raises
// naming the culprit, as the eager step does.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pnm {

// Whether each CPU counter holds a whole number of steps >= 0 (as counts_whole_steps); else
// traced._refuse_step_count(group, place, value) raises.
void check_step_counts(at::TensorList steps, at::IntArrayRef groups, at::IntArrayRef places);

// Whether no two of the counters and `written` share memory, nor one of `read` (gradients,
// tensor lrs) one of them, by their extents (extents_meet); else
// traced._refuse_shared_memory(where the first of `written` lies) checks them element by element
// and raises (or passes: strided views that interleave, a layout then remembered).
void check_memory_apart(at::TensorList steps, at::TensorList written, at::TensorList read);

}  // namespace pnm
