// gelu, tanh approximation: 0.5 v (1 + tanh(y)) = v sigmoid(2 y), y = sqrt(2/pi) (v + 0.044715 v^3)
template <class T>
TD_ACTIVATION_FN T td_activate(T v, T, T) {
  if constexpr (std::is_same_v<T, float>) return v * td_act::sigmoid_of(v * (1.5957692f + 0.071354816f * v * v));
  else return T(0.5) * v * (T(1) + td_act::tanh_of(T(0.7978845608028654) * (v + T(0.044715) * v * v * v)));
}
