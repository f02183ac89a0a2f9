// The library pnm_kernels: op schemas, their CPU implementations' registration, the test
// hooks, the custom classes (StepLists, StateLists, HeldLayouts: step_lists.cpp;
// WrittenMemory, HeldParams: written_memory.cpp), and the Python module's entry point. The
// implementations live in step_call.cpp (checks), traced_checks.cpp (the checks inside a
// torch.compile'd step), cpu_kernel.cpp, cpu_state_kernel.cpp and cpu_int8_kernel.cpp (the
// fused CPU kernels), emulated_cuda.cpp (the CUDA kernels' code on the host) and pnm_cuda.cu
// (CUDA, registered there).
#include <Python.h>

#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string>
#include <vector>

#include "cpu_kernel.h"
#include "emulated_cuda.h"
#include "step_call.h"
#include "step_lists.h"
#include "traced_checks.h"
#include "written_memory.h"

namespace pnm {
namespace {

// The two CPU implementations of the ops: the fused CPU kernel, and the CUDA kernels' code
// emulated on the host.
struct CpuFused {
  static constexpr c10::DeviceType kDevice = c10::DeviceType::CPU;
  static void run(const StepCall& call) { cpu_fused_step(call); }
};
struct CpuState {
  static constexpr c10::DeviceType kDevice = c10::DeviceType::CPU;
  static void run(const StepCall& call) { cpu_state_step(call); }
};
struct CpuInt8 {
  static constexpr c10::DeviceType kDevice = c10::DeviceType::CPU;
  static void run(const StepCall& call) { cpu_int8_step(call); }
};
struct EmulatedCudaState {
  static constexpr c10::DeviceType kDevice = c10::DeviceType::CPU;
  static void run(const StepCall& call) { emulated_cuda_state_step(call); }
};
struct EmulatedCudaInt8 {
  static constexpr c10::DeviceType kDevice = c10::DeviceType::CPU;
  static void run(const StepCall& call) { emulated_cuda_int8_step(call); }
};
struct EmulatedCuda {
  static constexpr c10::DeviceType kDevice = c10::DeviceType::CPU;
  static void run(const StepCall& call) { emulated_cuda_step(call); }
};

// Test hook: the launch plan for tensors of these sizes and element size, as (table, tensor,
// chunk) triples, one per block; with max_single_launch_blocks, that of a step with a
// blocks_done counter on a GPU of that many SMs (its chunk size: step_chunk_size). No memory
// is touched, so sizes beyond 2^31 elements can be planned here.
std::vector<int64_t> launch_plan(at::IntArrayRef numels, int64_t element_size,
                                 int64_t max_single_launch_blocks) {
  constexpr int kLists = 4;
  const int n = static_cast<int>(numels.size());
  std::vector<void*> ptrs(static_cast<size_t>(n) * kLists);
  for (int i = 0; i < n; ++i) {  // stand-in addresses that name the tensor
    for (int l = 0; l < kLists; ++l) ptrs[i * kLists + l] = reinterpret_cast<void*>((i + 1) * 64);
  }
  std::vector<double*> steps(n, nullptr);
  const auto tables = plan_launches<kLists>(n, ptrs.data(), steps.data(), numels.data(),
                                            static_cast<size_t>(element_size), launch_limits(),
                                            static_cast<int>(max_single_launch_blocks));
  std::vector<int64_t> out;
  for (size_t t = 0; t < tables.size(); ++t) {
    for (int b = 0; b < tables[t].num_blocks; ++b) {  // each block as step_block finds it
      const BlockChunk where = block_chunk(tables[t], b);
      out.push_back(static_cast<int64_t>(t));
      out.push_back(reinterpret_cast<intptr_t>(tables[t].ptrs[0][where.slot]) / 64 - 1);
      out.push_back(where.chunk);
    }
  }
  return out;
}

void set_launch_limits(int64_t chunk_size, int64_t max_tensors, int64_t max_blocks,
                       int64_t max_single_launch_blocks) {
  TORCH_CHECK(chunk_size >= 0 && chunk_size % 8 == 0,
              "pnm_kernels: chunk_size must be a non-negative multiple of 8, got ", chunk_size);
  LaunchLimits& limits = launch_limits();
  limits.chunk_size = chunk_size;
  limits.max_tensors = static_cast<int>(max_tensors);
  limits.max_blocks = static_cast<int>(max_blocks);
  limits.max_single_launch_blocks = static_cast<int>(max_single_launch_blocks);
}

// The ISA the fused CPU kernel runs with (pnm_kernels._ops picks torch's level at import).
// Returns the one now active; an ISA the CPU lacks is refused.
std::string set_cpu_isa(const std::string& name) {
  const auto* found = std::find(std::begin(kCpuIsaNames), std::end(kCpuIsaNames), name);
  TORCH_CHECK(found != std::end(kCpuIsaNames), "pnm_kernels: unknown CPU ISA '", name,
              "'; expected baseline, avx2 or avx512");
  const auto isa = static_cast<CpuIsa>(found - std::begin(kCpuIsaNames));
  TORCH_CHECK(cpu_supports(isa), "pnm_kernels: this CPU (or build) has no ", name);
  set_active_cpu_isa(isa);
  return name;
}

std::string cpu_isa() { return kCpuIsaNames[static_cast<int>(current_cpu_isa())]; }

std::vector<std::string> cpu_isas() {
  std::vector<std::string> names;
  for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (cpu_supports(isa)) names.emplace_back(kCpuIsaNames[static_cast<int>(isa)]);
  }
  return names;
}

}  // namespace
}  // namespace pnm

