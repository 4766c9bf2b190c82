// gelu, tanh approximation: 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))
template <class T>
TD_ACTIVATION_FN T td_activate(T v, T, T) {
  return T(0.5) * v * (T(1) + td_act::tanh_of(T(0.7978845608028654) * (v + T(0.044715) * v * v * v)));
}
