"""Fusion in tiledispatch.torch on the cpu backend: the GEMM route follows what the kernels can run (a bias kernel
that refuses a shape falls back to beta * C), the conv operator's epilogue (bias, residual, activation: fused
kernels where the bundle has them, else the plain kernel + beta * Y + torch's activation) forward and backward
against float64 torch, and tdt.fuse() on small models shaped like ResNet, MobileNetV2 and ConvNeXt blocks in
eval and training mode, eagerly and under torch.compile(fullgraph=True).

The fused-kernel conv tests need a bundle with conv kernels fusing an epilogue: they build one when the cpu
backend's rules allow it and are skipped (with the rule's message) when they do not.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tiledispatch as td  # noqa: E402
import tiledispatch.torch as tdt  # noqa: E402
from conftest import REPO, build_cpu_bundle  # noqa: E402
from tiledispatch import abi  # noqa: E402
from tiledispatch.errors import SpecError  # noqa: E402
from tiledispatch.registry import Kernel, Registry  # noqa: E402

FUSION_SET = """\
schema: 1
name: fusion_test
description: small cpu kernels for the fusion tests
groups:
  - backend: cpu
    op: conv
    direction: [fwd, bwd_data, bwd_weight]
    spatial_dims: 2
    dtype: [fp32, fp16]
    layout: nhwgc
    pipeline: packed
    tile: [16, 16, 24]
    mma: [4, 16, 1]
  - backend: cpu
    op: gemm
    dtype: fp32
    layout: rcr
    pipeline: packed
    tile: [96, 256, 256]
    mma: [8, 32, 1]
    epilogue:
      - {activation: identity}
      - {activation: identity, bias: true}
      - {activation: identity, residuals: 1}
      - {activation: [relu, gelu_erf, silu], bias: true}
"""
# conv kernels fusing epilogues: built only where the cpu backend's rules allow them (see fused_reg)
FUSED_CONV_SET = """\
schema: 1
name: fused_conv_test
description: cpu conv kernels fusing bias, a residual and an activation
groups:
  - backend: cpu
    op: conv
    direction: fwd
    spatial_dims: 2
    dtype: fp32
    layout: nhwgc
    pipeline: packed
    tile: [16, 16, 24]
    mma: [4, 16, 1]
    epilogue:
      - {activation: identity, bias: true}
      - {activation: [relu, silu, hardswish, hardsigmoid], bias: true}
      - {activation: relu, bias: true, residuals: 1}
"""
TOL = 1e-5       # float32 kernels against float64 (the kernels' validation tolerance)
GRAD_TOL = 1e-4  # gradients: two convolutions or GEMMs and an activation's derivative
MODEL_TOL = 2e-5  # a fused float32 model against the unfused eager float32 model (batch norm folded: rounding)


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    # fp16: the essential GEMM set's kernels (rcr: plain, relu + bias, gelu_tanh + bias), for pointwise convs
    return build_cpu_bundle(tmp_path_factory.mktemp("fusion_build"), "fusion_test", FUSION_SET, "fp16_rcr_essential")


@pytest.fixture(scope="module")
def fused_reg(tmp_path_factory):
    from tiledispatch import backends
    from tiledispatch.generator import kernelset

    build = tmp_path_factory.mktemp("fused_conv_build")
    spec = build / "fused_conv_test.yaml"
    spec.write_text(FUSED_CONV_SET)
    try:
        kernelset.expand_file(spec, "cpu", backends.get("cpu").detect_arch())
    except SpecError as e:
        pytest.skip(f"the cpu backend builds no conv kernels fusing an epilogue: {str(e).splitlines()[0]}")
    return build_cpu_bundle(build, "fused_conv_test", FUSED_CONV_SET + FUSION_SET.split("groups:\n", 1)[1])


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "the output holds NaN or inf"
    # a reference of zeros (a gradient through relu's flat side) compares by the difference's norm alone
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def rand(*shape, seed=0, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return ((torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1) * scale).to(dtype)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


# -- #17: the GEMM route follows what the kernels can run ------------------------------------------------------
class _AlignedLibrary(abi.KernelLibrary):
    """A kernel library whose td_can_run also refuses n % 8 != 0, as a GPU kernel with 8-element aligned output
    rows does; the rest (and every launch it admits) is the real cpu kernel's."""

    def __init__(self, real: abi.KernelLibrary):
        self.__dict__.update(real.__dict__)

    def can_run(self, args):
        n = args.tensors[3].shape[2]  # D [batch, m, n]
        if n % 8:
            return abi.UNSUPPORTED, f"n = {n} is not a multiple of 8 (aligned output rows)"
        return super().can_run(args)


