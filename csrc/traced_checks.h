// The checks a torch.compile'd step runs inside its graph (pnm_kernels/traced.py), where
// dynamo guards neither a counter's value, nor any tensor's memory, nor a parameter's dtype,
// device, sizes and strides changed through .data (as module.to() changes them): ops in C++, so
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

// The step's tensors (the counters, `written`, `read`, in that order) as the step was traced:
// - each laid out as `layouts` says, and no lazy negative or conjugate view (is_lazy_view);
//   else traced._refuse_changed_tensor raises naming it, with the layout it was traced with. An entry a tensor: a head, dtype + 2^8 (device + 1) +
//   2^16 (dims + 1) + 2^24 contiguous (dtype: its dtype_code, 255 not compared; device: -1
//   the CPU, else its index; dims: -1 sizes not compared), then its sizes, then, where not
//   contiguous, its strides (a layout as short as can be: the list is converted at every
//   step, some 25 ns a number);
// - no two of the counters and `written` sharing memory, nor one of `read` (gradients, tensor
//   lrs) one of them, by their extents (extents_meet); else traced._refuse_shared_memory(where
//   the first of `written` lies) checks them element by element and raises (or passes:
//   strided views that interleave, a layout then remembered).
void check_traced_tensors(at::TensorList steps, at::TensorList written, at::TensorList read,
                          at::IntArrayRef layouts);

// A dtype as `layouts` carries it (traced.py asks for each when it loads).
int64_t dtype_code(at::ScalarType dtype);

}  // namespace pnm
