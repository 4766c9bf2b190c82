"""Array views: numpy arrays, torch tensors and cupy / __cuda_array_interface__ objects, used in place.

A view is a pointer, a shape, strides in elements, our dtype name and where the memory lives. No
framework is imported unless the caller passed one of its objects.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np

from .errors import InvalidInputError
from .spec.dtypes import DTYPES, from_numpy

INT64_MAX = 2**63 - 1  # the ABI's sizes, strides and byte offsets are int64

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
        v = _numpy_view(obj, role)
    elif module == "torch":
        v = _torch_view(obj, role)
    elif hasattr(obj, "__cuda_array_interface__"):
        v = _cai_view(obj, role)
    else:
        raise InvalidInputError(f"{role}: expected a numpy array, torch tensor or cupy array, got {type(obj).__name__}")
    lo, hi = byte_span(v)
    if -lo > INT64_MAX or hi > INT64_MAX:
        raise InvalidInputError(f"{role}: shape {list(v.shape)} with strides {list(v.strides)} spans more bytes than "
                                f"an int64 offset can address")
    return v


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
    if isinstance(a, np.ma.MaskedArray):  # the kernels would read the masked-out values
        raise InvalidInputError(f"{role}: masked arrays are not supported; pass .filled(value) or .data")
    dtype = _dtype_of(a.dtype, role)
    if not a.flags.aligned:
        raise InvalidInputError(f"{role}: the data pointer {a.ctypes.data:#x} or the strides {a.strides} are not "
                                f"aligned to the element size {a.itemsize}; pass an aligned copy")
    return ArrayView(a.ctypes.data, tuple(a.shape), _element_strides(a.strides, a.itemsize, role), dtype, "cpu", a)


def _torch_view(t, role: str) -> ArrayView:
    import torch

    name = str(t.dtype).replace("torch.", "")
    if name not in _TORCH_DTYPES:
        raise InvalidInputError(f"{role}: torch dtype {t.dtype} has no tiledispatch equivalent")
    if t.is_nested:
        raise InvalidInputError(f"{role}: nested tensors are not supported")
    if t.layout != torch.strided:
        raise InvalidInputError(f"{role}: torch layout {t.layout} is not supported; pass a dense (strided) tensor")
    if t.is_neg() or t.is_conj():  # a lazy negation / conjugation: the memory does not hold the values
        raise InvalidInputError(f"{role}: the tensor has its negative or conjugate bit set; pass .resolve_neg() / "
                                f".resolve_conj()")
    if t.device.type == "meta":
        raise InvalidInputError(f"{role}: a meta tensor has no data")
    if t.requires_grad and torch.is_grad_enabled():
        raise InvalidInputError(f"{role}: the tensor requires grad; tiledispatch does not record autograd, so run "
                                f"under torch.no_grad() or pass .detach()")
    device = "cuda" if t.device.type == "cuda" else ("cpu" if t.device.type == "cpu" else t.device.type)
    try:
        ptr = t.data_ptr()
    except RuntimeError as e:  # tensors without storage (functorch wrappers, fake tensors)
        raise InvalidInputError(f"{role}: the tensor has no data pointer: {e}") from None
    return ArrayView(ptr, tuple(t.shape), tuple(t.stride()), _TORCH_DTYPES[name], device, t)


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


def byte_span(v: ArrayView) -> tuple[int, int]:
    """(lo, hi): the bytes [ptr + lo, ptr + hi) hold every element of v (lo <= 0 with negative strides)."""
    return span(v.shape, v.strides, DTYPES[v.dtype].itemsize)


def span(shape: Iterable[int], strides: Iterable[int], itemsize: int) -> tuple[int, int]:
    """(lo, hi) byte offsets from the data pointer of the first and one past the last byte an array with these
    sizes and strides (in elements) touches; (0, 0) when it has no elements."""
    lo = hi = 0
    for n, s in zip(shape, strides):
        if n == 0:
            return 0, 0
        reach = (n - 1) * s
        if reach < 0:
            lo += reach
        else:
            hi += reach
    return lo * itemsize, (hi + 1) * itemsize


def check_writable(v: ArrayView, role: str) -> None:
    """An output must be writable and no two of its elements may share memory (a broadcast view would
    have the kernel write one location from many threads, and rewrite the broadcast source)."""
    if read_only(v.obj):
        raise InvalidInputError(f"{role} is read-only (e.g. numpy writeable=False: a broadcast view or a read-only "
                                f"memmap): pass a writable array")
    if internal_overlap(v.shape, v.strides):
        raise InvalidInputError(f"{role} has shape {list(v.shape)} with strides {list(v.strides)}: some of its elements "
                                f"share memory (e.g. a broadcast or expanded view), so it cannot be an output")


def read_only(obj) -> bool:
    """Whether the caller marked obj's memory read-only (numpy's writeable flag, __cuda_array_interface__'s
    read-only bit; torch has no read-only tensors)."""
    if isinstance(obj, np.ndarray):
        return not obj.flags.writeable
    if type(obj).__module__.split(".")[0] == "torch":
        return False
    return bool(obj.__cuda_array_interface__["data"][1])


def internal_overlap(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether two elements may share memory. Sufficient test: with the dims of size > 1 sorted by |stride|,
    each stride exceeds the reach of all smaller ones (refuses a few exotic interleavings that do not overlap)."""
    if 0 in shape:
        return False
    reach = 0  # (the elements spanned by the smaller dims) - 1
    for s, n in sorted((abs(s), n) for n, s in zip(shape, strides) if n > 1):
        if s <= reach:
            return True
        reach += (n - 1) * s
    return False


