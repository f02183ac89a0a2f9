// Op schemas, argument checks, the fused CPU kernels, and the CPU emulation of the CUDA
// kernels. The CUDA launcher lives in pnm_cuda.cu and shares everything but the launch.
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PNM_X86_AVX2 1
#endif

#include "step_call.h"

namespace pnm {

LaunchLimits& launch_limits() {
  static LaunchLimits limits;
  return limits;
}

namespace {

constexpr const char* kPnmListNames[] = {"params", "grads", "pos_momentums", "neg_momentums"};
constexpr const char* kAdaPnmListNames[] = {"params",       "grads",      "exp_avgs",
                                            "neg_exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"};

// Same memory layout: equal strides on every dimension that has more than one element.
bool same_layout_as(const at::Tensor& a, const at::Tensor& b) {
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

// What the kernels need of every list: dense, and laid out like the parameter. Both
// contiguous is the common case, answered from cached flags.
bool dense_like(const at::Tensor& t, const at::Tensor& p) {
  return (t.is_contiguous() && p.is_contiguous()) ||
         (t.is_non_overlapping_and_dense() && same_layout_as(t, p));
}

void check_scalar_tensor(const std::optional<at::Tensor>& t, const char* name,
                         const c10::Device& device, bool lr) {
  if (!t.has_value()) return;
  const bool dtype_ok =
      t->scalar_type() == at::kFloat || (lr && t->scalar_type() == at::kDouble);
  TORCH_CHECK(t->numel() == 1 && dtype_ok, "pnm_kernels: ", name, " must be a ",
              lr ? "float32 or float64" : "float32", " tensor with one element, got ",
              t->scalar_type(), " with ", t->numel(), " elements");
  TORCH_CHECK(t->device() == device || (lr && t->device().is_cpu()),
              "pnm_kernels: ", name, " is on ", t->device(), " but params are on ", device);
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

  const at::Tensor& first = call.lists[0][0];
  const c10::Device device = first.device();
  const at::ScalarType dtype = first.scalar_type();
  TORCH_CHECK(device.type() == device_type, "pnm_kernels: this kernel takes ",
              c10::DeviceTypeName(device_type), " tensors, but params[0] is on ", device);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
                  dtype == at::kBFloat16,
              "pnm_kernels: params[0] has dtype ", dtype,
              "; the fused kernels take float32, float64, float16 and bfloat16");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = call.lists[0][i];
    for (int l = 0; l < call.num_lists; ++l) {
      const at::Tensor& t = call.lists[l][i];
      TORCH_CHECK(t.defined(), "pnm_kernels: ", names[l], "[", i, "] is undefined");
      TORCH_CHECK(t.layout() == at::kStrided, "pnm_kernels: ", names[l], "[", i,
                  "] is sparse; PNM/AdaPNM do not support sparse tensors");
      TORCH_CHECK(t.device() == device, "pnm_kernels: ", names[l], "[", i, "] is on ",
                  t.device(), " but params[0] is on ", device);
      TORCH_CHECK(t.scalar_type() == dtype, "pnm_kernels: ", names[l], "[", i, "] has dtype ",
                  t.scalar_type(), " but params[0] has ", dtype,
                  " (one call takes one dtype; group tensors by dtype)");
      TORCH_CHECK(t.sizes() == p.sizes(), "pnm_kernels: ", names[l], "[", i, "] has shape ",
                  t.sizes(), " but params[", i, "] has shape ", p.sizes());
      TORCH_CHECK(dense_like(t, p), "pnm_kernels: ", names[l], "[", i,
                  "] must be dense and laid out like params[", i, "] (strides ", t.strides(),
                  " vs ", p.strides(), ")");
    }
    const at::Tensor& s = call.steps[i];
    TORCH_CHECK(s.defined() && s.numel() == 1 && s.scalar_type() == at::kFloat &&
                    s.device() == device,
                "pnm_kernels: steps[", i, "] must be a float32 tensor with one element on ",
                device);
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

StepCall make_pnm_call(at::TensorList params, at::TensorList grads, at::TensorList pos_momentums,
                       at::TensorList neg_momentums, at::TensorList steps, double lr,
                       double beta1, double beta0, double weight_decay, bool decoupled,
                       bool maximize, const std::optional<at::Tensor>& lr_tensor,
                       const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf,
                       const std::optional<at::Tensor>& blocks_done, c10::DeviceType device_type) {
  StepCall call = common_call(params, grads, pos_momentums, neg_momentums, steps, lr,
                              lr_tensor, grad_scale, found_inf, blocks_done, decoupled);
  call.num_lists = 4;
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
                          c10::DeviceType device_type) {
  StepCall call = common_call(params, grads, exp_avgs, neg_exp_avgs, steps, lr, lr_tensor,
                              grad_scale, found_inf, blocks_done, decoupled);
  call.num_lists = amsgrad ? 6 : 5;
  call.lists[4] = exp_avg_sqs;
  if (amsgrad) call.lists[5] = max_exp_avg_sqs;
  call.hyper = Hyper{beta1, beta2, beta0, eps, weight_decay, maximize};
  call.adaptive = true;
  call.amsgrad = amsgrad;
  check_call(call, kAdaPnmListNames, device_type);
  return call;
}

namespace {
void bump_versions_of(at::TensorList tensors) {
  for (const at::Tensor& t : tensors) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
}
}  // namespace

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
    g.steps.push_back(static_cast<float*>(call.steps[i].data_ptr()));
    g.numels.push_back(call.lists[0][i].numel());
  }
  return g;
}

namespace {

// ---------------------------------------------------------------------------------------
// Fused CPU kernel: one pass over memory, the elements of all tensors split evenly between
// threads with at::parallel_for; the loops are written for the compiler's auto-vectoriser
// (restrict pointers, no branches), fp32, fp64 and bf16 in place; fp16 runs the same maths
// on vector registers where F16C is (see Lanes), elsewhere through small fp32 tiles.

constexpr int64_t kCpuChunk = 1 << 15;  // the fewest elements worth a thread of their own
constexpr int64_t kCpuTile = 512;

// Element access in the arithmetic type for the storage types the loops run on directly:
// fp32 and fp64 as they are, bf16 in fp32 (a shift in, round-to-nearest-even out), all of
// which the compiler vectorises. fp16 does not: see cpu_range_body.
#define PNM_CPU_INLINE inline __attribute__((always_inline))

// std::bit_cast, which the C++17 that older torch builds extensions with lacks.
template <class To, class From>
PNM_CPU_INLINE To bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}

PNM_CPU_INLINE float load(const float* a, int64_t i) { return a[i]; }
PNM_CPU_INLINE void store(float* a, int64_t i, float v) { a[i] = v; }
PNM_CPU_INLINE double load(const double* a, int64_t i) { return a[i]; }
PNM_CPU_INLINE void store(double* a, int64_t i, double v) { a[i] = v; }

PNM_CPU_INLINE float load(const c10::BFloat16* a, int64_t i) {
  return bit_cast<float>(static_cast<uint32_t>(a[i].x) << 16);
}

// Rounds to nearest even and makes NaN 0x7FC0: bitwise what c10::BFloat16(float) gives.
PNM_CPU_INLINE void store(c10::BFloat16* a, int64_t i, float v) {
  const uint32_t u = bit_cast<uint32_t>(v);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  a[i].x = v != v ? static_cast<uint16_t>(0x7FC0) : rounded;
}

// The loops take a local copy of the coefficients: through a reference GCC cannot rule out
// aliasing with the arrays, and does not vectorise the AdaPNM loop.
template <bool kDecoupled, typename S, typename C>
PNM_CPU_INLINE void cpu_loop_body(PnmAlgo<kDecoupled>, S* const* x, int64_t n,
                                  const Coeffs<C> coeffs, C gf) {
  S* __restrict__ p = x[0];
  const S* __restrict__ g = x[1];
  S* __restrict__ m = x[2];
  const S* __restrict__ m_other = x[3];
  for (int64_t i = 0; i < n; ++i) {
    C pi = load(p, i), mi = load(m, i);
    pnm_element<kDecoupled>(pi, load(g, i) * gf, mi, load(m_other, i), coeffs);
    store(p, i, pi);
    store(m, i, mi);
  }
}

// Arrays as restrict parameters: taken from x[] inside, GCC does not vectorise six of them.
template <bool kDecoupled, bool kAmsgrad, typename S, typename C>
PNM_CPU_INLINE void adapnm_loop(S* __restrict__ p, const S* __restrict__ g, S* __restrict__ m,
                                const S* __restrict__ m_other, S* __restrict__ v,
                                S* __restrict__ v_max, int64_t n, const Coeffs<C> coeffs,
                                C gf) {
  for (int64_t i = 0; i < n; ++i) {
    C pi = load(p, i), mi = load(m, i), vi = load(v, i);
    C vmi = kAmsgrad ? load(v_max, i) : C(0);
    adapnm_element<kDecoupled, kAmsgrad>(pi, load(g, i) * gf, mi, load(m_other, i), vi, vmi,
                                         coeffs);
    store(p, i, pi);
    store(m, i, mi);
    store(v, i, vi);
    if constexpr (kAmsgrad) store(v_max, i, vmi);
  }
}

template <bool kDecoupled, bool kAmsgrad, typename S, typename C>
PNM_CPU_INLINE void cpu_loop_body(AdaPnmAlgo<kDecoupled, kAmsgrad>, S* const* x, int64_t n,
                                  const Coeffs<C> coeffs, C gf) {
  adapnm_loop<kDecoupled, kAmsgrad>(x[0], x[1], x[2], x[3], x[4], kAmsgrad ? x[5] : nullptr, n,
                                    coeffs, gf);
}

template <typename T, class Algo>
struct CpuTensorWork {
  T* ptr[Algo::kLists];  // parity already applied: ptr[2] is this step's buffer
  Coeffs<opmath_t<T>> coeffs;
};

// The instruction sets the range loop is compiled for (see cpu_range).
enum class CpuIsa { kBaseline, kAvx2, kAvx512 };
constexpr const char* kCpuIsaNames[] = {"baseline", "avx2", "avx512"};

// fp16 <-> fp32 for the tiles: c10's conversions, or F16C where the CPU has it.
PNM_CPU_INLINE void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

PNM_CPU_INLINE void from_float(const float* src, c10::Half* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

#ifdef PNM_X86_AVX2
// fp16 with the F16C instructions (every AVX2 CPU has them); IEEE round to nearest even, as
// c10::Half. Only the AVX2 build of the range loop calls these.
__attribute__((target("avx2,f16c"))) inline void to_float_f16c(const c10::Half* src, float* dst,
                                                                int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

__attribute__((target("avx2,f16c"))) inline void from_float_f16c(const float* src,
                                                                  c10::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

// The same, 16 at a time (AVX-512F has the 512-bit forms of both conversions).
__attribute__((target("avx512f,avx2,f16c"))) inline void to_float_avx512(const c10::Half* src,
                                                                          float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
  }
  to_float_f16c(src + i, dst + i, n - i);
}

__attribute__((target("avx512f,avx2,f16c"))) inline void from_float_avx512(const float* src,
                                                                            c10::Half* dst,
                                                                            int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
  }
  from_float_f16c(src + i, dst + i, n - i);
}
#endif

#ifdef PNM_X86_AVX2
// fp16 in registers: F16C widens 8 (AVX2) or 16 (AVX-512) elements at once and the element
// maths of pnm_math.h runs on them as GCC vector types, whose + * / act lane by lane with
// IEEE rounding (no FMA: -ffp-contract=off; nan_max and the square root below), so every
// lane computes what the scalar loop computes. This spares the fp32 tiles' store and reload
// of every array, in and out, which bound the fp16 step (on the transformer set AdaPNM went
// from 0.8 to 1.05 of torch's fused fp16 GB/s: benchmarks/results/cpu_fp16_lanes.md).
// (Vector types of their own: __m256/__m512 carry may_alias, which template arguments drop.)
typedef float F32x8 __attribute__((vector_size(32)));
typedef float F32x16 __attribute__((vector_size(64)));
template <class V>
struct Lanes {
  V v;
};
template <class V>
PNM_CPU_INLINE Lanes<V> operator+(Lanes<V> a, Lanes<V> b) { return {a.v + b.v}; }
template <class V>
PNM_CPU_INLINE Lanes<V> operator*(Lanes<V> a, Lanes<V> b) { return {a.v * b.v}; }
template <class V>
PNM_CPU_INLINE Lanes<V> operator/(Lanes<V> a, Lanes<V> b) { return {a.v / b.v}; }
template <class V>
PNM_CPU_INLINE Lanes<V> splat(float x) {
  Lanes<V> out;
  for (size_t i = 0; i < sizeof(V) / sizeof(float); ++i) out.v[i] = x;
  return out;
}

// The F16C conversions and the square root. Not always_inline: GCC refuses to force a
// target's instructions into the ISA-neutral templates above them; cpu_range_avx2/_avx512
// are `flatten`, which inlines them there, in a function of their target.
struct HalfLanes8 {
  using V = Lanes<F32x8>;
  static constexpr int kLanes = 8;
  __attribute__((target("avx2,f16c"))) static inline V load(const c10::Half* src) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)))};
  }
  __attribute__((target("avx2,f16c"))) static inline void store(c10::Half* dst, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                     _mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT));
  }
};
__attribute__((target("avx2,f16c"))) inline Lanes<F32x8> square_root(Lanes<F32x8> x) {
  return {_mm256_sqrt_ps(x.v)};
}
// pnm_math.h's nan_max lane by lane (found by argument-dependent lookup): a > b ? a : b,
// then a NaN b, then a NaN a wins. (Written with GCC's vector ?: instead, the 16-lane form
// compiled to one scalar compare per lane.)
__attribute__((target("avx2,f16c"))) inline Lanes<F32x8> nan_max(Lanes<F32x8> a,
                                                                   Lanes<F32x8> b) {
  __m256 r = _mm256_blendv_ps(b.v, a.v, _mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ));
  r = _mm256_blendv_ps(r, b.v, _mm256_cmp_ps(b.v, b.v, _CMP_UNORD_Q));
  return {_mm256_blendv_ps(r, a.v, _mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q))};
}

