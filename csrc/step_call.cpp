// The argument checks of the ops (all before anything is written) and what the CPU, emulated
// and CUDA implementations make of a checked call: its scalars and its raw pointers.
#include "step_call.h"

#include <cmath>

namespace pnm {

// The launch tables' limits, shared by the CUDA launcher and its CPU emulation; the tests
// set them (_set_launch_limits) to reach plans that only huge tensors would otherwise need.
LaunchLimits& launch_limits() {
  static LaunchLimits limits;
  return limits;
}

namespace {

// Whether two dense tensors' memory overlaps (a gradient given its parameter's memory,
// `p.grad = p.detach()`: the foreach and reference steps read it after writing the
// parameter, the kernels before; the planned step refuses it, naming it, aliasing.py).
bool dense_spans_overlap(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.const_data_ptr());
  const auto* b0 = static_cast<const char*>(b.const_data_ptr());
  if (a0 == nullptr || b0 == nullptr) return false;  // meta tensors: no memory
  return a0 < b0 + b.numel() * b.element_size() && b0 < a0 + a.numel() * a.element_size();
}

constexpr const char* kPnmListNames[] = {"params", "grads", "pos_momentums", "neg_momentums"};
constexpr const char* kAdaPnmListNames[] = {"params",       "grads",      "exp_avgs",
                                            "neg_exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"};

constexpr const char* kLazyView =
    " is an unresolved negative or conjugate view: the kernels read and write its memory "
    "itself (resolve it: t.resolve_neg().resolve_conj())";

void check_scalar_tensor(const std::optional<at::Tensor>& t, const char* name,
                         const c10::Device& device, bool lr) {
  if (!t.has_value()) return;
  TORCH_CHECK(!is_lazy_view(*t), "pnm_kernels: ", name, kLazyView);
  const bool dtype_ok =
      t->scalar_type() == at::kFloat || (lr && t->scalar_type() == at::kDouble);
  TORCH_CHECK(t->numel() == 1 && dtype_ok, "pnm_kernels: ", name, " must be a ",
              lr ? "float32 or float64" : "float32", " tensor with one element, got ",
              t->scalar_type(), " with ", t->numel(), " elements");
  TORCH_CHECK(t->device() == device || (lr && t->device().is_cpu()),
              "pnm_kernels: ", name, " is on ", t->device(), " but params are on ", device);
}

// The int8 ops' buffers and scales (docs/design.md §8): codes shaped like contiguous
// parameters whose dim-0 rows hold at least one block, each buffer's float32 scales
// (rows, blocks per row), seeds and offsets for every parameter.
void check_int8_call(const StepCall& call, const char* const* names) {
  const size_t n = call.lists[0].size();
  const size_t buffers = static_cast<size_t>(call.num_lists - 2);
  TORCH_CHECK(call.scales.size() == n * buffers, "pnm_kernels: ", call.scales.size(),
              " scales for ", n, " params with ", buffers, " buffers each (", n * buffers,
              " wanted, buffer after buffer)");
  TORCH_CHECK(call.seeds.size() == n && call.offsets.size() == n, "pnm_kernels: ",
              call.seeds.size(), " seeds and ", call.offsets.size(), " offsets for ", n,
              " params with int8 state (", n, " of each wanted)");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = call.lists[0][i];
    // (A shard may hold no rows: FSDP2's of a parameter with fewer rows than ranks.)
    TORCH_CHECK(p.dim() >= 2 && p.is_contiguous() && int8_row_length(p) >= kInt8Block,
                "pnm_kernels: params[", i, "] (shape ", p.sizes(),
                ") cannot keep int8 state: it needs a contiguous tensor of at least two "
                "dimensions whose rows hold ", kInt8Block, " elements or more");
    const int64_t rows = p.size(0), length = int8_row_length(p);
    const int64_t blocks = (length + kInt8Block - 1) / kInt8Block;
    for (size_t l = 2; l < static_cast<size_t>(call.num_lists); ++l) {
      const at::Tensor& codes = call.lists[l][i];
      const at::ScalarType want = l < 4 ? at::kChar : at::kByte;
      TORCH_CHECK(codes.defined() && codes.scalar_type() == want, "pnm_kernels: ", names[l],
                  "[", i, "] must hold ", want, " codes");
      TORCH_CHECK(codes.sizes() == p.sizes() && codes.is_contiguous() &&
                      codes.device() == p.device(),
                  "pnm_kernels: ", names[l], "[", i, "] must be contiguous, of shape ",
                  p.sizes(), ", on ", p.device());
      const at::Tensor& scale = call.scales[(l - 2) * n + i];
      TORCH_CHECK(!is_lazy_view(scale), "pnm_kernels: scales[", (l - 2) * n + i, "]", kLazyView);
      TORCH_CHECK(scale.defined() && scale.scalar_type() == at::kFloat &&
                      scale.dim() == 2 && scale.size(0) == rows && scale.size(1) == blocks &&
                      scale.is_contiguous() && scale.device() == p.device(),
                  "pnm_kernels: scales[", (l - 2) * n + i, "] (", names[l], "[", i,
                  "]'s) must be a contiguous float32 tensor of shape [", rows, ", ", blocks,
                  "] on ", p.device());
    }
  }
}

