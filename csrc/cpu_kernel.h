// The fused CPU kernel (cpu_kernel.cpp): what the op registration needs of it, the step
// itself and the choice of the instruction set its range loop runs with.
#pragma once

#include "step_call.h"

namespace pnm {

// The instruction sets the range loop is compiled for: the x86-64 baseline (SSE2), AVX2
// (+F16C) and AVX-512 (F, BW, VL). Names as the _set_cpu_isa hook takes them, in this order.
enum class CpuIsa { kBaseline, kAvx2, kAvx512 };
inline constexpr const char* kCpuIsaNames[] = {"baseline", "avx2", "avx512"};

// Whether this CPU, and this build, can run the range loop compiled for isa.
bool cpu_supports(CpuIsa isa);

// The instruction set the kernel runs with: at first the best this CPU has (pnm_kernels._ops
// sets torch's level at import, and the tests each in turn). set_active_cpu_isa does not
// check cpu_supports: its caller does.
CpuIsa current_cpu_isa();
void set_active_cpu_isa(CpuIsa isa);

// The op's CPU implementation: one pass over the elements of every tensor, split between
// threads, then the step counters incremented.
void cpu_fused_step(const StepCall& call);

// The same with the state in a dtype of its own (cpu_state_kernel.cpp): bfloat16 buffers
// written with stochastic rounding, or float32 buffers of 16-bit parameters.
void cpu_state_step(const StepCall& call);

// The same with int8 state (cpu_int8_kernel.cpp): block-wise codes and scales.
void cpu_int8_step(const StepCall& call);

}  // namespace pnm
