"""ctypes mirror of include/tiledispatch_abi.h, and a thin wrapper around one kernel library."""
from __future__ import annotations

import ctypes
from pathlib import Path

ABI_VERSION = 1
MAX_RANK = 8
MAX_TENSORS = 8
MAX_SCALARS = 4
MAX_PARAMS = 16

OK, UNSUPPORTED, INVALID_ARGUMENT, RUNTIME_ERROR = 0, 1, 2, 3
INCLUDE_DIR = Path(__file__).with_name("include")


class TdTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_RANK),
        ("stride", ctypes.c_int64 * MAX_RANK),
    ]


class TdArgs(ctypes.Structure):
    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("num_tensors", ctypes.c_int32),
        ("tensors", TdTensor * MAX_TENSORS),
        ("scalars", ctypes.c_double * MAX_SCALARS),
        ("params", ctypes.c_int64 * MAX_PARAMS),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_uint64),
        ("stream", ctypes.c_void_p),
        ("num_threads", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


def set_tensor(slot: TdTensor, data_ptr: int | None, dtype_code: int, shape, strides) -> None:
    if len(shape) > MAX_RANK:
        raise ValueError(f"rank {len(shape)} exceeds the ABI's {MAX_RANK}")
    slot.data = data_ptr or None
    slot.dtype = dtype_code
    slot.rank = len(shape)
    for i, (n, s) in enumerate(zip(shape, strides)):
        slot.shape[i] = n
        slot.stride[i] = s


class KernelLibrary:
    """One loaded kernel .so. Loading runs no kernel and touches no GPU."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        lib = ctypes.CDLL(str(self.path), mode=ctypes.RTLD_LOCAL)
        lib.td_abi_version.restype = ctypes.c_uint32
        lib.td_kernel_key.restype = ctypes.c_char_p
        for fn in (lib.td_can_run, lib.td_run):
            fn.restype = ctypes.c_int32
            fn.argtypes = [ctypes.POINTER(TdArgs), ctypes.c_char_p, ctypes.c_uint64]
        lib.td_workspace_bytes.restype = ctypes.c_uint64
        lib.td_workspace_bytes.argtypes = [ctypes.POINTER(TdArgs)]
        self._lib = lib
        self._reason = ctypes.create_string_buffer(512)

    def abi_version(self) -> int:
        return int(self._lib.td_abi_version())

    def key_json(self) -> str:
        return self._lib.td_kernel_key().decode()

    def can_run(self, args: TdArgs) -> tuple[int, str]:
        status = self._lib.td_can_run(ctypes.byref(args), self._reason, len(self._reason))
        return status, self._reason.value.decode() if status else ""

    def workspace_bytes(self, args: TdArgs) -> int:
        return int(self._lib.td_workspace_bytes(ctypes.byref(args)))

    def run(self, args: TdArgs) -> tuple[int, str]:
        status = self._lib.td_run(ctypes.byref(args), self._reason, len(self._reason))
        return status, self._reason.value.decode() if status else ""
