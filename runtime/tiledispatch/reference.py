"""float64 numpy references.

Grouped convolution, channels-last with an explicit group axis, spatial rank S = 1, 2 or 3:
  x  [N, in_spatial..., G, C/G]      w  [G, K/G, filter..., C/G]      y  [N, out_spatial..., G, K/G]
  out[d] = floor((in[d] + pad_lo[d] + pad_hi[d] - dilation[d] * (filter[d] - 1) - 1) / stride[d]) + 1
Geometry arguments (stride, dilation, pad_lo, pad_hi) are sequences of S integers, outermost dim first.
Each function loops over filter taps only; a tap is one strided slice of the zero-padded input and one
batched matmul over groups, so the cost is taps x (one GEMM), never a Python loop over pixels.
"""
from __future__ import annotations

from itertools import product

import numpy as np


def conv_out_size(in_size: int, filter_size: int, stride: int, dilation: int, pad_lo: int, pad_hi: int) -> int:
    """Output extent of one spatial dim; ValueError when the padded input is smaller than the filter."""
    span = in_size + pad_lo + pad_hi - dilation * (filter_size - 1) - 1
    if span < 0:
        raise ValueError(f"padded input {in_size} + {pad_lo} + {pad_hi} is smaller than the dilated filter "
                         f"{dilation * (filter_size - 1) + 1}")
    return span // stride + 1


def _geometry(rank: int, stride, dilation, pad_lo, pad_hi):
    geo = []
    for name, values, low in (("stride", stride, 1), ("dilation", dilation, 1),
                              ("pad_lo", pad_lo, 0), ("pad_hi", pad_hi, 0)):
        values = tuple(int(v) for v in values)
        if len(values) != rank:
            raise ValueError(f"{name} has {len(values)} values, the convolution has {rank} spatial dims")
        if any(v < low for v in values):
            raise ValueError(f"{name} must be >= {low} in every dim, got {list(values)}")
        geo.append(values)
    return geo


