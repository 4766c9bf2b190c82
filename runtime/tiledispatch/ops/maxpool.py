"""Max pooling over channels-last maps: the problem descriptor, its match against kernel keys, and binding arrays to
the C ABI.

y[n, o..., c] = max over the window's taps t of x[n, o * stride - pad + t * dilation, c], the taps outside the input
left out (as torch's implicit -inf padding; a NaN in a window gives NaN, as torch's). x is [N, spatial..., C]
(1 to 3 spatial dims), channels contiguous; the kernels see every problem as 3D, unit outer dims added. The output
size is torch's (F.max_pool1d/2d/3d, ceil_mode included).

ABI slots: 0 x [N, D, H, W, C], 1 y [N, Do, Ho, Wo, C] (written); params: the conv slots for the rank, stride,
dilation and low padding, abi.POOL_WINDOW + d the window.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import ClassVar, Optional

from .. import abi
from ..arrays import ArrayView, check_disjoint, check_writable, empty_like_device, view
from ..errors import InvalidInputError
from ..spec.dtypes import DTYPES, dtype
from ..spec.key import KernelKey
from .gemm import DUMMY_PTR, check_size, positive_int

GEOMETRY = ("window", "stride", "dilation", "padding")


@dataclass(frozen=True)
class MaxPoolProblem:
    """A rank-1..3 max pooling, stored as 3D (unit outer dims): sizes and geometry are 3-tuples, outermost first."""
    n: int
    c: int
    in_size: tuple
    out_size: tuple
    window: tuple
    stride: tuple
    dilation: tuple
    padding: tuple
    dtype: str
    rank: int = 2
    layout: str = "ndhwc"
    op: ClassVar[str] = "maxpool"

    def __post_init__(self):
        for name in ("n", "c", "rank"):
            object.__setattr__(self, name, positive_int(f"maxpool {name}", getattr(self, name)))
        for name, low in (("in_size", 1), ("out_size", 1), ("window", 1), ("stride", 1), ("dilation", 1),
                          ("padding", 0)):
            value = getattr(self, name)
            if (not isinstance(value, tuple) or len(value) != 3 or any(
                    isinstance(v, bool) or not isinstance(v, numbers.Integral) or not low <= v < 2**31 for v in value)):
                raise InvalidInputError(f"maxpool {name} must be 3 integers in {low} .. 2^31 - 1, got {value!r}")
        if self.dtype not in DTYPES:
            raise InvalidInputError(f"maxpool dtype: unknown dtype {self.dtype!r}")
        for role, size in (("x", self.in_size), ("y", self.out_size)):
            check_size(f"maxpool {role}", (self.n, *size, self.c), DTYPES[self.dtype].itemsize)

    def mismatch(self, key: KernelKey) -> Optional[str]:
        sig = key.signature
        if sig.op != "maxpool":
            return f"kernel computes {sig.op}, not maxpool"
        if sig.dtype_a != self.dtype:
            return f"kernel takes x as {sig.dtype_a}, problem has {self.dtype}"
        return None

    def __str__(self) -> str:
        dims = slice(3 - self.rank, 3)
        return (f"maxpool{self.rank}d n={self.n} c={self.c} in={list(self.in_size[dims])} window="
                f"{list(self.window[dims])} stride={list(self.stride[dims])} dilation={list(self.dilation[dims])} "
                f"padding={list(self.padding[dims])} out={list(self.out_size[dims])} {self.dtype}")

    def flops(self) -> int:
        """Comparisons: one per window tap and output element (an upper bound: taps in the padding are skipped)."""
        return self.n * self.c * math.prod(self.out_size) * math.prod(self.window)

    def gemm_shape(self) -> tuple[int, int, int, int]:
        """The ranker's view: the output pixels as m, the channels as n, the window's taps as the reduction."""
        return self.n * math.prod(self.out_size), self.c, math.prod(self.window), 1

    def to_dict(self) -> dict:
        return {"op": "maxpool", "rank": self.rank, "n": self.n, "c": self.c, "in_size": list(self.in_size),
                "out_size": list(self.out_size), "window": list(self.window), "stride": list(self.stride),
                "dilation": list(self.dilation), "padding": list(self.padding), "dtype": self.dtype}


def out_size(size: int, window: int, stride: int, dilation: int, padding: int, ceil_mode: bool) -> int:
    """torch's pooling output size along one dim (ceil_mode: the last window may run past the end, but must start
    inside the input or its low padding)."""
    span = size + 2 * padding - dilation * (window - 1) - 1
    out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _per_dim(name: str, value, rank: int, low: int) -> tuple:
    values = (value,) * rank if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    try:
        values = tuple(values)
    except TypeError:
        values = ()
    if len(values) != rank or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low
                                  for v in values):
        raise InvalidInputError(f"maxpool {name} must be an integer >= {low} or {rank} of them, got {value!r}")
    return tuple(int(v) for v in values)


def geometry(rank: int, in_size, window, stride=None, padding=0, dilation=1, ceil_mode: bool = False) -> dict:
    """The checked geometry of a rank-`rank` pooling (torch's conventions: stride defaults to the window, padding
    at most half the window), and its output size."""
    window = _per_dim("window", window, rank, 1)
    stride = window if stride is None else _per_dim("stride", stride, rank, 1)
    dilation = _per_dim("dilation", dilation, rank, 1)
    padding = _per_dim("padding", padding, rank, 0)
    if not isinstance(ceil_mode, bool):
        raise InvalidInputError(f"maxpool ceil_mode must be True or False, got {ceil_mode!r}")
    for d in range(rank):
        if 2 * padding[d] > window[d]:
            raise InvalidInputError(f"maxpool padding {padding[d]} is more than half the window {window[d]} "
                                    f"(dim {d}): windows would hold only padding")
    out = tuple(out_size(*args, ceil_mode) for args in zip(in_size, window, stride, dilation, padding))
    if min(out) < 1:
        raise InvalidInputError(f"maxpool of input {list(in_size)} with window {list(window)}, dilation "
                                f"{list(dilation)} and padding {list(padding)}: the output would be empty")
    return {"window": window, "stride": stride, "dilation": dilation, "padding": padding, "out_size": out}


def _as3d(v: tuple, fill: int, rank: int) -> tuple:
    return (fill,) * (3 - rank) + tuple(v)


def problem_of(n: int, c: int, in_size: tuple, dtype_name: str, window, stride=None, padding=0, dilation=1,
               ceil_mode: bool = False) -> MaxPoolProblem:
    """The MaxPoolProblem of a map [n, in_size..., c] pooled with torch's arguments (checked)."""
    rank = len(in_size)
    geo = geometry(rank, in_size, window, stride, padding, dilation, ceil_mode)
    return MaxPoolProblem(n, c, _as3d(in_size, 1, rank), _as3d(geo["out_size"], 1, rank), _as3d(geo["window"], 1, rank),
                          _as3d(geo["stride"], 1, rank), _as3d(geo["dilation"], 1, rank),
                          _as3d(geo["padding"], 0, rank), dtype_name, rank)