def test_gemm_route_falls_back_to_beta_c_where_the_bias_kernel_cannot_run(reg, monkeypatch):
    """A linear with bias runs on the bias-fused kernel where that kernel can run the problem and through beta * C
    on the plain kernel where it cannot (an unaligned n): whether a bias kernel exists does not decide it; nor, for
    an activation, whether a kernel computing it exists."""
    kernels = [Kernel(k.key, k.path, library=_AlignedLibrary(k.library) if k.key.signature.epilogue.bias
                      else k.library) for k in reg.kernels]
    restricted = Registry(kernels, reg.backend, reg.arch)
    calls = []
    original = Registry.gemm

    def spy(self, a, b, out=None, **kw):
        calls.append("bias kernel" if kw.get("bias") is not None else ("beta * C" if kw.get("beta") else "plain"))
        return original(self, a, b, out, **kw)

    monkeypatch.setattr(Registry, "gemm", spy)
    x = rand(9, 16, seed=1)
    for n, route in ((24, "bias kernel"), (23, "beta * C")):
        w, b = rand(n, 16, seed=2), rand(n, seed=3)
        for call in range(2):  # the second call takes the cached route; on the bias kernel (the operands passed
            # as they are) it launches the remembered kernel without entering Registry.gemm
            out = tdt.linear(x, w, b, registry=restricted)
            assert calls == ([] if call and route == "bias kernel" else [route]), (n, call)
            calls.clear()
            assert rel_err(out, F.linear(x.double(), w.double(), b.double())) < TOL
    # with an activation: the relu + bias kernel where it runs; where it cannot (and this bundle has no relu kernel
    # without a bias), the plain kernel with the bias through beta * C, and torch's relu after it
    for n, route in ((24, "bias kernel"), (23, "beta * C")):
        w, b = rand(n, 16, seed=4), rand(n, seed=5)
        out = tdt.linear(x, w, b, registry=restricted, activation="relu")
        assert calls == [route], n
        calls.clear()
        assert rel_err(out, F.linear(x.double(), w.double(), b.double()).relu()) < TOL


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_gemm_route_takes_a_residual_through_beta_c_on_the_activation_and_bias_kernel(reg, monkeypatch, activation):
    """act(x @ w^T + b + r) where the bundle has act + bias kernels but none with a residual nor act alone: the act +
    bias kernel with the residual as C (beta 1), forward and backward against float64 torch."""
    calls = []
    original = Registry.gemm

    def spy(self, a, b, out=None, **kw):
        calls.append((kw.get("bias") is not None, kw.get("beta"), kw.get("c") is out, kw.get("activation")))
        return original(self, a, b, out, **kw)

    monkeypatch.setattr(Registry, "gemm", spy)
    x, w, b, r = leaf(rand(3, 7, 16, seed=11)), leaf(rand(24, 16, seed=12)), leaf(rand(24, seed=13)), \
        leaf(rand(3, 7, 24, seed=14))
    out = tdt.linear(x, w, b, registry=reg, residuals=(r,), activation=activation)
    assert calls[0] == (True, 1.0, True, activation)
    xr, wr, br, rr = leaf(x.double()), leaf(w.double()), leaf(b.double()), leaf(r.double())
    ref = TORCH_ACT[activation](F.linear(xr, wr, br) + rr)
    assert rel_err(out, ref) < TOL
    g = rand(*out.shape, seed=15)
    out.backward(g)
    ref.backward(g.double())
    for name, mine, theirs in (("x", x, xr), ("w", w, wr), ("bias", b, br), ("residual", r, rr)):
        assert rel_err(mine.grad, theirs.grad) < GRAD_TOL, name


