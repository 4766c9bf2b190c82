// tanh
template <class T>
TD_ACTIVATION_FN T td_activate(T v, T, T) { return td_act::tanh_of(v); }
