// sigmoid: 1 / (1 + exp(-v))
template <class T>
TD_ACTIVATION_FN T td_activate(T v, T, T) {
  if constexpr (std::is_same_v<T, float>) return td_act::sigmoid_of(v);
  else return T(1) / (T(1) + td_act::exp_of(-v));
}