# -- conv epilogues: the fallback (no fused conv kernels in this bundle) -------------------------------------------
TORCH_ACT = {"identity": lambda v: v, "relu": torch.relu, "clamp": lambda v: v.clamp(-0.3, 0.4),
             "sigmoid": torch.sigmoid, "tanh": torch.tanh, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"),
             "gelu_erf": F.gelu, "silu": F.silu, "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid}


def _conv_inputs(seed=0):
    x = rand(2, 6, 9, 8, seed=seed)
    w = rand(9, 2, 3, 3, seed=seed + 1)      # groups 3
    b = rand(9, seed=seed + 2, scale=0.5)
    r = rand(2, 9, 5, 8, seed=seed + 3)      # the output's shape: stride (2, 1), padding 1
    return x, w, b, r, dict(stride=(2, 1), padding=1, groups=3)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("activation", list(TORCH_ACT))
def test_conv_epilogue_forward_and_grads(reg, activation, residual):
    x, w, b, r, geo = _conv_inputs()
    clamp = (-0.3, 0.4) if activation == "clamp" else None
    xs, ws, bs, rs = leaf(x), leaf(w), leaf(b), leaf(r)
    out = tdt.conv(xs, ws, bs, registry=reg, residuals=(rs,) if residual else (), activation=activation,
                   clamp=clamp, **geo)
    xr, wr, br, rr = leaf(x.double()), leaf(w.double()), leaf(b.double()), leaf(r.double())
    ref = TORCH_ACT[activation](F.conv2d(xr, wr, br, **geo) + (rr if residual else 0))
    assert out.shape == ref.shape and tdt._is_channels_last(out)
    assert rel_err(out, ref) < TOL
    g = rand(*out.shape, seed=9)
    out.backward(g)
    ref.backward(g.double())
    for name, mine, theirs in (("x", xs, xr), ("w", ws, wr), ("bias", bs, br)) + ((("residual", rs, rr),)
                                                                                  if residual else ()):
        assert rel_err(mine.grad, theirs.grad) < GRAD_TOL, (activation, name)
    with torch.no_grad():  # the inference path (no autograd Function) computes the same
        again = tdt.conv(x, w, b, registry=reg, residuals=(r,) if residual else (), activation=activation,
                         clamp=clamp, **geo)
    assert torch.equal(again, out.detach())


def test_conv_epilogue_without_bias_and_with_a_nchw_residual(reg):
    x, w, _, r, geo = _conv_inputs(seed=5)
    r_cl = r.contiguous(memory_format=torch.channels_last)
    for res in (r, r_cl):
        out = tdt.conv(x, w, registry=reg, residuals=(res,), activation="relu", **geo)
        assert rel_err(out, torch.relu(F.conv2d(x.double(), w.double(), **geo) + r.double())) < TOL


def test_conv_epilogue_refusals_are_clear(reg):
    x, w, b, r, geo = _conv_inputs()
    with pytest.raises(td.InvalidInputError, match=r"residual 0 has shape \[2, 9, 1, 1\], expected \[2, 9, 5, 8\]"):
        tdt.conv(x, w, b, registry=reg, residuals=(r[:, :, :1, :1],), **geo)  # no broadcasting
    with pytest.raises(td.InvalidInputError, match="unknown activation 'swish'"):
        tdt.conv(x, w, b, registry=reg, activation="swish", **geo)
    with pytest.raises(td.InvalidInputError, match="residual 0 has dtype"):
        tdt.conv(x, w, b, registry=reg, residuals=(r.double(),), **geo)
    with pytest.raises(td.InvalidInputError, match="bias has shape"):
        tdt.conv(x, w, b[:-1], registry=reg, activation="relu", **geo)


def test_conv_epilogue_fake_implementation_and_operator(reg):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w, b, r, geo = _conv_inputs()
    h = tdt.register(reg)
    args = ([2, 1], [1, 1], [1, 1], [1, 1], 3, h)
    y = torch.ops.tiledispatch.conv_fwd(x, w, b, [r], "clamp", -0.3, 0.4, *args)
    assert rel_err(y, (F.conv2d(x.double(), w.double(), b.double(), **geo) + r.double()).clamp(-0.3, 0.4)) < TOL
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.tiledispatch.conv_fwd(*(mode.from_tensor(t) for t in (x, w, b)), [mode.from_tensor(r)],
                                               "clamp", -0.3, 0.4, *args)
    assert (fake.shape, fake.stride(), fake.dtype) == (y.shape, y.stride(), y.dtype)


def test_pointwise_conv_epilogue_runs_on_a_fused_gemm_kernel(reg, monkeypatch):
    """A 1x1 fp16 conv (a GEMM over pixels; fp32 convs stay on conv kernels, as ops/conv_as_gemm.py keeps them)
    takes its epilogue into one call of a GEMM kernel fusing it: bias + relu fused, a residual through beta * C;
    relu after a residual (fp16_rcr_essential has no kernel fusing a residual): the relu + bias kernel with the
    residual through beta * C."""
    calls = []
    original = Registry.gemm

    def spy(self, a, b, out=None, **kw):
        calls.append((kw.get("activation"), kw.get("bias") is not None, bool(kw.get("beta"))))
        return original(self, a, b, out, **kw)

    monkeypatch.setattr(Registry, "gemm", spy)
    h = torch.float16
    x = rand(2, 12, 5, 7, seed=40, dtype=h).contiguous(memory_format=torch.channels_last)
    w, b, r = rand(16, 12, 1, 1, seed=41, dtype=h), rand(16, seed=42, dtype=h), rand(2, 16, 5, 7, seed=43, dtype=h)
    cases = (("relu", (), ("relu", True, False)), ("identity", (r,), ("identity", False, True)),
             ("relu", (r,), ("relu", True, True)))
    for activation, residuals, want in cases:
        calls.clear()
        xs, ws, bs = leaf(x), leaf(w), leaf(b)
        out = tdt.conv(xs, ws, bs, registry=reg, residuals=residuals, activation=activation)
        assert calls[:1] == ([want] if want else []), (activation, calls)
        ref = TORCH_ACT[activation](F.conv2d(x.double(), w.double(), b.double()) + sum(t.double() for t in residuals))
        assert rel_err(out, ref) < 2e-3 and tdt._is_channels_last(out) and out.dtype == h
        out.backward(torch.ones_like(out))
        xr, wr, br = leaf(x.double()), leaf(w.double()), leaf(b.double())
        TORCH_ACT[activation](F.conv2d(xr, wr, br) + sum(t.double() for t in residuals)).sum().backward()
        for mine, theirs in ((xs, xr), (ws, wr), (bs, br)):
            assert rel_err(mine.grad, theirs.grad) < 1e-2, activation


# -- conv epilogues: fused conv kernels (where the backend builds them) ---------------------------------------
def _conv_fwd_calls(monkeypatch) -> list:
    calls = []
    original = Registry.conv_fwd

    def spy(self, x, w, out=None, **options):
        calls.append({k: options.get(k) for k in ("bias", "residuals", "activation")})
        return original(self, x, w, out, **options)

    monkeypatch.setattr(Registry, "conv_fwd", spy)
    return calls


def test_a_bias_gradient_from_the_native_backward_plan(fused_reg, monkeypatch):
    """A conv whose forward fuses the bias (so its launch is remembered) trains through the native node's backward
    plan from the second step: dX and dW launched, the bias gradient summed in C++, all exact."""
    assert td.native.torch_fastpath() is not None, "the native module was not built: see its .failed file"
    fused_reg.clear_caches()
    python_backward = tdt._conv_backward
    calls = []
    monkeypatch.setattr(tdt, "_conv_backward", lambda *a: calls.append(1) or python_backward(*a))
    for step in range(3):
        x, w, b, _, geo = _conv_inputs(seed=20 + step)
        geo["stride"] = 1  # a strided input gradient runs by stride phases: no single launch to plan
        xs, ws, bs = leaf(x), leaf(w), leaf(b)
        out = tdt.conv(xs, ws, bs, registry=fused_reg, **geo)
        xr, wr, br = leaf(x.double()), leaf(w.double()), leaf(b.double())
        ref = F.conv2d(xr, wr, br, **geo)
        g = rand(*out.shape, seed=30 + step)
        out.backward(g)
        ref.backward(g.double())
        for mine, theirs in ((xs, xr), (ws, wr), (bs, br)):
            assert rel_err(mine.grad, theirs.grad) < GRAD_TOL, step
    assert len(calls) == 1  # the first step's, which made the plan


@pytest.mark.parametrize("activation,residual", [("identity", False), ("relu", False), ("silu", False),
                                                 ("hardswish", False), ("hardsigmoid", False), ("relu", True)])
def test_fused_conv_kernels_run_the_whole_epilogue(fused_reg, monkeypatch, activation, residual):
    calls = _conv_fwd_calls(monkeypatch)
    x, w, b, r, geo = _conv_inputs(seed=11)
    xs, ws, bs, rs = leaf(x), leaf(w), leaf(b), leaf(r)
    out = tdt.conv(xs, ws, bs, registry=fused_reg, residuals=(rs,) if residual else (), activation=activation,
                   **geo)
    assert calls and calls[-1]["activation"] == activation and calls[-1]["bias"] is not None  # one fused call
    assert len(calls[-1]["residuals"]) == int(residual)
    xr, wr, br, rr = leaf(x.double()), leaf(w.double()), leaf(b.double()), leaf(r.double())
    ref = TORCH_ACT[activation](F.conv2d(xr, wr, br, **geo) + (rr if residual else 0))
    assert rel_err(out, ref) < TOL
    g = rand(*out.shape, seed=12)
    out.backward(g)
    ref.backward(g.double())
    for mine, theirs in ((xs, xr), (ws, wr), (bs, br)) + (((rs, rr),) if residual else ()):
        assert rel_err(mine.grad, theirs.grad) < GRAD_TOL, activation
    # an epilogue the bundle does not fuse (gelu) still runs: the plain kernel, torch's activation
    calls.clear()
    out = tdt.conv(x, w, b, registry=fused_reg, activation="gelu_erf", **geo)
    assert rel_err(out, F.gelu(F.conv2d(x.double(), w.double(), b.double(), **geo))) < TOL
    assert not calls  # no fused call was attempted


def test_a_fused_kernel_rated_far_slower_than_the_plain_one_is_not_taken(fused_reg, monkeypatch):
    """Where the cost model rates the kernel fusing the epilogue above twice the plain kernel (a set's fallback
    kernel, as a depthwise 7x7 with a clamp met on the cutlass essential set before its 7x7 tiles fused one), the
    conv runs on the plain kernel with the bias through beta * Y and torch's activation; where it rates them alike,
    on the fused kernel."""
    from tiledispatch import selection

    x, w, b, _, geo = _conv_inputs(seed=40)
    ref = F.silu(F.conv2d(x.double(), w.double(), b.double(), **geo))
    rated = selection.estimated_cost
    for slowdown, fused_call in ((1.5, True), (3.0, False)):
        monkeypatch.setattr(selection, "estimated_cost", lambda problem, key: rated(problem, key) * (
            slowdown if key.signature.epilogue.activation != "identity" else 1.0))
        monkeypatch.setattr(tdt, "_CONV_ROUTES", {})
        fused_reg.clear_caches()
        calls = _conv_fwd_calls(monkeypatch)
        out = tdt.conv(x, w, b, registry=fused_reg, activation="silu", **geo)
        assert rel_err(out, ref) < TOL, slowdown
        assert list(tdt._CONV_ROUTES.values()) == (["conv"] if fused_call else [None]), slowdown
        assert [c["activation"] for c in calls] == (["silu"] if fused_call else []), slowdown  # plain: conv_op.run


# -- fuse(): small models shaped like the real ones ------------------------------------------------------------
class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: out = relu(bn2(conv2(relu(bn1(conv1(x))))) + downsample(x))."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class Bottleneck(nn.Module):
    """torchvision's ResNet Bottleneck (1x1, 3x3, 1x1, residual, relu)."""

    def __init__(self, c, mid):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, c, 1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 16, stride=2), Bottleneck(16, 8))
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layer1(self.stem(x)), 1), 1))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: pointwise expand + BN + ReLU6, depthwise 3x3 + BN + ReLU6, pointwise project + BN, and
    the residual add (no activation after it)."""

    def __init__(self, c, expand):
        super().__init__()
        e = c * expand
        self.conv = nn.Sequential(nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e), nn.ReLU6(inplace=True),
                                  nn.Conv2d(e, e, 3, 1, 1, groups=e, bias=False), nn.BatchNorm2d(e),
                                  nn.ReLU6(inplace=True), nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.conv(x)


class TinyMobileNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=True),
                                      InvertedResidual(8, 4), InvertedResidual(8, 2))

    def forward(self, x):
        return self.features(x).mean((2, 3))


class CNBlock(nn.Module):
    """ConvNeXt's block: depthwise 7x7 (bias), LayerNorm on channels-last tokens, Linear -> GELU -> Linear, layer
    scale, residual."""

    def __init__(self, c):
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.pwconv1, self.act, self.pwconv2 = nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.rand(c) + 0.25)

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


def stochastic_depth(input, p: float, mode: str, training: bool = True):
    """Stands for torchvision.ops.stochastic_depth (which fx keeps as a call): its input in eval mode."""
    if not training or p == 0.0:
        return input
    raise NotImplementedError("these tests run it in eval mode")


stochastic_depth.__module__ = "torchvision.ops.stochastic_depth"
torch.fx.wrap("stochastic_depth")


class Permute(nn.Module):  # as torchvision.ops.misc.Permute
    def __init__(self, dims):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return torch.permute(x, self.dims)


class TorchvisionCNBlock(nn.Module):
    """torchvision's ConvNeXt block: permutes as modules, the layer scale (C, 1, 1) after the permute back, then
    stochastic depth and an in-place residual add."""

    def __init__(self, c):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(c, c, 7, padding=3, groups=c), Permute([0, 2, 3, 1]),
                                   nn.LayerNorm(c, eps=1e-6), nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c),
                                   Permute([0, 3, 1, 2]))
        self.layer_scale = nn.Parameter(torch.rand(c, 1, 1) + 0.25)

    def forward(self, input):
        result = self.layer_scale * self.block(input)
        result = stochastic_depth(result, 0.1, "row", self.training)
        result += input
        return result


class TinyConvNeXt(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 4, stride=4)
        self.blocks = nn.Sequential(CNBlock(8), CNBlock(8), TorchvisionCNBlock(8))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def make(cls, seed=0):
    """The model with non-trivial batch-norm statistics and affine parameters (so that folding changes numbers)."""
    torch.manual_seed(seed)
    model = cls()
    g = torch.Generator().manual_seed(seed + 100)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.rand(m.num_features, generator=g) - 0.5)
    return model


def _fused_parts(report) -> dict:
    """name -> (kind, parts, epilogue), a residual operand's node name ("+ name") written as "+"."""
    return {f.name: (f.kind, ["+" if p.startswith("+ ") else p for p in f.parts], f.epilogue) for f in report.fused}


