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
 * Tensor slots (args->tensors[i]); shapes and strides are in elements, outermost first; strides may be any
 * value the kernel's key allows (td_can_run says which it does not). A slot's dtype is a td_dtype code; the
 * key's name spells its dtypes as A x B x C x accumulator (gemm_fp16xfp16xfp16xfp32_...: A, B and C / D fp16).
 * Unused scalars and params are 0. C++ callers: runtime/cpp/tiledispatch_loader.h (gemm_args fills a GEMM).
 *
 *   GEMM   D = act(alpha * A@B + beta * C + bias + R0 + R1 + ...)
 *   num_tensors = 5 + the key's epilogue.residuals. Slot 4 (bias) is ALWAYS counted, also for a kernel
 *   without bias (its data is then NULL): a kernel without bias or residuals takes 5 tensors, not 4
 *   ("expected 5 tensors (A, B, C, D, bias, 0 residuals), got 4" means slot 4 was left out).
 *     slot  name  shape          dtype     data
 *     0     A     [batch, M, K]  dtype_a   required; row-major ("r" as the layout's 1st letter): stride[2] == 1,
 *                                          column-major ("c"): stride[1] == 1
 *     1     B     [batch, K, N]  dtype_b   required; the layout's 2nd letter as for A
 *     2     C     [batch, M, N]  dtype_c   source of beta * C; NULL when beta == 0; may alias D
 *     3     D     [batch, M, N]  dtype_c   required: the output; the layout's 3rd letter (as C)
 *     4     bias  [batch, N]     dtype_c   per-column bias: required when the key has epilogue.bias, else
 *                                          NULL (still counted); batch stride 0 = one bias for every batch
 *     5+i   R_i   [batch, M, N]  dtype_c   residual i, i < epilogue.residuals: required, row-major
 *   batch stride 0 on A, B, C or a residual broadcasts it over the batch (never on D).
 *   scalars: 0 alpha, 1 beta, 2 clamp low, 3 clamp high (read by activation "clamp" only)
 *   params (run-time tuning, no recompilation; 0 = the kernel's choice):
 *     params[0] raster order of output tiles: 0 heuristic, 1 along M, 2 along N
 *     params[1] tile swizzle: 0 heuristic, else 1, 2, 4 or 8
 *   Example: layout "rcr", fp16, no bias (key ..._identity_...), M = 128, N = 256, K = 64, batch 1, beta 0:
 *     num_tensors = 5
 *     tensors[0] A     data a     TD_FP16  rank 3  shape {1, 128, 64}   stride {8192, 64, 1}
 *     tensors[1] B     data b     TD_FP16  rank 3  shape {1, 64, 256}   stride {16384, 1, 64}
 *     tensors[2] C     data NULL  TD_FP16  rank 3  shape {1, 128, 256}  stride {32768, 256, 1}
 *     tensors[3] D     data d     TD_FP16  rank 3  shape {1, 128, 256}  stride {32768, 256, 1}
 *     tensors[4] bias  data NULL  TD_FP16  rank 2  shape {1, 256}       stride {0, 1}
 *     scalars = {1.0, 0.0, 0.0, 0.0}
 *   With a bias (key ..._identitybias_...) tensors[4].data points at N values; with epilogue.residuals = 2,
 *   num_tensors = 7 and tensors[5], tensors[6] are [1, 128, 256] row-major like D.
 *
 *   Grouped convolution (channels-last with a group axis; spatial rank S = 1, 2 or 3; G groups):
 *   num_tensors = 3, in this slot order for every direction; dtypes by slot: X dtype_a, W dtype_b, Y dtype_c.
 *     slot  name  shape                          fwd     bwd_data  bwd_weight
 *     0     X     [N, spatial_in..., G, C/G]     input   OUTPUT    input
 *     1     W     [G, K/G, filter..., C/G]       input   input     OUTPUT
 *     2     Y     [N, spatial_out..., G, K/G]    OUTPUT  input     input
 *   fwd writes Y = conv(X, W); bwd_data writes X = dX from Y = dY and W; bwd_weight writes W = dW from X
 *   and Y = dY. Ranks: X and Y 3 + S, W 3 + S. C and K count all groups' channels.
 *   params: [0] S, then per spatial dim d (d = 0..S-1, outermost first; the entries of dims >= S are 0;
 *   TD_CONV_* below name the slots, tiledispatch_kernel.h reads them):
 *     params[1 + d]       stride
 *     params[4 + d]       dilation
 *     params[7 + d]       padding low
 *     params[10 + d]      padding high
 *   scalars: 0 alpha, 1 beta (beta * previous contents of the written tensor); a fused fwd kernel also 2, 3
 *   (see "Fused forward epilogue" below).
 *   spatial_out = (spatial_in + pad_lo + pad_hi - dilation * (filter - 1) - 1) / stride + 1.
 *   Example, fwd: 2-D, fp16, N = 8, input 32 x 32, C = 64, K = 128, G = 1, 3 x 3 filter, stride 1, padding 1:
 *     num_tensors = 3
 *     tensors[0] X  data x  TD_FP16  rank 5  shape {8, 32, 32, 1, 64}   stride {65536, 2048, 64, 64, 1}
 *     tensors[1] W  data w  TD_FP16  rank 5  shape {1, 128, 3, 3, 64}   stride {73728, 576, 192, 64, 1}
 *     tensors[2] Y  data y  TD_FP16  rank 5  shape {8, 32, 32, 1, 128}  stride {131072, 4096, 128, 128, 1}
 *     params = {2, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0}
 *     scalars = {1.0, 0.0}
 *   Example, bwd_data of the same layer: the same three slots, shapes and params; X is written (dX), Y holds
 *     dY; scalars {1.0, 1.0} would add dX to X's previous contents.
 *   Example, bwd_weight: 1-D depthwise, fp32, N = 4, input 100, C = K = G = 16, filter 5, stride 2, no padding
 *     (spatial_out = 48): X {4, 100, 16, 1} stride {1600, 16, 1, 1}; W (written, dW) {16, 1, 5, 1} stride
 *     {5, 5, 1, 1}; Y (dY) {4, 48, 16, 1} stride {768, 16, 1, 1}; params = {1, 2, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0}.
 *
 *   Fused forward epilogue: Y = act(alpha * conv(X, W) + beta * Y_old + bias[g][k] + R0 + R1 + ...).
 *   A fwd kernel whose key has an epilogue other than the default (identity, no bias, 0 residuals; its name's
 *   epilogue field is not "identity") takes num_tensors = 4 + the key's epilogue.residuals; plain conv kernels
 *   keep the 3 tensors above. Slot 3 (bias) is ALWAYS counted, also for a kernel without bias (data NULL):
 *   "expected 4 tensors (X, W, Y, bias, 0 residuals), got 3" means slot 3 was left out. bwd_data and bwd_weight
 *   kernels have no epilogue (the rules refuse one).
 *     slot  name  shape                          dtype    data
 *     3     bias  [G, K/G]                       dtype_c  per output channel: required when the key has
 *                                                         epilogue.bias, else NULL (still counted)
 *     4+i   R_i   [N, spatial_out..., G, K/G]    dtype_c  residual i: Y's shape, its own strides (channels
 *                                                         contiguous); never overlapping Y
 *   scalars: 0 alpha, 1 beta, 2 clamp low, 3 clamp high (read by activation "clamp" only), as GEMM's.
 *   A kernel may refuse a combination it cannot fuse with TD_UNSUPPORTED and a reason (e.g. tma_ws_conv adds its
 *   residual through CUTLASS's C operand, so it refuses beta != 0 together with a residual).
 *   Example, the ResNet block's last conv: fp16, N = 8, 56 x 56, C = 64, K = 256, 1 x 1, relu(conv + bias +
 *   identity) (key ..._relubiasres1_...):
 *     num_tensors = 5
 *     tensors[0] X     data x     TD_FP16  rank 5  shape {8, 56, 56, 1, 64}   stride {200704, 3584, 64, 64, 1}
 *     tensors[1] W     data w     TD_FP16  rank 5  shape {1, 256, 1, 1, 64}   stride {16384, 64, 64, 64, 1}
 *     tensors[2] Y     data y     TD_FP16  rank 5  shape {8, 56, 56, 1, 256}  stride {802816, 14336, 256, 256, 1}
 *     tensors[3] bias  data b     TD_FP16  rank 2  shape {1, 256}             stride {256, 1}
 *     tensors[4] R0    data r     TD_FP16  rank 5  shape {8, 56, 56, 1, 256}  stride {802816, 14336, 256, 256, 1}
 *     params = {2, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0}
 *     scalars = {1.0, 0.0, 0.0, 0.0}
 *   ReLU6 (key ..._clampbias_...): num_tensors = 4, scalars = {1.0, 0.0, 0.0, 6.0}.
 *
 *   LayerNorm (op layernorm, layout rows): y[r, :] = (x[r, :] - mean) / sqrt(var + eps) * weight + bias, the
 *   variance biased; num_tensors = 4; dtypes: x dtype_a, weight and bias dtype_b, y dtype_c.
 *     slot  name    shape         data
 *     0     x       [rows, cols]  any row stride, unit column stride
 *     1     weight  [cols]        contiguous; NULL: 1
 *     2     bias    [cols]        contiguous; NULL: 0
 *     3     y       [rows, cols]  OUTPUT, like x; may be x itself (the same pointer and strides)
 *   scalars: 0 eps (>= 0). The shared check: tiledispatch_layernorm.h.
 *   Example, ConvNeXt-T's first stage, fp16, 100,352 rows of 96 channels: tensors[0] x TD_FP16 rank 2 shape
 *     {100352, 96} stride {96, 1}; tensors[1] weight and tensors[2] bias TD_FP16 rank 1 shape {96} stride {1};
 *     tensors[3] y like x; scalars = {1e-6}.
 *
 *   Max pooling (op maxpool, layout ndhwc): y[n, o, c] = the maximum of x[n, o * stride - pad + t * dilation, c]
 *   over the window's taps t inside the input (-inf where none is; NaN where one is NaN); every problem as 3D,
 *   unit outer dims added; num_tensors = 2, both dtype_a: 0 x [N, D, H, W, C], 1 y [N, Do, Ho, Wo, C] (written),
 *   channels contiguous. params: [TD_CONV_RANK] the problem's rank (1-3), [TD_CONV_STRIDE + d],
 *   [TD_CONV_DILATION + d], [TD_CONV_PAD_LO + d] and [TD_POOL_WINDOW + d] for d = 0..2; y's shape is the output
 *   size. The shared check: tiledispatch_pool.h.
 *   Example, ResNet-50's pool after the stem, fp16, N = 32, 112 x 112, C = 64, window 3, stride 2, padding 1:
 *     tensors[0] x TD_FP16 rank 5 shape {32, 1, 112, 112, 64} stride {802816, 0, 7168, 64, 1}
 *     tensors[1] y TD_FP16 rank 5 shape {32, 1, 56, 56, 64} stride {200704, 0, 3584, 64, 1}
 *     params = {2, 1, 2, 2, 1, 1, 1, 0, 1, 1, 0, 0, 0, 1, 3, 3}
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
/* Max pooling: the conv slots above for rank, stride, dilation and low padding, and the window per dim */
#define TD_POOL_WINDOW 13

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