struct HalfLanes16 {
  using V = Lanes<F32x16>;
  static constexpr int kLanes = 16;
  __attribute__((target("avx512f,avx2,f16c"))) static inline V load(const c10::Half* src) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)))};
  }
  __attribute__((target("avx512f,avx2,f16c"))) static inline void store(c10::Half* dst, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT));
  }
};
__attribute__((target("avx512f,avx2,f16c"))) inline Lanes<F32x16> square_root(Lanes<F32x16> x) {
  return {_mm512_sqrt_ps(x.v)};
}
__attribute__((target("avx512f,avx2,f16c"))) inline Lanes<F32x16> nan_max(Lanes<F32x16> a,
                                                                           Lanes<F32x16> b) {
  __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ), b.v, a.v);
  r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(b.v, b.v, _CMP_UNORD_Q), r, b.v);
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), r, a.v)};
}

// One tensor's coefficients in every lane.
template <class H>
PNM_CPU_INLINE Coeffs<typename H::V> splat_coeffs(const Coeffs<float>& c) {
  using V = decltype(H::V::v);
  Coeffs<typename H::V> out;
  out.decay = splat<V>(c.decay);
  out.l2 = splat<V>(c.l2);
  out.b1_sq = splat<V>(c.b1_sq);
  out.one_minus_b1_sq = splat<V>(c.one_minus_b1_sq);
  out.b2 = splat<V>(c.b2);
  out.one_minus_b2 = splat<V>(c.one_minus_b2);
  out.pos_coef = splat<V>(c.pos_coef);
  out.neg_coef = splat<V>(c.neg_coef);
  out.inv_noise_norm = splat<V>(c.inv_noise_norm);
  out.neg_step_size = splat<V>(c.neg_step_size);
  out.bc2_sqrt = splat<V>(c.bc2_sqrt);
  out.eps = splat<V>(c.eps);
  return out;
}