def test_fuse_resnet_blocks_in_eval_mode(reg):
    model = make(TinyResNet).eval()
    twin = copy.deepcopy(model)
    x = rand(2, 3, 16, 16, seed=20)
    fused, report = tdt.fuse(model, reg)
    parts = _fused_parts(report)
    assert parts["stem.0"] == ("FusedConv", ["stem.0", "stem.1", "stem.2"], "bias (batch norm folded), relu")
    # BasicBlock: conv1 -> bn1 -> relu; conv2 -> bn2 -> (+ identity) -> relu; the downsample conv -> bn
    assert parts["layer1.0.conv1"][1] == ["layer1.0.conv1", "layer1.0.bn1", "layer1.0.relu"]
    assert parts["layer1.0.conv2"][1] == ["layer1.0.conv2", "layer1.0.bn2", "+", "layer1.0.relu"]
    assert parts["layer1.0.conv2"][2] == "bias (batch norm folded) + residual, relu"
    assert parts["layer1.1.conv2"][1][:2] == ["layer1.1.conv2", "layer1.1.bn2"]
    assert parts["layer1.1.downsample.0"][2] == "bias (batch norm folded)"
    assert parts["layer1.2.conv3"][2] == "bias (batch norm folded) + residual, relu"  # Bottleneck's last conv
    assert len(report.fused) == 9 and not report.untraced
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fused.modules())  # every batch norm folded
    assert [r.name for r in report.patch.layers] == ["fc"] and not report.patch.unsupported
    with torch.no_grad():
        out, ref = fused(x), twin(x)
    assert rel_err(out, ref) < MODEL_TOL
    # eval mode with gradients (frozen batch norms): the input's gradient is the unfused model's
    xs, xr = leaf(x), leaf(x)
    fused(xs).square().sum().backward()
    twin(xr).square().sum().backward()
    assert rel_err(xs.grad, xr.grad) < GRAD_TOL
    assert all(p.grad is not None for p in fused.parameters())  # the folded layers' own parameters train
    # the model passed in is unchanged, and a fused-with-folding model refuses to train
    assert all(a is not b and torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                 twin.state_dict().values()))
    fused.train()
    with pytest.raises(RuntimeError, match="batch norm folded"):
        fused(x)
    assert "9 fused layer(s)" in str(report) and report.to_dict()["fused"][0]["name"] == "stem.0"


