"""One codec table for every element type: name, size, numpy dtype, ABI code.

Everything that needs a byte size, a numpy dtype or an ABI code reads it here, so no module keeps
its own table (the seed system passed bf16 data as fp16 because two tables disagreed).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str          # our spelling, used in keys, YAML and names
    code: int          # value of td_dtype in tiledispatch_abi.h
    itemsize: int      # bytes per element
    kind: str          # "float" or "int"
    numpy_name: str    # numpy / ml_dtypes dtype name

    @property
    def numpy(self) -> np.dtype:
        return numpy_dtype(self.name)


_TABLE = (
    DType("fp32", 1, 4, "float", "float32"),
    DType("fp16", 2, 2, "float", "float16"),
    DType("bf16", 3, 2, "float", "bfloat16"),
    DType("int8", 4, 1, "int", "int8"),
    DType("int32", 5, 4, "int", "int32"),
    DType("fp8e4m3", 6, 1, "float", "float8_e4m3fn"),
    DType("fp8e5m2", 7, 1, "float", "float8_e5m2"),
    DType("fp64", 8, 8, "float", "float64"),
)

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}
BY_CODE: dict[int, DType] = {d.code: d for d in _TABLE}


def dtype(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(DTYPES)})") from None


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for one of our dtypes; bf16 and fp8 come from ml_dtypes."""
    numpy_name = dtype(name).numpy_name
    if hasattr(np, numpy_name):
        return np.dtype(numpy_name)
    import ml_dtypes  # only needed for bf16 / fp8 arrays

    return np.dtype(getattr(ml_dtypes, numpy_name))


def from_numpy(dt: np.dtype) -> DType:
    """Our dtype for a numpy dtype, or ValueError naming it."""
    dt = np.dtype(dt)
    for d in _TABLE:
        try:
            if numpy_dtype(d.name) == dt:
                return d
        except (ImportError, AttributeError):
            continue
    raise ValueError(f"numpy dtype {dt} has no tiledispatch equivalent (known: {', '.join(DTYPES)})")