// The whole vectors of an fp16 range, in registers; returns how many elements it did (the
// rest, fewer than kLanes, go through a tile).
template <class H, class Algo>
PNM_CPU_INLINE int64_t half_lanes_loop(c10::Half* const* x, int64_t n,
                                       const Coeffs<float>& coeffs, float gf) {
  using V = typename H::V;
  constexpr int L = Algo::kLists;
  const Coeffs<V> c = splat_coeffs<H>(coeffs);
  const V grad_factor = splat<decltype(V::v)>(gf);
  int64_t i = 0;
  for (; i + H::kLanes <= n; i += H::kLanes) {
    V e[L];
    for (int l = 0; l < L; ++l) e[l] = H::load(x[l] + i);
    e[1] = e[1] * grad_factor;
    Algo::apply(e, c);
    for (int l = 0; l < L; ++l) {
      if (is_written(l)) H::store(x[l] + i, e[l]);
    }
  }
  return i;
}
#endif

// The tiles' conversions for the build at hand: 512-bit or 256-bit F16C, c10's otherwise.
template <CpuIsa kIsa>
PNM_CPU_INLINE void tile_in(const c10::Half* src, float* dst, int64_t n) {
#ifdef PNM_X86_AVX2
  if constexpr (kIsa == CpuIsa::kAvx512) return to_float_avx512(src, dst, n);
  if constexpr (kIsa == CpuIsa::kAvx2) return to_float_f16c(src, dst, n);
#endif
  to_float(src, dst, n);
}

