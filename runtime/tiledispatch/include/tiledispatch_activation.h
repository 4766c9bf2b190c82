// The activations of the fused epilogues, written once for the kernels of every backend: host C++ for the cpu
// backend, host and device code for CUDA and HIP. A kernel key's activation name is the function's name here,
// so a template applies it as td_act::{{ activation }}(v, low, high) (low and high are the clamp bounds, the
// ABI's scalars 2 and 3; the other activations ignore them). The float64 reference every kernel is validated
// against is reference.py's ACTIVATIONS; autograd's derivatives are torch.py's _activation_grad.
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

template <class T>
TD_ACTIVATION_FN T identity(T v, T, T) { return v; }

template <class T>
TD_ACTIVATION_FN T relu(T v, T, T) { return v > T(0) ? v : T(0); }

// 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))
template <class T>
TD_ACTIVATION_FN T gelu_tanh(T v, T, T) {
  return T(0.5) * v * (T(1) + tanh_of(T(0.7978845608028654) * (v + T(0.044715) * v * v * v)));
}

// 0.5 v (1 + erf(v / sqrt(2)))
template <class T>
TD_ACTIVATION_FN T gelu_erf(T v, T, T) { return T(0.5) * v * (T(1) + erf_of(v * T(0.7071067811865476))); }

template <class T>
TD_ACTIVATION_FN T silu(T v, T, T) { return v / (T(1) + exp_of(-v)); }

template <class T>
TD_ACTIVATION_FN T sigmoid(T v, T, T) { return T(1) / (T(1) + exp_of(-v)); }

template <class T>
TD_ACTIVATION_FN T tanh(T v, T, T) { return tanh_of(v); }

template <class T>
TD_ACTIVATION_FN T clamp(T v, T low, T high) { return v < low ? low : (v > high ? high : v); }

}  // namespace td_act

#endif  // TILEDISPATCH_ACTIVATION_H
