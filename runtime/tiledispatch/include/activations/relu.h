// relu: max(v, 0)
template <class T>
TD_ACTIVATION_FN T td_activate(T v, T, T) { return v > T(0) ? v : T(0); }