template <CpuIsa kIsa>
PNM_CPU_INLINE void tile_out(const float* src, c10::Half* dst, int64_t n) {
#ifdef PNM_X86_AVX2
  if constexpr (kIsa == CpuIsa::kAvx512) return from_float_avx512(src, dst, n);
  if constexpr (kIsa == CpuIsa::kAvx2) return from_float_f16c(src, dst, n);
#endif
  from_float(src, dst, n);
}

// One range of one tensor. fp32, fp64 and bf16 run the loop in place; fp16 in vector registers
// where F16C is (AVX2, AVX-512), its last few elements and the baseline build through fp32
// tiles.
template <typename T, class Algo, CpuIsa kIsa>
PNM_CPU_INLINE void cpu_range_body(const CpuTensorWork<T, Algo>& w, int64_t begin, int64_t end,
                                   opmath_t<T> gf) {
  constexpr int L = Algo::kLists;
  if constexpr (!std::is_same_v<T, c10::Half>) {
    T* x[L];
    for (int l = 0; l < L; ++l) x[l] = w.ptr[l] + begin;
    cpu_loop_body(Algo{}, x, end - begin, w.coeffs, gf);
  } else {
#ifdef PNM_X86_AVX2
    if constexpr (kIsa != CpuIsa::kBaseline) {
      using H = std::conditional_t<kIsa == CpuIsa::kAvx512, HalfLanes16, HalfLanes8>;
      c10::Half* x[L];
      for (int l = 0; l < L; ++l) x[l] = w.ptr[l] + begin;
      begin += half_lanes_loop<H, Algo>(x, end - begin, w.coeffs, gf);
    }
#endif
    float tile[L][kCpuTile];
    float* x[L];
    for (int l = 0; l < L; ++l) x[l] = tile[l];
    for (int64_t t0 = begin; t0 < end; t0 += kCpuTile) {
      const int64_t n = std::min(kCpuTile, end - t0);
      for (int l = 0; l < L; ++l) tile_in<kIsa>(w.ptr[l] + t0, tile[l], n);
      cpu_loop_body(Algo{}, x, n, w.coeffs, gf);
      for (int l = 0; l < L; ++l) {
        if (is_written(l)) tile_out<kIsa>(tile[l], w.ptr[l] + t0, n);
      }
    }
  }
}

// The range loop compiled three times: for the x86-64 baseline (SSE2), for AVX2 (+F16C) and
// for AVX-512 (F, BW, VL), picked at run time. AVX-512 halves the instructions per element,
// which is what bf16 and fp16 steps (conversions in and out) are bound by. No FMA (the build
// passes -ffp-contract=off; AVX-512 targets would contract otherwise): the CPU kernel stays
// bitwise equal to the emulated CUDA path, whose tests compare the two on every ISA.
template <typename T, class Algo>
void cpu_range_baseline(const CpuTensorWork<T, Algo>& w, int64_t begin, int64_t end,
                        opmath_t<T> gf) {
  cpu_range_body<T, Algo, CpuIsa::kBaseline>(w, begin, end, gf);
}

#ifdef PNM_X86_AVX2
template <typename T, class Algo>
__attribute__((target("avx2,f16c"), flatten)) void cpu_range_avx2(
    const CpuTensorWork<T, Algo>& w, int64_t begin, int64_t end, opmath_t<T> gf) {
  cpu_range_body<T, Algo, CpuIsa::kAvx2>(w, begin, end, gf);
}

template <typename T, class Algo>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c"), flatten)) void cpu_range_avx512(
    const CpuTensorWork<T, Algo>& w, int64_t begin, int64_t end, opmath_t<T> gf) {
  cpu_range_body<T, Algo, CpuIsa::kAvx512>(w, begin, end, gf);
}
#endif

bool cpu_supports(CpuIsa isa) {
#ifdef PNM_X86_AVX2
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  switch (isa) {
    case CpuIsa::kBaseline: return true;
    case CpuIsa::kAvx2: return avx2;
    case CpuIsa::kAvx512:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  }
#endif
  return isa == CpuIsa::kBaseline;
}

CpuIsa best_cpu_isa() {
  for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2}) {
    if (cpu_supports(isa)) return isa;
  }
  return CpuIsa::kBaseline;
}

CpuIsa& active_cpu_isa() {
  static CpuIsa isa = best_cpu_isa();
  return isa;
}

template <typename T, class Algo>
void cpu_range(const CpuTensorWork<T, Algo>& w, int64_t begin, int64_t end, opmath_t<T> gf) {
#ifdef PNM_X86_AVX2
  switch (active_cpu_isa()) {
    case CpuIsa::kAvx512: return cpu_range_avx512<T, Algo>(w, begin, end, gf);
    case CpuIsa::kAvx2: return cpu_range_avx2<T, Algo>(w, begin, end, gf);
    case CpuIsa::kBaseline: break;
  }
#endif
  cpu_range_baseline<T, Algo>(w, begin, end, gf);
}

