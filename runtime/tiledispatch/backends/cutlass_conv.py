"""cutlass backend, convolution: which templates a conv key uses and the values they see.

Pipelines `direct` (CUDA cores, shared-memory halos, narrow groups and depthwise), `direct_mma` (the same
halos and blocks, the taps summed by mma.sync over block-diagonal weights) and `implicit_gemm` (mma.sync
tensor cores, dense and wide groups) are the project's own CUDA (templates/cutlass/conv_*.cu.j2);
`tma_ws_conv` instantiates CUTLASS 3.x's SM90 implicit-GEMM convolution (conv_sm90.cu.j2, groups = 1).
See rules/cutlass.yaml for what the key fields mean.
"""
from __future__ import annotations

from ..spec import rules
from ..spec.dtypes import dtype
from ..spec.key import KernelKey

_CTYPE = {"fp16": "__half", "bf16": "__nv_bfloat16", "fp32": "float"}
_MMA_TYPE = {"fp16": "f16", "bf16": "bf16"}
DEFAULT_STAGES = 3

# tma_ws_conv: CUTLASS names per direction and rank
_CUTLASS_ELEMENT = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
_CUTLASS_OP = {"fwd": "kFprop", "bwd_data": "kDgrad", "bwd_weight": "kWgrad"}
_ACT_LAYOUT = {1: "TensorNWC", 2: "TensorNHWC", 3: "TensorNDHWC"}   # activations, filters (K first) and dY
_WGRAD_OUT_LAYOUT = {1: "TensorKCS", 2: "TensorKCSR", 3: "TensorKCSRT"}  # dW seen as K x (C, filter...)


def templates(key: KernelKey) -> list[str]:
    sig, alg = key.signature, key.algorithm
    if alg.pipeline == "direct":
        main = "conv_direct_bwd_weight.cu.j2" if sig.direction == "bwd_weight" else "conv_direct.cu.j2"
        return [main, "_conv_common.j2", "_conv_direct.j2"]
    if alg.pipeline == "direct_mma":
        if sig.direction == "bwd_weight":
            rows = ["_conv_direct_wgrad_rows.j2"] if alg.extra("cutlass.rows", 0) else []
            return ["conv_direct_bwd_weight.cu.j2", "_conv_common.j2", "_conv_direct.j2", "_conv_direct_wgrad_mma.j2",
                    "_mma_sync.j2"] + rows
        return ["conv_direct.cu.j2", "_conv_common.j2", "_conv_direct.j2", "_conv_direct_mma.j2", "_mma_sync.j2"]
    if alg.pipeline == "tma_ws_conv":
        wgrad = ["_conv_sm90_wgrad.j2", "_conv_sm90_wgrad_abi.j2"] if sig.direction == "bwd_weight" else []
        consumers = ["_conv_sm90_consumers.j2"] if _consumers(key) == 2 and not wgrad else []
        return ["conv_sm90.cu.j2", "_conv_common.j2", "_tma_driver.j2"] + wgrad + consumers
    return ["conv_igemm.cu.j2", "_conv_common.j2", "_mma_sync.j2"]


def context(key: KernelKey) -> dict:
    sig, alg = key.signature, key.algorithm
    ctx = {
        "ctype": _CTYPE[sig.dtype_a],
        "code": dtype(sig.dtype_a).code,
        "smem_limit": rules.archs("cutlass")[key.arch]["smem_bytes"],
        "direction": sig.direction,
    }
    if alg.pipeline in ("direct", "direct_mma"):
        # lanes per group (LG) and reduction channels per group (RG), 0 = read at run time
        cpg, kpg = alg.extra("cutlass.cpg", 0), alg.extra("cutlass.kpg", 0)
        lg, rg = (cpg, kpg) if sig.direction == "bwd_data" else (kpg, cpg)
        # compile-time filter width / height (cutlass.fx / cutlass.fy), 0 = read at run time
        ctx.update(threads=alg.warps[0] * alg.warps[1] * 32, lg=lg, rg=rg, fx=alg.extra("cutlass.fx", 0),
                   fy=alg.extra("cutlass.fy", 0), tc=alg.pipeline == "direct_mma", mma_type=_MMA_TYPE.get(sig.dtype_a),
                   rows=alg.extra("cutlass.rows", 0))
        # bwd_weight's register window: pixels along W a thread takes at a time (the largest of 4, 2, 1 dividing
        # the tile width tile[0])
        ctx.update(pxw=next(n for n in (4, 2, 1) if alg.tile[0] % n == 0))
    elif alg.pipeline == "tma_ws_conv":
        ctx.update(_sm90_context(key))
    else:
        ctx.update(threads=alg.warps[0] * alg.warps[1] * 32, stages=alg.stages or DEFAULT_STAGES,
                   mma_type=_MMA_TYPE[sig.dtype_a], rows=0)
    return ctx


