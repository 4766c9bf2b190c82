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
        "size": {role: dtype(getattr(sig, f"dtype_{role}")).itemsize for role in ("a", "b", "c")},
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


def gemm_alignment_refusal(problem, key, access: dict, ld=None):
    """The alignment checks of _common.j2's check() for a GEMM whose A, B and C / D are read / written in accesses
    of access[role] elements: each operand's contiguous extent, leading stride and batch stride must be multiples
    of it. ld: leading strides in elements per role ("a", "b", "c"; missing ones dense). Why the kernel refuses the
    problem, or None. (Pointers are taken as aligned to the access: a buffer's offset is the caller's.)"""
    ld = ld or {}
    layout = key.signature.layout
    # (role, rows, cols, layout letter); C / D row-major on this backend
    for role, rows, cols, letter in (("a", problem.m, problem.k, layout[0]), ("b", problem.k, problem.n, layout[1]),
                                     ("c", problem.m, problem.n, "r")):
        unit = access[role]
        contiguous, other = (cols, rows) if letter == "r" else (rows, cols)
        stride = ld.get(role, contiguous)
        name = {"a": "A", "b": "B", "c": "D"}[role]
        if contiguous % unit:
            return f"{name}: contiguous extent {contiguous} is not a multiple of {unit} elements"
        if other > 1 and stride % unit:
            return f"{name}: leading stride {stride} is not a multiple of {unit} elements"
        if problem.batch > 1 and (stride * other) % unit:
            return f"{name}: batch stride {stride * other} is not a multiple of {unit} elements"
    return None
