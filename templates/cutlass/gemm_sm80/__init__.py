"""cutlass GEMM on sm80: CUTLASS 2.x universal GEMM with the epilogue visitor tree, pipeline multistage (cp.async
software pipeline), one CTA per tile (scheduler data_parallel); mma.sync 16x8x16 (16-bit), 16x8x8 (tf32), 16x8x32
(int8). The kernels carry compute_80 PTX, so newer GPUs can run them.

Extra field cutlass.align (the low-alignment kernels that let every shape run, DESIGN.md invariant 10): A and B
are read in accesses of `align` elements (0, the default: 16 bytes), and C, D, the residuals and the bias element
by element, so any N and any leading dimension of C / D runs. cp.async copies 4, 8 or 16 bytes: an access below
4 bytes (fp16 / bf16 align 1) takes CUTLASS's two-stage pipelined main loop (stages 2: global -> registers ->
shared memory), which moves single elements. These kernels are also built for sm90a (same source, compiled for
sm_90a), where the TMA kernels need 16-byte aligned rows; the ranker puts them last (cost_factor)."""
from tiledispatch.spec.dtypes import dtype

from .. import common


def claims(key) -> bool:
    return key.signature.op == "gemm" and (key.arch == "sm80" or key.algorithm.pipeline == "multistage")


def templates(key) -> list[str]:
    return ["gemm_sm80.cu.j2", "_common.j2", "_epilogue.j2"]


def context(key) -> dict:
    sig, alg = key.signature, key.algorithm
    ctx = common.gemm_context(key)
    if sig.dtype_a == "fp32":
        ctx["ctype"] = {**ctx["ctype"], "a": "cutlass::tfloat32_t", "b": "cutlass::tfloat32_t"}  # the mma reads tf32
    if align(key):
        ctx["align"] = {"a": align(key), "b": align(key), "c": 1}
    ctx.update(stages=stages(key), warp_tile=[t // w for t, w in zip(alg.tile, alg.warps)],
               math_op="cutlass::arch::OpMultiplyAddSaturate" if sig.dtype_a == "int8"
               else "cutlass::arch::OpMultiplyAdd")
    return ctx


def align(key) -> int:
    """Elements per access of A and B (cutlass.align); 0: 16-byte accesses of every operand."""
    return common.extra(key, "align")


def access_elements(key) -> dict:
    """Elements per global access of A, B and C (D, the residuals and the bias like C)."""
    if align(key):
        return {"a": align(key), "b": align(key), "c": 1}
    return {role: 16 // dtype(getattr(key.signature, f"dtype_{role}")).itemsize for role in ("a", "b", "c")}


def refusal(problem, key, ld=None):
    """Why the kernel's td_can_run refuses the problem (dense operands, or leading dimensions `ld` = {"a": .., "b":
    .., "c": ..} in elements), None when it runs it: the same alignment checks as _common.j2 (16-byte pointers are
    assumed; a buffer's offset is the caller's)."""
    return common.gemm_alignment_refusal(problem, key, access_elements(key), ld)


def cost_factor(key) -> float:
    """A low-alignment kernel (cutlass.align) is the fallback where the 16-byte kernels cannot run (element-wise
    stores of C / D, and on sm90a mma.sync instead of GMMA): x8, after every 16-byte kernel of the set; narrower
    A / B accesses rank later still (x2 per halving below 16 bytes), so each problem takes the widest that runs."""
    if not align(key):
        return 1.0
    access = align(key) * dtype(key.signature.dtype_a).itemsize
    return 8.0 * 16 / access


def stage_bytes(key) -> int:
    """Shared memory of one main-loop stage: an A and a B tile."""
    sig, (tm, tn, tk) = key.signature, key.algorithm.tile
    return (tm * dtype(sig.dtype_a).itemsize + tn * dtype(sig.dtype_b).itemsize) * tk


def stages(key) -> int:
    """The key's stages; 0 (auto): as many as fit in shared memory, 3..4 (more buys nothing on A100)."""
    if key.algorithm.stages == 0 and align(key) and align(key) * dtype(key.signature.dtype_a).itemsize < 4:
        return 2  # accesses below 4 bytes: the two-stage pipelined main loop (no cp.async)
    return key.algorithm.stages or max(3, min(4, common.arch(key)["smem_bytes"] // stage_bytes(key)))


def smem_bytes(key) -> int:
    """Shared memory the rules bound (rule cutlass.sm80_smem): the key's stages, 3 for auto."""
    return (key.algorithm.stages or 3) * stage_bytes(key)
