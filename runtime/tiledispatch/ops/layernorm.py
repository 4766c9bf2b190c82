"""LayerNorm over the last dim: the problem descriptor, its match against kernel keys, and binding arrays to the C ABI.

y[r, :] = (x[r, :] - mean(x[r, :])) / sqrt(var(x[r, :]) + eps) * weight + bias, the variance biased (as torch's),
the statistics in the accumulator type (fp32). The leading dims of x are the rows; weight and bias are optional.

ABI slots: 0 x [rows, cols], 1 weight [cols] (null: 1), 2 bias [cols] (null: 0), 3 y [rows, cols]; scalars[0] eps.
Rows may have any stride; the normalized dim must have unit stride. y may be x itself (each row is read before it
is written, by the same threads).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from .. import abi
from ..arrays import ArrayView, check_disjoint, check_writable, empty_like_device, view
from ..errors import InvalidInputError
from ..spec.dtypes import DTYPES, dtype
from ..spec.key import KernelKey
from .gemm import DUMMY_PTR, check_size, positive_int, real_scalar

DEFAULT_EPS = 1e-5  # torch.nn.LayerNorm's


@dataclass(frozen=True)
class LayerNormProblem:
    """rows rows of cols elements, normalized each; dtype_x in, dtype_w for weight and bias, dtype_y out."""
    rows: int
    cols: int
    dtype_x: str
    dtype_w: str
    dtype_y: str
    layout: str = "rows"
    op: ClassVar[str] = "layernorm"

    def __post_init__(self):
        for name in ("rows", "cols"):
            object.__setattr__(self, name, positive_int(f"layernorm {name}", getattr(self, name)))
        for name in ("dtype_x", "dtype_w", "dtype_y"):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in DTYPES:
                raise InvalidInputError(f"layernorm {name}: unknown dtype {getattr(self, name)!r}")
        if self.layout != "rows":
            raise InvalidInputError(f"layernorm layout must be 'rows', got {self.layout!r}")
        for role, name in (("x", "dtype_x"), ("y", "dtype_y")):
            check_size(f"layernorm {role}", (self.rows, self.cols), DTYPES[getattr(self, name)].itemsize)

    def mismatch(self, key: KernelKey) -> Optional[str]:
        """Why the key's signature cannot serve this problem, or None when it can."""
        sig = key.signature
        if sig.op != "layernorm":
            return f"kernel computes {sig.op}, not layernorm"
        for role, have, want in (("x", sig.dtype_a, self.dtype_x), ("weight and bias", sig.dtype_b, self.dtype_w),
                                 ("y", sig.dtype_c, self.dtype_y)):
            if want != have:
                return f"kernel takes {role} as {have}, problem has {want}"
        return None

    def __str__(self) -> str:
        return f"layernorm rows={self.rows} cols={self.cols} {self.dtype_x}/{self.dtype_w}->{self.dtype_y}"

    def flops(self) -> int:
        """Floating-point operations, counted as torch's profiler counts none: sum, squared deviations, scale and
        shift, about 8 per element (for a GFLOP/s column only; the kernel is bound by its bytes)."""
        return 8 * self.rows * self.cols

    def gemm_shape(self) -> tuple[int, int, int, int]:
        """The ranker's view (backends' default gemm_view): the rows as m, the row's columns as n, no reduction."""
        return self.rows, self.cols, 1, 1

    def to_dict(self) -> dict:
        return {"op": "layernorm", "rows": self.rows, "cols": self.cols, "dtype_x": self.dtype_x,
                "dtype_w": self.dtype_w, "dtype_y": self.dtype_y, "layout": self.layout}


@dataclass
class Operands:
    """The caller's arrays as 2-D views [rows, cols] (weight and bias [cols], either may be None)."""
    x: ArrayView
    weight: Optional[ArrayView]
    bias: Optional[ArrayView]
    y: ArrayView
    out: object          # the caller's output object (returned by layer_norm())

    def all(self) -> list[ArrayView]:
        return [v for v in (self.x, self.weight, self.bias, self.y) if v is not None]

    def layout_key(self) -> tuple:
        """What td_can_run may look at besides the problem (the registry's selection caches' key)."""
        return tuple(None if v is None else (v.shape, v.strides, v.dtype, v.ptr & 15)
                     for v in (self.x, self.weight, self.bias, self.y))


def _as_rows(v: ArrayView, role: str) -> ArrayView:
    """v [..., cols] as [rows, cols]: the leading dims must collapse into one stride, the last have unit stride."""
    if v.ndim < 1:
        raise InvalidInputError(f"{role} must have at least one dim (the normalized one), got a scalar")
    cols = v.shape[-1]
    if cols > 1 and v.strides[-1] != 1:
        raise InvalidInputError(f"{role}'s last dim (the normalized one) has stride {v.strides[-1]}: it must be 1; "
                                f"make it contiguous")
    rows, row_stride = 1, cols
    for size, stride in zip(reversed(v.shape[:-1]), reversed(v.strides[:-1])):
        if size == 1:
            continue
        if rows > 1 and stride != row_stride * rows:
            raise InvalidInputError(f"{role} has shape {list(v.shape)} with strides {list(v.strides)}: its leading "
                                    f"dims are not one run of rows; make it contiguous")
        if rows == 1:
            row_stride = stride
        rows *= size
    return ArrayView(v.ptr, (rows, cols), (row_stride, 1), v.dtype, v.device, v.obj)