// Mutation annotations tell torch.compile/functionalization what each op writes. An argument
// written is positional and always given: torch takes one after `*` for an out= argument, and
// its allow_mutation_on_saved_tensors looks each up in the call's arguments (kwargs["out"], or
// a positional one, left out where it holds its default) and takes it for a tensor (so the
// optional ticket counter is a list of none or one).
#define PNM_STEP_SCHEMA(name)                                                                 \
  name "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] pos_momentums, "                   \
       "Tensor(c!)[] neg_momentums, Tensor(d!)[] steps, Tensor(e!)[] blocks_done, *, "         \
       "float lr, float beta1, float beta0, float weight_decay, bool decoupled, "             \
       "bool maximize, Tensor? lr_tensor=None, Tensor? grad_scale=None, "                     \
       "Tensor? found_inf=None) -> ()"
#define ADAPNM_STEP_SCHEMA(name)                                                              \
  name "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "                        \
       "Tensor(c!)[] neg_exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, "  \
       "Tensor(f!)[] steps, Tensor(g!)[] blocks_done, *, float lr, float beta1, "              \
       "float beta2, float beta0, float eps, float weight_decay, bool amsgrad, "              \
       "bool decoupled, bool maximize, Tensor? lr_tensor=None, Tensor? grad_scale=None, "     \
       "Tensor? found_inf=None) -> ()"

// State in a dtype of its own (docs/design.md §7): each parameter's seed and the elements of
// the whole parameter before it pick the random bits of stochastic rounding.
#define PNM_STATE_STEP_SCHEMA(name)                                                           \
  name "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] pos_momentums, "                   \
       "Tensor(c!)[] neg_momentums, Tensor(d!)[] steps, Tensor[] seeds, int[] offsets, *, "   \
       "float lr, float beta1, float beta0, float weight_decay, bool decoupled, "             \
       "bool maximize, Tensor? lr_tensor=None, Tensor? grad_scale=None, "                     \
       "Tensor? found_inf=None, bool bf16_stochastic_round=False) -> ()"
#define ADAPNM_STATE_STEP_SCHEMA(name)                                                        \
  name "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "                        \
       "Tensor(c!)[] neg_exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, "  \
       "Tensor(f!)[] steps, Tensor[] seeds, int[] offsets, *, float lr, float beta1, "        \
       "float beta2, float beta0, float eps, float weight_decay, bool amsgrad, "              \
       "bool decoupled, bool maximize, Tensor? lr_tensor=None, Tensor? grad_scale=None, "     \
       "Tensor? found_inf=None, bool bf16_stochastic_round=False) -> ()"

// int8 state (docs/design.md §8): each buffer's block scales too, buffer after buffer.
#define PNM_INT8_STEP_SCHEMA(name)                                                            \
  name "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] pos_momentums, "                   \
       "Tensor(c!)[] neg_momentums, Tensor(d!)[] steps, Tensor[] seeds, int[] offsets, "      \
       "Tensor(e!)[] scales, *, float lr, float beta1, float beta0, float weight_decay, "     \
       "bool decoupled, bool maximize, Tensor? lr_tensor=None, Tensor? grad_scale=None, "     \
       "Tensor? found_inf=None, bool bf16_stochastic_round=False) -> ()"
