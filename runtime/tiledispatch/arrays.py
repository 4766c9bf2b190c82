"""Array views: numpy arrays, torch tensors and cupy / __cuda_array_interface__ objects, used in place.

A view is a pointer, a shape, strides in elements, our dtype name and where the memory lives. No
framework is imported unless the caller passed one of its objects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidInputError
from .spec.dtypes import from_numpy

_TORCH_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int8": "int8", "int32": "int32",
                 "float8_e4m3fn": "fp8e4m3", "float8_e5m2": "fp8e5m2", "float64": "fp64"}


@dataclass(frozen=True)
class ArrayView:
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]   # in elements
    dtype: str
    device: str                # "cpu" or "cuda"
    obj: Any                   # the caller's object, kept alive for the call

    @property
    def ndim(self) -> int:
        return len(self.shape)


def view(obj: Any, role: str) -> ArrayView:
    """A view of obj; InvalidInputError naming the role (e.g. "A") when it cannot be used."""
    if isinstance(obj, ArrayView):  # already checked (a view the runtime derived from the caller's arrays)
        return obj
    module = type(obj).__module__.split(".")[0]
    if isinstance(obj, np.ndarray):
        return _numpy_view(obj, role)
    if module == "torch":
        return _torch_view(obj, role)
    if hasattr(obj, "__cuda_array_interface__"):
        return _cai_view(obj, role)
    raise InvalidInputError(f"{role}: expected a numpy array, torch tensor or cupy array, got {type(obj).__name__}")


def _dtype_of(np_dtype, role: str) -> str:
    try:
        return from_numpy(np_dtype).name
    except ValueError as e:
        raise InvalidInputError(f"{role}: {e}") from None


def _element_strides(byte_strides, itemsize: int, role: str) -> tuple[int, ...]:
    if any(s % itemsize for s in byte_strides):
        raise InvalidInputError(f"{role}: strides {byte_strides} bytes are not multiples of the element size {itemsize}")
    return tuple(s // itemsize for s in byte_strides)


def _numpy_view(a: np.ndarray, role: str) -> ArrayView:
    dtype = _dtype_of(a.dtype, role)
    return ArrayView(a.ctypes.data, tuple(a.shape), _element_strides(a.strides, a.itemsize, role), dtype, "cpu", a)


def _torch_view(t, role: str) -> ArrayView:
    name = str(t.dtype).replace("torch.", "")
    if name not in _TORCH_DTYPES:
        raise InvalidInputError(f"{role}: torch dtype {t.dtype} has no tiledispatch equivalent")
    device = "cuda" if t.device.type == "cuda" else ("cpu" if t.device.type == "cpu" else t.device.type)
    return ArrayView(t.data_ptr(), tuple(t.shape), tuple(t.stride()), _TORCH_DTYPES[name], device, t)


def _cai_view(obj, role: str) -> ArrayView:
    cai = obj.__cuda_array_interface__
    np_dtype = np.dtype(cai["typestr"])
    dtype = _dtype_of(np_dtype, role)
    shape = tuple(cai["shape"])
    if cai.get("strides") is None:  # C-contiguous
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    else:
        strides = _element_strides(cai["strides"], np_dtype.itemsize, role)
    return ArrayView(int(cai["data"][0]), shape, strides, dtype, "cuda", obj)


def empty_like_device(ref: ArrayView, shape: tuple[int, ...], dtype: str):
    """A new row-major array of the same framework and device as ref."""
    from .spec.dtypes import numpy_dtype

    if isinstance(ref.obj, np.ndarray):
        return np.empty(shape, dtype=numpy_dtype(dtype))
    module = type(ref.obj).__module__.split(".")[0]
    if module == "torch":
        import torch

        inv = {v: k for k, v in _TORCH_DTYPES.items()}
        return torch.empty(shape, dtype=getattr(torch, inv[dtype]), device=ref.obj.device)
    if module == "cupy":
        import cupy

        return cupy.empty(shape, dtype=numpy_dtype(dtype))
    raise InvalidInputError(f"cannot allocate an output like {type(ref.obj).__name__}: pass out=")


def copyable(obj) -> bool:
    """Whether snapshot() / restore() handle obj: numpy, torch and cupy arrays."""
    return isinstance(obj, np.ndarray) or type(obj).__module__.split(".")[0] in ("torch", "cupy")


def snapshot(obj):
    """A copy of a numpy, torch or cupy array's contents, for restore()."""
    if isinstance(obj, np.ndarray) or type(obj).__module__.startswith("cupy"):
        return obj.copy(order="K")
    return obj.clone()


def restore(obj, saved) -> None:
    """Write a snapshot back into the array it was taken from."""
    if isinstance(obj, np.ndarray):
        np.copyto(obj, saved)
    elif type(obj).__module__.startswith("torch"):
        obj.copy_(saved)
    else:
        import cupy

        cupy.copyto(obj, saved)
