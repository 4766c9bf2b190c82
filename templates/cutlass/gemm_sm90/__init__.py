"""cutlass GEMM on sm90a: CUTLASS 3.x collective builders (TMA loads, GMMA, warp-specialized producer and
consumers, TMA epilogue with the fused epilogue tree), pipelines tma_ws_cooperative (2 consumer warpgroups on
one tile) and tma_ws_pingpong (1 per tile, two alternating), tile schedulers persistent and stream_k.

Extra field cutlass.fp8_fast_accum (fp8 only): accumulate in the tensor core's reduced-precision fp32 without
periodic promotion (the *FP8FastAccum kernel schedules). Faster, slightly less accurate on long K.
"""
from tiledispatch.spec.dtypes import dtype

from .. import common

_SCHEDULE = {  # pipeline -> (kernel schedule, epilogue schedule)
    "tma_ws_cooperative": ("cutlass::gemm::KernelTmaWarpSpecializedCooperative",
                           "cutlass::epilogue::TmaWarpSpecializedCooperative"),
    "tma_ws_pingpong": ("cutlass::gemm::KernelTmaWarpSpecializedPingpong", "cutlass::epilogue::TmaWarpSpecialized"),
}
_TILE_SCHEDULER = {"persistent": "cutlass::gemm::PersistentScheduler", "stream_k": "cutlass::gemm::StreamKScheduler"}


def claims(key) -> bool:
    # multistage kernels built for sm90a (the low-alignment fallbacks) are gemm_sm80's
    return key.signature.op == "gemm" and key.arch == "sm90a" and key.algorithm.pipeline != "multistage"


def templates(key) -> list[str]:
    return ["gemm_sm90.cu.j2", "_common.j2", "_epilogue.j2"]


def context(key) -> dict:
    alg = key.algorithm
    kernel_schedule, epilogue_schedule = _SCHEDULE[alg.pipeline]
    if common.extra(key, "fp8_fast_accum"):
        kernel_schedule += "FP8FastAccum"
    return {**common.gemm_context(key), "kernel_schedule": kernel_schedule, "epilogue_schedule": epilogue_schedule,
            "tile_scheduler": _TILE_SCHEDULER[alg.scheduler], **_default_params(key)}


def _default_params(key) -> dict:
    """The tile order a kernel uses when the caller leaves ABI params 0 / 1 at 0.

    Raster along M when a tile is at least as wide as tall: neighbouring CTAs then share the larger B
    panel (CUTLASS's own heuristic looks at tile counts only). 64-row tiles without a cluster also
    group CTAs in bands of 2 (swizzle). Measured on the H100 (bench/sweeps/param_sweep.py): +20-55% for the
    64-row pingpong tiles on large and long-K problems, neutral within noise for the large tiles.
    """
    tm, tn, _ = key.algorithm.tile
    small = tm == 64 and key.algorithm.cluster == (1, 1, 1)
    return {"default_raster": "AlongM" if tn >= tm else "Heuristic", "default_swizzle": 2 if small else 1}


def smem_bytes(key) -> int:
    """Shared memory of one CTA (rule cutlass.sm90_smem): the main-loop stages of A and B tiles, the TMA
    epilogue's C/D buffers (up to 4 epilogue subtiles of 128x32 cooperative / 64x32 pingpong), the bias row and
    the barriers."""
    sig, alg = key.signature, key.algorithm
    tm, tn, tk = alg.tile
    a, b, c = (dtype(d).itemsize for d in (sig.dtype_a, sig.dtype_b, sig.dtype_c))
    rows = 128 if alg.pipeline == "tma_ws_cooperative" else 64
    return (alg.stages or 2) * (tm * a + tn * b) * tk + 4 * min(tm, rows) * min(tn, 32) * c + tn * c + 2048


def refusal(problem, key, ld=None):
    """Why the kernel's td_can_run refuses the problem, None when it runs it (_common.j2's alignment checks: TMA
    reads and writes 16-byte aligned rows of every operand); ld as in common.gemm_alignment_refusal."""
    sig = key.signature
    access = {role: 16 // dtype(getattr(sig, f"dtype_{role}")).itemsize for role in ("a", "b", "c")}
    return common.gemm_alignment_refusal(problem, key, access, ld)
