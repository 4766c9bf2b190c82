// What every generated kernel source shares (host C++, included by the templates of every backend): the ABI's
// export block (tiledispatch_export.h: TD_EXPORT_KERNEL), the error helper that writes a reason and returns a
// status, the names of the ABI's dtype codes, and named accessors for the grouped-convolution parameters.
// Templates keep only what varies.
#ifndef TILEDISPATCH_KERNEL_H
#define TILEDISPATCH_KERNEL_H

#include <cstdarg>
#include <cstdint>
#include <cstdio>

#include "tiledispatch_abi.h"
#include "tiledispatch_export.h"
#include "tiledispatch_activation.h"

// Writes the printf-formatted reason (when the caller gave a buffer) and returns status.
static inline int32_t fail(char* reason, uint64_t n, int32_t status, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
static inline int32_t fail(char* reason, uint64_t n, int32_t status, const char* fmt, ...) {
  if (reason && n) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(reason, size_t(n), fmt, ap);
    va_end(ap);
  }
  return status;
}

static inline const char* dtype_name(int32_t code) {
  switch (code) {
    case TD_FP32: return "fp32";
    case TD_FP16: return "fp16";
    case TD_BF16: return "bf16";
    case TD_INT8: return "int8";
    case TD_INT32: return "int32";
    case TD_FP8E4M3: return "fp8e4m3";
    case TD_FP8E5M2: return "fp8e5m2";
    case TD_FP64: return "fp64";
    default: return "unknown";
  }
}

// Grouped convolution: the spatial rank and, per spatial dim d (outermost first), the geometry.
static inline int64_t td_conv_rank(const td_args* args) { return args->params[TD_CONV_RANK]; }
static inline int64_t td_conv_stride(const td_args* args, int d) { return args->params[TD_CONV_STRIDE + d]; }
static inline int64_t td_conv_dilation(const td_args* args, int d) { return args->params[TD_CONV_DILATION + d]; }
static inline int64_t td_conv_pad_lo(const td_args* args, int d) { return args->params[TD_CONV_PAD_LO + d]; }
static inline int64_t td_conv_pad_hi(const td_args* args, int d) { return args->params[TD_CONV_PAD_HI + d]; }

#endif  // TILEDISPATCH_KERNEL_H
