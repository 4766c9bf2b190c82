// clamp to [low, high] (the ABI scalars 2 and 3)
template <class T>
TD_ACTIVATION_FN T td_activate(T v, T low, T high) { return v < low ? low : (v > high ? high : v); }
