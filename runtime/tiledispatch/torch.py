"""tiledispatch.torch: a bundle's GEMM, grouped convolution, LayerNorm and max pooling as PyTorch operators.

    import tiledispatch as td, tiledispatch.torch as tdt
    reg = td.load("build/fp16_rcr_essential+conv_fp16_all_essential")
    y = tdt.linear(x, weight, bias, registry=reg)             # differentiable, traceable by torch.compile
    report = tdt.patch(model, reg)                            # nn.Linear / nn.Conv1d/2d/3d through the bundle
    print(report); tdt.unpatch(model)
    fused, report = tdt.fuse(model.eval(), reg)               # conv -> bn -> residual -> relu as one call each

Operators (torch.ops.tiledispatch.*; registries are passed as the small integer handle of register(), since
an operator takes no Python objects):
    gemm(a, b, bias, residuals, activation, clamp_low, clamp_high, registry)    act(a @ b + bias + sum(residuals))
    conv_fwd(x, w, bias, residuals, activation, clamp_low, clamp_high, stride, dilation, pad_lo, pad_hi, groups,
             registry)                                                  act(conv(x, w) + bias + sum(residuals))
    conv_bwd_data(dy, w, in_size, stride, dilation, pad_lo, pad_hi, groups, registry)
    conv_bwd_weight(x, dy, filter_size, stride, dilation, pad_lo, pad_hi, groups, registry)
    layer_norm(x, normalized_shape, weight, bias, eps, registry)        F.layer_norm's forward
    max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, registry)  F.max_pool1d/2d/3d's forward
They are not differentiable themselves: linear(), matmul() and conv() are, recording their calls in the
autograd graph (eagerly by the native module's C++ node, else by autograd Functions) with forward and backward
functions that call them, so torch.compile(fullgraph=True) traces both through the fake implementations.

Registration: torch.library.Library("tiledispatch", "DEF") with define + impl (a Python kernel per device
key) + register_fake. Measured on CPU with torch 2.13 (a trivial kernel; bench/benchmarks/models.py records the
current numbers): such an operator costs about 1.4 us above calling the Python function, a
torch.library.custom_op about 7 us (Python layers of its own around the same kernel, with or without an
autograd formula), and registering autograd on the operator (torch.library.register_autograd) adds about 3 us
to every call, inference included. So the operators carry no autograd kernel and the differentiable
functions use an autograd.Function only when a gradient is needed. Eager calls skip even the operator dispatch
and run the implementation directly, unless something must see the operator (see "eager calls" below).

Layouts: the bundle's conv kernels take channels-last memory with a group axis. A torch conv input
[N, C, spatial...] whose memory is channels-last (torch.channels_last / channels_last_3d; for 1D, [N, W, C]
memory) IS that layout (N, spatial..., G, C/G), and a weight [K, C/G, filter...] in channels-last memory is
(G, K/G, filter..., C/G): both are used in place. Anything else is converted by one copy per call (outputs
are always allocated channels-last). GEMM operands are used in place when the bundle has a kernel of their
layout, else copied into one it has (say, rcr only: the weight of a Linear is used in place in the forward
pass; the backward pass copies).

CUDA graphs: the operators allocate only their outputs and the conversions above through torch's allocator,
never synchronize, and launch on torch's current stream. Each (registry, stream) pair has its own registry
view (the same loaded kernels), so workspaces (Registry.workspace) and plans are per stream: a kernel that
needs a workspace gets it on its first call on a stream, from torch's allocator, and keeps it.
"""
from __future__ import annotations

import functools
import itertools
import math
import numbers
import operator
import os
import threading
import types
import weakref
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from . import native, selection
from .errors import InvalidInputError, UnsupportedProblemError
from .ops import conv as conv_op
from .ops import conv_as_gemm
from .ops import maxpool as pool_op
from .ops.conv import ConvProblem
from .ops.gemm import GemmProblem, check_size
from .ops.layernorm import LayerNormProblem
from .plan import _torch_print, last_launcher
from .registry import NO_CLAMP, Registry
from .spec.key import ACTIVATIONS, Epilogue

__all__ = ["register", "registry_of", "linear", "matmul", "conv", "layer_norm", "max_pool", "patch", "unpatch",
           "PatchReport",
           "LayerReport", "fuse", "FuseReport", "FusedLayer", "FusedConv", "FusedLinear"]

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "int8",
           torch.float64: "fp64"}  # fp64: a dtype tiledispatch knows, which a bundle may lack (a clear refusal)

# -- registries by handle ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Capabilities:
    """What a registry's kernels compute, for routing without asking every kernel."""
    gemm: frozenset  # (dtype, layout, activation, bias, residuals)
    conv: frozenset  # (direction, spatial_dims, dtype)
    conv_epilogues: frozenset  # (spatial_dims, dtype, activation, bias, residuals) of fwd kernels fusing one
    layernorm: frozenset  # dtypes of x (weight and bias in the same dtype)
    maxpool: frozenset  # dtypes


_REGISTRIES: list[Registry] = []
_CAPS: list[_Capabilities] = []
_HANDLES: dict = {}  # id(registry) -> handle
_PER_STREAM: dict = {}  # (handle, device index, raw stream) -> a Registry view with its own workspaces and plans


def register(registry: Union[Registry, int]) -> int:
    """The handle (a small int) the operators take for this registry; the same registry keeps its handle."""
    if type(registry) is int and 0 <= registry < len(_REGISTRIES):  # every call passes here: the cheap cases first
        return registry
    handle = _HANDLES.get(id(registry))
    if handle is not None and _REGISTRIES[handle] is registry:
        return handle
    if isinstance(registry, int) and not isinstance(registry, bool):
        registry_of(registry)
    if not isinstance(registry, Registry):
        raise InvalidInputError(f"registry must be a tiledispatch Registry (td.load) or a handle, got "
                                f"{type(registry).__name__}")
    gemm, convs, conv_epilogues, layernorm, maxpool = set(), set(), set(), set(), set()
    for k in registry.kernels:
        sig = k.key.signature
        e = sig.epilogue
        if sig.op == "gemm":
            gemm.add((sig.dtype_a, sig.layout, e.activation, e.bias, e.residuals))
        elif sig.op == "conv":
            if e == Epilogue():
                convs.add((sig.direction, sig.spatial_dims, sig.dtype_a))
            elif sig.direction == "fwd":
                conv_epilogues.add((sig.spatial_dims, sig.dtype_a, e.activation, e.bias, e.residuals))
        elif sig.op == "layernorm" and sig.dtype_b == sig.dtype_a:
            layernorm.add(sig.dtype_a)
        elif sig.op == "maxpool":
            maxpool.add(sig.dtype_a)
    _REGISTRIES.append(registry)  # kept alive, so its id is never reused for another object
    _CAPS.append(_Capabilities(frozenset(gemm), frozenset(convs), frozenset(conv_epilogues), frozenset(layernorm),
                               frozenset(maxpool)))
    _HANDLES[id(registry)] = len(_REGISTRIES) - 1
    return len(_REGISTRIES) - 1


def registry_of(handle: int) -> Registry:
    if isinstance(handle, bool) or not isinstance(handle, int) or not 0 <= handle < len(_REGISTRIES):
        raise InvalidInputError(f"no registry has handle {handle!r}: pass a Registry or a handle from register()")
    return _REGISTRIES[handle]


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)  # an int, without a Stream object where torch has it


def _registry_for(handle: int, t: torch.Tensor) -> Registry:
    """The registry that launches on t's device: on CUDA, the view of this (device, current stream)."""
    if not t.is_cuda:
        return _REGISTRIES[handle] if type(handle) is int and 0 <= handle < len(_REGISTRIES) else registry_of(handle)
    index = t.get_device()
    key = (handle, index, _raw_stream(index))
    reg = _PER_STREAM.get(key)
    if reg is None:
        base = registry_of(handle)
        reg = _PER_STREAM[key] = Registry(base.kernels, base.backend, base.arch, base.manifest,
                                          autotune=base.autotune, tuning_cache=base.tuning)
    return reg


def _dtype_name(t: torch.Tensor, role: str) -> str:
    name = _DTYPES.get(t.dtype)
    if name is None:
        raise InvalidInputError(f"{role}: dtype {t.dtype} has no tiledispatch equivalent")
    return name


# -- GEMM routing ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _GemmRoute:
    """How one GEMM call runs on the bundle: the layout letters A and B are brought to (None: used in place),
    whether what the kernel's epilogue lacks of the call's (the residuals, and the bias where the kernel takes none)
    goes in through beta * C, the epilogue the kernel computes, and whether torch applies the activation after it
    (no kernel computing it runs the problem)."""
    layout: str
    copy_a: Optional[str]
    copy_b: Optional[str]
    fold: bool
    epilogue: Epilogue
    activation_after: bool = False


_ROUTES: dict = {}


def _letters(t: torch.Tensor) -> str:
    """'r', 'c', 'rc' or '': the major orders a [.., rows, cols] tensor's strides give (unit stride along cols:
    r, along rows: c). A dimension of size 1 with another stride counts as strided: at worst a needless copy."""
    s = t.stride()
    return ("r" if s[-1] == 1 else "") + ("c" if s[-2] == 1 else "")


def _gemm_route(handle: int, a: torch.Tensor, b: torch.Tensor, activation: str, bias: bool,
                residuals: int) -> _GemmRoute:
    """The route of a call, cached by everything it depends on: the problem's shape among them, since whether a
    kernel can run it decides the route (this runs on every call: kept lean)."""
    sa, sb = a.stride(), b.stride()
    key = (handle, a.dtype, activation, bias, residuals, sa[-1] == 1, sa[-2] == 1, sb[-1] == 1, sb[-2] == 1,
           a.shape, b.shape)
    route = _ROUTES.get(key)
    if route is None:
        registry_of(handle)
        shape = (a.shape[0] if a.dim() == 3 else 1, a.shape[-2], b.shape[-1], a.shape[-1])
        if len(_ROUTES) >= _MEMO_SIZE:
            _ROUTES.clear()
        route = _ROUTES[key] = _choose_route(handle, _dtype_name(a, "a"), activation, bias, residuals, _letters(a),
                                             _letters(b), shape)
    return route


def _choose_route(handle, dtype, activation, bias, residuals, letters_a, letters_b, shape=None) -> _GemmRoute:
    """The route: fewest operand copies, then a fused bias / residual epilogue over beta * C. shape: the call's
    (batch, m, n, k): a route is taken only where one of its kernels can run that problem (a kernel fusing an
    epilogue may refuse, e.g., an unaligned n that a plain kernel runs); where the bundle's kernels computing the
    activation all refuse it, the identity epilogue's route with torch's activation after the kernel; None, or no
    route running it: where its kernels exist (the registry's call then says why none runs the problem). Where the
    kernels computing the activation all take a bias the call lacks, the same identity route with torch's
    activation. A bundle with no kernel computing the activation is refused, whatever the shape; so is a call
    without a shape there (fuse() asks so whether an activation fuses into a kernel)."""
    route = _cheapest_route(handle, dtype, activation, bias, residuals, letters_a, letters_b, shape)
    if route is None and shape is not None:
        route = _cheapest_route(handle, dtype, activation, bias, residuals, letters_a, letters_b, None)
        computed = route is not None or any(c[0] == dtype and c[1][2] == "r" and c[2] == activation
                                            for c in _CAPS[handle].gemm)
        plain = None if not computed or activation == "identity" else \
            _cheapest_route(handle, dtype, "identity", bias, residuals, letters_a, letters_b, shape)
        if plain is not None:
            route = replace(plain, activation_after=True)
    if route is None:
        what = f"{activation}" + (" + bias" if bias else "") + (f" + {residuals} residual(s)" if residuals else "")
        caps = _CAPS[handle].gemm
        have = sorted({f"{c[1]} {c[2]}{' + bias' if c[3] else ''}" for c in caps if c[0] == dtype})
        raise UnsupportedProblemError(
            f"the bundle has no {dtype} GEMM kernel with a row-major output computing {what}"
            + (f" (its {dtype} GEMM kernels: {', '.join(have)})" if have else f" (it has no {dtype} GEMM kernels)"))
    return route


def _cheapest_route(handle, dtype, activation, bias, residuals, letters_a, letters_b, shape) -> Optional[_GemmRoute]:
    """The cheapest route whose kernels compute this epilogue (and run the shape, where given), or None: a kernel
    fusing all of it; else one fusing the activation and the bias, the residuals through beta * C; else one fusing
    the activation alone, bias and residuals through beta * C."""
    caps = _CAPS[handle].gemm
    exact = Epilogue(activation, bias, residuals)
    with_bias = Epilogue(activation, True, 0)
    plain = Epilogue(activation, False, 0)
    best = None
    for layout in sorted({c[1] for c in caps if c[0] == dtype and c[1][2] == "r"}):
        for epi, fold in ((exact, False), (with_bias, True), (plain, True)):
            if fold and not (bias or residuals) or epi is with_bias and not (bias and residuals):
                continue
            if (dtype, layout, epi.activation, epi.bias, epi.residuals) not in caps:
                continue
            if shape is not None and not _gemm_runs(handle, dtype, layout, epi, shape):
                continue
            copy_a = None if layout[0] in letters_a else layout[0]
            copy_b = None if layout[1] in letters_b else layout[1]
            cost = (copy_a is not None) + (copy_b is not None), fold  # fewest copies, then a fused epilogue
            if best is None or cost < best[0]:
                best = cost, _GemmRoute(layout, copy_a, copy_b, fold, epi)
            break
    return None if best is None else best[1]


def _gemm_runs(handle: int, dtype: str, layout: str, epilogue: Epilogue, shape: tuple) -> bool:
    """Whether a kernel of the bundle runs this GEMM (the registry's can-run answer, cached per problem there)."""
    batch, m, n, k = shape
    if min(shape) < 1:  # an empty problem: the registry's call refuses it with its own message
        return True
    problem = GemmProblem(m, n, k, dtype, dtype, "int32" if dtype == "int8" else dtype, layout, batch, epilogue)
    return registry_of(handle).supports(problem)


def _to_major(t: torch.Tensor, letter: str) -> torch.Tensor:
    return t.contiguous() if letter == "r" else t.mT.contiguous().mT


# -- operator implementations ----------------------------------------------------------------------------
def _gemm_shape(a: torch.Tensor, b: torch.Tensor) -> tuple:
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        raise InvalidInputError(f"tiledispatch::gemm takes a [m, k] @ b [k, n] or a [B, m, k] @ b [B, k, n]; got "
                                f"shapes {list(a.shape)} and {list(b.shape)}")
    if a.shape[-1] != b.shape[-2] or (a.dim() == 3 and a.shape[0] != b.shape[0]):
        raise InvalidInputError(f"tiledispatch::gemm: shapes {list(a.shape)} and {list(b.shape)} do not multiply")
    return (*a.shape[:-1], b.shape[-1])


def _gemm_out_dtype(a: torch.Tensor) -> torch.dtype:
    return torch.int32 if a.dtype == torch.int8 else a.dtype


# -- empty problems ------------------------------------------------------------------------------------------
# Frameworks pass empty tensors (a batch of none, a dynamic batch that came out empty). torch answers them without
# a kernel, and so do the operators: an empty output is allocated as it would be; where only the reduction is empty
# (K = 0 of a GEMM; a conv's dW over a batch of none), the result is the epilogue on a zero accumulator:
# act(bias + sum(residuals)), zeros for a gradient. No kernel runs, so nothing is remembered for the fast path.
# The other operands are checked as a call that runs a kernel checks them. A conv's empty channels or spatial dims
# stay refused (torch refuses them too, or answers C = 0 with an output of no channels).
def _empty_gemm(a, b, bias, residuals, activation: str, clamp: tuple) -> torch.Tensor:
    """The result of a GEMM with M, N, K or the batch 0."""
    out = a.new_zeros(_gemm_shape(a, b), dtype=_gemm_out_dtype(a))
    if not out.numel():
        _check_sum_operands(out, bias, residuals)
        return out
    if bias is not None or residuals:
        _fill_with_sum(out, bias, residuals)  # (its checks, too)
    return _activate_(out, activation, clamp)


def _checked_empty_batch(direction: str, x_shape, w_shape, like: torch.Tensor, geo: _Geometry, dy=None) -> None:
    """A conv problem of batch 0 checked as the registry checks it with a batch of one (channels, groups, spans,
    the dtype of like); x_shape is X's [N, C, spatial...] (dX's for bwd_data), w_shape W's [K, C/G, filter...], dy
    the output's gradient where the direction takes one."""
    if len(x_shape) != len(w_shape) or len(x_shape) - 2 != geo.rank:
        raise InvalidInputError(f"conv {direction}: shapes {list(x_shape)} and {list(w_shape)} do not match a "
                                f"{geo.rank}D convolution")
    if x_shape[1] != w_shape[1] * geo.groups:
        raise InvalidInputError(f"conv {direction}: x has {x_shape[1]} channels, the weight {list(w_shape)} takes "
                                f"{w_shape[1]} x {geo.groups} groups")
    dtype = _dtype_name(like, f"conv {direction}")
    ConvProblem(direction, 1, geo.groups, x_shape[1], w_shape[0], tuple(x_shape[2:]), tuple(w_shape[2:]), geo.stride,
                geo.dilation, geo.pad_lo, geo.pad_hi, dtype, dtype, dtype)
    if dy is not None:
        y_shape = _checked_fwd_shape(x_shape, w_shape, geo.stride, geo.dilation, geo.pad_lo, geo.pad_hi, 1)
        if tuple(dy.shape) != y_shape:
            raise InvalidInputError(f"conv {direction}: dy has shape {list(dy.shape)}, expected {list(y_shape)}")


def _empty_conv_fwd(x, w, bias, residuals, geo: _Geometry) -> torch.Tensor:
    """The forward conv of a batch of none: an empty output (its operands' dtypes checked by the caller)."""
    _checked_empty_batch("fwd", x.shape, w.shape, x, geo)
    shape = geo.fwd_shape(x, w)
    _check_epilogue_shapes(bias, residuals, w.shape[0], shape)
    return _new_channels_last(shape, x)


