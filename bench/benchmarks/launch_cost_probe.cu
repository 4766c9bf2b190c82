// Host cost of one kernel launch against the size of its parameters, its dynamic shared memory and the launch API:
// what separates the TMA kernels' raw call (about 1 KB of parameters, large shared memory, a cluster launch) from
// an implicit-GEMM kernel's, which is within 0.7 us of a bare launch (bench/results/launch_cache_h200/).
//
//   nvcc -O2 -std=c++17 -arch=sm_90a bench/benchmarks/launch_cost_probe.cu -o /tmp/launch_cost_probe
//   /tmp/launch_cost_probe > launch_cost.json
//
// Each case launches an empty kernel (132 blocks of 128 threads) in bursts of 200 back to back on one stream, with
// the host clock read around each burst (the device is synchronized between bursts, outside the clock); the median
// over 31 bursts of the time per launch is printed, one JSON object per line (the first names the GPU).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

template <int Bytes>
struct Blob {
  unsigned char bytes[Bytes];
};

template <int Bytes>
__global__ void empty_kernel(Blob<Bytes> blob) {
  if (threadIdx.x == 1023 && blob.bytes[0] == 255) asm volatile("trap;");  // never true: keeps the parameter used
}

enum class Api { kTripleChevron, kLaunchEx, kLaunchExCluster };

const char* name(Api api) {
  switch (api) {
    case Api::kTripleChevron: return "triple_chevron";
    case Api::kLaunchEx: return "cudaLaunchKernelEx";
    default: return "cudaLaunchKernelEx_cluster1x1x1";
  }
}

#define CHECK(call)                                                                                 \
  do {                                                                                              \
    cudaError_t status = (call);                                                                    \
    if (status != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(status)); \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

template <int Bytes>
double time_case(Api api, int smem, cudaStream_t stream) {
  auto kernel = empty_kernel<Bytes>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  Blob<Bytes> blob{};
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(132);
  config.blockDim = dim3(128);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  if (api == Api::kLaunchExCluster) {
    config.attrs = &cluster;
    config.numAttrs = 1;
  }
  auto launch = [&] {
    if (api == Api::kTripleChevron) {
      kernel<<<132, 128, smem, stream>>>(blob);
    } else {
      CHECK(cudaLaunchKernelEx(&config, kernel, blob));
    }
  };
  constexpr int kBurst = 200, kBursts = 31;
  for (int i = 0; i < kBurst; ++i) launch();
  CHECK(cudaStreamSynchronize(stream));
  std::vector<double> per_launch_us;
  for (int b = 0; b < kBursts; ++b) {
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kBurst; ++i) launch();
    auto stop = std::chrono::steady_clock::now();
    CHECK(cudaStreamSynchronize(stream));
    per_launch_us.push_back(std::chrono::duration<double, std::micro>(stop - start).count() / kBurst);
  }
  CHECK(cudaGetLastError());
  std::nth_element(per_launch_us.begin(), per_launch_us.begin() + kBursts / 2, per_launch_us.end());
  return per_launch_us[kBursts / 2];
}

template <int Bytes>
void run_sizes(cudaStream_t stream) {
  for (Api api : {Api::kTripleChevron, Api::kLaunchEx, Api::kLaunchExCluster}) {
    for (int smem : {0, 48 * 1024, 100 * 1024, 200 * 1024}) {
      double us = time_case<Bytes>(api, smem, stream);
      std::printf("{\"param_bytes\": %d, \"dynamic_smem_bytes\": %d, \"api\": \"%s\", \"host_us_per_launch\": %.3f}\n",
                  Bytes, smem, name(api), us);
    }
  }
}

int main() {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int runtime = 0, driver = 0;
  CHECK(cudaRuntimeGetVersion(&runtime));
  CHECK(cudaDriverGetVersion(&driver));
  std::printf("{\"gpu\": \"%s\", \"cuda_runtime\": %d, \"cuda_driver\": %d}\n", prop.name, runtime, driver);
  run_sizes<16>(stream);
  run_sizes<256>(stream);
  run_sizes<1024>(stream);
  run_sizes<2048>(stream);
  run_sizes<4096>(stream);
  CHECK(cudaStreamDestroy(stream));
  return 0;
}
