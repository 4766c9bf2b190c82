// direct_mma bwd_weight's row form (cutlass.rows = 1), plain CUDA included by conv_direct_bwd_weight.cu.j2 inside
// its kernel namespace.
#pragma once
// ---- direct_mma bwd_weight, depthwise row form (cutlass.rows) ----------------------------------------------
// The channel-chunk form keeps 16 of each mma's 128 entries on depthwise filters. Here one mma serves one channel
// and one filter row: k runs over 16 groups u of 8 neighbouring output pixels (output pixel b_u + v, v < 8),
// A[m][u] = X[halo row of u][b_u + m] (m < 16: 16 halo columns from the group's first pixel) and B[u][v] =
// dY[b_u + v], so C[m][v] = sum over u of X[b_u + m] dY[b_u + v] is tap (m - v) / dilation of the filter row:
// (FX - 1) x dilation <= 8 keeps every tap inside m < 16 (7 x 7: 56 entries of 128 are weights).
// Both operands must then be rows of one channel's pixels, so each step first transposes the block's X halo and
// dY tile (channels-last, as copied) into XCM / DCM (ldmatrix .trans, stmatrix): A's and B's k rows are then 16
// bytes of consecutive pixels at a group's first pixel (ldmatrix .trans), those past the tile's last group a zero
// row. Warps: lane l of the block belongs to warp l % NWARPS (CPW = BN / NWARPS channels each), which sums all
// of the tile's groups for them.
static_assert(CG == 1 && TW % 8 == 0 && BN % NWARPS == 0 && TGROUPS == 1 && FX <= 9,
              "direct_mma rows: depthwise, 8-pixel groups along W, whole channels per warp, one tap group, fx <= 9");
constexpr int CPW = BN / NWARPS;       // channels per warp
constexpr int GROUPS = TW * TH / 8;     // 8-pixel groups of a tile
constexpr int RBLOCKS = (GROUPS + 15) / 16;
constexpr int NPC = BN / 8;             // 8-channel pieces of a pixel
// a channel's dY row (DCM): the tile's pixels, padded to an odd number of 16-byte pieces (stmatrix rows of 8
// channels then hit distinct banks)
constexpr int DCH = GROUPS % 2 ? TW * TH : TW * TH + 8;

struct RowLayout {
  int cms;  // a halo row's pixels in XCM (a multiple of 8)
  int xch;  // a channel's elements in XCM (an odd number of 16-byte pieces)
  int nb;   // 8-pixel blocks of a halo row to transpose
};

__host__ __device__ __forceinline__ RowLayout row_layout(int hr, int hc) {
  RowLayout l;
  l.nb = (max(hc, TW + 8) + 7) / 8;  // a group's 16 columns stay in its row, past hc zeros
  l.cms = l.nb * 8;
  l.xch = hr * l.cms + ((hr * l.nb) % 2 ? 0 : 8);
  return l;
}

// Shared memory of XCM, DCM, a 16-element zero row and each warp's 16 x 8 fp32 C tile (reduce_rows), in bytes.
__host__ __device__ __forceinline__ int64_t rows_bytes(int hr, int hc) {
  return round16((int64_t(BN) * (row_layout(hr, hc).xch + DCH) + 16) * int(sizeof(T))) + NWARPS * 128 * 4;
}