#define ADAPNM_INT8_STEP_SCHEMA(name)                                                         \
  name "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "                        \
       "Tensor(c!)[] neg_exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, "  \
       "Tensor(f!)[] steps, Tensor[] seeds, int[] offsets, Tensor(g!)[] scales, *, "          \
       "float lr, float beta1, float beta2, float beta0, float eps, float weight_decay, "     \
       "bool amsgrad, bool decoupled, bool maximize, Tensor? lr_tensor=None, "                \
       "Tensor? grad_scale=None, Tensor? found_inf=None, bool bf16_stochastic_round=False) "  \
       "-> ()"

TORCH_LIBRARY(pnm_kernels, m) {
  m.def(PNM_STEP_SCHEMA("pnm_step_"));
  m.def(ADAPNM_STEP_SCHEMA("adapnm_step_"));
  // The CUDA kernels' code, executed on CPU tensors (CI has no GPU).
  m.def(PNM_STEP_SCHEMA("emulated_cuda_pnm_step_"));
  m.def(ADAPNM_STEP_SCHEMA("emulated_cuda_adapnm_step_"));
  m.def(PNM_STATE_STEP_SCHEMA("pnm_state_step_"));
  m.def(ADAPNM_STATE_STEP_SCHEMA("adapnm_state_step_"));
  m.def(PNM_STATE_STEP_SCHEMA("emulated_cuda_pnm_state_step_"));
  m.def(ADAPNM_STATE_STEP_SCHEMA("emulated_cuda_adapnm_state_step_"));
  m.def(PNM_INT8_STEP_SCHEMA("pnm_int8_step_"));
  m.def(ADAPNM_INT8_STEP_SCHEMA("adapnm_int8_step_"));
  m.def(PNM_INT8_STEP_SCHEMA("emulated_cuda_pnm_int8_step_"));
  m.def(ADAPNM_INT8_STEP_SCHEMA("emulated_cuda_adapnm_int8_step_"));
  m.def("_set_launch_limits(int chunk_size, int max_tensors, int max_blocks, "
        "int max_single_launch_blocks=0) -> ()",
        &pnm::set_launch_limits);
  m.def("_first_mismatched_grad(Tensor[] params, Tensor[] grads, bool same_layout=False) -> int",
        &pnm::first_mismatched_grad);
  m.def("_extents_meet(Tensor[] written, Tensor[] read) -> bool", &pnm::extents_meet);
  // Declared as writing the counters, so that the compiler orders every step after them.
  m.def("check_step_counts(Tensor(a!)[] steps, int[] groups, int[] places) -> ()");
  m.def(
      "check_traced_tensors(Tensor(a!)[] steps, Tensor[] written, Tensor[] read, int[] layouts) "
      "-> ()");
  m.def("_dtype_code(ScalarType dtype) -> int", &pnm::dtype_code);
  m.def("_launch_plan(int[] numels, int element_size, int max_single_launch_blocks=0) -> int[]",
        &pnm::launch_plan);
  m.def("_set_cpu_isa(str isa) -> str", &pnm::set_cpu_isa);
  m.def("_cpu_isas() -> str[]", &pnm::cpu_isas);
  m.def("_cpu_isa() -> str", &pnm::cpu_isa);
  m.class_<pnm::HeldParams>("HeldParams").def(torch::init<std::vector<at::Tensor>>());
  auto written_memory =
      m.class_<pnm::WrittenMemory>("WrittenMemory")
          .def(torch::init<>())
          .def("add", &pnm::WrittenMemory::add)
          .def("clear", &pnm::WrittenMemory::clear)
          .def("params_grads_met", &pnm::WrittenMemory::params_grads_met)
          .def("grads_met", &pnm::WrittenMemory::grads_met);
  m.class_<pnm::StepLists>("StepLists")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::optional<at::Tensor>>())
      .def("pnm_step", &pnm::StepLists::pnm_step)
      .def("adapnm_step", &pnm::StepLists::adapnm_step)
      .def("pointers", &pnm::StepLists::pointers)
      .def("own_grad_pointers", &pnm::StepLists::own_grad_pointers)
      .def("pnm_step_own_grads", &pnm::StepLists::pnm_step_own_grads)
      .def("adapnm_step_own_grads", &pnm::StepLists::adapnm_step_own_grads)
      .def("take_own_grads", &pnm::StepLists::take_own_grads)
      .def("drop_taken_grads", &pnm::StepLists::drop_taken_grads)
      .def("hold_outside", &pnm::StepLists::hold_outside)
      .def("held_lists_ok", &pnm::StepLists::held_lists_ok)
      .def("bump_versions", &pnm::StepLists::bump_versions)
      .def("watch_written", &pnm::StepLists::watch_written);
  // (add_lists takes a StepLists, registered after: each class names only those before it.)
  written_memory.def("add_lists", &pnm::WrittenMemory::add_lists);
  m.class_<pnm::StateLists>("StateLists")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                       bool>())
      .def("pnm_step", &pnm::StateLists::pnm_step)
      .def("adapnm_step", &pnm::StateLists::adapnm_step);
  m.class_<pnm::HeldLayouts>("HeldLayouts")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>>())
      .def("unchanged", &pnm::HeldLayouts::unchanged);
}