def _sm90_context(key: KernelKey) -> dict:
    """CUTLASS types of a tma_ws_conv key: the operator, layouts, tile and epilogue per direction and rank."""
    sig, alg = key.signature, key.algorithm
    wgrad = sig.direction == "bwd_weight"
    tm, tn, tk = alg.tile
    consumers = _consumers(key)
    return {
        "element": _CUTLASS_ELEMENT[sig.dtype_a],
        "conv_op": "cutlass::conv::Operator::" + _CUTLASS_OP[sig.direction],
        "act_layout": "cutlass::layout::" + _ACT_LAYOUT[sig.spatial_dims],
        "out_layout": "cutlass::layout::" + (_WGRAD_OUT_LAYOUT if wgrad else _ACT_LAYOUT)[sig.spatial_dims],
        # the K mode of the tile is a rank-1 tuple (CUTLASS tiles the hierarchical (C, S, R, T) mode with it);
        # so is bwd_weight's N mode, which is (C, S, R, T) there
        "tile_shape": f"cute::Shape<cute::_{tm}, {f'cute::Shape<cute::_{tn}>' if wgrad else f'cute::_{tn}'}, "
                      f"cute::Shape<cute::_{tk}>>",
        # dY / dW of bwd_weight are small next to its reduction; CUTLASS's own wgrad kernels store directly
        # two consumer warpgroups share each epilogue subtile (128 rows, both warpgroups' 64-row slices)
        "epilogue_schedule": "cutlass::epilogue::" + ("NoSmemWarpSpecialized" if wgrad else
                                                      "TmaWarpSpecializedCooperative" if consumers == 2 else
                                                      "TmaWarpSpecialized"),
        "consumers": consumers,
        "align": 16 // dtype(sig.dtype_a).itemsize,
        # bwd_weight writes fp32 partial dW per k range (the workspace) from our persistent kernel body
        # (wgrad_split), then finalize_splits sums and converts them into W
        "out_element": "ElementOut" if wgrad else "Element",
        "out_align": "OUT_ALIGN" if wgrad else "ALIGN",
        "launched_kernel": "wgrad_split" if wgrad else "conv_kernel",
        "occupancy": alg.extra("cutlass.occupancy", 0) or 1,
        "sm_smem_bytes": rules.archs("cutlass")[key.arch]["sm_smem_bytes"],
        "compute_units": rules.archs("cutlass")[key.arch]["compute_units"],
    } | (_wgrad_split_context(key) if wgrad else {})


def _consumers(key: KernelKey) -> int:
    """Consumer warpgroups of a tma_ws_conv tile: warps [4, 1, 1] one (CUTLASS's kernel body), [8, 1, 1] two
    (fwd / bwd_data: templates/cutlass/_conv_sm90_consumers.j2; bwd_weight: its split body)."""
    return key.algorithm.warps[0] // 4


def _wgrad_split_context(key: KernelKey) -> dict:
    """bwd_weight's split cost model (rules: archs.sm_flops_per_byte, selection.runtime_splits)."""
    return {"sm_flops_per_byte": rules.archs("cutlass")[key.arch]["sm_flops_per_byte"],
            "epilogue_ktiles": rules.runtime_split(key)["epilogue_ktiles"]}
