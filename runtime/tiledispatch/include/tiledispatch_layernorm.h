// LayerNorm's run-time argument check, shared by every backend's layernorm kernels (host C++). The slots are those
// runtime/tiledispatch/ops/layernorm.py fills: 0 x [rows, cols] (any row stride, unit column stride), 1 weight and
// 2 bias [cols] (NULL: 1 and 0), 3 y [rows, cols] like x (it may be x itself); scalars[0] eps >= 0.
#ifndef TILEDISPATCH_LAYERNORM_H
#define TILEDISPATCH_LAYERNORM_H

#include <cmath>
#include <cstdint>

#include "tiledispatch_kernel.h"

enum { TD_LN_X = 0, TD_LN_WEIGHT = 1, TD_LN_BIAS = 2, TD_LN_Y = 3 };

struct td_layernorm_shape {
  int64_t rows, cols, x_stride, y_stride;
};

static inline td_layernorm_shape td_layernorm_shape_of(const td_args* args) {
  const td_tensor &x = args->tensors[TD_LN_X], &y = args->tensors[TD_LN_Y];
  return {x.shape[0], x.shape[1], x.stride[0], y.stride[0]};
}

static inline int64_t td_layernorm_dtype_bytes(int32_t code) {
  return code == TD_FP16 || code == TD_BF16 ? 2 : (code == TD_FP64 ? 8 : 4);
}

// Whether every element of a [rows, cols] view (row stride s, unit column stride) has a byte offset an int64 holds.
static inline bool td_layernorm_extent_fits(int64_t rows, int64_t cols, int64_t s, int64_t item) {
  int64_t reach, bytes;
  const int64_t span = s < 0 ? -s : s;
  return !__builtin_mul_overflow(rows - 1, span, &reach) && !__builtin_add_overflow(reach, cols, &reach) &&
         !__builtin_mul_overflow(reach, item, &bytes);
}

// dx, dw, dy: the kernel's dtype codes of x, of weight and bias, of y. vec: the elements of one vector access (the
// row length, the row strides and every pointer must be multiples of it); max_cols: the longest row the kernel holds
// (0: any length).
static inline int32_t td_layernorm_check(const td_args* args, char* reason, uint64_t n, int32_t dx, int32_t dw,
                                         int32_t dy, int64_t vec, int64_t max_cols) {
  if (!args) return fail(reason, n, TD_INVALID_ARGUMENT, "args is NULL");
  if (args->abi_version != TD_ABI_VERSION)
    return fail(reason, n, TD_INVALID_ARGUMENT, "ABI version %u, kernel has %u", args->abi_version, TD_ABI_VERSION);
  if (args->num_tensors != 4)
    return fail(reason, n, TD_INVALID_ARGUMENT, "expected 4 tensors (x, weight, bias, y), got %d", args->num_tensors);
  static const char* names[4] = {"x", "weight", "bias", "y"};
  const int32_t dtypes[4] = {dx, dw, dw, dy};
  const td_tensor& x = args->tensors[TD_LN_X];
  for (int t = 0; t < 4; ++t) {
    const td_tensor& v = args->tensors[t];
    if (!v.data) {
      if (t == TD_LN_X || t == TD_LN_Y) return fail(reason, n, TD_INVALID_ARGUMENT, "%s is missing (NULL data)", names[t]);
      continue;
    }
    if (v.dtype != dtypes[t])
      return fail(reason, n, TD_INVALID_ARGUMENT, "%s has dtype %s, kernel expects %s", names[t], dtype_name(v.dtype),
                  dtype_name(dtypes[t]));
    const int rank = t == TD_LN_X || t == TD_LN_Y ? 2 : 1;
    if (v.rank != rank) return fail(reason, n, TD_INVALID_ARGUMENT, "%s has rank %d, expected %d", names[t], v.rank, rank);
  }
  const td_tensor& y = args->tensors[TD_LN_Y];
  const td_layernorm_shape p = td_layernorm_shape_of(args);
  if (p.rows < 1 || p.cols < 1)
    return fail(reason, n, TD_INVALID_ARGUMENT, "x has shape [%lld, %lld]: rows and cols must be >= 1",
                (long long)p.rows, (long long)p.cols);
  if (p.rows > INT32_MAX || p.cols > INT32_MAX)
    return fail(reason, n, TD_UNSUPPORTED, "rows and cols must be below 2^31, got %lld and %lld", (long long)p.rows,
                (long long)p.cols);
  if (y.shape[0] != p.rows || y.shape[1] != p.cols)
    return fail(reason, n, TD_INVALID_ARGUMENT, "y has shape [%lld, %lld], expected x's [%lld, %lld]",
                (long long)y.shape[0], (long long)y.shape[1], (long long)p.rows, (long long)p.cols);
  for (int t = 1; t < 3; ++t) {
    const td_tensor& v = args->tensors[t];
    if (v.data && (v.shape[0] != p.cols || (p.cols > 1 && v.stride[0] != 1)))
      return fail(reason, n, TD_INVALID_ARGUMENT, "%s has shape [%lld] and stride %lld, expected [%lld] contiguous",
                  names[t], (long long)v.shape[0], (long long)v.stride[0], (long long)p.cols);
  }
  if (p.cols > 1 && (x.stride[1] != 1 || y.stride[1] != 1))
    return fail(reason, n, TD_INVALID_ARGUMENT, "x and y need a unit stride along the normalized dim, got %lld and %lld",
                (long long)x.stride[1], (long long)y.stride[1]);
  if (p.rows > 1 && (p.y_stride < 0 ? -p.y_stride : p.y_stride) < p.cols)
    return fail(reason, n, TD_INVALID_ARGUMENT, "y's rows (stride %lld) overlap: rows of %lld elements need a stride "
                "of at least that", (long long)p.y_stride, (long long)p.cols);
  if (!td_layernorm_extent_fits(p.rows, p.cols, p.x_stride, td_layernorm_dtype_bytes(dx)) ||
      !td_layernorm_extent_fits(p.rows, p.cols, p.y_stride, td_layernorm_dtype_bytes(dy)))
    return fail(reason, n, TD_INVALID_ARGUMENT, "x or y spans more bytes than an int64 offset holds");
  const double eps = args->scalars[0];
  if (!(eps >= 0.0) || !std::isfinite(eps))
    return fail(reason, n, TD_INVALID_ARGUMENT, "eps must be finite and >= 0, got %g", eps);
  if (max_cols > 0 && p.cols > max_cols)
    return fail(reason, n, TD_UNSUPPORTED, "rows of %lld elements: this kernel holds rows of at most %lld",
                (long long)p.cols, (long long)max_cols);
  if (vec > 1) {
    if (p.cols % vec || (p.rows > 1 && (p.x_stride % vec || p.y_stride % vec)))
      return fail(reason, n, TD_UNSUPPORTED, "cols %lld and row strides %lld / %lld must be multiples of the kernel's "
                  "%lld-element accesses", (long long)p.cols, (long long)p.x_stride, (long long)p.y_stride,
                  (long long)vec);
    for (int t = 0; t < 4; ++t) {
      const td_tensor& v = args->tensors[t];
      const uint64_t bytes = uint64_t(vec * td_layernorm_dtype_bytes(dtypes[t]));
      if (v.data && reinterpret_cast<uintptr_t>(v.data) % bytes)
        return fail(reason, n, TD_UNSUPPORTED, "%s is not aligned to the kernel's %llu-byte accesses", names[t],
                    (unsigned long long)bytes);
    }
  }
  return TD_OK;
}

#endif  // TILEDISPATCH_LAYERNORM_H