def test_fuse_mobilenet_inverted_residuals_in_eval_mode(reg):
    model = make(TinyMobileNet).eval()
    x = rand(2, 3, 12, 12, seed=21)
    fused, report = tdt.fuse(model, reg)
    parts = _fused_parts(report)
    assert parts["features.3.conv.0"][2] == "bias (batch norm folded), clamp(0.0, 6.0)"       # ReLU6
    depthwise = fused.get_submodule("features.3.conv.3")
    assert isinstance(depthwise, tdt.FusedConv) and depthwise.groups == 32 and depthwise.activation == "clamp"
    assert parts["features.3.conv.6"][1] == ["features.3.conv.6", "features.3.conv.7", "+"]  # residual, no act
    assert parts["features.3.conv.6"][2] == "bias (batch norm folded) + residual"
    assert len(report.fused) == 7
    with torch.no_grad():
        assert rel_err(fused(x), model(x)) < MODEL_TOL


class SqueezeExcitedBlock(nn.Module):
    """EfficientNet's MBConv as torchvision writes it: pointwise expand + BN + SiLU, depthwise + BN + SiLU, the
    squeeze-excitation (average pool, fc1, SiLU, fc2, sigmoid, scale * input), pointwise project + BN, residual."""

    def __init__(self, c, expand):
        super().__init__()
        e = c * expand
        self.expand = nn.Sequential(nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e), nn.SiLU())
        self.depthwise = nn.Sequential(nn.Conv2d(e, e, 3, 1, 1, groups=e, bias=False), nn.BatchNorm2d(e), nn.SiLU())
        self.fc1, self.fc2 = nn.Conv2d(e, c // 2, 1), nn.Conv2d(c // 2, e, 1)
        self.project = nn.Sequential(nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        h = self.depthwise(self.expand(x))
        scale = torch.sigmoid(self.fc2(F.silu(self.fc1(F.adaptive_avg_pool2d(h, 1)))))
        return x + self.project(scale * h)


@pytest.mark.parametrize("fold_from", [0, 10 ** 9])  # every map folds / none does
def test_a_squeeze_excitation_scale_is_taken_into_the_projection(reg, monkeypatch, fold_from):
    """scale * h -> pointwise conv -> BN -> + residual is one FusedScaledConv: on maps where the rule folds, a
    batched GEMM on the weight scaled per sample (no multiply of h), elsewhere on h * scale; output and the input's
    gradient as the unfused model's. A product of two maps (no per-sample scale) runs as the model's multiply."""
    from tiledispatch import torch_fusion as tdf
    monkeypatch.setattr(tdf, "_FOLD_MIN_PIXELS", fold_from)
    model = make(lambda: SqueezeExcitedBlock(8, 4)).eval()
    fused, report = tdt.fuse(model, reg)
    project = fused.get_submodule("project.0")
    assert isinstance(project, tdf.FusedScaledConv)
    parts = _fused_parts(report)["project.0"]
    assert parts[1][0].startswith("mul (") and parts[1][1:] == ["project.0", "project.1", "+"]
    batched = []
    matmul = tdt._matmul

    def spy(a, b, *args, **kw):
        batched.append(a.dim() == 3)
        return matmul(a, b, *args, **kw)
    monkeypatch.setattr(tdt, "_matmul", spy)
    x = rand(2, 8, 16, 16, seed=30)
    with torch.no_grad():
        assert rel_err(fused(x), model(x)) < MODEL_TOL
    assert any(batched) == (fold_from == 0)
    xs, xr = leaf(x), leaf(x)
    fused(xs).square().sum().backward()
    model(xr).square().sum().backward()
    assert rel_err(xs.grad, xr.grad) < GRAD_TOL
    h = rand(2, 32, 16, 16, seed=31)
    with torch.no_grad():  # both factors full maps: the model's multiply, then the conv
        want = model.project(h * h) + 0
        assert rel_err(project(h, h), want) < MODEL_TOL
    if fold_from:
        return
    # traced whole by torch.compile: the batched GEMM is the operator's call in the graph
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return make_boxed_func(gm.forward)
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend=aot_autograd(fw_compiler=capture))
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < MODEL_TOL
    assert "tiledispatch.gemm.default" in graphs[0] and "aten.mul.Tensor" in graphs[0]  # (the weight's scaling)


def test_fuse_convnext_blocks_linear_gelu(reg):
    """linear -> GELU, and linear -> layer scale -> permute -> + residual with the scale folded: in both the
    block written as the test's CNBlock and as torchvision's (permute modules, a (C, 1, 1) scale after the permute,
    stochastic depth, an in-place add); channels-first and channels-last inputs (the residual a strided view, or
    a dense one); eval mode with gradients; a model fused in training mode keeps its scales."""
    model = make(TinyConvNeXt).eval()
    twin = copy.deepcopy(model)
    x = rand(2, 3, 16, 16, seed=22)
    fused, report = tdt.fuse(model, reg)
    parts = _fused_parts(report)
    assert set(parts) == {"blocks.0.pwconv1", "blocks.0.pwconv2", "blocks.1.pwconv1", "blocks.1.pwconv2",
                          "blocks.2.block.3", "blocks.2.block.5"}
    assert parts["blocks.0.pwconv1"] == ("FusedLinear", ["blocks.0.pwconv1", "blocks.0.act"], "bias, gelu_erf")
    assert parts["blocks.0.pwconv2"] == ("FusedLinear", ["blocks.0.pwconv2", "mul (mul)", "permute (permute_1)", "+"],
                                         "bias (scale folded) + residual")
    assert parts["blocks.2.block.5"] == ("FusedLinear", ["blocks.2.block.5", "permute (permute_5)", "mul (mul_2)",
                                                         "stochastic_depth (stochastic_depth)", "+"],
                                         "bias (scale folded) + residual")
    patched = {r.name for r in report.patch.patched}
    assert {"stem", "blocks.0.dwconv", "head"} <= patched and not report.patch.unsupported
    with torch.no_grad():
        assert rel_err(fused(x), model(x)) < MODEL_TOL
        dense = x.contiguous(memory_format=torch.channels_last)
        assert rel_err(fused(dense), model(dense)) < MODEL_TOL
    xs, xr = leaf(x), leaf(x)
    fused(xs).square().sum().backward()
    twin(xr).square().sum().backward()
    assert rel_err(xs.grad, xr.grad) < GRAD_TOL
    fused.train()
    with pytest.raises(RuntimeError, match="scale folded"):
        fused(x)
    _, report = tdt.fuse(make(TinyConvNeXt).train(), reg)
    assert {f.name for f in report.fused} == {"blocks.0.pwconv1", "blocks.1.pwconv1", "blocks.2.block.3"}


class Scaled(nn.Module):
    """A linear whose output is multiplied by a tensor of the model along one axis or another (then a residual of
    the model's added, where one is given: a broadcast add)."""

    def __init__(self, scale_shape, dims=None, residual_shape=None):
        super().__init__()
        self.linear, self.dims = nn.Linear(6, 5), dims
        self.s = nn.Parameter(torch.rand(scale_shape) + 0.5)
        self.r = None if residual_shape is None else nn.Parameter(torch.rand(residual_shape))

    def forward(self, x):
        y = self.linear(x)
        y = (y if self.dims is None else y.permute(*self.dims)) * self.s
        return y if self.r is None else y + self.r


@pytest.mark.parametrize("shape, dims, residual, folds", [
    ((5,), None, None, True), ((5, 1), (0, 2, 1), None, True), ((5,), (0, 2, 1), None, False),
    ((1, 5), None, None, False), ((1,), None, None, False), ((5, 1), (0, 2, 1), (5, 1), True),
    ((5, 1), (0, 2, 1), (1, 5, 1), True)])
def test_a_scale_folds_only_along_the_output_features(reg, shape, dims, residual, folds):
    """(5,) on the features (last), (5, 1) on the features moved to the middle: folded. (5,) after that permute
    scales the other axis, (1, 5) would broadcast to another rank, (1,) is one value: left to torch. A residual of
    another rank or shape after the permute is added by torch, in the chain's layout."""
    model = Scaled(shape, dims, residual).eval()
    x = rand(2, 5, 6, seed=23)  # as many rows as features: a scale along either axis broadcasts
    fused, report = tdt.fuse(model, reg)
    assert bool(report.fused) == folds
    with torch.no_grad():
        out, ref = fused(x), model(x)
    assert out.shape == ref.shape and rel_err(out, ref) < MODEL_TOL


def test_fuse_keeps_an_activation_the_bundle_has_no_gemm_kernel_for(reg):
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 4), nn.SiLU())
    fused, report = tdt.fuse(model, reg)
    assert [f.name for f in report.fused] == ["2"] and report.fused[0].epilogue == "bias, silu"
    assert report.kept == [("1", "the bundle has no fp32 GEMM kernel computing gelu_tanh: stays PyTorch's")]
    x = rand(5, 8, seed=23)
    with torch.no_grad():
        assert rel_err(fused(x), model(x)) < MODEL_TOL


