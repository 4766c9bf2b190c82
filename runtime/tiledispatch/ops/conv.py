"""Grouped convolution: the problem descriptor, its match against kernel keys, and binding arrays to the C ABI.

Same interface as ops/gemm.py: a frozen ConvProblem carrying the full signature, mismatch(key),
flops(), gemm_shape() for the rankers, Operands, operands(...) building both with every check, and
make_args(problem, key, operands) filling td_args (dummy pointers when operands is None).

Arrays come in one of two forms, chosen by the caller with `groups`:
  groups=None  explicit group axis (the ABI's form): x [N, in..., G, C/G], w [G, K/G, filter..., C/G],
               y [N, out..., G, K/G]
  groups=G     the frameworks' logical form: x [N, C, in...], w [K, C/G, filter...], y [N, K, out...];
               torch channels_last (or channels_last_3d) tensors hold exactly the explicit-axis memory, so
               they are used in place. Channels must be contiguous (unit stride): a plain NCHW tensor is
               refused with a reason, never copied behind the caller's back.
"""
from __future__ import annotations

import numbers
import operator
import threading
from dataclasses import dataclass, field
from math import prod
from operator import itemgetter
from typing import ClassVar, Optional, Sequence, Union

import numpy as np

from .. import abi
from ..arrays import ArrayView, check_disjoint, check_writable, empty_like_device, view
from ..errors import InvalidInputError, UnsupportedProblemError
from ..spec.dtypes import DTYPES, dtype
from ..spec.key import ACTIVATIONS, CONV_LAYOUTS, DIRECTIONS, Epilogue, KernelKey
from .gemm import _epi, check_size, clamp_pair, real_scalar
from ..plan import _CALLS, Launcher, fingerprint, prints3, replay, stream_now

_thread_id = threading.get_ident

DUMMY_PTR = 1 << 20  # aligned, never dereferenced: can-run checks look at shapes and strides only
CONV_DIRECTIONS = DIRECTIONS[1:]
# the tensor each direction writes: X (bwd_data), W (bwd_weight) or Y (fwd)
WRITES = {"fwd": "y", "bwd_data": "x", "bwd_weight": "w"}

IntOrSeq = Union[int, Sequence[int]]
# stride, dilation and padding are bounded so that the kernels' products of them (e.g. pixels x stride) fit an
# int64 (the cpu kernels refuse larger ones too: templates/cpu/_conv_common.j2 MAX_GEOMETRY)
MAX_GEOMETRY = 2**31 - 1
# a fused forward epilogue adds at most this many residual tensors (td_args holds X, W, Y, bias and 4 more)
MAX_RESIDUALS = 4
NO_CLAMP = (float("-inf"), float("inf"))


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_spans(in_size, filter_size, dilation, pad_lo, pad_hi) -> None:
    """Every padded input dim at least as wide as the dilated filter (an output of at least one element)."""
    for d, (i, f, dl, lo, hi) in enumerate(zip(in_size, filter_size, dilation, pad_lo, pad_hi)):
        if i + lo + hi - dl * (f - 1) < 1:
            raise InvalidInputError(f"conv spatial dim {d}: padded input {i} + {lo} + {hi} is smaller than the "
                                    f"dilated filter {dl * (f - 1) + 1}")


def _ints(name: str, value, rank: int, low: int, high: Optional[int] = None) -> tuple[int, ...]:
    """An int (every dim) or rank ints, each in [low, high]."""
    if _is_int(value):
        values = (value,) * rank
    elif isinstance(value, (tuple, list)):
        values = tuple(value)
    else:
        values = ()
    if len(values) != rank or not all(_is_int(v) for v in values):
        raise InvalidInputError(f"conv {name} must be an integer or {rank} integers (one per spatial dim), got {value!r}")
    values = tuple(operator.index(v) for v in values)
    if any(v < low for v in values):
        raise InvalidInputError(f"conv {name} must be >= {low} in every spatial dim, got {list(values)}")
    if high is not None and any(v > high for v in values):
        raise InvalidInputError(f"conv {name} must be <= {high} in every spatial dim, got {list(values)}")
    return values


