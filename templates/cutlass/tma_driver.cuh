// TMA descriptor encoders, looked up in the driver once (plain CUDA host code for the sm90 kernels: gemm_sm90 and
// conv_tma_ws include it after cuda.h / cudaTypedefs.h / cuda_runtime.h and before CUTLASS's headers).
// With CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL, CUTLASS calls cuTensorMapEncodeTiled / cuTensorMapEncodeIm2col
// directly instead of looking them up in the driver for every descriptor (1.3 us each, four per launch); the
// definitions below look each one up once. (Linking libcuda instead would keep bundles from loading on machines
// without a driver.) They stay private to the kernel library: it is compiled with -fvisibility=hidden.
#pragma once
#define CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL 1

template <typename Fn>
static Fn td_driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    fn = nullptr;
  return reinterpret_cast<Fn>(fn);
}

extern "C" CUresult CUDAAPI cuTensorMapEncodeTiled(
    CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address, const cuuint64_t* dims,
    const cuuint64_t* strides, const cuuint32_t* box, const cuuint32_t* element_strides,
    CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2,
    CUtensorMapFloatOOBfill oob) {
  static const auto encode = td_driver_entry<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled");
  if (!encode) return CUDA_ERROR_NOT_FOUND;
  return encode(map, type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2, oob);
}

extern "C" CUresult CUDAAPI cuTensorMapEncodeIm2col(
    CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address, const cuuint64_t* dims,
    const cuuint64_t* strides, const int* lower_corner, const int* upper_corner, cuuint32_t channels_per_pixel,
    cuuint32_t pixels_per_column, const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
    CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
  static const auto encode = td_driver_entry<PFN_cuTensorMapEncodeIm2col_v12000>("cuTensorMapEncodeIm2col");
  if (!encode) return CUDA_ERROR_NOT_FOUND;
  return encode(map, type, rank, address, dims, strides, lower_corner, upper_corner, channels_per_pixel,
                pixels_per_column, element_strides, interleave, swizzle, l2, oob);
}
