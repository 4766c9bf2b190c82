"""A small CUDA runtime binding (ctypes over libcudart) for the cutlass backend.

Nothing here touches CUDA at import: libcudart is found and loaded at the first call, and CUDA
initializes then. The library is the one the process already has (torch or cupy loaded it), else
the one a torch / cupy / nvidia-cuda-runtime wheel ships, else the system's libcudart.so.13 / .12.

What the runtime needs and no more: device facts (device_arch), device memory (malloc / free, and a
persistent workspace per device and stream that only grows), host <-> device copies for numpy
inputs (DeviceArray), the caller's current stream (current_stream), synchronize, and CUDA events
for benchmarks and tuning (Timer, time_calls, time_queued, time_paced).
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
_lib: Optional[ctypes.CDLL] = None
_lock = threading.Lock()


class CudaError(RuntimeError):
    """A CUDA runtime call failed; the message names the call and CUDA's reason."""


# ---- loading -----------------------------------------------------------------------------------

def _loaded_path() -> Optional[str]:
    """libcudart already mapped into this process (by torch, cupy, ...), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    return None


def _package_dirs(name: str) -> list[Path]:
    """Install folders of an importable package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])] or ([Path(spec.origin).parent] if spec.origin else [])


def _candidates() -> list[str]:
    paths = []
    loaded = _loaded_path()
    if loaded:
        paths.append(loaded)
    for pkg, patterns in (("nvidia", ("*/lib/libcudart.so*", "cu*/lib/libcudart.so*")), ("torch", ("lib/libcudart*.so*",)),
                          ("cupy", (".data/lib/libcudart.so*",)), ("cupy_backends", ("../nvidia/*/lib/libcudart.so*",))):
        for d in _package_dirs(pkg):
            for pattern in patterns:
                paths += sorted(glob.glob(str(d / pattern)), reverse=True)
    paths += list(_SONAMES)  # the dynamic loader's own search (LD_LIBRARY_PATH, ld.so.cache)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            paths += sorted(glob.glob(os.path.join(home, "lib64", "libcudart.so*")), reverse=True)
    return paths


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_size, vp = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p
    sigs = {
        "cudaGetErrorString": ([c_int], ctypes.c_char_p),
        "cudaGetDeviceCount": ([ctypes.POINTER(c_int)], c_int),
        "cudaGetDevice": ([ctypes.POINTER(c_int)], c_int),
        "cudaSetDevice": ([c_int], c_int),
        "cudaDeviceGetAttribute": ([ctypes.POINTER(c_int), c_int, c_int], c_int),
        "cudaMalloc": ([ctypes.POINTER(vp), c_size], c_int),
        "cudaFree": ([vp], c_int),
        "cudaMemcpy": ([vp, vp, c_size, c_int], c_int),
        "cudaMemcpyAsync": ([vp, vp, c_size, c_int, vp], c_int),
        "cudaMemsetAsync": ([vp, c_int, c_size, vp], c_int),
        "cudaStreamSynchronize": ([vp], c_int),
        "cudaDeviceSynchronize": ([], c_int),
        "cudaEventCreate": ([ctypes.POINTER(vp)], c_int),
        "cudaEventDestroy": ([vp], c_int),
        "cudaEventRecord": ([vp, vp], c_int),
        "cudaEventSynchronize": ([vp], c_int),
        "cudaEventElapsedTime": ([ctypes.POINTER(ctypes.c_float), vp, vp], c_int),
        "cudaRuntimeGetVersion": ([ctypes.POINTER(c_int)], c_int),
        "cudaDriverGetVersion": ([ctypes.POINTER(c_int)], c_int),
    }
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype


def runtime() -> ctypes.CDLL:
    """The loaded libcudart (loaded on the first call)."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                errors = []
                for path in _candidates():
                    try:
                        # local: kernels link cudart statically, and cudart's names in the global scope would
                        # take the place of same-named functions in libraries loaded later
                        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
                        _declare(lib)
                    except (OSError, AttributeError) as e:
                        errors.append(f"{path}: {e}")
                        continue
                    _lib = lib
                    break
                else:
                    raise CudaError("libcudart not found (install torch, cupy or the CUDA runtime); tried: "
                                    + "; ".join(errors[-4:]))
    return _lib


def _check(status: int, what: str) -> None:
    if status != 0:
        msg = runtime().cudaGetErrorString(status)
        raise CudaError(f"{what} failed: {msg.decode() if msg else status} (cudaError {status})")


def library_path() -> Optional[str]:
    """Where the loaded libcudart lives (None before the first call)."""
    return getattr(_lib, "_name", None)


# ---- devices ------------------------------------------------------------------------------------

_ATTR_CC_MAJOR, _ATTR_CC_MINOR, _ATTR_SM_COUNT, _ATTR_L2_BYTES = 75, 76, 16, 89


def device_count() -> int:
    n = ctypes.c_int(0)
    status = runtime().cudaGetDeviceCount(ctypes.byref(n))
    return n.value if status == 0 else 0


def current_device() -> int:
    d = ctypes.c_int(0)
    _check(runtime().cudaGetDevice(ctypes.byref(d)), "cudaGetDevice")
    return d.value


def _attribute(attr: int, device: int) -> int:
    v = ctypes.c_int(0)
    _check(runtime().cudaDeviceGetAttribute(ctypes.byref(v), attr, device), "cudaDeviceGetAttribute")
    return v.value


def compute_capability(device: Optional[int] = None) -> tuple[int, int]:
    device = current_device() if device is None else device
    return _attribute(_ATTR_CC_MAJOR, device), _attribute(_ATTR_CC_MINOR, device)


def multiprocessor_count(device: Optional[int] = None) -> int:
    return _attribute(_ATTR_SM_COUNT, current_device() if device is None else device)


def l2_bytes(device: Optional[int] = None) -> int:
    return _attribute(_ATTR_L2_BYTES, current_device() if device is None else device)


def device_name(device: Optional[int] = None) -> str:
    """The device's marketing name, e.g. "NVIDIA H100 80GB HBM3" (cudaDeviceProp begins with char name[256]
    in every CUDA version; the buffer is larger than any version's struct)."""
    device = current_device() if device is None else device
    buf = ctypes.create_string_buffer(16384)
    lib = runtime()
    get = getattr(lib, "cudaGetDeviceProperties_v2", None) or lib.cudaGetDeviceProperties
    _check(get(buf, ctypes.c_int(device)), "cudaGetDeviceProperties")
    return buf.raw[:256].split(b"\0", 1)[0].decode(errors="replace")


def device_arch(device: Optional[int] = None) -> str:
    """The cutlass arch name of a device (the cc -> arch map of drivers.arch_of_cc over the cutlass archs: "sm90a"
    for compute capability 9.0, "sm80" for 8.x), else "sm<major><minor>" (which no cutlass bundle targets)."""
    from . import backends, drivers

    major, minor = compute_capability(device)
    return drivers.arch_of_cc(f"{major}.{minor}", backends.get("cutlass").archs) or f"sm{major}{minor}"


def versions() -> dict:
    """CUDA runtime and driver versions, e.g. {"runtime": "13.0", "driver": "13.0"}."""
    out = {}
    for name, fn in (("runtime", "cudaRuntimeGetVersion"), ("driver", "cudaDriverGetVersion")):
        v = ctypes.c_int(0)
        _check(getattr(runtime(), fn)(ctypes.byref(v)), fn)
        out[name] = f"{v.value // 1000}.{v.value % 1000 // 10}"
    return out


# ---- memory ---------------------------------------------------------------------------------------

def malloc(nbytes: int) -> int:
    """Device memory on the current device (at least 1 byte); free it with free()."""
    p = ctypes.c_void_p()
    _check(runtime().cudaMalloc(ctypes.byref(p), max(1, int(nbytes))), f"cudaMalloc({nbytes})")
    return int(p.value)


def free(ptr: int) -> None:
    if ptr:
        _check(runtime().cudaFree(ctypes.c_void_p(ptr)), "cudaFree")


_workspaces: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (device, stream) -> [(ptr, bytes)]