template <typename T, class Algo>
void run_cpu_fused(const StepCall& call, const StepArgs& args) {
  if (step_skipped(args.found_inf)) return;
  const int64_t n = call.size();
  const double lr = step_lr(args);
  using C = opmath_t<T>;
  const C gf = grad_factor<C>(args.hyper.maximize, args.grad_scale);
  std::vector<CpuTensorWork<T, Algo>> work(n);
  std::vector<int64_t> offsets(n + 1, 0);  // tensor i: elements [offsets[i], offsets[i + 1])
  double coeffs_step = -1.0;  // tensors mostly share a step count: compute its pow()s once
  Coeffs<C> coeffs{};
  for (int64_t i = 0; i < n; ++i) {
    // Types were checked with the call: the untyped pointers skip a check per tensor.
    const double step = static_cast<double>(*static_cast<float*>(call.steps[i].data_ptr())) + 1.0;
    for (int l = 0; l < Algo::kLists; ++l) {
      work[i].ptr[l] = static_cast<T*>(call.lists[l][i].data_ptr());
    }
    if ((static_cast<int64_t>(step) & 1) == 0) std::swap(work[i].ptr[2], work[i].ptr[3]);
    if (step != coeffs_step) {
      coeffs = make_coeffs<C>(args.hyper, lr, step, Algo::kAdaptive);
      coeffs_step = step;
    }
    work[i].coeffs = coeffs;
    offsets[i + 1] = offsets[i] + call.lists[0][i].numel();
  }
  // The tensors as one run of elements, split between threads by element count (a split by
  // tensor or by chunk count leaves one thread with more work when sizes differ), each
  // thread's share at least kCpuChunk: a step over many tiny tensors stays on the calling
  // thread instead of paying to wake the others for microseconds of work.
  at::parallel_for(0, offsets[n], kCpuChunk, [&](int64_t lo, int64_t hi) {
    // The first tensor with elements at or after lo (empty tensors share its offset).
    int64_t i = std::upper_bound(offsets.begin(), offsets.end(), lo) - offsets.begin() - 1;
    for (; i < n && offsets[i] < hi; ++i) {
      const int64_t begin = std::max(lo, offsets[i]) - offsets[i];
      const int64_t end = std::min(hi, offsets[i + 1]) - offsets[i];
      if (begin < end) cpu_range(work[i], begin, end, gf);
    }
  });
  for (int64_t i = 0; i < n; ++i) *static_cast<float*>(call.steps[i].data_ptr()) += 1.0f;
}

// ---------------------------------------------------------------------------------------
// CPU emulation of the CUDA launch: the same launch tables, the same block body, walked
// block by block and thread by thread. In a single-launch step blocks take their tickets in
// order, so the last one to take one is the last block, as on the GPU.
template <typename T, class Algo>
void run_emulated_cuda(const StepCall& call, const StepArgs& args) {
  const GatheredPointers g = gather_pointers(call);
  const int n = static_cast<int>(call.size());
  unsigned int* const blocks_done = blocks_done_ptr(call);
  TORCH_CHECK(blocks_done == nullptr || *blocks_done == 0,
              "pnm_kernels: blocks_done must be zero when a step starts, got ", *blocks_done);
  const LaunchLimits& limits = launch_limits();
  const int max_single_blocks = blocks_done != nullptr ? limits.max_single_launch_blocks : 0;
  auto tables = plan_launches<Algo::kLists>(n, g.ptrs.data(), g.steps.data(), g.numels.data(),
                                            sizeof(T), limits, max_single_blocks);
  if (make_single_launch(tables, blocks_done, max_single_blocks)) {
    if (step_skipped(args.found_inf)) return;
    const LaunchTable<Algo::kLists>& table = tables[0];
    const int grid = single_launch_grid(table);
    for (int block = 0; block < grid; ++block) {
      if (block < table.num_blocks) {  // else the one block of a table of empty tensors
        for (int thread = 0; thread < kBlockSize; ++thread) {
          step_block<T, Algo>(table, args, block, thread, kBlockSize);
        }
      }
      if (++*blocks_done == static_cast<unsigned int>(grid)) {  // this block's ticket
        for (int thread = 0; thread < kBlockSize; ++thread) finish_launch(table, thread, kBlockSize);
      }
    }
    return;
  }
  for (const auto& table : tables) {
    for (int block = 0; block < table.num_blocks; ++block) {
      for (int thread = 0; thread < kBlockSize; ++thread) {
        step_block<T, Algo>(table, args, block, thread, kBlockSize);
      }
    }
  }
  for (const auto& counters : plan_step_counters(n, g.steps.data())) {
    for (int thread = 0; thread < kBlockSize; ++thread) {
      increment_steps(counters, args.found_inf, thread, kBlockSize);
    }
  }
}

// The two CPU implementations of the ops: the fused CPU kernel, and the CUDA kernels' code
// emulated on the host.
template <bool kEmulateCuda>
struct CpuImpl {
  static constexpr c10::DeviceType kDevice = c10::DeviceType::CPU;
  static void run(const StepCall& call) {
    if (call.size() == 0) return;
    const StepArgs args = make_step_args(call);
    dispatch_step(call, [&](auto t, auto a) {
      using T = typename decltype(t)::type;
      using Algo = typename decltype(a)::type;
      if constexpr (kEmulateCuda) {
        run_emulated_cuda<T, Algo>(call, args);
      } else {
        run_cpu_fused<T, Algo>(call, args);
      }
    });
  }
};
using CpuFused = CpuImpl<false>;
using EmulatedCuda = CpuImpl<true>;

// The optimizer's per-step gradient check for a batch, without a Python loop. With
// same_layout, a gradient that is not dense and laid out like its parameter counts too.
int64_t first_mismatched_grad(at::TensorList params, at::TensorList grads, bool same_layout) {
  TORCH_CHECK(params.size() == grads.size(), "pnm_kernels: ", grads.size(), " grads for ",
              params.size(), " params");
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    if (!g.defined() || g.layout() != at::kStrided || p.layout() != at::kStrided ||
        p.device() != params[0].device() || p.scalar_type() != params[0].scalar_type() ||
        g.device() != p.device() || g.scalar_type() != p.scalar_type() ||
        !g.sizes().equals(p.sizes()) || (same_layout && !dense_like(g, p))) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

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
  std::vector<float*> steps(n, nullptr);
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
  active_cpu_isa() = isa;
  return name;
}