@dataclass(frozen=True)
class ConvProblem:
    """One grouped convolution: direction, sizes, geometry and dtypes.

    c and k are total channels (divisible by g); in_size, filter_size, stride, dilation, pad_lo and
    pad_hi have one value per spatial dim, outermost first (1D: W; 2D: H, W; 3D: D, H, W).
    dtype_x / dtype_w / dtype_y are the dtypes of X, W, Y (the key's dtype_a / dtype_b / dtype_c).
    """
    direction: str
    n: int
    g: int
    c: int
    k: int
    in_size: tuple[int, ...]
    filter_size: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    pad_lo: tuple[int, ...]
    pad_hi: tuple[int, ...]
    dtype_x: str
    dtype_w: str
    dtype_y: str
    layout: str = "nhwgc"
    epilogue: Epilogue = field(default_factory=Epilogue)
    op: ClassVar[str] = "conv"

    def __post_init__(self):
        if self.direction not in CONV_DIRECTIONS:
            raise InvalidInputError(f"conv direction must be one of {', '.join(CONV_DIRECTIONS)}, got {self.direction!r}")
        for name in ("n", "g", "c", "k"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise InvalidInputError(f"conv {name.upper()} must be an integer >= 1, got {v!r}")
            object.__setattr__(self, name, operator.index(v))
        for name in ("c", "k"):
            if getattr(self, name) % self.g:
                raise InvalidInputError(f"conv groups G = {self.g} do not divide {name.upper()} = {getattr(self, name)}")
        if not isinstance(self.in_size, (tuple, list)) or len(self.in_size) not in (1, 2, 3):
            raise InvalidInputError(f"conv in_size needs 1, 2 or 3 spatial sizes, got {self.in_size!r}")
        rank = len(self.in_size)
        for name, low, high in (("in_size", 1, None), ("filter_size", 1, None), ("stride", 1, MAX_GEOMETRY),
                                ("dilation", 1, MAX_GEOMETRY), ("pad_lo", 0, MAX_GEOMETRY), ("pad_hi", 0, MAX_GEOMETRY)):
            object.__setattr__(self, name, _ints(name, getattr(self, name), rank, low, high))
        for name in ("dtype_x", "dtype_w", "dtype_y"):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in DTYPES:
                raise InvalidInputError(f"conv {name}: unknown dtype {getattr(self, name)!r}")
        if not isinstance(self.layout, str) or self.layout not in CONV_LAYOUTS:
            raise InvalidInputError(f"conv layout must be one of {', '.join(CONV_LAYOUTS)}, got {self.layout!r}")
        if not isinstance(self.epilogue, Epilogue):
            raise InvalidInputError(f"conv epilogue must be an Epilogue, got {self.epilogue!r}")
        check_spans(self.in_size, self.filter_size, self.dilation, self.pad_lo, self.pad_hi)
        for role, shape in self.shapes().items():
            check_size(f"conv {role}", shape, DTYPES[getattr(self, f"dtype_{role}")].itemsize)

    # -- derived sizes ----------------------------------------------------------------------------
    @property
    def dtype_a(self) -> str:  # the key's names for X, W, Y (shared code reads problems of any op)
        return self.dtype_x

    @property
    def dtype_b(self) -> str:
        return self.dtype_w

    @property
    def dtype_c(self) -> str:
        return self.dtype_y

    @property
    def spatial_dims(self) -> int:
        return len(self.in_size)

    @property
    def out_size(self) -> tuple[int, ...]:
        return tuple((i + lo + hi - d * (f - 1) - 1) // s + 1 for i, f, s, d, lo, hi in
                     zip(self.in_size, self.filter_size, self.stride, self.dilation, self.pad_lo, self.pad_hi))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Explicit-group-axis shapes of X, W and Y."""
        cg, kg = self.c // self.g, self.k // self.g
        return {"x": (self.n, *self.in_size, self.g, cg), "w": (self.g, kg, *self.filter_size, cg),
                "y": (self.n, *self.out_size, self.g, kg)}

    def flops(self) -> int:
        return 2 * self.n * prod(self.out_size) * self.k * (self.c // self.g) * prod(self.filter_size)

    def gemm_shape(self, key: Optional[KernelKey] = None) -> tuple[int, int, int, int]:
        """(m, n, k, batch) of the GEMM the direction performs: one per group (batch G); for a key, the view of
        its kernel family (its module's gemm_view: e.g. the channels of all groups as lanes, per-tap padding)."""
        if key is not None:
            from .. import backends

            return backends.family_of(key).gemm_view(self, key)
        cg, kg, taps = self.c // self.g, self.k // self.g, prod(self.filter_size)
        if self.direction == "fwd":
            return self.n * prod(self.out_size), kg, taps * cg, self.g
        if self.direction == "bwd_data":
            return self.n * prod(self.in_size), cg, taps * kg, self.g
        return kg, taps * cg, self.n * prod(self.out_size), self.g

    def lanes_gemm(self, out_pixels: int, in_pixels: int) -> tuple[int, int, int, int]:
        """(m, n, k, 1) of a kernel whose lanes are the channels of all groups (one GEMM with G x channels
        columns), given the pixels it computes over the output and over the input images."""
        cg, kg, taps = self.c // self.g, self.k // self.g, prod(self.filter_size)
        if self.direction == "fwd":
            return out_pixels, self.k, taps * cg, 1
        if self.direction == "bwd_data":
            return in_pixels, self.c, taps * kg, 1
        return taps * cg, self.k, out_pixels, 1

    # -- matching ---------------------------------------------------------------------------------
    def mismatch(self, key: KernelKey) -> Optional[str]:
        """Why the key's signature cannot serve this problem, or None when it can."""
        sig = key.signature
        if sig.op != "conv":
            return f"kernel computes {sig.op}, not conv"
        if sig.direction != self.direction:
            return f"kernel computes conv {sig.direction}, problem is conv {self.direction}"
        if sig.spatial_dims != self.spatial_dims:
            return f"kernel is a {sig.spatial_dims}D convolution, problem is {self.spatial_dims}D"
        for role, mine in (("a", "x"), ("b", "w"), ("c", "y")):
            want, have = getattr(self, f"dtype_{mine}"), getattr(sig, f"dtype_{role}")
            if want != have:
                return f"kernel takes {mine.upper()} as {have}, problem has {want}"
        if sig.layout != self.layout:
            return f"kernel has layout {sig.layout}, problem has {self.layout}"
        if sig.epilogue != self.epilogue:
            return f"kernel fuses epilogue {_epi(sig.epilogue)}, problem asks for {_epi(self.epilogue)}"
        return None

    def __str__(self) -> str:
        def dims(t):
            return "x".join(map(str, t))
        return (f"conv{self.spatial_dims}d {self.direction} N={self.n} G={self.g} C={self.c} K={self.k} "
                f"in={dims(self.in_size)} filter={dims(self.filter_size)} stride={dims(self.stride)} "
                f"dilation={dims(self.dilation)} pad={dims(self.pad_lo)}/{dims(self.pad_hi)} "
                f"{self.dtype_x}/{self.dtype_w}->{self.dtype_y} {self.layout}"
                + ("" if self.epilogue == Epilogue() else f" epilogue {_epi(self.epilogue)}"))

    def to_dict(self) -> dict:
        return {"op": "conv", "direction": self.direction, "spatial_dims": self.spatial_dims, "n": self.n,
                "g": self.g, "c": self.c, "k": self.k, "in_size": list(self.in_size),
                "filter_size": list(self.filter_size), "stride": list(self.stride), "dilation": list(self.dilation),
                "pad_lo": list(self.pad_lo), "pad_hi": list(self.pad_hi), "dtype_x": self.dtype_x,
                "dtype_w": self.dtype_w, "dtype_y": self.dtype_y, "layout": self.layout,
                "epilogue": {"activation": self.epilogue.activation, "bias": self.epilogue.bias,
                             "residuals": self.epilogue.residuals}}


@dataclass
class Operands:
    """Explicit-group-axis views of X, W, Y; `out` is the caller's object for the written tensor. A fused forward
    epilogue adds the bias [G, K/G] (or None) and the residuals, each shaped like Y."""
    x: ArrayView
    w: ArrayView
    y: ArrayView
    out: object
    bias: Optional[ArrayView] = None
    residuals: tuple[ArrayView, ...] = ()

    def all(self) -> list[ArrayView]:
        return [v for v in (self.x, self.w, self.y, self.bias, *self.residuals) if v is not None]

    def layout_key(self) -> tuple:
        """What td_can_run may look at besides the problem: each view's shape, strides, dtype and pointer
        alignment (None for an absent bias), in slot order; the key of the registry's selection caches."""
        return tuple(None if v is None else (v.shape, v.strides, v.dtype, v.ptr & 15)
                     for v in (self.x, self.w, self.y, self.bias, *self.residuals))


# -- array forms ------------------------------------------------------------------------------------
def _explicit(v: ArrayView, role: str, groups: Optional[int], rank: int) -> ArrayView:
    """The explicit-group-axis view of v (role x, w or y); logical NC... tensors are re-strided, not copied."""
    if groups is None:
        if v.ndim != rank + 3:
            raise InvalidInputError(f"{role} has shape {list(v.shape)}: a {rank}D convolution with an explicit group "
                                    f"axis takes rank {rank + 3} ({_FORMS[role][0]})")
        return v
    if v.ndim != rank + 2:
        raise InvalidInputError(f"{role} has shape {list(v.shape)}: with groups={groups}, a {rank}D convolution takes "
                                f"rank {rank + 2} ({_FORMS[role][1]})")
    lead, chan = v.shape[0], v.shape[1]
    s_lead, s_chan = v.strides[0], v.strides[1]
    sp, s_sp = v.shape[2:], v.strides[2:]
    if role == "w":  # [K, C/G, filter...] -> [G, K/G, filter..., C/G]
        if lead % groups:
            raise InvalidInputError(f"w has K = {lead} output channels, not divisible by groups = {groups}")
        shape = (groups, lead // groups, *sp, chan)
        strides = ((lead // groups) * s_lead, s_lead, *s_sp, s_chan)
    else:            # [N, C, spatial...] -> [N, spatial..., G, C/G]
        if chan % groups:
            raise InvalidInputError(f"{role} has {chan} channels, not divisible by groups = {groups}")
        shape = (lead, *sp, groups, chan // groups)
        strides = (s_lead, *s_sp, (chan // groups) * s_chan, s_chan)
    return ArrayView(v.ptr, shape, strides, v.dtype, v.device, v.obj)


_FORMS = {"x": ("[N, in..., G, C/G]", "[N, C, in...]"), "w": ("[G, K/G, filter..., C/G]", "[K, C/G, filter...]"),
          "y": ("[N, out..., G, K/G]", "[N, K, out...]")}


def _logical_shape(shape: tuple[int, ...], role: str, groups: Optional[int]) -> tuple[int, ...]:
    """The caller's shape for an explicit-axis shape (to allocate an output in the caller's form)."""
    if groups is None:
        return shape
    if role == "w":
        return (shape[0] * shape[1], shape[-1], *shape[2:-1])
    return (shape[0], shape[-2] * shape[-1], *shape[1:-2])


def _allocate(like: ArrayView, role: str, explicit_shape: tuple[int, ...], dtype_name: str, groups: Optional[int]):
    """A new output whose memory is the explicit-axis layout, in the caller's form."""
    new = empty_like_device(like, explicit_shape, dtype_name, role)
    if groups is None:
        return new
    rank = len(explicit_shape) - 3
    # w [G, K/G, f..., C/G] -> [G, K/G, C/G, f...]; x, y [N, sp..., G, C/G] -> [N, G, C/G, sp...]; then
    # merge the two leading channel axes: a view (no copy) of a channels-last tensor [K, C/G, f...] / [N, C, sp...]
    perm = (0, 1, rank + 2, *range(2, rank + 2)) if role == "w" else (0, rank + 1, rank + 2, *range(1, rank + 1))
    moved = new.permute(*perm) if hasattr(new, "permute") else new.transpose(perm)
    return moved.reshape(_logical_shape(explicit_shape, role, groups))


def operands(direction: str, x=None, w=None, y=None, *, stride: IntOrSeq = 1, dilation: IntOrSeq = 1,
             padding: Optional[IntOrSeq] = None, pad_lo: Optional[IntOrSeq] = None,
             pad_hi: Optional[IntOrSeq] = None, groups: Optional[int] = None,
             in_size: Optional[Sequence[int]] = None, filter_size: Optional[Sequence[int]] = None,
             spatial_dims: Optional[int] = None, bias=None, residuals=(), activation: str = "identity"):
    """Check the arrays against each other and return (ConvProblem, Operands).

    fwd reads x and w and writes y; bwd_data reads y (dY) and w and writes x (dX); bwd_weight reads x
    and y (dY) and writes w (dW). The written array may be None: it is allocated (in the caller's
    form), and bwd_data then needs in_size, bwd_weight filter_size. padding is symmetric; pad_lo and
    pad_hi give the two sides (asymmetric); each is an int (every dim) or one int per spatial dim.
    The fused epilogue (fwd only): Y = act(alpha * conv + beta * Y + bias[k] + sum(residuals)), bias of K values
    ([K], or [G, K/G] with the explicit group axis) and residuals in Y's form and shape, all of Y's dtype.
    """
    if direction not in CONV_DIRECTIONS:
        raise InvalidInputError(f"conv direction must be one of {', '.join(CONV_DIRECTIONS)}, got {direction!r}")
    epilogue = _epilogue(direction, bias, residuals, activation)
    written = WRITES[direction]
    given = {"x": x, "w": w, "y": y}
    for role in ("x", "w", "y"):
        if role != written and given[role] is None:
            raise InvalidInputError(f"conv {direction} needs {role} ({_FORMS[role][0 if groups is None else 1]})")
    if groups is not None and (not isinstance(groups, int) or isinstance(groups, bool) or groups < 1):
        raise InvalidInputError(f"groups must be an integer >= 1 (or None for the explicit group axis), got {groups!r}")
    raw = {role: view(a, role) for role, a in given.items() if a is not None}
    first = raw["w"] if "w" in raw else raw["x"]
    rank = spatial_dims or first.ndim - (3 if groups is None else 2)
    if rank not in (1, 2, 3):
        raise InvalidInputError(f"{'w' if 'w' in raw else 'x'} has shape {list(first.shape)}: that is no 1D, 2D or "
                                f"3D convolution operand")
    v = {role: _explicit(a, role, groups, rank) for role, a in raw.items()}
    if padding is not None and (pad_lo is not None or pad_hi is not None):
        raise InvalidInputError("give either padding (symmetric) or pad_lo / pad_hi, not both")
    lo = padding if padding is not None else (pad_lo if pad_lo is not None else 0)
    hi = padding if padding is not None else (pad_hi if pad_hi is not None else 0)
    geo = {"stride": stride, "dilation": dilation, "pad_lo": lo, "pad_hi": hi}

    # sizes from the read arrays, then the written one (given or allocated) is checked against them
    if direction == "fwd":
        n, sp_in, g, cg = v["x"].shape[0], v["x"].shape[1:-2], v["x"].shape[-2], v["x"].shape[-1]
        kg, filt = v["w"].shape[1], v["w"].shape[2:-1]
    elif direction == "bwd_data":
        n, g, kg = v["y"].shape[0], v["y"].shape[-2], v["y"].shape[-1]
        cg, filt = v["w"].shape[-1], v["w"].shape[2:-1]
        if "x" in v:
            sp_in = v["x"].shape[1:-2]
        elif in_size is None:
            raise InvalidInputError("conv bwd_data without an output array needs in_size (the input's spatial sizes)")
        else:
            sp_in = _ints("in_size", in_size, rank, 1)
    else:
        n, sp_in, g, cg = v["x"].shape[0], v["x"].shape[1:-2], v["x"].shape[-2], v["x"].shape[-1]
        kg = v["y"].shape[-1]
        if "w" in v:
            filt = v["w"].shape[2:-1]
        elif filter_size is None:
            raise InvalidInputError("conv bwd_weight without an output array needs filter_size")
        else:
            filt = _ints("filter_size", filter_size, rank, 1)
    dts = {role: a.dtype for role, a in v.items()}
    dt_default = next(iter(dts.values()))
    problem = ConvProblem(direction, n, g, cg * g, kg * g, tuple(sp_in), tuple(filt), **geo,
                          dtype_x=dts.get("x", dt_default), dtype_w=dts.get("w", dt_default),
                          dtype_y=dts.get("y", dt_default), epilogue=epilogue)
    shapes = problem.shapes()
    if written not in v:
        out = _allocate(v[next(iter(v))], written, shapes[written], dt_default, groups)
        v[written] = _explicit(view(out, written), written, groups, rank)
    else:
        out = given[written]
    for role in ("x", "w", "y"):
        if tuple(v[role].shape) != shapes[role]:
            got = list(raw[role].shape) if role in raw else list(v[role].shape)
            want = list(_logical_shape(shapes[role], role, groups))
            raise InvalidInputError(f"{role} has shape {got}, expected {want} ({_FORMS[role][0 if groups is None else 1]}) "
                                    f"for {problem}")
        if v[role].shape[-1] > 1 and v[role].strides[-1] != 1:
            hint = " (use a channels_last tensor)" if groups is not None else ""
            raise InvalidInputError(f"{role} must have contiguous channels (unit stride along C/G or K/G); its "
                                    f"strides are {list(raw[role].strides if role in raw else v[role].strides)}{hint}")
    vbias = _bias_view(bias, problem) if bias is not None else None
    vres = tuple(_residual_view(r, i, problem, groups, rank) for i, r in enumerate(residuals))
    devices = {a.device for a in (*v.values(), vbias, *vres) if a is not None}
    if len(devices) > 1:
        raise InvalidInputError(f"arrays live on different devices: {sorted(devices)}")
    if written in raw:
        check_writable(raw[written], written)
    check_disjoint(v[written], written, [(v[role], role) for role in ("x", "w", "y") if role != written]
                   + [(vbias, "bias")] + [(r, f"residual {i}") for i, r in enumerate(vres)])
    return problem, Operands(v["x"], v["w"], v["y"], out, vbias, vres)


def _epilogue(direction: str, bias, residuals, activation) -> Epilogue:
    """The fused epilogue a call asks for; the backward directions take none."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise InvalidInputError(f"unknown activation {activation!r} (known: {', '.join(ACTIVATIONS)})")
    if not isinstance(residuals, (list, tuple)):
        raise InvalidInputError(f"residuals must be a list or tuple of arrays, got {type(residuals).__name__}")
    if len(residuals) > MAX_RESIDUALS:
        raise InvalidInputError(f"a conv epilogue adds at most {MAX_RESIDUALS} residuals, got {len(residuals)}")
    if any(r is None for r in residuals):
        raise InvalidInputError("residuals must be arrays, got None among them")
    epilogue = Epilogue(activation, bias is not None, len(residuals))
    if direction != "fwd" and epilogue != Epilogue():
        raise InvalidInputError(f"conv {direction} takes no fused epilogue (bias, residuals, activation): fused "
                                f"epilogues are forward only")
    return epilogue


def _bias_view(bias, problem: ConvProblem) -> ArrayView:
    """The bias as [G, K/G]: given as K values ([K]) or with the explicit group axis ([G, K/G])."""
    b = view(bias, "bias")
    g, kg = problem.g, problem.k // problem.g
    if b.ndim == 1 and b.shape[0] == problem.k:
        b = ArrayView(b.ptr, (g, kg), (kg * b.strides[0], b.strides[0]), b.dtype, b.device, b.obj)
    elif b.ndim != 2 or b.shape != (g, kg):
        raise InvalidInputError(f"bias has shape {list(b.shape)}, expected [{problem.k}] (K output channels) or "
                                f"[{g}, {kg}] ([G, K/G])")
    if b.dtype != problem.dtype_y:
        raise InvalidInputError(f"bias has dtype {b.dtype}, expected {problem.dtype_y} (the output dtype)")
    return b


def _residual_view(r, i: int, problem: ConvProblem, groups: Optional[int], rank: int) -> ArrayView:
    """Residual i in the explicit-group-axis form, checked: Y's shape, dtype and contiguous channels."""
    role = f"residual {i}"
    raw = view(r, role)
    v = _explicit(raw, "y", groups, rank)
    want = problem.shapes()["y"]
    if tuple(v.shape) != want:
        raise InvalidInputError(f"{role} has shape {list(raw.shape)}, expected Y's "
                                f"{list(_logical_shape(want, 'y', groups))} ({_FORMS['y'][0 if groups is None else 1]})")
    if v.dtype != problem.dtype_y:
        raise InvalidInputError(f"{role} has dtype {v.dtype}, expected {problem.dtype_y} (the output dtype)")
    if v.shape[-1] > 1 and v.strides[-1] != 1:
        hint = " (use a channels_last tensor)" if groups is not None else ""
        raise InvalidInputError(f"{role} must have contiguous channels (unit stride along K/G); its strides are "
                                f"{list(raw.strides)}{hint}")
    return v


def tensors_in_slot_order(tensors: dict) -> list:
    """The caller's objects in td_args slot order: X, W, Y, then (a fused epilogue) bias and residuals."""
    if not isinstance(tensors, dict):
        raise InvalidInputError(f"conv tensors are a dict {{x, w, y, bias?, residuals?}}, got {type(tensors).__name__}")
    fused = [tensors.get("bias"), *(tensors.get("residuals") or ())]
    return [tensors.get("x"), tensors.get("w"), tensors.get("y")] + (fused if fused != [None] else [])


def operands_for(problem: ConvProblem, tensors: dict) -> Operands:
    """Operands from a dict {x, w, y} (all three: the written one is the output), and for a fused epilogue bias and
    residuals, checked against the problem. Arrays of rank S + 3 have the explicit group axis, of rank S + 2 the
    logical form."""
    if (not isinstance(tensors, dict) or not {"x", "w", "y"} <= set(tensors)
            or set(tensors) - {"x", "w", "y", "bias", "residuals"}):
        got = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
        raise InvalidInputError(f"conv tensors are x, w and y (y is dY for bwd_data and bwd_weight), and for a fused "
                                f"epilogue optionally bias and residuals; got {got}")
    rank = problem.spatial_dims
    ranks = {len(view(tensors[role], role).shape) for role in ("x", "w", "y")}
    if ranks not in ({rank + 3}, {rank + 2}):
        raise InvalidInputError(f"conv {rank}D tensors have rank {rank + 3} (explicit group axis) or {rank + 2} "
                                f"([N, C, spatial...]) all three; got ranks {sorted(ranks)}")
    found, ops = operands(problem.direction, tensors["x"], tensors["w"], tensors["y"], stride=problem.stride,
                          dilation=problem.dilation, pad_lo=problem.pad_lo, pad_hi=problem.pad_hi,
                          groups=problem.g if ranks == {rank + 2} else None, spatial_dims=rank,
                          bias=tensors.get("bias"), residuals=tensors.get("residuals", ()),
                          activation=problem.epilogue.activation)
    if found != problem:
        raise InvalidInputError(f"the tensors describe {found}, but the problem is {problem}")
    return ops


def _dense(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def written_slots(problem: ConvProblem) -> tuple[int, Optional[int]]:
    """The td_args slot the direction writes; no other slot may alias it."""
    return "xwy".index(WRITES[problem.direction]), None


def slot_names(problem: ConvProblem, count: int) -> list[str]:
    return ["x", "w", "y", "bias", *(f"residual {i}" for i in range(count - 4))]


_PLAIN_EPILOGUE = Epilogue()


def fused(epilogue: Epilogue) -> bool:
    """Whether a kernel with this epilogue takes the fused forward ABI (4 + residuals tensors)."""
    return epilogue != _PLAIN_EPILOGUE


def make_args(problem: ConvProblem, key: KernelKey, ops: Optional[Operands] = None, *, alpha: float = 1.0,
              beta: float = 0.0, clamp: tuple[float, float] = NO_CLAMP) -> abi.TdArgs:
    """The ABI arguments of the problem on these operands (dummy pointers without). Reads only key.signature:
    Registry._explain shares one set of arguments among the kernels of a signature."""
    alpha, beta = real_scalar("alpha", alpha), real_scalar("beta", beta)
    sig = key.signature
    p = problem
    args = abi.TdArgs()
    args.abi_version = abi.ABI_VERSION
    epi = sig.epilogue
    args.num_tensors = 4 + epi.residuals if fused(epi) else 3
    shapes = p.shapes()
    for slot, (role, key_role) in enumerate((("x", "a"), ("w", "b"), ("y", "c"))):
        code = dtype(getattr(sig, f"dtype_{key_role}")).code
        if ops is None:
            abi.set_tensor(args.tensors[slot], DUMMY_PTR, code, shapes[role], _dense(shapes[role]))
        else:
            v = getattr(ops, role)
            strides = list(v.strides)
            if v.shape[-1] == 1:  # any stride is right for a single channel; the kernel asks for 1
                strides[-1] = 1
            abi.set_tensor(args.tensors[slot], v.ptr, code, shapes[role], strides)
    if fused(epi):  # slot 3 bias [G, K/G] (NULL without one, still counted), slots 4 + i the residuals
        code = dtype(sig.dtype_c).code
        kg = p.k // p.g
        if ops is not None and ops.bias is not None:
            strides = list(ops.bias.strides)
            strides[0] = strides[0] if p.g > 1 else kg  # any stride is right for one group; give the packed one
            strides[1] = strides[1] if kg > 1 else 1
            abi.set_tensor(args.tensors[3], ops.bias.ptr, code, (p.g, kg), strides)
        else:
            abi.set_tensor(args.tensors[3], DUMMY_PTR if ops is None and epi.bias else None, code, (p.g, kg), (kg, 1))
        for i in range(epi.residuals):
            if ops is None:
                abi.set_tensor(args.tensors[4 + i], DUMMY_PTR, code, shapes["y"], _dense(shapes["y"]))
            else:
                r = ops.residuals[i]
                strides = list(r.strides)
                if r.shape[-1] == 1:
                    strides[-1] = 1
                abi.set_tensor(args.tensors[4 + i], r.ptr, code, shapes["y"], strides)
        args.scalars[2], args.scalars[3] = clamp_pair(clamp)
    args.params[abi.CONV_RANK] = p.spatial_dims
    for d in range(p.spatial_dims):
        args.params[abi.CONV_STRIDE + d] = p.stride[d]
        args.params[abi.CONV_DILATION + d] = p.dilation[d]
        args.params[abi.CONV_PAD_LO + d] = p.pad_lo[d]
        args.params[abi.CONV_PAD_HI + d] = p.pad_hi[d]
    args.scalars[0], args.scalars[1] = alpha, beta
    return args


# -- entry points (numpy on the cpu backend, torch or cupy on GPU backends) --------------------------
GEOMETRY_OPTIONS = ("stride", "dilation", "padding", "pad_lo", "pad_hi", "groups", "in_size", "filter_size",
                    "spatial_dims")


# options whose full check wants a Python int (not a numpy integer) or None; alpha and beta are left out of the
# launch key (the Launcher checks and swaps them)
_EXACT_INT_OPTIONS = frozenset(("groups", "spatial_dims", "num_threads", "stream"))
# alpha and beta: swapped by the Launcher; bias and residuals: arrays, fingerprinted by run() like x, w and y
_NOT_KEYED = frozenset(("alpha", "beta", "bias", "residuals"))
EPILOGUE_OPTIONS = ("bias", "residuals", "activation", "clamp")


def options_key(options: dict) -> Optional[tuple]:
    """A call's options (but alpha, beta and the epilogue's arrays) as a hashable key for the launch cache, or None
    when a value is not a plain integer (or a tuple / list of them), a kernel, None, an activation name or a
    clamp pair of floats: such calls take the full checks every time, so that a value the checks refuse but that
    equals an accepted one (True == 1, 1.0 == 1) never reaches a cached launch."""
    items = []
    for name, value in options.items():
        if name in _NOT_KEYED:
            continue
        kind = type(value)
        if name == "activation" and kind is str:
            items.append((name, value))
        elif name == "clamp" and kind is tuple and len(value) == 2 and all(type(v) in (float, int) for v in value):
            items.append((name, value, type(value[0]), type(value[1])))
        elif kind is int or value is None or name == "kernel":  # a kernel: its name or the Kernel object itself
            items.append((name, value))
        elif name in _EXACT_INT_OPTIONS:
            return None
        elif kind is tuple or kind is list:
            for v in value:
                if type(v) is not int and not isinstance(v, np.integer):
                    return None
            items.append((name, tuple(value)))
        elif isinstance(value, np.integer):
            items.append((name, value))
        else:
            return None
    return tuple(items)


_CALL_OPTIONS = {"alpha": 1.0, "beta": 0.0, "kernel": None, "stream": None, "num_threads": 0, "clamp": NO_CLAMP}


_DERIVE = object()  # run(option_key=): derive the key from the options


def run(registry, direction: str, x, w, y, written, options: dict, option_key=_DERIVE):
    """The entry points' work (fwd, bwd_data, bwd_weight and the Registry's methods, which pass their keyword
    arguments as the dict `options`): x, w, y in the explicit roles, `written` the output given (or None).
    option_key: options_key(options), from a caller that passes the same options dict again and again (it is
    not rebuilt per call then)."""
    key = launcher = None
    if written is not None:  # the fast path, as Registry.gemm's: a launch prepared by an earlier call
        try:
            ptrs, prints = prints3(x, w, y)
            beta = options.get("beta", 0.0)
            if option_key is _DERIVE:
                option_key = options_key(options)
            if option_key is not None:
                key = (_thread_id(), direction, prints, beta != 0, option_key,
                       stream_now(x) if options.get("stream") is None and registry.device != "cpu" else None)
                bias, residuals = options.get("bias"), options.get("residuals", ())
                if bias is not None or residuals or "activation" in options:  # the epilogue's arrays, in slot
                    # order after Y (bias None for a kernel without one: its slot stays NULL)
                    if type(residuals) not in (tuple, list):
                        raise TypeError("residuals: the full checks say what is wrong")
                    extra = [fingerprint(bias), *(fingerprint(r) for r in residuals)]
                    key += tuple(e[1] for e in extra)
                    ptrs += tuple(e[0] for e in extra)
                launcher = registry._launches.get(key)
        except Exception:  # an argument that cannot be fingerprinted or hashed: the full checks say what is wrong
            key = launcher = None
        if launcher is not None:
            replay(registry._launches, key, launcher, ptrs, options.get("alpha", 1.0), beta)
            return written
    call = dict(_CALL_OPTIONS)
    geo = {}
    for name, value in options.items():
        (call if name in call else geo)[name] = value
    unknown = sorted(set(geo) - set(GEOMETRY_OPTIONS) - set(EPILOGUE_OPTIONS))
    if unknown:
        raise InvalidInputError(f"conv {direction}: unknown option(s) {', '.join(unknown)} (known: alpha, beta, kernel, "
                                f"stream, num_threads, {', '.join(GEOMETRY_OPTIONS)}; fwd: {', '.join(EPILOGUE_OPTIONS)})")
    alpha, beta = real_scalar("alpha", call["alpha"]), real_scalar("beta", call["beta"])
    clamp = clamp_pair(call["clamp"])
    if beta != 0 and written is None:
        raise InvalidInputError("beta != 0 reads the previous contents of the output: pass out=")
    problem, ops = operands(direction, x, w, y, **geo)
    if call["clamp"] is not NO_CLAMP and problem.epilogue.activation != "clamp":
        raise InvalidInputError(f"clamp bounds are read by activation 'clamp' only; the call asks for activation "
                                f"{problem.epilogue.activation!r}")
    kernel, stream, num_threads = call["kernel"], call["stream"], call["num_threads"]
    launcher = None
    if kernel is None:
        launcher = _gemm_launcher(registry, problem, ops, alpha=alpha, beta=beta, clamp=clamp, stream=stream,
                                  num_threads=num_threads, given=(call["alpha"], call["beta"]))
    if launcher is None:
        scalars = {"clamp": clamp} if fused(problem.epilogue) else {}
        plan = registry._launch(problem, ops, kernel=kernel, stream=stream, num_threads=num_threads, alpha=alpha,
                                beta=beta, **scalars)
        launcher = Launcher(plan, call["alpha"], call["beta"])
    _CALLS.launcher = launcher
    if key is not None:
        registry._launches.put(key, launcher)
    return ops.out


# where the GEMM's td_args slots (A, B, C, D, bias) take their pointers from the caller's (x, w, y) + (None,),
# per direction and whether beta reads C (the written tensor itself)
_GEMM_SLOTS = {("fwd", False): itemgetter(0, 1, 3, 2, 3), ("fwd", True): itemgetter(0, 1, 2, 2, 3),
               ("bwd_data", False): itemgetter(2, 1, 3, 0, 3), ("bwd_data", True): itemgetter(2, 1, 0, 0, 3)}


def _gemm_launcher(registry, problem: ConvProblem, ops: Operands, *, alpha: float, beta: float, clamp, stream,
                   num_threads: int, given: tuple):
    """A pointwise convolution on the bundle's GEMM kernels (ops/conv_as_gemm.py), launched once: its Launcher.
    None, with nothing written, when the problem is not pointwise or no GEMM kernel of the bundle runs it:
    the conv kernels do. A fused forward epilogue becomes the GEMM's (bias per column K, residuals like D)."""
    from . import conv_as_gemm, gemm

    views = conv_as_gemm.operands(problem, ops)
    if views is None or "gemm" not in registry.ops:
        return None
    a, b, d = views
    bias = res = None
    if fused(problem.epilogue):
        res = tuple(conv_as_gemm.pixel_rows(r) for r in ops.residuals)
        if any(r is None for r in res):
            return None
        bias = None if ops.bias is None else conv_as_gemm.bias_row(ops.bias)
    gemm_problem, gemm_ops = gemm.operands(a, b, d, d if beta else None, bias, res or (),
                                           problem.epilogue.activation)
    try:
        plan = registry._launch(gemm_problem, gemm_ops, kernel=None, stream=stream, num_threads=num_threads,
                                alpha=alpha, beta=beta, clamp=clamp)
    except UnsupportedProblemError:  # no GEMM kernel fits (dtype, layout, alignment) or one refused at launch
        return None
    pick = _GEMM_SLOTS[problem.direction, beta != 0]
    if fused(problem.epilogue):  # the caller's pointers are (x, w, y, bias, residuals...) + (None,)
        none = 4 + problem.epilogue.residuals
        pick = itemgetter(0, 1, 2 if beta else none, 2, 3 if problem.epilogue.bias else none,
                          *range(4, 4 + problem.epilogue.residuals))
    return Launcher(plan, *given, pick=pick)


def fwd(registry, x, w, out=None, **options):
    """y = act(alpha * conv(x, w) + beta * out + bias + sum(residuals)); returns out (allocated when None).
    options: alpha (1.0), beta (0.0), bias, residuals, activation ("identity"), clamp ((-inf, inf); activation
    "clamp" only), kernel, stream, num_threads and the geometry (see operands())."""
    return run(registry, "fwd", x, w, out, out, options)


def bwd_data(registry, dy, w, out=None, **options):
    """dx = alpha * conv_bwd_data(dy, w) + beta * out; without out, give in_size."""
    return run(registry, "bwd_data", out, w, dy, out, options)


def bwd_weight(registry, x, dy, out=None, **options):
    """dw = alpha * conv_bwd_weight(x, dy) + beta * out; without out, give filter_size."""
    return run(registry, "bwd_weight", x, out, dy, out, options)
