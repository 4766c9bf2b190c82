"""The cpu backend: portable C++17 + OpenMP kernels, built with g++ (or $CXX).

What the generic key fields mean here:
  tile      the cache block [mc, nc, kc]: A panels of mc x kc and B panels of kc x nc are packed
  mma       the register micro-tile [mr, nr, 1] the inner kernel computes
  pipeline  packed: A and B packed into contiguous panels before the micro-kernel runs (GEMM, conv);
            direct: conv only, the channels of all groups as the vector lanes
            rows: layernorm only, rows split over threads (tile m rows at a time)
            window: maxpool only, output pixels split over threads (tile m at a time), channels as the lanes
Fields the backend has no use for are fixed (rules.yaml); a kernel set that sets them otherwise is refused.
"""
from tiledispatch.backends import register
from tiledispatch.drivers import CpuDriver

BACKEND = register(
    "cpu", __path__,
    device="cpu",
    auto_priority=0,
    # march: the compiler's -march; vector_bytes: the widest vector register; cpu_flags: the /proc/cpuinfo flags
    # the arch needs (x86-64 micro-architecture levels, abridged); listed from the least to the most capable
    archs={
        "generic": {"march": "x86-64", "vector_bytes": 16, "cpu_flags": []},
        "x86v3": {"march": "x86-64-v3", "vector_bytes": 32, "cpu_flags": ["avx2", "fma", "f16c", "bmi2", "movbe"]},
        "x86v4": {"march": "x86-64-v4", "vector_bytes": 64,
                  "cpu_flags": ["avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                                "avx512cd"]},
    },
    pipeline=["packed", "direct", "rows", "window"],
    scheduler=["default"],
    extras={},
    tolerance={"fp32": 1.0e-5, "fp16": 2.0e-3, "bf16": 1.0e-2, "int32": 1.0e-6},
    # analytic ranker: tile intensity (mn / (m + n)) where efficiency saturates
    selection={"intensity_knee": 64},
    driver=CpuDriver(),
)