std::string cpu_isa() { return kCpuIsaNames[static_cast<int>(active_cpu_isa())]; }

std::vector<std::string> cpu_isas() {
  std::vector<std::string> names;
  for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (cpu_supports(isa)) names.emplace_back(kCpuIsaNames[static_cast<int>(isa)]);
  }
  return names;
}

// Some tensors of a list, borrowed: a list for a call, without a reference-count increment
// and decrement for each tensor. A step where some held parameters lack a gradient takes the
// others from six lists: copied, the host time of a 2,000-tensor AdaPNM step with 10 % of its
// gradients missing was 0.48-0.52 ms, borrowed 0.36-0.39 (0.34-0.38 with none missing;
// benchmarks/results/missing_grads.md). The list it borrows from must outlive it (StepLists
// holds its lists).
class BorrowedSubset {
 public:
  BorrowedSubset(const std::vector<at::Tensor>& list, const std::vector<int64_t>& at) {
    if (list.empty()) return;  // a buffer this optimizer does not hold (buffer3 without AMSGrad)
    tensors_.reserve(at.size());
    for (int64_t i : at) {
      const at::Tensor& t = list[static_cast<size_t>(i)];
      tensors_.push_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t));
    }
  }
  ~BorrowedSubset() {
    for (at::Tensor& t : tensors_) c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
  }
  BorrowedSubset(const BorrowedSubset&) = delete;
  BorrowedSubset& operator=(const BorrowedSubset&) = delete;
  const std::vector<at::Tensor>& get() const { return tensors_; }

 private:
  std::vector<at::Tensor> tensors_;
};

// The lists of a batch that stay the same from step to step (parameters, buffers, step
// counters), converted from Python once: an eager step then converts only its gradients,
// which for thousands of small tensors is most of the host time. Each step goes through the
// registered ops, so every check and every device's kernel is the same as for a direct call.
// The batch's own blocks_done counter (optional) lets a CUDA step be a single launch.
struct StepLists : torch::CustomClassHolder {
  std::vector<at::Tensor> params, buffer0, buffer1, buffer2, buffer3, steps;
  std::optional<at::Tensor> blocks_done;

  StepLists(std::vector<at::Tensor> params, std::vector<at::Tensor> buffer0,
            std::vector<at::Tensor> buffer1, std::vector<at::Tensor> buffer2,
            std::vector<at::Tensor> buffer3, std::vector<at::Tensor> steps,
            std::optional<at::Tensor> blocks_done)
      : params(std::move(params)), buffer0(std::move(buffer0)), buffer1(std::move(buffer1)),
        buffer2(std::move(buffer2)), buffer3(std::move(buffer3)), steps(std::move(steps)),
        blocks_done(std::move(blocks_done)) {}

  void pnm_step(std::vector<at::Tensor> grads, bool emulate, double lr, double beta1,
                double beta0, double weight_decay, bool decoupled, bool maximize,
                std::optional<at::Tensor> lr_tensor, std::optional<at::Tensor> grad_scale,
                std::optional<at::Tensor> found_inf) {
    pnm_step_on(params, grads, buffer0, buffer1, steps, emulate, lr, beta1, beta0,
                weight_decay, decoupled, maximize, lr_tensor, grad_scale, found_inf);
  }

  void adapnm_step(std::vector<at::Tensor> grads, bool emulate, double lr, double beta1,
                   double beta2, double beta0, double eps, double weight_decay, bool amsgrad,
                   bool decoupled, bool maximize, std::optional<at::Tensor> lr_tensor,
                   std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf) {
    adapnm_step_on(params, grads, buffer0, buffer1, buffer2, buffer3, steps, emulate, lr, beta1,
                   beta2, beta0, eps, weight_decay, amsgrad, decoupled, maximize, lr_tensor,
                   grad_scale, found_inf);
  }

  // A step with the held parameters' own gradients (read here, so none cross over from
  // Python), or with those take_own_grads() took for it (use_taken). A parameter without a
  // gradient does not step, as on the careful path. Returns false, having done nothing,
  // when a gradient is not dense and laid out like its parameter, or a parameter outside
  // the lists (hold_outside) has one: the optimizer then takes its careful path, which
  // copies it, makes its state or says what is wrong.
  bool pnm_step_own_grads(bool use_taken, bool emulate, double lr, double beta1, double beta0,
                          double weight_decay, bool decoupled, bool maximize,
                          std::optional<at::Tensor> lr_tensor,
                          std::optional<at::Tensor> grad_scale,
                          std::optional<at::Tensor> found_inf) {
    OwnGrads own;
    if (!own_or_taken_grads(use_taken, own)) return false;
    if (own.grads.empty()) return true;  // no parameter has a gradient: none steps
    if (own.present.empty()) {
      pnm_step(std::move(own.grads), emulate, lr, beta1, beta0, weight_decay, decoupled,
               maximize, lr_tensor, grad_scale, found_inf);
    } else {
      const auto& at = own.present;
      pnm_step_on(BorrowedSubset(params, at).get(), own.grads, BorrowedSubset(buffer0, at).get(),
                  BorrowedSubset(buffer1, at).get(), BorrowedSubset(steps, at).get(), emulate,
                  lr, beta1, beta0, weight_decay, decoupled, maximize, lr_tensor, grad_scale,
                  found_inf);
    }
    return true;
  }

