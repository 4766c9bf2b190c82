// CPU emulation of the CUDA features the cutlass conv templates use, for tests on machines without a GPU.
// Every thread of a block is an OS thread; __syncthreads, ldmatrix and mma.sync go through barriers.
// Compile a rendered kernel with: g++ -std=c++20 -DTD_EMULATE -include td_emulate.h (launches rewritten to
// td_emu::launch by the test). Slow, for small problems only: it checks index arithmetic, not speed.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>  // types and declarations only: the functions used are defined below

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)


namespace td_emu {
inline thread_local dim3 tidx, bidx;
inline dim3 grid_dim, block_dim;
inline thread_local unsigned char* smem_ptr;
inline thread_local std::barrier<>* block_bar;
struct Warp {
  std::barrier<> bar{32};
  const void* addr[32];
  uint32_t a[32][4], b[32][2];
};
inline thread_local Warp* warp;
inline std::atomic<int> memset_calls{0};
}  // namespace td_emu

#define threadIdx td_emu::tidx
#define blockIdx td_emu::bidx
#define gridDim td_emu::grid_dim
#define blockDim td_emu::block_dim

inline void __syncthreads() { td_emu::block_bar->arrive_and_wait(); }
inline void __syncwarp() { td_emu::warp->bar.arrive_and_wait(); }
template <typename A> inline A min(A a, A b) { return b < a ? b : a; }
template <typename A> inline A max(A a, A b) { return a < b ? b : a; }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }

cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) { *v = 4; return cudaSuccess; }
template <typename K> inline cudaError_t cudaFuncSetAttribute(K*, cudaFuncAttribute, int) { return cudaSuccess; }
template <typename K>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, K*, int, size_t) { *n = 1; return cudaSuccess; }
cudaError_t cudaGetLastError() { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t) { return "emulated"; }
const char* cudaGetErrorName(cudaError_t) { return "emulated"; }
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  std::memset(p, v, n);
  ++td_emu::memset_calls;
  return cudaSuccess;
}

// cp.async: a plain copy (the emulated wait is the next barrier)
inline void cp_async16(void* smem, const void* gmem, bool valid) {
  if (valid) std::memcpy(smem, gmem, 16);
  else std::memset(smem, 0, 16);
}
inline void cp_async8(void* smem, const void* gmem, bool valid) {
  if (valid) std::memcpy(smem, gmem, 8);
  else std::memset(smem, 0, 8);
}
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}

// ldmatrix .x4 / .x2 (.trans): lanes 8q..8q+7 give the rows of matrix q; lane t receives row t/4, columns
// 2(t%4), 2(t%4)+1 of each matrix (trans: rows 2(t%4), 2(t%4)+1 of column t/4).
template <typename E>
inline void emu_ldsm(uint32_t* r, const E* p, bool trans, int matrices = 4) {
  const int lane = td_emu::tidx.x % 32;
  td_emu::Warp& w = *td_emu::warp;
  w.addr[lane] = p;
  w.bar.arrive_and_wait();
  for (int q = 0; q < matrices; ++q) {
    uint16_t v[2];
    for (int h = 0; h < 2; ++h) {
      const int row = trans ? 2 * (lane % 4) + h : lane / 4, col = trans ? lane / 4 : 2 * (lane % 4) + h;
      std::memcpy(&v[h], static_cast<const E*>(w.addr[8 * q + row]) + col, 2);
    }
    r[q] = uint32_t(v[0]) | (uint32_t(v[1]) << 16);
  }
  w.bar.arrive_and_wait();
}

// stmatrix .x4: lane t's register q holds row t/4, columns 2(t%4), 2(t%4)+1 of matrix q; lanes 8q..8q+7 give
// the rows' addresses.
template <typename E>
inline void emu_stsm(E* p, const uint32_t* r) {
  const int lane = td_emu::tidx.x % 32;
  td_emu::Warp& w = *td_emu::warp;
  w.addr[lane] = p;
  w.bar.arrive_and_wait();
  for (int q = 0; q < 4; ++q)
    for (int h = 0; h < 2; ++h) {
      const uint16_t v = uint16_t(r[q] >> (16 * h));
      std::memcpy(static_cast<E*>(const_cast<void*>(w.addr[8 * q + lane / 4])) + 2 * (lane % 4) + h, &v, 2);
    }
  w.bar.arrive_and_wait();
}

template <typename E>
inline float emu_half(uint32_t reg, int h) {
  E e;
  const uint16_t bits = uint16_t(reg >> (16 * h));
  std::memcpy(&e, &bits, 2);
  return float(e);
}

// mma.sync m16n8k16 row.col, fp32 accumulate: A[r][k] in lane (r%8)*4 + (k%8)/2, register (r/8) + 2(k/8);
// B[k][n] in lane n*4 + (k%8)/2, register k/8; C[r][n] in lane (r%8)*4 + n/2, element (r/8)*2 + n%2.
template <typename E>
inline void emu_mma(float* d, const uint32_t* a, const uint32_t* b) {
  const int lane = td_emu::tidx.x % 32;
  td_emu::Warp& w = *td_emu::warp;
  std::memcpy(w.a[lane], a, 16);
  std::memcpy(w.b[lane], b, 8);
  w.bar.arrive_and_wait();
  for (int e = 0; e < 4; ++e) {
    const int r = lane / 4 + (e / 2) * 8, n = 2 * (lane % 4) + e % 2;
    float s = 0.0f;
    for (int k = 0; k < 16; ++k) {
      const float av = emu_half<E>(w.a[(r % 8) * 4 + (k % 8) / 2][(r / 8) + 2 * (k / 8)], k % 2);
      const float bv = emu_half<E>(w.b[n * 4 + (k % 8) / 2][k / 8], k % 2);
      s += av * bv;
    }
    d[e] += s;
  }
  w.bar.arrive_and_wait();
}

namespace td_emu {
template <typename K, typename... A>
void launch(K kernel, dim3 grid, int threads, size_t smem, cudaStream_t, A... args) {
  grid_dim = grid;
  block_dim = dim3(threads);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        std::vector<unsigned char> shared(smem + 16, 0xFF);  // NaN bytes: reads of unwritten smem show
        std::barrier<> bar(threads);
        std::vector<std::unique_ptr<Warp>> warps((threads + 31) / 32);
        for (auto& wp : warps) wp = std::make_unique<Warp>();
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t)
          pool.emplace_back([&, t] {
            tidx = dim3(unsigned(t));
            bidx = dim3(x, y, z);
            smem_ptr = shared.data();
            block_bar = &bar;
            warp = warps[t / 32].get();
            kernel(args...);
            bar.arrive_and_drop();
          });
        for (auto& th : pool) th.join();
      }
}
}  // namespace td_emu