// The expectation of the op call running on this thread, if it comes from held lists.
thread_local const ExpectMemory* expected_memory = nullptr;

// Refuses tensor i of list `block` (HeldMemory's) given other memory than the held lists'.
void check_memory(const ExpectMemory& e, int block, size_t i, const at::Tensor& t,
                  const char* name) {
  const std::vector<Memory>& held = (*e.memory)[block];
  const size_t h = e.at == nullptr ? i : static_cast<size_t>((*e.at)[i]);
  TORCH_CHECK(h < held.size() && !(memory_of(t) != held[h]), "pnm_kernels: ", name, "[", i,
              "] is in other memory than when the held lists were made (t.data = ...)");
}

void check_call(const StepCall& call, const char* const* names, c10::DeviceType device_type) {
  const size_t n = call.lists[0].size();
  for (int l = 1; l < call.num_lists; ++l) {
    TORCH_CHECK(call.lists[l].size() == n, "pnm_kernels: ", names[l], " has ",
                call.lists[l].size(), " tensors but params has ", n);
  }
  TORCH_CHECK(call.steps.size() == n, "pnm_kernels: steps has ", call.steps.size(),
              " tensors but params has ", n);
  const Hyper& h = call.hyper;
  TORCH_CHECK(std::isfinite(call.lr) && call.lr >= 0.0, "pnm_kernels: invalid lr ", call.lr);
  TORCH_CHECK(h.beta1 >= 0.0 && h.beta1 < 1.0, "pnm_kernels: invalid beta1 ", h.beta1);
  TORCH_CHECK(h.beta2 >= 0.0 && h.beta2 < 1.0, "pnm_kernels: invalid beta2 ", h.beta2);
  TORCH_CHECK(std::isfinite(h.beta0), "pnm_kernels: invalid beta0 ", h.beta0);
  TORCH_CHECK(std::isfinite(h.eps) && h.eps >= 0.0, "pnm_kernels: invalid eps ", h.eps);
  TORCH_CHECK(std::isfinite(h.weight_decay) && h.weight_decay >= 0.0,
              "pnm_kernels: invalid weight_decay ", h.weight_decay);
  if (n == 0) return;
  // Held lists hold only the float ops' lists (the state ops' are confirmed by HeldLayouts).
  const ExpectMemory* expected = call.own_state_dtype ? nullptr : expected_memory;

  const at::Tensor& first = call.lists[0][0];
  const c10::Device device = first.device();
  const at::ScalarType dtype = first.scalar_type();
  TORCH_CHECK(device.type() == device_type, "pnm_kernels: this kernel takes ",
              c10::DeviceTypeName(device_type), " tensors, but params[0] is on ", device);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
                  dtype == at::kBFloat16,
              "pnm_kernels: params[0] has dtype ", dtype,
              "; the fused kernels take float32, float64, float16 and bfloat16");
  // The buffers' dtype: the parameters' own, or (the state ops) bfloat16 with stochastic
  // rounding, or float32 beside 16-bit parameters.
  const at::ScalarType state_dtype =
      call.own_state_dtype ? call.lists[2][0].scalar_type() : dtype;
  if (call.int8_state) {
    TORCH_CHECK(dtype != at::kDouble, "pnm_kernels: float64 parameters keep float64 state");
    check_int8_call(call, names);
  } else if (call.own_state_dtype) {
    TORCH_CHECK(dtype != at::kDouble, "pnm_kernels: float64 parameters keep float64 state");
    const bool param_stochastic = call.bf16_stochastic_round && dtype == at::kBFloat16;
    TORCH_CHECK(state_dtype == at::kBFloat16 || (state_dtype == at::kFloat && dtype != at::kFloat),
                "pnm_kernels: ", names[2], "[0] has dtype ", state_dtype, " beside ", dtype,
                " parameters; the state ops keep bfloat16 state, or float32 state of 16-bit "
                "parameters");
    // Rounding to bfloat16 stochastically needs each parameter's seed and offset.
    const size_t wanted = state_dtype == at::kBFloat16 || param_stochastic ? n : 0;
    TORCH_CHECK(call.seeds.size() == wanted && call.offsets.size() == wanted, "pnm_kernels: ",
                call.seeds.size(), " seeds and ", call.offsets.size(), " offsets for ", n,
                " params with ", state_dtype, " state (", wanted, " of each wanted)");
  }
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = call.lists[0][i];
    if (call.own_state_dtype && !call.seeds.empty()) {
      const at::Tensor& seed = call.seeds[i];
      TORCH_CHECK(seed.defined() && seed.numel() == 1 && seed.scalar_type() == at::kLong &&
                      seed.device() == device,
                  "pnm_kernels: seeds[", i, "] must be an int64 tensor with one element on ",
                  device);
      TORCH_CHECK(!is_lazy_view(seed), "pnm_kernels: seeds[", i, "]", kLazyView);
      TORCH_CHECK(call.offsets[i] >= 0, "pnm_kernels: offsets[", i, "] is negative");
    }
    for (int l = 0; l < call.num_lists; ++l) {
      const at::Tensor& t = call.lists[l][i];
      TORCH_CHECK(t.defined(), "pnm_kernels: ", names[l], "[", i, "] is undefined");
      TORCH_CHECK(!is_lazy_view(t), "pnm_kernels: ", names[l], "[", i, "]", kLazyView);
      if (expected != nullptr && l != 1) {  // gradients are not held
        check_memory(*expected, l == 0 ? 0 : l - 1, i, t, names[l]);
      }
      TORCH_CHECK(t.layout() == at::kStrided, "pnm_kernels: ", names[l], "[", i,
                  "] is sparse; PNM/AdaPNM do not support sparse tensors");
      TORCH_CHECK(t.device() == device, "pnm_kernels: ", names[l], "[", i, "] is on ",
                  t.device(), " but params[0] is on ", device);
      if (l >= 2 && call.int8_state) continue;  // codes: check_int8_call
      const at::ScalarType want = (l >= 2 && call.own_state_dtype) ? state_dtype : dtype;
      TORCH_CHECK(t.scalar_type() == want, "pnm_kernels: ", names[l], "[", i, "] has dtype ",
                  t.scalar_type(), " but ", l >= 2 && call.own_state_dtype ? names[2] : "params",
                  "[0] has ", want, " (one call takes one dtype; group tensors by dtype)");
      TORCH_CHECK(t.sizes() == p.sizes(), "pnm_kernels: ", names[l], "[", i, "] has shape ",
                  t.sizes(), " but params[", i, "] has shape ", p.sizes());
      TORCH_CHECK(dense_like(t, p), "pnm_kernels: ", names[l], "[", i,
                  "] must be dense and laid out like params[", i, "] (strides ", t.strides(),
                  " vs ", p.strides(), ")");
      TORCH_CHECK(l != 1 || !dense_spans_overlap(t, p), "pnm_kernels: grads[", i,
                  "] shares memory with params[", i, "]");
    }
    const at::Tensor& s = call.steps[i];
    TORCH_CHECK(s.defined() && s.numel() == 1 && s.scalar_type() == at::kDouble &&
                    s.device() == device,
                "pnm_kernels: steps[", i, "] must be a float64 tensor with one element on ",
                device);
    TORCH_CHECK(!is_lazy_view(s), "pnm_kernels: steps[", i, "]", kLazyView);
    TORCH_CHECK(counts_whole_steps(s), "pnm_kernels: steps[", i, "] is ",
                *static_cast<const double*>(s.const_data_ptr()),
                ", not a whole number of steps >= 0");
    if (expected != nullptr) check_memory(*expected, 5, i, s, "steps");
  }
  // lr alone may be float64 (read in full, for float64 parameters) and on the CPU (read on
  // the host, with no device synchronisation).
  check_scalar_tensor(call.lr_tensor, "lr_tensor", device, /*lr=*/true);
  check_scalar_tensor(call.grad_scale, "grad_scale", device, /*lr=*/false);
  check_scalar_tensor(call.found_inf, "found_inf", device, /*lr=*/false);
  if (call.blocks_done.has_value()) {
    const at::Tensor& d = *call.blocks_done;
    TORCH_CHECK(d.numel() == 1 && d.scalar_type() == at::kInt,
                "pnm_kernels: blocks_done must be an int32 tensor with one element, got ",
                d.scalar_type(), " with ", d.numel(), " elements");
    TORCH_CHECK(d.device() == device, "pnm_kernels: blocks_done is on ", d.device(),
                " but params are on ", device);
  }
}

