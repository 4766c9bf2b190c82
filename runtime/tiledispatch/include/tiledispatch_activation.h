// What the activations of the fused epilogues share, for the kernels of every backend (host C++ for the cpu
// backend, host and device code for CUDA and HIP). Each activation is one file, activations/<name>.h, defining
// td_activate(v, low, high) (low and high: the clamp bounds, the ABI's scalars 2 and 3); codegen declares the key's
// one as a template of every kernel (so editing it rebuilds exactly the kernels with that activation) and the
// epilogues include it by the key's activation name. The float64 reference every kernel is validated against is
// reference.py's ACTIVATIONS; the torch forms and derivatives are torch.py's TORCH_ACTIVATIONS.
#ifndef TILEDISPATCH_ACTIVATION_H
#define TILEDISPATCH_ACTIVATION_H

#include <cmath>
#include <type_traits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define TD_ACTIVATION_FN __host__ __device__ __forceinline__
#else
#define TD_ACTIVATION_FN static inline
#endif

namespace td_act {

// exp, tanh and erf in T's own precision: the float forms are the ones device code has (expf, not exp(double))
template <class T>
TD_ACTIVATION_FN T exp_of(T x) {
  if constexpr (std::is_same_v<T, float>) return ::expf(x); else return ::exp(x);
}
template <class T>
TD_ACTIVATION_FN T tanh_of(T x) {
  if constexpr (std::is_same_v<T, float>) return ::tanhf(x); else return ::tanh(x);
}
template <class T>
TD_ACTIVATION_FN T erf_of(T x) {
  if constexpr (std::is_same_v<T, float>) return ::erff(x); else return ::erf(x);
}

// The float activations below run in a kernel's epilogue once per output element. Built on CUDA's erff, expf
// or IEEE division (10-25 instructions each), a GELU took about as long as a GEMM's main loop over a few hundred
// K (bench/results/gelu_epilogue_h200); so they are built on 1 / x and 2^x, each one instruction of the GPU's
// special-function unit (a relative error of about 2^-22). Host code computes the same formulas exactly.
#if defined(__CUDA_ARCH__)
TD_ACTIVATION_FN float reciprocal(float x) { float r; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
TD_ACTIVATION_FN float exp2_of(float x) { float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
#else
TD_ACTIVATION_FN float reciprocal(float x) { return 1.0f / x; }
TD_ACTIVATION_FN float exp2_of(float x) { return ::exp2f(x); }
#endif

// 1 / (1 + exp(-x)): no cancellation at either end (exp(-x) overflowing to infinity gives 0)
TD_ACTIVATION_FN float sigmoid_of(float x) { return reciprocal(1.0f + exp2_of(x * -1.4426950408889634f)); }

// The standard normal CDF, Phi(x) = (1 + erf(x / sqrt 2)) / 2, through its lower tail Phi(-a), a = |x|:
// Phi(-a) = t 2^(q(t) - a^2 log2(e) / 2) with t = 1 / (1 + 0.28 a) and q a degree-8 polynomial fitted (minimax,
// log2 of the ratio) on a in [0, 16] to 1.1e-7. Relative error in float at most 1e-6 for x >= -4 and 3e-6 down to
// -8, where 1 + erff(x / sqrt 2) loses all its digits to cancellation.
TD_ACTIVATION_FN float normal_cdf_of(float x) {
  const float a = ::fabsf(x);
  const float t = reciprocal(1.0f + 0.28f * a);
  float q = -0.31233838f;
  q = q * t + 1.4193910f;
  q = q * t - 2.3553421f;
  q = q * t + 1.6889902f;
  q = q * t - 0.78726763f;
  q = q * t + 0.49632043f;
  q = q * t + 0.56588709f;
  q = q * t + 1.4467734f;
  q = q * t - 3.1624141f;
  const float lower = t * exp2_of(a * (a * -0.72134752f) + q);
  return x >= 0.0f ? 1.0f - lower : lower;  // a NaN x stays NaN through lower
}

}  // namespace td_act

#endif  // TILEDISPATCH_ACTIVATION_H
