"""Pointwise dense convolutions run as GEMMs (ops/conv_as_gemm.py): the GEMM's operands are views of the
conv's tensors, the runtime runs them on the bundle's GEMM kernels when it has one that fits, and falls back to
the conv kernels otherwise; results against the float64 reference with the output poisoned first."""
import numpy as np
import pytest

from conftest import build_cpu_bundle
from tiledispatch import validation
from tiledispatch.ops import conv, conv_as_gemm

# fp16 conv kernels of both directions the lowering covers, and fp16 GEMM kernels of its two layouts (no bf16
# GEMM: bf16 pointwise problems must fall back to the conv kernels)
BUNDLE_SET = """\
schema: 1
name: conv_as_gemm_test
description: conv kernels and the GEMM kernels pointwise convolutions lower to
groups:
  - backend: cpu
    op: conv
    direction: [fwd, bwd_data, bwd_weight]
    spatial_dims: [1, 2]
    dtype: [fp16, bf16]
    layout: nhwgc
    pipeline: packed
    tile: [16, 16, 24]
    mma: [4, 16, 1]
  - backend: cpu
    op: gemm
    dtype: fp16
    layout: [rcr, rrr]
    pipeline: packed
    tile: [96, 256, 256]
    mma: [8, 32, 1]
"""


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return build_cpu_bundle(tmp_path_factory.mktemp("conv_as_gemm"), "conv_as_gemm_test", BUNDLE_SET)


def problem(direction, dtype="fp16", n=3, c=24, k=40, size=(5, 7), f=1, stride=1, pad=0, g=1):
    r = len(size)
    return conv.ConvProblem(direction, n, g, c, k, size, (f,) * r, (stride,) * r, (1,) * r, (pad,) * r, (pad,) * r,
                            dtype, dtype, dtype)


def test_views_are_the_pointwise_gemm():
    rng = np.random.default_rng(0)
    p = problem("fwd")
    data, _ = validation.conv_case(p, rng)
    _, ops = conv.operands("fwd", data["x"], data["w"], data["y"])
    a, b, d = conv_as_gemm.operands(p, ops)
    rows = 3 * 5 * 7
    assert (a.shape, a.strides) == ((rows, 24), (24, 1))       # X [N x pixels, C], row-major
    assert (b.shape, b.strides) == ((24, 40), (1, 24))         # W^T [C, K], column-major
    assert (d.shape, d.strides) == ((rows, 40), (40, 1))       # Y [N x pixels, K]
    q = problem("bwd_data")
    data, _ = validation.conv_case(q, rng)
    _, ops = conv.operands("bwd_data", data["x"], data["w"], data["y"])
    a, b, d = conv_as_gemm.operands(q, ops)
    assert (a.shape, b.shape, b.strides, d.shape) == ((rows, 40), (40, 24), (24, 1), (rows, 24))  # dY . W


@pytest.mark.parametrize("p", [problem("bwd_weight"), problem("fwd", f=3, pad=1), problem("fwd", stride=2),
                               problem("fwd", pad=1), problem("fwd", g=4), problem("fwd", dtype="fp32")],
                         ids=["bwd_weight", "3x3", "stride2", "padded", "grouped", "fp32"])
def test_only_pointwise_dense_16bit_problems_lower(p):
    assert not conv_as_gemm.applies(p)
    data, _ = validation.conv_case(p, np.random.default_rng(1))
    _, ops = conv.operands(p.direction, data["x"], data["w"], data["y"], stride=p.stride, pad_lo=p.pad_lo,
                           pad_hi=p.pad_hi, groups=None if data["x"].ndim == p.spatial_dims + 3 else p.g)
    assert conv_as_gemm.operands(p, ops) is None


def test_a_batch_slice_with_a_gap_does_not_lower():
    """Every other image of a batch: the pixels are no longer one run of rows, so no GEMM view exists."""
    p = problem("fwd", n=6)
    data, _ = validation.conv_case(p, np.random.default_rng(2))
    half = problem("fwd", n=3)
    _, ops = conv.operands("fwd", data["x"][::2], data["w"], data["y"][::2])
    assert conv_as_gemm.operands(half, ops) is None


def _spy(registry, monkeypatch) -> list:
    ran, real = [], registry._launch  # every launch of a public call is prepared there
    monkeypatch.setattr(registry, "_launch", lambda prob, *a, **kw: ran.append(prob.op) or real(prob, *a, **kw))
    return ran


@pytest.mark.parametrize("direction", conv_as_gemm.DIRECTIONS)
@pytest.mark.parametrize("rank", [1, 2])
def test_pointwise_runs_on_gemm_kernels(registry, monkeypatch, direction, rank):
    p = problem(direction, size=(11,) if rank == 1 else (5, 7))
    ran = _spy(registry, monkeypatch)
    rng = np.random.default_rng(3)
    written = {"fwd": "y", "bwd_data": "x"}[direction]
    for alpha, beta in ((1.0, 0.0), (0.5, -1.5)):
        data, expect = validation.conv_case(p, rng)  # the written tensor poisoned
        if beta:
            data[written][...] = rng.standard_normal(data[written].shape)
            expect = alpha * expect + beta * data[written].astype(np.float64)
        out = (conv.fwd(registry, data["x"], data["w"], data["y"], alpha=alpha, beta=beta) if direction == "fwd"
               else conv.bwd_data(registry, data["y"], data["w"], data["x"], alpha=alpha, beta=beta))
        result = validation.compare(out, expect, registry.select(_gemm_of(p, data)).key)
        assert result["passed"], result
    assert ran == ["gemm", "gemm"]


def _gemm_of(p, data):
    from tiledispatch.ops import gemm

    _, ops = conv.operands(p.direction, data["x"], data["w"], data["y"])
    a, b, d = conv_as_gemm.operands(p, ops)
    gp, _ = gemm.operands(a, b, d)
    return gp


def test_without_a_fitting_gemm_kernel_the_conv_kernels_run(registry, monkeypatch):
    p = problem("fwd", dtype="bf16")  # pointwise, but the bundle has fp16 GEMM kernels only
    assert conv_as_gemm.applies(p)
    ran = _spy(registry, monkeypatch)
    data, expect = validation.conv_case(p, np.random.default_rng(4))
    out = conv.fwd(registry, data["x"], data["w"], data["y"])
    assert validation.compare(out, expect, registry.select(p).key)["passed"]
    assert ran == ["gemm", "conv"]  # tried as a GEMM (no kernel fits: nothing launched), then as a conv


def test_a_named_conv_kernel_is_never_lowered(registry, monkeypatch):
    p = problem("fwd")
    kern = registry.select(p)
    ran = _spy(registry, monkeypatch)
    data, expect = validation.conv_case(p, np.random.default_rng(5))
    out = conv.fwd(registry, data["x"], data["w"], data["y"], kernel=kern)
    assert validation.compare(out, expect, kern.key)["passed"] and ran == ["conv"]
