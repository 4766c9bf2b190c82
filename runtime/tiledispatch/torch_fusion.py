"""tiledispatch.torch.fuse: whole layers of a model as single tiledispatch calls, found with torch.fx.

    fused, report = tdt.fuse(model.eval(), reg)        # a new module; the model is left as it was
    print(report)

Chains fused (each into one call of tiledispatch.torch.conv / matmul with an epilogue):
    conv -> [batch norm] -> [+ residual] -> [activation]
    linear -> [scale, permute ...] -> [+ residual] -> [activation]
Layer norms run on the bundle's layernorm kernels where it has them: nn.LayerNorm modules through patch(), and
functional calls (F.layer_norm in a module's forward, such as torchvision's LayerNorm2d) as
tiledispatch.torch.layer_norm calls; both forward only (a call recording a gradient is torch's).
A pointwise conv's input may be a product x * s, s holding one value per sample and channel (squeeze-excitation's
scale, [N, C, 1, 1]): the product is taken into the fused call (FusedScaledConv: where each sample's pixels fill
GEMM tiles, the weight is scaled per sample instead of x, and the conv runs as one batched GEMM).
A scale is a multiply by a model tensor holding one value per output feature (ConvNeXt's layer scale), in eval
mode only: like a batch norm it is folded into the weight and bias (in float32, cast to the weight's dtype). A
permute between the linear and what is fused moves the residual into the linear's layout and the result out of
it (views: nothing is copied).
activation: relu, relu6 / hardtanh (clamp), silu, gelu (erf or tanh), sigmoid, tanh, hard-swish, hard-sigmoid, as
modules (nn.ReLU, ...), functions (F.relu, torch.relu, ...) or tensor methods (x.relu()). A batch norm in eval mode
(running statistics) is folded into the conv's weight and a bias, computed in float32 and cast to the weight's dtype;
in training mode it computes batch statistics, so it stays PyTorch's and ends the chain: what is fused then is exact
in either mode (bias, residual add, activation). A conv whose fused kernel the bundle lacks for a problem still runs
as one tiledispatch.torch.conv call (the plain kernel, bias and residual through beta * Y, the activation by torch);
a linear's activation is fused only where the bundle has GEMM kernels computing it, and applied by torch after the
GEMM for a problem all of them refuse (an unaligned out_features).

A residual whose shape or dtype differs from the layer's output at run time (a broadcast add, a type promotion)
is added by torch instead, so the fused model computes what the model did. Modules torch.fx cannot trace are
fused inside their traceable submodules; the report names them. The remaining nn.Linear / nn.Conv layers are
routed through the bundle by tiledispatch.torch.patch (patch_rest=True).
"""
from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from . import torch as tdt
from .errors import InvalidInputError, UnsupportedProblemError
from .registry import NO_CLAMP

__all__ = ["fuse", "FuseReport", "FusedLayer", "FusedConv", "FusedLinear"]

_BATCH_NORMS = {nn.BatchNorm1d: 1, nn.BatchNorm2d: 2, nn.BatchNorm3d: 3}