class TrainNet(nn.Module):
    """Batch norms (a BasicBlock), conv + bias + SiLU, a 1x1 conv + residual + ReLU, Linear + ReLU."""

    def __init__(self):
        super().__init__()
        self.block = BasicBlock(4, 4)
        self.conv = nn.Conv2d(4, 6, 3, padding=1)
        self.act = nn.SiLU()
        self.proj = nn.Conv2d(6, 4, 1)
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        y = self.block(x)
        y = F.relu(self.proj(self.act(self.conv(y))) + y)
        return self.fc2(F.relu(self.fc1(y.mean((2, 3)))))


def test_fuse_in_training_mode_is_exact_and_trains(reg):
    """Training mode: batch norms stay PyTorch's (batch statistics), conv + bias + activation and residual adds
    are fused; outputs, gradients and the batch norms' running statistics match the unfused model."""
    model = make(TrainNet).train()
    twin = copy.deepcopy(model)
    fused, report = tdt.fuse(model, reg)
    parts = _fused_parts(report)
    assert parts["conv"] == ("FusedConv", ["conv", "act"], "bias, silu")
    assert parts["proj"] == ("FusedConv", ["proj", "+", "relu (relu)"], "bias + residual, relu")
    assert parts["fc1"] == ("FusedLinear", ["fc1", "relu (relu_1)"], "bias, relu")
    assert ("block.bn1", "batch norm in training mode (batch statistics stay PyTorch's)") in report.kept
    assert any(isinstance(m, nn.BatchNorm2d) for m in fused.modules())
    x = rand(3, 4, 6, 6, seed=24)
    out, ref = fused(x), twin(x)
    assert rel_err(out, ref) < MODEL_TOL
    g = rand(*out.shape, seed=25)
    out.backward(g)
    ref.backward(g)
    mine = dict(fused.named_parameters())
    for name, p in twin.named_parameters():
        assert rel_err(mine[name].grad, p.grad) < GRAD_TOL, name
    for (name, a), b in zip(fused.named_buffers(), twin.buffers()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6), name


