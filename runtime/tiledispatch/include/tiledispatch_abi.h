/* tiledispatch C ABI: the one interface every generated kernel library (.so) exports.
 *
 * One .so holds one kernel configuration. The runtime reads its key from the ELF section ".td_key"
 * (TD_DEFINE_KERNEL_KEY) and compares it with the bundle manifest before loading it; after loading it
 * checks td_abi_version() and compares td_kernel_key() (the kernel key as canonical JSON) as well.
 *
 * Calls never allocate device memory and never synchronize: td_run launches the kernel once on
 * args->stream (cudaStream_t / hipStream_t; ignored by the cpu backend, which runs synchronously).
 * Every function that can fail returns a td_status and writes a readable reason into `reason`.
 *
 * Tensor slots (args->tensors[i]); shapes and strides are in elements, strides may be any value
 * the kernel's key allows (td_can_run says which it does not):
 *
 *   GEMM   D = act(alpha * A@B + beta * C + bias + R0 + R1 + ...)
 *     0 A     [batch, M, K]
 *     1 B     [batch, K, N]
 *     2 C     [batch, M, N]  source of beta * C; data may be NULL when beta == 0; may alias D
 *     3 D     [batch, M, N]  output
 *     4 bias  [batch, N]     per-column bias (keys with epilogue.bias); batch stride 0 = shared
 *     5.. R_i [batch, M, N]  residuals (epilogue.residuals of them)
 *   scalars: 0 alpha, 1 beta, 2 clamp low, 3 clamp high
 *   params (run-time tuning, no recompilation; 0 = the kernel's choice):
 *     params[0] raster order of output tiles: 0 heuristic, 1 along M, 2 along N
 *     params[1] tile swizzle: 0 heuristic, else 1, 2, 4 or 8
 *
 *   Grouped convolution (channels-last with a group axis; spatial rank S = 1, 2 or 3):
 *     0 X  input   [N, spatial_in..., G, C/G]
 *     1 W  weight  [G, K/G, filter..., C/G]
 *     2 Y  output  [N, spatial_out..., G, K/G]
 *   fwd writes Y from X, W; bwd_data writes X from Y, W; bwd_weight writes W from X, Y.
 *   params: [0] S, then per spatial dim d (d = 0..S-1, outermost first; TD_CONV_* below name the slots,
 *   tiledispatch_kernel.h reads them):
 *     params[1 + d]       stride
 *     params[4 + d]       dilation
 *     params[7 + d]       padding low
 *     params[10 + d]      padding high
 *   scalars: 0 alpha, 1 beta (beta * previous contents of the written tensor).
 */
#ifndef TILEDISPATCH_ABI_H
#define TILEDISPATCH_ABI_H

#include <stddef.h>
#include <stdint.h>

#define TD_ABI_VERSION 1u
#define TD_MAX_RANK 8
#define TD_MAX_TENSORS 8
#define TD_MAX_SCALARS 4
#define TD_MAX_PARAMS 16

/* Grouped convolution params slots (see above): [TD_CONV_RANK] S, [TD_CONV_STRIDE + d] ... */
#define TD_CONV_RANK 0
#define TD_CONV_STRIDE 1
#define TD_CONV_DILATION 4
#define TD_CONV_PAD_LO 7
#define TD_CONV_PAD_HI 10

#if defined(_WIN32)
#define TD_EXPORT __declspec(dllexport)
#else
#define TD_EXPORT __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum td_status {
  TD_OK = 0,
  TD_UNSUPPORTED = 1,      /* this kernel cannot run this problem (reason says why) */
  TD_INVALID_ARGUMENT = 2, /* the arguments are inconsistent (dtype, rank, shape, missing pointer) */
  TD_RUNTIME_ERROR = 3     /* the launch or the device failed */
} td_status;

typedef enum td_dtype { /* the codes of runtime/tiledispatch/spec/dtypes.py */
  TD_FP32 = 1, TD_FP16 = 2, TD_BF16 = 3, TD_INT8 = 4, TD_INT32 = 5,
  TD_FP8E4M3 = 6, TD_FP8E5M2 = 7, TD_FP64 = 8
} td_dtype;

typedef struct td_tensor {
  void* data;                   /* device pointer (host pointer on the cpu backend); NULL = absent */
  int32_t dtype;                /* td_dtype */
  int32_t rank;
  int64_t shape[TD_MAX_RANK];
  int64_t stride[TD_MAX_RANK];  /* in elements */
} td_tensor;

typedef struct td_args {
  uint32_t abi_version;         /* TD_ABI_VERSION of the caller */
  int32_t num_tensors;
  td_tensor tensors[TD_MAX_TENSORS];
  double scalars[TD_MAX_SCALARS];
  int64_t params[TD_MAX_PARAMS];
  void* workspace;              /* td_workspace_bytes(args) bytes, owned by the caller */
  uint64_t workspace_bytes;
  void* stream;
  int32_t num_threads;          /* cpu backend: worker threads, 0 = OpenMP's default */
  int32_t reserved;
} td_args;

TD_EXPORT uint32_t td_abi_version(void);
/* The kernel key as canonical JSON (static storage); defined by TD_DEFINE_KERNEL_KEY below. */
TD_EXPORT const char* td_kernel_key(void);
/* TD_OK when td_run would accept these arguments; otherwise the reason. */
TD_EXPORT int32_t td_can_run(const td_args* args, char* reason, uint64_t reason_bytes);
/* Bytes of workspace td_run needs for these arguments (0 for none). */
TD_EXPORT uint64_t td_workspace_bytes(const td_args* args);
/* Checks as td_can_run does, then launches the kernel once. */
TD_EXPORT int32_t td_run(const td_args* args, char* reason, uint64_t reason_bytes);

#ifdef __cplusplus
}
#endif

/* TD_DEFINE_KERNEL_KEY("<key JSON>") defines td_kernel_key() (write it where the other td_ functions are
 * defined, inside extern "C") and stores the same bytes, NUL-terminated, as the only content of the ELF
 * section ".td_key". The runtime reads that section from the file's bytes and compares it with the
 * manifest before dlopen, so a library that is not the kernel the manifest names is refused before any of
 * its constructors can run; after dlopen it compares td_kernel_key() as well. */
#if defined(__ELF__)
#define TD_KEY_SECTION __attribute__((section(".td_key"), used))
#else
#define TD_KEY_SECTION
#endif
#define TD_DEFINE_KERNEL_KEY(json)                              \
  static const char td_key_json_[] TD_KEY_SECTION = json;       \
  TD_EXPORT const char* td_kernel_key(void) { return td_key_json_; }

#endif /* TILEDISPATCH_ABI_H */
