// Max pooling's run-time argument check and geometry, shared by every backend's maxpool kernels (host C++). The
// slots are those runtime/tiledispatch/ops/maxpool.py fills: 0 x [N, D, H, W, C] (1D and 2D problems with unit
// outer dims), 1 y [N, Do, Ho, Wo, C] (written); params as grouped convolution's (TD_CONV_RANK: the problem's rank,
// TD_CONV_STRIDE / DILATION / PAD_LO + d for d = 0..2, outermost first) and TD_POOL_WINDOW + d, the window.
#ifndef TILEDISPATCH_POOL_H
#define TILEDISPATCH_POOL_H

#include <cstdint>

#include "tiledispatch_kernel.h"

enum { TD_POOL_X = 0, TD_POOL_Y = 1 };

struct td_pool_geometry {
  int64_t n, c, in[3], out[3], window[3], stride[3], dilation[3], pad[3];
  int64_t xs[5], ys[5];  // strides in elements, [N, D, H, W, C]
};

static inline td_pool_geometry td_pool_geometry_of(const td_args* args) {
  const td_tensor &x = args->tensors[TD_POOL_X], &y = args->tensors[TD_POOL_Y];
  td_pool_geometry g;
  g.n = x.shape[0];
  g.c = x.shape[4];
  for (int d = 0; d < 3; ++d) {
    g.in[d] = x.shape[1 + d];
    g.out[d] = y.shape[1 + d];
    g.window[d] = args->params[TD_POOL_WINDOW + d];
    g.stride[d] = td_conv_stride(args, d);
    g.dilation[d] = td_conv_dilation(args, d);
    g.pad[d] = td_conv_pad_lo(args, d);
  }
  for (int i = 0; i < 5; ++i) {
    g.xs[i] = x.stride[i];
    g.ys[i] = y.stride[i];
  }
  return g;
}

// dtype: the kernel's (x and y); vec: the channels of one access (C, the pointers and the pixel strides must be
// multiples of it). Refuses what no kernel could compute (TD_INVALID_ARGUMENT) and what this one does not
// (TD_UNSUPPORTED), with the reason.
static inline int32_t td_pool_check(const td_args* args, char* reason, uint64_t n, int32_t dtype, int64_t vec) {
  if (!args) return fail(reason, n, TD_INVALID_ARGUMENT, "args is NULL");
  if (args->abi_version != TD_ABI_VERSION)
    return fail(reason, n, TD_INVALID_ARGUMENT, "ABI version %u, kernel has %u", args->abi_version, TD_ABI_VERSION);
  if (args->num_tensors != 2)
    return fail(reason, n, TD_INVALID_ARGUMENT, "expected 2 tensors (x, y), got %d", args->num_tensors);
  static const char* names[2] = {"x", "y"};
  for (int t = 0; t < 2; ++t) {
    const td_tensor& v = args->tensors[t];
    if (!v.data) return fail(reason, n, TD_INVALID_ARGUMENT, "%s is missing (NULL data)", names[t]);
    if (v.dtype != dtype)
      return fail(reason, n, TD_INVALID_ARGUMENT, "%s has dtype %s, kernel expects %s", names[t], dtype_name(v.dtype),
                  dtype_name(dtype));
    if (v.rank != 5) return fail(reason, n, TD_INVALID_ARGUMENT, "%s has rank %d, expected 5 [N, D, H, W, C]", names[t],
                                 v.rank);
    for (int i = 0; i < 5; ++i)
      if (v.shape[i] < 1 || v.shape[i] > INT32_MAX)
        return fail(reason, n, TD_INVALID_ARGUMENT, "%s dim %d is %lld: sizes must be 1 .. 2^31 - 1", names[t], i,
                    (long long)v.shape[i]);
  }
  const td_pool_geometry g = td_pool_geometry_of(args);
  if (args->tensors[TD_POOL_Y].shape[0] != g.n || args->tensors[TD_POOL_Y].shape[4] != g.c)
    return fail(reason, n, TD_INVALID_ARGUMENT, "y's batch and channels differ from x's");
  for (int d = 0; d < 3; ++d) {
    if (g.window[d] < 1 || g.stride[d] < 1 || g.dilation[d] < 1 || g.pad[d] < 0 || g.window[d] > INT32_MAX ||
        g.stride[d] > INT32_MAX || g.dilation[d] > INT32_MAX || g.pad[d] > INT32_MAX)
      return fail(reason, n, TD_INVALID_ARGUMENT, "dim %d: window %lld, stride %lld, dilation %lld must be >= 1 and "
                  "padding %lld >= 0 (all below 2^31)", d, (long long)g.window[d], (long long)g.stride[d],
                  (long long)g.dilation[d], (long long)g.pad[d]);
    // every window starts inside the input or its low padding (torch's output size, ceil_mode included)
    if ((g.out[d] - 1) * g.stride[d] - g.pad[d] > g.in[d] - 1)
      return fail(reason, n, TD_INVALID_ARGUMENT, "dim %d: the last of %lld outputs (stride %lld, padding %lld) starts "
                  "past the input of %lld", d, (long long)g.out[d], (long long)g.stride[d], (long long)g.pad[d],
                  (long long)g.in[d]);
  }
  for (int t = 0; t < 2; ++t) {  // every element's byte offset fits an int64
    const td_tensor& v = args->tensors[t];
    int64_t reach = 0, step, bytes;
    bool ok = true;
    for (int i = 0; i < 5 && ok; ++i)
      ok = !__builtin_mul_overflow(v.shape[i] - 1, v.stride[i] < 0 ? -v.stride[i] : v.stride[i], &step) &&
           !__builtin_add_overflow(reach, step, &reach);
    if (!ok || __builtin_mul_overflow(reach + 1, int64_t(dtype == TD_FP32 ? 4 : 2), &bytes))
      return fail(reason, n, TD_INVALID_ARGUMENT, "%s spans more bytes than an int64 offset holds", names[t]);
  }
  if (g.c > 1 && (g.xs[4] != 1 || g.ys[4] != 1))
    return fail(reason, n, TD_INVALID_ARGUMENT, "x and y need contiguous channels (stride 1), got %lld and %lld",
                (long long)g.xs[4], (long long)g.ys[4]);
  if (vec > 1) {
    bool ok = g.c % vec == 0;
    for (int i = 0; i < 4; ++i) ok = ok && g.xs[i] % vec == 0 && g.ys[i] % vec == 0;
    const uint64_t bytes = uint64_t(vec) * (dtype == TD_FP32 ? 4 : 2);
    for (int t = 0; t < 2; ++t) ok = ok && reinterpret_cast<uintptr_t>(args->tensors[t].data) % bytes == 0;
    if (!ok)
      return fail(reason, n, TD_UNSUPPORTED, "channels %lld, the pixel strides and the pointers must be multiples of "
                  "the kernel's %lld-channel accesses", (long long)g.c, (long long)vec);
  }
  return TD_OK;
}

#endif  // TILEDISPATCH_POOL_H
