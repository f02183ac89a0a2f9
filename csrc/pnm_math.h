// The per-element maths of PNM and AdaPNM (DESIGN.md §1), written once.
//
// Every C++/CUDA path calls these functions: the fused CPU kernel, the CUDA kernels, and
// the host emulation of the CUDA kernels that CI runs. Arithmetic is always fp32 ("opmath"),
// whatever the storage dtype; per-tensor constants are prepared in double by make_coeffs.
// The operation order follows pnm_kernels/reference.py so the paths agree to rounding.
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

// Constants for one tensor in one step: they depend on lr and on the tensor's own step t.
struct Coeffs {
  float decay;            // 1 - lr * wd        (decoupled weight decay)
  float l2;               // wd                 (L2 weight decay)
  float b1_sq;            // b1^2
  float one_minus_b1_sq;  // 1 - b1^2
  float b2;               // b2
  float one_minus_b2;     // 1 - b2
  float pos_coef;         // 1 + b0
  float neg_coef;         // -b0
  float inv_noise_norm;   // 1 / sqrt((1 + b0)^2 + b0^2)
  float neg_step_size;    // -lr (PNM) or -lr / (1 - b1^t) (AdaPNM)
  float bc2_sqrt;         // sqrt(1 - b2^t)
  float eps;
};

PNM_HOST_DEVICE Coeffs make_coeffs(const Hyper& h, double lr, double step, bool adaptive) {
  Coeffs c;
  const double b1_sq = h.beta1 * h.beta1;
  c.decay = static_cast<float>(1.0 - lr * h.weight_decay);
  c.l2 = static_cast<float>(h.weight_decay);
  c.b1_sq = static_cast<float>(b1_sq);
  c.one_minus_b1_sq = static_cast<float>(1.0 - b1_sq);
  c.b2 = static_cast<float>(h.beta2);
  c.one_minus_b2 = static_cast<float>(1.0 - h.beta2);
  c.pos_coef = static_cast<float>(1.0 + h.beta0);
  c.neg_coef = static_cast<float>(-h.beta0);
  c.inv_noise_norm = static_cast<float>(
      1.0 / sqrt((1.0 + h.beta0) * (1.0 + h.beta0) + h.beta0 * h.beta0));
  c.neg_step_size = static_cast<float>(adaptive ? -lr / (1.0 - pow(h.beta1, step)) : -lr);
  c.bc2_sqrt = static_cast<float>(adaptive ? sqrt(1.0 - pow(h.beta2, step)) : 1.0);
  c.eps = static_cast<float>(h.eps);
  return c;
}

// maximize and AMP unscaling folded into one factor the gradient is multiplied by as it is
// loaded: (maximize ? -1 : 1) / grad_scale. Negation is exact, so folding changes no bit.
PNM_HOST_DEVICE float grad_factor(bool maximize, const float* grad_scale) {
  const float inv_scale = grad_scale ? 1.0f / *grad_scale : 1.0f;
  return maximize ? -inv_scale : inv_scale;
}

// torch.maximum semantics: a NaN in either operand propagates.
// Written as plain selects so that GCC vectorises it.
PNM_HOST_DEVICE float nan_max(float a, float b) {
  float r = a > b ? a : b;
  r = b != b ? b : r;
  return a != a ? a : r;
}

// One element of PNM (paper's Algorithm 2). `m` is this step's buffer (updated in place),
// `m_other` the buffer of the other parity (read only).
template <bool kDecoupled>
PNM_HOST_DEVICE void pnm_element(float& p, float g, float& m, float m_other, const Coeffs& c) {
  if constexpr (kDecoupled) {
    p = p * c.decay;
  } else {
    g = g + c.l2 * p;
  }
  m = c.b1_sq * m + c.one_minus_b1_sq * g;
  const float pn_momentum = (c.pos_coef * m + c.neg_coef * m_other) * c.inv_noise_norm;
  p = p + c.neg_step_size * pn_momentum;
}

// One element of AdaPNM (paper's Algorithm 3), with AMSGrad as a compile-time switch.
template <bool kDecoupled, bool kAmsgrad>
PNM_HOST_DEVICE void adapnm_element(float& p, float g, float& m, float m_other, float& v,
                                    float& v_max, const Coeffs& c) {
  if constexpr (kDecoupled) {
    p = p * c.decay;
  } else {
    g = g + c.l2 * p;
  }
  m = c.b1_sq * m + c.one_minus_b1_sq * g;
  v = c.b2 * v + c.one_minus_b2 * (g * g);
  float second_moment = v;
  if constexpr (kAmsgrad) {
    v_max = nan_max(v_max, v);
    second_moment = v_max;
  }
  const float denom = sqrtf(second_moment) / c.bc2_sqrt + c.eps;
  const float pn_momentum = (c.pos_coef * m + c.neg_coef * m_other) * c.inv_noise_norm;
  p = p + c.neg_step_size * (pn_momentum / denom);
}

}  // namespace pnm
