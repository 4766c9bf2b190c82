"""A dense 1x1 convolution with unit stride and no padding is a GEMM over the pixels: this module finds that
GEMM's operands as views of the convolution's tensors (no copies), so that the runtime can run it on the
bundle's GEMM kernels (persistent, epilogue-overlapped) instead of the implicit-GEMM conv kernels, as cuDNN and
MIOpen do for pointwise layers.

    fwd       Y[NP, K]  = X[NP, C] . W[K, C]^T     (P: pixels of one image; layout rcr)
    bwd_data  dX[NP, C] = dY[NP, K] . W[K, C]      (layout rrr)

bwd_weight (dW = dY^T . X) is left to the conv kernels: its reduction runs over every pixel of the batch, which
needs a split / stream-K GEMM, and the conv kernels' persistent split-K already provides one. Measured as a crr
stream-K GEMM on the H100 (CUTLASS's cooperative stream-K kernels), ResNet-50's 1x1 layer took 76-423 us against
the conv kernel's 33.4 (bench/results/conv_run37_pointwise_wgrad/).
"""
from __future__ import annotations

import math
from typing import Optional

from ..arrays import ArrayView
from .conv import ConvProblem, Operands

DIRECTIONS = ("fwd", "bwd_data")
DTYPES = ("fp16", "bf16")  # fp32 conv kernels compute in fp32; GEMM kernels may round to tf32


def applies(problem: ConvProblem) -> bool:
    """Whether the problem is a pointwise dense convolution this lowering covers."""
    return (problem.direction in DIRECTIONS and problem.g == 1 and problem.dtype_x in DTYPES
            and set(problem.filter_size) == {1} and set(problem.stride) == {1}
            and not any(problem.pad_lo) and not any(problem.pad_hi))


def operands(problem: ConvProblem, ops: Operands) -> Optional[tuple[ArrayView, ArrayView, ArrayView]]:
    """(A, B, D) of the GEMM, as views of the conv's explicit-group-axis tensors, or None when the problem is
    not pointwise or its activations' pixels are not one run of rows (e.g. a strided slice of a batch)."""
    if not applies(problem):
        return None
    x, y = _pixel_rows(ops.x), _pixel_rows(ops.y)
    if x is None or y is None:
        return None
    w = ops.w  # [1, K, 1..., C]
    kc = ArrayView(w.ptr, (w.shape[1], w.shape[-1]), (w.strides[1], w.strides[-1]), w.dtype, w.device, w.obj)
    if problem.direction == "fwd":
        return x, _transposed(kc), y
    return y, kc, x


def _pixel_rows(v: ArrayView) -> Optional[ArrayView]:
    """[N, spatial..., 1, channels] as [N x pixels, channels] when the leading dims step through memory as one
    run of equally spaced rows; None otherwise."""
    lead = [(n, s) for n, s in zip(v.shape[:-2], v.strides[:-2]) if n > 1]
    row = lead[-1][1] if lead else v.shape[-1] * v.strides[-1]
    step = row
    for n, s in reversed(lead):
        if s != step:
            return None
        step = n * s
    rows = math.prod(v.shape[:-2])
    return ArrayView(v.ptr, (rows, v.shape[-1]), (row, v.strides[-1]), v.dtype, v.device, v.obj)


def _transposed(v: ArrayView) -> ArrayView:
    return ArrayView(v.ptr, v.shape[::-1], v.strides[::-1], v.dtype, v.device, v.obj)


def pixel_rows(v: ArrayView) -> Optional[ArrayView]:
    """A residual [N, spatial..., 1, K] as the GEMM's [N x pixels, K] (None when its pixels are not one run of rows)."""
    return _pixel_rows(v)


def bias_row(v: ArrayView) -> ArrayView:
    """The bias [1, K] (one group) as the GEMM's per-column bias [K]."""
    return ArrayView(v.ptr, (v.shape[1],), (v.strides[1],), v.dtype, v.device, v.obj)