def _check_epilogue_shapes(bias, residuals, k: int, shape: tuple) -> None:
    """A conv's bias [K] and residuals of the output's shape, refused by name otherwise."""
    if bias is not None and bias.shape != (k,):
        raise InvalidInputError(f"conv bias has shape {list(bias.shape)}, expected [{k}]")
    for i, r in enumerate(residuals):
        if r.shape != shape:
            raise InvalidInputError(f"conv residual {i} has shape {list(r.shape)}, expected {list(shape)} (the "
                                    f"output's)")


def _gemm_impl(a, b, bias, residuals, activation, clamp_low, clamp_high, registry):
    residuals = tuple(residuals)
    grad = _requires_grad(a, b, bias, *residuals)
    return _remembered(registry, a, b, bias, residuals, ("gemm", activation, clamp_low, clamp_high), _gemm_run, a, b,
                       bias, residuals, activation, clamp_low, clamp_high, registry, grad=grad)


def _gemm_run(a, b, bias, residuals, activation, clamp_low, clamp_high, registry):
    """The GEMM on the bundle: the operator's implementation, which eager calls enter directly."""
    # Shapes that do not multiply are refused by reg.gemm's checks (its plan cache is keyed by shapes); only the
    # rank is checked here, before the output is allocated.
    rank = a.dim()
    if rank != b.dim() or not 2 <= rank <= 3:
        _gemm_shape(a, b)
    route = _gemm_route(registry, a, b, activation, bias is not None, len(residuals))  # (refusals as for any shape)
    if not (a.numel() and b.numel()):
        return _empty_gemm(a, b, bias, residuals, activation, (clamp_low, clamp_high) if activation == "clamp"
                           else NO_CLAMP)
    reg = _registry_for(registry, a) if a.is_cuda else _REGISTRIES[registry]
    sa = a.shape
    shape = (sa[0], b.shape[-1]) if rank == 2 else (sa[0], sa[1], b.shape[-1])
    out = a.new_empty(shape) if a.dtype is not torch.int8 else a.new_empty(shape, dtype=torch.int32)
    if route.copy_a:
        a = _to_major(a, route.copy_a)
    if route.copy_b:
        b = _to_major(b, route.copy_b)
    clamp = (clamp_low, clamp_high) if activation == "clamp" else NO_CLAMP
    kernel_activation = route.epilogue.activation
    kernel_clamp = clamp if kernel_activation == "clamp" else NO_CLAMP
    _launch_route(reg, route, a, b, out, bias, residuals, kernel_activation, kernel_clamp)
    if not (route.fold or route.copy_a or route.copy_b or route.activation_after):
        _mark_direct(_gemm_pointers)
    return _activate_(out, activation, clamp) if route.activation_after else out


def _launch_route(reg, route: _GemmRoute, a, b, out, bias, residuals, activation: str, clamp: tuple) -> None:
    """out = act(a @ b + bias + sum(residuals)) on the route's kernel: what its epilogue lacks goes in through
    beta * C, written into out first (C aliases out)."""
    if route.fold:
        _fill_with_sum(out, None if route.epilogue.bias else bias, residuals)
        reg.gemm(a, b, out, c=out, beta=1.0, bias=bias if route.epilogue.bias else None, activation=activation,
                 clamp=clamp)
    else:
        reg.gemm(a, b, out, bias=bias, residuals=residuals, activation=activation, clamp=clamp)


def _fill_with_sum(out: torch.Tensor, bias: Optional[torch.Tensor], residuals: Sequence[torch.Tensor]) -> None:
    """out = bias + sum(residuals), with the checks the fused kernels' operands get."""
    _check_sum_operands(out, bias, residuals)
    if bias is not None:
        out.copy_(bias)  # broadcast over the rows
        for r in residuals:
            out.add_(r)
    else:
        out.copy_(residuals[0])
        for r in residuals[1:]:
            out.add_(r)


def _check_sum_operands(out: torch.Tensor, bias: Optional[torch.Tensor], residuals: Sequence[torch.Tensor]) -> None:
    """The fused kernels' checks of a GEMM's bias and residuals: out's dtype, no broadcasting but the bias's over
    rows."""
    for role, t, shape in (("bias", bias, out.shape[-1:]), *((f"residual {i}", r, out.shape)
                                                              for i, r in enumerate(residuals))):
        if t is None:
            continue
        if t.dtype != out.dtype:
            raise InvalidInputError(f"{role} has dtype {t.dtype}, expected {out.dtype} (the output dtype)")
        if t.shape != shape:
            raise InvalidInputError(f"{role} has shape {list(t.shape)}, expected {list(shape)}")


def _gemm_fake(a, b, bias, residuals, activation, clamp_low, clamp_high, registry):
    return a.new_empty(_gemm_shape(a, b), dtype=_gemm_out_dtype(a))


