"""cutlass GEMM on sm80: CUTLASS 2.x universal GEMM with the epilogue visitor tree, pipeline multistage (cp.async
software pipeline), one CTA per tile (scheduler data_parallel); mma.sync 16x8x16 (16-bit), 16x8x8 (tf32), 16x8x32
(int8). The kernels carry compute_80 PTX, so newer GPUs can run them."""
from tiledispatch.spec.dtypes import dtype

from .. import common


def claims(key) -> bool:
    return key.signature.op == "gemm" and key.arch == "sm80"


def templates(key) -> list[str]:
    return ["gemm_sm80.cu.j2", "_common.j2", "_epilogue.j2"]


def context(key) -> dict:
    sig, alg = key.signature, key.algorithm
    ctx = common.gemm_context(key)
    if sig.dtype_a == "fp32":
        ctx["ctype"] = {**ctx["ctype"], "a": "cutlass::tfloat32_t", "b": "cutlass::tfloat32_t"}  # the mma reads tf32
    ctx.update(stages=stages(key), warp_tile=[t // w for t, w in zip(alg.tile, alg.warps)],
               math_op="cutlass::arch::OpMultiplyAddSaturate" if sig.dtype_a == "int8"
               else "cutlass::arch::OpMultiplyAdd")
    return ctx


def stage_bytes(key) -> int:
    """Shared memory of one main-loop stage: an A and a B tile."""
    sig, (tm, tn, tk) = key.signature, key.algorithm.tile
    return (tm * dtype(sig.dtype_a).itemsize + tn * dtype(sig.dtype_b).itemsize) * tk


def stages(key) -> int:
    """The key's stages; 0 (auto): as many as fit in shared memory, 3..4 (more buys nothing on A100)."""
    return key.algorithm.stages or max(3, min(4, common.arch(key)["smem_bytes"] // stage_bytes(key)))


def smem_bytes(key) -> int:
    """Shared memory the rules bound (rule cutlass.sm80_smem): the key's stages, 3 for auto."""
    return (key.algorithm.stages or 3) * stage_bytes(key)
