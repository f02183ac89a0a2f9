// Host time of one kernel launch by the size of its arguments. The fused step's launch table
// travels as a __grid_constant__ argument of about 30 KB whatever the step's size (torch's
// multi-tensor apply passes about 4 KB); a small step's host time was 0.043 ms against
// torch's fused SGD's 0.031 on an H200 (docs/performance.md). This says how much of that the
// argument's size could be, before anything is changed for it: an empty kernel, launched in batches short
// enough never to wait on a full launch queue, host time to issue them timed apart from the
// GPU's. Run by benchmarks/gpu_check.sh (stage launch_params); built on its own:
//   nvcc -O2 -std=c++17 -arch=sm_90 benchmarks/experiments/launch_params.cu -o /tmp/launch_params
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace {

template <int kBytes>
struct Argument {
  unsigned char data[kBytes];
};

template <int kBytes>
__global__ void read_last_byte(const __grid_constant__ Argument<kBytes> arg, unsigned char* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = arg.data[kBytes - 1];
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

constexpr int kBatch = 200;    // launches issued between synchronisations
constexpr int kBatches = 50;

// Median over batches of the host time to issue one launch, and of the GPU time per launch.
template <int kBytes>
void time_argument(unsigned char* out) {
  static Argument<kBytes> arg{};  // static: 32 KB is a lot of stack
  arg.data[kBytes - 1] = 1;
  for (int i = 0; i < 2 * kBatch; ++i) read_last_byte<kBytes><<<1, 32>>>(arg, out);
  check(cudaDeviceSynchronize(), "warm-up");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  std::vector<double> host_us, gpu_us;
  for (int b = 0; b < kBatches; ++b) {
    check(cudaEventRecord(start), "record");
    const double t0 = seconds();
    for (int i = 0; i < kBatch; ++i) read_last_byte<kBytes><<<1, 32>>>(arg, out);
    const double t1 = seconds();
    check(cudaEventRecord(stop), "record");
    check(cudaEventSynchronize(stop), "synchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    host_us.push_back((t1 - t0) * 1e6 / kBatch);
    gpu_us.push_back(ms * 1e3 / kBatch);
  }
  check(cudaGetLastError(), "launch");
  std::sort(host_us.begin(), host_us.end());
  std::sort(gpu_us.begin(), gpu_us.end());
  std::printf("| %6d | %6.2f | %6.2f | %6.2f |\n", kBytes, host_us[kBatches / 2],
              host_us[kBatches / 10], gpu_us[kBatches / 2]);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace

int main() {
  unsigned char* out = nullptr;
  check(cudaMalloc(&out, 1), "cudaMalloc");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  std::printf("%s, %d launches of an empty kernel in each of %d batches; medians over batches\n",
              prop.name, kBatch, kBatches);
  std::printf("| argument bytes | host us/launch | host us, 10th pct | GPU us/launch |\n");
  std::printf("|---|---|---|---|\n");
  time_argument<256>(out);
  time_argument<1024>(out);
  time_argument<4096>(out);
  time_argument<8192>(out);
  time_argument<16384>(out);
  time_argument<24576>(out);
  time_argument<30720>(out);  // about the fused step's table
  time_argument<32000>(out);  // near the 32,764-byte limit
  check(cudaFree(out), "cudaFree");
  return 0;
}