def _vector(obj, role: str, cols: int) -> Optional[ArrayView]:
    if obj is None:
        return None
    v = view(obj, role)
    if v.shape != (cols,):
        raise InvalidInputError(f"{role} has shape {list(v.shape)}, expected [{cols}] (the normalized dim)")
    if cols > 1 and v.strides[0] != 1:
        raise InvalidInputError(f"{role} has stride {v.strides[0]}: it must be contiguous")
    return v


def operands(x, weight=None, bias=None, out=None):
    """Check the arrays against each other and return (LayerNormProblem, Operands)."""
    raw_x = view(x, "x")
    if 0 in raw_x.shape:
        raise InvalidInputError(f"x has shape {list(raw_x.shape)}: every size must be >= 1")
    vx = _as_rows(raw_x, "x")
    cols = vx.shape[1]
    vw, vb = _vector(weight, "weight", cols), _vector(bias, "bias", cols)
    if vw is not None and vb is not None and vw.dtype != vb.dtype:
        raise InvalidInputError(f"weight has dtype {vw.dtype} but bias has {vb.dtype}")
    dtype_w = (vw or vb).dtype if (vw or vb) is not None else vx.dtype
    if out is None:
        out = empty_like_device(raw_x, raw_x.shape, vx.dtype)
    raw_y = view(out, "out")
    check_writable(raw_y, "out")
    if raw_y.shape != raw_x.shape:
        raise InvalidInputError(f"out has shape {list(raw_y.shape)}, expected x's {list(raw_x.shape)}")
    vy = _as_rows(raw_y, "out")
    devices = {v.device for v in (vx, vw, vb, vy) if v is not None}
    if len(devices) > 1:
        raise InvalidInputError(f"arrays live on different devices: {sorted(devices)}")
    check_disjoint(vy, "out", [(vx, "x"), (vw, "weight"), (vb, "bias")], exact_ok=("x",))
    problem = LayerNormProblem(vx.shape[0], cols, vx.dtype, dtype_w, vy.dtype)
    return problem, Operands(vx, vw, vb, vy, out)


def tensors_in_slot_order(tensors: dict) -> list:
    """The caller's objects in td_args slot order: x, weight, bias, out."""
    if not isinstance(tensors, dict):
        raise InvalidInputError(f"layernorm tensors are a dict {{x, out, weight?, bias?}}, got "
                                f"{type(tensors).__name__}")
    return [tensors.get("x"), tensors.get("weight"), tensors.get("bias"), tensors.get("out")]


def written_slots(problem: LayerNormProblem) -> tuple[int, Optional[int]]:
    """The slot the kernel writes (y) and the one slot that may be exactly the same tensor (x)."""
    return 3, 0


def slot_names(problem: LayerNormProblem, count: int) -> list[str]:
    return ["x", "weight", "bias", "out"]


def operands_for(problem: LayerNormProblem, tensors: dict) -> Operands:
    """Operands from a dict {x, out, weight?, bias?}, checked against the problem."""
    if not isinstance(tensors, dict):
        raise InvalidInputError(f"layernorm tensors are a dict {{x, out, weight?, bias?}}, got "
                                f"{type(tensors).__name__}")
    unknown = set(tensors) - {"x", "out", "weight", "bias"}
    if unknown or not {"x", "out"} <= set(tensors):
        raise InvalidInputError(f"layernorm tensors are x, out and optionally weight, bias; got {sorted(tensors)}")
    found, ops = operands(tensors["x"], tensors.get("weight"), tensors.get("bias"), tensors["out"])
    if found != problem:
        raise InvalidInputError(f"the tensors describe {found}, but the problem is {problem}")
    return ops


def make_args(problem: LayerNormProblem, key: KernelKey, ops: Optional[Operands] = None, *,
              eps: float = DEFAULT_EPS) -> abi.TdArgs:
    """The ABI arguments of the problem on these operands (dummy pointers without). Reads only key.signature."""
    eps = real_scalar("eps", eps)
    if eps < 0:
        raise InvalidInputError(f"eps must be >= 0, got {eps}")
    sig, p = key.signature, problem
    args = abi.TdArgs()
    args.abi_version = abi.ABI_VERSION
    args.num_tensors = 4
    code = {role: dtype(getattr(sig, f"dtype_{role}")).code for role in "abc"}
    rows = (p.rows, p.cols)
    for slot, role, c, shape in ((0, "x", code["a"], rows), (1, "weight", code["b"], (p.cols,)),
                                 (2, "bias", code["b"], (p.cols,)), (3, "y", code["c"], rows)):
        v = getattr(ops, role) if ops is not None else None
        if ops is None:
            ptr, strides = DUMMY_PTR, ((p.cols, 1) if len(shape) == 2 else (1,))
        elif v is None:
            ptr, strides = None, (1,)
        else:
            ptr, strides = v.ptr, v.strides
        abi.set_tensor(args.tensors[slot], ptr, c, shape, strides)
    args.scalars[0] = eps
    return args