def _taps(out, filt, stride, dilation):
    """(filter tap index, slices of the padded input it reads for every output pixel)."""
    for t in product(*(range(f) for f in filt)):
        yield t, tuple(slice(t[d] * dilation[d], t[d] * dilation[d] + (out[d] - 1) * stride[d] + 1, stride[d])
                       for d in range(len(out)))


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _gemm_over_groups(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a [P, G, I], b [G, I, J] -> [P, G, J]: one batched matmul (BLAS), batched over G."""
    return np.matmul(a.transpose(1, 0, 2), b).transpose(1, 0, 2)


def conv_fwd(x, w, stride, dilation, pad_lo, pad_hi) -> np.ndarray:
    """y = conv(x, w) in float64."""
    x, w = _f64(x), _f64(w)
    rank = x.ndim - 3
    if rank not in (1, 2, 3) or w.ndim != rank + 3:
        raise ValueError(f"x has rank {x.ndim} and w rank {w.ndim}; both must be S + 3 with S in 1..3")
    stride, dilation, pad_lo, pad_hi = _geometry(rank, stride, dilation, pad_lo, pad_hi)
    n, in_sp, g, cg = x.shape[0], x.shape[1:-2], x.shape[-2], x.shape[-1]
    filt, kg = w.shape[2:-1], w.shape[1]
    if w.shape[0] != g or w.shape[-1] != cg:
        raise ValueError(f"w {w.shape} does not match x {x.shape} in groups or channels per group")
    out = [conv_out_size(*a) for a in zip(in_sp, filt, stride, dilation, pad_lo, pad_hi)]
    xp = np.pad(x, [(0, 0)] + list(zip(pad_lo, pad_hi)) + [(0, 0), (0, 0)])
    y = np.zeros((n, *out, g, kg))
    pixels = n * int(np.prod(out))
    for t, sl in _taps(out, filt, stride, dilation):
        xs = xp[(slice(None),) + sl].reshape(pixels, g, cg)
        wt = w[(slice(None), slice(None)) + t].transpose(0, 2, 1)      # [G, C/G, K/G]
        y += _gemm_over_groups(xs, wt).reshape(y.shape)
    return y


def conv_bwd_data(dy, w, in_spatial, stride, dilation, pad_lo, pad_hi) -> np.ndarray:
    """dx = d<y, dy>/dx for y = conv(x, w), in float64; in_spatial gives x's spatial sizes."""
    dy, w = _f64(dy), _f64(w)
    rank = dy.ndim - 3
    in_sp = tuple(int(v) for v in in_spatial)
    if rank not in (1, 2, 3) or w.ndim != rank + 3 or len(in_sp) != rank:
        raise ValueError(f"dy rank {dy.ndim}, w rank {w.ndim}, in_spatial {in_sp}: need S + 3, S + 3 and S values")
    stride, dilation, pad_lo, pad_hi = _geometry(rank, stride, dilation, pad_lo, pad_hi)
    n, out, g, kg = dy.shape[0], dy.shape[1:-2], dy.shape[-2], dy.shape[-1]
    filt, cg = w.shape[2:-1], w.shape[-1]
    if w.shape[0] != g or w.shape[1] != kg:
        raise ValueError(f"w {w.shape} does not match dy {dy.shape} in groups or output channels per group")
    expect = [conv_out_size(*a) for a in zip(in_sp, filt, stride, dilation, pad_lo, pad_hi)]
    if list(out) != expect:
        raise ValueError(f"dy has spatial sizes {list(out)}, the geometry gives {expect}")
    dxp = np.zeros((n, *(i + lo + hi for i, lo, hi in zip(in_sp, pad_lo, pad_hi)), g, cg))
    dyp = dy.reshape(-1, g, kg)
    for t, sl in _taps(out, filt, stride, dilation):
        wt = w[(slice(None), slice(None)) + t]                           # [G, K/G, C/G]
        # for a fixed tap, distinct output pixels read distinct input pixels: += does not collide
        dxp[(slice(None),) + sl] += _gemm_over_groups(dyp, wt).reshape(n, *out, g, cg)
    return dxp[(slice(None),) + tuple(slice(lo, lo + i) for lo, i in zip(pad_lo, in_sp))].copy()


def conv_bwd_weight(x, dy, filter_spatial, stride, dilation, pad_lo, pad_hi) -> np.ndarray:
    """dw = d<y, dy>/dw for y = conv(x, w), in float64; filter_spatial gives w's filter sizes."""
    x, dy = _f64(x), _f64(dy)
    rank = x.ndim - 3
    filt = tuple(int(v) for v in filter_spatial)
    if rank not in (1, 2, 3) or dy.ndim != rank + 3 or len(filt) != rank:
        raise ValueError(f"x rank {x.ndim}, dy rank {dy.ndim}, filter {filt}: need S + 3, S + 3 and S values")
    stride, dilation, pad_lo, pad_hi = _geometry(rank, stride, dilation, pad_lo, pad_hi)
    n, in_sp, g, cg = x.shape[0], x.shape[1:-2], x.shape[-2], x.shape[-1]
    out, kg = dy.shape[1:-2], dy.shape[-1]
    if dy.shape[0] != n or dy.shape[-2] != g:
        raise ValueError(f"dy {dy.shape} does not match x {x.shape} in batch or groups")
    expect = [conv_out_size(*a) for a in zip(in_sp, filt, stride, dilation, pad_lo, pad_hi)]
    if list(out) != expect:
        raise ValueError(f"dy has spatial sizes {list(out)}, the geometry gives {expect}")
    xp = np.pad(x, [(0, 0)] + list(zip(pad_lo, pad_hi)) + [(0, 0), (0, 0)])
    dw = np.zeros((g, kg, *filt, cg))
    dyt = dy.reshape(-1, g, kg).transpose(1, 2, 0)                       # [G, K/G, P]
    for t, sl in _taps(out, filt, stride, dilation):
        xs = xp[(slice(None),) + sl].reshape(-1, g, cg).transpose(1, 0, 2)  # [G, P, C/G]
        dw[(slice(None), slice(None)) + t] = np.matmul(dyt, xs)
    return dw


ACTIVATIONS = {  # name -> f(v, clamp low, clamp high); spec/key.py takes its activation names from here
    "identity": lambda v, lo, hi: v,
    "relu": lambda v, lo, hi: np.maximum(v, 0.0),
    "gelu_tanh": lambda v, lo, hi: 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v ** 3))),
    "gelu_erf": lambda v, lo, hi: 0.5 * v * (1.0 + _erf(v / np.sqrt(2.0))),
    "silu": lambda v, lo, hi: v / (1.0 + np.exp(-v)),
    "sigmoid": lambda v, lo, hi: 1.0 / (1.0 + np.exp(-v)),
    "tanh": lambda v, lo, hi: np.tanh(v),
    "clamp": lambda v, lo, hi: np.clip(v, lo, hi),
    # where(), not v * clip(v + 3, 0, 6) / 6: -inf gives 0 as the kernels do, not -inf * 0
    "hardswish": lambda v, lo, hi: np.where(v + 3.0 <= 0.0, 0.0, np.where(v + 3.0 >= 6.0, v, v * (v + 3.0) / 6.0)),
    "hardsigmoid": lambda v, lo, hi: np.clip((v + 3.0) / 6.0, 0.0, 1.0),
}


