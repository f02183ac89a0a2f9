// Where the fused CPU int8 PNM step's time goes (docs/performance.md, "int8 state"): one
// thread, one 16M-element fp32 tensor, the block loop of csrc/cpu_int8_kernel.cpp written
// out with one stage at a time made trivial (not the same bits: timing only), the block's
// stages fused into two loops, a "squared" code map (value c|c| * scale / 127^2, one
// multiply to decode, one square root to encode), and float32 state's step beside them.
// Build and run from the repository root (torch's headers for c10):
//   g++ -O3 -fno-math-errno -fno-trapping-math -ffp-contract=off -std=c++17 -Icsrc \
//     -I$(python -c "import torch,os;print(os.path.join(os.path.dirname(torch.__file__),'include'))") \
//     -o /tmp/int8_block_stages benchmarks/experiments/int8_block_stages.cpp && /tmp/int8_block_stages
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>
#include <random>
#include "int8_codes.h"
using namespace pnm;
constexpr int B = 128;

// Variant knobs
template <int V>
struct K {
  static constexpr bool kHash = V != 1;
  static constexpr bool kEncode = V != 2;
  static constexpr bool kDecode = V != 3;
};

// squared-domain map: value = c*|c| * k,  k = scale / 16129
static inline __attribute__((always_inline)) float sq_decode(int c, float k) {
  return static_cast<float>(c * (c < 0 ? -c : c)) * k;
}
static inline __attribute__((always_inline)) int32_t sq_encode(float x, float inv /*16129/scale*/, uint32_t bits) {
  const float t = fabsf(x) * inv;
  float low = floorf(sqrtf(t));
  low = low >= 0.0f ? low : 0.0f;
  low = low < 126.0f ? low : 126.0f;
  const float below = low * low;
  const float gap = low + low + 1.0f;
  const float u = static_cast<float>(static_cast<int32_t>(bits)) * (1.0f / 65536.0f);
  const int32_t code = static_cast<int32_t>(low + (u * gap < t - below ? 1.0f : 0.0f));
  return x < 0.0f ? -code : code;
}

template <int V>
__attribute__((target("avx2,f16c"), flatten, noinline))
void run_blocks(float* P, const float* G, int8_t* M, const int8_t* MO, float* SM, const float* SMO,
                int64_t nblocks, Coeffs<float> c, uint32_t seed, uint32_t step) {
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t begin = b * B;
    float m[B], mo[B], p[B];
    uint32_t hash[B], high[B];
    if constexpr (V == 4) {
      const float k0 = SM[b] * (1.0f / 16129.0f), k1 = SMO[b] * (1.0f / 16129.0f);
      for (int i = 0; i < B; ++i) m[i] = sq_decode(M[begin + i], k0);
      for (int i = 0; i < B; ++i) mo[i] = sq_decode(MO[begin + i], k1);
    } else if constexpr (K<V>::kDecode) {
      for (int i = 0; i < B; ++i) m[i] = SignedCodes::decode(M[begin + i], SM[b]);
      for (int i = 0; i < B; ++i) mo[i] = SignedCodes::decode(MO[begin + i], SMO[b]);
    } else {
      for (int i = 0; i < B; ++i) m[i] = M[begin + i] * SM[b];
      for (int i = 0; i < B; ++i) mo[i] = MO[begin + i] * SMO[b];
    }
    const uint32_t first = static_cast<uint32_t>(begin);
    const uint32_t key = rounding_key(seed, step, 0);
    if constexpr (K<V>::kHash) {
      for (int i = 0; i < B; ++i) hash[i] = element_hash(key, first + i);
    } else {
      for (int i = 0; i < B; ++i) hash[i] = (first + i) * 0x9E3779B9u;
    }
    for (int i = 0; i < B; ++i) high[i] = hash[i] >> 16;
    for (int i = 0; i < B; ++i) {
      float pi = P[begin + i];
      const float gi = G[begin + i];
      pnm_element<true>(pi, gi, m[i], mo[i], c);
      p[i] = pi;
    }
    for (int i = 0; i < B; ++i) P[begin + i] = p[i];
    uint32_t largest = 0;
    for (int i = 0; i < B; ++i) {
      const uint32_t bb = SignedCodes::scale_bits(m[i]);
      largest = bb > largest ? bb : largest;
    }
    const float scale = SignedCodes::block_scale(largest);
    int8_t* out = M + begin;
    if constexpr (V == 4) {
      const float inv = 16129.0f / scale;
      for (int i = 0; i < B; ++i) out[i] = static_cast<int8_t>(sq_encode(m[i], inv, high[i]));
    } else if constexpr (K<V>::kEncode) {
      const float inverse = 1.0f / scale;
      for (int i = 0; i < B; ++i) out[i] = static_cast<int8_t>(SignedCodes::encode(m[i], inverse, high[i]));
    } else {
      const float inverse = 127.0f / scale;
      for (int i = 0; i < B; ++i) out[i] = static_cast<int8_t>(static_cast<int32_t>(m[i] * inverse));
    }
    SM[b] = scale;
  }
}


