"""ctypes mirror of include/tiledispatch_abi.h, and a thin wrapper around one kernel library."""
from __future__ import annotations

import atexit
import ctypes
import fcntl
import os
import shutil
import tempfile
import threading
from pathlib import Path

from .errors import BundleError

ABI_VERSION = 1
MAX_RANK = 8
MAX_TENSORS = 8
MAX_SCALARS = 4
MAX_PARAMS = 16
# grouped convolution params slots (TD_CONV_* of tiledispatch_abi.h): [CONV_RANK], then per spatial dim d
CONV_RANK, CONV_STRIDE, CONV_DILATION, CONV_PAD_LO, CONV_PAD_HI = 0, 1, 4, 7, 10
POOL_WINDOW = 13  # max pooling: the conv slots for rank, stride, dilation and low padding, and its window per dim

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


REASON_BYTES = 512  # the reason buffer of a prepared launch (Plan)
REASON_BYTES_ARG = ctypes.c_uint64(REASON_BYTES)  # as KernelLibrary.launch takes it


class KernelLibrary:
    """One loaded kernel .so. Loading runs no kernel and touches no GPU.

    KernelLibrary(path) loads a file as it is (tools and tests that build their own libraries);
    KernelLibrary.from_image loads bytes that were already checked, as load() does for a bundle."""

    def __init__(self, path: str | Path, lib: ctypes.CDLL | None = None):
        self.path = Path(path)
        lib = lib or ctypes.CDLL(str(self.path), mode=ctypes.RTLD_LOCAL)
        try:
            lib.td_abi_version.restype = ctypes.c_uint32
            lib.td_kernel_key.restype = ctypes.c_char_p
            for fn in (lib.td_can_run, lib.td_run):
                fn.restype = ctypes.c_int32
                fn.argtypes = [ctypes.POINTER(TdArgs), ctypes.c_char_p, ctypes.c_uint64]
            lib.td_workspace_bytes.restype = ctypes.c_uint64
            lib.td_workspace_bytes.argtypes = [ctypes.POINTER(TdArgs)]
        except AttributeError as e:  # a td_ function is missing
            raise BundleError(f"{self.path}: not a tiledispatch kernel library: {e}") from None
        self._lib = lib
        self._reason = ctypes.create_string_buffer(512)
        # td_run again, without argtypes: a prepared launch (Plan) passes exactly (byref(TdArgs), its reason
        # buffer, REASON_BYTES), and ctypes' per-argument conversion would cost ~0.3 us of every launch
        self.launch = lib["td_run"]
        self.launch.restype = ctypes.c_int32

    @classmethod
    def from_image(cls, data: bytes, digest: str, path: str | Path) -> "KernelLibrary":
        """The library whose file bytes are `data`, whose sha256 the caller has checked to be `digest`;
        `path` is where the bytes came from (for messages). dlopen reads a private copy of exactly these
        bytes that nothing can change (_load_image); each distinct image is loaded once per process."""
        with _IMAGES_LOCK:
            lib = _IMAGES.get(digest)
            if lib is None:
                lib = _IMAGES[digest] = _load_image(data, digest)
        return cls(path, lib)

    def abi_version(self) -> int:
        return int(self._lib.td_abi_version())

    def key_json(self) -> str:
        key = self._lib.td_kernel_key()
        return key.decode("utf-8", "replace") if key else ""

    def can_run(self, args: TdArgs) -> tuple[int, str]:
        status = self._lib.td_can_run(ctypes.byref(args), self._reason, len(self._reason))
        return status, self._reason.value.decode() if status else ""

    def workspace_bytes(self, args: TdArgs) -> int:
        return int(self._lib.td_workspace_bytes(ctypes.byref(args)))

    def run(self, args: TdArgs) -> tuple[int, str]:
        status = self._lib.td_run(ctypes.byref(args), self._reason, len(self._reason))
        return status, self._reason.value.decode() if status else ""


_IMAGES: dict[str, ctypes.CDLL] = {}  # sha256 of the image -> the library loaded from it
_IMAGES_LOCK = threading.Lock()
_MEMFDS: list[int] = []  # kept open: see _load_image
_PRIVATE_DIR: list[str] = []  # the fallback's directory, made once per process


def _load_image(data: bytes, digest: str) -> ctypes.CDLL:
    """dlopen a copy of `data` that nobody can change after the caller checked it.

    Linux: a memfd holding exactly these bytes, sealed against writes and size changes, opened as
    /proc/self/fd/N. The dynamic loader knows a library by the name it was opened with and would return
    this one for a later dlopen of the same name, so N stays open while the library is loaded, which for
    ctypes is the life of the process (and each image is loaded only once). Elsewhere, or where memfds are
    refused (vm.memfd_noexec), a copy in a private directory (mode 0700, so no other user can replace it),
    read back and compared before dlopen."""
    fd = _sealed_memfd(data)
    if fd is None:
        return _load_private_copy(data, digest)
    try:
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}", mode=ctypes.RTLD_LOCAL)
    except BaseException:
        os.close(fd)
        raise
    _MEMFDS.append(fd)
    return lib


def _sealed_memfd(data: bytes) -> int | None:
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        fd = os.memfd_create("tiledispatch-kernel", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _load_private_copy(data: bytes, digest: str) -> ctypes.CDLL:
    if not _PRIVATE_DIR:
        _PRIVATE_DIR.append(tempfile.mkdtemp(prefix="tiledispatch-"))
        atexit.register(shutil.rmtree, _PRIVATE_DIR[0], True)
    path = os.path.join(_PRIVATE_DIR[0], f"{digest}.so")  # one name per image: see _load_image
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o500)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        with open(path, "rb") as f:
            if f.read() != data:
                raise BundleError(f"{path}: the private copy of a kernel library changed after it was written")
        return ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