def _erf(x: np.ndarray) -> np.ndarray:
    from math import erf

    return np.frompyfunc(erf, 1, 1)(x).astype(np.float64)


def conv_fwd_fused(x, w, stride, dilation, pad_lo, pad_hi, *, y=None, bias=None, residuals=(), alpha=1.0, beta=0.0,
                   activation="identity", clamp=(-np.inf, np.inf)) -> np.ndarray:
    """y = act(alpha * conv(x, w) + beta * y + bias[k] + sum(residuals)) in float64, explicit group axis: bias
    [G, K/G] (or its K values in group order), residuals and y [N, out..., G, K/G]."""
    acc = conv_fwd(x, w, stride, dilation, pad_lo, pad_hi)
    b = None if bias is None else _f64(bias).reshape(acc.shape[-2:])
    out = alpha * acc
    if y is not None and beta != 0:
        out = out + beta * _f64(y)
    if b is not None:
        out = out + b
    for r in residuals:
        out = out + _f64(r)
    return ACTIVATIONS[activation](out, clamp[0], clamp[1])


def gemm(a, b, c=None, bias=None, residuals=(), alpha=1.0, beta=0.0, activation="identity",
         clamp=(-np.inf, np.inf)) -> np.ndarray:
    """act(alpha * a @ b + beta * c + bias + sum(residuals)) in float64; a [.., m, k], b [.., k, n]."""
    out = alpha * np.matmul(_f64(a), _f64(b))
    if c is not None and beta != 0:
        out = out + beta * _f64(c)
    if bias is not None:
        out = out + _f64(bias)[..., None, :] if _f64(bias).ndim == 2 else out + _f64(bias)
    for r in residuals:
        out = out + _f64(r)
    return ACTIVATIONS[activation](out, clamp[0], clamp[1])


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim, in float64; the variance biased (as torch's)."""
    x = _f64(x)
    centered = x - x.mean(axis=-1, keepdims=True)
    out = centered / np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)
    if weight is not None:
        out = out * _f64(weight)
    if bias is not None:
        out = out + _f64(bias)
    return out


def max_pool(x, window, stride, dilation, padding, out_size) -> np.ndarray:
    """Max pooling of channels-last x [N, spatial..., C] in float64: taps outside the input count as -inf, a NaN
    in a window gives NaN (as torch's); geometry per spatial dim, outermost first, out_size as given."""
    x = _f64(x)
    if len(window) != x.ndim - 2:
        raise ValueError(f"x has {x.ndim - 2} spatial dims, the window {len(window)}")
    hi = [max(0, (o - 1) * s + (k - 1) * d - (n - 1) - p)
          for o, s, k, d, n, p in zip(out_size, stride, window, dilation, x.shape[1:-1], padding)]
    padded = np.pad(x, [(0, 0), *zip(padding, hi), (0, 0)], constant_values=-np.inf)
    out = np.full((x.shape[0], *out_size, x.shape[-1]), -np.inf)
    for taps in product(*(range(k) for k in window)):
        index = tuple(slice(t * d, t * d + (o - 1) * s + 1, s)
                      for t, d, o, s in zip(taps, dilation, out_size, stride))
        out = np.maximum(out, padded[(slice(None), *index)])
    return out
