"""GEMM: the problem descriptor, its match against kernel keys, and binding arrays to the C ABI.

An op module provides: a frozen Problem (with the full signature, so matching happens before any
ranking), Problem.mismatch(key) -> reason or None, Problem.flops(), Operands (views of the caller's
arrays), operands(...) building them with every check, and make_args(problem, key, operands) filling
td_args (dummy pointers when operands is None, for can-run questions without data).
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from .. import abi
from ..arrays import INT64_MAX, ArrayView, check_disjoint, check_writable, empty_like_device, view
from ..errors import InvalidInputError
from ..spec.dtypes import DTYPES, dtype
from ..spec.key import ACTIVATIONS, Epilogue, KernelKey

DUMMY_PTR = 1 << 20  # aligned, never dereferenced: can-run checks look at shapes and strides only


@dataclass(frozen=True)
class GemmProblem:
    """D[batch, m, n] = act(alpha * A[batch, m, k] @ B[batch, k, n] + beta * C + bias + residuals).

    layout has one letter per operand A, B, D: r (row-major), c (column-major) or * (either: a
    dimension of size 1 makes both true).
    """
    m: int
    n: int
    k: int
    dtype_a: str
    dtype_b: str
    dtype_c: str
    layout: str = "rcr"
    batch: int = 1
    epilogue: Epilogue = field(default_factory=Epilogue)
    op: ClassVar[str] = "gemm"

    def __post_init__(self):
        for name in ("m", "n", "k", "batch"):
            object.__setattr__(self, name, positive_int(f"GEMM {name}", getattr(self, name)))
        for name in ("dtype_a", "dtype_b", "dtype_c"):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in DTYPES:
                raise InvalidInputError(f"GEMM {name}: unknown dtype {getattr(self, name)!r}")
        if not isinstance(self.layout, str) or len(self.layout) != 3 or any(ch not in "rc*" for ch in self.layout):
            raise InvalidInputError(f"GEMM layout must be three of r/c/* (A, B, D), got {self.layout!r}")
        if not isinstance(self.epilogue, Epilogue):
            raise InvalidInputError(f"GEMM epilogue must be an Epilogue, got {self.epilogue!r}")
        size = {r: DTYPES[getattr(self, f"dtype_{r}")].itemsize for r in "abc"}
        for role, rows, cols, itemsize in (("A", self.m, self.k, size["a"]), ("B", self.k, self.n, size["b"]),
                                           ("D", self.m, self.n, size["c"])):
            check_size(f"GEMM {role}", (self.batch, rows, cols), itemsize)

    def mismatch(self, key: KernelKey) -> Optional[str]:
        """Why the key's signature cannot serve this problem, or None when it can."""
        sig = key.signature
        if sig.op != "gemm":
            return f"kernel computes {sig.op}, not gemm"
        for role in ("a", "b", "c"):
            want, have = getattr(self, f"dtype_{role}"), getattr(sig, f"dtype_{role}")
            if want != have:
                return f"kernel takes {role.upper()} as {have}, problem has {want}"
        major = {"r": "row-major", "c": "column-major"}
        for i, operand in enumerate("ABD"):
            if self.layout[i] not in ("*", sig.layout[i]):
                return (f"kernel (layout {sig.layout}) takes {operand} {major[sig.layout[i]]}, "
                        f"problem has it {major[self.layout[i]]}")
        if sig.epilogue != self.epilogue:
            return f"kernel fuses {_epi(sig.epilogue)}, problem asks for {_epi(self.epilogue)}"
        return None

    def __str__(self) -> str:
        return (f"gemm m={self.m} n={self.n} k={self.k} batch={self.batch} "
                f"{self.dtype_a}/{self.dtype_b}->{self.dtype_c} layout {self.layout} epilogue {_epi(self.epilogue)}")

    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    def to_dict(self) -> dict:
        return {"op": "gemm", "m": self.m, "n": self.n, "k": self.k, "batch": self.batch, "layout": self.layout,
                "dtype_a": self.dtype_a, "dtype_b": self.dtype_b, "dtype_c": self.dtype_c,
                "epilogue": {"activation": self.epilogue.activation, "bias": self.epilogue.bias,
                             "residuals": self.epilogue.residuals}}


