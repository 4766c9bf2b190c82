// silu: v / (1 + exp(-v))
template <class T>
TD_ACTIVATION_FN T td_activate(T v, T, T) { return v / (T(1) + td_act::exp_of(-v)); }
