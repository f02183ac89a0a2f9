// What the CPU's memory system charges for each access pattern, with no optimizer code in
// the way: bare loops that read 3 or 4 arrays (a sum), or do the access pattern and the
// per-element arithmetic of SGD-momentum (3 arrays read, 2 written back), PNM (4 read, 2
// written), Adam-AMSGrad (5 read, 4 written) and AdaPNM-AMSGrad (6 read, 4 written). The
// update loops use the real operations (AdaPNM and Adam: a square root and two divisions per
// element) with constant hyper-parameters.
//
// Standalone (times every pattern on 23.6M fp32 elements, the transformer set's size):
//   g++ -O3 -march=native -fno-math-errno -ffp-contract=off -fopenmp \
//       benchmarks/experiments/cpu_streams.cpp -o /tmp/cpu_streams
//   OMP_NUM_THREADS=2 /tmp/cpu_streams
// As a library for benchmarks/experiments/cpu_floor.py (which builds it itself): -DCPU_STREAMS_LIBRARY
// -shared -fPIC. Each loop splits its n elements into equal contiguous shares per thread.
#include <omp.h>

#include <cmath>

namespace {

// [begin, end) of this thread's equal share of n elements.
struct Share {
  long begin, end;
};
Share my_share(long n) {
  const long threads = omp_get_num_threads(), me = omp_get_thread_num();
  return {n * me / threads, n * (me + 1) / threads};
}

// Loop bodies are separate noinline functions over restrict pointers: GCC vectorises them
// reliably there, which it did not for every loop written inside `omp parallel for`.
__attribute__((noinline)) float read3_range(const float* __restrict a, const float* __restrict b,
                                            const float* __restrict c, long n) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (long i = 0; i < n; ++i) s += a[i] * b[i] + c[i];
  return s;
}

__attribute__((noinline)) float read4_range(const float* __restrict a, const float* __restrict b,
                                            const float* __restrict c, const float* __restrict d,
                                            long n) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (long i = 0; i < n; ++i) s += a[i] * b[i] + c[i] * d[i];
  return s;
}

__attribute__((noinline)) void sgd_range(float* __restrict p, const float* __restrict g,
                                         float* __restrict m, long n) {
  for (long i = 0; i < n; ++i) {
    const float mi = 0.9f * m[i] + g[i];
    m[i] = mi;
    p[i] -= 1e-6f * mi;
  }
}

__attribute__((noinline)) void pnm_range(float* __restrict p, const float* __restrict g,
                                         float* __restrict m, const float* __restrict m_other,
                                         long n) {
  for (long i = 0; i < n; ++i) {
    const float mi = 0.81f * m[i] + 0.19f * g[i];
    m[i] = mi;
    p[i] -= 1e-6f * (1.9f * mi - 0.9f * m_other[i]) * 0.7f;
  }
}

__attribute__((noinline)) void adam_range(float* __restrict p, const float* __restrict g,
                                          float* __restrict m, float* __restrict v,
                                          float* __restrict v_max, long n) {
  for (long i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = 0.9f * m[i] + 0.1f * gi;
    const float vi = 0.999f * v[i] + 0.001f * (gi * gi);
    const float vm = v_max[i] > vi ? v_max[i] : vi;
    m[i] = mi;
    v[i] = vi;
    v_max[i] = vm;
    p[i] -= 1e-6f * (mi / (sqrtf(vm) / 0.7f + 1e-8f));
  }
}

__attribute__((noinline)) void adapnm_range(float* __restrict p, const float* __restrict g,
                                            float* __restrict m, const float* __restrict m_other,
                                            float* __restrict v, float* __restrict v_max, long n) {
  for (long i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = 0.81f * m[i] + 0.19f * gi;
    const float vi = 0.999f * v[i] + 0.001f * (gi * gi);
    const float vm = v_max[i] > vi ? v_max[i] : vi;
    m[i] = mi;
    v[i] = vi;
    v_max[i] = vm;
    const float pn = (1.9f * mi - 0.9f * m_other[i]) * 0.7f;
    p[i] -= 1e-6f * (pn / (sqrtf(vm) / 0.7f + 1e-8f));
  }
}

}  // namespace

