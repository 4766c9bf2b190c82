"""tiledispatch.torch on the cpu backend: operators against float64 references, gradients against torch's
autograd, fake-tensor tracing with torch.compile(fullgraph=True), patch() / unpatch() of a small model.

The cpu kernels have no float64 variant, so gradients are not gradchecked: they are compared with torch's
autograd run in float64 on the same data, at the kernels' dtype tolerance. GPU tests (operators on CUDA
tensors, a CUDA-graph captured training step) are marked gpu and need $TD_TORCH_BUNDLE: a cutlass bundle
built for the GPU holding fp16 GEMM and conv kernels (e.g. fp16_rcr_essential + conv_fp16_all_essential).
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import math
import os
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tiledispatch as td  # noqa: E402
import tiledispatch.torch as tdt  # noqa: E402
from tiledispatch import plan  # noqa: E402
from conftest import REPO, build_cpu_bundle  # noqa: E402

TORCH_SET = """\
schema: 1
name: torch_test
description: small cpu kernels for the torch integration tests
groups:
  - backend: cpu
    op: conv
    direction: [fwd, bwd_data, bwd_weight]
    spatial_dims: [1, 2, 3]
    dtype: fp32
    layout: nhwgc
    pipeline: packed
    tile: [16, 16, 24]
    mma: [4, 16, 1]
  - backend: cpu
    op: conv
    direction: [fwd, bwd_data, bwd_weight]
    spatial_dims: 2
    dtype: [fp16, bf16]
    layout: nhwgc
    pipeline: packed
    tile: [16, 16, 24]
    mma: [4, 16, 1]
  - backend: cpu
    op: gemm
    dtype: fp32
    layout: [rcr, rrr, crr]
    pipeline: packed
    tile: [96, 256, 256]
    mma: [8, 32, 1]
  - backend: cpu
    op: gemm
    dtype: fp32
    layout: rcr
    pipeline: packed
    tile: [96, 256, 256]
    mma: [8, 32, 1]
    epilogue:
      - {activation: [relu, gelu_tanh, silu, sigmoid, tanh, clamp, hardswish, hardsigmoid], bias: true}
      - {activation: identity, residuals: 1}
