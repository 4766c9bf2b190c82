"""What every cpu family's templates see: C++ storage types, dtype codes and vector widths of the key's arch."""
from tiledispatch import backends
from tiledispatch.spec.dtypes import dtype

# storage type of each dtype in generated C++ (fp16 / bf16 are raw bits, converted in the kernel)
CTYPE = {"fp32": "float", "fp16": "uint16_t", "bf16": "uint16_t", "int8": "int8_t", "int32": "int32_t"}


def context(key) -> dict:
    sig = key.signature
    arch = backends.get("cpu").archs[key.arch]
    acc = dtype(sig.dtype_acc)
    return {
        "ctype": {role: CTYPE[getattr(sig, f"dtype_{role}")] for role in ("a", "b", "c", "acc")},
        "code": {role: dtype(getattr(sig, f"dtype_{role}")).code for role in ("a", "b", "c", "acc")},
        # the epilogue computes in double where the output is an integer, so int32 results stay exact
        "ctype_compute": "double" if dtype(sig.dtype_c).kind == "int" else "float",
        "vector_bytes": arch["vector_bytes"],
        "vector_lanes": arch["vector_bytes"] // acc.itemsize,
    }