def positive_int(what: str, v) -> int:
    """v as an int >= 1 (Python or numpy integers; not bool, not float)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise InvalidInputError(f"{what} must be an integer >= 1, got {v!r}")
    return operator.index(v)


def check_size(what: str, shape, itemsize: int) -> None:
    """The elements and bytes of a dense tensor of this shape must fit the ABI's int64."""
    if math.prod(shape) * itemsize > INT64_MAX:
        raise InvalidInputError(f"{what} would have {' x '.join(map(str, shape))} elements of {itemsize} bytes: more "
                                f"than an int64 byte count holds")


def real_scalar(what: str, v, finite: bool = True) -> float:
    """v as a float: a real number (not bool), finite unless finite=False (then not NaN)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise InvalidInputError(f"{what} must be a real number, got {v!r}")
    f = float(v)
    if f != f or (finite and not math.isfinite(f)):
        raise InvalidInputError(f"{what} must be {'finite' if finite else 'a number (not NaN)'}, got {v!r}")
    return f


def clamp_pair(clamp) -> tuple[float, float]:
    """(low, high) with low <= high; each a number, +-inf meaning no bound."""
    try:
        low, high = clamp
    except (TypeError, ValueError):
        raise InvalidInputError(f"clamp must be a pair (low, high), got {clamp!r}") from None
    low, high = real_scalar("clamp low", low, finite=False), real_scalar("clamp high", high, finite=False)
    if low > high:
        raise InvalidInputError(f"clamp needs low <= high, got ({low}, {high})")
    return low, high


def _epi(e: Epilogue) -> str:
    return e.activation + (" + bias" if e.bias else "") + (f" + {e.residuals} residual(s)" if e.residuals else "")


@dataclass
class Operands:
    """The caller's arrays as 3-D views [batch, rows, cols]; c / bias may be None."""
    a: ArrayView
    b: ArrayView
    d: ArrayView
    c: Optional[ArrayView]
    bias: Optional[ArrayView]
    residuals: tuple[ArrayView, ...]
    out: object          # the caller's output object (returned by gemm())

    def all(self) -> list[ArrayView]:
        return [v for v in (self.a, self.b, self.c, self.d, self.bias, *self.residuals) if v is not None]

    def layout_key(self) -> tuple:
        """What td_can_run may look at besides the problem: each view's shape, strides, dtype and pointer
        alignment (None for an absent one), in slot order; the key of the registry's selection caches."""
        return tuple(None if v is None else (v.shape, v.strides, v.dtype, v.ptr & 15)
                     for v in (self.a, self.b, self.c, self.d, self.bias, *self.residuals))


def _as3d(v: ArrayView, role: str, rows: Optional[int] = None) -> ArrayView:
    if v.ndim == 2:
        return ArrayView(v.ptr, (1, *v.shape), (0, *v.strides), v.dtype, v.device, v.obj)
    if v.ndim == 3:
        return v
    raise InvalidInputError(f"{role} must be 2-D [rows, cols] or 3-D [batch, rows, cols], got shape {v.shape}")


def _layout_letters(v: ArrayView) -> str:
    """Which of r / c the strides of a [batch, rows, cols] view allow; '*' for both."""
    _, rows, cols = v.shape
    _, sr, sc = v.strides
    row_ok, col_ok = sc == 1 or cols == 1, sr == 1 or rows == 1
    return "*" if row_ok and col_ok else ("r" if row_ok else ("c" if col_ok else ""))


