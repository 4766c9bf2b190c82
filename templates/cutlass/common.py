"""What the cutlass families' templates share: C++ types of our dtypes and the values every GEMM or conv template
sees (the _common.j2 / _epilogue.j2 and _conv_common.j2 partials)."""
from tiledispatch import backends
from tiledispatch.spec.dtypes import dtype

# our dtype names -> CUTLASS element types (sm80 reads fp32 operands as tf32)
GEMM_CTYPE = {
    "fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t", "fp32": "float", "int8": "int8_t",
    "int32": "int32_t", "fp8e4m3": "cutlass::float_e4m3_t", "fp8e5m2": "cutlass::float_e5m2_t",
}
LAYOUT = {"r": "cutlass::layout::RowMajor", "c": "cutlass::layout::ColumnMajor"}
# conv kernels of our own: CUDA types, and the mma.sync operand type names
CONV_CTYPE = {"fp16": "__half", "bf16": "__nv_bfloat16", "fp32": "float"}
MMA_TYPE = {"fp16": "f16", "bf16": "bf16"}


def arch(key) -> dict:
    return backends.get("cutlass").archs[key.arch]


def extra(key, name: str):
    return backends.get("cutlass").extra(key, name)


def gemm_context(key) -> dict:
    """The ABI plumbing and epilogue of both GEMM families."""
    sig = key.signature
    int_out = dtype(sig.dtype_c).kind == "int"
    return {
        "ctype": {role: GEMM_CTYPE[getattr(sig, f"dtype_{role}")] for role in ("a", "b", "c", "acc")},
        "code": {role: dtype(getattr(sig, f"dtype_{role}")).code for role in ("a", "b", "c")},
        "layout_tag": {role: LAYOUT[getattr(sig, f"layout_{role}")] for role in ("a", "b", "c")},
        # elements per 16-byte access: TMA and cp.async need 16-byte aligned rows and pointers
        "align": {role: 16 // dtype(getattr(sig, f"dtype_{role}")).itemsize for role in ("a", "b", "c")},
        # the epilogue computes in double for int32 output so results stay exact past 2^24
        "compute": "double" if int_out else "float",
        "int_out": int_out,
        "residuals": list(range(sig.epilogue.residuals)),
    }


def conv_context(key) -> dict:
    """What _conv_common.j2 reads."""
    sig = key.signature
    return {
        "ctype": CONV_CTYPE[sig.dtype_a],
        "code": dtype(sig.dtype_a).code,
        "smem_limit": arch(key)["smem_bytes"],
        "direction": sig.direction,
    }
