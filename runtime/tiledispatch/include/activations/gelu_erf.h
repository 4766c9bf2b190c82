// gelu, exact form: 0.5 v (1 + erf(v / sqrt(2))) = v Phi(v)
template <class T>
TD_ACTIVATION_FN T td_activate(T v, T, T) {
  if constexpr (std::is_same_v<T, float>) return v * td_act::normal_cdf_of(v);
  else return T(0.5) * v * (T(1) + td_act::erf_of(v * T(0.7071067811865476)));
}
