"""cutlass backend, grouped convolution: which templates a conv key uses and the values they see.

The kernels are the project's own CUDA (templates/cutlass/conv_*.cu.j2), not CUTLASS instantiations:
pipeline `direct` (CUDA cores, shared-memory halos, narrow groups and depthwise) and `implicit_gemm`
(mma.sync tensor cores, dense and wide groups). See rules/cutlass.yaml for what the key fields mean.
"""
from __future__ import annotations

from ..spec import rules
from ..spec.dtypes import dtype
from ..spec.key import KernelKey

_CTYPE = {"fp16": "__half", "bf16": "__nv_bfloat16", "fp32": "float"}
_MMA_TYPE = {"fp16": "f16", "bf16": "bf16"}
DEFAULT_STAGES = 3


def templates(key: KernelKey) -> list[str]:
    sig, alg = key.signature, key.algorithm
    if alg.pipeline == "direct":
        main = "conv_direct_bwd_weight.cu.j2" if sig.direction == "bwd_weight" else "conv_direct.cu.j2"
        return [main, "_conv_common.j2", "_conv_direct.j2"]
    return ["conv_igemm.cu.j2", "_conv_common.j2"]


def context(key: KernelKey) -> dict:
    sig, alg = key.signature, key.algorithm
    ctx = {
        "ctype": _CTYPE[sig.dtype_a],
        "code": dtype(sig.dtype_a).code,
        "smem_limit": rules.archs("cutlass")[key.arch]["smem_bytes"],
        "direction": sig.direction,
    }
    if alg.pipeline == "direct":
        # lanes per group (LG) and reduction channels per group (RG), 0 = read at run time
        cpg, kpg = alg.extra("cutlass.cpg", 0), alg.extra("cutlass.kpg", 0)
        lg, rg = (cpg, kpg) if sig.direction == "bwd_data" else (kpg, cpg)
        ctx.update(threads=alg.warps[0] * 32, lg=lg, rg=rg)
    else:
        ctx.update(threads=alg.warps[0] * alg.warps[1] * 32, stages=alg.stages or DEFAULT_STAGES,
                   mma_type=_MMA_TYPE[sig.dtype_a])
    return ctx
