// identity: v
template <class T>
TD_ACTIVATION_FN T td_activate(T v, T, T) { return v; }