// What a PNM and an AdaPNM call have in common: the first four lists (param, grad and the
// two momentum buffers), the counters and the step's scalars.
StepCall common_call(at::TensorList params, at::TensorList grads, at::TensorList positive,
                     at::TensorList negative, at::TensorList steps, double lr,
                     const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& blocks_done, bool decoupled) {
  StepCall call;
  call.lists[0] = params;
  call.lists[1] = grads;
  call.lists[2] = positive;
  call.lists[3] = negative;
  call.steps = steps;
  call.lr = lr;
  call.lr_tensor = lr_tensor;
  call.grad_scale = grad_scale;
  call.found_inf = found_inf;
  call.blocks_done = blocks_done;
  call.decoupled = decoupled;
  return call;
}

}  // namespace

ExpectMemory::ExpectMemory(const HeldMemory& memory, const std::vector<int64_t>* at)
    : memory(&memory), at(at), previous_(expected_memory) {
  expected_memory = this;
}

ExpectMemory::~ExpectMemory() { expected_memory = previous_; }

StepCall make_pnm_call(at::TensorList params, at::TensorList grads, at::TensorList pos_momentums,
                       at::TensorList neg_momentums, at::TensorList steps, double lr,
                       double beta1, double beta0, double weight_decay, bool decoupled,
                       bool maximize, const std::optional<at::Tensor>& lr_tensor,
                       const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf,
                       const std::optional<at::Tensor>& blocks_done, c10::DeviceType device_type,
                       at::TensorList seeds, at::IntArrayRef offsets, bool own_state_dtype,
                       bool bf16_stochastic_round, at::TensorList scales) {
  StepCall call = common_call(params, grads, pos_momentums, neg_momentums, steps, lr,
                              lr_tensor, grad_scale, found_inf, blocks_done, decoupled);
  call.int8_state = !scales.empty();
  call.scales = scales;
  call.num_lists = 4;
  call.own_state_dtype = own_state_dtype;
  call.bf16_stochastic_round = bf16_stochastic_round;
  call.seeds = seeds;
  call.offsets = offsets;
  call.hyper = Hyper{beta1, 0.0, beta0, 0.0, weight_decay, maximize};
  check_call(call, kPnmListNames, device_type);
  return call;
}