def workspace(nbytes: int, stream: int = 0) -> int:
    """A device buffer of at least nbytes for kernels launched on `stream` of the current device.

    Allocated once and grown when a larger one is asked for, never per call: kernels on one stream
    run in order, so they can share it; other streams get their own. An outgrown buffer stays
    allocated (prepared launches may still hold its pointer) until release_workspaces().
    Returns 0 for nbytes == 0.
    """
    if nbytes <= 0:
        return 0
    slot = (current_device(), int(stream or 0))
    with _lock:
        buffers = _workspaces.setdefault(slot, [])
        if not buffers or buffers[-1][1] < nbytes:
            size = max(int(nbytes), 2 * buffers[-1][1] if buffers else 0, 1 << 20)
            buffers.append((malloc(size), size))
        return buffers[-1][0]


def release_workspaces() -> None:
    """Free every workspace buffer (after synchronizing: kernels may still be using them)."""
    synchronize()
    with _lock:
        for buffers in _workspaces.values():
            for ptr, _ in buffers:
                free(ptr)
        _workspaces.clear()


def memcpy_htod(dst: int, src: np.ndarray) -> None:
    """Copy a C-contiguous host array to device memory (synchronous)."""
    src = np.ascontiguousarray(src)
    _check(runtime().cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src.ctypes.data), src.nbytes, 1),
           "cudaMemcpy host->device")


def memcpy_dtoh(dst: np.ndarray, src: int) -> None:
    """Copy device memory into a C-contiguous host array (synchronous)."""
    if not dst.flags.c_contiguous:
        raise ValueError("memcpy_dtoh needs a C-contiguous destination")
    _check(runtime().cudaMemcpy(ctypes.c_void_p(dst.ctypes.data), ctypes.c_void_p(src), dst.nbytes, 2),
           "cudaMemcpy device->host")


def _dense_span(a: np.ndarray) -> Optional[int]:
    """Bytes of the memory block a dense array (any axis order, no gaps) occupies, else None."""
    if a.size == 0 or any(s < 0 for s in a.strides):
        return None
    span = sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + a.itemsize
    return span if span == a.nbytes else None


