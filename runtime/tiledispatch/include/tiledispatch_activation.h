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

}  // namespace td_act

#endif  // TILEDISPATCH_ACTIVATION_H