"""
# max ||out - ref|| / ||ref||: the kernels' validation tolerance; gradients pass through two GEMMs or
# convolutions and the activation's derivative, so they get a few times more
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
GRAD_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    # fp16 / bf16 GEMMs: the cpu kernels of the essential sets (rcr only, so their backward passes copy)
    return build_cpu_bundle(tmp_path_factory.mktemp("torch_build"), "torch_test", TORCH_SET, "fp16_rcr_essential",
                            "bf16_rcr_essential")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "the output holds NaN or inf"
    return ((out - ref).norm() / ref.norm()).item()


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return ((torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1) * scale).to(dtype)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def test_import_tiledispatch_does_not_import_torch():
    code = "import sys, tiledispatch; assert 'torch' not in sys.modules, 'torch was imported'"
    env = {**os.environ, "PYTHONPATH": str(REPO / "runtime")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr


# -- GEMM ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64_reference(reg, dtype, bias):
    x = rand(3, 37, 29, dtype=dtype, seed=1)  # leading dims flattened into the GEMM's m
    w = rand(23, 29, dtype=dtype, seed=2)
    b = rand(23, dtype=dtype, seed=3) if bias else None
    out = tdt.linear(x, w, b, registry=reg)
    ref = F.linear(x.double(), w.double(), b.double() if bias else None)
    assert out.shape == (3, 37, 23) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]
    one = tdt.linear(x[0, 0], w, b, registry=reg)  # a single vector, as F.linear takes it
    assert one.shape == (23,) and rel_err(one, ref[0, 0]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_linear_grads_match_torch_autograd(reg, dtype):
    """grad x, grad W and grad bias; fp32 has rcr, rrr and crr kernels (operands used in place), fp16 / bf16
    only rcr (the backward GEMMs copy their operands into it)."""
    x, w, b = rand(41, 30, dtype=dtype, seed=4), rand(19, 30, dtype=dtype, seed=5), rand(19, dtype=dtype, seed=6)
    g = rand(41, 19, dtype=dtype, seed=7)
    xs, ws, bs = leaf(x), leaf(w), leaf(b)
    tdt.linear(xs, ws, bs, registry=reg).backward(g)
    xr, wr, br = leaf(x.double()), leaf(w.double()), leaf(b.double())
    F.linear(xr, wr, br).backward(g.double())
    for mine, ref in ((xs, xr), (ws, wr), (bs, br)):
        assert mine.grad.shape == ref.grad.shape and mine.grad.dtype == dtype
        assert rel_err(mine.grad, ref.grad) < GRAD_TOL[dtype]
    assert ws.grad.stride() == ws.stride()  # the weight's gradient comes out in the weight's layout


TORCH_ACT = {"relu": torch.relu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "silu": F.silu,
             "sigmoid": torch.sigmoid, "tanh": torch.tanh, "clamp": lambda v: v.clamp(-0.3, 0.4),
             "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid}


@pytest.mark.parametrize("activation", list(TORCH_ACT))
def test_fused_activation_forward_and_grads(reg, activation):
    x, w, b = rand(33, 24, seed=8), rand(40, 24, seed=9), rand(40, seed=10, scale=0.5)
    g = rand(33, 40, seed=11)
    clamp = (-0.3, 0.4) if activation == "clamp" else None
    xs, ws, bs = leaf(x), leaf(w), leaf(b)
    out = tdt.linear(xs, ws, bs, registry=reg, activation=activation, clamp=clamp)
    out.backward(g)
    xr, wr, br = leaf(x.double()), leaf(w.double()), leaf(b.double())
    ref = TORCH_ACT[activation](F.linear(xr, wr, br))
    ref.backward(g.double())
    assert rel_err(out, ref) < TOL[torch.float32]
    for mine, theirs in ((xs, xr), (ws, wr), (bs, br)):
        assert rel_err(mine.grad, theirs.grad) < GRAD_TOL[torch.float32], activation


def test_residual_epilogue_and_its_grad(reg):
    x, w, r = rand(17, 24, seed=12), rand(32, 24, seed=13), rand(17, 32, seed=14)
    xs, ws, rs = leaf(x), leaf(w), leaf(r)
    out = tdt.linear(xs, ws, registry=reg, residuals=(rs,))
    out.backward(torch.ones_like(out))
    assert rel_err(out, F.linear(x.double(), w.double()) + r.double()) < TOL[torch.float32]
    assert torch.equal(rs.grad, torch.ones_like(r))
    # a bias with the residual: no kernel fuses both, so both go in through beta * C, still differentiable
    b = leaf(rand(32, seed=15))
    out = tdt.linear(x, w, b, registry=reg, residuals=(r,))
    assert rel_err(out, F.linear(x.double(), w.double(), b.double()) + r.double()) < TOL[torch.float32]


def test_matmul_batched_and_strided_operands(reg):
    a = rand(4, 21, 18, seed=16)
    b_col = rand(4, 25, 18, seed=17).mT  # column-major [4, 18, 25]
    out = tdt.matmul(a, b_col, registry=reg)
    assert rel_err(out, a.double() @ b_col.double()) < TOL[torch.float32]
    a_s, b_s = leaf(a), leaf(b_col.contiguous())
    tdt.matmul(a_s, b_s, registry=reg).sum().backward()
    a_r, b_r = leaf(a.double()), leaf(b_col.double().contiguous())
    (a_r @ b_r).sum().backward()
    assert rel_err(a_s.grad, a_r.grad) < GRAD_TOL[torch.float32]
    assert rel_err(b_s.grad, b_r.grad) < GRAD_TOL[torch.float32]


def test_operands_that_are_not_tensors_are_refused_by_name(reg):
    """Every torch function and patched layer names an operand that is not a torch.Tensor (a numpy array, a list,
    None where a tensor is needed), with grad mode on and off, rather than failing inside on an attribute."""
    x, w, xc, wc = rand(8, 16), rand(4, 16), rand(1, 8, 4, 4), rand(8, 8, 3, 3)
    linear, conv = nn.Linear(16, 4), nn.Conv2d(8, 8, 3)
    tdt.patch(linear, reg)
    tdt.patch(conv, reg)
    calls = [("linear: x is a ndarray", lambda: tdt.linear(x.numpy(), w, registry=reg)),
             ("linear: weight is a NoneType", lambda: tdt.linear(x, None, registry=reg)),
             ("linear: bias is a list", lambda: tdt.linear(x, w, [0.0] * 4, registry=reg)),
             (r"linear: residuals\[0\] is a float", lambda: tdt.linear(x, w, registry=reg, residuals=[1.0])),
             ("matmul: b is a ndarray", lambda: tdt.matmul(x, w.t().numpy(), registry=reg)),
             ("conv: x is a list", lambda: tdt.conv(xc.tolist(), wc, registry=reg)),
             ("conv: weight is a str", lambda: tdt.conv(xc, "w", registry=reg)),
             ("conv: bias is a float", lambda: tdt.conv(xc, wc, 1.0, registry=reg)),
             (r"conv: residuals\[0\] is a int", lambda: tdt.conv(xc, wc, registry=reg, residuals=[1])),
             ("linear: x is a ndarray", lambda: linear(x.numpy())),
             ("conv: x is a ndarray", lambda: conv(xc.numpy()))]
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            for message, call in calls:
                with pytest.raises(td.InvalidInputError, match=message):
                    call()


def test_an_activation_whose_kernels_refuse_the_shape_is_applied_after_a_plain_kernel(reg, monkeypatch):
    """Where every kernel computing the activation refuses a problem (as the cutlass fused set's 16-byte-aligned
    kernels refuse an out_features that is not a multiple of 8) and a plain kernel runs it, the GEMM runs on that
    kernel and torch applies the activation: forward and gradients exact, never a remembered launch that would
    skip the activation; a pointwise conv then stays on its conv kernel."""
    h = tdt.register(reg)
    runs = tdt._gemm_runs
    monkeypatch.setattr(tdt, "_gemm_runs", lambda handle, dtype, layout, epi, shape: (
        (epi.activation == "identity" or shape[2] % 8 == 0) and runs(handle, dtype, layout, epi, shape)))
    monkeypatch.setattr(tdt, "_ROUTES", {})  # routes chosen under the modelled refusals stay in this test
    monkeypatch.setattr(tdt, "_CONV_ROUTES", {})
    reg.clear_caches()
    x, w, b = leaf(rand(6, 16, seed=80)), leaf(rand(13, 16, seed=81)), leaf(rand(13, seed=82))
    route = tdt._choose_route(h, "fp32", "gelu_tanh", True, 0, "r", "c", (1, 6, 13, 16))
    assert route.activation_after and route.epilogue.activation == "identity"
    assert not tdt._choose_route(h, "fp32", "gelu_tanh", True, 0, "r", "c", (1, 6, 16, 16)).activation_after
    exact = [leaf(t.detach().double()) for t in (x, w, b)]
    want = F.gelu(F.linear(*exact), approximate="tanh")
    for _ in range(3):  # the third call: where a launch would be remembered
        out = tdt.linear(x, w, b, registry=h, activation="gelu_tanh")
        assert rel_err(out, want) < TOL[torch.float32]
    out.sum().backward()
    want.sum().backward()
    for got, ref in zip((x, w, b), exact):
        assert rel_err(got.grad, ref.grad) < GRAD_TOL[torch.float32]
    # a pointwise fp16 conv (the GEMM lowering's dtypes), modelled: fp16 GELU GEMM kernels running only 8k output
    # channels, plain ones running every count. 13 channels: its own conv kernel, not the GEMM route
    monkeypatch.setattr(tdt, "_gemm_runs", lambda handle, dtype, layout, epi, shape: (
        epi.activation == "identity" or shape[2] % 8 == 0))
    caps = tdt._CAPS[h]
    claimed = dataclasses.replace(caps, gemm=caps.gemm | {("fp16", "rcr", "gelu_tanh", False, 0)})
    monkeypatch.setattr(tdt, "_CAPS", [*tdt._CAPS[:h], claimed, *tdt._CAPS[h + 1:]])
    x16, w16 = torch.empty(2, 16, 5, 5, dtype=torch.float16), torch.empty(13, 16, 1, 1, dtype=torch.float16)
    geo = tdt._geometry((1, 1), (1, 1), (0, 0), (0, 0), 1)
    assert tdt._conv_route(h, x16, w16, geo, "gelu_tanh", False, 0) == "gemm_padded"  # 13 channels padded to 16
    assert tdt._conv_route(h, x16, w16[:8], geo, "gelu_tanh", False, 0) == "gemm"


def test_a_pointwise_conv_with_unaligned_output_channels_runs_padded_on_a_fused_gemm(reg, monkeypatch):
    """Where the GEMM kernels fusing a pointwise conv's epilogue refuse its output channel count (as the cutlass
    TMA kernels refuse one that is not a multiple of 8: EfficientNet's squeeze-excitation), the conv runs as one
    fused GEMM on its weight and bias zero-padded to 16 channels, its first 13 output channels copied out: forward
    and gradients exact, the padded copies cached while the weight lives unmodified and made anew after an in-place
    change."""
    h = tdt.register(reg)
    runs = tdt._gemm_runs
    monkeypatch.setattr(tdt, "_gemm_runs", lambda handle, dtype, layout, epi, shape: (
        (epi.activation == "identity" or shape[2] % 8 == 0) and runs(handle, dtype, layout, epi, shape)))
    for memo in ("_ROUTES", "_CONV_ROUTES", "_DERIVED"):
        monkeypatch.setattr(tdt, memo, {})
    calls = []
    original = td.Registry.gemm

    def spy(self, a, b, out=None, **kw):
        calls.append((tuple(out.shape), kw.get("activation"), tuple(kw["bias"].shape)))
        return original(self, a, b, out, **kw)

    monkeypatch.setattr(td.Registry, "gemm", spy)
    half = torch.float16
    x = rand(2, 24, 5, 7, dtype=half, seed=90).contiguous(memory_format=torch.channels_last)
    w, b = rand(13, 24, 1, 1, dtype=half, seed=91), rand(13, dtype=half, seed=92)
    xs, ws, bs = leaf(x), leaf(w), leaf(b)
    out = tdt.conv(xs, ws, bs, registry=h, activation="relu")
    assert calls == [((70, 16), "relu", (16,))]
    exact = [leaf(t.detach().double()) for t in (x, w, b)]
    ref = F.relu(F.conv2d(*exact))
    assert out.shape == ref.shape and out.dtype == half and tdt._is_channels_last(out)
    assert rel_err(out, ref) < TOL[half]
    g = rand(*out.shape, dtype=half, seed=93)
    out.backward(g)
    ref.backward(g.double())
    for got, want in zip((xs, ws, bs), exact):
        assert rel_err(got.grad, want.grad) < GRAD_TOL[half]
    # the second call pads nothing anew; an in-place change to the weight is seen
    padded = {key: entry[2] for key, entry in tdt._DERIVED.items()}
    assert len(padded) == 2
    tdt.conv(xs, ws, bs, registry=h, activation="relu")
    assert all(tdt._DERIVED[key][2] is t for key, t in padded.items())
    with torch.no_grad():
        ws.mul_(-1)
    out = tdt.conv(xs, ws, bs, registry=h, activation="relu")
    assert rel_err(out, F.relu(F.conv2d(exact[0], -exact[1], exact[2]))) < TOL[half]


def test_gemm_refusals_are_clear(reg):
    x, w = rand(8, 16), rand(4, 16)
    with pytest.raises(td.UnsupportedProblemError, match="no fp32 GEMM kernel .*gelu_erf"):
        tdt.linear(x, w, registry=reg, activation="gelu_erf")
    with pytest.raises(td.InvalidInputError, match="unknown activation"):
        tdt.linear(x, w, registry=reg, activation="swish")
    with pytest.raises(td.InvalidInputError, match="inner dimensions differ"):
        tdt.matmul(rand(8, 16), rand(15, 4), registry=reg)
    with pytest.raises(td.InvalidInputError, match="no registry has handle"):
        tdt.linear(x, w, registry=1234)
    with pytest.raises(td.UnsupportedProblemError, match="no fp64"):
        tdt.linear(x.double(), w.double(), registry=reg)
    # bias and residual through beta * C (no kernel fuses both): checked as the fused kernels' operands are
    with pytest.raises(td.InvalidInputError, match=r"residual 0 has shape \[1, 4\], expected \[8, 4\]"):
        tdt.linear(x, w, rand(4), registry=reg, residuals=(rand(1, 4),))
    with pytest.raises(td.InvalidInputError, match=r"bias has shape \[5\], expected \[4\]"):
        tdt.linear(x, w, rand(5), registry=reg, residuals=(rand(8, 4),))



def test_an_activation_whose_kernels_all_take_a_bias_runs_after_a_plain_kernel(reg):
    """The bundle computes sigmoid only with a bias: a call without one runs the plain kernel and torch's sigmoid
    (it was refused); fuse() still leaves that activation to PyTorch, since no kernel fuses it there."""
    x, w = leaf(rand(9, 16, seed=3)), leaf(rand(5, 16, seed=4))
    out = tdt.linear(x, w, registry=reg, activation="sigmoid")
    x64, w64 = leaf(x.detach().double()), leaf(w.detach().double())
    ref = torch.sigmoid(F.linear(x64, w64))
    assert rel_err(out, ref) < TOL[torch.float32]
    g = rand(9, 5, seed=5)
    out.backward(g)
    ref.backward(g.double())
    assert rel_err(x.grad, x64.grad) < GRAD_TOL[torch.float32] and rel_err(w.grad, w64.grad) < GRAD_TOL[torch.float32]
    model = nn.Sequential(nn.Linear(16, 5, bias=False), nn.Sigmoid())
    fused, report = tdt.fuse(model, reg)
    assert report.kept == [("1", "the bundle has no fp32 GEMM kernel computing sigmoid: stays PyTorch's")]


def test_empty_problems_run_as_torch_runs_them(reg):
    """A GEMM with M, N, K or the batch 0 and a conv over a batch of none give torch's results (K = 0: the epilogue
    on a zero accumulator), gradients included, with no kernel; their other operands are checked as for any call."""
    b, r = rand(5, seed=1), rand(3, 5, seed=2)
    cases = [  # (ours, torch's)
        (lambda: tdt.linear(rand(3, 0), rand(5, 0), b, registry=reg), lambda: b.expand(3, 5)),
        (lambda: tdt.linear(rand(3, 0), rand(5, 0), b, residuals=(r,), activation="relu", registry=reg),
         lambda: torch.relu(b + r)),
        (lambda: tdt.linear(rand(3, 0), rand(5, 0), registry=reg, activation="sigmoid"), lambda: torch.full((3, 5), .5)),
        (lambda: tdt.linear(rand(2, 0, 8), rand(5, 8), b, registry=reg), lambda: torch.empty(2, 0, 5)),
        (lambda: tdt.linear(rand(2, 3, 0), rand(5, 0), b, registry=reg), lambda: b.expand(2, 3, 5)),  # rows of no K
        (lambda: tdt.linear(rand(2, 0, 4), rand(0, 4), registry=reg), lambda: torch.empty(2, 0, 0)),
        (lambda: tdt.linear(rand(3, 8), rand(0, 8), registry=reg), lambda: torch.empty(3, 0)),
        (lambda: tdt.matmul(rand(0, 3, 4), rand(0, 4, 5), registry=reg), lambda: torch.empty(0, 3, 5)),
        (lambda: tdt.conv(rand(0, 4, 5, 5), rand(6, 4, 3, 3), b.new_ones(6), padding=1, activation="relu",
                          registry=reg), lambda: torch.empty(0, 6, 5, 5)),
        (lambda: tdt.conv(rand(0, 3, 32, 32), rand(8, 3, 7, 7), stride=2, padding=3, registry=reg),  # a stem
         lambda: torch.empty(0, 8, 16, 16)),
    ]
    for ours, theirs in cases:
        out, ref = ours(), theirs()
        assert out.shape == ref.shape and out.dtype == ref.dtype and torch.equal(out, ref)
    # gradients: empty for the empty operand, zeros for the weight (a sum over no rows or images), as torch's
    for x, w, call, torch_call in (
            (rand(0, 8), rand(5, 8), lambda x, w, b: tdt.linear(x, w, b, registry=reg, activation="gelu_tanh"),
             lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh")),
            (rand(3, 0), rand(5, 0), lambda x, w, b: tdt.linear(x, w, b, registry=reg, activation="silu"),
             lambda x, w, b: F.silu(F.linear(x, w, b))),
            (rand(0, 4, 9, 9), rand(6, 2, 3, 3), lambda x, w, b: tdt.conv(x, w, b, stride=2, groups=2, registry=reg),
             lambda x, w, b: F.conv2d(x, w, b, stride=2, groups=2)),
            (rand(0, 3, 16, 16), rand(8, 3, 7, 7), lambda x, w, b: tdt.conv(x, w, b, stride=2, padding=3,
                                                                            activation="relu", registry=reg),
             lambda x, w, b: torch.relu(F.conv2d(x, w, b, stride=2, padding=3)))):
        bias = rand(w.shape[0], seed=6)
        ours, theirs = [leaf(t) for t in (x, w, bias)], [leaf(t.double()) for t in (x, w, bias)]
        out, ref = call(*ours), torch_call(*theirs)
        assert out.shape == ref.shape
        g = rand(*out.shape, seed=7)
        out.backward(g)
        ref.backward(g.double())
        for mine, torch_grad in zip(ours, theirs):
            assert mine.grad.shape == torch_grad.grad.shape and torch.allclose(mine.grad.double(), torch_grad.grad)
    refusals = [
        (lambda: tdt.linear(rand(0, 8), rand(5, 8), rand(4), registry=reg), r"bias has shape \[4\], expected \[5\]"),
        (lambda: tdt.linear(rand(0, 8), rand(5, 8), residuals=(rand(1, 5),), registry=reg),
         r"residual 0 has shape \[1, 5\], expected \[0, 5\]"),
        (lambda: tdt.linear(rand(0, 8), rand(5, 7), registry=reg), "do not multiply"),
        (lambda: tdt.linear(rand(3, 0), rand(5, 0), registry=reg, activation="gelu_erf"), "no fp32 GEMM kernel"),
        (lambda: tdt.conv(rand(0, 5, 5, 5), rand(6, 4, 3, 3), registry=reg), "x has 5 channels"),
        (lambda: tdt.conv(rand(0, 4, 5, 5), rand(6, 4, 3, 3), rand(3), registry=reg), r"bias has shape \[3\]"),
        (lambda: tdt.conv(rand(0, 4, 2, 2), rand(6, 4, 3, 3), registry=reg), "smaller than the dilated filter"),
        (lambda: tdt.conv(rand(0, 4, 5, 5), rand(6, 4, 3, 3), groups=3, registry=reg), "groups"),
        (lambda: tdt.conv(rand(2, 0, 5, 5), rand(6, 0, 3, 3), registry=reg), "C must be an integer >= 1"),
    ]
    for call, message in refusals:
        with pytest.raises(td.InvalidInputError if "GEMM kernel" not in message else td.UnsupportedProblemError,
                           match=message):
            call()
    for direction, call in (("bwd_data", lambda: tdt._conv_bwd_data(rand(0, 6, 4, 4), rand(6, 4, 3, 3), (5, 5), (1, 1),
                                                                     (1, 1), (0, 0), (0, 0), 1, tdt.register(reg))),
                            ("bwd_weight", lambda: tdt._conv_bwd_weight(rand(0, 4, 5, 5), rand(0, 6, 4, 4), (3, 3),
                                                                        (1, 1), (1, 1), (0, 0), (0, 0), 1,
                                                                        tdt.register(reg)))):
        with pytest.raises(td.InvalidInputError, match=rf"conv {direction}: dy has shape \[0, 6, 4, 4\], expected "
                                                       r"\[0, 6, 3, 3\]"):
            call()


# -- convolution ---------------------------------------------------------------------------------------------
# (rank, N, C, K, groups, in size, filter, stride, dilation, pad_lo, pad_hi)
CONVS = {
    "1d_dense": (1, 2, 6, 10, 1, (23,), (3,), 2, 1, (1,), (2,)),
    "2d_grouped": (2, 2, 12, 9, 3, (9, 8), (3, 2), (2, 1), (1, 2), (1, 0), (0, 1)),
    "2d_depthwise": (2, 3, 8, 8, 8, (7, 7), (3, 3), 1, 1, (1, 1), (1, 1)),
    "2d_pointwise": (2, 2, 16, 24, 1, (5, 6), (1, 1), 1, 1, (0, 0), (0, 0)),
    "3d_dense": (3, 1, 4, 6, 1, (5, 6, 4), (3, 2, 3), 1, (1, 1, 2), (1, 0, 2), (1, 1, 0)),
}


def conv_case(name, dtype=torch.float32, channels_last=False):
    rank, n, c, k, g, size, filt, stride, dil, lo, hi = CONVS[name]
    x = rand(n, c, *size, dtype=dtype, seed=20)
    w = rand(k, c // g, *filt, dtype=dtype, seed=21)
    b = rand(k, dtype=dtype, seed=22)
    if channels_last:
        x, w = tdt._channels_last(x), tdt._channels_last(w)
    return x, w, b, dict(stride=stride, dilation=dil, groups=g), (lo, hi)


def torch_conv(x, w, b, geo, pads):
    """torch's convNd with asymmetric padding (F.pad takes the last dim first)."""
    lo, hi = pads
    pad = [p for d in reversed(range(len(lo))) for p in (lo[d], hi[d])]
    fn = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[x.dim()]
    return fn(F.pad(x, pad), w, b, **geo)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("name", list(CONVS))
def test_conv_forward_and_grads_match_torch(reg, name, channels_last):
    x, w, b, geo, (lo, hi) = conv_case(name, channels_last=channels_last)
    xs, ws, bs = leaf(x), leaf(w), leaf(b)
    out = tdt.conv(xs, ws, bs, registry=reg, pad_lo=lo, pad_hi=hi, **geo)
    xr, wr, br = leaf(x.double()), leaf(w.double()), leaf(b.double())
    ref = torch_conv(xr, wr, br, geo, (lo, hi))
    assert out.shape == ref.shape and tdt._is_channels_last(out)
    assert rel_err(out, ref) < TOL[torch.float32]
    g = rand(*out.shape, seed=23)
    out.backward(g)
    ref.backward(g.double())
    for mine, theirs in ((xs, xr), (ws, wr), (bs, br)):
        assert rel_err(mine.grad, theirs.grad) < GRAD_TOL[torch.float32], name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_conv_half_precision(reg, dtype):
    x, w, b, geo, (lo, hi) = conv_case("2d_grouped", dtype)
    xs, ws, bs = leaf(x), leaf(w), leaf(b)
    out = tdt.conv(xs, ws, bs, registry=reg, pad_lo=lo, pad_hi=hi, **geo)
    xr, wr, br = leaf(x.double()), leaf(w.double()), leaf(b.double())
    ref = torch_conv(xr, wr, br, geo, (lo, hi))
    assert out.dtype == dtype and rel_err(out, ref) < TOL[dtype]
    g = rand(*out.shape, dtype=dtype, seed=24)
    out.backward(g)
    ref.backward(g.double())
    for mine, theirs in ((xs, xr), (ws, wr), (bs, br)):
        assert rel_err(mine.grad, theirs.grad) < GRAD_TOL[dtype]