class DeviceArray:
    """A device copy of a numpy array, with the same shape and element order.

    A dense array (row-major, column-major or any axis permutation, e.g. a swapaxes view) keeps its
    strides, so layouts survive the copy; others are made row-major first. It exposes
    __cuda_array_interface__, so it goes wherever cupy arrays do; to_host() copies it back. The
    memory is freed with the object (or by free_now()).
    """

    def __init__(self, host: np.ndarray, copy: bool = True):
        if _dense_span(host) is None:
            host = np.ascontiguousarray(host)
        self.dtype, self.shape, self.strides = host.dtype, tuple(host.shape), tuple(host.strides)
        self.nbytes = host.nbytes
        self.ptr = malloc(self.nbytes)
        if copy and self.nbytes:
            _check(runtime().cudaMemcpy(ctypes.c_void_p(self.ptr), ctypes.c_void_p(host.ctypes.data), self.nbytes, 1),
                   "cudaMemcpy host->device")

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
                "strides": self.strides, "version": 3}

    def to_host(self, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The contents as a new host array (or copied into `out`, which must match)."""
        raw = np.empty(self.nbytes, dtype=np.uint8)
        memcpy_dtoh(raw, self.ptr)
        host = np.lib.stride_tricks.as_strided(raw.view(self.dtype), self.shape, self.strides).copy()
        if out is not None:
            out[...] = host
            return out
        return host

    def free_now(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr and _lib is not None:
            free(ptr)

    def __del__(self):
        try:
            self.free_now()
        except Exception:  # interpreter shutdown: the context may be gone already
            pass


# ---- streams and timing -------------------------------------------------------------------------

def current_stream(obj: Any = None) -> int:
    """The stream the caller's framework would use now: torch's current stream for torch tensors
    (on the tensor's device), cupy's current stream for cupy arrays, else 0 (the default stream)."""
    module = type(obj).__module__.split(".")[0] if obj is not None else ""
    if module == "torch":
        import torch

        return int(torch.cuda.current_stream(obj.device).cuda_stream)
    if module == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def synchronize(stream: Optional[int] = None) -> None:
    """Wait for one stream, or (stream=None) for the whole device."""
    if stream is None:
        _check(runtime().cudaDeviceSynchronize(), "cudaDeviceSynchronize")
    else:
        _check(runtime().cudaStreamSynchronize(ctypes.c_void_p(stream)), "cudaStreamSynchronize")


class Timer:
    """A pair of CUDA events: start() / stop() on a stream, elapsed_ms() after stop."""

    def __init__(self):
        self._start, self._stop = ctypes.c_void_p(), ctypes.c_void_p()
        _check(runtime().cudaEventCreate(ctypes.byref(self._start)), "cudaEventCreate")
        _check(runtime().cudaEventCreate(ctypes.byref(self._stop)), "cudaEventCreate")

    def start(self, stream: int = 0) -> None:
        _check(runtime().cudaEventRecord(self._start, ctypes.c_void_p(stream)), "cudaEventRecord")

    def stop(self, stream: int = 0) -> None:
        _check(runtime().cudaEventRecord(self._stop, ctypes.c_void_p(stream)), "cudaEventRecord")

    def elapsed_ms(self) -> float:
        _check(runtime().cudaEventSynchronize(self._stop), "cudaEventSynchronize")
        ms = ctypes.c_float()
        _check(runtime().cudaEventElapsedTime(ctypes.byref(ms), self._start, self._stop), "cudaEventElapsedTime")
        return float(ms.value)

    def __del__(self):
        try:
            runtime().cudaEventDestroy(self._start)
            runtime().cudaEventDestroy(self._stop)
        except Exception:
            pass


def time_calls(fn: Callable[[int], None], *, stream: int = 0, calls: int = 20, repeats: int = 15,
               warmup: int = 3) -> list[float]:
    """Milliseconds per call of fn(i), i = 0, 1, ... (so fn can rotate inputs): for each repeat,
    `calls` back-to-back launches between two events on `stream`. Returns one value per repeat."""
    timer = Timer()
    for i in range(warmup):
        fn(i)
    synchronize(stream)
    out = []
    i = 0
    for _ in range(repeats):
        timer.start(stream)
        for _ in range(calls):
            fn(i)
            i += 1
        timer.stop(stream)
        out.append(timer.elapsed_ms() / calls)
    return out


# ---- queued timing: the GPU's time for back-to-back launches, whatever the host's pace -----------------------
# A delay kernel (PTX, JIT-compiled by the driver once per device) that spins on the GPU's nanosecond timer: launches
# queued behind it start back to back when it ends, so events around them time the GPU alone.
_DELAY_PTX = b""".version 7.0
.target sm_70
.address_size 64
.visible .entry td_delay(.param .u64 td_delay_ns)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [td_delay_ns];
    mov.u64 %rd2, %globaltimer;
    add.s64 %rd3, %rd2, %rd1;
$L_spin:
    mov.u64 %rd4, %globaltimer;
    setp.lt.u64 %p1, %rd4, %rd3;
    @%p1 bra $L_spin;
    ret;
}
"""
_driver: Optional[ctypes.CDLL] = None
_delay_kernels: dict = {}  # device -> CUfunction
_delay_lock = threading.Lock()
MAX_DELAY_MS = 50.0  # the delay's cap: a batch the host takes longer to queue is reported as behind


def _driver_call(status: int, what: str) -> None:
    if status != 0:
        raise CudaError(f"{what} failed (CUresult {status})")


def _delay_kernel() -> ctypes.c_void_p:
    """The delay kernel of the current device (loaded into the context cudart made current on first use)."""
    global _driver
    device = current_device()
    with _delay_lock:
        if _driver is None:
            try:
                driver = ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_LOCAL)
            except OSError as e:
                raise CudaError(f"the CUDA driver library (libcuda.so.1) cannot be loaded: {e}") from None
            vp = ctypes.c_void_p
            driver.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
            driver.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
            driver.cuLaunchKernel.argtypes = [vp] + [ctypes.c_uint] * 7 + [vp, ctypes.POINTER(vp), vp]
            _driver = driver
        if device not in _delay_kernels:
            _check(runtime().cudaFree(None), "cudaFree")  # makes this device's primary context current
            module, function = ctypes.c_void_p(), ctypes.c_void_p()
            _driver_call(_driver.cuModuleLoadData(ctypes.byref(module), _DELAY_PTX), "cuModuleLoadData (delay kernel)")
            _driver_call(_driver.cuModuleGetFunction(ctypes.byref(function), module, b"td_delay"),
                         "cuModuleGetFunction (delay kernel)")
            _delay_kernels[device] = function
        return _delay_kernels[device]


def delay(ms: float, stream: int = 0) -> None:
    """Queue a kernel on `stream` that keeps it busy for `ms` milliseconds."""
    function = _delay_kernel()
    ns = ctypes.c_uint64(int(ms * 1e6))
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(ns), ctypes.c_void_p))
    _driver_call(_driver.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, ctypes.c_void_p(stream), params, None),
                 "cuLaunchKernel (delay kernel)")


class QueuedTimer:
    """Times batches of back-to-back calls on a stream by the GPU's clock alone, whatever the host's pace.

    Each batch waits on the stream behind a delay kernel long enough for the host to queue all its calls (sized from
    the host's pace in the previous batch, plus half), so the events around the batch time the GPU running the
    calls back to back: the steady state of a busy stream or a CUDA graph. A host that did not queue the batch
    within the delay is reported as behind (that batch was timed at the host's pace, in part)."""

    def __init__(self, stream: int = 0):
        self.stream = stream
        self._delay, self._batch = Timer(), Timer()
        self._host_ms = 0.03  # per call: a first guess above a prepared launch's, then measured

    def batch(self, fn: Callable[[], None], calls: int) -> tuple[float, bool]:
        """(milliseconds per call of `calls` back-to-back calls of fn, whether the host fell behind the GPU)."""
        delay_ms = min(MAX_DELAY_MS, 1.5 * self._host_ms * calls + 0.02)
        self._delay.start(self.stream)
        delay(delay_ms, self.stream)
        self._delay.stop(self.stream)
        self._batch.start(self.stream)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        queued_ms = (time.perf_counter() - t0) * 1e3
        self._batch.stop(self.stream)
        self._host_ms = queued_ms / calls
        return self._batch.elapsed_ms() / calls, queued_ms > self._delay.elapsed_ms()


def time_queued(fn: Callable[[], None], *, stream: int = 0, batch_ms: float = 0.5, repeats: int = 5,
                max_calls: int = 10000) -> list[float]:
    """Milliseconds per call of fn in each of `repeats` queued batches (QueuedTimer) of about batch_ms, sized from
    the fastest of three single calls; batches the host fell behind on are left out unless all were."""
    timer = QueuedTimer(stream)
    fn()  # warm-up: first-launch costs (module load, lazy init) stay out of the samples
    probe = min(timer.batch(fn, 1)[0] for _ in range(3))
    calls = max(1, min(max_calls, int(batch_ms / max(probe, 1e-4))))
    batches = [timer.batch(fn, calls) for _ in range(repeats)]
    return [ms for ms, behind in batches if not behind] or [ms for ms, _ in batches]


def time_paced(fn: Callable[[], None], *, stream: int = 0, batch_ms: float = 0.5, repeats: int = 5,
               max_calls: int = 1000) -> list[float]:
    """Milliseconds per call of fn in each of `repeats` batches of back-to-back calls at the host's pace (no delay
    in front: a loop of calls, the host's cost per call included), each about batch_ms, sized from two calls."""
    fn()  # warm-up, as time_queued's
    probe = time_calls(lambda i: fn(), stream=stream, calls=2, repeats=1, warmup=0)[0]
    calls = max(1, min(max_calls, int(batch_ms / max(probe, 1e-4))))
    return time_calls(lambda i: fn(), stream=stream, calls=calls, repeats=repeats, warmup=0)
