"""The ck_tile backend: CK Tile GEMM and grouped-convolution sources for AMD CDNA GPUs (gfx90a / gfx942 / gfx950),
built with hipcc / amdclang++ (toolchain.py; without ROCm, a compile check: scons check=1).

What the generic key fields mean here:
  tile       block tile [m, n, k] of the (implicit) GEMM
  warps      waves per block along m, n, k (a wave is 64 lanes on every arch below)
  mma        the MFMA warp tile [m, n, k] one wave computes per instruction group (CK "warp tile")
  pipeline   mem | compv3 | compv4 (GemmPipelineAgBgCr{Mem,CompV3,CompV4}; compv4 double-buffers LDS)
  scheduler  intrawave | interwave; `default` (CK's Auto) is only used by pipelines we do not generate
The arch facts come from the CK Tile headers of the pinned snapshot (amd-aiter 0.1.7.post2.dev18, 2025-11):
warp_gemm_dispatcher.hpp (which warp tiles exist), warp_gemm_attribute_mfma_impl.hpp (which MFMA each arch
executes; an instruction an arch lacks compiles to nothing there, so the compile check cannot catch it and these
tables must), config.hpp (CK_TILE_USE_OCP_FP8: OCP fp8 on gfx950, FNUZ before), and the seed system's arch table
(legal wave layouts, LDS per arch).
"""
from tiledispatch.backends import register
from tiledispatch.drivers import HipDriver

BACKEND = register(
    "ck_tile", __path__,
    device="hip",
    auto_priority=10,  # backend=auto prefers a GPU backend whose toolchain and device are present
    # warp_tiles: "<a>_<b>_<acc>" -> legal MFMA warp tiles; fp8_format: CK's fp8_t / bf8_t on the arch (gfx90a has
    # no fp8 MFMA: emulated through fp32 MFMA); int8_mfma false: CK's fallback passes the int32 accumulators through
    # an fp32 MFMA by bit reinterpretation, which compiles and returns float bit patterns
    archs={"gfx90a": {"warp_size": 64,
                "lds_bytes": 65536,
                "fp8_format": "fnuz",
                "int8_mfma": False,
                "wave_layouts": [[1, 4, 1], [2, 2, 1], [4, 1, 1]],
                "warp_tiles": {"fp32_fp32_fp32": [[16, 16, 4], [16, 16, 16]],
                               "fp16_fp16_fp32": [[32, 32, 8],
                                                  [32, 32, 16],
                                                  [16, 16, 16],
                                                  [16, 16, 32],
                                                  [4, 64, 16],
                                                  [64, 4, 16]],
                               "bf16_bf16_fp32": [[32, 32, 8],
                                                  [32, 32, 16],
                                                  [16, 16, 16],
                                                  [16, 16, 32],
                                                  [4, 64, 16],
                                                  [64, 4, 16]]}},
     "gfx942": {"warp_size": 64,
                "lds_bytes": 65536,
                "fp8_format": "fnuz",
                "int8_mfma": True,
                "wave_layouts": [[1, 1, 1], [1, 2, 1], [1, 4, 1], [2, 1, 1], [2, 1, 2], [2, 2, 1], [4, 1, 1]],
                "warp_tiles": {"fp32_fp32_fp32": [[16, 16, 4], [16, 16, 16]],
                               "fp16_fp16_fp32": [[32, 32, 8],
                                                  [32, 32, 16],
                                                  [16, 16, 16],
                                                  [16, 16, 32],
                                                  [4, 64, 16],
                                                  [64, 4, 16]],
                               "bf16_bf16_fp32": [[32, 32, 8],
                                                  [32, 32, 16],
                                                  [16, 16, 16],
                                                  [16, 16, 32],
                                                  [4, 64, 16],
                                                  [64, 4, 16]],
                               "int8_int8_int32": [[32, 32, 16], [16, 16, 32]]}},
     "gfx950": {"warp_size": 64,
                "lds_bytes": 163840,
                "fp8_format": "ocp",
                "int8_mfma": True,
                "wave_layouts": [[1, 1, 1],
                                 [1, 2, 1],
                                 [1, 4, 1],
                                 [2, 1, 1],
                                 [2, 1, 2],
                                 [2, 2, 1],
                                 [4, 1, 1],
                                 [8, 2, 1],
                                 [4, 4, 1]],
                "warp_tiles": {"fp32_fp32_fp32": [[16, 16, 4], [16, 16, 16]],
                               "fp16_fp16_fp32": [[32, 32, 8],
                                                  [32, 32, 16],
                                                  [16, 16, 16],
                                                  [16, 16, 32],
                                                  [4, 64, 16],
                                                  [64, 4, 16]],
                               "bf16_bf16_fp32": [[32, 32, 8],
                                                  [32, 32, 16],
                                                  [16, 16, 16],
                                                  [16, 16, 32],
                                                  [4, 64, 16],
                                                  [64, 4, 16]],
                               "int8_int8_int32": [[32, 32, 16], [16, 16, 32]],
                               "fp8e4m3_fp8e4m3_fp32": [[32, 32, 16],
                                                        [32, 32, 32],
                                                        [16, 16, 32],
                                                        [16, 16, 64],
                                                        [16, 16, 128],
                                                        [32, 32, 64]],
                               "fp8e5m2_fp8e5m2_fp32": [[32, 32, 16],
                                                        [32, 32, 32],
                                                        [16, 16, 32],
                                                        [16, 16, 64],
                                                        [16, 16, 128],
                                                        [32, 32, 64]],
                               "fp8e4m3_fp8e5m2_fp32": [[32, 32, 16],
                                                        [32, 32, 32],
                                                        [16, 16, 32],
                                                        [16, 16, 128],
                                                        [32, 32, 64]],
                               "fp8e5m2_fp8e4m3_fp32": [[32, 32, 16], [16, 16, 128], [32, 32, 64]]}}},
    pipeline=["mem", "compv3", "compv4"],
    scheduler=["intrawave", "interwave", "default"],
    # vector_a / _b / _c: conv only, elements per vector access of A / B / C; 0 = 16 bytes
    extras={"epilogue": {"type": "enum", "values": ["default", "cshuffle"], "default": "cshuffle"},
     "pad_m": {"type": "bool", "default": False},
     "pad_n": {"type": "bool", "default": False},
     "pad_k": {"type": "bool", "default": False},
     "persistent": {"type": "bool", "default": False},
     "vector_a": {"type": "int", "default": 0},
     "vector_b": {"type": "int", "default": 0},
     "vector_c": {"type": "int", "default": 0}},
    tolerance={},   # no validation on a device yet: validation.tolerance says so
    selection={},
    driver=HipDriver(),
)