def operands(a, b, out=None, c=None, bias=None, residuals=(), activation: str = "identity"):
    """Check the arrays against each other and return (GemmProblem, Operands)."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise InvalidInputError(f"unknown activation {activation!r} (known: {', '.join(ACTIVATIONS)})")
    if not isinstance(residuals, (list, tuple)):
        raise InvalidInputError(f"residuals must be a list or tuple of arrays, got {type(residuals).__name__}")
    raw_a, raw_b = view(a, "A"), view(b, "B")
    for v, role in ((raw_a, "A"), (raw_b, "B")):
        if 0 in v.shape:
            raise InvalidInputError(f"{role} has shape {v.shape}: every size must be >= 1")
    va, vb = _as3d(raw_a, "A"), _as3d(raw_b, "B")
    batch_a, m, k = va.shape
    batch_b, kb, n = vb.shape
    if kb != k:
        raise InvalidInputError(f"A is {m}x{k} but B is {kb}x{n}: inner dimensions differ")
    if va.dtype != vb.dtype:
        raise InvalidInputError(f"A has dtype {va.dtype} but B has {vb.dtype}")
    batch = max(batch_a, batch_b)
    dtype_c = "int32" if va.dtype == "int8" else va.dtype
    if out is None:
        both_2d = raw_a.ndim == 2 and raw_b.ndim == 2
        out = empty_like_device(va, (m, n) if both_2d else (batch, m, n), dtype_c)
    raw_d = view(out, "out")
    check_writable(raw_d, "out")
    vd = _as3d(raw_d, "out")
    if vd.dtype != dtype_c and c is None:
        dtype_c = vd.dtype
    vc = _as3d(view(c, "C"), "C") if c is not None else None
    vbias = view(bias, "bias") if bias is not None else None
    vres = tuple(_as3d(view(r, f"residual {i}"), f"residual {i}") for i, r in enumerate(residuals))

    def check(v: ArrayView, role: str, rows: int, cols: int):
        if v.shape[1:] != (rows, cols) or v.shape[0] not in (1, batch):
            raise InvalidInputError(f"{role} has shape {v.shape[1:] if v.shape[0] == 1 else v.shape}, "
                                    f"expected [{rows}, {cols}]" + (f" with batch 1 or {batch}" if batch > 1 else ""))
        if v.dtype != dtype_c:
            raise InvalidInputError(f"{role} has dtype {v.dtype}, expected {dtype_c} (the output dtype)")

    if batch_a not in (1, batch) or batch_b not in (1, batch):
        raise InvalidInputError(f"A has batch {batch_a} and B has batch {batch_b}: they must match or be 1")
    check(vd, "out", m, n)
    if vd.shape[0] != batch:
        raise InvalidInputError(f"out has batch {vd.shape[0]}, expected {batch}")
    for v, role in ((vc, "C"), *((r, f"residual {i}") for i, r in enumerate(vres))):
        if v is not None:
            check(v, role, m, n)
    if vbias is not None:
        if vbias.ndim == 1:
            vbias = ArrayView(vbias.ptr, (1, *vbias.shape), (0, *vbias.strides), vbias.dtype, vbias.device, vbias.obj)
        if vbias.ndim != 2 or vbias.shape[1] != n or vbias.shape[0] not in (1, batch):
            raise InvalidInputError(f"bias has shape {vbias.shape}, expected [{n}] (or [batch, {n}])")
        if vbias.dtype != dtype_c:
            raise InvalidInputError(f"bias has dtype {vbias.dtype}, expected {dtype_c}")
    devices = {v.device for v in (va, vb, vd, vc, vbias, *vres) if v is not None}
    if len(devices) > 1:
        raise InvalidInputError(f"arrays live on different devices: {sorted(devices)}")
    layout = ""
    for v, role in ((va, "A"), (vb, "B"), (vd, "out")):
        letters = _layout_letters(v)
        if not letters:
            raise InvalidInputError(f"{role} has strides {v.strides[1:]} with no unit stride: make it contiguous")
        layout += letters
    check_disjoint(vd, "out", [(va, "A"), (vb, "B"), (vc, "C"), (vbias, "bias"),
                               *((r, f"residual {i}") for i, r in enumerate(vres))], exact_ok=("C",))
    epi = Epilogue(activation, bias is not None, len(vres))
    problem = GemmProblem(m, n, k, va.dtype, vb.dtype, dtype_c, layout, batch, epi)
    return problem, Operands(va, vb, vd, vc, vbias, vres, out)


def tensors_in_slot_order(tensors: dict) -> list:
    """The caller's objects in td_args slot order: A, B, C, D, bias, residuals."""
    if not isinstance(tensors, dict):
        raise InvalidInputError(f"GEMM tensors are a dict {{a, b, out, c?, bias?, residuals?}}, got {type(tensors).__name__}")
    return [tensors.get("a"), tensors.get("b"), tensors.get("c"), tensors.get("out"), tensors.get("bias"),
            *(tensors.get("residuals") or ())]


def written_slots(problem: GemmProblem) -> tuple[int, Optional[int]]:
    """The td_args slot the kernel writes (D) and the one slot that may be exactly the same tensor (C)."""
    return 3, 2


def slot_names(problem: GemmProblem, count: int) -> list[str]:
    return ["A", "B", "C", "out", "bias", *(f"residual {i}" for i in range(count - 5))]


