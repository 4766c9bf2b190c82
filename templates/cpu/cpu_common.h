// What every cpu kernel shares: fp16 / bf16 storage conversions and the checks of the run-time arguments
// (plain C++, included by the cpu families' main templates after their compile-time constants).
#pragma once
// ---- storage conversions (fp16 / bf16 are carried as raw bits) ------------------------------
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal
    const float f = std::ldexp(float(mant), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = exp == 31 ? (sign | 0x7f800000u | (mant << 13)) : (sign | ((exp + 112) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t float_to_half(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds past 65504: infinity
  if (ax < 0x38800000u) {                                  // below 2^-14: subnormal half
    float af;
    std::memcpy(&af, &ax, 4);
    return uint16_t(sign | uint32_t(std::nearbyint(af * 16777216.0f)));
  }
  uint32_t h = (((ax >> 23) - 112) << 10) | ((ax >> 13) & 0x3ffu);
  const uint32_t rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return uint16_t(sign | h);
}

static inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return uint16_t(x >> 16);
}

// load<DT, T>(stored value) -> T ; store<DT, T>(T) -> stored value, for a td_dtype code DT
template <int DT, typename T, typename S>
static inline T load(S v) {
#if defined(__F16C__)
  if constexpr (DT == TD_FP16) return T(_cvtsh_ss(v));  // one instruction, the same value
#endif
  if constexpr (DT == TD_FP16) return T(half_to_float(v));
  else if constexpr (DT == TD_BF16) return T(bf16_to_float(v));
  else return T(v);
}

template <int DT, typename S, typename T>
static inline S store(T v) {
#if defined(__F16C__)
  if constexpr (DT == TD_FP16) return S(_cvtss_sh(float(v), _MM_FROUND_TO_NEAREST_INT));  // round to nearest even
#endif
  if constexpr (DT == TD_FP16) return float_to_half(float(v));
  else if constexpr (DT == TD_BF16) return float_to_bf16(float(v));
  else if constexpr (DT == TD_INT32) {
    const double r = std::nearbyint(std::min(std::max(double(v), -2147483648.0), 2147483647.0));
    return S(r);
  } else return S(v);
}

// ---- argument checking -----------------------------------------------------------------------


// num_threads: 0 (OpenMP's default) to MAX_THREADS; libgomp crashes on absurd counts (runtime/tiledispatch/plan.py
// refuses the same range before any call)
constexpr int32_t MAX_THREADS = 1024;

static int32_t check_threads(const td_args* args, char* reason, uint64_t n) {
  if (args->num_threads < 0 || args->num_threads > MAX_THREADS)
    return fail(reason, n, TD_INVALID_ARGUMENT, "num_threads must be 0 (OpenMP's default) to %d, got %d", MAX_THREADS,
                args->num_threads);
  return TD_OK;
}

static int64_t dtype_size(int32_t code) {
  switch (code) {
    case TD_FP16: case TD_BF16: return 2;
    case TD_INT8: case TD_FP8E4M3: case TD_FP8E5M2: return 1;
    case TD_FP64: return 8;
    default: return 4;
  }
}

// Whether t's element count and the byte offset of every element (sizes x strides, either sign) fit an int64,
// the type every index is computed in. Sizes must be >= 1 already.
static bool extent_fits(const td_tensor& t) {
  const int64_t item = dtype_size(t.dtype);
  int64_t elements = 1, lo = 0, hi = 0, bytes;
  for (int i = 0; i < t.rank; ++i) {
    int64_t reach;
    if (__builtin_mul_overflow(elements, t.shape[i], &elements)) return false;
    if (__builtin_mul_overflow(t.shape[i] - 1, t.stride[i], &reach)) return false;
    if (__builtin_add_overflow(reach < 0 ? lo : hi, reach, reach < 0 ? &lo : &hi)) return false;
  }
  return !__builtin_mul_overflow(elements, item, &bytes) && !__builtin_mul_overflow(lo, item, &bytes) &&
         !__builtin_mul_overflow(hi + 1, item, &bytes);
}

// aligned scratch buffer kept per thread and grown on demand (no allocation per call once warm)
template <typename T>
static T* scratch(int slot, size_t count) {
  struct Buffer { void* p = nullptr; size_t bytes = 0; ~Buffer() { std::free(p); } };
  static thread_local Buffer buffers[4];
  Buffer& b = buffers[slot];
  const size_t bytes = (count * sizeof(T) + 63) & ~size_t(63);
  if (b.bytes < bytes) {
    std::free(b.p);
    b.p = std::aligned_alloc(64, bytes);
    b.bytes = b.p ? bytes : 0;
  }
  return static_cast<T*>(b.p);
}

// td_run of every cpu kernel: td_can_run's checks, then the kernel, whose only failure is running out of host
// memory (the family's main template exports it: TD_EXPORT_KERNEL(..., (run_checked<can_run, run>))).
template <int32_t (*CanRun)(const td_args*, char*, uint64_t), bool (*Kernel)(const td_args*)>
static int32_t run_checked(const td_args* args, char* reason, uint64_t reason_bytes) {
  const int32_t status = CanRun(args, reason, reason_bytes);
  if (status != TD_OK) return status;
  if (!Kernel(args)) return fail(reason, reason_bytes, TD_RUNTIME_ERROR, "out of host memory");
  return TD_OK;
}