StepCall make_adapnm_call(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList neg_exp_avgs, at::TensorList exp_avg_sqs,
                          at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr,
                          double beta1, double beta2, double beta0, double eps,
                          double weight_decay, bool amsgrad, bool decoupled, bool maximize,
                          const std::optional<at::Tensor>& lr_tensor,
                          const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf,
                          const std::optional<at::Tensor>& blocks_done,
                          c10::DeviceType device_type, at::TensorList seeds,
                          at::IntArrayRef offsets, bool own_state_dtype,
                          bool bf16_stochastic_round, at::TensorList scales) {
  StepCall call = common_call(params, grads, exp_avgs, neg_exp_avgs, steps, lr, lr_tensor,
                              grad_scale, found_inf, blocks_done, decoupled);
  call.int8_state = !scales.empty();
  call.scales = scales;
  call.own_state_dtype = own_state_dtype;
  call.bf16_stochastic_round = bf16_stochastic_round;
  call.seeds = seeds;
  call.offsets = offsets;
  call.num_lists = amsgrad ? 6 : 5;
  call.lists[4] = exp_avg_sqs;
  if (amsgrad) call.lists[5] = max_exp_avg_sqs;
  call.hyper = Hyper{beta1, beta2, beta0, eps, weight_decay, maximize};
  call.adaptive = true;
  call.amsgrad = amsgrad;
  check_call(call, kAdaPnmListNames, device_type);
  return call;
}