@dataclass
class Operands:
    """The caller's arrays as 5-D views [N, D, H, W, C]."""
    x: ArrayView
    y: ArrayView
    out: object

    def all(self) -> list[ArrayView]:
        return [self.x, self.y]

    def layout_key(self) -> tuple:
        return tuple((v.shape, v.strides, v.dtype, v.ptr & 15) for v in (self.x, self.y))


def _view5(v: ArrayView, rank: int) -> ArrayView:
    """[N, spatial..., C] as [N, D, H, W, C], unit dims added (their strides never used: any value is right)."""
    shape = (v.shape[0], *(1,) * (3 - rank), *v.shape[1:])
    strides = (v.strides[0], *(0,) * (3 - rank), *v.strides[1:])
    return ArrayView(v.ptr, shape, strides, v.dtype, v.device, v.obj)


def operands(x, window, stride=None, padding=0, dilation=1, ceil_mode: bool = False, out=None):
    """Check the arrays and geometry, and return (MaxPoolProblem, Operands); x is [N, spatial..., C]."""
    vx = view(x, "x")
    rank = vx.ndim - 2
    if not 1 <= rank <= 3:
        raise InvalidInputError(f"x must be [N, spatial..., C] with 1 to 3 spatial dims, got shape {list(vx.shape)}")
    if 0 in vx.shape:
        raise InvalidInputError(f"x has shape {list(vx.shape)}: every size must be >= 1")
    if vx.shape[-1] > 1 and vx.strides[-1] != 1:
        raise InvalidInputError(f"x's channels (its last dim) have stride {vx.strides[-1]}: they must be contiguous "
                                f"(a channels-last map)")
    problem = problem_of(vx.shape[0], vx.shape[-1], vx.shape[1:-1], vx.dtype, window, stride, padding, dilation,
                         ceil_mode)
    shape = (vx.shape[0], *problem.out_size[3 - rank:], vx.shape[-1])
    if out is None:
        out = empty_like_device(vx, shape, vx.dtype)
    vy = view(out, "out")
    if vy.shape != shape:
        raise InvalidInputError(f"out has shape {list(vy.shape)}, expected {list(shape)}")
    _check_pair(vx, vy)
    return problem, Operands(_view5(vx, rank), _view5(vy, rank), out)


