// The per-element maths of PNM and AdaPNM (docs/design.md §1), written once.
//
// Every C++/CUDA path calls these functions: the fused CPU kernel, the CUDA kernels, and
// the host emulation of the CUDA kernels that CI runs. Arithmetic is fp32 for fp32, fp16 and
// bf16 storage, fp64 for fp64 (torch's "opmath" types); per-tensor constants are prepared in
// double by make_coeffs. The operation order follows pnm_kernels/reference.py so the paths
// agree to rounding.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define PNM_HOST_DEVICE __host__ __device__ __forceinline__
#define PNM_UNROLL _Pragma("unroll")
#else
#define PNM_HOST_DEVICE inline __attribute__((always_inline))
#define PNM_UNROLL _Pragma("GCC unroll 8")
#endif

namespace pnm {

// Hyper-parameters of one optimizer call, identical for every tensor in it.
struct Hyper {
  double beta1;
  double beta2;         // AdaPNM only
  double beta0;         // the positive-negative coefficient
  double eps;           // AdaPNM only
  double weight_decay;
  bool maximize;
};

// The arithmetic type of a storage type T: float, or double for double.
template <typename T>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};
template <typename T>
using opmath_t = typename OpMath<T>::type;

// Constants for one tensor in one step, in the arithmetic type C: they depend on lr and on
// the tensor's own step t.
template <typename C>
struct Coeffs {
  C decay;            // 1 - lr * wd        (decoupled weight decay)
  C l2;               // wd                 (L2 weight decay)
  C b1_sq;            // b1^2
  C one_minus_b1_sq;  // 1 - b1^2
  C b2;               // b2
  C one_minus_b2;     // 1 - b2
  C pos_coef;         // 1 + b0
  C neg_coef;         // -b0
  C inv_noise_norm;   // 1 / sqrt((1 + b0)^2 + b0^2)
  C neg_step_size;    // -lr (PNM) or -lr / (1 - b1^t) (AdaPNM)
  C bc2_sqrt;         // sqrt(1 - b2^t)
  C eps;
};

template <typename C>
PNM_HOST_DEVICE Coeffs<C> make_coeffs(const Hyper& h, double lr, double step, bool adaptive) {
  Coeffs<C> c;
  const double b1_sq = h.beta1 * h.beta1;
  c.decay = static_cast<C>(1.0 - lr * h.weight_decay);
  c.l2 = static_cast<C>(h.weight_decay);
  c.b1_sq = static_cast<C>(b1_sq);
  c.one_minus_b1_sq = static_cast<C>(1.0 - b1_sq);
  c.b2 = static_cast<C>(h.beta2);
  c.one_minus_b2 = static_cast<C>(1.0 - h.beta2);
  c.pos_coef = static_cast<C>(1.0 + h.beta0);
  c.neg_coef = static_cast<C>(-h.beta0);
  c.inv_noise_norm = static_cast<C>(
      1.0 / sqrt((1.0 + h.beta0) * (1.0 + h.beta0) + h.beta0 * h.beta0));
  c.neg_step_size = static_cast<C>(adaptive ? -lr / (1.0 - pow(h.beta1, step)) : -lr);
  c.bc2_sqrt = static_cast<C>(adaptive ? sqrt(1.0 - pow(h.beta2, step)) : 1.0);
  c.eps = static_cast<C>(h.eps);
  return c;
}

// maximize and AMP unscaling folded into one factor the gradient is multiplied by as it is
// loaded: (maximize ? -1 : 1) / grad_scale. Negation is exact, so folding changes no bit.
template <typename C>
PNM_HOST_DEVICE C grad_factor(bool maximize, const float* grad_scale) {
  const C inv_scale = grad_scale ? C(1) / static_cast<C>(*grad_scale) : C(1);
  return maximize ? -inv_scale : inv_scale;
}

// torch.maximum semantics: a NaN in either operand propagates.
// Written as plain selects so that GCC vectorises it.
template <typename C>
PNM_HOST_DEVICE C nan_max(C a, C b) {
  C r = a > b ? a : b;
  r = b != b ? b : r;
  return a != a ? a : r;
}

PNM_HOST_DEVICE float square_root(float x) { return sqrtf(x); }
PNM_HOST_DEVICE double square_root(double x) { return sqrt(x); }

// One element of PNM (paper's Algorithm 2). `m` is this step's buffer (updated in place),
// `m_other` the buffer of the other parity (read only).
template <bool kDecoupled, typename C>
PNM_HOST_DEVICE void pnm_element(C& p, C g, C& m, C m_other, const Coeffs<C>& c) {
  if constexpr (kDecoupled) {
    p = p * c.decay;
  } else {
    g = g + c.l2 * p;
  }
  m = c.b1_sq * m + c.one_minus_b1_sq * g;
  const C pn_momentum = (c.pos_coef * m + c.neg_coef * m_other) * c.inv_noise_norm;
  p = p + c.neg_step_size * pn_momentum;
}

// One element of AdaPNM (paper's Algorithm 3), with AMSGrad as a compile-time switch.
template <bool kDecoupled, bool kAmsgrad, typename C>
PNM_HOST_DEVICE void adapnm_element(C& p, C g, C& m, C m_other, C& v, C& v_max,
                                    const Coeffs<C>& c) {
  if constexpr (kDecoupled) {
    p = p * c.decay;
  } else {
    g = g + c.l2 * p;
  }
  m = c.b1_sq * m + c.one_minus_b1_sq * g;
  // (1 - b2) g first, then g, as torch's addcmul (the reference): g * g overflows for
  // |g| > 1.8e19 where the reference's product stays finite.
  v = c.b2 * v + (c.one_minus_b2 * g) * g;
  C second_moment = v;
  if constexpr (kAmsgrad) {
    v_max = nan_max(v_max, v);
    second_moment = v_max;
  }
  const C denom = square_root(second_moment) / c.bc2_sqrt + c.eps;
  const C pn_momentum = (c.pos_coef * m + c.neg_coef * m_other) * c.inv_noise_norm;
  p = p + c.neg_step_size * (pn_momentum / denom);
}

}  // namespace pnm