def _is_channels_last(t: torch.Tensor) -> bool:
    """Whether t [N or K, C, spatial...] has channels-last memory, the bundle's layout."""
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    if t.dim() == 5:
        return t.is_contiguous(memory_format=torch.channels_last_3d)
    return t.transpose(1, -1).is_contiguous() if t.dim() == 3 else t.movedim(1, -1).is_contiguous()


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """t itself when its memory is channels-last, else a channels-last copy (same logical shape)."""
    rank = t.dim()  # _is_channels_last's test, inlined for the common ranks (this runs on every call)
    if rank == 4:
        if t.is_contiguous(memory_format=torch.channels_last):
            return t
    elif rank == 5:
        if t.is_contiguous(memory_format=torch.channels_last_3d):
            return t
    elif _is_channels_last(t):
        return t
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def _empty_channels_last(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A new [N, C, spatial...] tensor whose memory is [N, spatial..., C] (the fake implementations' form: it
    takes symbolic sizes)."""
    lead, chan, spatial = shape[0], shape[1], shape[2:]
    return like.new_empty((lead, *spatial, chan)).movedim(-1, 1)


_CL_STRIDES: dict = {}  # [N, C, spatial...] shape -> its channels-last strides


def _contiguous_strides(shape: tuple) -> tuple:
    """The strides of a contiguous tensor of this shape (as torch's: a dim of size 0 counts as 1)."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _channels_last_strides(shape: tuple) -> tuple:
    """The strides of a [N, C, spatial...] tensor whose memory is [N, spatial..., C]."""
    memory = _contiguous_strides((shape[0], *shape[2:], shape[1]))
    return (memory[0], memory[-1], *memory[1:-1])


def _new_channels_last(shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """_empty_channels_last's tensor (same strides) in one allocation call: an empty + movedim pair costs three
    times as much host time."""
    strides = _CL_STRIDES.get(shape)
    if strides is None:
        if len(_CL_STRIDES) >= _MEMO_SIZE:
            _CL_STRIDES.clear()
        strides = _CL_STRIDES[shape] = _channels_last_strides(shape)
    return like.new_empty_strided(shape, strides)


def _out_size(in_size, filter_size, stride, dilation, pad_lo, pad_hi) -> list:
    return [(i + lo + hi - d * (f - 1) - 1) // s + 1
            for i, f, s, d, lo, hi in zip(in_size, filter_size, stride, dilation, pad_lo, pad_hi)]


def _checked_fwd_shape(x_shape, w_shape, stride, dilation, pad_lo, pad_hi, itemsize: int) -> tuple:
    """The forward output's shape, refused as the registry's problem check refuses it (ops/conv.py ConvProblem:
    a filter wider than the padded input, more elements than an int64 byte count holds), since the output is
    allocated before that check runs."""
    conv_op.check_spans(x_shape[2:], w_shape[2:], dilation, pad_lo, pad_hi)
    shape = (x_shape[0], w_shape[0], *_out_size(x_shape[2:], w_shape[2:], stride, dilation, pad_lo, pad_hi))
    if all(type(v) is int for v in shape):  # symbolic sizes (a dynamic trace): checked when the call runs
        check_size("conv y", shape, itemsize)
    return shape


class _Geometry:
    """A convolution's stride, dilation, padding and groups (tuples of ints, one per spatial dim), with what every
    call derives from them made once: the registry options per direction with their launch-cache key (no option
    dict to build or key to derive per call), the bias view's shape and the output shapes seen."""
    __slots__ = ("stride", "dilation", "pad_lo", "pad_hi", "groups", "rank", "strided", "options", "keys",
                 "bias_shape", "out_shapes", "phase_plans")

    def __init__(self, stride: tuple, dilation: tuple, pad_lo: tuple, pad_hi: tuple, groups: int):
        for name, values, least in (("stride", stride, 1), ("dilation", dilation, 1), ("pad_lo", pad_lo, 0),
                                    ("pad_hi", pad_hi, 0)):  # output shapes are computed from them before any check
            conv_op._ints(name, values, len(values), least, conv_op.MAX_GEOMETRY)  # the registry's check, message
        self.stride, self.dilation, self.pad_lo, self.pad_hi, self.groups = stride, dilation, pad_lo, pad_hi, groups
        self.rank = len(stride)
        self.strided = any(s > 1 for s in stride)
        base = {"stride": stride, "dilation": dilation, "pad_lo": pad_lo, "pad_hi": pad_hi, "groups": groups}
        self.options = {beta: {**base, "beta": beta} for beta in (0.0, 1.0)}
        self.keys = {beta: conv_op.options_key(options) for beta, options in self.options.items()}
        self.bias_shape = (1, -1) + (1,) * self.rank
        self.out_shapes: dict = {}  # (x.shape, w.shape) -> y's shape (forward)
        self.phase_plans: dict = {}  # (dy.shape, w.shape, dx.shape) -> _phases (strided bwd_data by phase)

    def fwd_shape(self, x: torch.Tensor, w: torch.Tensor) -> tuple:
        xs, ws = x.shape, w.shape
        shape = self.out_shapes.get((xs, ws))
        if shape is None:
            shape = _checked_fwd_shape(xs, ws, self.stride, self.dilation, self.pad_lo, self.pad_hi, x.element_size())
            if len(self.out_shapes) >= _MEMO_SIZE:
                self.out_shapes.clear()
            self.out_shapes[xs, ws] = shape
        return shape


_MEMO_SIZE = 256  # entries of each shape memo (cleared when full: they only save recomputation)
_GEOMETRIES: dict = {}


def _geometry(stride, dilation, pad_lo, pad_hi, groups) -> _Geometry:
    """The _Geometry of these values: sequences of plain ints and an int (torch.ops passes them so; the public
    functions check theirs: True == 1 hashes alike, so nothing else may reach the memo)."""
    key = (tuple(stride), tuple(dilation), tuple(pad_lo), tuple(pad_hi), groups)
    geo = _GEOMETRIES.get(key)
    if geo is None:
        if len(_GEOMETRIES) >= _MEMO_SIZE:
            _GEOMETRIES.clear()
        geo = _GEOMETRIES[key] = _Geometry(*key)
    return geo


# -- channel padding ---------------------------------------------------------------------------------------
# A dense conv whose channel count C is not a multiple of the aligned kernels' vector (16 bytes: 8 fp16 channels) runs
# on a backend's fallback kernel (cutlass's generic implicit GEMM, element-wise loads, cost_factor 8). The same conv
# with X and W zero-padded to whole 8- or 16-byte vectors may select an ordinary kernel: the extra channels add zeros
# to every sum, the output is unchanged (fwd; bwd_weight keeps dW's first C channels), and the copy costs a pass
# over X. Of the conv as it is and padded to each vector width, the one whose selected kernel the cost model
# (selection.estimated_cost) rates cheapest runs. Measured on the H200 (bench/results/channel_padding_align4_h200,
# batch 32, the copy included): ResNet-50's 7x7 stem fwd 0.32 ms as it is, 0.23 padded to 8, 0.18 to 4 (the 8-byte
# kernels); bwd_weight 0.71, 0.43, 0.40.
_PLAIN_EPILOGUE = Epilogue()
_PAD_ROUTES: dict = {}  # (handle, direction, dtype, shapes, geometry, epilogue) -> padded channel count, or 0
_PAD_VECTOR_BYTES = (8, 16)


def _vector_channels(t: torch.Tensor) -> int:
    """Channels in one 16-byte access of t's dtype."""
    return max(1, 16 // t.element_size())


def _selected_cost(reg: Registry, problem: ConvProblem) -> Optional[float]:
    """The cost model's estimate for the kernel the registry selects for the problem; where no kernel runs it with
    its epilogue, for the plain problem's (the epilogue then goes around that kernel: beta * Y, or a GEMM fusing
    it, as _conv_fwd_epilogue_run routes it); None when no kernel of the bundle runs the plain problem either.
    Without that fallback, a bundle with no conv kernel fusing a bias refused every route for a stem with one
    (bench/results/stem_route_h200: ConvNeXt-T's 4x4 stride-4 stem 124 us as it is, 37 us on its space-to-depth
    copy)."""
    for candidate in (problem, replace(problem, epilogue=_PLAIN_EPILOGUE)):
        try:
            kern = reg.select(candidate)
        except (InvalidInputError, UnsupportedProblemError):
            continue
        return selection.estimated_cost(candidate, kern.key)
    return None


def _channel_padding(handle: int, direction: str, x: torch.Tensor, k: int, filter_size: tuple, geo: _Geometry,
                     epilogue: Epilogue) -> int:
    """The channel count to zero-pad a dense conv's X (and fwd's W) to, or 0 to run it as it is (see above);
    cached per problem."""
    key = (handle, direction, x.dtype, x.shape, k, filter_size, geo.stride, geo.dilation, geo.pad_lo, geo.pad_hi,
           epilogue)
    wide = _PAD_ROUTES.get(key)
    if wide is None:
        c, size = x.shape[1], x.element_size()
        reg = registry_of(handle)

        def cost(channels: int) -> Optional[float]:
            dtype = _dtype_name(x, "x")
            return _selected_cost(reg, ConvProblem(direction, x.shape[0], 1, channels, k, tuple(x.shape[2:]),
                                                   filter_size, geo.stride, geo.dilation, geo.pad_lo, geo.pad_hi,
                                                   dtype, dtype, dtype, epilogue=epilogue))
        widths = sorted({-(-c // v) * v for v in (max(1, b // size) for b in _PAD_VECTOR_BYTES)} - {c})
        wide, best = 0, None
        try:
            best = cost(c)
            for channels in widths:
                padded = cost(channels)
                if padded is not None and (best is None or padded < best):
                    wide, best = channels, padded
        except InvalidInputError:  # dtypes or shapes the plain path's checks refuse, with their own message
            wide = 0
        if len(_PAD_ROUTES) >= _MEMO_SIZE:
            _PAD_ROUTES.clear()
        _PAD_ROUTES[key] = wide
    return wide


def _channels_last_filter(w: torch.Tensor) -> torch.Tensor:
    """_channels_last(w), a copy cached while w is unmodified (_derived)."""
    return w if _is_channels_last(w) else _derived(w, ("channels_last",), lambda: _channels_last(w))


def _zero_padded_channels(t: torch.Tensor, channels: int) -> torch.Tensor:
    """A channels-last copy of t [N or K, C, spatial...] with zero channels appended up to `channels`."""
    out = _new_channels_last((t.shape[0], channels, *t.shape[2:]), t)
    out.zero_()  # whole: one contiguous fill, where zeroing the extra channels alone writes a strided slice
    out[:, :t.shape[1]].copy_(t)
    return out


def _fwd_operands(handle: int, x: torch.Tensor, w: torch.Tensor, geo: _Geometry, epilogue: Epilogue) -> tuple:
    """fwd's channels-last (x, w, geo) as they run: a dense conv with few channels on a space-to-depth copy
    (_space_to_depth) or zero-padded in its channels (_channel_padding) where that runs faster, else as given.
    Those copies are made from x as it is (one copy, not a channels-last one first); what is derived from w alone
    is cached (_derived)."""
    if geo.groups == 1 and x.shape[1] % _vector_channels(x) and x.shape[0]:  # (a batch of none: _empty_conv_fwd)
        s2d = _space_to_depth(handle, "fwd", x, w.shape[0], tuple(w.shape[2:]), geo, epilogue)
        if s2d is not None:
            return _to_depth(x, s2d), _derived(w, ("depth", s2d), lambda: _filter_to_depth(w, s2d)), s2d.geo
        wide = _channel_padding(handle, "fwd", x, w.shape[0], tuple(w.shape[2:]), geo, epilogue)
        if wide:
            return (_zero_padded_channels(x, wide), _derived(w, ("channels", wide), lambda: _zero_padded_channels(
                w, wide)), geo)
    return _channels_last(x), _channels_last_filter(w), geo


# -- space to depth ---------------------------------------------------------------------------------------------
# A strided dense conv with few input channels (an RGB stem: 7x7 stride 2, C = 3) as a unit-stride conv on a
# space-to-depth copy of its input: each s_1 x ... x s_d block of the zero-padded input becomes one pixel of
# C' = prod(s) * C channels, and the filter's R taps per dim become ceil(R / s) taps of those pixels (zero where
# s * tap + offset >= R). The sums are the same ones, so the output is exact; the problem has prod(s) times the
# channels (aligned kernels instead of few-channel ones) and about prod(s) times fewer taps. C is first
# zero-padded so that C' is a whole number of 16-byte vectors. bwd_weight runs on the same copy, and dW comes back by
# the inverse mapping. Chosen where the filter gains few zero taps (prod(ceil(R / s) * s) / prod(R) at most
# _S2D_MOST_EXTRA: 7x7 / 2 1.31, 4x4 / 4 and 10 / 5 1.0, but 3x3 / 2 1.78) and the cost model rates the selected
# kernel of the transformed problem cheaper than that of the problem as it is (after its channel padding). The tap
# limit: 3x3 / 2 stems ran slower mapped on the H200, where 7x7 / 2, 4x4 / 4, 10 / 5 and 3x7x7 ones ran faster
# (bench/results/space_to_depth_h200).
SPACE_TO_DEPTH_ROUTES = ("auto", "on", "off")
_S2D_MOST_EXTRA = 4 / 3
_SPACE_TO_DEPTH = "auto"
_S2D_ROUTES: dict = {}  # (handle, direction, dtype, x.shape, k, filter, geometry, epilogue) -> _SpaceToDepth or None


class _SpaceToDepth(NamedTuple):
    """How a conv maps onto its space-to-depth problem: the block (the stride), the input channels padded to,
    the input's padding per dim (low, high: high < 0 crops), the taps per dim and the unit-stride geometry."""
    block: tuple
    channels: int
    pads: tuple
    taps: tuple
    geo: "_Geometry"


def set_space_to_depth(route: str) -> None:
    """Whether the torch operators run a strided dense conv with fewer input channels than a 16-byte vector holds
    as a unit-stride conv on a space-to-depth copy of its input: "auto" (the default) where the cost model rates it
    cheaper, "on" wherever it applies, "off" never. The environment variable TD_SPACE_TO_DEPTH sets the initial
    route."""
    global _SPACE_TO_DEPTH
    if route not in SPACE_TO_DEPTH_ROUTES:
        raise InvalidInputError(f"space-to-depth route {route!r}: one of {', '.join(SPACE_TO_DEPTH_ROUTES)}")
    _SPACE_TO_DEPTH = route
    _S2D_ROUTES.clear()


def _space_to_depth_plan(x_shape: tuple, filter_size: tuple, geo: "_Geometry", vector: int) -> _SpaceToDepth:
    block, c = geo.stride, x_shape[1]
    cells = math.prod(block)
    channels = c
    while (cells * channels) % vector:
        channels += 1
    taps = tuple(-(-f // s) for f, s in zip(filter_size, block))
    out = _out_size(x_shape[2:], filter_size, block, geo.dilation, geo.pad_lo, geo.pad_hi)
    # the padded input holds s * (out + taps - 1) rows per dim: the rows the unit-stride problem reads
    pads = tuple((lo, s * (o + t - 1) - size - lo) for s, o, t, size, lo in zip(block, out, taps, x_shape[2:],
                                                                                 geo.pad_lo))
    rank = len(block)
    return _SpaceToDepth(block, channels, pads, taps, _geometry((1,) * rank, (1,) * rank, (0,) * rank, (0,) * rank, 1))


def _space_to_depth(handle: int, direction: str, x: torch.Tensor, k: int, filter_size: tuple, geo: "_Geometry",
                    epilogue: Epilogue) -> Optional[_SpaceToDepth]:
    """The space-to-depth mapping to run this conv by (see above), or None; cached per problem."""
    if (_SPACE_TO_DEPTH == "off" or geo.groups != 1 or not geo.strided or any(d != 1 for d in geo.dilation)
            or x.shape[1] >= _vector_channels(x)):
        return None
    key = (handle, direction, x.dtype, x.shape, k, filter_size, geo.stride, geo.pad_lo, geo.pad_hi, epilogue)
    if key in _S2D_ROUTES:
        return _S2D_ROUTES[key]
    plan = _space_to_depth_plan(tuple(x.shape), tuple(filter_size), geo, _vector_channels(x))
    if _SPACE_TO_DEPTH == "auto" and not _space_to_depth_pays(handle, direction, x, k, filter_size, geo, epilogue,
                                                              plan):
        plan = None
    if len(_S2D_ROUTES) >= _MEMO_SIZE:
        _S2D_ROUTES.clear()
    _S2D_ROUTES[key] = plan
    return plan


def _space_to_depth_pays(handle: int, direction: str, x: torch.Tensor, k: int, filter_size: tuple,
                         geo: "_Geometry", epilogue: Epilogue, plan: _SpaceToDepth) -> bool:
    """Whether the mapped filter gains few zero taps and the cost model rates the selected kernel of the mapped
    problem cheaper than that of the problem as it is (after its channel padding)."""
    if math.prod(t * s for t, s in zip(plan.taps, plan.block)) > _S2D_MOST_EXTRA * math.prod(filter_size):
        return False
    reg = registry_of(handle)
    try:
        as_is, mapped = (_selected_cost(reg, problem) for problem in
                         _space_to_depth_problems(handle, direction, x, k, filter_size, geo, epilogue, plan))
    except InvalidInputError:  # dtypes or shapes the plain path's checks refuse, with their own message
        return False
    return mapped is not None and (as_is is None or mapped < as_is)


def _space_to_depth_problems(handle: int, direction: str, x: torch.Tensor, k: int, filter_size: tuple,
                             geo: "_Geometry", epilogue: Epilogue, plan: _SpaceToDepth) -> tuple:
    """(the problem as it runs without the mapping, after its channel padding; the mapped unit-stride problem):
    what _space_to_depth_pays compares."""
    dtype = _dtype_name(x, "x")

    def problem(channels: int, in_size, taps, g: "_Geometry") -> ConvProblem:
        return ConvProblem(direction, x.shape[0], 1, channels, k, tuple(in_size), tuple(taps), g.stride, g.dilation,
                           g.pad_lo, g.pad_hi, dtype, dtype, dtype, epilogue=epilogue)
    wide = _channel_padding(handle, direction, x, k, tuple(filter_size), geo, epilogue)
    out = _out_size(x.shape[2:], filter_size, geo.stride, geo.dilation, geo.pad_lo, geo.pad_hi)
    return (problem(wide or x.shape[1], x.shape[2:], filter_size, geo),
            problem(math.prod(plan.block) * plan.channels, [o + t - 1 for o, t in zip(out, plan.taps)], plan.taps,
                    plan.geo))


def _to_depth(x: torch.Tensor, plan: _SpaceToDepth) -> torch.Tensor:
    """x [N, C, H...] as the channels-last [N, prod(block) * channels, H'...] input of the unit-stride problem: zero
    padded (channels and spatial dims), then each block's pixels side by side in the channels (block offsets
    outer, channels inner)."""
    pads, split, order, shape = _depth_layout(plan.block, plan.channels, plan.pads, tuple(x.shape))
    xp = x if pads is None else F.pad(x, pads)  # (patchify stems: blocks tile the input exactly; one copy, not two)
    return xp.reshape(split).permute(order).reshape(shape).movedim(-1, 1)  # (a view where x is dense)


@functools.lru_cache(maxsize=256)
def _depth_layout(block: tuple, channels: int, pads: tuple, shape: tuple) -> tuple:
    """_to_depth's steps for an input of `shape`, derived once per shape: F.pad's pads (None: none), the view
    splitting each padded dim into (blocks, block), the permutation [N, C, B1, S1, B2, S2, ...] -> [N, B1, B2, ...,
    S1, S2, ..., C] and the shape that merges the block offsets with the channels."""
    rank = len(block)
    flat = (*(v for lo_hi in reversed(pads) for v in lo_hi), 0, channels - shape[1])
    blocks = [(size + lo + hi) // s for size, (lo, hi), s in zip(shape[2:], pads, block)]
    split = (shape[0], channels, *(v for b, s in zip(blocks, block) for v in (b, s)))
    order = (0, *range(2, 2 + 2 * rank, 2), *range(3, 3 + 2 * rank, 2), 1)
    return (flat if any(flat) else None), split, order, (shape[0], *blocks, -1)


def _filter_to_depth(w: torch.Tensor, plan: _SpaceToDepth) -> torch.Tensor:
    """w [K, C, R...] as the unit-stride problem's channels-last filter [K, prod(block) * channels, taps...]."""
    return _to_depth(w, plan._replace(pads=tuple((0, t * s - r) for t, s, r in zip(plan.taps, plan.block,
                                                                                   w.shape[2:]))))


def _filter_from_depth(dw: torch.Tensor, plan: _SpaceToDepth, channels: int, filter_size: tuple) -> torch.Tensor:
    """The inverse of _filter_to_depth: the unit-stride problem's dW as the conv's channels-last [K, C, R...]."""
    rank = len(plan.block)
    k = dw.shape[0]
    split = dw.movedim(1, -1).reshape(k, *plan.taps, *plan.block, plan.channels)
    # [K, T1, T2, ..., S1, S2, ..., C] -> [K, C, T1, S1, T2, S2, ...]
    order = (0, 1 + 2 * rank, *(v for i in range(rank) for v in (1 + i, 1 + rank + i)))
    full = split.permute(order).reshape(k, plan.channels, *(t * s for t, s in zip(plan.taps, plan.block)))
    return _channels_last(full[(slice(None), slice(0, channels), *(slice(0, r) for r in filter_size))])


set_space_to_depth(os.environ.get("TD_SPACE_TO_DEPTH", "auto"))


def _check_conv_dtypes(*tensors) -> None:
    first = tensors[0][1]
    for role, t in tensors:
        if t is not None and t.dtype != first.dtype:
            raise InvalidInputError(f"conv: {role} has dtype {t.dtype}, {tensors[0][0]} has {first.dtype}")


def _conv_fwd_shape(x, w, stride, dilation, pad_lo, pad_hi):
    return _checked_fwd_shape(x.shape, w.shape, stride, dilation, pad_lo, pad_hi, x.element_size())


def _conv_fwd_impl(x, w, bias, residuals, activation, clamp_low, clamp_high, stride, dilation, pad_lo, pad_hi, groups,
                   registry):
    geo = _geometry(stride, dilation, pad_lo, pad_hi, groups)
    residuals, clamp = tuple(residuals), (clamp_low, clamp_high)
    options, grad = ("conv", activation, clamp, geo), _requires_grad(x, w, bias, *residuals)
    if bias is None and not residuals and activation == "identity":
        return _remembered(registry, x, w, None, (), options, _conv_fwd_run, x, w, geo, registry, grad=grad)
    return _remembered(registry, x, w, bias, residuals, options, _conv_fwd_epilogue_run, x, w, bias, residuals,
                       activation, clamp, geo, registry, grad=grad)


def _conv_fwd_run(x, w, geo: _Geometry, handle: int):
    """The forward convolution without an epilogue on the bundle: the operator's implementation, which eager
    calls enter directly (with an epilogue: _conv_fwd_epilogue_run)."""
    if w.dtype != x.dtype:
        _check_conv_dtypes(("x", x), ("w", w))
    if not x.shape[0]:
        return _empty_conv_fwd(x, w, None, (), geo)
    reg = _registry_for(handle, x)
    xc, wc, geo = _fwd_operands(handle, x, w, geo, _PLAIN_EPILOGUE)
    if _mapped(x, w, xc, wc):
        return _on_copies(handle, xc, wc, None, (), "identity", NO_CLAMP, geo)
    y = _new_channels_last(geo.fwd_shape(xc, wc), xc)
    conv_op.run(reg, "fwd", xc, wc, y, y, geo.options[0.0], geo.keys[0.0])
    if xc is x and wc is w:
        _mark_direct(_conv_pointers)
    return y


def _mapped(x, w, xc, wc) -> bool:
    """Whether _fwd_operands mapped the operands (channels-last copies, space to depth, channel padding) to ones
    it takes as they are: channels-last, their channels a whole number of vectors."""
    return (xc is not x or wc is not w) and _channels_last(xc) is xc and _channels_last(wc) is wc and \
        not xc.shape[1] % _vector_channels(xc)


def _on_copies(handle: int, x, w, bias, residuals: tuple, activation: str, clamp: tuple, geo: _Geometry):
    """The forward conv on operands _fwd_operands mapped, as a launch remembered under the copies' fingerprints
    (the caller's call launches on no tensor of its own, so it is not one to remember): a later call copies again
    (its filter copy is cached, _derived) and launches the remembered call instead of routing and checking anew."""
    options, grad = ("conv", activation, clamp, geo), _requires_grad(x, w, bias, *residuals)
    if bias is None and not residuals and activation == "identity":
        y = _remembered(handle, x, w, None, (), options, _conv_fwd_run, x, w, geo, handle, grad=grad)
    else:
        y = _remembered(handle, x, w, bias, residuals, options, _conv_fwd_epilogue_run, x, w, bias, residuals,
                        activation, clamp, geo, handle, grad=grad)
    _DIRECT.launch = None  # that launch read the copies: the caller's call, which read its own tensors, is not it
    return y


def _conv_fwd_epilogue_run(x, w, bias, residuals, activation: str, clamp: tuple, geo: _Geometry, handle: int):
    """act(conv(x, w) + bias + sum(residuals)) on the bundle: one call of a conv kernel fusing that epilogue where
    one runs the problem and is not rated far slower than the plain kernel (_conv_route); for a pointwise problem,
    else one call of a GEMM kernel fusing it (as ops/conv_as_gemm.py lowers the plain problem); else the plain conv
    kernel with bias and residuals added through beta * Y (Y holding their sum first) and the activation applied by
    torch, in place."""
    dtype = x.dtype
    for role, t in (("w", w), ("bias", bias), *((f"residual {i}", r) for i, r in enumerate(residuals))):
        if t is not None and t.dtype != dtype:
            raise InvalidInputError(f"conv: {role} has dtype {t.dtype}, x has {dtype}")
    if activation not in ACTIVATIONS:
        raise InvalidInputError(f"unknown activation {activation!r} (known: {', '.join(ACTIVATIONS)})")
    if not x.shape[0]:
        return _empty_conv_fwd(x, w, bias, residuals, geo)
    xc, wc, geo = _fwd_operands(handle, x, w, geo, Epilogue(activation, bias is not None, len(residuals)))
    if _mapped(x, w, xc, wc):
        return _on_copies(handle, xc, wc, bias, residuals, activation, clamp, geo)
    in_place = xc is x and wc is w and all(_channels_last(r) is r for r in residuals)  # the caller's memory, as given
    x, w = xc, wc
    shape = geo.fwd_shape(x, w)
    _check_epilogue_shapes(bias, residuals, w.shape[0], shape)
    reg = _registry_for(handle, x)
    y = _new_channels_last(shape, x)
    route = _conv_route(handle, x, w, geo, activation, bias is not None, len(residuals))
    if route == "conv":
        reg.conv_fwd(x, w, y, **geo.options[0.0], bias=bias, residuals=tuple(map(_channels_last, residuals)),
                     activation=activation, **({"clamp": clamp} if activation == "clamp" else {}))
        if in_place:
            _mark_direct(_conv_epilogue_pointers)
        return y
    if route in ("gemm", "gemm_padded"):
        return _pointwise_gemm(reg, handle, x, w, bias, residuals, activation, clamp, y, in_place,
                               padded=route == "gemm_padded")
    if bias is None and not residuals:
        conv_op.run(reg, "fwd", x, w, y, y, geo.options[0.0], geo.keys[0.0])
    else:  # y = conv + 1 * y, y holding bias + residuals first: the adds happen in the kernel's epilogue
        if bias is not None:
            y.copy_(bias.view(geo.bias_shape))  # broadcast over N and the spatial dims
            for r in residuals:
                y.add_(r)
        else:
            y.copy_(residuals[0])
            for r in residuals[1:]:
                y.add_(r)
        conv_op.run(reg, "fwd", x, w, y, y, geo.options[1.0], geo.keys[1.0])
    return _activate_(y, activation, clamp)


def _activate_(y: torch.Tensor, activation: str, clamp: tuple) -> torch.Tensor:
    """y with the activation applied in place."""
    return _activation_ops(activation)[1](y, clamp)


_CONV_ROUTES: dict = {}  # (handle, dtype, shapes, geometry, epilogue) -> "conv", "gemm" or None (see below)


def _conv_route(handle: int, x, w, geo: _Geometry, activation: str, bias: bool, residuals: int) -> Optional[str]:
    """How a conv with this epilogue runs (cached per problem): "conv" where a conv kernel of the bundle fusing it
    runs the problem (its can-run answer) and is not rated far slower than the plain kernel (_fusing_pays);
    "gemm" for a pointwise dense problem whose GEMM (pixels x channels) a GEMM kernel runs with the epilogue (bias
    and residuals fused or through beta * C, the activation fused); "gemm_padded": that GEMM with its output
    channels zero-padded (_pads_outputs);
    None: the plain conv kernel, bias and residuals through beta * Y, torch's activation."""
    key = (handle, x.dtype, x.shape, w.shape, geo.stride, geo.dilation, geo.pad_lo, geo.pad_hi, geo.groups,
           activation, bias, residuals)
    route = _CONV_ROUTES.get(key, False)
    if route is False:
        dtype = _dtype_name(x, "x")
        route = None
        try:
            problem = ConvProblem("fwd", x.shape[0], geo.groups, x.shape[1], w.shape[0], tuple(x.shape[2:]),
                                  tuple(w.shape[2:]), geo.stride, geo.dilation, geo.pad_lo, geo.pad_hi, dtype, dtype,
                                  dtype, epilogue=Epilogue(activation, bias, residuals))
        except InvalidInputError:  # shapes the plain path's checks refuse, with their own message
            problem = None
        reg = registry_of(handle)
        if problem is not None and _pads_outputs(handle, problem, _vector_channels(x)):
            route = "gemm_padded"
        elif problem is not None and (geo.rank, dtype, activation, bias, residuals) in _CAPS[handle].conv_epilogues \
                and reg.supports(problem) and _fusing_pays(reg, problem):
            route = "conv"
        elif problem is not None and conv_as_gemm.applies(problem):
            pixels = problem.n * math.prod(problem.in_size)
            # only a GEMM kernel that runs the problem with the activation fused; else the plain conv kernel
            if _cheapest_route(handle, dtype, activation, bias, residuals, "r", "c",
                               (1, pixels, problem.k, problem.c)) is not None:
                route = "gemm"
        if len(_CONV_ROUTES) >= _MEMO_SIZE:
            _CONV_ROUTES.clear()
        _CONV_ROUTES[key] = route
    return route


# Fusing an epilogue saves the passes over Y that the unfused route makes (bias written into Y first, the activation
# after); a fused kernel rated (selection.estimated_cost) above this many times the plain kernel is not taken.
# Such kernels are a set's fallbacks: before the essential set fused a clamp on its 7x7 depthwise tiles, a depthwise
# 7x7 conv with bias + clamp selected the generic implicit GEMM (rated over 100x the plain direct kernel) and ran
# 26-58x slower than the plain kernel followed by torch's bias add and clamp (bench/results/depthwise_epilogue_h200).
_FUSED_COST_LIMIT = 2.0


def _fusing_pays(reg: Registry, problem: ConvProblem) -> bool:
    """Whether the kernel selected for the problem with its epilogue is rated (selection.estimated_cost) at most
    _FUSED_COST_LIMIT times the kernel selected for the plain problem (True where no kernel runs that). A pointwise
    problem that reg.conv_fwd runs on the GEMM kernels (ops/conv_as_gemm.py), fused there, is not rated by its conv
    kernels: True."""
    if _lowered_to_gemm(reg, problem):
        return True
    fused = _selected_cost(reg, problem)
    plain = _selected_cost(reg, replace(problem, epilogue=_PLAIN_EPILOGUE))
    return plain is None or fused <= _FUSED_COST_LIMIT * plain


# A pointwise conv whose output channels are not a whole number of 16-byte vectors (EfficientNet's squeeze-excitation
# squeezes 672 channels to 28, ShuffleNetV2 has 58, segmentation heads 21) has no output the TMA GEMM kernels can
# store, so it ran on the low-alignment fallback GEMM: one CTA per 64 x 128 tile walking all of C, no fused epilogue
# (EfficientNet-B0's 32 x 28 x 672: 0.29x cuDNN, bench/results/inverted_residual_h200). It runs instead with the
# weight and bias zero-padded to the next whole vector (copies cached per tensor), into a padded output whose first
# K channels are copied out: one more pass over the output, where the fallback makes three (the bias written
# first, the activation read and written by torch).
def _pads_outputs(handle: int, problem: ConvProblem, vector: int) -> bool:
    """Whether a pointwise dense conv runs on its output channels zero-padded to a multiple of `vector` (see
    above): no residuals (they would need padded copies too), and only padded does a GEMM kernel run it with the
    whole epilogue fused."""
    epi = problem.epilogue
    if not problem.k % vector or epi.residuals or not conv_as_gemm.applies(problem):
        return False
    pixels = problem.n * math.prod(problem.in_size)

    def fuses(k: int) -> bool:
        route = _cheapest_route(handle, problem.dtype_x, epi.activation, epi.bias, 0, "r", "c",
                                (1, pixels, k, problem.c))
        return route is not None and not route.fold
    return not fuses(problem.k) and fuses(-(-problem.k // vector) * vector)


_DERIVED: dict = {}  # (id of a tensor, what was derived) -> (weak reference to it, its version, the derived tensor)


def _derived(t: torch.Tensor, what: tuple, make) -> torch.Tensor:
    """make(): a tensor derived from t alone (a weight zero-padded or mapped to another layout), cached while t
    lives unmodified: a layer's weights are derived once, not on every call. An inference tensor, which has no
    version counter to tell, is derived anew on every call."""
    key = (id(t), what)
    try:
        version = t._version
    except RuntimeError:  # an inference tensor
        version = None
    hit = _DERIVED.get(key)
    if hit is not None and version is not None and hit[0]() is t and hit[1] == version:
        return hit[2]
    with torch.no_grad():
        out = make()
    if version is not None:
        if len(_DERIVED) >= _MEMO_SIZE:
            _DERIVED.clear()
        _DERIVED[key] = (weakref.ref(t), version, out)
    return out


def _zero_padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t [K, ...] with zero rows appended up to `rows` (cached: _derived)."""
    def make():
        padded = t.new_zeros((rows, *t.shape[1:]))
        padded[:t.shape[0]].copy_(t)
        return padded
    return _derived(t, ("rows", rows), make)


def _pointwise_gemm(reg, handle: int, x, w, bias, residuals, activation: str, clamp: tuple, y, in_place: bool,
                    padded: bool = False):
    """y = act(x @ w^T + bias + sum(residuals)) over the pixels of a pointwise conv: channels-last x, y and
    residuals are [pixels, channels] row-major matrices and a channels-last weight [K, C, 1...] a column-major
    [C, K] one, all views (the GEMM path of _gemm_run on them). in_place: x, w and the residuals are the
    caller's own tensors (not channels-last copies). padded: on the output channels zero-padded to a whole
    vector (_pads_outputs; no residuals)."""
    k, c = w.shape[0], w.shape[1]
    a = x.movedim(1, -1).reshape(-1, c)
    out = y.movedim(1, -1).reshape(-1, k)
    if padded:
        wide = -(-k // _vector_channels(x)) * _vector_channels(x)
        w = _zero_padded_rows(w, wide)
        bias = None if bias is None else _zero_padded_rows(bias, wide)
        result, out = out, a.new_empty((a.shape[0], wide))
    b = w.reshape(w.shape[0], c).t()
    res = tuple(_channels_last(r).movedim(1, -1).reshape(-1, k) for r in residuals)
    route = _gemm_route(handle, a, b, activation, bias is not None, len(res))
    clamp = clamp if activation == "clamp" else NO_CLAMP
    if route.copy_a:
        a = _to_major(a, route.copy_a)
    if route.copy_b:
        b = _to_major(b, route.copy_b)
    _launch_route(reg, route, a, b, out, bias, res, activation, clamp)
    if in_place and not (route.fold or route.copy_a or route.copy_b or padded):
        _mark_direct(_gemm_pointers)
    if padded:
        result.copy_(out[:, :k])
    return y


def _conv_fwd_fake(x, w, bias, residuals, activation, clamp_low, clamp_high, stride, dilation, pad_lo, pad_hi, groups,
                   registry):
    return _empty_channels_last(_conv_fwd_shape(x, w, stride, dilation, pad_lo, pad_hi), x)


def _conv_bwd_data_impl(dy, w, in_size, stride, dilation, pad_lo, pad_hi, groups, registry):
    geo, in_size = _geometry(stride, dilation, pad_lo, pad_hi, groups), tuple(in_size)
    return _remembered(registry, dy, w, None, (), ("bwd_data", geo, in_size), _conv_bwd_data_run, dy, w, in_size, geo,
                       registry, grad=_requires_grad(dy, w))


def _conv_bwd_data_run(dy, w, in_size, geo: _Geometry, handle: int):
    if w.dtype != dy.dtype:
        _check_conv_dtypes(("dy", dy), ("w", w))
    if not dy.shape[0]:  # a batch of none: an empty dX
        dx_shape = (0, w.shape[1] * geo.groups, *in_size)
        _checked_empty_batch("bwd_data", dx_shape, w.shape, dy, geo, dy)
        return _new_channels_last(dx_shape, dy)
    reg = _registry_for(handle, dy)
    given_dy, given_w = dy, w
    dy, w = _channels_last(dy), _channels_last(w)
    dx = _new_channels_last((dy.shape[0], w.shape[1] * geo.groups, *in_size), dy)
    if geo.strided and (_STRIDED_BWD_DATA in ("phases", "stacked") or _STRIDED_BWD_DATA == "auto" and w.shape[1] > 1):
        whole = _bwd_data_by_phase(handle, dy, w, dx, geo)
        _DIRECT.launch = None  # the phases' launches are remembered each on its own: dx is no one launch's output
        if whole:
            return dx
    conv_op.run(reg, "bwd_data", dx, w, dy, dx, geo.options[0.0], geo.keys[0.0])
    if dy is given_dy and w is given_w:
        _mark_direct(_bwd_data_pointers)
    return dx


STRIDED_BWD_DATA_ROUTES = ("auto", "kernel", "phases", "stacked")
_STRIDED_BWD_DATA = "auto"


def set_strided_bwd_data(route: str) -> None:
    """How the torch operators compute the input gradient of a strided convolution: "kernel", the bundle's
    strided bwd_data kernels; "phases", one unit-stride bwd_data per stride phase (_bwd_data_by_phase), which runs
    on the unit-stride kernels at the cost of a copy of each phase; "stacked", the phases in one unit-stride
    bwd_data where they stack (_stacked), else by phase; "auto" (the default), stacked where a group has more
    than one input channel and the strided kernels where it has one (depthwise). Measured through these operators
    on the conv suite's stride-2 layers on an H200: phases 1.66x the kernels on dense layers and 1.41x on grouped
    ones, 0.49x on depthwise ones (their direct kernels handle the stride; bench/results/suite_h200_bwd_data_phases);
    stacked 1.42x the phases on dense layers and 1.67x on grouped ones (bench/results/stacked_phases_h200). The
    environment variable TD_STRIDED_BWD_DATA sets the initial route."""
    global _STRIDED_BWD_DATA
    if route not in STRIDED_BWD_DATA_ROUTES:
        raise InvalidInputError(f"strided bwd_data route {route!r}: one of {', '.join(STRIDED_BWD_DATA_ROUTES)}")
    _STRIDED_BWD_DATA = route


set_strided_bwd_data(os.environ.get("TD_STRIDED_BWD_DATA", "auto"))


class _Phase(NamedTuple):
    """One stride phase of a strided bwd_data (see _bwd_data_by_phase), as index tuples made once per problem."""
    view: tuple  # dx's slices of the phase's pixels
    target: Optional[tuple]  # dx's slices of its pixels that a dy row reaches; None: the phase is all zero
    whole: bool  # target is the whole view (nothing to zero)
    dy_rows: tuple  # dy's slices of the rows that reach it
    taps: tuple  # the filter's slices of the taps that reach it (evenly spaced)
    geo: Optional[_Geometry]  # the unit-stride sub-problem's geometry


def _phases(geo: _Geometry, dy_shape, w_shape, dx_shape) -> tuple:
    """The phases of dx (see _bwd_data_by_phase). Phase p of a dim holds the pixels p, p + s, p + 2s, ...; they
    receive only the taps r with (p + pad_lo - r * dilation) % s == 0, which are evenly spaced: the phase is the
    bwd_data of a unit-stride convolution with that sub-filter and its own dilation and padding; its rows that no
    dy row reaches are zero, and dy rows that reach none of its rows are left out."""
    dy_size, w_size, in_size = dy_shape[2:], w_shape[2:], dx_shape[2:]
    phases = []
    lead = (slice(None), slice(None))
    for combo in itertools.product(*(range(s) for s in geo.stride)):
        lengths = [len(range(p, n, s)) for p, n, s in zip(combo, in_size, geo.stride)]
        if 0 in lengths:
            continue
        view = lead + tuple(slice(p, None, s) for p, s in zip(combo, geo.stride))
        taps, dilation, pad_lo, pad_hi, target, dy_rows, whole = [], [], [], [], [], [], True
        for d, p in enumerate(combo):
            s, dil, lo = geo.stride[d], geo.dilation[d], geo.pad_lo[d]
            reach = [r for r in range(w_size[d]) if (p + lo - r * dil) % s == 0]
            if not reach:
                break
            sub_dil = (reach[1] - reach[0]) * dil // s if len(reach) > 1 else 1
            extent = sub_dil * (len(reach) - 1)
            q = (p + lo - reach[0] * dil) // s  # phase row i = sum over m of dy[i + q - m * sub_dil] * w[reach[m]]
            first = max(0, -q)  # the phase rows [first, last) reach a dy row
            last = min(lengths[d], dy_size[d] - q + extent)
            if last <= first:
                break
            lo_sub = q + first
            skip = max(0, lo_sub - extent)  # dy rows before it reach no phase row
            dy_end = min(dy_size[d], last + q)
            taps.append(slice(reach[0], reach[-1] + 1, reach[1] - reach[0] if len(reach) > 1 else 1))
            dilation.append(sub_dil)
            pad_lo.append(lo_sub - skip)
            pad_hi.append((dy_end - skip) - (last - first) - (lo_sub - skip) + extent)
            target.append(slice(p + first * s, p + (last - 1) * s + 1, s))
            dy_rows.append(slice(skip, dy_end))
            whole = whole and first == 0 and last == lengths[d]
        if len(taps) < geo.rank:  # a dim where no tap reaches the phase: it is all zero
            phases.append(_Phase(view, None, False, (), (), None))
            continue
        sub = _geometry((1,) * geo.rank, tuple(dilation), tuple(pad_lo), tuple(pad_hi), geo.groups)
        phases.append(_Phase(view, lead + tuple(target), whole, lead + tuple(dy_rows), lead + tuple(taps), sub))
    return tuple(phases)


def _bwd_data_by_phase(handle: int, dy, w, dx, geo: _Geometry) -> bool:
    """dx of a strided convolution by stride phase (_phases): all phases in one unit-stride bwd_data where they
    stack (_Stacked; not on the "phases" route), else one per phase, each computed into a channels-last buffer, by
    a launch remembered like the direct ones (_remembered), and copied into its strided view of dx. The plan is
    made once per problem. False, with dx unspecified, where a sub-problem has no kernel (the caller then runs the
    strided problem whole)."""
    if dx.numel() == 0:
        return True
    stack = _STRIDED_BWD_DATA != "phases"
    key = (dy.shape, w.shape, dx.shape, stack)
    plan = geo.phase_plans.get(key)
    if plan is None:
        if len(geo.phase_plans) >= _MEMO_SIZE:
            geo.phase_plans.clear()
        plan = (stack and _stacked(geo, dy.shape, w.shape, dx.shape)) or _phases(geo, dy.shape, w.shape, dx.shape)
        geo.phase_plans[key] = plan
    if type(plan) is _Stacked:
        try:
            _bwd_data_stacked(handle, dy, w, dx, plan)
            return True
        except UnsupportedProblemError:  # no kernel runs the stacked problem: one launch per phase from now on
            plan = geo.phase_plans[key] = _phases(geo, dy.shape, w.shape, dx.shape)
    if not all(phase.whole for phase in plan):  # some pixels no tap or dy row reaches: one fill, not one a phase
        dx.zero_()
    for phase in plan:
        if phase.target is None:
            continue
        target = dx[phase.target]
        taps, rows, size = _channels_last(w[phase.taps]), _channels_last(dy[phase.dy_rows]), target.shape[2:]
        try:
            buffer = _remembered(handle, rows, taps, None, (), ("bwd_data", phase.geo, size), _conv_bwd_data_run,
                                 rows, taps, size, phase.geo, handle)
        except UnsupportedProblemError:
            return False
        target.copy_(buffer)
    return True


class _Stacked(NamedTuple):
    """A strided bwd_data's stride phases stacked in the channel axis (see _stacked): one unit-stride bwd_data
    whose filter holds every phase's sub-filter, followed by one copy that interleaves the phases into dx."""
    geo: _Geometry  # the unit-stride problem's geometry
    size: tuple  # its dX's spatial size (in_size // stride)
    taps: tuple  # per entry (stacked tap, phase) of the stacked filter, the filter tap it holds (zero: `zero`)
    zero: int  # the index of the zero tap appended to the filter's (its tap count), or 0 where none is needed
    weight_view: tuple  # (size, strides) of the filter's memory as [K, taps, C per group]
    stacked_weight: tuple  # (size, strides) of the stacked filter [K, phases * C per group, stacked taps...]
    shuffle: tuple  # (size, dx's strides, the stacked dX's strides): both as [N, (rows, stride) per dim, G, C]
    indices: dict  # device -> taps as an index tensor there


def _stacked(geo: _Geometry, dy_shape, w_shape, dx_shape) -> Optional[_Stacked]:
    """All stride phases of a strided bwd_data as one unit-stride bwd_data, or None where they do not stack.

    Per dim, phase p (the pixels p, p + s, ...) receives the taps r with (p + pad_lo - r * dilation) % s == 0,
    spaced by a common sub-dilation D = dilation / gcd(s, dilation): its row i is the sum over m of
    dy[i + q_p - m * D] * w[reach_p[m]]. With Q the largest q_p, every phase is the same unit-stride bwd_data
    (dilation D, pad_lo Q) with its taps placed at m + (Q - q_p) / D of a filter of U taps and zeros elsewhere.
    Stacking the phases' filters along the input channels makes that one problem whose dX holds every phase's
    rows side by side in its channels. It applies where every phase receives a tap, the phases have equally many
    rows (in_size % s == 0), (Q - q_p) % D == 0 and the padding is not negative. It computes U^rank taps per
    phase where the phases compute the filter's, and launches once where they launch once per phase and copy
    each phase's result."""
    dims = []  # per dim: (tap placement per phase, U, D, Q, pad_hi, rows, stride)
    for d in range(geo.rank):
        s, dil, lo, n = geo.stride[d], geo.dilation[d], geo.pad_lo[d], dx_shape[2 + d]
        if n % s:
            return None
        sub = dil // math.gcd(s, dil)
        reaches = [[r for r in range(w_shape[2 + d]) if (p + lo - r * dil) % s == 0] for p in range(s)]
        if not all(reaches):
            return None
        qs = [(p + lo - reach[0] * dil) // s for p, reach in enumerate(reaches)]
        top = max(qs)
        if top < 0 or any((top - q) % sub for q in qs):
            return None
        placed = [{m + (top - q) // sub: r for m, r in enumerate(reach)} for q, reach in zip(qs, reaches)]
        taps = max(max(p) for p in placed) + 1
        pad_hi = dy_shape[2 + d] - n // s - top + sub * (taps - 1)
        if pad_hi < 0:
            return None
        dims.append((placed, taps, sub, top, pad_hi, n // s, s))
    filter_size = w_shape[2:]
    filter_taps = math.prod(filter_size)
    entries = []  # the stacked filter's memory order: [stacked taps (C order), phases (C order)]
    for stacked_tap in itertools.product(*(range(d[1]) for d in dims)):
        for phase in itertools.product(*(range(d[6]) for d in dims)):
            where = [d[0][p].get(u) for d, p, u in zip(dims, phase, stacked_tap)]
            entries.append(filter_taps if None in where else
                           sum(r * math.prod(filter_size[i + 1:]) for i, r in enumerate(where)))
    n, k, per_group, groups = dx_shape[0], w_shape[0], w_shape[1], geo.groups
    rows, strides = tuple(d[5] for d in dims), tuple(d[6] for d in dims)
    phases = math.prod(strides)
    stacked_shape = (k, phases * per_group, *(d[1] for d in dims))
    # dx's memory [N, in..., G, C] is [N, (rows, stride) per dim, G, C]; the stacked dX's [N, rows..., G, strides..., C]
    shuffle_shape = (n, *(v for pair in zip(rows, strides) for v in pair), groups, per_group)
    stacked_dims = (n, *rows, groups, *strides, per_group)
    stacked_strides = _contiguous_strides(stacked_dims)
    rank = geo.rank
    order = (0, *(i for d in range(rank) for i in (1 + d, 2 + rank + d)), 1 + rank, len(stacked_dims) - 1)
    sub_geo = _geometry((1,) * rank, tuple(d[2] for d in dims), tuple(d[3] for d in dims), tuple(d[4] for d in dims),
                        groups)
    return _Stacked(sub_geo, rows, tuple(entries), filter_taps if filter_taps in entries else 0,
                    ((k, filter_taps, per_group), (filter_taps * per_group, per_group, 1)),
                    (stacked_shape, _channels_last_strides(stacked_shape)),
                    (shuffle_shape, _contiguous_strides(shuffle_shape), tuple(stacked_strides[i] for i in order)), {})


def _bwd_data_stacked(handle: int, dy, w, dx, plan: _Stacked) -> None:
    """dx (channels-last, whole) by the stacked plan: the stacked filter gathered from w's taps (a zero tap
    appended where some entry holds none), one remembered unit-stride bwd_data, one copy into dx's phases."""
    index = plan.indices.get(w.device)
    if index is None:
        index = plan.indices[w.device] = torch.tensor(plan.taps, dtype=torch.long, device=w.device)
    taps = w.as_strided(*plan.weight_view)
    if plan.zero:
        taps = F.pad(taps, (0, 0, 0, 1))
    stacked = taps.index_select(1, index).as_strided(*plan.stacked_weight)
    out = _remembered(handle, dy, stacked, None, (), ("bwd_data", plan.geo, plan.size), _conv_bwd_data_run, dy,
                      stacked, plan.size, plan.geo, handle)
    shape, dx_strides, out_strides = plan.shuffle
    dx.as_strided(shape, dx_strides).copy_(out.as_strided(shape, out_strides))


def _conv_bwd_data_fake(dy, w, in_size, stride, dilation, pad_lo, pad_hi, groups, registry):
    return _empty_channels_last((dy.shape[0], w.shape[1] * groups, *in_size), dy)


def _conv_bwd_weight_impl(x, dy, filter_size, stride, dilation, pad_lo, pad_hi, groups, registry):
    geo, filter_size = _geometry(stride, dilation, pad_lo, pad_hi, groups), tuple(filter_size)
    return _remembered(registry, x, dy, None, (), ("bwd_weight", geo, filter_size), _conv_bwd_weight_run, x, dy,
                       filter_size, geo, registry, grad=_requires_grad(x, dy))


def _conv_bwd_weight_run(x, dy, filter_size, geo: _Geometry, handle: int):
    if dy.dtype != x.dtype:
        _check_conv_dtypes(("x", x), ("dy", dy))
    if not x.shape[0]:  # a batch of none: dW sums over nothing
        w_shape = (dy.shape[1], x.shape[1] // geo.groups, *filter_size)
        _checked_empty_batch("bwd_weight", x.shape, w_shape, x, geo, dy)
        return _new_channels_last(w_shape, x).zero_()
    reg = _registry_for(handle, x)
    given_x, given_dy = x, dy
    x, dy = _channels_last(x), _channels_last(dy)
    xr, filter_size, g, back = _bwd_weight_operands(handle, x, dy, filter_size, geo)
    dw = _new_channels_last((dy.shape[1], xr.shape[1] // g.groups, *filter_size), xr)
    conv_op.run(reg, "bwd_weight", xr, dw, dy, dw, g.options[0.0], g.keys[0.0])
    if back is not None:
        return back(dw)
    if x is given_x and dy is given_dy:
        _mark_direct(_bwd_weight_pointers)
    return dw


def _bwd_weight_operands(handle: int, x: torch.Tensor, dy: torch.Tensor, filter_size, geo: _Geometry) -> tuple:
    """bwd_weight's (x, filter_size, geo) as it runs, and the map from that problem's dW to the conv's (None: the
    same): a dense conv with few channels on a space-to-depth copy of x (_space_to_depth) or on x zero-padded in
    its channels (_channel_padding) where that runs faster, else as given."""
    filter_size, channels = tuple(filter_size), x.shape[1]
    if not x.shape[0]:  # a batch of none: no copy (_conv_bwd_weight_run answers it)
        return x, filter_size, geo, None
    s2d = _space_to_depth(handle, "bwd_weight", x, dy.shape[1], filter_size, geo, _PLAIN_EPILOGUE)
    if s2d is not None:
        return _to_depth(x, s2d), s2d.taps, s2d.geo, lambda dw: _filter_from_depth(dw, s2d, channels, filter_size)
    wide = _bwd_weight_padding(handle, x, dy, filter_size, geo)
    if wide:  # dW of the zero-padded X, its first C channels
        return _zero_padded_channels(x, wide), filter_size, geo, lambda dw: _channels_last(dw[:, :channels])
    return x, filter_size, geo, None


def _bwd_weight_padding(handle: int, x, dy, filter_size, geo: _Geometry) -> int:
    """The channel count to zero-pad a dense bwd_weight's X to, or 0 (see _channel_padding)."""
    if geo.groups != 1 or not x.shape[1] % _vector_channels(x):
        return 0
    return _channel_padding(handle, "bwd_weight", x, dy.shape[1], tuple(filter_size), geo, _PLAIN_EPILOGUE)


def _conv_bwd_weight_fake(x, dy, filter_size, stride, dilation, pad_lo, pad_hi, groups, registry):
    return _empty_channels_last((dy.shape[1], x.shape[1] // groups, *filter_size), x)


# -- layer norm ----------------------------------------------------------------------------------------------
def _layer_norm_run(x, normalized_shape, weight, bias, eps: float, handle: int) -> torch.Tensor:
    """F.layer_norm's forward on the bundle's layernorm kernels: x's trailing normalized_shape dims are each row
    (x copied where its memory is not one run of rows); the output contiguous, as torch's."""
    cols = math.prod(normalized_shape)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows = x if x.is_contiguous() else x.contiguous()
    w = None if weight is None else weight.reshape(cols)
    b = None if bias is None else bias.reshape(cols)
    _registry_for(handle, x).layer_norm(rows.view(-1, cols), w, b, out.view(-1, cols), eps=eps)
    if rows is x and (w is None or w.data_ptr() == weight.data_ptr()) and (
            b is None or b.data_ptr() == bias.data_ptr()):
        _mark_direct(_layer_norm_pointers)  # the kernel read the caller's tensors as they are: a call to remember
    return out


def _layer_norm_impl(x, normalized_shape, weight, bias, eps, registry):
    return _layer_norm_run(x, tuple(normalized_shape), weight, bias, eps, registry)


def _layer_norm_fake(x, normalized_shape, weight, bias, eps, registry):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# -- max pooling ---------------------------------------------------------------------------------------------
def _pool_shape(x_shape, kernel_size, stride, padding, dilation, ceil_mode: bool) -> tuple:
    """The output shape [N, C, out...] of F.max_poolNd (geometry lists already one value per spatial dim)."""
    rank = len(x_shape) - 2
    out = pool_op.geometry(rank, tuple(x_shape[2:]), tuple(kernel_size), tuple(stride), tuple(padding),
                           tuple(dilation), ceil_mode)["out_size"]
    return (x_shape[0], x_shape[1], *out)


def _max_pool_run(x, kernel_size, stride, padding, dilation, ceil_mode: bool, handle: int) -> torch.Tensor:
    """F.max_poolNd's forward on the bundle's maxpool kernels: x [N, C, spatial...] read channels-last (copied
    where its memory is not), the output channels-last."""
    shape = _pool_shape(x.shape, kernel_size, stride, padding, dilation, ceil_mode)
    xc = _channels_last(x)
    y = _new_channels_last(shape, x)
    if y.numel() == 0:
        return y
    _registry_for(handle, x).max_pool(xc.movedim(1, -1), kernel_size, stride, padding, dilation,
                                      ceil_mode=ceil_mode, out=y.movedim(1, -1))
    if xc is x:
        _mark_direct(_pool_pointers)  # the kernel read the caller's tensor as it is: a call to remember
    return y


def _max_pool_impl(x, kernel_size, stride, padding, dilation, ceil_mode, registry):
    return _max_pool_run(x, list(kernel_size), list(stride), list(padding), list(dilation), ceil_mode, registry)


def _max_pool_fake(x, kernel_size, stride, padding, dilation, ceil_mode, registry):
    return _empty_channels_last(_pool_shape(x.shape, kernel_size, stride, padding, dilation, ceil_mode), x)


_GEO = "int[] stride, int[] dilation, int[] pad_lo, int[] pad_hi, int groups, int registry"
_LIB = torch.library.Library("tiledispatch", "DEF")
_SCHEMAS = {
    "gemm": ("gemm(Tensor a, Tensor b, Tensor? bias, Tensor[] residuals, str activation, float clamp_low, "
             "float clamp_high, int registry) -> Tensor", _gemm_impl, _gemm_fake),
    "conv_fwd": (f"conv_fwd(Tensor x, Tensor w, Tensor? bias, Tensor[] residuals, str activation, float clamp_low, "
                 f"float clamp_high, {_GEO}) -> Tensor", _conv_fwd_impl, _conv_fwd_fake),
    "conv_bwd_data": (f"conv_bwd_data(Tensor dy, Tensor w, SymInt[] in_size, {_GEO}) -> Tensor", _conv_bwd_data_impl,
                      _conv_bwd_data_fake),
    "conv_bwd_weight": (f"conv_bwd_weight(Tensor x, Tensor dy, SymInt[] filter_size, {_GEO}) -> Tensor",
                        _conv_bwd_weight_impl, _conv_bwd_weight_fake),
    "layer_norm": ("layer_norm(Tensor x, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps, "
                   "int registry) -> Tensor", _layer_norm_impl, _layer_norm_fake),
    "max_pool": ("max_pool(Tensor x, int[] kernel_size, int[] stride, int[] padding, int[] dilation, bool ceil_mode, "
                 "int registry) -> Tensor", _max_pool_impl, _max_pool_fake),
}
for _name, (_schema, _impl, _fake) in _SCHEMAS.items():
    _LIB.define(_schema)
    for _key in ("CPU", "CUDA"):
        _LIB.impl(_name, _impl, _key)
    torch.library.register_fake(f"tiledispatch::{_name}", _fake, lib=_LIB)

_ops = torch.ops.tiledispatch
_gemm_op = _ops.gemm.default
_conv_fwd_op = _ops.conv_fwd.default
_conv_bwd_data_op = _ops.conv_bwd_data.default
_conv_bwd_weight_op = _ops.conv_bwd_weight.default
_layer_norm_op = _ops.layer_norm.default
_max_pool_op = _ops.max_pool.default


# -- eager calls -------------------------------------------------------------------------------------------
# An operator call through torch.ops costs a few microseconds of dispatch on top of its Python implementation:
# where nothing needs to see the operator, the implementation is called directly. Everything else goes
# through torch.ops: torch.compile / torch.export (their tracing runs the fake implementations), torch.jit
# tracing, dispatch modes (FakeTensorMode, make_fx), torch function modes, functorch transforms, tensor
# subclasses (fake tensors), meta tensors, and a running torch.profiler (its trace then names the operators).
_compiling = torch.compiler.is_compiling
_profiling = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
_tracing_state = getattr(torch._C, "_get_tracing_state", None)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_functorch_level = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", None)
_PLAIN = frozenset((torch.Tensor, nn.Parameter))
# without one of these functions (another torch), always torch.ops
_CAN_CALL_DIRECTLY = None not in (_tracing_state, _dispatch_modes, _function_modes, _functorch_level, _profiling)


def _eager(a, b, c=None) -> bool:
    """Whether an operator call on these tensors may run its implementation directly (see above)."""
    return (_CAN_CALL_DIRECTLY and not _compiling() and type(a) in _PLAIN and type(b) in _PLAIN
            and (c is None or type(c) in _PLAIN) and not a.is_meta and not _dispatch_modes() and not _function_modes()
            and _tracing_state() is None and _functorch_level() is None and not _profiling())


def _gemm(a, b, bias, residuals, activation: str, clamp_low: float, clamp_high: float, handle: int):
    """tiledispatch::gemm, directly where _eager allows."""
    if _eager(a, b, bias) and (not residuals or all(type(r) in _PLAIN for r in residuals)):
        return _gemm_run(a, b, bias, residuals, activation, clamp_low, clamp_high, handle)
    return _gemm_op(a, b, bias, list(residuals), activation, clamp_low, clamp_high, handle)


def _conv_fwd(x, w, bias, stride, dilation, pad_lo, pad_hi, groups, handle, geo: Optional[_Geometry] = None,
              residuals: tuple = (), activation: str = "identity", clamp: tuple = NO_CLAMP):
    """tiledispatch::conv_fwd, directly where _eager allows (geo: the _Geometry of these values, when known)."""
    if _eager(x, w, bias) and (not residuals or all(type(r) in _PLAIN for r in residuals)):
        if activation == "identity" and not residuals and bias is None:
            return _conv_fwd_run(x, w, geo or _geometry(stride, dilation, pad_lo, pad_hi, groups), handle)
        return _conv_fwd_epilogue_run(x, w, bias, residuals, activation, clamp,
                                      geo or _geometry(stride, dilation, pad_lo, pad_hi, groups), handle)
    return _conv_fwd_op(x, w, bias, list(residuals), activation, clamp[0], clamp[1], stride, dilation, pad_lo, pad_hi,
                        groups, handle)


def _conv_bwd_data(dy, w, in_size, stride, dilation, pad_lo, pad_hi, groups, handle):
    if _eager(dy, w):
        return _conv_bwd_data_run(dy, w, in_size, _geometry(stride, dilation, pad_lo, pad_hi, groups), handle)
    return _conv_bwd_data_op(dy, w, in_size, stride, dilation, pad_lo, pad_hi, groups, handle)


def _conv_bwd_weight(x, dy, filter_size, stride, dilation, pad_lo, pad_hi, groups, handle):
    if _eager(x, dy):
        return _conv_bwd_weight_run(x, dy, filter_size, _geometry(stride, dilation, pad_lo, pad_hi, groups), handle)
    return _conv_bwd_weight_op(x, dy, filter_size, stride, dilation, pad_lo, pad_hi, groups, handle)


# -- autograd ----------------------------------------------------------------------------------------------
# Each activation in torch, as reference.ACTIVATIONS defines it: name -> (out of place and differentiable, in place,
# the derivative: dL/d(pre-activation) from dL/d(out) g, the output and, for those in _NEEDS_PRE, the
# pre-activation). tests/integration/test_torch_integration.py checks each against the float64 reference.
TORCH_ACTIVATIONS = {
    "identity": (lambda y, c: y, lambda y, c: y, lambda g, out, pre, c: g),
    "relu": (lambda y, c: torch.relu(y), lambda y, c: y.relu_(), lambda g, out, pre, c: g * (out > 0)),
    "clamp": (lambda y, c: torch.clamp(y, c[0], c[1]), lambda y, c: y.clamp_(c[0], c[1]),
              lambda g, out, pre, c: g * ((out > c[0]) & (out < c[1]))),
    "sigmoid": (lambda y, c: torch.sigmoid(y), lambda y, c: y.sigmoid_(), lambda g, out, pre, c: g * out * (1 - out)),
    "tanh": (lambda y, c: torch.tanh(y), lambda y, c: y.tanh_(), lambda g, out, pre, c: g * (1 - out * out)),
    "gelu_tanh": (lambda y, c: F.gelu(y, approximate="tanh"), lambda y, c: torch.ops.aten.gelu_(y, approximate="tanh"),
                  lambda g, out, pre, c: torch.ops.aten.gelu_backward(g, pre, approximate="tanh")),
    "gelu_erf": (lambda y, c: F.gelu(y), lambda y, c: torch.ops.aten.gelu_(y),
                 lambda g, out, pre, c: torch.ops.aten.gelu_backward(g, pre)),
    "silu": (lambda y, c: F.silu(y), lambda y, c: torch.ops.aten.silu_(y),
             lambda g, out, pre, c: torch.ops.aten.silu_backward(g, pre)),
    "hardswish": (lambda y, c: F.hardswish(y), lambda y, c: torch.ops.aten.hardswish_(y),
                  lambda g, out, pre, c: torch.ops.aten.hardswish_backward(g, pre)),
    "hardsigmoid": (lambda y, c: F.hardsigmoid(y), lambda y, c: torch.ops.aten.hardsigmoid_(y),
                    lambda g, out, pre, c: g * ((out > 0) & (out < 1)) / 6),
}


def _activation_ops(activation: str):
    entry = TORCH_ACTIVATIONS.get(activation)
    if entry is None:
        raise NotImplementedError(f"tiledispatch.torch: activation {activation!r} has no entry in TORCH_ACTIVATIONS")
    return entry


def _activation_grad(g, out, pre, activation: str, clamp: tuple):
    """dL/d(pre-activation) from dL/d(out); pre is None for the activations whose derivative the output gives."""
    return _activation_ops(activation)[2](g, out, pre, clamp)


_NEEDS_PRE = ("gelu_tanh", "gelu_erf", "silu", "hardswish")


def _grad_in_layout_of(t: torch.Tensor, lhs, rhs, handle: int) -> torch.Tensor:
    """lhs @ rhs (the gradient of t), computed so that it comes out in t's major order: a column-major t
    (e.g. the weight view of a Linear) gets (rhs^T @ lhs^T)^T."""
    if "r" not in _letters(t):
        return _product(rhs.mT, lhs.mT, handle).mT
    return _product(lhs, rhs, handle)


_PRODUCT = ("gemm", "identity", NO_CLAMP)  # the key options of _product's remembered launches


def _product(a, b, handle: int) -> torch.Tensor:
    """a @ b in a backward pass (traced by torch.compile's AOTAutograd with fake tensors: _remembered then runs
    the operator). An operand whose major order no kernel of the bundle takes is copied to one first, here rather
    than inside the operator: the launch on the copy can then be remembered (a Linear's gradient GEMMs are rrr
    and crr, which an rcr-only bundle runs only so)."""
    if not _compiling():
        route = _gemm_route(handle, a, b, "identity", False, 0)
        if route.copy_a:
            a = _to_major(a, route.copy_a)
        if route.copy_b:
            b = _to_major(b, route.copy_b)
    return _remembered(handle, a, b, None, (), _PRODUCT, _gemm, a, b, None, (), "identity", *NO_CLAMP, handle)


# A differentiable call is recorded by the native module's C++ autograd node where it can be (_record: eager, the
# module built), else by the autograd Functions below (traced by torch.compile, under a functorch transform or the
# JIT tracer, or without the native module). Both run the same forward and backward functions: forward(spec,
# *inputs) -> (output, saved tensors[, link]), backward((saved, spec, needs, link), grad) -> one gradient per input,
# needs saying which inputs want one; link (None in the autograd Functions): a conv's remembered forward call, whose
# backward plan the C++ node runs instead of the Python backward function once that function has made it
# (_backward_plan). The options travel as one tuple (a `spec`): every argument of a call costs host time. A
# backward pass is marked once-differentiable only where a second derivative could be asked for (grad mode on
# inside backward: create_graph=True); the marking's wrapper costs host time on every call.
def _record(function, forward, backward, backward_once, name: str, spec, *inputs) -> torch.Tensor:
    """function.apply(spec, *inputs), or the same call recorded by the C++ node, which costs less host time."""
    if _NATIVE_RECORD is _UNRESOLVED and not _compiling():  # traced: the native module is not used there, and
        _resolve_native()  # building or loading it takes a lock, which torch.compile cannot trace
    if (_NATIVE_RECORD is not None and _CAN_CALL_DIRECTLY and not _compiling() and _functorch_level() is None
            and _tracing_state() is None):
        return _NATIVE_RECORD(forward, backward, backward_once, spec, name, *inputs)
    return function.apply(spec, *inputs)


def _gemm_forward(spec, a, b, bias, *residuals):
    activation, clamp, handle = spec
    if _compiling():  # traced: no per-call state is read or written inside a graph
        out = _gemm(a, b, bias, residuals, activation, *clamp, handle)
    else:
        out = _remembered(handle, a, b, bias, residuals, ("gemm", activation, clamp), _gemm, a, b, bias, residuals,
                          activation, *clamp, handle)
    return out, (a, b, bias, out, *(residuals if activation in _NEEDS_PRE else ()))


class _GemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, a, b, bias, *residuals):
        out, saved = _gemm_forward(spec, a, b, bias, *residuals)
        ctx.spec = spec
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, g):
        backward = _gemm_backward_once if torch.is_grad_enabled() else _gemm_backward
        return (None, *backward((ctx.saved_tensors, ctx.spec, ctx.needs_input_grad[1:], None), g))


def _gemm_backward(state, g):
    (a, b, bias, out, *residuals), (activation, clamp, handle), needs, _ = state
    pre = None
    if activation in _NEEDS_PRE:  # recomputed through the bundle rather than stored by the forward pass
        pre = _gemm(a, b, bias, residuals, "identity", *NO_CLAMP, handle)
    g = _activation_grad(g.contiguous(), out, pre, activation, clamp)
    ga = _grad_in_layout_of(a, g, b.mT, handle) if needs[0] else None
    gb = _grad_in_layout_of(b, a.mT, g, handle) if needs[1] else None
    gbias = g.sum(dim=tuple(range(g.dim() - 1))) if needs[2] else None
    return (ga, gb, gbias, *(g if need else None for need in needs[3:]))


_gemm_backward_once = torch.autograd.function.once_differentiable(_gemm_backward)


def _conv_forward(spec, x, w, bias, *residuals):
    stride, dilation, pad_lo, pad_hi, groups, handle, activation, clamp, geo = spec
    x, w = _channels_last(x), _channels_last(w)  # converted once, kept for the backward pass
    if geo is None:  # traced (_conv passes None then): no per-call state is read or written inside a graph
        y = _conv_fwd(x, w, bias, stride, dilation, pad_lo, pad_hi, groups, handle, None, residuals, activation, clamp)
        link = None
    else:
        # a few-channel conv mapped (space to depth, channel padding) here, so that the launch on the copies is
        # remembered (the implementation maps them otherwise)
        xr, wr, g = _fwd_operands(handle, x, w, geo, Epilogue(activation, bias is not None, len(residuals)))
        key, pointers = _fast_key(xr, wr, bias, residuals, ("conv", activation, clamp, g))
        y = None if key is None else _fast_call(handle, xr, key, pointers)
        if y is None:
            y = _run_remembering(handle, xr, key, True, len(residuals), _conv_fwd, xr, wr, bias, g.stride, g.dilation,
                                 g.pad_lo, g.pad_hi, g.groups, handle, g, residuals, activation, clamp)
        # the remembered forward call carries the backward plan
        link = None if key is None else _registry_for(handle, xr)._launches.get(key)
    if activation in _NEEDS_PRE:
        return y, (x, w, bias, None, *residuals), link
    return y, (x, w, None, y if activation != "identity" else None), link


class _ConvFunction(torch.autograd.Function):
    """y = act(conv(x, w) + bias + sum(residuals)); spec: (stride, dilation, pad_lo, pad_hi, groups, handle,
    activation, clamp, the _Geometry of those values or None). The backward pass takes the activation's
    derivative from the saved output (relu, clamp, sigmoid, tanh, hard-sigmoid) or from the pre-activation,
    recomputed through the bundle (gelu, silu, hard-swish), then grad bias = the sum of that gradient over N and
    the spatial dims, grad residual = that gradient. Each direction's launch is remembered like an eager call's
    (_remembered)."""

    @staticmethod
    def forward(ctx, spec, x, w, bias, *residuals):
        y, saved, _ = _conv_forward(spec, x, w, bias, *residuals)
        ctx.spec = spec
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, gy):
        backward = _conv_backward_once if torch.is_grad_enabled() else _conv_backward
        return (None, *backward((ctx.saved_tensors, ctx.spec, ctx.needs_input_grad[1:], None), gy))


def _conv_backward(state, gy):
    (x, w, bias, out, *residuals), spec, needs, link = state
    stride, dilation, pad_lo, pad_hi, groups, handle, activation, clamp, geo = spec
    if activation != "identity":
        pre = None
        if activation in _NEEDS_PRE:  # recomputed through the bundle rather than stored by the forward pass
            pre = _conv_fwd(x, w, bias, stride, dilation, pad_lo, pad_hi, groups, handle, geo, tuple(residuals))
        gy = _activation_grad(gy, out, pre, activation, clamp)
    gy = _channels_last(gy)
    dx = dw = db = None
    direct = geo is not None  # not traced (see forward)
    if needs[0]:
        args = (gy, w, x.shape[2:], stride, dilation, pad_lo, pad_hi, groups, handle)
        dx = (_remembered(handle, gy, w, None, (), ("bwd_data", geo, args[2]), _conv_bwd_data, *args) if direct
              else _conv_bwd_data(*args))
    mapped = False  # dW from a mapped copy of x: no single launch on the saved tensors to plan
    if needs[1] and direct:  # mapped here, as the forward pass maps, so that the launch on the copy is remembered
        xw, taps, g, back = _bwd_weight_operands(handle, x, gy, w.shape[2:], geo)
        dw = _remembered(handle, xw, gy, None, (), ("bwd_weight", g, taps), _conv_bwd_weight, xw, gy, taps, g.stride,
                         g.dilation, g.pad_lo, g.pad_hi, g.groups, handle)
        if back is not None:
            dw, mapped = back(dw), True
    elif needs[1]:
        dw = _conv_bwd_weight(x, gy, w.shape[2:], stride, dilation, pad_lo, pad_hi, groups, handle)
    if needs[2]:
        db = gy.sum(dim=(0, *range(2, gy.dim())))
    if link is not None and link.native_backward is None and activation == "identity" and not residuals and not mapped:
        link.native_backward = _backward_plan(handle, x, w, gy, geo, needs)
    return (dx, dw, db, *(gy if need else None for need in needs[3:]))


def _backward_plan(handle: int, x, w, gy, geo: _Geometry, needs: tuple):
    """The plan of this conv backward pass that the native node runs from then on (backward_plan in
    native/torch_fastpath.cpp): the launches of dX and dW just remembered, under the fingerprints they were
    remembered by. False where a wanted gradient is not one remembered native launch (the stride phases run
    several); None (asked again next time) where these tensors were not fingerprinted natively (e.g. under the
    profiler)."""
    launches = _registry_for(handle, gy)._launches
    parts = []
    for need, a, b, options in ((needs[0], gy, w, ("bwd_data", geo, x.shape[2:])),
                                (needs[1], x, gy, ("bwd_weight", geo, w.shape[2:]))):
        entry, print_ = None, b""
        if need:
            key = _fast_key(a, b, None, (), options)[0]
            if key is None or type(key[2]) is not bytes:
                return None
            entry = launches.get(key)
            if entry is None or entry.record is None:
                return False
            print_ = key[2]
        parts += [entry, print_]
    return _NATIVE_BACKWARD_PLAN(_thread_id(), *parts, *needs)


_conv_backward_once = torch.autograd.function.once_differentiable(_conv_backward)


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: True)  # the cheap first test


def _autocast(tensors: tuple) -> tuple:
    """Under torch.autocast, the floating tensors (float64 excepted) cast to its dtype, as torch's own linear and
    conv inputs are (an autograd-recorded cast: the gradients come back in the parameters' dtype)."""
    if not _any_autocast():
        return tensors
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dt = torch.get_autocast_dtype(device)
    return tuple(t.to(dt) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in tensors)


# -- the eager fast path -------------------------------------------------------------------------------------
# A repeated eager call (nothing tracing, no autocast, no gradient to record) whose tensors the implementation
# handed to the registry as they are (no layout copy, no torch op before or after the kernel) is remembered in the
# launching registry's launch cache under this layer's own key: the tensors' fingerprints and the options. A later
# call with that key allocates its output and launches the registry's prepared Launcher on the new pointers, one
# lookup instead of the routing, the views and the registry's fingerprints of those views (README, "Repeated
# calls"). The key holds the thread (a Launcher's arguments are rewritten per launch); the registry is the view of
# the current stream; clear_caches() forgets these entries with the registry's own.
_DIRECT = threading.local()  # .launch: (Launcher, pointer order) of the kernel the implementation just launched on
# the caller's own tensors, set only where it did (_mark_direct), read by the caller that remembers the call
_thread_id = threading.get_ident


def _mark_direct(pointers) -> None:
    _DIRECT.launch = (last_launcher(), pointers)


# the order of a Launcher's pointers, from the call's (x or a, w or b, output, bias, residuals)
def _gemm_pointers(a, b, out, bias, residuals) -> tuple:  # Registry.gemm's: a, b, c, out, bias, residuals
    return (a, b, None, out, bias, *residuals)


def _conv_pointers(x, w, y, bias, residuals) -> tuple:  # conv_op.run's without an epilogue
    return (x, w, y)


def _conv_epilogue_pointers(x, w, y, bias, residuals) -> tuple:  # conv_op.run's with one
    return (x, w, y, bias, *residuals)


def _bwd_data_pointers(dy, w, dx, bias, residuals) -> tuple:  # conv_op.run's for bwd_data: dX in X's slot
    return (dx, w, dy)


def _layer_norm_pointers(x, weight, out, bias, residuals) -> tuple:  # Registry.layer_norm's: x, weight, bias, out
    return (x, weight, bias, out)


def _pool_pointers(x, x_again, out, bias, residuals) -> tuple:  # Registry.max_pool's: x, out (x is the call's a and b)
    return (x, out)


def _bwd_weight_pointers(x, dy, dw, bias, residuals) -> tuple:  # conv_op.run's for bwd_weight: dW in W's slot
    return (x, dw, dy)


class _FastCall:
    """A remembered call: the Launcher, how its pointers are ordered, and the output to allocate (shape, strides,
    dtype, device and the pointer alignment its kernel was checked with; for the native path, a meta tensor of
    that shape, strides and dtype, made on the device of the call's first tensor, and the launch record of the
    Launcher's prepared td_args, valid while the plan holds those same td_args)."""
    __slots__ = ("launcher", "pointers", "shape", "strides", "dtype", "device", "align", "alpha", "beta", "grad",
                 "prototype", "record", "args", "native_backward")

    def __init__(self, launcher, pointers, out: torch.Tensor, grad: bool, first: torch.Tensor, residuals: int):
        self.launcher, self.pointers, self.grad = launcher, pointers, grad
        self.shape, self.strides, self.dtype, self.device = tuple(out.shape), out.stride(), out.dtype, out.device
        self.align = out.data_ptr() & 15
        self.alpha, self.beta = launcher.alpha, launcher.beta  # the scalars of this call (the Launcher swaps them
        # back if a registry call with other values used it since)
        self.prototype = self.record = self.args = None
        self.native_backward = None  # a recorded conv's forward call: its backward plan (_backward_plan)
        if callable(_NATIVE_LAUNCH) and out.device == first.device:  # resolved, and built
            self.prototype = torch.empty_strided(self.shape, self.strides, dtype=self.dtype, device="meta")
            layout = launcher.plan.launch_layout()
            if layout is not None:
                self.args = launcher.plan._args
                self.record = _NATIVE_LAUNCHER(*layout[:4], _slot_sources(launcher, pointers, residuals),
                                               *layout[4:], self.align)

    def __call__(self, pointers: tuple, first: torch.Tensor) -> Optional[torch.Tensor]:
        """The output, computed; None (nothing launched) when the new output's alignment differs. pointers: the
        call's (a, b, bias, *residuals); first: its first tensor, on the output's device (its fingerprint is part
        of this call's key)."""
        launcher = self.launcher
        plan = launcher.plan
        if (self.record is not None and plan._args is self.args and launcher.alpha is self.alpha
                and launcher.beta is self.beta):
            made = _NATIVE_LAUNCH(self.record, self.prototype, first, pointers,
                                  None if plan._stream_of is None else plan._stream_of())
            plan._ptrs = None  # the slots hold this launch's pointers: the plan's next launch writes its own
            if type(made) is not int:
                return made
            if made == _NATIVE_OVERLAP:  # a new output never overlaps a live input: said, not expected
                raise InvalidInputError("the new output overlaps an input in memory; pass a separate output")
            plan._raise(made)
        out = torch.empty_strided(self.shape, self.strides, dtype=self.dtype, device=self.device)
        p = out.data_ptr()
        if p & 15 != self.align:
            return None
        a, b, bias, *residuals = pointers
        launcher(self.pointers(a, b, p, bias, residuals), self.alpha, self.beta)
        return out


_OUT, _ABSENT, _NATIVE_OVERLAP = -2, -1, -1000  # native/torch_fastpath.cpp's kOut, kAbsent and kOverlap


def _slot_sources(launcher, pointers, residuals: int) -> tuple:
    """Per td_args slot of the launcher's plan, where its pointer comes from: an index into the caller's
    (a, b, bias, *residuals), _OUT for the new output or _ABSENT for none (as the Python path places them)."""
    marks = pointers(0, 1, _OUT, 2, tuple(range(3, 3 + residuals)))
    if launcher.pick is not None:
        marks = launcher.pick(marks + (None,))
    return tuple(_ABSENT if m is None else m for m in marks)


_UNRESOLVED = object()
# the native fast path's functions (native/torch_fastpath.cpp), looked up at the first call; None without it
_NATIVE_PRINTS = _NATIVE_LAUNCHER = _NATIVE_LAUNCH = _NATIVE_RECORD = _NATIVE_BACKWARD_PLAN = _UNRESOLVED


def _resolve_native() -> None:
    global _NATIVE_PRINTS, _NATIVE_LAUNCHER, _NATIVE_LAUNCH, _NATIVE_RECORD, _NATIVE_BACKWARD_PLAN
    module = native.torch_fastpath()
    _NATIVE_PRINTS, _NATIVE_LAUNCHER, _NATIVE_LAUNCH, _NATIVE_RECORD, _NATIVE_BACKWARD_PLAN = (
        (None,) * 5 if module is None else
        (module.eager_prints, module.launcher, module.launch, module.record, module.backward_plan))


def _fast_key(a, b, bias, residuals: tuple, options: tuple):
    """(key, the pointers of (a, b, bias, *residuals)) of a call that may take the fast path, else (None, None)."""
    if _NATIVE_PRINTS is _UNRESOLVED and not _compiling():  # as _record's
        _resolve_native()
    if _NATIVE_PRINTS is not None and _CAN_CALL_DIRECTLY and not _compiling() and _functorch_level() is None:
        found = _NATIVE_PRINTS(a, b, bias, *residuals)
        if found is not None:  # else a mode may intercept, or a tensor it does not read: the Python checks decide
            return (_thread_id(), options, found[1]), found[0]
    if not _eager(a, b, bias) or _any_autocast():
        return None, None
    fa, fb = _torch_print(a), _torch_print(b)
    fbias = (None, None) if bias is None else _torch_print(bias)
    key = (_thread_id(), options, fa[1], fb[1], fbias[1])
    if not residuals:
        return key, (fa[0], fb[0], fbias[0])
    if not all(type(r) in _PLAIN for r in residuals):
        return None, None
    prints = [_torch_print(r) for r in residuals]
    return key + tuple(p[1] for p in prints), (fa[0], fb[0], fbias[0], *(p[0] for p in prints))


def _fast_call(handle: int, t: torch.Tensor, key, pointers) -> Optional[torch.Tensor]:
    """The remembered call's output, or None when there is none for this key."""
    reg = _registry_for(handle, t)
    entry = reg._launches.get(key)
    if entry is None or (entry.grad and torch.is_grad_enabled()):
        return None
    try:
        return entry(pointers, t)
    except BaseException:  # the next call takes the full path again, whose checks say what is wrong
        reg._launches.discard(key)
        raise


def _remember(handle: int, t: torch.Tensor, key, out: torch.Tensor, grad: bool, residuals: int) -> None:
    """Keep the call the implementation just made under key, when it launched on the caller's tensors."""
    launch = getattr(_DIRECT, "launch", None)
    if launch is not None and launch[0] is not None:
        _registry_for(handle, t)._launches.put(key, _FastCall(*launch, out, grad, t, residuals))


def _remembered(handle: int, a, b, bias, residuals: tuple, options: tuple, run, *args, grad: bool = True
                ) -> torch.Tensor:
    """run(*args), a launch on (a, b, bias, *residuals): the call remembered under these tensors' fingerprints and
    options where there is one, else run itself, remembered when it launched one kernel on those tensors as given.
    Callers: a recorded call's forward or backward pass, whose entry never serves a call that records a gradient
    (grad True: autograd must record that call), and the operators' implementations, which a compiled graph's code
    calls through the dispatcher every time (grad: whether an operand requires one, as for an eager call). Their
    options are those of _matmul and of the conv calls that hold a _Geometry (patched and fused layers, the
    backward passes), so an entry either of them made serves the other."""
    key, pointers = _fast_key(a, b, bias, residuals, options)
    if key is not None:
        out = _fast_call(handle, a, key, pointers)
        if out is not None:
            return out
    return _run_remembering(handle, a, key, grad, len(residuals), run, *args)


def _requires_grad(*tensors) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


def _run_remembering(handle: int, first: torch.Tensor, key, grad: bool, residuals: int, run, *args) -> torch.Tensor:
    """run(*args), remembered under key (None: not remembered) when it launched one kernel on the caller's tensors
    as given (grad: the entry serves only calls that record no gradient). Without a key (a traced call: a backward
    pass that torch.compile traces inside an autograd.Function, which may not change state outside it) the
    thread's _DIRECT is left alone: only a call that remembers reads it, after setting it itself."""
    if key is not None:
        _DIRECT.launch = None
    out = run(*args)
    if key is not None:
        _remember(handle, first, key, out, grad, residuals)
    return out


def _check_tensors(op: str, residuals: Sequence = (), **operands) -> None:
    """A clear error for an operand that is not a torch.Tensor (bias: nor None)."""
    operands.update((f"residuals[{i}]", r) for i, r in enumerate(residuals))
    for name, t in operands.items():
        if not isinstance(t, torch.Tensor) and not (t is None and name == "bias"):
            raise InvalidInputError(f"{op}: {name} is a {type(t).__name__}, expected a torch.Tensor")


_grad_enabled = torch.is_grad_enabled  # a C function: no Python frame where grad mode is off (inference)


def _needs_grad(*tensors) -> bool:
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:  # another object: refused by the caller's checks
            return True
    return False


# -- public functions ----------------------------------------------------------------------------------------
def matmul(a: torch.Tensor, b: torch.Tensor, *, registry, bias: Optional[torch.Tensor] = None,
           residuals: Sequence[torch.Tensor] = (), activation: str = "identity", clamp=None) -> torch.Tensor:
    """act(a @ b + bias + sum(residuals)) on the bundle: a [..., k] @ b [k, n], or a [B, m, k] @ b [B, k, n]
    (batched). Differentiable (activations: the derivative of each; gelu and silu recompute the pre-activation
    through the bundle in the backward pass). Under torch.autocast the operands are cast to its dtype."""
    handle = register(registry)
    if activation not in ACTIVATIONS:
        raise InvalidInputError(f"unknown activation {activation!r} (known: {', '.join(ACTIVATIONS)})")
    low, high = NO_CLAMP if clamp is None else (float(clamp[0]), float(clamp[1]))
    return _matmul(a, b, bias, tuple(residuals), activation, low, high, handle)


_OWN_KEY = object()  # _matmul(key=): look the call up under its own key


def _matmul(a, b, bias, residuals: tuple, activation: str, low: float, high: float, handle: int,
            key=_OWN_KEY) -> torch.Tensor:
    """matmul() on checked options. key: the fast path's key of the caller's call, which the caller looked up
    already, its operands checked (None: the call is not to be remembered)."""
    if key is _OWN_KEY:  # a call that records a gradient is never served by a remembered call: not looked up
        key, pointers = (None, None) if _grad_enabled() and _needs_grad(a, b, bias, *residuals) else _fast_key(
            a, b, bias, residuals, ("gemm", activation, low, high))
        if key is not None:
            out = _fast_call(handle, a, key, pointers)
            if out is not None:
                return out
        _check_tensors("matmul", residuals, a=a, b=b, bias=bias)  # linear()'s callers checked theirs already
    if _any_autocast():
        a, b, bias, *residuals = _autocast((a, b, bias, *residuals))
    lead = None
    if b.dim() == 2 and a.dim() != 2:  # [..., k] @ [k, n]: one GEMM over the rows of every leading index
        if a.dim() < 1:
            raise InvalidInputError(f"matmul: a has shape {list(a.shape)}, expected [..., k]")
        lead = a.shape[:-1]
        rows = _rows(a)
        rows_of_residuals = tuple(map(_rows, residuals))
        if key is not None and (rows.data_ptr() != a.data_ptr() or any(
                v.data_ptr() != r.data_ptr() for v, r in zip(rows_of_residuals, residuals))):
            key = None  # a reshape copied: the kernel reads the copy, not the caller's tensor
        a, residuals = rows, rows_of_residuals
    grad = _needs_grad(a, b, bias, *residuals)
    if grad:
        out = _record(_GemmFunction, _gemm_forward, _gemm_backward, _gemm_backward_once, "TiledispatchGemmBackward",
                      (activation, (low, high), handle), a, b, bias, *residuals)
    else:
        _DIRECT.launch = None
        out = _gemm(a, b, bias, residuals, activation, low, high, handle)
    if lead is not None:
        out = out.view(*lead, out.shape[-1])
    if key is not None and not grad:
        _remember(handle, a, key, out, _requires_grad(a, b, bias, *residuals), len(residuals))
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., n] as [rows, n] (reshape(-1, n) cannot size the rows of an empty tensor with n = 0); a 0-d tensor as
    it is (the checks refuse it)."""
    if t.dim() == 0:
        return t
    n = t.shape[-1]
    return t.reshape(-1, n) if n else t.reshape(math.prod(t.shape[:-1]), 0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, registry,
           residuals: Sequence[torch.Tensor] = (), activation: str = "identity", clamp=None) -> torch.Tensor:
    """act(x @ weight^T + bias + sum(residuals)), as torch.nn.functional.linear (weight [out, in])."""
    handle = register(registry)
    if activation not in ACTIVATIONS:
        raise InvalidInputError(f"unknown activation {activation!r} (known: {', '.join(ACTIVATIONS)})")
    low, high = NO_CLAMP if clamp is None else (float(clamp[0]), float(clamp[1]))
    return _linear(x, weight, bias, tuple(residuals), activation, low, high, handle)


def _linear(x, weight, bias, residuals: tuple, activation: str, low: float, high: float, handle: int) -> torch.Tensor:
    """linear() on checked options (the patched and fused layers call it): the fast path under the key of (x,
    weight), which saves the transposed view of the weight that _matmul takes."""
    key = None
    if not (_grad_enabled() and _needs_grad(x, weight, bias, *residuals)):  # a grad call is never served by one
        key, pointers = _fast_key(x, weight, bias, residuals, ("linear", activation, low, high))
        if key is not None:
            out = _fast_call(handle, x, key, pointers)
            if out is not None:
                return out
    _check_tensors("linear", residuals, x=x, weight=weight, bias=bias)
    return _matmul(x, weight.t(), bias, residuals, activation, low, high, handle, key)


def layer_norm(x: torch.Tensor, normalized_shape, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5, *, registry) -> torch.Tensor:
    """F.layer_norm on the bundle, its arguments in the same order: the trailing dims normalized_shape names are
    normalized per row (the variance biased), then scaled by weight and shifted by bias (each optional, of that
    shape). The kernels are forward only: a call that records a gradient, or runs under torch.autocast (which
    computes layer norm in float32), is torch's F.layer_norm, so its result and gradient are torch's."""
    return _layer_norm(x, normalized_shape, weight, bias, eps, register(registry))


def _layer_norm(x, normalized_shape, weight, bias, eps, handle: int) -> torch.Tensor:
    key = None
    if weight is not None and not _needs_grad(x, weight, bias):  # the eager fast path (x and weight its a and b)
        try:
            key, pointers = _fast_key(x, weight, bias, (), ("layer_norm", tuple(normalized_shape) if type(
                normalized_shape) is not int else normalized_shape, eps, type(eps)))
            out = None if key is None else _fast_call(handle, x, key, pointers)
        except TypeError:  # an unhashable or non-iterable argument: the checks below say what is wrong
            key = out = None
        if out is not None:
            return out
    shape = _normalized_shape(x, normalized_shape, weight, bias)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise InvalidInputError(f"layer_norm: eps must be a real number, got {eps!r}")
    if _needs_grad(x, weight, bias) or (_any_autocast() and torch.is_autocast_enabled(x.device.type)):
        return F.layer_norm(x, shape, weight, bias, eps)
    if _eager(x, x if weight is None else weight, bias):
        return _run_remembering(handle, x, key, _requires_grad(x, weight, bias), 0, _layer_norm_run, x, shape, weight,
                                bias, float(eps), handle)
    return _layer_norm_op(x, list(shape), weight, bias, float(eps), handle)


def max_pool(x: torch.Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False, *,
             registry) -> torch.Tensor:
    """F.max_pool1d / 2d / 3d (by the rank of x: [N, C, W], [N, C, H, W], [N, C, D, H, W]) on the bundle, the same
    arguments (stride defaults to kernel_size; return_indices is torch's alone). x is read channels-last (copied
    where its memory is not) and the output is channels-last. The kernels are forward only: a call that records a
    gradient is torch's own F.max_poolNd."""
    return _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, register(registry))


_TORCH_POOLS = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, handle: int) -> torch.Tensor:
    options = ("max_pool", repr((kernel_size, stride, padding, dilation, ceil_mode)))
    if not _needs_grad(x):  # the eager fast path (x as the call's a and b)
        key, pointers = _fast_key(x, x, None, (), options) if type(x) in _PLAIN else (None, None)
        out = None if key is None else _fast_call(handle, x, key, pointers)
        if out is not None:
            return out
    else:
        key = None
    if not isinstance(x, torch.Tensor) or not 3 <= x.dim() <= 5:
        raise InvalidInputError(f"max_pool: x must be a tensor [N, C, spatial...] with 1 to 3 spatial dims, got "
                                f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    rank = x.dim() - 2
    kernel_size = _per_dim("kernel_size", kernel_size, rank, "max_pool")
    stride = kernel_size if stride is None or (isinstance(stride, (list, tuple)) and not stride) else _per_dim(
        "stride", stride, rank, "max_pool")  # torch's default: the window (None or an empty list)
    padding, dilation = _per_dim("padding", padding, rank, "max_pool"), _per_dim("dilation", dilation, rank, "max_pool")
    if not isinstance(ceil_mode, bool):
        raise InvalidInputError(f"max_pool: ceil_mode must be True or False, got {ceil_mode!r}")
    _pool_shape(x.shape, kernel_size, stride, padding, dilation, ceil_mode)  # the geometry's checks, before any call
    if _needs_grad(x):
        return _TORCH_POOLS[rank](x, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode)
    if _eager(x, x):
        return _run_remembering(handle, x, key, False, 0, _max_pool_run, x, kernel_size, stride, padding, dilation,
                                ceil_mode, handle)
    return _max_pool_op(x, kernel_size, stride, padding, dilation, ceil_mode, handle)


def _normalized_shape(x, normalized_shape, weight, bias) -> tuple:
    """normalized_shape as a tuple of ints, checked against x's trailing dims and the shapes of weight and bias."""
    if not isinstance(x, torch.Tensor):
        raise InvalidInputError(f"layer_norm: x must be a tensor, got {type(x).__name__}")
    shape = (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else normalized_shape
    try:
        shape = tuple(_plain_int(d) for d in shape)
    except (TypeError, InvalidInputError):
        shape = ()
    if not shape or isinstance(normalized_shape, bool) or any(d < 1 for d in shape):
        raise InvalidInputError(f"layer_norm: normalized_shape must be one or more positive ints, got "
                                f"{normalized_shape!r}")
    if x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise InvalidInputError(f"layer_norm: x has shape {list(x.shape)}, whose trailing dims are not "
                                f"normalized_shape {list(shape)}")
    for t, role in ((weight, "weight"), (bias, "bias")):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape):
            raise InvalidInputError(f"layer_norm: {role} must be a tensor of shape {list(shape)}, got "
                                    f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    return shape


def _per_dim(name: str, value, rank: int, op: str = "conv") -> list:
    """rank plain ints from an int or a sequence of ints (numpy integers accepted, bools refused)."""
    if type(value) is int:
        return [value] * rank
    try:
        values = [value] * rank if isinstance(value, numbers.Integral) else list(value)
        values = [v if type(v) is int else _plain_int(v) for v in values]
    except TypeError:
        values = None
    if values is None or len(values) != rank:
        raise InvalidInputError(f"{op} {name} must be an int or {rank} ints, got {value!r}")
    return values


def _plain_int(v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(v)
    return operator.index(v)


def conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, registry, stride=1,
         padding=0, dilation=1, groups: int = 1, pad_lo=None, pad_hi=None, residuals: Sequence[torch.Tensor] = (),
         activation: str = "identity", clamp=None) -> torch.Tensor:
    """act(convNd(x, weight, bias) + sum(residuals)): torch.nn.functional.conv1d / 2d / 3d (by the rank of x:
    [N, C, W], [N, C, H, W], [N, C, D, H, W]) on the bundle, with a fused epilogue; padding symmetric, or
    pad_lo / pad_hi per side; residuals of the output's shape (no broadcasting); activation one of the GEMM
    epilogue's (clamp: (low, high)). One kernel computes the whole expression where the bundle has one that
    runs the problem; otherwise the plain conv kernel adds bias and residuals (beta * Y) and torch applies the
    activation. The output is channels-last. Differentiable (grad input: bwd_data, grad weight: bwd_weight,
    grad bias: a sum, grad residual: the output's gradient, all through the activation's derivative)."""
    handle = register(registry)
    key = _OWN_KEY
    if (pad_lo is None and pad_hi is None and clamp is None and type(stride) is int and type(padding) is int
            and type(dilation) is int and type(groups) is int and type(activation) is str):
        # the common call, looked up under its options as given before they are checked: only a call that passed
        # the checks is remembered, and plain types keep True or 1.0 from finding the entry of 1
        residuals = residuals if type(residuals) is tuple else tuple(residuals)
        key, pointers = _fast_key(x, weight, bias, residuals, ("conv", activation, stride, padding, dilation, groups))
        if key is not None:
            y = _fast_call(handle, x, key, pointers)
            if y is not None:
                return y
    if activation not in ACTIVATIONS:
        raise InvalidInputError(f"unknown activation {activation!r} (known: {', '.join(ACTIVATIONS)})")
    _check_tensors("conv", residuals, bias=bias)
    rank = x.dim() - 2 if isinstance(x, torch.Tensor) else 0
    _check_conv_ranks(x, weight, rank)
    low, high = NO_CLAMP if clamp is None else (float(clamp[0]), float(clamp[1]))
    if (pad_lo is None and pad_hi is None and type(stride) is int and type(padding) is int and type(dilation) is int
            and type(groups) is int):  # one int per option: its _Geometry memoized by those ints
        geo = _UNIFORM_GEOMETRIES.get((rank, stride, padding, dilation, groups))
        if geo is None:
            if len(_UNIFORM_GEOMETRIES) >= _MEMO_SIZE:
                _UNIFORM_GEOMETRIES.clear()
            geo = _UNIFORM_GEOMETRIES[rank, stride, padding, dilation, groups] = _geometry(
                (stride,) * rank, (dilation,) * rank, (padding,) * rank, (padding,) * rank, groups)
        return _conv(x, weight, bias, geo.stride, geo.dilation, geo.pad_lo, geo.pad_hi, groups, handle, geo,
                     tuple(residuals), activation, (low, high), key)
    if (pad_lo is None) != (pad_hi is None):
        raise InvalidInputError("give both pad_lo and pad_hi, or padding")
    lo = _per_dim("pad_lo", pad_lo if pad_lo is not None else padding, rank)
    hi = _per_dim("pad_hi", pad_hi if pad_hi is not None else padding, rank)
    stride, dilation = _per_dim("stride", stride, rank), _per_dim("dilation", dilation, rank)
    return _conv(x, weight, bias, stride, dilation, lo, hi, groups if type(groups) is int else _groups(groups), handle,
                 None, tuple(residuals), activation, (low, high))


_UNIFORM_GEOMETRIES: dict = {}  # (rank, stride, padding, dilation, groups), plain ints -> _Geometry


def _groups(value) -> int:
    try:
        return _plain_int(value)
    except TypeError:
        raise InvalidInputError(f"conv groups must be an int, got {value!r}") from None


def _check_conv_ranks(x, weight, rank: int) -> None:
    # tested inline (this runs on a patched layer's every call); the helper only names the operand
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        _check_tensors("conv", x=x, weight=weight)
    if rank not in (1, 2, 3) or weight.dim() != rank + 2:
        raise InvalidInputError(f"conv takes x [N, C, spatial...] with 1-3 spatial dims and weight [K, C/G, "
                                f"filter...] of the same rank; got {list(x.shape)} and {list(weight.shape)}")


def _conv(x, weight, bias, stride, dilation, lo, hi, groups: int, handle: int, geo: Optional[_Geometry] = None,
          residuals: tuple = (), activation: str = "identity", clamp: tuple = NO_CLAMP, key=_OWN_KEY):
    """conv() on checked arguments (geo: their _Geometry, when the caller keeps it). key: as _matmul's."""
    if _grad_enabled() and _needs_grad(x, weight, bias, *residuals):
        if _any_autocast():
            x, weight, bias, *residuals = _autocast((x, weight, bias, *residuals))
        if _compiling():  # traced: the recorded call reads and writes no per-call state (it sees geo None)
            geo = None
        elif geo is None:  # the eager calls' launches are remembered under their _Geometry
            geo = _geometry(stride, dilation, lo, hi, groups)
        return _record(_ConvFunction, _conv_forward, _conv_backward, _conv_backward_once, "TiledispatchConvBackward",
                       (stride, dilation, lo, hi, groups, handle, activation, clamp, geo), x, weight, bias, *residuals)
    if key is _OWN_KEY:
        key, pointers = _fast_key(x, weight, bias, residuals, ("conv", activation, clamp, geo) if geo is not None else
                                  ("conv", activation, clamp, tuple(stride), tuple(dilation), tuple(lo), tuple(hi),
                                   groups))
        if key is not None:
            y = _fast_call(handle, x, key, pointers)
            if y is not None:
                return y
    if _any_autocast():
        x, weight, bias, *residuals = _autocast((x, weight, bias, *residuals))
    return _run_remembering(handle, x, key, _requires_grad(x, weight, bias, *residuals), len(residuals), _conv_fwd, x,
                            weight, bias, stride, dilation, lo, hi, groups, handle, geo, residuals, activation, clamp)


# -- patch / unpatch -----------------------------------------------------------------------------------------
@dataclass
class LayerReport:
    """One nn.Linear / nn.Conv layer: routed through the bundle ("tiledispatch") or left on PyTorch ("pytorch",
    with the reason: a dtype or op the bundle was not built for). kernels: the kernel selected per direction
    for the example input (patch(..., example_inputs=...)); notes: conversions each call makes."""
    name: str
    kind: str
    dtype: str
    status: str
    reason: str = ""
    notes: list = field(default_factory=list)
    kernels: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "dtype": self.dtype, "status": self.status,
                "reason": self.reason, "notes": list(self.notes), "kernels": dict(self.kernels)}


@dataclass
class PatchReport:
    layers: list

    @property
    def patched(self) -> list:
        return [r for r in self.layers if r.status == "tiledispatch"]

    @property
    def unsupported(self) -> list:
        return [r for r in self.layers if r.status != "tiledispatch"]

    def to_dict(self) -> dict:
        return {"patched": len(self.patched), "unsupported": len(self.unsupported),
                "layers": [r.to_dict() for r in self.layers]}

    def __str__(self) -> str:
        lines = [f"tiledispatch.patch: {len(self.patched)} layer(s) on the bundle, {len(self.unsupported)} on PyTorch"]
        for r in self.layers:
            where = "bundle " if r.status == "tiledispatch" else "PyTorch"
            detail = (r.reason or "; ".join(f"{d}: {k}" for d, k in r.kernels.items())
                      or "kernels chosen per input shape")
            lines.append(f"  {r.name or '(model)'} [{r.kind} {r.dtype}] {where} {detail}")
            lines += [f"      note: {n}" for n in r.notes]
        return "\n".join(lines)


_CONV_TYPES = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}
_POOL_TYPES = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3}
_BASE_FORWARD = {"Linear": nn.Linear.forward, "LayerNorm": nn.LayerNorm.forward,
                 **{f"Conv{rank}d": cls.forward for cls, rank in _CONV_TYPES.items()},
                 **{f"MaxPool{rank}d": cls.forward for cls, rank in _POOL_TYPES.items()}}
_FORWARD_ONLY = {"LayerNorm": "forward only: a call that records a gradient or runs under torch.autocast is torch's "
                              "F.layer_norm",
                 "MaxPool": "forward only: a call that records a gradient is torch's F.max_pool"}
_PATCH_ATTR = "_tiledispatch_patch"
_ANY_DTYPE = "input's"  # the dtype patch() reports for a LayerNorm without parameters


def _layer_kind(module: nn.Module) -> Optional[str]:
    if isinstance(module, nn.Linear):
        return "Linear"
    if isinstance(module, nn.LayerNorm):
        return "LayerNorm"
    for cls, rank in _POOL_TYPES.items():
        if isinstance(module, cls):
            return f"MaxPool{rank}d"
    for cls, rank in _CONV_TYPES.items():
        if isinstance(module, cls):
            return f"Conv{rank}d"
    return None


def _conv_padding(module) -> tuple[list, list]:
    """(pad_lo, pad_hi) of a Conv module's own zero padding (none when padding_mode pads the input itself)."""
    rank = len(module.kernel_size)
    if module.padding_mode != "zeros":
        return [0] * rank, [0] * rank
    if module.padding == "valid":
        return [0] * rank, [0] * rank
    if module.padding == "same":  # torch's split of the total: the smaller half first
        total = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
        return [t // 2 for t in total], [t - t // 2 for t in total]
    return list(module.padding), list(module.padding)


def _patched_linear_forward(self, x):
    return _linear(x, self.weight, self.bias, (), "identity", *NO_CLAMP, getattr(self, _PATCH_ATTR)["handle"])


def _patched_layer_norm_forward(self, x):
    return _layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps,
                       getattr(self, _PATCH_ATTR)["handle"])


def _patched_max_pool_forward(self, x):
    return _max_pool(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode,
                     getattr(self, _PATCH_ATTR)["handle"])


def _patched_conv_forward(self, x):
    state = getattr(self, _PATCH_ATTR)
    if self.padding_mode != "zeros":  # reflect / replicate / circular: padded by torch, as nn.Conv does
        x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
    weight = self.weight
    if _compiling():  # traced: no per-layer state is read or written inside a graph
        return conv(x, weight, self.bias, registry=state["handle"], stride=list(self.stride),
                    dilation=list(self.dilation), groups=self.groups, pad_lo=state["pad_lo"], pad_hi=state["pad_hi"])
    # the layer's _Geometry, made again when its stride, dilation or groups changed since (compared by value)
    geo, source = state["geometry"]
    if source != (self.stride, self.dilation, self.groups):
        rank = len(self.kernel_size)
        source = (self.stride, self.dilation, self.groups)
        geo = _geometry(_per_dim("stride", self.stride, rank), _per_dim("dilation", self.dilation, rank),
                        _per_dim("pad_lo", state["pad_lo"], rank), _per_dim("pad_hi", state["pad_hi"], rank),
                        _groups(self.groups))
        state["geometry"] = geo, source
    rank = x.dim() - 2 if isinstance(x, torch.Tensor) else 0
    _check_conv_ranks(x, weight, rank if rank == geo.rank else 0)
    return _conv(x, weight, self.bias, geo.stride, geo.dilation, geo.pad_lo, geo.pad_hi, geo.groups,
                 state["handle"], geo)


def _missing(handle: int, module: nn.Module, kind: str, dtype: str, training: bool) -> Optional[str]:
    """Why the bundle cannot run this layer's op and dtype, or None."""
    caps = _CAPS[handle]
    if kind == "LayerNorm" or kind.startswith("MaxPool"):
        op, dtypes = ("layernorm", caps.layernorm) if kind == "LayerNorm" else ("maxpool", caps.maxpool)
        if not (dtypes if dtype == _ANY_DTYPE else dtype in dtypes):
            return f"the bundle has no {'' if dtype == _ANY_DTYPE else dtype + ' '}{op} kernels"
        if kind.startswith("MaxPool") and module is not None and module.return_indices:
            return "return_indices: the kernels compute the maxima alone"
        return None
    if kind == "Linear":
        if not any(c[0] == dtype and c[2] == "identity" and c[1][2] == "r" for c in caps.gemm):
            return f"the bundle has no {dtype} GEMM kernels"
        return None
    rank = int(kind[4])
    directions = ("fwd", "bwd_data", "bwd_weight") if training else ("fwd",)
    lacking = [d for d in directions if (d, rank, dtype) not in caps.conv]
    if lacking:
        return (f"the bundle has no {dtype} conv{rank}d {' / '.join(lacking)} kernels"
                + (" (the layer's parameters require grad)" if training and "fwd" not in lacking else ""))
    return None


def patch(model: nn.Module, registry, *, example_inputs=None, autocast: Optional[torch.dtype] = None) -> PatchReport:
    """Route the model's nn.Linear and nn.Conv1d/2d/3d layers, and its nn.LayerNorm layers where the bundle has
    layernorm kernels, through the bundle (their forward is replaced; parameters, buffers and state_dict stay as
    they are) and report, per layer, the kernels chosen or why the layer stays on PyTorch: only a dtype or op the
    bundle was not built for (for a layer whose parameters require grad, the conv backward directions count). A
    patched layer never falls back at call time: a problem the bundle cannot run raises UnsupportedProblemError.
    (A LayerNorm call that records a gradient or runs under autocast is torch's own, as layer_norm() says.)

    example_inputs: a tensor or tuple of tensors; the model is run once on them (under torch.no_grad) to record
    each patched layer's input and report the kernel selected for it per direction.
    autocast: the dtype the model will run in under torch.autocast (e.g. torch.float16): layers with float32
    parameters are then checked against it (the example run happens under autocast too)."""
    handle = register(registry)
    layers = []
    for name, module in model.named_modules():
        kind = _layer_kind(module)
        if kind is None:
            continue
        if hasattr(module, _PATCH_ATTR):
            _unpatch_module(module)
        if (kind == "LayerNorm" and not _CAPS[handle].layernorm) or (kind.startswith("MaxPool")
                                                                    and not _CAPS[handle].maxpool):
            continue  # layer norms and pooling: only a bundle with the op reports them
        weight = getattr(module, "weight", None)  # None: a LayerNorm without affine, a pool (the input's dtype)
        compute = autocast if autocast is not None and weight is not None and weight.dtype == torch.float32 else (
            None if weight is None else weight.dtype)
        dtype = _ANY_DTYPE if compute is None else _DTYPES.get(compute, str(compute).replace("torch.", ""))
        training = any(p.requires_grad for p in module.parameters(recurse=False))
        reason = _missing(handle, module, kind, dtype, training)
        if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
            reason = "nn.MultiheadAttention reads this projection's weight itself (F.multi_head_attention_forward)"
        elif type(module).forward is not _BASE_FORWARD[kind]:  # replacing it would drop what the subclass computes
            reason = f"{type(module).__name__} overrides {kind}.forward: not a plain {kind} call"
        if reason:
            layers.append(LayerReport(name, kind, dtype, "pytorch", reason))
            continue
        report = LayerReport(name, kind, dtype, "tiledispatch", notes=_static_notes(handle, module, kind, dtype))
        if weight is not None and compute != weight.dtype and kind not in _FORWARD_ONLY:
            report.notes.append(f"fp32 parameters, computed in {dtype} under torch.autocast")
        state = {"handle": handle, "report": report, "dtype": dtype}
        if kind.startswith("Conv"):
            state["pad_lo"], state["pad_hi"] = _conv_padding(module)
            state["geometry"] = None, None  # made on the first call (_patched_conv_forward)
        setattr(module, _PATCH_ATTR, state)
        forward = {"Linear": _patched_linear_forward, "LayerNorm": _patched_layer_norm_forward}.get(
            kind, _patched_max_pool_forward if kind.startswith("MaxPool") else _patched_conv_forward)
        module.forward = types.MethodType(forward, module)
        layers.append(report)
    result = PatchReport(layers)
    if example_inputs is not None:
        _record_kernels(model, handle, example_inputs, autocast)
    return result


def unpatch(model: nn.Module) -> None:
    """Undo patch(): every layer runs its own forward again."""
    for module in model.modules():
        if hasattr(module, _PATCH_ATTR):
            _unpatch_module(module)


def _unpatch_module(module: nn.Module) -> None:
    delattr(module, _PATCH_ATTR)
    if "forward" in module.__dict__:
        del module.__dict__["forward"]


def _static_notes(handle: int, module: nn.Module, kind: str, dtype: str) -> list:
    notes = []
    if kind.rstrip("123d") in _FORWARD_ONLY:
        return [_FORWARD_ONLY[kind.rstrip("123d")]] + (
            [] if kind == "LayerNorm" else ["an input whose memory is not channels-last is copied on every call"])
    if kind == "Linear":
        if module.bias is not None:
            try:
                route = _choose_route(handle, dtype, "identity", True, 0, "r", "c")
                if route.fold:
                    notes.append("bias added through the kernel's beta * C (the bundle has no bias-fused kernel)")
            except UnsupportedProblemError:
                pass
        return notes
    if not _is_channels_last(module.weight):
        notes.append("weight converted to channels-last on every call (model.to(memory_format=torch.channels_last) "
                     "avoids it)")
    if module.bias is not None:
        notes.append("bias added through the kernel's beta * Y (the output is filled with the bias first)")
    if module.padding_mode != "zeros":
        notes.append(f"input padded by torch ({module.padding_mode}) before the convolution")
    return notes


def _record_kernels(model: nn.Module, handle: int, example_inputs, autocast: Optional[torch.dtype]) -> None:
    """Run the model once and fill each patched layer's report with the kernels selected for its input."""
    seen = {}

    def hook(module, args):
        seen[module] = args[0]

    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    hooks = [m.register_forward_pre_hook(hook) for m in model.modules() if hasattr(m, _PATCH_ATTR)]
    try:
        with torch.no_grad(), torch.autocast(inputs[0].device.type, dtype=autocast, enabled=autocast is not None):
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    for module, x in seen.items():
        state = getattr(module, _PATCH_ATTR)
        report = state["report"]
        training = any(p.requires_grad for p in module.parameters(recurse=False))
        if report.kind == "Linear":
            report.kernels.update(_linear_kernels(handle, module, x, training))
        elif report.kind == "LayerNorm":
            cols = math.prod(module.normalized_shape)
            dtype = _DTYPES.get(x.dtype, str(x.dtype))
            report.kernels["fwd"] = _select_name(handle, LayerNormProblem(max(1, x.numel() // cols), cols, dtype,
                                                                          dtype, dtype))
        elif report.kind.startswith("MaxPool"):
            report.kernels["fwd"] = _pool_kernel_name(handle, module, x)
        else:
            if module.padding_mode != "zeros":
                x = F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
            if not _is_channels_last(x):
                report.notes.append("input converted to channels-last on every call (its memory is not channels-last)")
            report.kernels.update(_conv_kernels(handle, module, state, x, training))


def _pool_kernel_name(handle: int, module: nn.Module, x: torch.Tensor) -> str:
    try:
        rank = x.dim() - 2
        geo = [_per_dim(name, getattr(module, name), rank, "max_pool")
               for name in ("kernel_size", "stride", "padding", "dilation")]
        problem = pool_op.problem_of(x.shape[0], x.shape[1], tuple(x.shape[2:]), _dtype_name(x, "x"), *geo,
                                     module.ceil_mode)
    except InvalidInputError as e:
        return f"NO KERNEL: {e}"
    return _select_name(handle, problem)


def _select_name(handle: int, problem) -> str:
    try:
        return registry_of(handle).select(problem).name
    except UnsupportedProblemError as e:
        return f"NO KERNEL: {str(e).splitlines()[0]}"


def _gemm_kernel(handle: int, a_shape, b_shape, dtype: str, letters_a: str, letters_b: str, bias: bool) -> str:
    try:
        route = _choose_route(handle, dtype, "identity", bias, 0, letters_a, letters_b,
                              (1, a_shape[0], b_shape[-1], a_shape[1]))
    except UnsupportedProblemError as e:
        return f"NO KERNEL: {e}"
    (m, k), n = a_shape, b_shape[-1]
    problem = GemmProblem(m, n, k, dtype, dtype, "int32" if dtype == "int8" else dtype, route.layout, 1, route.epilogue)
    copies = [f"{role} copied to {'row' if letter == 'r' else 'column'}-major" for role, letter in
              (("A", route.copy_a), ("B", route.copy_b)) if letter]
    return _select_name(handle, problem) + (f" ({', '.join(copies)})" if copies else "")


def _linear_kernels(handle: int, module: nn.Linear, x: torch.Tensor, training: bool) -> dict:
    dtype = getattr(module, _PATCH_ATTR)["dtype"]
    rows = x.numel() // x.shape[-1]
    n, k = module.weight.shape
    a_letters = _letters(x.reshape(-1, k))
    kernels = {"fwd": _gemm_kernel(handle, (rows, k), (k, n), dtype, a_letters, "c", module.bias is not None)}
    if training:  # grad x = g @ W (W row-major), grad W = g^T @ x: what _gemm_backward runs
        kernels["bwd_data"] = _gemm_kernel(handle, (rows, n), (n, k), dtype, "r", "r", False)
        kernels["bwd_weight"] = _gemm_kernel(handle, (n, rows), (rows, k), dtype, "c", "r", False)
    return kernels


def _conv_kernels(handle: int, module, state: dict, x: torch.Tensor, training: bool) -> dict:
    dtype = state["dtype"]
    k, cg = module.weight.shape[:2]
    geo = dict(stride=tuple(module.stride), dilation=tuple(module.dilation), pad_lo=tuple(state["pad_lo"]),
               pad_hi=tuple(state["pad_hi"]))
    kernels = {}
    for direction in ("fwd", "bwd_data", "bwd_weight") if training else ("fwd",):
        problem = ConvProblem(direction, x.shape[0], module.groups, cg * module.groups, k, tuple(x.shape[2:]),
                              tuple(module.weight.shape[2:]), **geo, dtype_x=dtype, dtype_w=dtype, dtype_y=dtype)
        kernels[direction] = _conv_kernel_name(handle, problem)
    return kernels


def _lowered_to_gemm(reg: Registry, problem: ConvProblem) -> bool:
    """Whether reg.conv_fwd / conv_bwd_data try the problem first as a GEMM over the bundle's GEMM kernels
    (ops/conv_as_gemm.py: a pointwise dense problem, a bundle with GEMM kernels)."""
    return conv_as_gemm.applies(problem) and "gemm" in reg.ops


def _conv_kernel_name(handle: int, problem: ConvProblem) -> str:
    """The kernel reg.conv_fwd / conv_bwd_data choose: a pointwise dense problem first as a GEMM over the
    bundle's GEMM kernels (ops/conv_as_gemm.py), else a conv kernel."""
    reg = registry_of(handle)
    if _lowered_to_gemm(reg, problem):
        pixels = problem.n * math.prod(problem.in_size)
        if problem.direction == "fwd":
            gemm = GemmProblem(pixels, problem.k, problem.c, problem.dtype_x, problem.dtype_w, problem.dtype_y, "rcr")
        else:
            gemm = GemmProblem(pixels, problem.c, problem.k, problem.dtype_y, problem.dtype_w, problem.dtype_x, "rrr")
        try:
            return reg.select(gemm).name
        except UnsupportedProblemError:
            pass
    return _select_name(handle, problem)


# fuse(): whole layers (conv -> batch norm -> residual -> activation, linear -> activation) as single calls; it
# builds on everything above, so it is imported last
from .torch_fusion import FusedConv, FusedLayer, FusedLinear, FuseReport, fuse  # noqa: E402