def _check_pair(vx: ArrayView, vy: ArrayView) -> None:
    """What x and out must be to each other, their shapes aside."""
    check_writable(vy, "out")
    if vy.dtype != vx.dtype:
        raise InvalidInputError(f"out has dtype {vy.dtype}, expected x's {vx.dtype}")
    if vy.shape[-1] > 1 and vy.strides[-1] != 1:
        raise InvalidInputError(f"out's channels have stride {vy.strides[-1]}: they must be contiguous")
    if vx.device != vy.device:
        raise InvalidInputError(f"arrays live on different devices: {sorted({vx.device, vy.device})}")
    check_disjoint(vy, "out", [(vx, "x")])


def tensors_in_slot_order(tensors: dict) -> list:
    if not isinstance(tensors, dict):
        raise InvalidInputError(f"maxpool tensors are a dict {{x, out}}, got {type(tensors).__name__}")
    return [tensors.get("x"), tensors.get("out")]


def written_slots(problem: MaxPoolProblem) -> tuple[int, Optional[int]]:
    return 1, None


def slot_names(problem: MaxPoolProblem, count: int) -> list[str]:
    return ["x", "out"]


def operands_for(problem: MaxPoolProblem, tensors: dict) -> Operands:
    """Operands from a dict {x, out}, checked against the problem."""
    if not isinstance(tensors, dict) or set(tensors) != {"x", "out"}:
        raise InvalidInputError(f"maxpool tensors are a dict {{x, out}}, got "
                                f"{sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__}")
    dims = slice(3 - problem.rank, 3)
    vx, vy = view(tensors["x"], "x"), view(tensors["out"], "out")
    for v, role, size in ((vx, "x", problem.in_size), (vy, "out", problem.out_size)):
        want = (problem.n, *size[dims], problem.c)
        if v.shape != want or v.dtype != problem.dtype:
            raise InvalidInputError(f"{role} is {list(v.shape)} {v.dtype}; the problem {problem} needs {list(want)} "
                                    f"{problem.dtype}")
    if vx.shape[-1] > 1 and vx.strides[-1] != 1:
        raise InvalidInputError(f"x's channels have stride {vx.strides[-1]}: they must be contiguous")
    _check_pair(vx, vy)
    return Operands(_view5(vx, problem.rank), _view5(vy, problem.rank), tensors["out"])


def make_args(problem: MaxPoolProblem, key: KernelKey, ops: Optional[Operands] = None) -> abi.TdArgs:
    """The ABI arguments of the problem on these operands (dummy pointers and dense channels-last strides without)."""
    p = problem
    args = abi.TdArgs()
    args.abi_version = abi.ABI_VERSION
    args.num_tensors = 2
    code = dtype(key.signature.dtype_a).code
    for slot, role, size in ((0, "x", p.in_size), (1, "y", p.out_size)):
        shape = (p.n, *size, p.c)
        if ops is None:
            strides, ptr = [1] * 5, DUMMY_PTR
            for i in range(3, -1, -1):
                strides[i] = strides[i + 1] * shape[i + 1]
        else:
            v = getattr(ops, role)
            strides, ptr = v.strides, v.ptr
        abi.set_tensor(args.tensors[slot], ptr, code, shape, strides)
    args.params[abi.CONV_RANK] = p.rank
    for d in range(3):
        args.params[abi.CONV_STRIDE + d] = p.stride[d]
        args.params[abi.CONV_DILATION + d] = p.dilation[d]
        args.params[abi.CONV_PAD_LO + d] = p.padding[d]
        args.params[abi.POOL_WINDOW + d] = p.window[d]
    return args
