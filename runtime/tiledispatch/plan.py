"""Plans: a problem bound to one kernel, for repeated launches with little host work.

The first launch validates everything (Python checks, then the kernel's own td_can_run). It records
each tensor's fingerprint (shape, strides, dtype, device, and what else decides whether a tensor may be
used: numpy's writeable flag, torch's requires_grad); a later launch whose tensors have the same
fingerprints only swaps the data pointers in the prepared td_args, after checking that the new
pointers do not make the written tensor overlap a read one (a few integer comparisons, only when a
pointer changed). Anything else goes through the full checks again, so the fast path can never run a
kernel on arguments it did not accept.

The registry's public calls keep one prepared Plan per call key in a Launcher (which also swaps alpha and
beta), in a BoundedCache (the entries not used lately dropped first): README, "Repeated calls".
"""
from __future__ import annotations

import ctypes
import numbers
import threading
from collections import OrderedDict
from typing import Any, Callable, Optional

import numpy as np

from . import abi
from .arrays import span
from .ops import get as ops_get
from .ops.gemm import real_scalar
from .errors import InvalidInputError, KernelRuntimeError, UnsupportedProblemError
from .spec.dtypes import BY_CODE

# num_threads above this is refused (the cpu kernels refuse it too: templates/cpu/_common.j2 MAX_THREADS);
# libgomp crashes on absurd counts
MAX_THREADS = 1024
_REASON_BYTES = abi.REASON_BYTES_ARG


def check_num_threads(n) -> int:
    if type(n) is bool or not isinstance(n, numbers.Integral) or not 0 <= n <= MAX_THREADS:
        raise InvalidInputError(f"num_threads must be an integer from 0 (the default) to {MAX_THREADS}, got {n!r}")
    return int(n)


def fingerprint(obj: Any) -> tuple[int, tuple]:
    """(data pointer, everything else a kernel's validity depends on: shape, strides, dtype, device and
    the pointer's alignment) with as little work as possible: one function per array type, found by a
    dictionary lookup on the type (this runs on every launch)."""
    printer = _PRINTERS.get(type(obj))
    if printer is None:
        if obj is None:
            return None, None
        printer = _PRINTERS.setdefault(type(obj), _printer_for(type(obj)))
    return printer(obj)


def _numpy_pointer_offset() -> Optional[int]:
    """Where an ndarray's data pointer lies in its object. a.ctypes.data builds a ctypes helper object on every
    access (~0.8 us, most of a cached launch on the cpu backend); the pointer is the first field after the
    object header of numpy's PyArrayObject (its C ABI: what PyArray_DATA reads), so it is read from there
    (~0.1 us) where a probe of a few arrays and views agrees with a.ctypes.data; None (use a.ctypes.data)
    where it does not."""
    offset = object.__basicsize__  # PyObject_HEAD
    base = np.arange(64, dtype=np.float32)
    probes = (base, base[3:], base.reshape(8, 8)[1:, ::2].T, np.zeros((0, 4), np.float16))
    if all(ctypes.c_void_p.from_address(id(p) + offset).value == p.ctypes.data for p in probes):
        return offset
    return None


_NUMPY_POINTER_OFFSET = _numpy_pointer_offset()
_read_pointer = ctypes.c_void_p.from_address


def _numpy_print(a) -> tuple[int, tuple]:
    ptr = _read_pointer(id(a) + _NUMPY_POINTER_OFFSET).value
    return ptr, (a.shape, a.strides, a.dtype, ptr & 15, a.flags.writeable)


def _numpy_print_slow(a) -> tuple[int, tuple]:
    ptr = a.ctypes.data
    return ptr, (a.shape, a.strides, a.dtype, ptr & 15, a.flags.writeable)


def _torch_print(t) -> tuple[int, tuple]:
    # one attribute read per field (each costs ~0.1 us, more on slower hosts): t.device names type and index at
    # once; alignment -1 for no memory (a meta tensor, data_ptr 0, would otherwise look like a CPU one);
    # is_neg(): a lazily negated view (e.g. the .imag of a conjugated tensor) has the same memory, shape and
    # strides as the values it does not hold
    ptr = t.data_ptr()
    return ptr, (t.shape, t.stride(), t.dtype, t.device, ptr & 15 if ptr else -1, t.requires_grad, t.is_neg())