def test_fuse_inside_modules_fx_cannot_trace(reg):
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Bottleneck(8, 4)
            self.other = nn.Sequential(nn.Conv2d(8, 8, 1), nn.ReLU())

        def forward(self, x):
            if x.sum() > 0:  # control flow on a tensor's value: torch.fx cannot trace this module
                return self.block(x)
            return self.other(x)

    model = make(DataDependent).eval()
    fused, report = tdt.fuse(model, reg)
    assert report.untraced and report.untraced[0][0] == "" and "TraceError" in report.untraced[0][1]
    assert {f.name for f in report.fused} == {"block.conv1", "block.conv2", "block.conv3", "other.0"}
    assert type(fused) is DataDependent and isinstance(fused.block, torch.fx.GraphModule)
    for sign in (1, -1):
        x = sign * (rand(2, 8, 5, 5, seed=26) + 1.5)
        with torch.no_grad():
            assert rel_err(fused(x), model(x)) < MODEL_TOL, sign


def test_fuse_leaves_shared_and_tied_layers(reg):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.tied, self.act = nn.Linear(6, 6), nn.Linear(6, 6), nn.ReLU()

        def forward(self, x):
            x = self.act(self.shared(self.act(self.shared(x))))   # one module, two calls
            return F.linear(self.act(self.tied(x)), self.tied.weight)  # its weight read by the graph itself

    model = make(Net).eval()
    fused, report = tdt.fuse(model, reg)
    assert not report.fused
    assert [why.split(":")[0] for _, why in report.kept] == ["the module is called more than once"] * 2 + [
        "the model reads the module's parameters itself (tied weights)"]
    x = rand(3, 6, seed=29)
    with torch.no_grad():
        assert rel_err(fused(x), model(x)) < MODEL_TOL