// The step's halo (hr x hc pixels, plane 0) and dY tile from channels-last xs / dys into XCM / DCM: 8 x 8 blocks
// (8 pixels x one 8-channel piece), four per ldmatrix.x4.trans and stmatrix.x4. A halo row's columns from hc to
// cms are zeros, so every column an mma reads is finite.
__device__ __forceinline__ void transpose_step(const DirectParams& p, const RowLayout& l, const T* xs, const T* dys,
                                               T* xcm, T* dcm, T* zero) {
  constexpr int STEP = NWARPS * 4;  // blocks per pass of the block's warps
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, i = lane % 8;
  const int ux = p.hr * l.nb * NPC, units = ux + GROUPS * NPC;
  // this lane's X block u = (r * nb + pb) * NPC + cp, stepped by STEP without dividing again
  int u = warp * 4 + lane / 8, cp = u % NPC, pb = u / NPC, r = pb / l.nb;
  pb -= r * l.nb;
  for (; u - lane / 8 < units; u += STEP) {
    const T* src = zero;  // past the last block: zeros onto the zero row (the instructions take the whole warp)
    T* dst = zero;
    if (u < ux) {
      if (pb * 8 + i < p.hc) src = xs + (int64_t(r) * p.hc + pb * 8 + i) * PITCH_CT + cp * 8;
      dst = xcm + (cp * 8 + i) * l.xch + r * l.cms + pb * 8;
    } else if (u < units) {
      const int v = u - ux, vc = v % NPC, vb = v / NPC;
      src = dys + (vb * 8 + i) * DPITCH + vc * 8;
      dst = dcm + (vc * 8 + i) * DCH + vb * 8;
    }
    uint32_t r4[4];
    ldsm_x4_trans(r4, src);
    stsm_x4(dst, r4);
    cp += STEP % NPC;
    if (cp >= NPC) cp -= NPC, ++pb;
    for (pb += STEP / NPC; pb >= l.nb; pb -= l.nb) ++r;
  }
}

// Add the tile's groups into the warp's accumulators: acc[c][fy] is C of channel warp + c * NWARPS, filter row fy.
__device__ __forceinline__ void accumulate_rows(const DirectParams& p, const RowLayout& l, const T* xcm,
                                                const T* dcm, const T* zero, float (&acc)[CPW][FY][4]) {
  const Geom& q = p.q;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // ldmatrix rows: B's k row lane % 16; A's k row lane % 8 + 8 (lane / 16), its columns from m0 = 0 or 8
  const int kb_row = lane % 16, ka = lane % 8 + 8 * (lane / 16), m0 = 8 * (lane / 8 % 2);
#pragma unroll
  for (int c = 0; c < CPW; ++c) {
    const T* xc = xcm + (warp + c * NWARPS) * l.xch;
    const T* dc = dcm + (warp + c * NWARPS) * DCH;
    for (int rb = 0; rb < RBLOCKS; ++rb) {
      const int ub = rb * 16 + kb_row, ua = rb * 16 + ka;
      uint32_t bf[2];
      ldsm_x2_trans(bf, GROUPS % 16 == 0 || ub < GROUPS ? dc + ub * 8 : zero);
      const T* arow = zero + m0;  // past the last group: zeros (B's row is zero too)
      int fstep = 0;
      if (GROUPS % 16 == 0 || ua < GROUPS) {
        const int a = ua * 8 / TW, b = ua * 8 % TW;
        arow = xc + a * q.s[1] * l.cms + b + m0;
        fstep = q.dil[1] * l.cms;
      }
#pragma unroll
      for (int fy = 0; fy < FY; ++fy) {
        uint32_t af[4];
        ldsm_x4_trans(af, arow + fy * fstep);
        mma16816(acc[c][fy], af, bf);
      }
    }
  }
}

// The weights among the warp's accumulators into the block's sums: tap fx of a filter row is the diagonal
// sum over v of C[fx x dilation + v][v]. Each C goes through the warp's tile ctile (C[m][v] sits in lane
// (m % 8) * 4 + v / 2, element (m / 8) * 2 + v % 2), and lane fx adds its diagonal: one shared-memory atomic
// per weight (atomics straight from the fragments would collide 8-fold on each weight).
__device__ __forceinline__ void reduce_rows(const DirectParams& p, float* red, float* ctile, int j0, int fz,
                                            const float (&acc)[CPW][FY][4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, dx = p.q.dil[2];
#pragma unroll
  for (int c = 0; c < CPW; ++c) {
    const int jl = warp + c * NWARPS;
#pragma unroll
    for (int fy = 0; fy < FY; ++fy) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ctile[(lane / 4 + 8 * (e / 2)) * 8 + 2 * (lane % 4) + e % 2] = acc[c][fy][e];
      __syncwarp();
      if (lane < FX && j0 + jl < p.lanes) {
        float sum = 0.0f;
#pragma unroll
        for (int v = 0; v < 8; ++v) sum += ctile[(lane * dx + v) * 8 + v];
        atomicAdd(&red[(fz * PLANE_TAPS + fy * FX + lane) * BN + jl], sum);
      }
      __syncwarp();
    }
  }
}
