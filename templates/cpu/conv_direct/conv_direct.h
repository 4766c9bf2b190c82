// The cpu direct convolution family's helpers (plain C++, included by its main templates).
#pragma once
// ---- direct convolution helpers: channels of every group as vector lanes ---------------------------
constexpr int64_t EXPAND_LIMIT_BYTES = int64_t(2) << 20;  // per-thread expanded halo
// Direct kernels serve narrow groups: with more channels per group a packed (implicit GEMM) kernel reuses
// its operands better and is faster, so direct kernels decline them and selection takes the packed one.
constexpr int64_t DIRECT_MAX_CHANNELS = 8;

// `channels`: the per-group channels the reduction runs over (C/G, or K/G for bwd_data), named by `what`.
static int32_t check_expansion(int64_t halo_pixels, int64_t channels, const char* what, char* reason, uint64_t rn) {
  if (channels > DIRECT_MAX_CHANNELS)
    return fail(reason, rn, TD_UNSUPPORTED,
                "direct kernels serve narrow groups (%s <= %lld), this problem has %s = %lld: a packed kernel runs it",
                what, (long long)DIRECT_MAX_CHANNELS, what, (long long)channels);
  const int64_t bytes = halo_pixels * channels * NC * int64_t(sizeof(Acc));
  if (bytes > EXPAND_LIMIT_BYTES)
    return fail(reason, rn, TD_UNSUPPORTED,
                "direct kernel: expanding %lld halo pixels x %lld channels per group x %d lanes takes %lld KiB "
                "(limit %lld KiB); a packed kernel runs this problem",
                (long long)halo_pixels, (long long)channels, NC, (long long)(bytes >> 10),
                (long long)(EXPAND_LIMIT_BYTES >> 10));
  return TD_OK;
}

// xe[p][c][j] = src[(p0 + p) * pixel_stride + lane_off[j] + c] for p < pixels (0 outside [0, extent)),
// c < channels, j < nc; lanes nc..NC are 0. The lanes of one channel come from different groups.
template <int DT, typename T>
static void expand(const T* src, int64_t pixel_stride, int64_t p0, int64_t extent, int64_t pixels, int64_t channels,
                   const int64_t* lane_off, int nc, Acc* xe) {
  const bool unit = channels == 1 && nc > 1 && lane_off[nc - 1] - lane_off[0] == nc - 1;  // depthwise, dense lanes
  for (int64_t p = 0; p < pixels; ++p) {
    Acc* dst = xe + p * channels * NC;
    const int64_t pos = p0 + p;
    if (pos < 0 || pos >= extent) {
      std::fill(dst, dst + channels * NC, Acc(0));
      continue;
    }
    const T* px = src + pos * pixel_stride;
    if (unit) {
      const T* s = px + lane_off[0];
      for (int j = 0; j < nc; ++j) dst[j] = load<DT, Acc>(s[j]);
    } else {
      for (int64_t c = 0; c < channels; ++c)
        for (int j = 0; j < nc; ++j) dst[c * NC + j] = load<DT, Acc>(px[lane_off[j] + c]);
    }
    for (int64_t c = 0; c < channels; ++c) std::fill(dst + c * NC + nc, dst + (c + 1) * NC, Acc(0));
  }
}

// c[i][lanes] (+)= sum over reduction steps r in [r0, r1) of xrow[i][xoff[r]] * w[woff[r]]: MR rows x NR lanes
// of accumulators stay in registers. The step tables hold only the steps that reach real data.
static inline void direct_tile(int64_t r0, int64_t r1, const int64_t* __restrict xoff, const int64_t* __restrict woff,
                               const Acc* const* xrow, const Acc* w, Acc* __restrict c, bool first) {
  vec_t acc[MR][NV];
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 32
    for (int v = 0; v < NV; ++v) {
      if (first) acc[i][v] = vec_t{};
      else std::memcpy(&acc[i][v], c + i * NC + v * VL, sizeof(vec_t));
    }
  for (int64_t r = r0; r < r1; ++r) {
    const Acc* wr = w + woff[r];
    const int64_t off = xoff[r];
    vec_t wv[NV];
#pragma GCC unroll 32
    for (int v = 0; v < NV; ++v) std::memcpy(&wv[v], wr + v * VL, sizeof(vec_t));
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 32
      for (int v = 0; v < NV; ++v) {
        vec_t xv;
        std::memcpy(&xv, xrow[i] + off + v * VL, sizeof(vec_t));
        acc[i][v] += xv * wv[v];
      }
  }
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 32
    for (int v = 0; v < NV; ++v) std::memcpy(c + i * NC + v * VL, &acc[i][v], sizeof(vec_t));
}
