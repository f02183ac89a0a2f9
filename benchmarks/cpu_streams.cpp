// What the CPU's memory system charges for each access pattern, with no optimizer code in
// the way: bare loops over arrays of the transformer set's size (23.6M fp32 elements) that
// read 3 or 4 arrays (a sum), or do SGD-momentum's pattern (3 reads, 2 of them written
// back) or PNM's (4 reads, 2 written back). If time follows the arrays read rather than the
// bytes moved, no PNM kernel can reach SGD-momentum's effective GB/s on this machine (see
// README, CPU figures).
//
//   g++ -O3 -ffast-math -fopenmp benchmarks/cpu_streams.cpp -o /tmp/cpu_streams
//   OMP_NUM_THREADS=2 /tmp/cpu_streams
//
// -ffast-math lets the sums vectorise (reassociation); the update loops do not depend on it.
#include <omp.h>

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
  for (long i = 0; i < kElements; ++i) a[i] = 0.001f * static_cast<float>(i % 100);
  return a;
}

float read3(const float* __restrict a, const float* __restrict b, const float* __restrict c) {
  float s = 0;
#pragma omp parallel for schedule(static) reduction(+ : s)
  for (long i = 0; i < kElements; ++i) s += a[i] * b[i] + c[i];
  return s;
}

float read4(const float* __restrict a, const float* __restrict b, const float* __restrict c,
            const float* __restrict d) {
  float s = 0;
#pragma omp parallel for schedule(static) reduction(+ : s)
  for (long i = 0; i < kElements; ++i) s += a[i] * b[i] + c[i] * d[i];
  return s;
}

void sgd_momentum(float* __restrict p, const float* __restrict g, float* __restrict m) {
#pragma omp parallel for schedule(static)
  for (long i = 0; i < kElements; ++i) {
    const float mi = 0.9f * m[i] + g[i];
    m[i] = mi;
    p[i] -= 1e-6f * mi;
  }
}

void pnm(float* __restrict p, const float* __restrict g, float* __restrict m,
         const float* __restrict m_other) {
#pragma omp parallel for schedule(static)
  for (long i = 0; i < kElements; ++i) {
    const float mi = 0.81f * m[i] + 0.19f * g[i];
    m[i] = mi;
    p[i] -= 1e-6f * (1.9f * mi - 0.9f * m_other[i]) * 0.7f;
  }
}

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int main() {
  float *p = make_array(), *g = make_array(), *m = make_array(), *m_other = make_array();
  volatile float sink = 0;
  struct Pattern {
    const char* name;
    int arrays_read, arrays_written;
  };
  const Pattern patterns[] = {{"read 3 arrays", 3, 0},
                              {"read 4 arrays", 4, 0},
                              {"SGD-momentum (3 read, 2 written)", 3, 2},
                              {"PNM (4 read, 2 written)", 4, 2}};
  std::vector<double> times[4];
  for (int round = 0; round < kRounds; ++round) {  // interleaved: the machine drifts
    for (int k = 0; k < 4; ++k) {
      const double start = seconds();
      switch (k) {
        case 0: sink = read3(p, g, m); break;
        case 1: sink = read4(p, g, m, m_other); break;
        case 2: sgd_momentum(p, g, m); break;
        case 3: pnm(p, g, m, m_other); break;
      }
      times[k].push_back(seconds() - start);
    }
  }
  (void)sink;
  std::printf("%d threads, %ld fp32 elements, median of %d rounds\n", omp_get_max_threads(),
              kElements, kRounds);
  for (int k = 0; k < 4; ++k) {
    std::sort(times[k].begin(), times[k].end());
    const double t = times[k][kRounds / 2];
    const double bytes = 4.0 * kElements * (patterns[k].arrays_read + patterns[k].arrays_written);
    std::printf("%-34s %7.3f ms  %6.1f GB/s read+written\n", patterns[k].name, t * 1e3,
                bytes / t / 1e9);
  }
  return 0;
}