// Host code over pointers and CPU counters: one kernel for any device's tensors.
TORCH_LIBRARY_IMPL(pnm_kernels, CompositeExplicitAutograd, m) {
  m.impl("check_step_counts", &pnm::check_step_counts);
  m.impl("check_traced_tensors", &pnm::check_traced_tensors);
}

// A lazy negative or conjugate view among the inputs: the dispatcher's fallback would hand the
// check a resolved copy (in other memory, not lazy); the check itself sees and refuses it.
TORCH_LIBRARY_IMPL(pnm_kernels, Negative, m) {
  m.impl("check_step_counts", &pnm::check_step_counts);
  m.impl("check_traced_tensors", &pnm::check_traced_tensors);
}

TORCH_LIBRARY_IMPL(pnm_kernels, Conjugate, m) {
  m.impl("check_step_counts", &pnm::check_step_counts);
  m.impl("check_traced_tensors", &pnm::check_traced_tensors);
}

TORCH_LIBRARY_IMPL(pnm_kernels, CPU, m) {
  m.impl("pnm_step_", &pnm::pnm_step_op<pnm::CpuFused>);
  m.impl("adapnm_step_", &pnm::adapnm_step_op<pnm::CpuFused>);
  m.impl("emulated_cuda_pnm_step_", &pnm::pnm_step_op<pnm::EmulatedCuda>);
  m.impl("emulated_cuda_adapnm_step_", &pnm::adapnm_step_op<pnm::EmulatedCuda>);
  m.impl("pnm_state_step_", &pnm::pnm_state_step_op<pnm::CpuState>);
  m.impl("adapnm_state_step_", &pnm::adapnm_state_step_op<pnm::CpuState>);
  m.impl("emulated_cuda_pnm_state_step_", &pnm::pnm_state_step_op<pnm::EmulatedCudaState>);
  m.impl("emulated_cuda_adapnm_state_step_", &pnm::adapnm_state_step_op<pnm::EmulatedCudaState>);
  m.impl("pnm_int8_step_", &pnm::pnm_int8_step_op<pnm::CpuInt8>);
  m.impl("adapnm_int8_step_", &pnm::adapnm_int8_step_op<pnm::CpuInt8>);
  m.impl("emulated_cuda_pnm_int8_step_", &pnm::pnm_int8_step_op<pnm::EmulatedCudaInt8>);
  m.impl("emulated_cuda_adapnm_int8_step_", &pnm::adapnm_int8_step_op<pnm::EmulatedCudaInt8>);
}

// Importing pnm_kernels._C runs the registrations above.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY_IMPL(pnm_kernels, Autograd, m) {
  for (const char* name : {"pnm_step_", "adapnm_step_", "emulated_cuda_pnm_step_",
                           "emulated_cuda_adapnm_step_", "pnm_state_step_",
                           "adapnm_state_step_", "emulated_cuda_pnm_state_step_",
                           "emulated_cuda_adapnm_state_step_", "pnm_int8_step_",
                           "adapnm_int8_step_", "emulated_cuda_pnm_int8_step_",
                           "emulated_cuda_adapnm_int8_step_", "check_step_counts",
                           "check_traced_tensors"}) {
    m.impl(name, torch::CppFunction::makeFallthrough());
  }
}