template <int V>
__attribute__((target("avx2,f16c"), flatten, noinline))
void run_fused(float* P, const float* G, int8_t* M, const int8_t* MO, float* SM, const float* SMO,
                int64_t nblocks, Coeffs<float> c, uint32_t seed, uint32_t step) {
  const uint32_t key = rounding_key(seed, step, 0);
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t begin = b * B;
    float m[B];
    const float k0 = SM[b] * (1.0f / 16129.0f), k1 = SMO[b] * (1.0f / 16129.0f);
    uint32_t largest = 0;
    for (int i = 0; i < B; ++i) {
      float mi = sq_decode(M[begin + i], k0);
      const float moi = sq_decode(MO[begin + i], k1);
      float pi = P[begin + i];
      pnm_element<true>(pi, G[begin + i], mi, moi, c);
      P[begin + i] = pi;
      m[i] = mi;
      const uint32_t bb = SignedCodes::scale_bits(mi);
      largest = bb > largest ? bb : largest;
    }
    const float scale = SignedCodes::block_scale(largest);
    int8_t* out = M + begin;
    const float inv = 16129.0f / scale;
    const uint32_t first = static_cast<uint32_t>(begin);
    for (int i = 0; i < B; ++i) {
      const uint32_t h = element_hash(key, first + i) >> 16;
      if constexpr (V == 5) out[i] = static_cast<int8_t>(sq_encode(m[i], inv, h));
      else if constexpr (V == 7) { const float t = fabsf(m[i]) * inv; float low = floorf(t * 0.01f); low = low < 126.0f ? low : 126.0f; const float below = low * low; const float gap = low + low + 1.0f; const float u = static_cast<float>(static_cast<int32_t>(h)) * (1.0f / 65536.0f); const int32_t code = static_cast<int32_t>(low + (u * gap < t - below ? 1.0f : 0.0f)); out[i] = m[i] < 0 ? -code : code; }
      else out[i] = static_cast<int8_t>(SignedCodes::encode(m[i], 1.0f / scale, h));
    }
    SM[b] = scale;
  }
}


__attribute__((target("avx2,f16c"), flatten, noinline))
void pnm_fp32(float* P, const float* G, float* M, const float* MO, int64_t n, Coeffs<float> c) {
  for (int64_t i = 0; i < n; ++i) { float p = P[i], m = M[i]; pnm_element<true>(p, G[i], m, MO[i], c); P[i] = p; M[i] = m; }
}
int main() {
  const int64_t n = 16 << 20, nb = n / B;
  std::vector<float> P(n), G(n), SM(nb, 1.0f), SMO(nb, 1.0f);
  std::vector<int8_t> M(n), MO(n); std::vector<float> F1(n, 0.1f), F2(n, 0.2f);
  std::mt19937 r(0);
  std::normal_distribution<float> d;
  for (auto& x : P) x = d(r);
  for (auto& x : G) x = d(r);
  for (int64_t i = 0; i < n; ++i) { M[i] = (int8_t)(r() % 255 - 127); MO[i] = (int8_t)(r() % 255 - 127); }
  Hyper h{0.9, 0.999, 1.0, 1e-8, 0.0, false};
  Coeffs<float> c = make_coeffs<float>(h, 1e-3, 5, false);
  auto time = [&](auto f, const char* name) {
    double best = 1e9;
    for (int rep = 0; rep < 7; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      f();
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      best = ms < best ? ms : best;
    }
    printf("%-28s %7.2f ms  (%.2f ns/elem)\n", name, best, best * 1e6 / n);
  };
  for (int round = 0; round < 2; ++round) {
  time([&] { run_blocks<0>(P.data(), G.data(), M.data(), MO.data(), SM.data(), SMO.data(), nb, c, 1, 5); }, "current");
  time([&] { run_blocks<1>(P.data(), G.data(), M.data(), MO.data(), SM.data(), SMO.data(), nb, c, 1, 5); }, "no hash");
  time([&] { run_blocks<2>(P.data(), G.data(), M.data(), MO.data(), SM.data(), SMO.data(), nb, c, 1, 5); }, "trivial encode");
  time([&] { run_blocks<3>(P.data(), G.data(), M.data(), MO.data(), SM.data(), SMO.data(), nb, c, 1, 5); }, "trivial decode");
  time([&] { run_blocks<4>(P.data(), G.data(), M.data(), MO.data(), SM.data(), SMO.data(), nb, c, 1, 5); }, "squared domain");
  time([&] { run_fused<5>(P.data(), G.data(), M.data(), MO.data(), SM.data(), SMO.data(), nb, c, 1, 5); }, "fused loops squared");
  time([&] { run_fused<6>(P.data(), G.data(), M.data(), MO.data(), SM.data(), SMO.data(), nb, c, 1, 5); }, "fused loops current map");
  time([&] { pnm_fp32(P.data(), G.data(), F1.data(), F2.data(), n, c); }, "fp32-state PNM");
  time([&] { run_fused<7>(P.data(), G.data(), M.data(), MO.data(), SM.data(), SMO.data(), nb, c, 1, 5); }, "fused, encode no sqrt");
  time([&] { for (int64_t i = 0; i < n; ++i) { P[i] = P[i] * 0.99f + G[i]; } }, "fp32 touch p,g");
  }
}