  bool adapnm_step_own_grads(bool use_taken, bool emulate, double lr, double beta1,
                             double beta2, double beta0, double eps, double weight_decay,
                             bool amsgrad, bool decoupled, bool maximize,
                             std::optional<at::Tensor> lr_tensor,
                             std::optional<at::Tensor> grad_scale,
                             std::optional<at::Tensor> found_inf) {
    OwnGrads own;
    if (!own_or_taken_grads(use_taken, own)) return false;
    if (own.grads.empty()) return true;  // no parameter has a gradient: none steps
    if (own.present.empty()) {
      adapnm_step(std::move(own.grads), emulate, lr, beta1, beta2, beta0, eps, weight_decay,
                  amsgrad, decoupled, maximize, lr_tensor, grad_scale, found_inf);
    } else {
      const auto& at = own.present;
      adapnm_step_on(BorrowedSubset(params, at).get(), own.grads,
                     BorrowedSubset(buffer0, at).get(), BorrowedSubset(buffer1, at).get(),
                     BorrowedSubset(buffer2, at).get(), BorrowedSubset(buffer3, at).get(),
                     BorrowedSubset(steps, at).get(), emulate, lr, beta1, beta2, beta0, eps,
                     weight_decay, amsgrad, decoupled, maximize, lr_tensor, grad_scale,
                     found_inf);
    }
    return true;
  }

  // A step over several batches first takes every batch's gradients, so that none steps
  // unless all can (a gradient laid out unlike its parameter, or a parameter given new
  // data: see held_lists_ok); each batch's step then uses what it took, and the gradients
  // are read once. False, holding nothing, when this batch cannot step.
  bool take_own_grads() {
    drop_taken_grads();
    OwnGrads own;
    if (!own_grads(own) || !held_lists_ok()) return false;
    taken = std::move(own);
    has_taken = true;
    return true;
  }

  void drop_taken_grads() {
    taken = OwnGrads();
    has_taken = false;
  }

  // Parameters of the batch's param group that have no state and so are not held: a
  // gradient for one of them makes the own-gradient steps decline (the careful path then
  // makes its state). Checked here, not in Python: a model passed whole, most of it frozen,
  // has thousands.
  void hold_outside(std::vector<at::Tensor> params_without_state) {
    outside = std::move(params_without_state);
  }

  // Whether the held parameters still fit their state (dtype, device, shape, layout). A
  // parameter given new data (p.data = ...) changes under the held lists; the optimizer then
  // rebuilds the batch, its state following the parameter. The buffers are the optimizer's
  // own and were made to fit when the batch was built, so the first stands for all. A step
  // over several batches, and a Triton step (whose kernels check nothing), ask this first.
  bool held_lists_ok() const {
    if (buffer0.size() != params.size()) return false;
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      const at::Tensor& b = buffer0[i];
      if (b.scalar_type() != p.scalar_type() || b.device() != p.device() ||
          !b.sizes().equals(p.sizes()) || !dense_like(b, p)) {
        return false;
      }
    }
    return true;
  }

  // For the Triton step, which writes through raw pointers: the version counters of the
  // params, the first num_buffers buffers and the counters (see bump_versions).
  void bump_versions(int64_t num_buffers) {
    const std::vector<at::Tensor>* lists[] = {&params, &buffer0, &buffer1, &buffer2, &buffer3};
    for (int64_t l = 0; l < 1 + num_buffers && l < 5; ++l) bump_versions_of(*lists[l]);
    bump_versions_of(steps);
  }

  // For a repeated Triton step: pointers() with the held parameters' own gradients, read
  // here, or with those take_own_grads() took (use_taken). Empty, the gradients let go of,
  // when a held parameter has no gradient or one unlike it (dtype, device, shape, layout), a
  // parameter outside the lists has one, or a parameter was given new data (held_lists_ok):
  // the kernels check nothing, so the optimizer's careful path then takes the step.
  at::Tensor own_grad_pointers(bool use_taken, int64_t num_buffers) {
    OwnGrads own;
    if (!own_or_taken_grads(use_taken, own) || own.grads.size() != params.size() ||
        params.empty() || (!use_taken && !held_lists_ok())) {
      return at::empty({0}, at::kLong);
    }
    return pointers(std::move(own.grads), num_buffers);
  }

  // The data pointers of params, grads and the first num_buffers buffers (list-major), then
  // of the step counters, then the params' element counts, as one int64 CPU tensor: what the
  // Triton kernels' tables hold.
  at::Tensor pointers(std::vector<at::Tensor> grads, int64_t num_buffers) {
    TORCH_CHECK(grads.size() == params.size() && num_buffers >= 0 && num_buffers <= 4,
                "pnm_kernels: StepLists.pointers: ", grads.size(), " grads for ", params.size(),
                " params, ", num_buffers, " buffers");
    const std::vector<at::Tensor>* lists[] = {&params, &grads, &buffer0, &buffer1, &buffer2,
                                              &buffer3};
    const int64_t n = static_cast<int64_t>(params.size());
    at::Tensor out = at::empty({(4 + num_buffers) * n}, at::kLong);
    int64_t* dst = out.data_ptr<int64_t>();
    for (int64_t l = 0; l < 2 + num_buffers; ++l) {
      TORCH_CHECK(static_cast<int64_t>(lists[l]->size()) == n,
                  "pnm_kernels: StepLists.pointers: buffer ", l - 2, " is not held");
      for (const at::Tensor& t : *lists[l]) *dst++ = reinterpret_cast<intptr_t>(t.data_ptr());
    }
    for (const at::Tensor& t : steps) *dst++ = reinterpret_cast<intptr_t>(t.data_ptr());
    for (const at::Tensor& t : params) *dst++ = t.numel();
    return out;
  }

 private:
  // A step's gradients, in the order of the held parameters that have one; `present` says
  // which those are, and is empty when every held parameter has one.
  struct OwnGrads {
    std::vector<at::Tensor> grads;
    std::vector<int64_t> present;
  };
  OwnGrads taken;  // see take_own_grads
  bool has_taken = false;
  std::vector<at::Tensor> outside;  // see hold_outside

  bool own_or_taken_grads(bool use_taken, OwnGrads& own) {
    if (!use_taken) return own_grads(own);
    TORCH_CHECK(has_taken, "pnm_kernels: StepLists: no gradients taken for this step");
    own = std::move(taken);
    drop_taken_grads();
    return true;
  }

  bool own_grads(OwnGrads& own) const {
    for (const at::Tensor& p : outside) {
      if (p.grad().defined()) return false;
    }
    own.grads.reserve(params.size());
    own.present.reserve(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& g = params[i].grad();
      if (!g.defined()) continue;
      own.grads.push_back(g);
      own.present.push_back(static_cast<int64_t>(i));
    }
    if (own.grads.size() == params.size()) {
      own.present.clear();
      return first_mismatched_grad(params, own.grads, /*same_layout=*/true) < 0;
    }
    return first_mismatched_grad(BorrowedSubset(params, own.present).get(), own.grads,
                                 /*same_layout=*/true) < 0;
  }

  void pnm_step_on(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g,
                   const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& m_other,
                   const std::vector<at::Tensor>& s, bool emulate, double lr, double beta1,
                   double beta0, double weight_decay, bool decoupled, bool maximize,
                   const std::optional<at::Tensor>& lr_tensor,
                   const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf) {
    using Fn = decltype(pnm_step_op<CpuFused>);
    static const auto op = find_op<Fn>("pnm_kernels::pnm_step_");
    static const auto emulated = find_op<Fn>("pnm_kernels::emulated_cuda_pnm_step_");
    (emulate ? emulated : op)
        .call(p, g, m, m_other, s, lr, beta1, beta0, weight_decay, decoupled, maximize,
              lr_tensor, grad_scale, found_inf, blocks_done);
  }

  void adapnm_step_on(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g,
                      const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& m_other,
                      const std::vector<at::Tensor>& v, const std::vector<at::Tensor>& v_max,
                      const std::vector<at::Tensor>& s, bool emulate, double lr, double beta1,
                      double beta2, double beta0, double eps, double weight_decay, bool amsgrad,
                      bool decoupled, bool maximize, const std::optional<at::Tensor>& lr_tensor,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf) {
    using Fn = decltype(adapnm_step_op<CpuFused>);
    static const auto op = find_op<Fn>("pnm_kernels::adapnm_step_");
    static const auto emulated = find_op<Fn>("pnm_kernels::emulated_cuda_adapnm_step_");
    (emulate ? emulated : op)
        .call(p, g, m, m_other, v, v_max, s, lr, beta1, beta2, beta0, eps, weight_decay,
              amsgrad, decoupled, maximize, lr_tensor, grad_scale, found_inf, blocks_done);
  }

  template <class Fn>
  static c10::TypedOperatorHandle<Fn> find_op(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
  }
};

}  // namespace
}  // namespace pnm

