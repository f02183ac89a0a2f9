// The CPU emulation of the CUDA launch (emulated_cuda.cpp): the emulated_cuda_* ops.
#pragma once

#include "step_call.h"

namespace pnm {

// One step of the CUDA kernels' code on CPU tensors: pnm_cuda.cu's launches, emulated.
void emulated_cuda_step(const StepCall& call);

// The same for the state ops (state in a dtype of its own): state_block.h's launches.
void emulated_cuda_state_step(const StepCall& call);

// The same for the int8 ops: int8_block.h's launches.
void emulated_cuda_int8_step(const StepCall& call);

}  // namespace pnm