def _torch_prints3(a, b, c) -> tuple[tuple, tuple]:
    """_torch_print of three tensors at once, as prints3 returns them: one Python call and two tuples instead of
    three calls and six tuples (~0.35 us of a cached public call)."""
    pa, pb, pc = a.data_ptr(), b.data_ptr(), c.data_ptr()
    return (pa, pb, pc), (
        a.shape, a.stride(), a.dtype, a.device, pa & 15 if pa else -1, a.requires_grad, a.is_neg(),
        b.shape, b.stride(), b.dtype, b.device, pb & 15 if pb else -1, b.requires_grad, b.is_neg(),
        c.shape, c.stride(), c.dtype, c.device, pc & 15 if pc else -1, c.requires_grad, c.is_neg())


def _cupy_print(x) -> tuple[int, tuple]:
    ptr = x.data.ptr
    return ptr, (x.shape, x.strides, x.dtype, x.device.id, ptr & 15)


def _generic_print(obj) -> tuple[int, tuple]:
    from .arrays import read_only, view

    v = view(obj, "tensor")
    return v.ptr, (v.shape, v.strides, v.dtype, v.device, v.ptr & 15, read_only(obj))


def _printer_for(cls) -> Callable[[Any], tuple[int, tuple]]:
    if cls is np.ndarray:
        return _numpy_print if _NUMPY_POINTER_OFFSET is not None else _numpy_print_slow
    module = cls.__module__.split(".")[0]
    if module == "torch":
        global _NATIVE_READER
        native = None
        if _reads_natively(cls):
            native = _NATIVE_READER = _native_prints()
        _TRIPLE_PRINTERS[cls] = native or _torch_prints3
    return {"torch": _torch_print, "cupy": _cupy_print}.get(module, _generic_print)


def _reads_natively(cls) -> bool:
    import torch

    return cls is torch.Tensor or cls is torch.nn.Parameter  # not a subclass: it may redefine its attributes


def _native_prints():
    """The native reader's prints (native/torch_fastpath.cpp), or None when it is off or cannot be built."""
    from . import native

    module = native.torch_fastpath()
    return None if module is None else module.prints


def prints3(a, b, c) -> tuple[tuple, tuple]:
    """(data pointers, fingerprint) of the three arrays of a call (the launch caches' keys take the fingerprint
    whole). Three torch tensors of one type are read by one function: the native reader's (a bytes object) for
    torch.Tensor and Parameter when it is built, else _torch_prints3's (a flat tuple); other arrays by their
    fingerprint()s (a tuple of tuples). The three forms never compare equal, so a key never mixes them."""
    cls = type(a)
    if cls is type(b) and cls is type(c):
        triple = _TRIPLE_PRINTERS.get(cls)
        if triple is None and cls not in _PRINTERS:  # a type not met yet: meet it (registers its printers)
            fingerprint(a)
            triple = _TRIPLE_PRINTERS.get(cls)
        if triple is not None:
            found = triple(a, b, c)
            if found is not None:  # None: the native reader does not take these tensors (e.g. sparse ones)
                return found
    (pa, fa), (pb, fb), (pc, fc) = fingerprint(a), fingerprint(b), fingerprint(c)
    return (pa, pb, pc), (fa, fb, fc)


def prints_of(arrays) -> tuple[tuple, tuple]:
    """(data pointers, fingerprints) of a launch's arrays in slot order (None for an empty slot): one native call
    when they are all plain torch tensors (or None) and the native reader is built, else each array's
    fingerprint(). The two forms never compare equal."""
    if _NATIVE_READER is not None:
        found = _NATIVE_READER(*arrays)
        if found is not None:
            return found
    return tuple(zip(*[(printer_of_type(type(t)) or fingerprint)(t) for t in arrays]))


_NATIVE_READER = None  # the native reader's prints, once torch tensors were met and it was built
_TRIPLE_PRINTERS: dict = {}  # type -> the function that fingerprints three arrays of it at once (prints3)
_PRINTERS: dict = {}
# type -> its fingerprint function (None until fingerprint() met the type): the launch caches' callers call
# `(printer_of_type(type(t)) or fingerprint)(t)`, one Python call per tensor instead of two
printer_of_type = _PRINTERS.get


def current_stream(obj: Any):
    """The current CUDA/HIP stream of the framework that owns obj (None: the default stream)."""
    return stream_getter(obj)()


def stream_getter(obj: Any) -> Callable[[], Any]:
    """A cheap function returning the current stream of obj's framework on obj's device, looked up at
    each launch (the caller may switch streams between launches)."""
    module = type(obj).__module__
    if module.startswith("torch"):
        import torch

        index = obj.device.index if obj.device.index is not None else torch.cuda.current_device()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # an int, without a Stream object
        if raw is not None:
            return lambda: raw(index) or None
        return lambda: torch.cuda.current_stream(index).cuda_stream or None
    if module.startswith("cupy"):
        import cupy

        return lambda: cupy.cuda.get_current_stream().ptr or None
    return lambda: None


