"""The cutlass backend: CUTLASS 3.x collective-builder GEMMs (sm90a), 2.x universal GEMMs (sm80), CUTLASS 3.x's
SM90 dense convolution and grouped-convolution kernels of the project's own, built with nvcc against the headers
of the nvidia-cutlass wheel.

What the generic key fields mean here (each family's module says more about its own kernels):
  tile       CTA tile [m, n, k] in elements
  warps      math (consumer) warps along m, n, k. sm90a: a warpgroup is 4 warps stacked along m;
             tma_ws_cooperative runs 2 consumer warpgroups on one tile ([8, 1, 1]), tma_ws_pingpong 1 per tile,
             two alternating ([4, 1, 1]). The producer warpgroup is not counted. sm80: warps of the CTA; the warp
             tile is tile / warps.
  mma        one tensor-core instruction [m, n, k]. sm90a: one warpgroup GMMA, [64, tile_n, 32 bytes of K] (the
             collective builder issues the widest GMMA the tile allows; the rule checks the key says so). sm80:
             mma.sync 16x8x16 (16-bit), 16x8x8 (tf32), 16x8x32 (int8).
  pipeline   sm90a GEMM: tma_ws_cooperative | tma_ws_pingpong (TMA loads, warp-specialized producer and
             consumers, TMA epilogue); sm80 GEMM: multistage (cp.async software pipeline); conv: direct,
             direct_mma, implicit_gemm, tma_ws_conv; layernorm: rows, rows_loop (layernorm/__init__.py);
             maxpool: window (maxpool/__init__.py).
  scheduler  sm90a: persistent (persistent tile scheduler) | stream_k (stream-K; with split_k > 1 a fixed split-K
             through the same scheduler); sm80 and conv: data_parallel (one CTA per tile). Raster order and swizzle
             are run-time parameters (ABI params[0], params[1]), not fields.
  cluster    thread-block cluster (sm90a), TMA multicast across it.
  stages     main-loop smem stages; 0 = as many as fit next to the epilogue (sm90a: the builder's carve-out; sm80:
             the family picks, gemm_sm80).
  fp32       means fp32 storage with tf32 tensor-core math (and fp32 accumulation).
"""
from tiledispatch.backends import register
from tiledispatch.drivers import CudaDriver

BACKEND = register(
    "cutlass", __path__,
    device="cuda",
    auto_priority=20,  # backend=auto prefers cutlass where nvcc, the headers and a GPU are present
    # cc: the compute capability the arch is built for (a device of another one is not detected as it), ptx: the
    # kernels also carry its PTX, so newer GPUs run them (JIT-compiled by the driver); gencode: nvcc's -gencode;
    # smem_bytes: dynamic shared memory a CTA may opt into; sm_smem_bytes: an SM's, shared by its resident CTAs
    # (1 KiB of it reserved per CTA); compute_units: SMs (H100 SXM, A100); sm_flops_per_byte: fp16 tensor flops one
    # SM does while the whole GPU moves one byte of memory (sm90a: ~5.6 TFLOP/s per SM reached by the conv kernels
    # over ~2.8 TB/s), the split cost model of tma_ws_conv bwd_weight (conv_tma_ws)
    archs={
        "sm90a": {"cc": "9.0", "gencode": "arch=compute_90a,code=sm_90a", "smem_bytes": 232448,
                  "sm_smem_bytes": 233472, "compute_units": 132, "sm_flops_per_byte": 2.0},
        "sm80": {"cc": "8.0", "ptx": True, "gencode": "arch=compute_80,code=[sm_80,compute_80]", "smem_bytes": 166912,
                 "sm_smem_bytes": 167936, "compute_units": 108},
    },
    pipeline=["tma_ws_cooperative", "tma_ws_pingpong", "multistage", "direct", "direct_mma", "implicit_gemm",
              "tma_ws_conv", "rows", "rows_loop", "window"],
    scheduler=["persistent", "stream_k", "data_parallel"],
    # extra key fields (cutlass.<name>); what each means: the module of the family that reads it
    extras={
        "fp8_fast_accum": {"type": "bool", "default": False},  # gemm_sm90
        "align": {"type": "int", "default": 0},                # gemm_sm80 (low-alignment kernels, also on sm90a),
                                                               # conv implicit_gemm (1: generic, 4: 8-byte chunks)
        "cpg": {"type": "int", "default": 0},                  # conv_direct
        "kpg": {"type": "int", "default": 0},                  # conv_direct
        "fx": {"type": "int", "default": 0},                   # conv_direct
        "fy": {"type": "int", "default": 0},                   # conv_direct
        "occupancy": {"type": "int", "default": 0},            # conv_direct, conv_tma_ws
        "rows": {"type": "int", "default": 0},                 # conv_direct (direct_mma bwd_weight)
    },
    # validation: max ||out - ref|| / ||ref|| per output dtype (fp32: tf32 math)
    tolerance={"fp16": 2.0e-3, "bf16": 1.0e-2, "fp32": 5.0e-3, "int32": 1.0e-6},
    selection={"intensity_knee": 96},  # analytic ranker: tile intensity mn / (m + n) where efficiency saturates
    driver=CudaDriver(),
)