# -- fused modules -----------------------------------------------------------------------------------------
def _torch_activation(y: torch.Tensor, activation: str, clamp: tuple) -> torch.Tensor:
    """The activation by torch (out of place, differentiable): where a residual is added by torch."""
    return tdt._activation_ops(activation)[0](y, clamp)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a tiledispatch call computes x's layer in: autocast's where it applies (tdt._autocast)."""
    if not tdt._any_autocast():
        return x.dtype
    device = x.device.type
    if x.is_floating_point() and x.dtype != torch.float64 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class FusedConv(nn.Module):
    """act(conv(x, weight) + bias + residual) as one tiledispatch.torch.conv call: a conv layer with what followed
    it (a folded batch norm, a residual add, an activation). folded_bn: the weight and bias hold an eval-mode
    batch norm, so the module refuses to run in training mode."""

    def __init__(self, conv: nn.Module, weight: nn.Parameter, bias: Optional[nn.Parameter], *, handle: int,
                 residual: bool, activation: str, clamp: tuple, folded_bn: bool):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.rank = len(conv.kernel_size)
        self.stride, self.dilation, self.groups = list(conv.stride), list(conv.dilation), conv.groups
        self.pad_lo, self.pad_hi = tdt._conv_padding(conv)
        self.padding_mode = conv.padding_mode
        self.reversed_padding = conv._reversed_padding_repeated_twice
        self.handle, self.residual, self.activation, self.clamp = handle, residual, activation, tuple(clamp)
        self.folded_bn = folded_bn
        self._geo = tdt._geometry(self.stride, self.dilation, self.pad_lo, self.pad_hi, self.groups)

    def extra_repr(self) -> str:
        k, cg = self.weight.shape[:2]
        return (f"{cg * self.groups}, {k}, kernel_size={tuple(self.weight.shape[2:])}, stride={self.stride}, "
                f"groups={self.groups}, bias={self.bias is not None}, residual={self.residual}, "
                f"activation={self.activation}" + (f"{self.clamp}" if self.activation == "clamp" else "")
                + (", batch norm folded" if self.folded_bn else ""))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.folded_bn and self.training:
            raise RuntimeError("this conv has an eval-mode batch norm folded in (tiledispatch.torch.fuse of a model in "
                               "eval mode): fuse the model in training mode to train it")
        if self.padding_mode != "zeros":
            x = F.pad(x, self.reversed_padding, mode=self.padding_mode)
        geo = None if tdt._compiling() else self._geo
        if residual is None:
            return tdt._conv(x, self.weight, self.bias, self.stride, self.dilation, self.pad_lo, self.pad_hi,
                             self.groups, self.handle, geo, (), self.activation, self.clamp)
        if geo is not None:  # eager: the geometry's memo of output shapes
            shape = geo.fwd_shape(x, self.weight)
        else:
            shape = (x.shape[0], self.weight.shape[0], *tdt._out_size(x.shape[2:], self.weight.shape[2:], self.stride,
                                                                      self.dilation, self.pad_lo, self.pad_hi))
        if residual.shape == shape and residual.dtype == _compute_dtype(x):
            return tdt._conv(x, self.weight, self.bias, self.stride, self.dilation, self.pad_lo, self.pad_hi,
                             self.groups, self.handle, geo, (residual,), self.activation, self.clamp)
        y = tdt._conv(x, self.weight, self.bias, self.stride, self.dilation, self.pad_lo, self.pad_hi, self.groups,
                      self.handle, geo)  # a broadcast or promoting add: torch's, as the model had it
        return _torch_activation(y + residual, self.activation, self.clamp)


# Scaling each sample's weight [K, C] instead of its pixels [P, C] pays where the weight is the smaller (K < P) and
# each sample's GEMM still fills whole tiles of rows (P >= _FOLD_MIN_PIXELS): the early, large-map layers of
# squeeze-excitation models, whose x * s multiplies cost the most. Elsewhere x * s is torch's multiply, as the model.
_FOLD_MIN_PIXELS = 256


class FusedScaledConv(FusedConv):
    """act(conv(a * b, weight) + bias + residual) for a pointwise conv (1x1 taps, unit stride, no padding, one
    group) whose input is a product: where one factor holds one value per sample and channel ([N, C, 1, ...], the
    other [N, C, spatial...]) and the rule above holds, the conv runs as one batched GEMM per sample on the weight
    scaled by that sample's values (x is read once, by the GEMM); otherwise on a * b, as the model computed it."""

    def forward(self, a: torch.Tensor, b: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        scale, x = (a, b) if _per_sample_channel(a, b) else (b, a) if _per_sample_channel(b, a) else (None, None)
        k = self.weight.shape[0]
        pixels = 0 if x is None else math.prod(x.shape[2:])
        if scale is None or pixels < max(_FOLD_MIN_PIXELS, k + 1) or (self.folded_bn and self.training):
            return super().forward(a * b, residual)
        n, c = x.shape[:2]
        rows = x.movedim(1, -1).reshape(n, pixels, c)  # a view of channels-last x
        weights = self.weight.reshape(1, k, c) * scale.reshape(n, 1, c)  # [N, K, C]: B column-major per sample
        spatial = x.shape[2:]
        residuals = ()
        if residual is not None:
            if residual.shape != (n, k, *spatial) or residual.dtype != _compute_dtype(x):
                y = self._gemm(rows, weights, (), "identity", NO_CLAMP).view(n, *spatial, k).movedim(-1, 1)
                return _torch_activation(y + residual, self.activation, self.clamp)  # torch's add, as the model's
            residuals = (residual.movedim(1, -1).reshape(n, pixels, k),)
        return self._gemm(rows, weights, residuals, self.activation, self.clamp).view(n, *spatial, k).movedim(-1, 1)

    def _gemm(self, rows, weights, residuals: tuple, activation: str, clamp: tuple) -> torch.Tensor:
        return tdt._matmul(rows, weights.transpose(1, 2), self.bias, residuals, activation, *clamp, self.handle)


def _per_sample_channel(s: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether s holds one value per sample and channel of x ([N, C, 1, ...] against [N, C, spatial...]) in x's
    dtype."""
    return (isinstance(s, torch.Tensor) and isinstance(x, torch.Tensor) and s.dim() == x.dim() > 2
            and s.shape[:2] == x.shape[:2] and all(d == 1 for d in s.shape[2:]) and s.dtype == x.dtype
            and s.device == x.device)


class FusedLinear(nn.Module):
    """act(x @ weight^T + bias + residual) as one tiledispatch.torch GEMM call: a linear layer with the residual
    add and activation that followed it. folded_scale: the weight and bias hold an eval-mode per-feature scale, so
    the module refuses to run in training mode. layout: the permutation the chain applied to the linear's output
    before the residual add (axes[i]: the linear's axis at i), or None: the residual is moved into the linear's
    layout and the result out of it (views)."""

    def __init__(self, linear: nn.Linear, weight: nn.Parameter, bias: Optional[nn.Parameter], *, handle: int,
                 residual: bool, activation: str, clamp: tuple, folded_scale: bool, layout: Optional[list] = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.handle, self.residual, self.activation, self.clamp = handle, residual, activation, tuple(clamp)
        self.folded_scale = folded_scale
        self.layout = None if layout is None else tuple(layout)
        self.inverse = None if layout is None else tuple(sorted(range(len(layout)), key=layout.__getitem__))

    def extra_repr(self) -> str:
        return (f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, "
                f"bias={self.bias is not None}, residual={self.residual}, activation={self.activation}"
                + (f"{self.clamp}" if self.activation == "clamp" else "")
                + (", scale folded" if self.folded_scale else "")
                + (f", output permuted {list(self.layout)}" if self.layout is not None else ""))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.folded_scale and self.training:
            raise RuntimeError("this linear has an eval-mode scale folded in (tiledispatch.torch.fuse of a model in "
                               "eval mode): fuse the model in training mode to train it")
        if self.layout is None:
            return self._fused(x, residual, self.activation, self.clamp)
        if residual is not None and residual.dim() != len(self.layout):  # a broadcast add: torch's, as the model's
            y = self._fused(x, None, "identity", NO_CLAMP).permute(self.layout)
            return _torch_activation(y + residual, self.activation, self.clamp)
        residual = None if residual is None else residual.permute(self.inverse)
        return self._fused(x, residual, self.activation, self.clamp).permute(self.layout)

    def _fused(self, x: torch.Tensor, residual: Optional[torch.Tensor], activation: str, clamp: tuple):
        w = self.weight
        if residual is None:
            return tdt._linear(x, w, self.bias, (), activation, *clamp, self.handle)
        if residual.shape == (*x.shape[:-1], self.weight.shape[0]) and residual.dtype == _compute_dtype(x):
            return tdt._linear(x, w, self.bias, (residual,), activation, *clamp, self.handle)
        y = tdt._linear(x, w, self.bias, (), "identity", *NO_CLAMP, self.handle)  # torch's add, as the model had it
        return _torch_activation(y + residual, activation, clamp)


# -- report --------------------------------------------------------------------------------------------------
@dataclass
class FusedLayer:
    """One fused module: its name in the returned model, what it replaced (the original modules and operations,
    in order) and what its epilogue computes."""
    name: str
    kind: str
    parts: list
    epilogue: str
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "parts": list(self.parts), "epilogue": self.epilogue,
                "notes": list(self.notes)}


@dataclass
class FuseReport:
    """fused: the fused modules; kept: (layer or operation, why it was not fused into the layer before it);
    untraced: (module, why torch.fx could not trace it: fused inside its submodules only); patch: the report of
    tiledispatch.torch.patch on the remaining nn.Linear / nn.Conv layers (None with patch_rest=False)."""
    fused: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    untraced: list = field(default_factory=list)
    patch: Optional[tdt.PatchReport] = None

    def to_dict(self) -> dict:
        return {"fused": [f.to_dict() for f in self.fused], "kept": [list(k) for k in self.kept],
                "untraced": [list(u) for u in self.untraced],
                "patch": None if self.patch is None else self.patch.to_dict()}

    def __str__(self) -> str:
        lines = [f"tiledispatch.fuse: {len(self.fused)} fused layer(s), {len(self.kept)} operation(s) kept, "
                 f"{len(self.untraced)} module(s) not traceable"]
        for f in self.fused:
            lines.append(f"  {f.name} [{f.kind}] = {' -> '.join(f.parts)}  (epilogue: {f.epilogue})")
            lines += [f"      note: {n}" for n in f.notes]
        for name, why in self.kept:
            lines.append(f"  kept {name}: {why}")
        for name, why in self.untraced:
            lines.append(f"  not traced {name or '(model)'}: {why} (fused inside its submodules)")
        if self.patch is not None:
            lines.append(str(self.patch))
        return "\n".join(lines)


# -- pattern matching on the fx graph -----------------------------------------------------------------------
def _only_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _const(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _arg(node: fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _function_activation(node: fx.Node):
    """(activation, clamp) of a call_function node applying one to its first argument, else None."""
    f, extra = node.target, set(node.kwargs) - {"inplace"}
    if f in (torch.relu, torch.relu_, F.relu, F.relu_) and len(node.args) <= 2 and not extra:
        return "relu", NO_CLAMP
    if f is F.relu6 and len(node.args) <= 2 and not extra:
        return "clamp", (0.0, 6.0)
    if f is F.hardtanh:
        lo, hi = _arg(node, 1, "min_val", -1.0), _arg(node, 2, "max_val", 1.0)
        return ("clamp", (float(lo), float(hi))) if _const(lo) and _const(hi) else None
    if f in (torch.clamp, torch.clip):
        lo, hi = _arg(node, 1, "min", None), _arg(node, 2, "max", None)
        return ("clamp", (float(lo), float(hi))) if _const(lo) and _const(hi) else None
    if f is F.silu and len(node.args) <= 2 and not extra:
        return "silu", NO_CLAMP
    if f is F.gelu and len(node.args) == 1 and set(node.kwargs) <= {"approximate"}:
        approximate = node.kwargs.get("approximate", "none")
        return ({"none": "gelu_erf", "tanh": "gelu_tanh"}.get(approximate), NO_CLAMP) if approximate in (
            "none", "tanh") else None
    if f in (torch.sigmoid, F.sigmoid) and len(node.args) == 1 and not node.kwargs:
        return "sigmoid", NO_CLAMP
    if f in (torch.tanh, F.tanh) and len(node.args) == 1 and not node.kwargs:
        return "tanh", NO_CLAMP
    if f in (F.hardswish, F.hardsigmoid) and len(node.args) <= 2 and not extra:
        return f.__name__, NO_CLAMP
    return None


def _activation_of(node: fx.Node, cur: fx.Node, modules: dict):
    """(activation, clamp) when node applies an activation to cur and nothing else, else None."""
    if not node.args or node.args[0] is not cur:
        return None
    if node.op == "call_module":
        if len(node.args) != 1 or node.kwargs:
            return None
        m = modules[node.target]
        kind = type(m)
        if kind is nn.ReLU:
            return "relu", NO_CLAMP
        if kind is nn.ReLU6:
            return "clamp", (0.0, 6.0)
        if kind is nn.Hardtanh:
            return "clamp", (float(m.min_val), float(m.max_val))
        if kind is nn.SiLU:
            return "silu", NO_CLAMP
        if kind is nn.GELU:
            return {"none": "gelu_erf", "tanh": "gelu_tanh"}[m.approximate], NO_CLAMP
        if kind is nn.Sigmoid:
            return "sigmoid", NO_CLAMP
        if kind is nn.Tanh:
            return "tanh", NO_CLAMP
        if kind in (nn.Hardswish, nn.Hardsigmoid):
            return kind.__name__.lower(), NO_CLAMP
        return None
    if node.op == "call_function":
        return _function_activation(node)
    if node.op == "call_method" and not node.kwargs:
        if node.target in ("relu", "relu_") and len(node.args) == 1:
            return "relu", NO_CLAMP
        if node.target in ("sigmoid", "sigmoid_") and len(node.args) == 1:
            return "sigmoid", NO_CLAMP
        if node.target in ("tanh", "tanh_") and len(node.args) == 1:
            return "tanh", NO_CLAMP
        if node.target in ("clamp", "clamp_", "clip", "clip_") and len(node.args) == 3 and all(
                _const(v) for v in node.args[1:]):
            return "clamp", (float(node.args[1]), float(node.args[2]))
    return None


_ADDS = (operator.add, torch.add, operator.iadd)
_IN_PLACE_ADDS = (operator.iadd, "add_")


def _residual_of(node: fx.Node, cur: fx.Node) -> Optional[fx.Node]:
    """The other operand when node is cur + other (other a tensor computed in the graph), else None. An in-place
    add must write cur (writing other would change a tensor the model may read again)."""
    if node.kwargs or len(node.args) != 2:
        return None
    if not ((node.op == "call_function" and node.target in _ADDS)
            or (node.op == "call_method" and node.target in ("add", "add_"))):
        return None
    a, b = node.args
    if node.target in _IN_PLACE_ADDS and a is not cur:
        return None
    other = b if a is cur else (a if b is cur else None)
    if not isinstance(other, fx.Node) or other is cur:
        return None
    return other


_MULS = (operator.mul, torch.mul)


def _scaled_input(anchor: fx.Node, conv: nn.Module) -> Optional[fx.Node]:
    """The node computing a pointwise conv's input when it is a product a * b of two graph tensors read by the conv
    alone (FusedScaledConv's pattern), else None."""
    node = anchor.args[0]
    if not isinstance(node, fx.Node) or len(node.users) != 1 or node.kwargs or len(node.args) != 2:
        return None
    if not ((node.op == "call_function" and node.target in _MULS) or (node.op == "call_method"
                                                                      and node.target == "mul")):
        return None
    if not all(isinstance(v, fx.Node) for v in node.args) or node.args[0] is node.args[1]:
        return None
    pointwise = (all(v == 1 for v in (*conv.kernel_size, *conv.stride, *conv.dilation, conv.groups))
                 and tdt._conv_padding(conv) == ([0] * len(conv.kernel_size),) * 2 and conv.padding_mode == "zeros")
    return node if pointwise else None


def _permute_dims(node: fx.Node, cur: fx.Node) -> Optional[list]:
    """The dims of node when it is cur.permute(dims) (a method or torch.permute), else None."""
    if node.kwargs or not node.args or node.args[0] is not cur:
        return None
    if node.op == "call_method" and node.target == "permute":
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
    elif node.op == "call_function" and node.target is torch.permute and len(node.args) == 2:
        dims = node.args[1]
    else:
        return None
    dims = list(dims)
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return None
    dims = [d % len(dims) if -len(dims) <= d < len(dims) else -1 for d in dims]
    return dims if sorted(dims) == list(range(len(dims))) else None


def _passes_through(node: fx.Node, cur: fx.Node, modules: dict) -> bool:
    """Whether node returns cur itself: an nn.Identity, or torchvision's stochastic depth traced in eval mode (its
    training argument False: fx keeps the call, which returns its input then)."""
    if node.op == "call_module":
        return type(modules.get(node.target)) is nn.Identity and node.args == (cur,) and not node.kwargs
    target = node.target
    if node.op != "call_function" or getattr(target, "__name__", "") != "stochastic_depth" or \
            not getattr(target, "__module__", "").startswith("torchvision.") or not node.args or node.args[0] is not cur:
        return False
    return _arg(node, 3, "training", True) is False


def _scale_of(gm: fx.GraphModule, node: fx.Node, cur: fx.Node, linear: nn.Module, axes: Optional[list]):
    """The per-output-feature factor (1D, float32) when node is cur * t for a tensor t of the model (a parameter or
    buffer) of the linear's dtype that holds one value per output feature along the features' axis (axes: the
    permutation cur shows the linear's output in, None for none), else None."""
    if node.kwargs or len(node.args) != 2 or cur not in node.args:
        return None
    if not ((node.op == "call_function" and node.target in (operator.mul, torch.mul))
            or (node.op == "call_method" and node.target == "mul" and node.args[0] is cur)):
        return None
    other = node.args[1] if node.args[0] is cur else node.args[0]
    if not isinstance(other, fx.Node) or other.op != "get_attr":
        return None
    try:
        t = operator.attrgetter(other.target)(gm)
    except AttributeError:
        return None
    features = linear.out_features
    if not isinstance(t, torch.Tensor) or t.dtype != linear.weight.dtype or t.device != linear.weight.device:
        return None
    rank = 1 if axes is None else len(axes)
    where = rank - 1 if axes is None else axes.index(rank - 1)
    shape = [1] * (rank - t.dim()) + list(t.shape)
    if t.dim() > rank or shape != [features if i == where else 1 for i in range(rank)]:
        return None
    return t.detach().float().reshape(features)


def _describe(node: fx.Node, prefix: str) -> str:
    if node.op == "call_module":
        return _join(prefix, node.target)
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{target} ({_join(prefix, node.name)})"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# -- batch norm folding ------------------------------------------------------------------------------------
def _foldable(bn: nn.Module, conv: nn.Module) -> Optional[str]:
    """Why an eval-mode fold of bn into conv is not exact, or None."""
    if bn.training:
        return "batch norm in training mode (batch statistics stay PyTorch's)"
    if bn.running_mean is None or bn.running_var is None:
        return "batch norm without running statistics (track_running_stats=False: batch statistics in eval mode)"
    if bn.num_features != conv.out_channels:
        return f"batch norm of {bn.num_features} features after a conv of {conv.out_channels} channels"
    return None


def _fold_bn(conv: nn.Module, bn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and bias of conv followed by eval-mode bn: w * s and (b - mean) * s + beta with
    s = gamma / sqrt(var + eps), computed in float32 and cast to the weight's dtype (its memory format kept)."""
    with torch.no_grad():
        scale = torch.rsqrt(bn.running_var.float() + bn.eps)
        if bn.weight is not None:
            scale = scale * bn.weight.float()
        shift = -bn.running_mean.float() * scale
        if conv.bias is not None:
            shift = shift + conv.bias.float() * scale
        if bn.bias is not None:
            shift = shift + bn.bias.float()
        w = conv.weight.float() * scale.view(-1, *([1] * (conv.weight.dim() - 1)))
        weight = torch.empty_like(conv.weight).copy_(w)  # empty_like keeps a channels-last weight channels-last
        bias = shift.to(conv.weight.dtype)
    return weight, bias


def _fold_scale(linear: nn.Module, scale: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The weight and bias of linear followed by a per-output-feature multiply by scale (float32): w * s and b * s,
    computed in float32 and cast to the weight's dtype."""
    with torch.no_grad():
        weight = (linear.weight.float() * scale[:, None]).to(linear.weight.dtype)
        bias = None if linear.bias is None else (linear.bias.float() * scale).to(linear.bias.dtype)
    return weight, bias


# -- the pass ------------------------------------------------------------------------------------------------
class _Tracer(fx.Tracer):
    """torch.nn's modules are leaves (fx's default), and so are modules fuse() made."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, (FusedConv, FusedLinear)) or super().is_leaf_module(m, qualname)


def _trace(module: nn.Module) -> fx.GraphModule:
    tracer = _Tracer()
    graph = tracer.trace(module)
    return fx.GraphModule(tracer.root, graph, type(module).__name__)


def _anchor_kind(m: nn.Module) -> Optional[str]:
    """'conv' / 'linear' for the plain layers a chain starts at (subclasses may compute something else)."""
    if type(m) in tdt._CONV_TYPES:
        return "conv"
    if type(m) is nn.Linear:
        return "linear"
    return None


class _Pass:
    def __init__(self, handle: int, autocast: Optional[torch.dtype], report: FuseReport):
        self.handle, self.autocast, self.report = handle, autocast, report

    def dtype_of(self, m: nn.Module) -> str:
        dt = self.autocast if self.autocast is not None and m.weight.dtype == torch.float32 else m.weight.dtype
        return tdt._DTYPES.get(dt, str(dt).replace("torch.", ""))

    def module(self, module: nn.Module, prefix: str) -> nn.Module:
        """module fused (a new GraphModule), or module itself with its children fused where fx cannot trace it."""
        try:
            gm = _trace(module)
        except Exception as e:  # control flow on tensors, unsupported Python: fuse inside the children
            if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                self.report.untraced.append((prefix, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            for name, child in list(module.named_children()):
                if _Tracer().is_leaf_module(child, name) and not isinstance(child, nn.Sequential):
                    continue
                new = self.module(child, _join(prefix, name))
                if new is not child:
                    setattr(module, name, new)
            return module
        gm.training = module.training  # the flag only: the submodules keep their own modes
        self.rewrite(gm, prefix)
        return gm

    def rewrite(self, gm: fx.GraphModule, prefix: str) -> None:
        modules = dict(gm.named_modules())
        calls: dict = {}
        read = set()  # modules whose parameters the graph reads itself (tied weights): a fused layer would change them
        for node in gm.graph.nodes:
            if node.op == "call_module":
                calls[node.target] = calls.get(node.target, 0) + 1
            elif node.op == "get_attr":
                read.add(node.target.rpartition(".")[0])
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_module":
                continue
            m = modules.get(node.target)
            kind = _anchor_kind(m) if m is not None else None
            if kind is None or len(node.args) != 1 or node.kwargs:
                continue
            if calls[node.target] > 1:
                self.report.kept.append((_join(prefix, node.target), "the module is called more than once: not fused"))
                continue
            if node.target in read:
                self.report.kept.append((_join(prefix, node.target), "the model reads the module's parameters itself "
                                                                     "(tied weights): not fused"))
                continue
            changed |= self.chain(gm, node, m, kind, modules, prefix)
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in (F.layer_norm, torch.layer_norm):
                changed |= self.layer_norm(gm, node, prefix)
        if changed:
            gm.graph.lint()
            gm.delete_all_unused_submodules()
            gm.recompile()

    def chain(self, gm: fx.GraphModule, anchor: fx.Node, m: nn.Module, kind: str, modules: dict, prefix: str) -> bool:
        dtype = self.dtype_of(m)
        training = any(p.requires_grad for p in m.parameters(recurse=False))
        if kind == "conv":
            missing = tdt._missing(self.handle, m, f"Conv{len(m.kernel_size)}d", dtype, training)
        else:
            missing = tdt._missing(self.handle, m, "Linear", dtype, training)
        if missing:  # patch() reports the layer as staying on PyTorch
            return False
        nodes, parts = [anchor], [_describe(anchor, prefix)]
        bn = residual = None
        activation, clamp = "identity", NO_CLAMP
        cur = anchor
        user = _only_user(cur)
        # batch norm (conv only, eval mode)
        if kind == "conv" and user is not None and user.op == "call_module" and \
                type(modules.get(user.target)) in _BATCH_NORMS and user.args == (cur,) and not user.kwargs:
            candidate = modules[user.target]
            why = _foldable(candidate, m) if _BATCH_NORMS[type(candidate)] == len(m.kernel_size) else \
                "batch norm of another rank"
            if why:
                self.report.kept.append((_describe(user, prefix), why))
                return self.replace(gm, nodes, parts, m, kind, bn, residual, activation, clamp, prefix)
            bn, cur = candidate, user
            nodes.append(user)
            parts.append(_describe(user, prefix))
            user = _only_user(cur)
        # linear: permutes (views) and per-feature scales; look: the last node seen, taken or pending
        look, axes, pending, scale = cur, None, [], None
        layout = None  # axes at the last node taken: the permutation from the fused call's output to the chain's

        def take(node: fx.Node, part: str) -> None:  # node joins the chain, with the permutes passed before it
            nodes.extend(pending + [node])
            parts.extend([_describe(n, prefix) for n in pending] + [part])
            pending.clear()

        while kind == "linear" and user is not None:
            dims = _permute_dims(user, look)
            permutes = dims is not None and (axes is None or len(axes) == len(dims))
            if permutes or _passes_through(user, look, modules):
                if permutes:
                    axes = [(axes or list(range(len(dims))))[d] for d in dims]  # axes[i]: the linear's axis at i
                pending.append(user)
                look, user = user, _only_user(user)
                continue
            factor = None if m.training or self.autocast is not None else _scale_of(gm, user, look, m, axes)
            if factor is None:
                break
            scale = factor if scale is None else scale * factor
            take(user, _describe(user, prefix))
            layout = axes
            look, user = user, _only_user(user)
        # residual add
        if user is not None and (other := _residual_of(user, look)) is not None:
            if self.gemm_supports(kind, dtype, m, "identity", 1):
                take(user, f"+ {other.name}")
                residual, layout = other, axes
                look, user = user, _only_user(user)
        # activation
        if user is not None and (act := _activation_of(user, look, modules)) is not None:
            if self.gemm_supports(kind, dtype, m, act[0], int(residual is not None)):
                activation, clamp = act
                take(user, _describe(user, prefix))
                layout = axes
            else:
                self.report.kept.append((_describe(user, prefix), f"the bundle has no {dtype} GEMM kernel computing "
                                                                  f"{act[0]}: stays PyTorch's"))
        return self.replace(gm, nodes, parts, m, kind, bn, residual, activation, clamp, prefix, scale, layout)

    def layer_norm(self, gm: fx.GraphModule, node: fx.Node, prefix: str) -> bool:
        """A functional layer norm in the graph (a module whose forward calls F.layer_norm, such as torchvision's
        LayerNorm2d around a permute) as tiledispatch.torch.layer_norm, which takes the same arguments; nn.LayerNorm
        modules are patch()'s. Where the bundle has no layernorm kernel of the weight's dtype it stays torch's (reported
        as kept; a bundle without the op leaves layer norms alone)."""
        if not node.args or "input" in node.kwargs or not tdt._CAPS[self.handle].layernorm:
            return False
        weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        if isinstance(weight, fx.Node) and weight.op == "get_attr":
            dt = gm.get_parameter(weight.target).dtype
            dtype = tdt._DTYPES.get(dt, str(dt).replace("torch.", ""))
        elif weight is None:
            dtype = tdt._ANY_DTYPE
        else:  # a weight computed in the graph: its dtype is known only at run time
            return False
        name = _describe(node, prefix)
        if isinstance(weight, fx.Node):  # named after the module whose weight it reads
            name = f"{_join(prefix, weight.target.rpartition('.')[0])} ({name})"
        missing = tdt._missing(self.handle, None, "LayerNorm", dtype, False)
        if missing:
            self.report.kept.append((name, f"{missing}: stays torch's"))
            return False
        node.target = tdt.layer_norm
        node.kwargs = {**node.kwargs, "registry": self.handle}
        self.report.fused.append(FusedLayer(name, "layer_norm", [name], "none", notes=[tdt._FORWARD_ONLY["LayerNorm"]]))
        return True

    def gemm_supports(self, kind: str, dtype: str, m: nn.Module, activation: str, residuals: int) -> bool:
        """Whether a linear's GEMM can take this epilogue (conv epilogues always can: see the module's doc)."""
        if kind == "conv":
            return True
        try:
            tdt._choose_route(self.handle, dtype, activation, m.bias is not None, residuals, "r", "c")
            return True
        except UnsupportedProblemError:
            return False

    def replace(self, gm, nodes, parts, m, kind, bn, residual, activation, clamp, prefix, scale=None,
                layout=None) -> bool:
        """nodes[0] (the layer) to nodes[-1] as one fused module's call. scale: per output feature, folded into a
        linear's weight and bias; layout: the permutation between the linear's output and the last node's
        (FusedLinear's)."""
        anchor, last = nodes[0], nodes[-1]
        product = _scaled_input(anchor, m) if kind == "conv" else None
        if len(nodes) == 1 and product is None:
            return False
        inputs = (anchor.args[0],) if product is None else tuple(product.args)
        if product is not None:
            parts.insert(0, _describe(product, prefix))
        if kind == "conv":
            if bn is not None:
                # the folded layer's own parameters (as torch.ao's eval-mode fusion makes them): they require grad
                # where the conv's weight did, so a model fine-tuned with frozen batch norms still trains
                w, b = _fold_bn(m, bn)
                grad = m.weight.requires_grad
                weight, bias = nn.Parameter(w, requires_grad=grad), nn.Parameter(b, requires_grad=grad)
            else:
                weight, bias = m.weight, m.bias
            fused = (FusedConv if product is None else FusedScaledConv)(
                m, weight, bias, handle=self.handle, residual=residual is not None, activation=activation,
                clamp=clamp, folded_bn=bn is not None)
        else:
            weight, bias = m.weight, m.bias
            if scale is not None:
                w, b = _fold_scale(m, scale)
                grad = m.weight.requires_grad
                weight = nn.Parameter(w, requires_grad=grad)
                bias = None if b is None else nn.Parameter(b, requires_grad=grad)
            fused = FusedLinear(m, weight, bias, handle=self.handle, residual=residual is not None,
                                activation=activation, clamp=clamp, folded_scale=scale is not None, layout=layout)
        fused.train(m.training)
        gm.add_submodule(anchor.target, fused)  # in the layer's place: its name, and its parameters' names, stay
        with gm.graph.inserting_before(last):
            new = gm.graph.call_module(anchor.target, inputs + ((residual,) if residual is not None else ()))
        last.replace_all_uses_with(new)
        for node in reversed(nodes):
            gm.graph.erase_node(node)
        if product is not None:
            gm.graph.erase_node(product)
        folded = " (batch norm folded)" if bn is not None else " (scale folded)" if scale is not None else ""
        epilogue = " + ".join([f"bias{folded}"] * (fused.bias is not None) + ["residual"] * (residual is not None)) or (
            "none" + folded)
        if activation != "identity":
            epilogue += f", {activation}" + (f"{tuple(clamp)}" if activation == "clamp" else "")
        self.report.fused.append(FusedLayer(_join(prefix, anchor.target), type(fused).__name__, parts, epilogue))
        return True


def fuse(model: nn.Module, registry, *, inplace: bool = False, patch_rest: bool = True,
         autocast: Optional[torch.dtype] = None) -> tuple[nn.Module, FuseReport]:
    """The model with its conv / linear chains fused into single tiledispatch calls (see the module's doc), and
    a report: what was fused into what, what was kept and why, which modules fx could not trace, and (with
    patch_rest) patch()'s report on the remaining nn.Linear / nn.Conv layers, which it routes through the bundle.

    Folding batch norms follows each module's mode: call model.eval() first for inference. The model is copied
    (inplace=False) so that it stays as it was; with inplace=True its submodules are reused (and changed).
    autocast: the dtype the model will run in under torch.autocast, as for patch()."""
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"fuse takes an nn.Module, got {type(model).__name__}")
    handle = tdt.register(registry)
    model = model if inplace else copy.deepcopy(model)
    tdt.unpatch(model)  # a patched layer's forward is replaced by its fused module's, or patched again below
    report = FuseReport()
    fused = _Pass(handle, autocast, report).module(model, "")
    if patch_rest:
        report.patch = tdt.patch(fused, handle, autocast=autocast)
    return fused, report