def stream_now(obj: Any):
    """The current stream of obj's framework on obj's device (None: the default stream), cheaply. Part of the
    launch caches' keys on GPU backends: a launch prepared on one stream (with that stream's workspace) is never
    replayed on another."""
    getter = _STREAM_NOW.get(type(obj))
    if getter is None:
        getter = _STREAM_NOW.setdefault(type(obj), _stream_now_for(type(obj)))
    return getter(obj)


def _stream_now_for(cls) -> Callable[[Any], Any]:
    module = cls.__module__.split(".")[0]
    if module == "torch":
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # an int, without a Stream object
        if raw is not None:
            return lambda t: raw(t.get_device()) or None
        return lambda t: torch.cuda.current_stream(t.device).cuda_stream or None
    if module == "cupy":
        import cupy

        return lambda x: cupy.cuda.get_current_stream().ptr or None
    return lambda obj: None


_STREAM_NOW: dict = {}


class Plan:
    """Launch one kernel on one problem, again and again.

    The op module gives the tensors in td_args slot order (tensors_in_slot_order), checks them
    against the problem (operands_for) and fills td_args (make_args).
    """

    def __init__(self, registry, problem, kernel, *, stream=None, num_threads: int = 0, **scalars):
        check_num_threads(num_threads)
        self.registry, self.problem, self.kernel = registry, problem, kernel
        self.stream, self.num_threads, self.scalars = stream, num_threads, scalars
        self._ops = ops_get(problem.op)
        self._args: Optional[abi.TdArgs] = None
        self._prints: Optional[tuple] = None
        self._ptrs: Optional[tuple] = None  # the pointers in _args now
        self._run = kernel.library.launch
        self._reason = ctypes.create_string_buffer(abi.REASON_BYTES)
        self._grad_sensitive = False  # a torch tensor requires grad: launches need grad mode off

    def __call__(self, tensors: dict, prints: Optional[list] = None) -> None:
        """Launch once; tensors as the op's run() takes them (GEMM: a, b, out, c, bias, residuals).
        prints: their fingerprints in td_args slot order, when the caller has them already."""
        if prints is None:
            try:
                ptrs, fingerprints = prints_of(self._ops.tensors_in_slot_order(tensors))
            except Exception:
                self._ops.operands_for(self.problem, tensors)  # the full checks say what is wrong
                raise
        else:
            ptrs, fingerprints = zip(*prints)
        if self._args is None or fingerprints != self._prints:
            self._prepare(tensors, fingerprints)
        self.launch_pointers(ptrs)

    def launch(self) -> None:
        """Launch on the tensors prepare() bound."""
        self.launch_pointers(self._ptrs)

    @property
    def launch_stream(self) -> Optional[int]:
        """The stream the launch prepare() bound runs on (None on the cpu backend)."""
        return None if self._args is None else self._args.stream

    def launch_pointers(self, ptrs: tuple) -> None:
        """The fast path: the data pointers, in slot order, of tensors whose fingerprints equal the validated
        ones (the caller checked); only pointers that changed since the last launch are checked for overlap
        and written."""
        if self._grad_sensitive and _grad_enabled():
            raise InvalidInputError("a tensor requires grad and grad mode is on; tiledispatch does not record "
                                    "autograd, so run under torch.no_grad() or pass .detach()")
        if ptrs != self._ptrs:
            self._check_disjoint(ptrs)
            for slot, ptr in zip(self._slot_structs, ptrs):
                slot.data = ptr
            self._ptrs = ptrs
        if self._stream_of is not None:
            self._args.stream = self._stream_of()
        status = self._run(self._args_ref, self._reason, _REASON_BYTES)
        if status != abi.OK:
            self._raise(status)

    def launch_layout(self) -> Optional[tuple]:
        """The prepared launch as native.launcher takes it after the slot sources: td_run's address, the addresses
        of td_args and the reason buffer, the buffer's size, the written slot, its byte span, the read slots with
        theirs and the slot the output may alias exactly (-1: none). None when nothing is prepared. The addresses
        stay valid while self._args is this object (a failed launch or a new prepare replaces it)."""
        if self._args is None:
            return None
        return (ctypes.cast(self._run, ctypes.c_void_p).value, ctypes.addressof(self._args),
                ctypes.addressof(self._reason), abi.REASON_BYTES, self._written, tuple(self._w_span),
                tuple(self._reads), -1 if self._exact is None else self._exact)

    def _prepare(self, tensors: dict, fingerprints) -> None:
        self.prepare(self._ops.operands_for(self.problem, tensors))
        self._prints = fingerprints

    def prepare(self, operands) -> None:
        """Bind operands that passed the op's full checks (the op module's Operands): td_args, the kernel's
        own td_can_run, the byte spans for the overlap checks. Launch with launch_pointers."""
        self._args = self._prints = None
        args = bind(self.registry, self.problem, self.kernel, operands, stream=self.stream,
                    num_threads=self.num_threads, **self.scalars)
        # no explicit stream: launch on the current stream of the caller's framework, looked up per call
        follow = self.stream is None and self.registry.device != "cpu"
        self._stream_of = stream_getter(next(v.obj for v in operands.all())) if follow else None
        status, why = self.kernel.library.can_run(args)
        if status != abi.OK:
            raise_for_status(self.kernel, status, why)
        slots = args.num_tensors
        self._args, self._ptrs = args, tuple(args.tensors[i].data for i in range(slots))
        self._args_ref = ctypes.byref(args)
        self._slot_structs = [args.tensors[i] for i in range(slots)]
        self._footprints(args, slots)
        self._grad_sensitive = any(getattr(v.obj, "requires_grad", False) for v in operands.all())

    def pin_stream(self) -> None:
        """Launch on the stream the plan was prepared on, without looking up the current one per launch: for the
        launch caches' plans, whose keys hold the current stream (a cached plan is only found, and launched, while
        that stream is current)."""
        self._stream_of = None

    def set_scalars(self, alpha, beta) -> None:
        """Swap alpha and beta in the prepared arguments (checked as the first launch checks them). Whether
        beta is 0 must not change: it decides whether C is read, which the preparation checked."""
        alpha, beta = real_scalar("alpha", alpha), real_scalar("beta", beta)
        if (beta != 0) != (self.scalars.get("beta", 0.0) != 0):
            raise InvalidInputError("beta changed between zero and non-zero: prepare the plan again")
        self.scalars.update(alpha=alpha, beta=beta)
        if self._args is not None:
            self._args.scalars[0], self._args.scalars[1] = alpha, beta

    def _footprints(self, args: abi.TdArgs, slots: int) -> None:
        """Each tensor's byte span relative to its pointer, for _check_disjoint."""
        spans = []
        for i in range(slots):
            t = args.tensors[i]
            spans.append(span(t.shape[:t.rank], t.stride[:t.rank], BY_CODE[t.dtype].itemsize) if t.data else None)
        self._written, exact = self._ops.written_slots(self.problem)
        w = args.tensors[self._written]
        self._exact = exact if exact is not None and _same_view(args.tensors[exact], w) else None
        self._w_span = spans[self._written]
        self._reads = [(i, *sp) for i, sp in enumerate(spans) if sp is not None and i != self._written]
        self._slot_names = self._ops.slot_names(self.problem, slots)

    def _check_disjoint(self, ptrs: tuple) -> None:
        """The written tensor at its new pointer must not overlap a read one at its new pointer (the exact
        alias the op allows, C = D for GEMM, excepted)."""
        w = ptrs[self._written]
        w_lo, w_hi = w + self._w_span[0], w + self._w_span[1]
        for i, lo, hi in self._reads:
            p = ptrs[i]
            if p is not None and p + lo < w_hi and w_lo < p + hi and not (i == self._exact and p == w):
                raise InvalidInputError(f"{self._slot_names[self._written]} overlaps {self._slot_names[i]} in memory "
                                        f"(bytes [{w_lo:#x}, {w_hi:#x}) and [{p + lo:#x}, {p + hi:#x})): the kernel "
                                        f"would read values it has already overwritten; pass a separate output")

    def _raise(self, status: int) -> None:
        self._args = None  # the next call re-validates
        raise_for_status(self.kernel, status, self._reason.value.decode())