def test_channels_last_tensors_are_used_in_place(reg, monkeypatch):
    """A channels-last input and weight reach the registry as the very same memory; an NCHW one is copied."""
    from tiledispatch.ops import conv as conv_op

    seen = []
    original = conv_op.run  # what reg.conv_fwd runs, and tiledispatch.torch directly

    def spy(registry, direction, x, w, *rest, **kw):
        seen.append((x.data_ptr(), w.data_ptr()))
        return original(registry, direction, x, w, *rest, **kw)

    monkeypatch.setattr(conv_op, "run", spy)
    x, w, b, geo, _ = conv_case("2d_grouped", channels_last=True)
    tdt.conv(x, w, registry=reg, padding=1, **geo)
    assert seen[-1] == (x.data_ptr(), w.data_ptr())
    x_nchw = x.contiguous()
    tdt.conv(x_nchw, w, registry=reg, padding=1, **geo)
    assert seen[-1][0] != x_nchw.data_ptr() and seen[-1][1] == w.data_ptr()


def test_conv_refusals_are_clear(reg):
    x, w, b, geo, _ = conv_case("2d_grouped")
    with pytest.raises(td.InvalidInputError, match="dtype"):
        tdt.conv(x, w.half(), registry=reg, **geo)
    with pytest.raises(td.UnsupportedProblemError):  # fp16 3D: the test bundle has 2D fp16 convolutions only
        tdt.conv(rand(1, 4, 5, 5, 5, dtype=torch.float16), rand(4, 4, 3, 3, 3, dtype=torch.float16), registry=reg)
    with pytest.raises(td.InvalidInputError, match="bias has shape"):
        tdt.conv(x, w, b[:-1], registry=reg, **geo)
    for bad, message in (({"stride": 0}, "stride must be >= 1"), ({"stride": (1, 0)}, "stride must be >= 1"),
                         ({"dilation": 0}, "dilation must be >= 1"), ({"padding": -1}, "pad_lo must be >= 0"),
                         ({"padding": 2**31}, "pad_lo must be <= 2147483647"),
                         ({"padding": 10**9}, r"conv y would have 2 x 9 x 1000000004 x 2000000006 elements"),
                         ({"dilation": 5}, "padded input 9 \\+ 0 \\+ 0 is smaller than the dilated filter 11")):
        # the output is allocated before the registry checks the problem: refused as it refuses it, with no tensor
        # of a negative or overflowing size asked of torch, on the no-grad and the autograd path
        for operand in (x, x.detach().requires_grad_()):
            with pytest.raises(td.InvalidInputError, match=message):
                tdt.conv(operand, w, registry=reg, **{**geo, **bad})
    # the operator's fake implementation (what torch.compile traces) computes the shape with the same check
    with pytest.raises(td.InvalidInputError, match="smaller than the dilated filter 11"):
        tdt._conv_fwd_shape(x, w, geo["stride"], (5, 5), (0, 0), (0, 0))


# -- fake tensors and torch.compile ------------------------------------------------------------------------
def test_fake_implementations_match_the_real_outputs(reg):
    from torch._subclasses.fake_tensor import FakeTensorMode

    h = tdt.register(reg)
    x, w, b, geo, (lo, hi) = conv_case("2d_grouped")
    s, d, gr = list(geo["stride"]), list(geo["dilation"]), geo["groups"]
    y = torch.ops.tiledispatch.conv_fwd(x, w, b, [], "identity", float("-inf"), float("inf"), s, d, list(lo),
                                        list(hi), gr, h)
    dx = torch.ops.tiledispatch.conv_bwd_data(y, w, list(x.shape[2:]), s, d, list(lo), list(hi), gr, h)
    dw = torch.ops.tiledispatch.conv_bwd_weight(x, y, list(w.shape[2:]), s, d, list(lo), list(hi), gr, h)
    a, bb = rand(5, 7), rand(3, 7, 4)[0]
    mm = torch.ops.tiledispatch.gemm(a, bb, None, [], "identity", float("-inf"), float("inf"), h)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx, fw, fb, fy, fa, fbb = (mode.from_tensor(t) for t in (x, w, b, y, a, bb))
        fakes = [torch.ops.tiledispatch.conv_fwd(fx, fw, fb, [], "identity", float("-inf"), float("inf"), s, d,
                                                 list(lo), list(hi), gr, h),
                 torch.ops.tiledispatch.conv_bwd_data(fy, fw, list(x.shape[2:]), s, d, list(lo), list(hi), gr, h),
                 torch.ops.tiledispatch.conv_bwd_weight(fx, fy, list(w.shape[2:]), s, d, list(lo), list(hi), gr, h),
                 torch.ops.tiledispatch.gemm(fa, fbb, None, [], "identity", float("-inf"), float("inf"), h)]
    for real, fake in zip((y, dx, dw, mm), fakes):
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


def _profiled(fn) -> tuple[list, list]:
    """The Python functions (file:name) a call enters and the torch tensor methods and functions (torch.empty...) it
    calls, via sys.setprofile: exact and deterministic, unlike a wall clock."""
    frames, methods = [], []

    def profile(frame, event, arg):
        if event == "call":
            frames.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")
        elif event == "c_call" and getattr(arg, "__qualname__", "").startswith(("Tensor.", "TensorBase.",
                                                                               "Parameter.", "_VariableFunctions")):
            methods.append(arg.__qualname__.split(".", 1)[1])

    gc.collect()  # a collection inside the call would run finalizers there: frames of other objects, not the call's
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return frames, methods


@pytest.mark.parametrize("reader", ["native", "python"])
def test_eager_inference_calls_skip_the_dispatcher_and_allocate_once(reg, reader, monkeypatch):
    """Host cost guards of the eager inference path, counted rather than timed: tdt.linear / tdt.conv and patched
    nn.Linear / nn.Conv2d layers (no grad needed, channels-last conv tensors, no bias) call the operator's
    implementation directly (not through torch.ops), allocate the output with one call, fingerprint each tensor
    once, and run a bounded number of Python functions (a repeated call launches the remembered kernel: the eager
    fast path); fake and meta tensors still go through the registered operators (their fake implementations)."""
    native = td.native.torch_fastpath() if reader == "native" else None
    assert native is not None or reader == "python", "the native module was not built: see its .failed file"
    monkeypatch.setattr(tdt, "_NATIVE_PRINTS", native and native.eager_prints)
    monkeypatch.setattr(tdt, "_NATIVE_LAUNCHER", native and native.launcher)
    monkeypatch.setattr(tdt, "_NATIVE_LAUNCH", native and native.launch)
    plan.fingerprint(torch.zeros(1))  # the type met (its printers registered), so that the patch is undone to them
    monkeypatch.setitem(plan._TRIPLE_PRINTERS, torch.Tensor, native.prints if native else plan._torch_prints3)
    h = tdt.register(reg)
    x, w = rand(8, 16, seed=40), rand(24, 16, seed=41)
    xc = rand(2, 8, 6, 6, seed=42).contiguous(memory_format=torch.channels_last)
    wc = rand(8, 8, 3, 3, seed=43).contiguous(memory_format=torch.channels_last)
    linear = nn.Linear(16, 24, bias=False).requires_grad_(False)
    conv = nn.Conv2d(8, 8, 3, padding=1, bias=False).requires_grad_(False)
    linear.weight.copy_(w)
    conv.weight = nn.Parameter(wc, requires_grad=False)
    tdt.patch(linear, reg)
    tdt.patch(conv, reg)
    want_linear, want_conv = F.linear(x, w), F.conv2d(xc, wc, padding=1)
    # the most Python functions each path enters, the lambda and nn.Module's own __call__ frames included, and the
    # overlap check that runs when the new output's pointer differs from the last one's
    calls = {"tdt.linear": (lambda: tdt.linear(x, w, registry=h), want_linear, 18),
             "tdt.conv": (lambda: tdt.conv(xc, wc, registry=h, padding=1), want_conv, 23),
             "patched nn.Linear": (lambda: linear(x), want_linear, 21),
             "patched nn.Conv2d": (lambda: conv(xc), want_conv, 24)}
    with torch.no_grad():
        for name, (call, want, most_frames) in calls.items():
            call()
            frames, methods = _profiled(call)
            assert rel_err(call(), want) < TOL[torch.float32], name
            assert not any("torch/_ops.py" in f for f in frames), (name, "went through torch.ops", frames)
            assert len(frames) <= most_frames, (name, len(frames), frames)
            # one output allocated and x, w, out fingerprinted once each, by torch's Python methods or (native)
            # in C++, where none of them is seen here
            allocations = [m for m in methods if m.startswith(("new_empty", "empty"))]
            assert len(allocations) == (0 if native else 1), (name, methods)
            assert methods.count("data_ptr") == (0 if native else 3), (name, methods)
            assert not {"movedim", "permute", "contiguous", "expand", "copy_", "clone"} & set(methods), (name, methods)

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode() as mode:
        fake = tdt.conv(mode.from_tensor(xc), mode.from_tensor(wc), registry=h, padding=1)
        assert isinstance(fake, FakeTensor) and fake.shape == want_conv.shape and fake.stride() == want_conv.stride()
    meta = tdt.linear(x.to("meta"), w.to("meta"), registry=h)
    assert meta.is_meta and meta.shape == want_linear.shape
    with torch.profiler.profile() as prof:  # a profile names the operators: they are dispatched while it runs
        tdt.conv(xc, wc, registry=h, padding=1)
    assert "tiledispatch::conv_fwd" in {e.name for e in prof.events()}


def test_a_native_launch_leaves_the_plans_own_launches_writing_their_own_pointers(reg):
    """The native launch of a remembered call writes the new output's pointer into the td_args of a Plan that
    registry calls launch too: the plan's next launch on its earlier pointers must write them back, not launch
    on the eager call's output."""
    h = tdt.register(reg)
    xc = rand(2, 8, 6, 6, seed=46).contiguous(memory_format=torch.channels_last)
    wc = rand(8, 8, 3, 3, seed=47).contiguous(memory_format=torch.channels_last)
    want = F.conv2d(xc, wc, padding=1)
    launches = tdt._registry_for(h, xc)._launches
    launches.clear()
    with torch.no_grad():
        first = tdt.conv(xc, wc, registry=h, padding=1)  # the full path, remembered
        [entry] = [e for e in launches.values() if isinstance(e, tdt._FastCall)]
        assert entry.record is not None, "the native launch record was not made: see the native module's warning"
        own_plan = entry.launcher.plan
        own_pointers = own_plan._ptrs
        second = tdt.conv(xc, wc, registry=h, padding=1)  # launched natively, on a new output
        assert second.data_ptr() != first.data_ptr() and rel_err(second, want) < TOL[torch.float32]
        assert (second.shape, second.stride(), second.dtype, second.device, second.requires_grad) == (
            first.shape, first.stride(), first.dtype, first.device, False)
        first.fill_(float("nan"))
        own_plan.launch_pointers(own_pointers)
        assert rel_err(first, want) < TOL[torch.float32]


def test_a_torch_without_the_mode_checks_always_dispatches_through_the_operators(reg, monkeypatch):
    """Where this torch lacks one of the functions the direct eager path asks whether anything must see the
    operator (tdt._CAN_CALL_DIRECTLY false), every call goes through torch.ops and still computes the result."""
    h = tdt.register(reg)
    x, w = rand(8, 16, seed=44), rand(24, 16, seed=45)
    monkeypatch.setattr(tdt, "_CAN_CALL_DIRECTLY", False)
    assert not tdt._eager(x, w)
    with torch.no_grad():
        frames, _ = _profiled(lambda: tdt.linear(x, w, registry=h))
        assert any("torch/_ops.py" in f for f in frames), frames
        assert rel_err(tdt.linear(x, w, registry=h), F.linear(x, w)) < TOL[torch.float32]