// Mutation annotations tell torch.compile/functionalization what each op writes.
#define PNM_STEP_SCHEMA(name)                                                                 \
  name "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] pos_momentums, "                   \
       "Tensor(c!)[] neg_momentums, Tensor(d!)[] steps, *, float lr, float beta1, "           \
       "float beta0, float weight_decay, bool decoupled, bool maximize, "                     \
       "Tensor? lr_tensor=None, Tensor? grad_scale=None, Tensor? found_inf=None, "            \
       "Tensor(e!)? blocks_done=None) -> ()"
#define ADAPNM_STEP_SCHEMA(name)                                                              \
  name "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "                        \
       "Tensor(c!)[] neg_exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, "  \
       "Tensor(f!)[] steps, *, float lr, float beta1, float beta2, float beta0, float eps, "  \
       "float weight_decay, bool amsgrad, bool decoupled, bool maximize, "                    \
       "Tensor? lr_tensor=None, Tensor? grad_scale=None, Tensor? found_inf=None, "            \
       "Tensor(g!)? blocks_done=None) -> ()"

TORCH_LIBRARY(pnm_kernels, m) {
  m.def(PNM_STEP_SCHEMA("pnm_step_"));
  m.def(ADAPNM_STEP_SCHEMA("adapnm_step_"));
  // The CUDA kernels' code, executed on CPU tensors (CI has no GPU).
  m.def(PNM_STEP_SCHEMA("emulated_cuda_pnm_step_"));
  m.def(ADAPNM_STEP_SCHEMA("emulated_cuda_adapnm_step_"));
  m.def("_set_launch_limits(int chunk_size, int max_tensors, int max_blocks, "
        "int max_single_launch_blocks=0) -> ()",
        &pnm::set_launch_limits);
  m.def("_first_mismatched_grad(Tensor[] params, Tensor[] grads, bool same_layout=False) -> int",
        &pnm::first_mismatched_grad);
  m.def("_launch_plan(int[] numels, int element_size, int max_single_launch_blocks=0) -> int[]",
        &pnm::launch_plan);
  m.def("_set_cpu_isa(str isa) -> str", &pnm::set_cpu_isa);
  m.def("_cpu_isas() -> str[]", &pnm::cpu_isas);
  m.def("_cpu_isa() -> str", &pnm::cpu_isa);
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
      .def("bump_versions", &pnm::StepLists::bump_versions);
}

TORCH_LIBRARY_IMPL(pnm_kernels, CPU, m) {
  m.impl("pnm_step_", &pnm::pnm_step_op<pnm::CpuFused>);
  m.impl("adapnm_step_", &pnm::adapnm_step_op<pnm::CpuFused>);
  m.impl("emulated_cuda_pnm_step_", &pnm::pnm_step_op<pnm::EmulatedCuda>);
  m.impl("emulated_cuda_adapnm_step_", &pnm::adapnm_step_op<pnm::EmulatedCuda>);
}

// Importing pnm_kernels._C runs the registrations above.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY_IMPL(pnm_kernels, Autograd, m) {
  for (const char* name : {"pnm_step_", "adapnm_step_", "emulated_cuda_pnm_step_",
                           "emulated_cuda_adapnm_step_"}) {
    m.impl(name, torch::CppFunction::makeFallthrough());
  }
}