def operands_for(problem: GemmProblem, tensors: dict) -> Operands:
    """Operands from a dict {a, b, out, c?, bias?, residuals?}, checked against the problem."""
    if not isinstance(tensors, dict):
        raise InvalidInputError(f"GEMM tensors are a dict {{a, b, out, c?, bias?, residuals?}}, got {type(tensors).__name__}")
    unknown = set(tensors) - {"a", "b", "out", "c", "bias", "residuals"}
    if unknown or not {"a", "b", "out"} <= set(tensors):
        raise InvalidInputError(f"GEMM tensors are a, b, out and optionally c, bias, residuals; got {sorted(tensors)}")
    found, ops = operands(tensors["a"], tensors["b"], tensors["out"], tensors.get("c"), tensors.get("bias"),
                          tensors.get("residuals", ()), problem.epilogue.activation)
    same = ("m", "n", "k", "batch", "dtype_a", "dtype_b", "dtype_c", "epilogue")
    if any(getattr(found, f) != getattr(problem, f) for f in same) or any(
            want not in ("*", got) and got != "*" for want, got in zip(problem.layout, found.layout)):
        raise InvalidInputError(f"the tensors describe {found}, but the problem is {problem}")
    return ops


def _dense(batch: int, rows: int, cols: int, letter: str) -> tuple:
    if letter == "c":
        return (rows * cols, 1, rows)
    return (rows * cols, cols, 1)


def _fit_strides(v: ArrayView, letter: str, batch: int) -> tuple:
    """Strides for the ABI: broadcast batch 1, and for a size-1 dimension the unit stride the kernel's
    layout asks for (any stride is correct there)."""
    sb, sr, sc = v.strides
    _, rows, cols = v.shape
    if v.shape[0] == 1 and batch > 1:
        sb = 0
    if letter == "r" and cols == 1:
        sc = 1
    if letter == "c" and rows == 1:
        sr = 1
    return (sb, sr, sc)


def make_args(problem: GemmProblem, key: KernelKey, ops: Optional[Operands] = None, *, alpha: float = 1.0,
              beta: float = 0.0, clamp: tuple[float, float] = (float("-inf"), float("inf")),
              raster: int = 0, swizzle: int = 0) -> abi.TdArgs:
    """The ABI arguments of the problem on these operands (dummy pointers without). Reads only key.signature:
    Registry._explain shares one set of arguments among the kernels of a signature."""
    alpha, beta = real_scalar("alpha", alpha), real_scalar("beta", beta)
    clamp = clamp_pair(clamp)
    sig = key.signature
    p = problem
    args = abi.TdArgs()
    args.abi_version = abi.ABI_VERSION
    args.num_tensors = 5 + sig.epilogue.residuals
    code = {role: dtype(getattr(sig, f"dtype_{role}")).code for role in "abc"}
    shapes = {"a": (p.batch, p.m, p.k), "b": (p.batch, p.k, p.n), "c": (p.batch, p.m, p.n), "d": (p.batch, p.m, p.n)}
    letters = {"a": sig.layout[0], "b": sig.layout[1], "c": sig.layout[2], "d": sig.layout[2]}
    for slot, role in enumerate("abcd"):
        v = getattr(ops, role) if ops is not None else None
        if ops is None:
            ptr = DUMMY_PTR if role != "c" or beta != 0 else None
            strides = _dense(*shapes[role], letters[role])
        elif v is None:
            ptr, strides = None, _dense(*shapes[role], letters[role])
        else:
            ptr, strides = v.ptr, _fit_strides(v, letters[role], p.batch)
        abi.set_tensor(args.tensors[slot], ptr, code["c" if role == "d" else role], shapes[role], strides)
    if ops is not None and ops.bias is not None:
        sb = 0 if ops.bias.shape[0] == 1 else ops.bias.strides[0]
        abi.set_tensor(args.tensors[4], ops.bias.ptr, code["c"], (p.batch, p.n), (sb, ops.bias.strides[1]))
    else:
        ptr = DUMMY_PTR if (ops is None and sig.epilogue.bias) else None
        abi.set_tensor(args.tensors[4], ptr, code["c"], (p.batch, p.n), (0, 1))
    for i in range(sig.epilogue.residuals):
        slot = args.tensors[5 + i]
        if ops is None:
            abi.set_tensor(slot, DUMMY_PTR, code["c"], shapes["d"], _dense(*shapes["d"], "r"))
        else:
            r = ops.residuals[i]
            abi.set_tensor(slot, r.ptr, code["c"], shapes["d"], _fit_strides(r, "r", p.batch))
    args.scalars[0], args.scalars[1] = alpha, beta
    args.scalars[2], args.scalars[3] = clamp
    args.params[0], args.params[1] = raster, swizzle
    return args
