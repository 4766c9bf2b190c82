// hardswish: v * clamp(v + 3, 0, 6) / 6 (MobileNetV3's; PyTorch's Hardswish)
template <class T>
TD_ACTIVATION_FN T td_activate(T v, T, T) {
  const T t = v + T(3);
  return t <= T(0) ? T(0) : (t >= T(6) ? v : v * t * T(1.0 / 6.0));
}