class Launcher:
    """A cached call of a public entry point: a prepared Plan, where its td_args slots take their pointers
    from (pick: a function of the caller's pointers + (None,); None when they are already in slot order) and
    the alpha / beta objects its arguments hold now."""
    __slots__ = ("plan", "pick", "alpha", "beta")

    def __init__(self, plan: Plan, alpha, beta, pick: Optional[Callable[[tuple], tuple]] = None):
        plan.pin_stream()
        self.plan, self.pick = plan, pick
        self.alpha, self.beta = alpha, beta  # the caller's objects, for an identity test on the next call

    def __call__(self, ptrs: tuple, alpha, beta) -> None:
        if alpha is not self.alpha or beta is not self.beta:  # checked and swapped only when they change
            self.plan.set_scalars(alpha, beta)
            self.alpha, self.beta = alpha, beta
        self.plan.launch_pointers(ptrs if self.pick is None else self.pick(ptrs + (None,)))


def replay(cache: "BoundedCache", key, launcher: Launcher, ptrs: tuple, alpha, beta) -> None:
    """A public call's fast path: launch the remembered call on the new pointers (the thread's last launcher from
    now on). Any failure (an overlap of the new pointers, say) forgets it, so the next call is checked in full."""
    _CALLS.launcher = launcher
    try:
        launcher(ptrs, alpha, beta)
    except BaseException:
        cache.discard(key)
        raise