class SmallNet(nn.Module):
    """A CNN + MLP: dense, grouped, depthwise and pointwise 2D convolutions, a 1D convolution, Linear layers."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=4, bias=False), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding="same", groups=16), nn.ReLU(),
            nn.Conv2d(16, 8, 1))
        self.temporal = nn.Conv1d(8, 8, 3, padding=1, padding_mode="reflect")
        self.head = nn.Sequential(nn.Linear(8 * 16, 32), nn.GELU(), nn.Linear(32, 10))

    def forward(self, x):
        f = self.features(x)                         # [N, 8, 4, 4]
        t = self.temporal(f.flatten(2))              # [N, 8, 16]
        return self.head(t.flatten(1))


def _routed_calls(monkeypatch, reg) -> list:
    """Names of the registry entry points the calls reach: gemm, conv_fwd, conv_bwd_data, conv_bwd_weight (the
    convolutions by the op module's run(), which Registry.conv_* and tiledispatch.torch both enter)."""
    from tiledispatch.ops import conv as conv_op

    calls = []
    original_gemm, original_run = type(reg).gemm, conv_op.run

    def gemm_spy(self, *args, **kw):
        calls.append("gemm")
        return original_gemm(self, *args, **kw)

    def run_spy(registry, direction, *args, **kw):
        calls.append(f"conv_{direction}")
        return original_run(registry, direction, *args, **kw)

    monkeypatch.setattr(type(reg), "gemm", gemm_spy)
    monkeypatch.setattr(conv_op, "run", run_spy)
    return calls


@pytest.mark.parametrize("spatial,filt,stride,dil,lo,hi,groups", [
    ((23,), (3,), (2,), (1,), (1,), (2,), 1), ((10,), (5,), (3,), (2,), (2,), (0,), 1),
    ((9, 8), (3, 3), (2, 1), (1, 2), (1, 0), (0, 1), 2), ((11, 12), (4, 3), (3, 2), (2, 1), (3, 1), (2, 2), 3),
    ((14, 14), (1, 1), (2, 2), (1, 1), (0, 0), (0, 0), 2), ((14, 13), (3, 3), (2, 2), (3, 3), (2, 2), (2, 2), 1),
    ((5, 6, 7), (3, 2, 3), (2, 2, 1), (1, 2, 1), (1, 0, 2), (0, 1, 1), 1),
    ((6, 7, 8), (1, 3, 3), (2, 2, 2), (1, 1, 1), (0, 1, 1), (0, 1, 1), 1),
    # phases that stack: a zero tap in some phase's filter, none, a stride of 3, groups, 1-3D
    ((8, 8), (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 1), ((8, 6), (2, 2), (2, 2), (1, 1), (0, 0), (0, 0), 2),
    ((12,), (4,), (2,), (1,), (1,), (1,), 3), ((9,), (3,), (3,), (1,), (1,), (1,), 1),
    ((10, 12), (5, 5), (2, 2), (1, 1), (2, 2), (2, 2), 1), ((4, 6, 4), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1),
                                                            (1, 1, 1), 2)])
@pytest.mark.parametrize("route", ["phases", "stacked"])
def test_strided_bwd_data_by_phase_matches_autograd(reg, monkeypatch, spatial, filt, stride, dil, lo, hi, groups,
                                                    route):
    """The "phases" route of a strided conv's input gradient (one unit-stride bwd_data per stride phase: phases no
    tap reaches, rows no dy row reaches, dilations that skip taps, groups, 1-3D) and the "stacked" one (every
    phase in one unit-stride bwd_data where they stack, else the same) against torch's autograd in float64; the
    plan that ran is the one the route asks for."""
    monkeypatch.setattr(tdt, "_STRIDED_BWD_DATA", route)
    ran = []
    by_phase = tdt._bwd_data_by_phase
    monkeypatch.setattr(tdt, "_bwd_data_by_phase", lambda *a: ran.append(by_phase(*a)) or ran[-1])
    rank = len(spatial)
    out = [(i + a + b - d * (f - 1) - 1) // s + 1 for i, f, s, d, a, b in zip(spatial, filt, stride, dil, lo, hi)]
    x = rand(2, 6, *spatial, dtype=torch.float64, seed=60)
    w = rand(6, 6 // groups, *filt, dtype=torch.float64, seed=61)
    dy = rand(2, 6, *out, dtype=torch.float64, seed=62)
    geo = tdt._geometry(stride, dil, lo, hi, groups)
    geo.phase_plans.clear()  # the geometry is memoized: an earlier test may have run it on other shapes
    got = [tdt._conv_bwd_data_run(dy.float(), w.float(), list(spatial), geo, tdt.register(reg)) for _ in range(2)]
    xx = leaf(x)
    pad = [v for a, b in reversed(list(zip(lo, hi))) for v in (a, b)]
    conv_nd = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[rank]
    conv_nd(F.pad(xx, pad), w, stride=stride, dilation=dil, groups=groups).backward(dy)
    assert ran == [True, True] and len(geo.phase_plans) == 1  # the second call ran the phases made by the first
    # they stack where every dim's size is a multiple of its stride and each of its phases receives a tap (these
    # cases meet the plan's other conditions where they meet these)
    stacks = all(n % s == 0 and all(any((p + a - r * d) % s == 0 for r in range(f)) for p in range(s))
                 for n, f, s, d, a in zip(spatial, filt, stride, dil, lo))
    assert isinstance(*geo.phase_plans.values(), tdt._Stacked) == (route == "stacked" and stacks)
    plan, = geo.phase_plans.values()
    if isinstance(plan, tdt._Stacked) and filt == (3, 3) and stride == (2, 2):  # 4 phases in 2x2 taps: 16, not 9
        assert plan.stacked_weight[0][2:] == (2, 2) and len(plan.taps) == 16 and plan.zero == 9
    for dx in got:
        assert rel_err(dx, xx.grad) < TOL[torch.float32]


@pytest.mark.parametrize("groups,per_group,route", [(1, 4, "phases"), (2, 2, "phases"), (4, 1, "kernel")])
def test_auto_strided_bwd_data_route_runs_phases_unless_depthwise(reg, monkeypatch, groups, per_group, route):
    """"auto" (the default): by phase where a group has more than one input channel, the strided kernels where it
    has one (measured slower by phase on the GPU)."""
    monkeypatch.setattr(tdt, "_STRIDED_BWD_DATA", "auto")
    ran = []
    by_phase = tdt._bwd_data_by_phase
    monkeypatch.setattr(tdt, "_bwd_data_by_phase", lambda *a: ran.append(by_phase(*a)) or ran[-1])
    x = rand(2, 4, 9, 9, dtype=torch.float64, seed=63)
    w = rand(4, per_group, 3, 3, dtype=torch.float64, seed=64)
    dy = rand(2, 4, 5, 5, dtype=torch.float64, seed=65)
    got = tdt._conv_bwd_data_run(dy.float(), w.float(), [9, 9], tdt._geometry((2, 2), (1, 1), (1, 1), (1, 1), groups),
                                 tdt.register(reg))
    xx = leaf(x)
    F.conv2d(xx, w, stride=2, padding=1, groups=groups).backward(dy)
    assert ran == ([True] if route == "phases" else [])
    assert rel_err(got, xx.grad) < TOL[torch.float32]


def test_strided_bwd_data_route_is_checked():
    with pytest.raises(td.InvalidInputError, match="one of auto, kernel, phases"):
        tdt.set_strided_bwd_data("fast")
    env = {**os.environ, "PYTHONPATH": str(REPO / "runtime"), "TD_STRIDED_BWD_DATA": "fast"}
    proc = subprocess.run([sys.executable, "-c", "import tiledispatch.torch"], capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "strided bwd_data route 'fast'" in proc.stderr


@pytest.mark.parametrize("activation", ["identity", "relu"])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_small_channel_convs_run_zero_padded_where_the_as_is_kernel_is_a_fallback(reg, monkeypatch, rank, activation):
    """A dense conv with C = 3 runs with X and W zero-padded to whole vectors (fp32: 4 channels) where the cost
    model rates the padded problem's kernel cheaper: the output, grad X and grad W (bwd_weight on the padded X, its
    first C channels) match torch's autograd in float64. On the cpu kernels padding never pays: the test says
    which costs what."""
    monkeypatch.setattr(tdt, "_selected_cost", lambda registry, problem: 1.0 if problem.c % 4 == 0 else 8.0)
    tdt._PAD_ROUTES.clear()
    reg.clear_caches()  # no launch remembered by an earlier test: every kernel call below goes through conv_op.run
    from tiledispatch.ops import conv as conv_op

    seen, run = [], conv_op.run  # (direction, X's channels, W's channels) of every conv kernel call

    def run_spy(registry, direction, x, w, *args):
        seen.append((direction, x.shape[1], w.shape[1]))
        return run(registry, direction, x, w, *args)
    monkeypatch.setattr(conv_op, "run", run_spy)
    size = (9, 8, 7)[:rank]
    x, w, b = rand(2, 3, *size, seed=66), rand(5, 3, *(3,) * rank, seed=67), rand(5, seed=68)
    xs, ws, bs = leaf(x), leaf(w), leaf(b)
    out = tdt.conv(xs, ws, bs, registry=reg, stride=2, padding=1, activation=activation)
    xr, wr, br = leaf(x.double()), leaf(w.double()), leaf(b.double())
    conv_nd = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[rank]
    ref = conv_nd(xr, wr, br, stride=2, padding=1)
    ref = ref.relu() if activation == "relu" else ref
    assert out.shape == ref.shape and rel_err(out, ref) < TOL[torch.float32]
    g = rand(*out.shape, seed=69)
    out.backward(g)
    ref.backward(g.double())
    for mine, theirs in ((xs, xr), (ws, wr), (bs, br)):
        assert mine.grad.shape == theirs.grad.shape and rel_err(mine.grad, theirs.grad) < GRAD_TOL[torch.float32]
    # fwd: X [N, 4, ...] and W [K, 4, ...]; bwd_data (grad X, C = 3 out) as it is; bwd_weight: X padded, dW [K, 4]
    assert ("fwd", 4, 4) in seen and ("bwd_weight", 4, 4) in seen and ("bwd_data", 3, 3) in seen
    assert not any(c == 3 for d, c, _ in seen if d != "bwd_data")
    # a second step on new tensors: every launch, those on the padded copies included, was remembered
    seen.clear()
    xs, ws, bs = leaf(x + 1), leaf(w), leaf(b)
    out = tdt.conv(xs, ws, bs, registry=reg, stride=2, padding=1, activation=activation)
    xr, wr, br = leaf(x.double() + 1), leaf(w.double()), leaf(b.double())
    ref = conv_nd(xr, wr, br, stride=2, padding=1)
    ref = ref.relu() if activation == "relu" else ref
    out.backward(g)
    ref.backward(g.double())
    # (this bundle fuses no conv bias: the forward adds it through beta * Y, a call never remembered)
    assert seen == [("fwd", 4, 4)] and rel_err(out, ref) < TOL[torch.float32]
    for mine, theirs in ((xs, xr), (ws, wr), (bs, br)):
        assert rel_err(mine.grad, theirs.grad) < GRAD_TOL[torch.float32]
    for step in range(2):  # without a bias, the forward's launch on the padded copies is remembered too
        seen.clear()
        xs = leaf(x - step)
        out = tdt.conv(xs, ws, registry=reg, stride=2, padding=1)
        out.backward(g)
        assert seen == ([("fwd", 4, 4)] if step == 0 else [])
        assert rel_err(out, conv_nd(x.double() - step, w.double(), stride=2, padding=1)) < TOL[torch.float32]


@pytest.mark.parametrize("size, filt, stride, pad, channels, bias", [
    ((12, 11), (7, 7), (2, 2), (3, 3), 3, False),        # an RGB stem, odd width
    ((9, 8), (3, 3), (2, 2), (1, 1), 3, True),           # a MobileNet-like stem, with bias and relu
    ((10, 13), (4, 4), (4, 4), (0, 0), 3, False),        # a ConvNeXt stem (1x1 taps, pointwise); rows left over
    ((8, 12), (4, 4), (4, 4), (0, 0), 3, False),         # blocks tiling the input exactly (no padding copy)
    ((40,), (10,), (5,), (0,), 1, False),                # a raw-audio front end
    ((4, 9, 10), (3, 7, 7), (1, 2, 2), (1, 3, 3), 3, False),  # a video stem
])
def test_few_channel_strided_convs_run_on_a_space_to_depth_copy(reg, monkeypatch, size, filt, stride, pad, channels,
                                                                 bias):
    """With the space-to-depth route on, a strided dense conv with fewer channels than a vector runs as a
    unit-stride conv on the blocks of its padded input: the forward (eager and under no_grad) and dW on the copy,
    dW mapped back; output and every gradient against torch's autograd in float64, and a second step's launches all
    remembered (a bias: its forward adds it through beta * Y on this bundle, never remembered)."""
    monkeypatch.setattr(tdt, "_SPACE_TO_DEPTH", "on")
    tdt._S2D_ROUTES.clear()
    reg.clear_caches()
    from tiledispatch.ops import conv as conv_op

    seen, run = [], conv_op.run  # (direction, X's channels, stride) of every conv kernel call

    def run_spy(registry, direction, x, w, y, out, options, *args):
        seen.append((direction, (x if direction != "bwd_data" else out).shape[1], tuple(options["stride"])))
        return run(registry, direction, x, w, y, out, options, *args)
    monkeypatch.setattr(conv_op, "run", run_spy)
    rank = len(size)
    conv_nd = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[rank]
    padded = next(c for c in itertools.count(channels) if c * math.prod(stride) % 4 == 0)  # fp32: 4-channel vectors
    mapped = padded * math.prod(stride)
    activation = "relu" if bias else "identity"
    for step in range(2):
        x, w = rand(2, channels, *size, seed=150 + step), rand(6, channels, *filt, seed=152)
        b = rand(6, seed=153) if bias else None
        xs, ws = leaf(x), leaf(w)
        bs = leaf(b) if bias else None
        seen.clear()
        out = tdt.conv(xs, ws, bs, registry=reg, stride=stride, padding=pad, activation=activation)
        xr, wr = leaf(x.double()), leaf(w.double())
        br = leaf(b.double()) if bias else None
        ref = conv_nd(xr, wr, br, stride=stride, padding=pad)
        ref = ref.relu() if bias else ref
        assert out.shape == ref.shape and rel_err(out, ref) < TOL[torch.float32]
        g = rand(*out.shape, seed=154)
        out.backward(g)
        ref.backward(g.double())
        for mine, theirs in ((xs, xr), (ws, wr)) + (((bs, br),) if bias else ()):
            assert mine.grad.shape == theirs.grad.shape and rel_err(mine.grad, theirs.grad) < GRAD_TOL[torch.float32]
        unit = (1,) * rank
        if step == 0:  # fwd and bwd_weight on the copy (C' channels, stride 1); bwd_data as usual (phases)
            if math.prod(filt) == math.prod(stride):  # pointwise: the fused GEMM route, or the conv kernel
                assert ("fwd", mapped, unit) in seen or not any(d == "fwd" for d, _, _ in seen)
            else:
                assert ("fwd", mapped, unit) in seen
            assert ("bwd_weight", mapped, unit) in seen and any(d == "bwd_data" for d, _, _ in seen)
            assert not any(c == channels for d, c, _ in seen if d != "bwd_data")
        else:
            assert seen == ([("fwd", mapped, unit)] if bias else [])
        with torch.no_grad():
            assert rel_err(tdt.conv(x, w, b, registry=reg, stride=stride, padding=pad, activation=activation),
                           ref) < TOL[torch.float32]
            # the operator itself (what a traced graph calls) maps too
            dw = tdt._conv_bwd_weight_op(x, g, list(filt), list(stride), [1] * rank, list(pad), list(pad), 1,
                                         tdt.register(reg))
            w64 = leaf(w.double())
        want, = torch.autograd.grad(conv_nd(x.double(), w64, stride=stride, padding=pad), w64, g.double())
        assert rel_err(dw, want) < GRAD_TOL[torch.float32]


@pytest.mark.parametrize("filt, stride, pad, channels, runs_on", [
    ((4, 4), (4, 4), (0, 0), 3, 48),  # a ConvNeXt stem: space to depth (4 x 4 blocks of 3 channels)
    ((3, 3), (1, 1), (1, 1), 3, 4),   # unit stride, 3 channels zero-padded to a vector's 4
    ((3, 3), (1, 1), (1, 1), 8, 8),   # an aligned conv on x that is not channels-last: a channels-last copy
])
def test_eager_calls_on_mapped_copies_launch_the_remembered_call(reg, monkeypatch, filt, stride, pad, channels,
                                                                 runs_on):
    """An inference call whose conv runs on copies of its operands (space to depth, channels zero-padded, a
    channels-last copy) routes and checks once: later calls copy x, reuse what was derived from the weight while
    it is unmodified and launch the call remembered on the copies (no conv call through the registry); outputs
    against float64, an in-place change to the weight seen."""
    monkeypatch.setattr(tdt, "_SPACE_TO_DEPTH", "on")
    monkeypatch.setattr(tdt, "_DERIVED", {})
    if runs_on == 4:  # this bundle's cost model keeps 3 channels as they are: the padding forced
        monkeypatch.setattr(tdt, "_channel_padding", lambda *args: runs_on)
    tdt._S2D_ROUTES.clear()
    reg.clear_caches()
    from tiledispatch.ops import conv as conv_op

    calls, run = [], conv_op.run

    def run_spy(registry, direction, x, *args):
        calls.append((direction, x.shape[1]))
        return run(registry, direction, x, *args)
    monkeypatch.setattr(conv_op, "run", run_spy)
    w = rand(6, channels, *filt, seed=160)
    derived = {}
    with torch.no_grad():
        for step in range(3):
            if step == 2:
                w.mul_(-1)
            x = rand(2, channels, 12, 16, seed=161 + step)
            calls.clear()
            out = tdt.conv(x, w, registry=reg, stride=stride, padding=pad)
            ref = F.conv2d(x.double(), w.double(), stride=stride, padding=pad)
            assert out.shape == ref.shape and rel_err(out, ref) < TOL[torch.float32]
            made = {key: entry[2] for key, entry in tdt._DERIVED.items() if key[0] == id(w)}  # w's own copies
            if step == 0:  # the conv kernel (or, pointwise, the GEMM route) ran on the copies
                assert calls in ([("fwd", runs_on)], []) and made
                derived = made
            else:
                assert calls == []
                same = [made[key] is t for key, t in derived.items()]
                assert all(same) if step == 1 else not any(same)  # made anew after the in-place change


def test_space_to_depth_is_chosen_where_few_taps_are_added_and_the_cost_model_rates_it_cheaper(reg, monkeypatch):
    """The "auto" route maps a few-channel strided conv where the cost model (here: a kernel for whole 4-channel
    vectors costs 1, any other 8, the mapped problem's sums counted) rates it cheaper and the filter gains at most
    a third more taps: a 7x7 / 2 stem (49 -> 64 taps) maps, a 3x3 / 2 one (9 -> 16) does not, nor one the cost model
    rates dearer; "off" maps nothing."""
    monkeypatch.setattr(tdt, "_selected_cost", lambda registry, problem: (1.0 if problem.c % 4 == 0 else 8.0) * (
        problem.c * math.prod(problem.filter_size)))
    handle = tdt.register(reg)
    x = rand(2, 3, 16, 16, seed=160)

    def mapped(filt, stride, pad, route="auto"):
        monkeypatch.setattr(tdt, "_SPACE_TO_DEPTH", route)
        tdt._S2D_ROUTES.clear()
        tdt._PAD_ROUTES.clear()
        geo = tdt._geometry(stride, (1, 1), pad, pad, 1)
        return tdt._space_to_depth(handle, "fwd", x, 8, filt, geo, tdt._PLAIN_EPILOGUE) is not None

    # 7x7 / 2: 3 channels x 49 taps padded to 4 costs 196; mapped, 12 channels x 16 taps, 192
    assert mapped((7, 7), (2, 2), (3, 3))
    assert not mapped((3, 3), (2, 2), (1, 1))  # 9 -> 16 taps
    assert mapped((3, 3), (2, 2), (1, 1), route="on")
    assert not mapped((7, 7), (2, 2), (3, 3), route="off")
    monkeypatch.setattr(tdt, "_selected_cost", lambda registry, problem: 1.0 if problem.c == 4 else 2.0)
    assert not mapped((7, 7), (2, 2), (3, 3))  # rated dearer


def test_channel_padding_keeps_ordinary_kernels_and_refusals_as_they_are(reg):
    """With the real cost model (the cpu kernels' cost grows with the padded reduction) nothing is padded; a problem
    no kernel runs keeps the plain path's error."""
    tdt._PAD_ROUTES.clear()
    x, w = rand(2, 3, 9, 9, seed=70), rand(5, 3, 3, 3, seed=71)
    geo = tdt._geometry((1, 1), (1, 1), (1, 1), (1, 1), 1)
    handle = tdt.register(reg)
    assert tdt._fwd_operands(handle, x, w, geo, tdt._PLAIN_EPILOGUE)[0].shape[1] == 3
    assert set(tdt._PAD_ROUTES.values()) == {0}
    x64 = rand(2, 3, 9, 9, dtype=torch.float64, seed=72)
    with pytest.raises(td.UnsupportedProblemError, match="no kernel"):  # the bundle has no fp64 conv
        tdt.conv(x64, x64.new_ones(5, 3, 3, 3), registry=reg, padding=1)


class _ModelledRegistry:
    """select() over a set's keys as the cutlass bundle would answer it without a GPU: the kernels whose signature
    matches and whose family's refusal model (checked against td_can_run by tests/kernels/test_coverage_emulated.py)
    admits the problem, ranked by the analytic ranker."""

    def __init__(self, keys):
        self.kernels = [types.SimpleNamespace(key=k, name=k.name) for k in keys]

    def select(self, problem):
        from tiledispatch import backends, selection

        fits = [k for k in self.kernels if problem.mismatch(k.key) is None
                and backends.family_of(k.key).module.refusal(problem, k.key) is None]
        if not fits:
            raise td.UnsupportedProblemError(f"no kernel runs {problem}")
        return selection.analytic(problem, fits)[0]


def _modelled_essential_registry(monkeypatch, keep=lambda key: True) -> "_ModelledRegistry":
    """A _ModelledRegistry over conv_fp16_all_essential's sm90a keys that `keep` admits, answering for every
    handle."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("coverage", REPO / "bench" / "benchmarks" / "coverage.py")
    coverage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(coverage)
    registry = _ModelledRegistry([k for k in coverage.set_keys("conv_fp16_all_essential", "cutlass/sm90a") if keep(k)])
    monkeypatch.setattr(tdt, "registry_of", lambda handle: registry)
    return registry


@pytest.mark.parametrize("channels,k,filt,stride,direction,padded", [
    (3, 64, 7, 2, "fwd", 0), (3, 64, 3, 2, "fwd", 0),         # RGB stems fwd: as they are (few-channel kernels)
    (3, 64, 7, 2, "bwd_weight", 4),                             # ResNet-50's stem dW: the 8-byte kernels
    (5, 64, 3, 1, "fwd", 8), (5, 64, 3, 1, "bwd_weight", 8),    # C = 5: both widths give 8
    (12, 64, 3, 1, "fwd", 0), (12, 64, 3, 1, "bwd_weight", 0),  # C = 12 runs as it is on the 8-byte kernels
    (3, 45, 7, 2, "fwd", 0), (16, 64, 3, 1, "fwd", 0)])       # K = 45 refused by every aligned kernel; aligned C
def test_channel_padding_width_on_the_cutlass_essential_set(monkeypatch, channels, k, filt, stride, direction, padded):
    """The padding width the cost model picks for conv_fp16_all_essential's sm90a kernels (bench/results/
    channel_padding_align4_h200 measured these choices as the fastest of as is / 4 / 8 on the stems; the RGB stems'
    fwd runs as it is on direct_mma's few-channel kernels since bench/results/few_channel_h200)."""
    _modelled_essential_registry(monkeypatch)
    tdt._PAD_ROUTES.clear()
    x = torch.empty(32, channels, 56, 56, dtype=torch.float16)
    geo = tdt._geometry((stride, stride), (1, 1), (filt // 2,) * 2, (filt // 2,) * 2, 1)
    assert tdt._channel_padding(-1, direction, x, k, (filt, filt), geo, tdt._PLAIN_EPILOGUE) == padded


@pytest.mark.parametrize("k,filt,stride,maps", [
    (96, 4, 4, True),    # ConvNeXt / Swin 4x4 stride-4 patches: a 1x1 conv of 48 channels
    (768, 16, 16, True),  # ViT-B/16 patches
    (32, 3, 2, False)])  # MobileNetV2's 3x3 / 2 stem: 9 -> 16 taps
def test_a_stem_with_a_bias_is_routed_on_its_plain_cost_where_no_conv_kernel_fuses_the_bias(monkeypatch, k, filt,
                                                                                            stride, maps):
    """On conv kernels that fuse no bias (the models benchmark builds the identity epilogues of
    conv_fp16_all_essential), a stem with a bias is costed as the plain problem (the bias then goes through
    beta * Y, or a GEMM fusing it on the pointwise mapped problem): the patch-embedding stems map to space to depth
    (bench/results/stem_route_h200: ConvNeXt-T's 37 against 124 us as it is, ViT-B/16's 37 against 349), where
    costed with the bias neither problem had a kernel and the route was refused."""
    _modelled_essential_registry(monkeypatch, lambda key: key.signature.epilogue == tdt._PLAIN_EPILOGUE)
    monkeypatch.setattr(tdt, "_SPACE_TO_DEPTH", "auto")
    tdt._S2D_ROUTES.clear()
    tdt._PAD_ROUTES.clear()
    x = torch.empty(32, 3, 224, 224, dtype=torch.float16)
    geo = tdt._geometry((stride, stride), (1, 1), (filt // 2 if stride < filt else 0,) * 2,
                        (filt // 2 if stride < filt else 0,) * 2, 1)
    with_bias = tdt.Epilogue("identity", True, 0)
    assert (tdt._space_to_depth(-1, "fwd", x, k, (filt, filt), geo, with_bias) is not None) == maps


def _remembered(registry) -> int:
    """How many calls the eager fast path keeps in the registry's launch cache."""
    return sum(type(v).__name__ == "_FastCall" for v in registry._launches.values())


def test_the_eager_fast_path_remembers_only_whole_results_on_the_callers_tensors(reg):
    """A repeated eager call launches the remembered kernel directly only where the kernel alone computed the whole
    result on the caller's own tensors: a conv whose activation torch applies after the kernel, a conv input that is
    converted to channels-last per call and a linear whose bias is added through beta * C stay exact call after
    call; a registry call with other scalars on the same prepared launch in between changes nothing; grad mode,
    autocast and clear_caches() are obeyed."""
    h = tdt.register(reg)
    reg.clear_caches()
    xc = rand(2, 8, 6, 6, seed=50).contiguous(memory_format=torch.channels_last)
    wc = rand(8, 8, 3, 3, seed=51).contiguous(memory_format=torch.channels_last)
    want = F.conv2d(xc.double(), wc.double(), padding=1)
    x, w, b = rand(8, 16, seed=52), rand(24, 16, seed=53), rand(24, seed=54)
    want_linear = F.linear(x.double(), w.double())
    with torch.no_grad():
        for _ in range(3):
            assert rel_err(tdt.conv(xc, wc, registry=h, padding=1, activation="relu"), want.relu()) < TOL[torch.float32]
            assert rel_err(tdt.conv(xc.contiguous(), wc, registry=h, padding=1), want) < TOL[torch.float32]
            assert rel_err(tdt.conv(xc, wc, registry=h, padding=1), want) < TOL[torch.float32]
            assert rel_err(tdt.linear(x, w, b, registry=h, residuals=(x @ w.t(),)),
                           2 * want_linear + b.double()) < TOL[torch.float32]
            assert rel_err(tdt.linear(x, w, registry=h), want_linear) < TOL[torch.float32]
        # the plain channels-last conv, the launch on the other input's channels-last copy (under the copy's
        # fingerprint, not the caller's) and the plain linear (the bias + residual linear folds them into beta * C)
        assert _remembered(reg) == 3
        out = torch.empty(8, 24)
        reg.gemm(x, w.t(), out, alpha=2.0)  # the prepared launch tdt.linear's remembered call holds, other alpha
        assert rel_err(out, 2 * want_linear) < TOL[torch.float32]
        assert rel_err(tdt.linear(x, w, registry=h), want_linear) < TOL[torch.float32]

    w_leaf = leaf(w)
    with torch.no_grad():
        tdt.linear(x, w_leaf, registry=h)
        assert rel_err(tdt.linear(x, w_leaf, registry=h), want_linear) < TOL[torch.float32]
    y = tdt.linear(x, w_leaf, registry=h)  # grad mode on: recorded by autograd, not the remembered launch
    assert y.grad_fn is not None
    y.sum().backward()
    assert rel_err(w_leaf.grad, x.double().sum(0).expand(24, 16)) < GRAD_TOL[torch.float32]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = tdt.linear(x, w, registry=h)
    assert y.dtype == torch.bfloat16 and rel_err(y, want_linear) < TOL[torch.bfloat16]
    reg.clear_caches()
    assert _remembered(reg) == 0


def _count_remembered_launches(monkeypatch) -> list:
    """A list that gets an item per launch of a remembered call."""
    served = []
    fast_call = tdt._FastCall.__call__
    monkeypatch.setattr(tdt._FastCall, "__call__", lambda self, *a: served.append(1) or fast_call(self, *a))
    return served


def test_operator_calls_launch_remembered_calls_as_a_compiled_graph_makes_them(reg, monkeypatch):
    """A compiled graph's code calls the operators through torch.ops on real tensors, every time: each of the four
    launches, from its second call on new tensors of the same shapes, the call remembered by its first (one entry
    each, under the key a patched or fused layer's eager call uses), and stays exact; an operand that requires a
    gradient is still refused in grad mode, and its call remembered in no-grad mode serves no-grad calls only."""
    h = tdt.register(reg)
    reg.clear_caches()
    served = _count_remembered_launches(monkeypatch)
    geo = ([1, 1], [1, 1], [1, 1], [1, 1], 1)
    ops = torch.ops.tiledispatch
    for step in range(3):
        a, b = rand(8, 16, seed=80 + step), rand(24, 16, seed=83 + step).t()
        x = rand(2, 8, 6, 6, seed=86 + step).contiguous(memory_format=torch.channels_last)
        w = rand(8, 8, 3, 3, seed=89 + step).contiguous(memory_format=torch.channels_last)
        dy = rand(2, 8, 6, 6, seed=92 + step).contiguous(memory_format=torch.channels_last)
        xd, wd, dyd = x.double().requires_grad_(), w.double().requires_grad_(), dy.double()
        ref = F.conv2d(xd, wd, padding=1)
        ref.backward(dyd)
        assert rel_err(ops.gemm(a, b, None, [], "identity", -math.inf, math.inf, h), a.double() @ b.double()) < \
            TOL[torch.float32]
        assert rel_err(ops.conv_fwd(x, w, None, [], "identity", -math.inf, math.inf, *geo, h), ref) < TOL[torch.float32]
        assert rel_err(ops.conv_bwd_data(dy, w, [6, 6], *geo, h), xd.grad) < GRAD_TOL[torch.float32]
        assert rel_err(ops.conv_bwd_weight(x, dy, [3, 3], *geo, h), wd.grad) < GRAD_TOL[torch.float32]
        assert len(served) == 4 * step, step
    entries = [key[1][0] for key, entry in zip(reg._launches._entries, reg._launches.values())
               if isinstance(entry, tdt._FastCall)]
    assert sorted(entries) == ["bwd_data", "bwd_weight", "conv", "gemm"]
    # a patched layer's eager call on the same tensors (the same key) takes the operator's entry
    layer = nn.Conv2d(8, 8, 3, padding=1, bias=False).requires_grad_(False)
    layer.weight = nn.Parameter(w, requires_grad=False)
    tdt.patch(layer, reg)
    assert rel_err(layer(x), ref) < TOL[torch.float32] and len(served) == 9
    # an operand that requires a gradient (its fingerprint says so): refused in grad mode, call after call; in
    # no-grad mode remembered by its first call, whose entry serves only no-grad calls
    w_leaf = leaf(w)
    for _ in range(2):
        with pytest.raises(td.InvalidInputError, match="requires grad"):
            ops.conv_fwd(x, w_leaf, None, [], "identity", -math.inf, math.inf, *geo, h)
    with torch.no_grad():
        for _ in range(2):
            assert rel_err(ops.conv_fwd(x, w_leaf, None, [], "identity", -math.inf, math.inf, *geo, h), ref) < \
                TOL[torch.float32]
    with pytest.raises(td.InvalidInputError, match="requires grad"):
        ops.conv_fwd(x, w_leaf, None, [], "identity", -math.inf, math.inf, *geo, h)
    assert len(served) == 10


@pytest.mark.parametrize("stride, autocast, route", [(1, None, "auto"), (2, None, "phases"), (2, None, "auto"),
                                                     (1, torch.bfloat16, "auto")])
def test_training_calls_launch_every_direction_through_remembered_calls(reg, monkeypatch, stride, autocast, route):
    """A training step's conv without bias (forward with grad, then bwd_data and bwd_weight in the backward pass)
    launches each direction through a call remembered on the first step, on each step's new tensors: outputs and
    gradients stay exact step after step. The strided input gradient runs by phase: on the "phases" route a launch
    per phase, then a copy, each phase's launch remembered, never the whole; by default the phases stacked in one
    unit-stride launch, remembered, then one copy. Where each gradient is one remembered launch (stride 1), the
    first backward pass also leaves a plan of them on the forward's remembered call, and the native node runs
    it from then on without the Python backward function. Those entries never answer a call that records a
    gradient, and a second derivative through the backward pass is refused, as torch's once-differentiable
    functions refuse it. Under torch.autocast the operands are cast before the call is recorded and its forward
    pass runs with autocast off (as torch.amp.custom_fwd(cast_inputs=...) runs one): the same launches are
    remembered."""
    dtype = autocast or torch.float32  # what the kernels see
    h = tdt.register(reg)
    reg.clear_caches()
    monkeypatch.setattr(tdt, "_STRIDED_BWD_DATA", route)
    phases = 1 if stride == 1 or route == "auto" else 4  # bwd_data launches a step
    assert td.native.torch_fastpath() is not None, "the native module was not built: see its .failed file"
    planned = stride == 1  # the stride phases' launches are no single remembered launch
    served = _count_remembered_launches(monkeypatch)
    backward_calls = []
    python_backward = tdt._conv_backward
    monkeypatch.setattr(tdt, "_conv_backward", lambda *a: backward_calls.append(1) or python_backward(*a))
    for step in range(3):
        x = leaf(rand(2, 8, 6, 6, seed=60 + step).contiguous(memory_format=torch.channels_last))
        w = leaf(rand(8, 8, 3, 3, seed=63 + step).contiguous(memory_format=torch.channels_last))
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            y = tdt.conv(x, w, registry=h, padding=1, stride=stride)
        xr, wr = leaf(x.to(dtype).double()), leaf(w.to(dtype).double())
        ref = F.conv2d(xr, wr, padding=1, stride=stride)
        assert y.grad_fn is not None and y.dtype == dtype and rel_err(y, ref) < TOL[dtype]
        g = rand(*y.shape, seed=69 + step, dtype=dtype).contiguous(memory_format=torch.channels_last)
        y.backward(g)
        ref.backward(g.double())
        for mine, theirs in ((x, xr), (w, wr)):
            assert mine.grad.dtype == torch.float32 and rel_err(mine.grad, theirs.grad) < GRAD_TOL[dtype], step
        if step == 0:
            assert not served
            options = [key[1] for key, entry in zip(reg._launches._entries, reg._launches.values())
                       if isinstance(entry, tdt._FastCall)]
            assert sorted(o[0] for o in options) == ["bwd_data"] * phases + ["bwd_weight", "conv"]
            assert not any(o[0] == "bwd_data" and o[1].strided for o in options)
            forward = next(e for k, e in zip(reg._launches._entries, reg._launches.values()) if k[1][0] == "conv")
            assert (type(forward.native_backward).__name__ == "PyCapsule") == planned, forward.native_backward
    # steps 1 and 2: every remembered launch; the backward pass's by the native node where planned
    assert len(backward_calls) == (1 if planned else 3)
    assert len(served) == 2 * (1 if planned else 2 + phases)
    layer = nn.Conv2d(8, 8, 3, padding=1, stride=stride, bias=False)
    layer.weight = nn.Parameter(w.detach())
    tdt.patch(layer, reg)
    for _ in range(2):  # the layer's forward is remembered inside the autograd Function, under the layer's key
        y = layer(x)
        assert y.grad_fn is not None
    with torch.no_grad():
        assert layer(x).grad_fn is None
    gx, = torch.autograd.grad(y, x, leaf(g), create_graph=True)  # a gradient that needs a gradient itself
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.sum().backward()
    a, wl = leaf(rand(4, 16, seed=72)), leaf(rand(8, 16, seed=73))
    ga, = torch.autograd.grad(tdt.linear(a, wl, registry=h), a, leaf(rand(4, 8, seed=74)), create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        ga.sum().backward()


def test_the_native_backward_plan_runs_only_the_call_it_was_made_for(reg, monkeypatch):
    """A conv's backward plan (run by the native node instead of the Python backward function) serves a later
    step's node only where that node's call is the one it was made for. Each case checks the gradients against
    float64 and which path ran: a non-channels-last output gradient (made channels-last first, as the Python
    function makes it: planned), an input that wants no gradient (another forward call, so a plan of its own:
    Python the first time, then planned; the bias gradient: test_torch_fusion.py), the plan's kernels launched in between through
    the registry on other tensors with other scalars (planned: the launch checks its plan's arguments), a
    backward pass on another thread (Python), a saved tensor changed in place (refused, as before)."""
    import threading

    assert td.native.torch_fastpath() is not None, "the native module was not built: see its .failed file"
    h = tdt.register(reg)
    reg.clear_caches()
    python_backward = tdt._conv_backward
    calls = []
    monkeypatch.setattr(tdt, "_conv_backward", lambda *a: calls.append(1) or python_backward(*a))

    def step(seed, *, layout=torch.channels_last, wrt=("x", "w"), run=lambda f: f()):
        x = rand(2, 8, 6, 6, seed=seed).contiguous(memory_format=torch.channels_last).requires_grad_("x" in wrt)
        w = leaf(rand(8, 8, 3, 3, seed=seed + 1).contiguous(memory_format=torch.channels_last))
        named = {"x": x, "w": w}
        y = tdt.conv(x, w, registry=h, padding=1)
        refs = {n: leaf(t.double()) for n, t in named.items()}
        ref = F.conv2d(refs["x"], refs["w"], padding=1)
        g = rand(*y.shape, seed=seed + 2).contiguous(memory_format=layout)
        calls.clear()
        got = []
        run(lambda: got.extend(torch.autograd.grad(y, [named[n] for n in wrt], g)))
        want = torch.autograd.grad(ref, [refs[n] for n in wrt], g.double())
        for name, mine, theirs in zip(wrt, got, want):
            assert rel_err(mine, theirs) < GRAD_TOL[torch.float32], name
        return len(calls)

    assert step(120) == 1  # the first: the Python function, which makes the plan
    assert step(123) == 0
    assert step(126, layout=torch.contiguous_format) == 0
    assert step(129, wrt=("w",)) == 1 and step(130, wrt=("w",)) == 0
    # the plan's dX launcher run in between with another alpha: that step's node leaves it to the Python function
    data = next(e for k, e in zip(reg._launches._entries, reg._launches.values()) if k[1][0] == "bwd_data")
    gy = rand(2, 8, 6, 6, seed=138).contiguous(memory_format=torch.channels_last)
    w = rand(8, 8, 3, 3, seed=139).contiguous(memory_format=torch.channels_last)
    dx = torch.empty(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        data.launcher(data.pointers(gy.data_ptr(), w.data_ptr(), dx.data_ptr(), None, ()), 0.5, 0.0)
    want = 0.5 * torch.nn.grad.conv2d_input(dx.shape, w.double(), gy.double(), padding=1)
    assert rel_err(dx, want) < TOL[torch.float32]
    assert step(140) == 1 and step(141) == 0

    def on_another_thread(f):
        worker = threading.Thread(target=f)
        worker.start()
        worker.join()

    assert step(143, run=on_another_thread) == 1
    x = leaf(rand(2, 8, 6, 6, seed=146).contiguous(memory_format=torch.channels_last))
    w = leaf(rand(8, 8, 3, 3, seed=147).contiguous(memory_format=torch.channels_last))
    y = tdt.conv(x, w, registry=h, padding=1)
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_training_steps_stay_exact_through_remembered_calls(reg, monkeypatch, dtype):
    """A Linear's training step (forward with grad; grad input and grad weight, two GEMMs, in the backward pass)
    launches every GEMM through a call remembered on the first step, on each step's new tensors. In fp16 the
    bundle has rcr kernels only: the gradient GEMMs (rrr, crr) copy an operand first, and their launches on the
    copies are remembered too."""
    h = tdt.register(reg)
    reg.clear_caches()
    served = _count_remembered_launches(monkeypatch)
    fp32 = dtype == torch.float32  # the fp16 set fuses no bias: its forward would add one by beta * C
    for step in range(3):
        x, w, b = (leaf(rand(*shape, seed=seed + step, dtype=dtype)) for shape, seed in (((6, 16), 80),
                                                                                         ((8, 16), 83), ((8,), 86)))
        y = tdt.linear(x, w, b if fp32 else None, registry=h, activation="relu" if fp32 else "identity")
        xr, wr, br = leaf(x.double()), leaf(w.double()), leaf(b.double())
        ref = F.linear(xr, wr, br).relu() if fp32 else F.linear(xr, wr)
        assert rel_err(y, ref) < TOL[dtype]
        g = rand(6, 8, seed=89 + step, dtype=dtype)
        y.backward(g)
        ref.backward(g.double())
        for mine, theirs in ((x, xr), (w, wr), (b, br))[:3 if fp32 else 2]:
            assert rel_err(mine.grad, theirs.grad) < GRAD_TOL[dtype], step
    assert len(served) == 2 * 3  # steps 1 and 2: the forward GEMM and both gradient GEMMs


@pytest.mark.parametrize("recorder", ["native", "function"])
def test_training_calls_are_recorded_by_the_native_node_as_by_the_autograd_function(reg, monkeypatch, recorder):
    """A differentiable call is recorded by the native module's C++ autograd node (eager, the module built) or by
    the autograd Function (traced, or without the module): gradients exact through bias, a residual and an
    activation whose derivative needs the saved output (relu) or the recomputed pre-activation (gelu); a saved
    tensor changed in place, a second backward pass without retain_graph and an error inside the backward pass
    are refused as torch refuses them; the graph keeps nothing alive once its output is gone."""
    native = td.native.torch_fastpath() if recorder == "native" else None
    assert native is not None or recorder == "function", "the native module was not built: see its .failed file"
    monkeypatch.setattr(tdt, "_NATIVE_RECORD", native and native.record)
    h = tdt.register(reg)
    node = {"native": ("TiledispatchConvBackward", "TiledispatchGemmBackward"),
            "function": ("_ConvFunctionBackward", "_GemmFunctionBackward")}[recorder]
    for step, activation in enumerate(("relu", "gelu_tanh", "relu")):  # the third: remembered launches
        x = leaf(rand(2, 8, 6, 6, seed=90).contiguous(memory_format=torch.channels_last))
        w = leaf(rand(8, 8, 3, 3, seed=91).contiguous(memory_format=torch.channels_last))
        b, r = leaf(rand(8, seed=92)), leaf(rand(2, 8, 6, 6, seed=93).contiguous(memory_format=torch.channels_last))
        y = tdt.conv(x, w, b, registry=h, padding=1, residuals=[r], activation=activation)
        assert y.grad_fn.name() == node[0]
        refs = [leaf(t.double()) for t in (x, w, b, r)]
        pre = F.conv2d(refs[0], refs[1], refs[2], padding=1) + refs[3]
        ref = pre.relu() if activation == "relu" else F.gelu(pre, approximate="tanh")
        assert rel_err(y, ref) < TOL[torch.float32]
        g = rand(*y.shape, seed=94).contiguous(memory_format=torch.channels_last)
        y.backward(g)
        ref.backward(g.double())
        for mine, theirs in zip((x, w, b, r), refs):
            assert rel_err(mine.grad, theirs.grad) < GRAD_TOL[torch.float32], (step, activation)
        a, wl, bl = leaf(rand(4, 16, seed=95)), leaf(rand(8, 16, seed=96)), leaf(rand(8, seed=97))
        out = tdt.linear(a, wl, bl, registry=h, activation=activation)
        assert out.grad_fn.name() == node[1]
        refs = [leaf(t.double()) for t in (a, wl, bl)]
        pre = F.linear(*refs)
        (pre.relu() if activation == "relu" else F.gelu(pre, approximate="tanh")).sum().backward()
        out.sum().backward()
        for mine, theirs in zip((a, wl, bl), refs):
            assert rel_err(mine.grad, theirs.grad) < GRAD_TOL[torch.float32], (step, activation)
    y = tdt.conv(x, w, registry=h, padding=1, activation="relu")
    y.sum().backward(retain_graph=True)
    y.sum().backward()  # retained: the second pass accumulates
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()
    y = tdt.conv(x, w, registry=h, padding=1)
    with torch.no_grad():
        w.add_(1)  # a saved tensor changed in place after the forward pass
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

    def refuse(*_):
        raise td.InvalidInputError("refused in the backward pass")

    backward = tdt._conv_backward
    monkeypatch.setattr(tdt, "_conv_backward", refuse)
    with pytest.raises(td.InvalidInputError, match="refused in the backward pass"):
        tdt.conv(x, w, registry=h, padding=1).sum().backward()
    monkeypatch.setattr(tdt, "_conv_backward", backward)
    kept = leaf(rand(2, 8, 6, 6, seed=98).contiguous(memory_format=torch.channels_last))
    alive = weakref.ref(kept)
    y = tdt.conv(kept, w, registry=h, padding=1, activation="relu")  # the node saves kept and its own output
    del kept, y
    assert alive() is None, "the recorded graph outlived its output"


def test_patch_matches_the_unpatched_model_and_unpatch_restores(reg, monkeypatch):
    torch.manual_seed(0)
    model = SmallNet()
    twin = copy.deepcopy(model)
    x = rand(2, 3, 8, 8, seed=30)
    report = tdt.patch(model, reg, example_inputs=x)
    calls = _routed_calls(monkeypatch, reg)

    names = [r.name for r in report.layers]
    assert names == ["features.0", "features.2", "features.4", "features.6", "temporal", "head.0", "head.2"]
    assert not report.unsupported and all(r.status == "tiledispatch" for r in report.layers)
    for r in report.layers:  # the model's parameters require grad: every direction reported, each a real kernel
        assert set(r.kernels) == {"fwd", "bwd_data", "bwd_weight"}, r
        assert all(k.startswith(("gemm_", "conv")) for k in r.kernels.values()), r
    temporal = next(r for r in report.layers if r.name == "temporal")
    assert any("reflect" in n for n in temporal.notes)
    assert any("input converted to channels-last" in n for n in report.layers[0].notes)
    assert "7 layer(s) on the bundle, 0 on PyTorch" in str(report)
    assert report.to_dict()["patched"] == 7

    out = model(x)
    ref = twin(x)
    assert rel_err(out, ref) < 1e-5
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert rel_err(p.grad, q.grad) < GRAD_TOL[torch.float32], name
    assert {"gemm", "conv_fwd", "conv_bwd_data", "conv_bwd_weight"} <= set(calls)
    assert "conv_bwd_data" in calls and calls.count("conv_fwd") == 5

    tdt.unpatch(model)
    calls.clear()
    assert rel_err(model(x), twin(x)) < 1e-6
    assert calls == [] and not any("forward" in m.__dict__ for m in model.modules())
    assert list(model.state_dict()) == list(twin.state_dict())


def test_patch_under_autocast_matches_torch_autocast(reg):
    """fp32 parameters run in bf16 under torch.autocast, as torch's own layers do; the gradients come back fp32."""
    torch.manual_seed(0)
    model = SmallNet()
    twin = copy.deepcopy(model)
    x = rand(2, 3, 8, 8, seed=32)
    report = tdt.patch(model, reg, autocast=torch.bfloat16, example_inputs=x)
    status = {r.name: r for r in report.layers}
    # the test bundle's bf16 convolutions are 2D only: the Conv1d stays on PyTorch, named as such
    assert status["temporal"].status == "pytorch" and "no bf16 conv1d" in status["temporal"].reason
    assert all(r.status == "tiledispatch" and r.dtype == "bf16" for n, r in status.items() if n != "temporal")
    assert all("bf16" in k for r in report.patched for k in r.kernels.values())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        ref = twin(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert rel_err(out, ref) < 2e-2
    out.float().square().sum().backward()
    ref.float().square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.grad.dtype == torch.float32 and rel_err(p.grad, q.grad) < 5e-2, name


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_patch_leaves_unsupported_dtypes_on_pytorch_and_patched_layers_raise(reg):
    model = nn.Sequential(nn.Linear(8, 8).double(), nn.Conv2d(4, 4, 3).half(), nn.Conv3d(2, 2, 1).half(),
                          nn.Conv2d(4, 4, 3), ScaledLinear(4, 4))
    report = tdt.patch(model, reg)
    status = {r.name: (r.status, r.reason) for r in report.layers}
    assert status["0"] == ("pytorch", "the bundle has no fp64 GEMM kernels")
    assert status["1"][0] == "tiledispatch"
    assert status["2"][0] == "pytorch" and "no fp16 conv3d fwd / bwd_data / bwd_weight kernels" in status["2"][1]
    assert status["4"] == ("pytorch", "ScaledLinear overrides Linear.forward: not a plain Linear call")
    assert len(report.unsupported) == 3
    assert "forward" not in model[0].__dict__  # left exactly as it was
    # a patched layer that later meets a problem the bundle cannot run raises; it never falls back to torch
    model[3].double()
    with pytest.raises(td.UnsupportedProblemError, match="fp64"):
        model[3](rand(1, 4, 6, 6, dtype=torch.float64))


def test_compile_fullgraph_traces_the_operators_forward_and_backward(reg):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return make_boxed_func(gm.forward)

    torch.manual_seed(0)
    model = SmallNet()
    twin = copy.deepcopy(model)
    tdt.patch(model, reg)
    tdt.patch(twin, reg)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
    x = rand(2, 3, 8, 8, seed=31)
    out = compiled(x)
    out.sum().backward()
    ref = twin(x)
    ref.sum().backward()
    assert rel_err(out, ref) < 1e-6
    for p, q in zip(model.parameters(), twin.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-5
    forward, backward = graphs
    assert {"tiledispatch.gemm.default", "tiledispatch.conv_fwd.default"} <= forward
    assert {"tiledispatch.gemm.default", "tiledispatch.conv_bwd_data.default",
            "tiledispatch.conv_bwd_weight.default"} <= backward


# -- GPU: operators on CUDA tensors and a CUDA-graph captured training step --------------------------------------
def _gpu_registry():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    path = os.environ.get("TD_TORCH_BUNDLE")
    if not path:
        pytest.skip("set TD_TORCH_BUNDLE to a cutlass bundle with fp16 GEMM and conv kernels "
                    "(e.g. fp16_rcr_essential + conv_fp16_all_essential)")
    return td.load(path)


@pytest.mark.gpu
def test_gpu_operators_match_torch():
    reg = _gpu_registry()
    dev, dt = "cuda", torch.float16
    x, w, b = rand(64, 256, dtype=dt).to(dev), rand(128, 256, dtype=dt).to(dev), rand(128, dtype=dt).to(dev)
    assert rel_err(tdt.linear(x, w, b, registry=reg), F.linear(x.double(), w.double(), b.double())) < 2e-3
    xc = tdt._channels_last(rand(4, 64, 14, 14, dtype=dt, seed=2).to(dev))
    wc = tdt._channels_last(rand(64, 64, 3, 3, dtype=dt, seed=3, scale=0.1).to(dev))
    xs, ws = leaf(xc), leaf(wc)
    out = tdt.conv(xs, ws, registry=reg, padding=1)
    xr, wr = leaf(xc.double()), leaf(wc.double())
    ref = F.conv2d(xr, wr, padding=1)
    assert rel_err(out, ref) < 2e-3
    g = rand(*out.shape, dtype=dt, seed=4).to(dev)
    out.backward(g)
    ref.backward(g.double())
    assert rel_err(xs.grad, xr.grad) < 1e-2 and rel_err(ws.grad, wr.grad) < 1e-2


@pytest.mark.gpu
def test_gpu_linear_with_gelu_runs_where_no_fused_kernel_takes_the_shape():
    """out_features 1234 (not a multiple of 8): the fused sets' GELU kernels refuse it; the call still runs, forward
    and backward, on a plain kernel with torch's GELU after it."""
    reg = _gpu_registry()
    h = tdt.register(reg)
    dev, dt = "cuda", torch.float16
    x, w, b = (leaf(t.to(dev)) for t in (rand(77, 256, dtype=dt), rand(1234, 256, dtype=dt, seed=1),
                                          rand(1234, dtype=dt, seed=2)))
    if ("fp16", "rcr", "gelu_erf", True, 0) in tdt._CAPS[h].gemm:
        assert tdt._choose_route(h, "fp16", "gelu_erf", True, 0, "r", "c", (1, 77, 1234, 256)).activation_after
    exact = [leaf(t.detach().double()) for t in (x, w, b)]
    out = tdt.linear(x, w, b, registry=reg, activation="gelu_erf")
    ref = F.gelu(F.linear(*exact))
    assert rel_err(out, ref) < 2e-3
    g = rand(*out.shape, dtype=dt, seed=3).to(dev)
    out.backward(g)
    ref.backward(g.double())
    for got, want in zip((x, w, b), exact):
        assert rel_err(got.grad, want.grad) < 1e-2



@pytest.mark.gpu
def test_gpu_empty_problems_and_an_activation_without_a_bias():
    """On CUDA tensors: a batch of none through linear and conv (a stem included) with the weight's zero gradient,
    K = 0 as the epilogue on zeros, and a linear whose activation the fused sets compute only with a bias."""
    reg = _gpu_registry()
    dev, dt = "cuda", torch.float16
    b = rand(64, dtype=dt, seed=1).to(dev)
    assert tdt.linear(rand(0, 128, dtype=dt).to(dev), rand(64, 128, dtype=dt).to(dev), b, registry=reg).shape == (0, 64)
    assert torch.equal(tdt.linear(rand(8, 0, dtype=dt).to(dev), rand(64, 0, dtype=dt).to(dev), b, activation="relu",
                                  registry=reg), torch.relu(b).expand(8, 64))
    x = leaf(tdt._channels_last(rand(0, 64, 14, 14, dtype=dt).to(dev)))
    w = leaf(rand(128, 64, 3, 3, dtype=dt, seed=2).to(dev))
    y = tdt.conv(x, w, registry=reg, padding=1)
    assert y.shape == (0, 128, 14, 14)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))
    stem = tdt.conv(rand(0, 3, 224, 224, dtype=dt).to(dev), rand(64, 3, 7, 7, dtype=dt).to(dev), registry=reg, stride=2,
                    padding=3)
    assert stem.shape == (0, 64, 112, 112)
    xl, wl = rand(256, 512, dtype=dt, seed=3).to(dev), rand(1024, 512, dtype=dt, seed=4, scale=1 / 16).to(dev)
    for activation, fn in (("gelu_erf", F.gelu), ("silu", F.silu), ("relu", torch.relu)):
        assert rel_err(tdt.linear(xl, wl, registry=reg, activation=activation), fn(F.linear(xl.double(), wl.double()))) \
            < 2e-3

@pytest.mark.gpu
def test_gpu_cuda_graph_captures_and_replays_a_training_step():
    reg = _gpu_registry()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, stride=2, padding=1, groups=4, bias=False), nn.ReLU(), nn.Flatten(),
                          nn.Linear(32 * 8 * 8, 64)).cuda().half().to(memory_format=torch.channels_last)
    eager = copy.deepcopy(model)
    report = tdt.patch(model, reg)
    assert not report.unsupported, str(report)
    tdt.patch(eager, reg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=1e-2)
    static_x = tdt._channels_last(torch.randn(8, 16, 16, 16, device="cuda", dtype=torch.float16))

    def step(m, o, x):
        o.zero_grad(set_to_none=False)
        loss = m(x).float().square().mean()
        loss.backward()
        o.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: plans, selections and workspaces, as CUDA graphs require
        for _ in range(3):
            step(model, opt, static_x)
            step(eager, opt_eager, static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # the warmed-up stream: its plans and workspaces
        static_loss = step(model, opt, static_x)
    for i in range(3):
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        loss = step(eager, opt_eager, static_x)
        torch.cuda.synchronize()
        assert abs(static_loss.item() - loss.item()) <= 1e-3 * abs(loss.item()) + 1e-6, i
    for p, q in zip(model.parameters(), eager.parameters()):
        assert rel_err(p, q) < 1e-3
    assert any(geo.phase_plans for geo in tdt._GEOMETRIES.values())  # the strided conv's dX ran by phase


@pytest.mark.parametrize("directions", ["[fwd, bwd_data, bwd_weight]", "fwd"])
def test_bench_host_overhead_runs_on_the_cpu(tmp_path, directions):
    """bench/benchmarks/host_overhead.py on the cpu backend for a conv forward: every path timed; with a bundle of
    forward kernels only, the training pair (which needs bwd_data and bwd_weight) is left out and said so, and
    the rest is still timed."""
    import json

    set_text = TORCH_SET.split("  - backend: cpu\n    op: gemm")[0].replace("[fwd, bwd_data, bwd_weight]", directions)
    bundle = Path(build_cpu_bundle(tmp_path, "torch_test", set_text).kernels[0].path).parents[1]
    env = {**os.environ, "PYTHONPATH": str(REPO / "runtime")}
    cmd = [sys.executable, str(REPO / "bench" / "benchmarks" / "host_overhead.py"), str(bundle), "--arrays", "torch",
           "--rounds", "2", "--problems", "conv2d_3x3_fwd", "--out", str(tmp_path), "--tag", "test"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    problem = json.loads((tmp_path / "host_overhead_test.json").read_text())["problems"]["conv2d_3x3_fwd"]
    timed = set(problem["paths"])
    assert {"raw_c_call", "default", "plan", "tdt_conv", "patched_conv", "torch_conv"} <= timed
    if directions == "fwd":
        assert not timed & {"tdt_conv_train", "torch_conv_train"}
        assert problem["paths_skipped"]["tdt_conv_train"] == "no bwd_data or bwd_weight kernel for it"
    else:
        assert {"tdt_conv_train", "torch_conv_train"} <= timed and "paths_skipped" not in problem


def _bench_models_on_the_cpu(reg, out: Path, models: str, variants: str) -> dict:
    """bench/benchmarks/models.py on the cpu backend (tiny sizes, --quick): its JSON."""
    import json

    bundle = Path(reg.kernels[0].path).parents[1]  # <bundle>/kernels/<kernel>.so
    env = {**os.environ, "PYTHONPATH": str(REPO / "runtime")}
    cmd = [sys.executable, str(REPO / "bench" / "benchmarks" / "models.py"), "--device", "cpu", "--tiny", "--quick",
           "--bundle", str(bundle), "--models", models, "--variants", variants, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "models_cpu_tiny.json").read_text())


def test_bench_models_runs_on_the_cpu(reg, tmp_path):
    """bench/benchmarks/models.py end to end on the cpu backend (tiny sizes): the patched and fused models match eager
    and the JSON holds the reports, the per-layer comparison and the host overhead."""
    result = _bench_models_on_the_cpu(reg, tmp_path, "llama3_8b_decode8,convnext_tiny,mobilenet_v2,resnet50,"
                                      "resnet50_train", "eager,tiledispatch,fused")
    for case in ("llama3_8b_decode8", "convnext_tiny", "mobilenet_v2", "resnet50"):
        r = result["cases"][case]
        assert r["variants"]["tiledispatch"]["out_rel_err"] < 1e-5, r["variants"]
        assert r["variants"]["fused"]["out_rel_err"] < 1e-5 and r["variants"]["fused"]["out_within_tolerance"]
        # (inference) each variant against a float64 copy of the model too: float32 here, all near it
        assert all(v["out_rel_err_fp64"] < 1e-5 for v in r["variants"].values()), r["variants"]
        assert r["fuse_report"]["patch"]["unsupported"] == 0
        assert r["patch_report"]["unsupported"] == 0 and r["unsupported_layers"] == []
        assert r["layers"] and all("tiledispatch_ms" in row and "pytorch_ms" in row for row in r["layers"])
    for r in result["cases"].values():  # each variant also timed in rounds alternating with eager
        assert all(r["variants"][v]["speedup_vs_eager_paired"] > 0 for v in ("tiledispatch", "fused"))
        assert "speedup_vs_eager_paired" not in r["variants"]["eager"]
    # the training step: outputs and every gradient against eager's and against the float64 model's
    for name, v in result["cases"]["resnet50_train"]["variants"].items():
        assert v["out_within_tolerance"] and v["out_rel_err_fp64"] < 1e-5, (name, v)
        assert v["grad_rel_err_max"] < 1e-4 and v["grad_rel_err_fp64_max"] < 1e-4, (name, v)
    # the folded parameters alone in a float64 model: float32 folding here, so near the exact model
    assert 0 < result["cases"]["mobilenet_v2"]["folded_model_rel_err_fp64"] < 1e-5
    # MobileNetV2's stand-in: every conv with its folded batch norm (and ReLU6 / residual) in one call
    fused = result["cases"]["mobilenet_v2"]["fuse_report"]["fused"]
    assert len(fused) == 7 and all("batch norm folded" in f["epilogue"] for f in fused)
    assert result["host_overhead"]["tiledispatch.torch.linear"]["median_us"] > 0
    assert set(result["host_overhead"]["registration"]) == {"python function", "Library define + impl",
                                                            "torch.library.custom_op"}


def test_bench_models_runs_the_inverted_residual_models_on_the_cpu(reg, tmp_path):
    """models.py's EfficientNet-B0, MnasNet and MobileNetV3-Large stand-ins (5x5 depthwise, squeeze-excitation with
    sigmoid / hard-sigmoid gates, SiLU / hard-swish): every conv runs on the bundle, the patched and fused models match
    eager, and each block's expansion and depthwise conv fuse with their folded batch norms."""
    result = _bench_models_on_the_cpu(reg, tmp_path, "efficientnet_b0,mnasnet1_0,mobilenet_v3_large",
                                      "eager,tiledispatch,fused")
    for case, r in result["cases"].items():
        for name in ("tiledispatch", "fused"):
            v = r["variants"][name]
            assert v["out_rel_err"] < 1e-5 and v["out_within_tolerance"], (case, name, v)
        assert r["patch_report"]["unsupported"] == 0 and r["fuse_report"]["patch"]["unsupported"] == 0, case
        fused = r["fuse_report"]["fused"]
        assert sum("batch norm folded" in f["epilogue"] for f in fused) >= 8, (case, fused)
    # every hard-swish of the MobileNetV3 stand-in (after its stem, expansions, depthwise convs and head: 7) and
    # every hard-sigmoid gate (after each excitation's second conv: 3) is fused into the conv before it
    epilogues = [f["epilogue"] for f in result["cases"]["mobilenet_v3_large"]["fuse_report"]["fused"]]
    assert sum(e.endswith("hardswish") for e in epilogues) == 7
    assert sum(e.endswith("hardsigmoid") for e in epilogues) == 3


def test_bench_models_compiles_the_fused_model_on_the_cpu(reg, tmp_path):
    """models.py's fused_compile variant: torch.compile of the fused model (Inductor around the tiledispatch
    operators) matches eager, and the fused variant need not run beside it."""
    result = _bench_models_on_the_cpu(reg, tmp_path, "convnext_tiny", "eager,fused_compile")
    variants = result["cases"]["convnext_tiny"]["variants"]
    assert set(variants) == {"eager", "fused_compile"}, variants
    assert variants["fused_compile"]["out_rel_err"] < 1e-5 and variants["fused_compile"]["out_within_tolerance"]
    assert variants["fused_compile"]["speedup_vs_eager_paired"] > 0
    assert result["cases"]["convnext_tiny"]["fuse_report"]["patch"]["unsupported"] == 0


def test_bench_models_tolerance_is_eager_near_or_no_farther_from_float64():
    """models.py's accuracy verdict: a variant passes near eager's output, or when it is no farther from the float64
    model's output than eager is, by more than the tolerance (two fp16 computations of a deep model can differ by
    more than the tolerance while both are as near the exact result)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_models", REPO / "bench" / "benchmarks" / "models.py")
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    exact = torch.zeros(1000, dtype=torch.float64)
    exact[0] = 1.0
    eager_out = exact.clone()
    eager_out[1] = 0.02  # 2e-2 from the exact output
    eager = models.compare({"out": eager_out}, {"out": eager_out}, 0.01, {"out": exact}, None)
    assert eager["out_within_tolerance"] and eager["out_rel_err_fp64"] == pytest.approx(0.02)

    def variant(v1, v2):
        out = exact.clone()
        out[1], out[2] = v1, v2
        return models.compare({"out": out}, {"out": eager_out}, 0.01, {"out": exact}, eager)

    near = variant(0.0, 0.025)  # 3.2e-2 from eager, 2.5e-2 from the exact output: within 2e-2 + 1e-2
    assert near["out_rel_err"] > 0.01 and near["out_within_tolerance"]
    far = variant(0.0, 0.035)  # 3.5e-2 from the exact output
    assert not far["out_within_tolerance"]
    assert variant(0.025, 0.0)["out_within_tolerance"]  # 5e-3 from eager's output
    # without a float64 reference only the distance to eager counts
    assert not models.compare({"out": exact}, {"out": eager_out}, 0.01, None, None)["out_within_tolerance"]


@pytest.mark.parametrize("activation", list(td.reference.ACTIVATIONS))
def test_every_activation_has_its_torch_forms(activation):
    """tdt's torch forms of each activation (out of place, in place, and autograd's derivative from the saved
    output or the pre-activation) against the float64 reference and its central difference: a new activation
    without them fails here."""
    import numpy as np
    from tiledispatch.torch import _NEEDS_PRE, TORCH_ACTIVATIONS, _activation_grad

    assert activation in TORCH_ACTIVATIONS
    out_of_place, in_place, _ = TORCH_ACTIVATIONS[activation]
    clamp, h = (-0.5, 0.75), 1e-6
    f = td.reference.ACTIVATIONS[activation]
    pre = np.random.default_rng(7).uniform(-3, 3, 257)
    g = np.random.default_rng(8).uniform(0.5, 1.5, 257)
    ref = np.asarray(f(pre, *clamp), dtype=np.float64)
    assert np.allclose(out_of_place(torch.from_numpy(pre), clamp).numpy(), ref, rtol=1e-12, atol=1e-12)
    assert np.allclose(in_place(torch.from_numpy(pre.copy()), clamp).numpy(), ref, rtol=1e-12, atol=1e-12)
    expected = g * (f(pre + h, *clamp) - f(pre - h, *clamp)) / (2 * h)
    got = _activation_grad(torch.from_numpy(g), torch.from_numpy(ref),
                           torch.from_numpy(pre) if activation in _NEEDS_PRE else None, activation, clamp)
    assert np.allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6), activation