def test_fused_residual_that_broadcasts_is_added_by_torch(reg):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.lin = nn.Linear(4, 4)
            self.shift = nn.Parameter(torch.linspace(-1, 1, 4).view(1, 4, 1, 1))

        def forward(self, x):
            y = torch.relu(self.conv(x) + self.shift)  # a broadcast add: fused, added by torch at run time
            return torch.relu(self.lin(y.mean((2, 3))) + self.shift.flatten())

    model = make(Net).eval()
    fused, report = tdt.fuse(model, reg)
    # the linear's relu after a residual: the relu + bias kernel with the residual through beta * C takes it (this
    # residual broadcasts at run time, so there torch adds it and applies the relu)
    assert {f.name: f.epilogue for f in report.fused} == {"conv": "bias + residual, relu",
                                                           "lin": "bias + residual, relu"}
    assert report.kept == []
    x = rand(2, 4, 5, 5, seed=27)
    with torch.no_grad():
        assert rel_err(fused(x), model(x)) < MODEL_TOL


def test_compile_fullgraph_as_a_process_first_call(reg, tmp_path):
    """torch.compile(fullgraph=True) of a fused model whose parameters require grad, as the first tiledispatch call
    of a fresh process, in eval and in training mode: the native module is not resolved yet, and tracing must not
    try to (resolving it takes a lock, which Dynamo refuses to trace: 'Unsupported context manager'), nor may the
    traced backward pass reset the thread's launch record (a side effect outside the autograd.Function). Earlier
    calls in this process resolved the module and set the record, so this runs in a new one."""
    bundle = reg.kernels[0].path.parents[1]
    script = tmp_path / "first_call.py"
    script.write_text(f"""
import torch
from torch import nn
import tiledispatch as td
import tiledispatch.torch as tdt
reg = td.load({str(bundle)!r})
model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 7, 5)).eval()
fused, report = tdt.fuse(model, reg)
assert report.fused
x = torch.randn(2, 3, 6, 7)
out = torch.compile(fused, fullgraph=True, backend="aot_eager")(x)
ref = model(x)
assert ((out - ref).norm() / ref.norm()).item() < 1e-5
# training: the backward pass is traced too (inside the autograd.Function it may change no state outside it)
model.train()
fused, report = tdt.fuse(model, reg)
xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
torch.compile(fused, fullgraph=True, backend="aot_eager")(xs).square().sum().backward()
model(xr).square().sum().backward()
assert ((xs.grad - xr.grad).norm() / xr.grad.norm()).item() < 1e-5
print("ok")
""")
    env = {**os.environ, "PYTHONPATH": str(REPO / "runtime")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_compile_fullgraph_of_a_fused_model(reg, mode):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append([n for n in gm.graph.nodes if n.op == "call_function"])
        return make_boxed_func(gm.forward)

    model = make(TinyResNet if mode == "eval" else TrainNet)
    model.train(mode == "train")
    fused, report = tdt.fuse(model, reg)
    eager = copy.deepcopy(fused)
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
    x = rand(2, 3, 16, 16, seed=28) if mode == "eval" else rand(2, 4, 6, 6, seed=28)
    if mode == "eval":
        with torch.no_grad():
            out, ref = compiled(x), eager(x)
        assert rel_err(out, ref) < 1e-6
        convs = [n for n in graphs[0] if str(n.target) == "tiledispatch.conv_fwd.default"]
        assert {n.args[4] for n in convs} == {"relu", "identity"}  # folded bn + relu; downsample: bias only
        assert any(n.args[3] for n in convs)  # a residual went into the operator
        return
    out, ref = compiled(x), eager(x)
    out.sum().backward()
    ref.sum().backward()
    assert rel_err(out, ref) < 1e-6
    for (name, p), q in zip(fused.named_parameters(), eager.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-5, name
    forward, backward = ({str(n.target) for n in g} for g in graphs)
    assert "tiledispatch.conv_fwd.default" in forward
    assert {"tiledispatch.conv_bwd_data.default", "tiledispatch.conv_bwd_weight.default"} <= backward


# -- GPU: a fused model in fp16 on the bundle, eager and captured in a CUDA graph ----------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("cls", [TinyResNet, TinyMobileNet, TinyConvNeXt])
def test_gpu_fused_model_matches_eager_and_replays_in_a_cuda_graph(cls):
    """Needs $TD_TORCH_BUNDLE (a cutlass bundle with fp16 GEMM and conv kernels, as test_torch_integration's GPU
    tests, and fp16_rcr_fused's epilogue GEMMs: TinyConvNeXt's linear -> GELU chains fuse only into those): the
    fused fp16 channels-last model against the unfused eager model (ten times the fp16 kernel tolerance: a whole
    model), and its CUDA-graph replay against its own eager output."""
    import os

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    path = os.environ.get("TD_TORCH_BUNDLE")
    if not path:
        pytest.skip("set TD_TORCH_BUNDLE to a cutlass bundle with fp16 GEMM and conv kernels")
    reg = td.load(path)
    model = make(cls).cuda().half().to(memory_format=torch.channels_last).eval().requires_grad_(False)
    fused, report = tdt.fuse(model, reg)
    assert report.fused, f"nothing fused (does the bundle hold fp16_rcr_fused's epilogue GEMMs?): {report}"
    assert not report.patch.unsupported, str(report)
    static_x = rand(8, 3, 32, 32, seed=30, dtype=torch.float16).cuda().contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref, out = model(static_x), fused(static_x)
    assert rel_err(out, ref) < 2e-2, str(report)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():  # warm-up: selections, plans and workspaces on this stream
        for _ in range(2):
            fused(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side), torch.no_grad():
        static_out = fused(static_x)
    static_x.copy_(rand(8, 3, 32, 32, seed=31, dtype=torch.float16).cuda())
    graph.replay()
    with torch.no_grad():
        want = fused(static_x)
    torch.cuda.synchronize()
    assert rel_err(static_out, want) < 1e-3