void bump_versions_of(at::TensorList tensors) {
  for (const at::Tensor& t : tensors) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
}

void bump_versions(const StepCall& call) {
  for (int l = 0; l < call.num_lists; ++l) {
    if (l != 1) bump_versions_of(call.lists[l]);  // grads are only read
  }
  bump_versions_of(call.steps);
}

StepArgs make_step_args(const StepCall& call) {
  StepArgs args{};
  args.hyper = call.hyper;
  args.lr = call.lr;
  if (call.lr_tensor.has_value()) {
    const at::Tensor& lr = *call.lr_tensor;
    const bool f64 = lr.scalar_type() == at::kDouble;
    if (lr.device() == call.lists[0][0].device()) {  // read by the kernel
      if (f64) args.lr_f64_ptr = lr.const_data_ptr<double>();
      else args.lr_ptr = lr.const_data_ptr<float>();
    } else {  // a CPU lr for device params: read it here, no synchronisation needed
      args.lr = f64 ? *lr.const_data_ptr<double>()
                    : static_cast<double>(*lr.const_data_ptr<float>());
    }
  }
  if (call.grad_scale.has_value()) args.grad_scale = call.grad_scale->const_data_ptr<float>();
  if (call.found_inf.has_value()) args.found_inf = call.found_inf->const_data_ptr<float>();
  return args;
}

GatheredPointers gather_pointers(const StepCall& call) {
  GatheredPointers g;
  const int64_t n = call.size();
  g.ptrs.reserve(n * call.num_lists);
  g.steps.reserve(n);
  g.numels.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    for (int l = 0; l < call.num_lists; ++l) g.ptrs.push_back(call.lists[l][i].data_ptr());
    g.steps.push_back(static_cast<double*>(call.steps[i].data_ptr()));
    g.numels.push_back(call.lists[0][i].numel());
  }
  return g;
}

GatheredSeeds gather_seeds(const StepCall& call) {
  GatheredSeeds g;
  const int64_t n = call.size();
  g.seeds.assign(n, nullptr);
  g.offsets.assign(n, 0);
  for (int64_t i = 0; i < static_cast<int64_t>(call.seeds.size()); ++i) {
    g.seeds[i] = call.seeds[i].const_data_ptr<int64_t>();
    g.offsets[i] = call.offsets[i];
  }
  return g;
}

int64_t first_mismatched_grad(at::TensorList params, at::TensorList grads, bool same_layout) {
  TORCH_CHECK(params.size() == grads.size(), "pnm_kernels: ", grads.size(), " grads for ",
              params.size(), " params");
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    if (!g.defined() || g.layout() != at::kStrided || p.layout() != at::kStrided ||
        is_lazy_view(p) || is_lazy_view(g) ||
        p.device() != params[0].device() || p.scalar_type() != params[0].scalar_type() ||
        g.device() != p.device() || g.scalar_type() != p.scalar_type() ||
        !g.sizes().equals(p.sizes()) ||
        (same_layout && (!dense_like(g, p) || dense_spans_overlap(g, p)))) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

}  // namespace pnm