extern "C" {

float read3(const float* a, const float* b, const float* c, long n) {
  float s = 0;
#pragma omp parallel reduction(+ : s)
  {
    const Share r = my_share(n);
    s += read3_range(a + r.begin, b + r.begin, c + r.begin, r.end - r.begin);
  }
  return s;
}

float read4(const float* a, const float* b, const float* c, const float* d, long n) {
  float s = 0;
#pragma omp parallel reduction(+ : s)
  {
    const Share r = my_share(n);
    s += read4_range(a + r.begin, b + r.begin, c + r.begin, d + r.begin, r.end - r.begin);
  }
  return s;
}

void sgd_momentum(float* p, const float* g, float* m, long n) {
#pragma omp parallel
  {
    const Share r = my_share(n);
    sgd_range(p + r.begin, g + r.begin, m + r.begin, r.end - r.begin);
  }
}

void pnm(float* p, const float* g, float* m, const float* m_other, long n) {
#pragma omp parallel
  {
    const Share r = my_share(n);
    pnm_range(p + r.begin, g + r.begin, m + r.begin, m_other + r.begin, r.end - r.begin);
  }
}

void adam_amsgrad(float* p, const float* g, float* m, float* v, float* v_max, long n) {
#pragma omp parallel
  {
    const Share r = my_share(n);
    adam_range(p + r.begin, g + r.begin, m + r.begin, v + r.begin, v_max + r.begin,
               r.end - r.begin);
  }
}

void adapnm_amsgrad(float* p, const float* g, float* m, const float* m_other, float* v,
                    float* v_max, long n) {
#pragma omp parallel
  {
    const Share r = my_share(n);
    adapnm_range(p + r.begin, g + r.begin, m + r.begin, m_other + r.begin, v + r.begin,
                 v_max + r.begin, r.end - r.begin);
  }
}

}  // extern "C"

#ifndef CPU_STREAMS_LIBRARY
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr long kElements = 23'600'000;
constexpr int kRounds = 30;

float* make_array() {
  void* mem = nullptr;
  if (posix_memalign(&mem, 4096, kElements * sizeof(float)) != 0) std::abort();
  float* a = static_cast<float*>(mem);
#pragma omp parallel for schedule(static)
  for (long i = 0; i < kElements; ++i) a[i] = 0.001f * static_cast<float>(i % 100 + 1);
  return a;
}

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int main() {
  float *p = make_array(), *g = make_array(), *m = make_array(), *m_other = make_array(),
        *v = make_array(), *v_max = make_array();
  const long n = kElements;
  volatile float sink = 0;
  struct Pattern {
    const char* name;
    int arrays_read, arrays_written;
  };
  const Pattern patterns[] = {{"read 3 arrays", 3, 0},
                              {"read 4 arrays", 4, 0},
                              {"SGD-momentum (3 read, 2 written)", 3, 2},
                              {"PNM (4 read, 2 written)", 4, 2},
                              {"Adam-AMSGrad (5 read, 4 written)", 5, 4},
                              {"AdaPNM-AMSGrad (6 read, 4 written)", 6, 4}};
  constexpr int kPatterns = sizeof(patterns) / sizeof(patterns[0]);
  std::vector<double> times[kPatterns];
  for (int round = 0; round < kRounds; ++round) {  // interleaved: the machine drifts
    for (int k = 0; k < kPatterns; ++k) {
      const double start = seconds();
      switch (k) {
        case 0: sink = read3(p, g, m, n); break;
        case 1: sink = read4(p, g, m, m_other, n); break;
        case 2: sgd_momentum(p, g, m, n); break;
        case 3: pnm(p, g, m, m_other, n); break;
        case 4: adam_amsgrad(p, g, m, v, v_max, n); break;
        case 5: adapnm_amsgrad(p, g, m, m_other, v, v_max, n); break;
      }
      times[k].push_back(seconds() - start);
    }
  }
  (void)sink;
  std::printf("%d threads, %ld fp32 elements, median of %d rounds\n", omp_get_max_threads(),
              kElements, kRounds);
  for (int k = 0; k < kPatterns; ++k) {
    std::sort(times[k].begin(), times[k].end());
    const double t = times[k][kRounds / 2];
    const double bytes = 4.0 * kElements * (patterns[k].arrays_read + patterns[k].arrays_written);
    std::printf("%-36s %7.3f ms  %6.1f GB/s read+written\n", patterns[k].name, t * 1e3,
                bytes / t / 1e9);
  }
  return 0;
}
#endif  // CPU_STREAMS_LIBRARY