def check_disjoint(written: ArrayView, role: str, reads: Iterable[tuple[Optional[ArrayView], str]],
                   exact_ok: Iterable[str] = ()) -> None:
    """The written array must not share memory with any array the kernel reads (it would read values it has
    already overwritten); by address ranges. A read listed in exact_ok may be the written array itself (same
    pointer, shape and strides): the ABI allows C to alias D for beta * C."""
    w_lo, w_hi = byte_span(written)
    w_lo, w_hi = written.ptr + w_lo, written.ptr + w_hi
    for v, name in reads:
        if v is None:
            continue
        if name in exact_ok and (v.ptr, v.shape, v.strides) == (written.ptr, written.shape, written.strides):
            continue
        lo, hi = byte_span(v)
        if v.ptr + lo < w_hi and w_lo < v.ptr + hi:
            raise InvalidInputError(f"{role} overlaps {name} in memory (bytes [{w_lo:#x}, {w_hi:#x}) and "
                                    f"[{v.ptr + lo:#x}, {v.ptr + hi:#x})): the kernel would read values it has "
                                    f"already overwritten; pass a separate output")


def _memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _size_text(nbytes: int) -> str:
    for unit, scale in (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def empty_like_device(ref: ArrayView, shape: tuple[int, ...], dtype: str, role: str = "out"):
    """A new row-major array of the same framework and device as ref. Its size is checked first: more bytes
    than an int64 holds, or (in host memory) than this machine has, is refused, as is a failed allocation."""
    from .spec.dtypes import numpy_dtype

    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    what = f"{role} ({list(shape)} {dtype}) would take {_size_text(nbytes)}"
    if nbytes > INT64_MAX:
        raise InvalidInputError(f"{what}, more than an int64 byte count holds")
    memory = _memory_bytes() if ref.device == "cpu" else None
    if memory is not None and nbytes > memory:
        raise InvalidInputError(f"{what}, more than this machine's {_size_text(memory)} of memory")
    try:
        if isinstance(ref.obj, np.ndarray):
            return np.empty(shape, dtype=numpy_dtype(dtype))
        module = type(ref.obj).__module__.split(".")[0]
        if module == "torch":
            import torch

            inv = {v: k for k, v in _TORCH_DTYPES.items()}
            try:
                return torch.empty(shape, dtype=getattr(torch, inv[dtype]), device=ref.obj.device)
            except RuntimeError:  # torch.OutOfMemoryError, or the CPU allocator's "can't allocate memory"
                raise MemoryError from None
        if module == "cupy":
            import cupy

            try:
                return cupy.empty(shape, dtype=numpy_dtype(dtype))
            except cupy.cuda.memory.OutOfMemoryError:
                raise MemoryError from None
    except MemoryError:
        raise InvalidInputError(f"{what}: the allocation failed (out of memory)") from None
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