# The Launcher of the calling thread's last public call (the cached one it reused, or the one it prepared): the
# torch layer keeps it under its own, cheaper key for calls whose tensors it passes on unchanged (torch.py, "the
# eager fast path")
_CALLS = threading.local()


def last_launcher() -> Optional[Launcher]:
    return getattr(_CALLS, "launcher", None)


class BoundedCache:
    """A mapping of at most `size` entries, with hit / miss counts, that drops the entries not used lately first:
    a second-chance clock (a hit marks its entry; eviction passes over a marked entry once, clearing the mark),
    which approximates least-recently-used without reordering on every hit, so a hit is one dictionary lookup.
    Safe to share between threads (a concurrent eviction is a miss, never an error)."""

    def __init__(self, size: int):
        self.size, self.hits, self.misses = size, 0, 0
        self._entries: OrderedDict = OrderedDict()  # key -> [value, used since the clock last passed it]

    def get(self, key):
        slot = self._entries.get(key)
        if slot is None:
            self.misses += 1
            return None
        slot[1] = True
        self.hits += 1
        return slot[0]

    def put(self, key, value) -> None:
        entries = self._entries
        entries.pop(key, None)
        entries[key] = [value, False]
        while len(entries) > self.size:
            try:
                old, slot = entries.popitem(last=False)
            except KeyError:  # emptied by another thread
                break
            if slot[1] or old is key:  # used since the last pass (or the entry just put): once more to the end
                slot[1] = False
                entries[old] = slot

    def values(self) -> list:
        """The values, oldest entry first."""
        return [slot[0] for slot in list(self._entries.values())]

    def discard(self, key) -> None:
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def info(self) -> dict:
        return {"entries": len(self._entries), "size": self.size, "hits": self.hits, "misses": self.misses}


def _same_view(a: abi.TdTensor, b: abi.TdTensor) -> bool:
    return a.rank == b.rank and all(a.shape[i] == b.shape[i] and a.stride[i] == b.stride[i] for i in range(a.rank))


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def bind(registry, problem, kernel, operands, *, stream=None, num_threads: int = 0, **scalars) -> abi.TdArgs:
    """td_args for one launch of kernel on checked operands: device, signature, stream and workspace."""
    check_num_threads(num_threads)
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int)):
        raise InvalidInputError(f"stream must be a raw CUDA/HIP stream handle (an int) or None, got {stream!r}")
    registry._check_device(operands)
    if registry.device != "cpu":  # the GPU kernels are not tested with negative strides
        for v in operands.all():
            if any(s < 0 for n, s in zip(v.shape, v.strides) if n > 1):
                raise InvalidInputError(f"strides {list(v.strides)}: negative strides are supported on the cpu "
                                        f"backend only; pass a copy")
    reason = problem.mismatch(kernel.key)
    if reason:
        raise UnsupportedProblemError(f"{kernel.name} cannot run {problem}: {reason}")
    ops = ops_get(problem.op)
    args = ops.make_args(problem, kernel.key, operands, **scalars)
    args.num_threads = num_threads
    first = next(v.obj for v in operands.all())
    args.stream = current_stream(first) if stream is None and registry.device != "cpu" else stream
    need = kernel.library.workspace_bytes(args)
    if need:
        args.workspace = registry.workspace(need, first, args.stream)
        args.workspace_bytes = need
    return args


def raise_for_status(kernel, status: int, reason: str) -> None:
    if status == abi.UNSUPPORTED:
        raise UnsupportedProblemError(f"{kernel.name}: {reason}")
    if status == abi.INVALID_ARGUMENT:
        raise InvalidInputError(f"{kernel.name}: {reason}")
    raise KernelRuntimeError(f"{kernel.name}: {reason}")
