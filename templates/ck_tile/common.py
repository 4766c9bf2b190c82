"""What the ck_tile families' templates share: the symbol map from our names to CK Tile C++ (types, layouts,
pipeline and scheduler classes) and the render context of a GEMM or a grouped-convolution key."""
from tiledispatch import backends
from tiledispatch.spec.dtypes import dtype

# ---- symbol map: our names -> CK Tile C++ ------------------------------------------------------------
_CK_TYPE = {
    "fp16": "ck_tile::half_t", "bf16": "ck_tile::bf16_t", "fp32": "float", "int8": "ck_tile::int8_t",
    "int32": "ck_tile::int32_t",
    # CK's fp8_t / bf8_t are OCP on gfx950 and FNUZ before it (rule ck_tile.fp8_encoding keeps them apart)
    "fp8e4m3": "ck_tile::fp8_t", "fp8e5m2": "ck_tile::bf8_t",
}
_LAYOUT = {"r": "ck_tile::tensor_layout::gemm::RowMajor", "c": "ck_tile::tensor_layout::gemm::ColumnMajor"}
_PIPELINE = {  # ours -> (pipeline class, its base class with the tail dispatch)
    "mem": ("GemmPipelineAgBgCrMem", "BaseGemmPipelineAgBgCrMem"),
    "compv3": ("GemmPipelineAgBgCrCompV3", "BaseGemmPipelineAgBgCrCompV3"),
    "compv4": ("GemmPipelineAgBgCrCompV4", "BaseGemmPipelineAgBgCrCompV4"),
}
_DOUBLE_SMEM = {"mem": False, "compv3": False, "compv4": True}   # compv4 ping-pongs two LDS buffers
_SCHEDULER = {"intrawave": "Intrawave", "interwave": "Interwave", "default": "Default"}
# conv tensor layouts per spatial rank: input, weight, output (ck_tile::tensor_layout::convolution)
_CONV_LAYOUTS = {1: ("NWGC", "GKXC", "NWGK"), 2: ("NHWGC", "GKYXC", "NHWGK"), 3: ("NDHWGC", "GKZYXC", "NDHWGK")}
# per direction: which conv tensor is the implicit GEMM's A, B and C (X input, W weight, Y output)
_CONV_ROLES = {"fwd": ("X", "W", "Y"), "bwd_data": ("Y", "W", "X"), "bwd_weight": ("Y", "X", "W")}
_CONV_KERNEL = {"fwd": "GroupedConvolutionForwardKernel", "bwd_data": "GroupedConvolutionBackwardDataKernel",
                "bwd_weight": "GroupedConvolutionBackwardWeightKernel"}
_CONV_HOSTARGS = {"fwd": "GroupedConvFwdHostArgs<>", "bwd_data": "GroupedConvBwdDataHostArgs",
                  "bwd_weight": "GroupedConvBwdWeightHostArgs"}
_CONV_GEMM_TRAITS = {"fwd": "Fwd", "bwd_data": "BwdData", "bwd_weight": "BwdWeight"}
# per direction: the channel count (C or K, per group) each of A / B / C's vector accesses runs along,
# as CK's IsSupportedArgument checks them
_CONV_VECTOR_DIM = {"fwd": ("C", "C", "K"), "bwd_data": ("K", "C", "C"), "bwd_weight": ("K", "C", "C")}


def _extra(key, name: str):
    return backends.get("ck_tile").extra(key, name)


def context(key) -> dict:
    """What _common.j2, _pipeline.j2 and both families' main templates see."""
    sig, alg = key.signature, key.algorithm
    arch = backends.get("ck_tile").archs[key.arch]
    pipeline, base = _PIPELINE[alg.pipeline]
    ctx = {
        "ck_type": {r: _CK_TYPE[getattr(sig, f"dtype_{r}")] for r in ("a", "b", "c", "acc")},
        "dtype_code": {r: dtype(getattr(sig, f"dtype_{r}")).code for r in ("a", "b", "c")},
        "pipeline_class": pipeline, "pipeline_base": base,
        "double_smem": _DOUBLE_SMEM[alg.pipeline],
        "scheduler": _SCHEDULER[alg.scheduler],
        "cshuffle": _extra(key, "epilogue") == "cshuffle",
        "pad": {a: _extra(key, f"pad_{a}") for a in "mnk"},
        "persistent": _extra(key, "persistent"),
        "lds_bytes": arch["lds_bytes"],
        "arch_macro": f"__{key.arch}__",
    }
    if sig.op == "gemm":
        ctx["layout"] = {r: _LAYOUT[getattr(sig, f"layout_{r}")] for r in ("a", "b", "c")}
        ctx["row_major"] = {r: getattr(sig, f"layout_{r}") == "r" for r in ("a", "b", "c")}
    else:
        x, w, y = _CONV_LAYOUTS[sig.spatial_dims]
        dt = {"X": sig.dtype_a, "W": sig.dtype_b, "Y": sig.dtype_c}
        roles = _CONV_ROLES[sig.direction]
        vectors = {}
        for r, role in zip(("a", "b", "c"), roles):
            v = _extra(key, f"vector_{r}")
            vectors[r] = v or 16 // dtype(dt[role]).itemsize
        ctx.update({
            "conv_layout": {"in": x, "wei": w, "out": y},
            "gemm_roles": dict(zip(("a", "b", "c"), roles)),
            "gemm_type": {r: _CK_TYPE[dt[role]] for r, role in zip(("a", "b", "c"), roles)},
            "conv_kernel": _CONV_KERNEL[sig.direction],
            "conv_hostargs": _CONV_HOSTARGS[sig.direction],
            "conv_gemm_traits": _CONV_GEMM_TRAITS[sig.direction],
            "vector": vectors,
            "vector_dim": dict(zip(("a", "b", "c"), _CONV_VECTOR_DIM[sig.direction])),
        })
    return ctx
