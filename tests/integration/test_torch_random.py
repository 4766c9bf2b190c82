"""tiledispatch.torch on random problems (cpu backend): the conv and linear operators and tdt.fuse() against float64
torch, forward and backward, on problems drawn by seeded generators instead of picked by hand.

The draws cover what the hand-written tests pick one case of: every rank, group counts with odd channels per group,
filters wider than the input's padding, strides and dilations together, asymmetric padding, non-contiguous and
channels-last inputs, fp16 / bf16, residuals and activations; linear layers with leading batch dimensions, strided
and transposed inputs, sizes that fill no tile; models of conv / batch norm / activation / residual / squeeze-
excitation / permuted-linear blocks, fused in eval and in training mode; sequences of calls on tensors changed
between the calls (the launch caches must follow them). A failure prints the problem it drew.
"""
from __future__ import annotations

import copy
import random

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tiledispatch.torch as tdt  # noqa: E402
from tiledispatch.torch_fusion import FusedScaledConv  # noqa: E402
from conftest import build_cpu_bundle  # noqa: E402
from test_torch_fusion import FUSED_CONV_SET, TORCH_ACT as ACTIVATIONS, rel_err  # noqa: E402
from test_torch_integration import TORCH_SET  # noqa: E402

# float32 kernels: the validation tolerance; fp16 / bf16: their rounding over reductions of up to ~100 terms
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
GRAD_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
# the linear epilogues the bundle below computes, per dtype (fp32: TORCH_SET; fp16: fp16_rcr_essential's cpu
# kernels); tdt.linear refuses an activation no kernel computes (test_torch_integration checks that refusal)
LINEAR_EPILOGUES = {
    torch.float32: [("identity", False), ("identity", True), ("relu", True), ("silu", True), ("gelu_tanh", True),
                    ("sigmoid", True), ("tanh", True), ("hardswish", True)],
    torch.float16: [("identity", False), ("identity", True), ("relu", True), ("gelu_tanh", True)],
}


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    # TORCH_SET (plain conv kernels of every rank and direction, fp32 / fp16 / bf16 in 2D; fp32 GEMMs with
    # epilogues) and the cpu conv kernels fusing bias, residual and activation, with the essential fp16 GEMMs
    groups = FUSED_CONV_SET.split("groups:\n", 1)[1]
    return build_cpu_bundle(tmp_path_factory.mktemp("random_build"), "torch_test", TORCH_SET + groups,
                            "fp16_rcr_essential")


def draw_conv(rng: random.Random) -> dict:
    """A valid conv problem: every output size >= 1."""
    while True:
        rank = rng.choice([1, 2, 2, 3])
        groups = rng.choice([1, 1, 2, 3, 4])
        p = dict(rank=rank, groups=groups, n=rng.randint(1, 3), c=groups * rng.choice([1, 2, 3, 5, 8]),
                 k=groups * rng.choice([1, 2, 3, 4, 7]), size=[rng.randint(1, 9) for _ in range(rank)],
                 filt=[rng.randint(1, 4) for _ in range(rank)], stride=[rng.randint(1, 3) for _ in range(rank)],
                 dilation=[rng.randint(1, 2) for _ in range(rank)], lo=[rng.randint(0, 2) for _ in range(rank)],
                 hi=[rng.randint(0, 2) for _ in range(rank)],
                 dtype=rng.choice([torch.float32, torch.float16, torch.bfloat16]) if rank == 2 else torch.float32,
                 bias=rng.random() < 0.5, residual=rng.random() < 0.3,
                 activation=rng.choice(["identity", "identity", "relu", "silu", "hardswish"]),
                 memory=rng.choice(["contiguous", "channels_last", "sliced"]))
        out = [(p["size"][d] + p["lo"][d] + p["hi"][d] - p["dilation"][d] * (p["filt"][d] - 1) - 1)
               // p["stride"][d] + 1 for d in range(rank)]
        if min(out) >= 1:
            return p


def conv_input(p: dict, gen: torch.Generator) -> torch.Tensor:
    shape = (p["n"], p["c"], *p["size"])
    if p["memory"] == "sliced":  # a view inside a larger tensor: strides that no dense layout has
        big = torch.randn(p["n"], p["c"] + 1, *[s + 2 for s in p["size"]], generator=gen)
        return big[(slice(None), slice(1, None)) + tuple(slice(1, 1 + s) for s in p["size"])].to(p["dtype"])
    x = torch.randn(*shape, generator=gen).to(p["dtype"])
    if p["memory"] == "channels_last":
        return tdt._channels_last(x)
    return x


@pytest.mark.parametrize("seed", range(6))
def test_random_convs_match_torch(reg, seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(12):
        p = draw_conv(rng)
        x = conv_input(p, gen)
        w = (torch.randn(p["k"], p["c"] // p["groups"], *p["filt"], generator=gen) * 0.3).to(p["dtype"])
        b = torch.randn(p["k"], generator=gen).to(p["dtype"]) if p["bias"] else None
        geo = dict(stride=p["stride"], dilation=p["dilation"], groups=p["groups"])
        pad = [v for d in reversed(range(p["rank"])) for v in (p["lo"][d], p["hi"][d])]
        conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[p["rank"]]
        xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
        br = b.double().requires_grad_() if b is not None else None
        ref = conv(F.pad(xr, pad), wr, br, **geo)
        r = torch.randn(ref.shape, generator=gen).to(p["dtype"]) if p["residual"] else None
        ref = ACTIVATIONS[p["activation"]](ref + r.double() if r is not None else ref)

        xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        bs = b.detach().clone().requires_grad_() if b is not None else None
        out = tdt.conv(xs, ws, bs, registry=reg, pad_lo=p["lo"], pad_hi=p["hi"], residuals=(r,) if r is not None
                       else (), activation=p["activation"], **geo)
        assert out.shape == ref.shape and out.dtype == p["dtype"], p
        assert rel_err(out, ref) < TOL[p["dtype"]], p
        g = torch.randn(out.shape, generator=gen).to(p["dtype"])
        out.backward(g)
        ref.backward(g.double())
        for mine, theirs in ((xs, xr), (ws, wr), (bs, br)):
            if theirs is not None:
                assert rel_err(mine.grad, theirs.grad) < GRAD_TOL[p["dtype"]], p


@pytest.mark.parametrize("seed", range(4))
def test_random_linears_match_torch(reg, seed):
    rng, gen = random.Random(100 + seed), torch.Generator().manual_seed(100 + seed)
    for _ in range(15):
        dtype = rng.choice([torch.float32, torch.float32, torch.float16])
        activation, bias = rng.choice(LINEAR_EPILOGUES[dtype])
        lead = [rng.randint(1, 4) for _ in range(rng.randint(0, 2))]
        m, k, n = rng.randint(1, 40), rng.randint(1, 70), rng.randint(1, 70)
        residual = rng.random() < 0.3 and not (dtype == torch.float16 and bias)
        layout = rng.choice(["contiguous", "sliced", "transposed"])
        case = dict(dtype=dtype, activation=activation, bias=bias, lead=lead, m=m, k=k, n=n, residual=residual,
                    layout=layout)
        if layout == "sliced":
            x = torch.randn(*lead, m, k + 3, generator=gen).to(dtype)[..., 1:1 + k]
        elif layout == "transposed":
            x = torch.randn(*lead, k, m, generator=gen).to(dtype).transpose(-1, -2)
        else:
            x = torch.randn(*lead, m, k, generator=gen).to(dtype)
        w = (torch.randn(n, k, generator=gen) * 0.2).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype) if bias else None
        r = torch.randn(*lead, m, n, generator=gen).to(dtype) if residual else None
        xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
        br = b.double().requires_grad_() if bias else None
        ref = F.linear(xr, wr, br)
        ref = ACTIVATIONS[activation](ref + r.double() if residual else ref)

        xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        bs = b.detach().clone().requires_grad_() if bias else None
        out = tdt.linear(xs, ws, bs, registry=reg, residuals=(r,) if residual else (), activation=activation)
        assert out.shape == ref.shape and out.dtype == dtype, case
        assert rel_err(out, ref) < TOL[dtype], case
        g = torch.randn(out.shape, generator=gen).to(dtype)
        out.backward(g)
        ref.backward(g.double())
        for mine, theirs in ((xs, xr), (ws, wr), (bs, br)):
            if theirs is not None:
                assert rel_err(mine.grad, theirs.grad) < GRAD_TOL[dtype], case


# -- random models through fuse() ------------------------------------------------------------------------------
class ConvBlock(nn.Module):
    """conv (dense, grouped or depthwise) -> [batch norm] -> activation -> [+ x] -> [squeeze-excitation into a
    pointwise conv]."""

    def __init__(self, c: int, rng: random.Random):
        super().__init__()
        self.conv = nn.Conv2d(c, c, rng.choice([1, 3]), padding="same", groups=rng.choice([1, 1, 2, c]),
                              bias=rng.random() < 0.5)
        self.norm = nn.BatchNorm2d(c) if rng.random() < 0.6 else nn.Identity()
        self.act = rng.choice([nn.ReLU, nn.SiLU, nn.ReLU6, nn.Hardswish, nn.GELU, nn.Identity, nn.Sigmoid])()
        self.residual = rng.random() < 0.5
        self.gate = rng.random() < 0.3
        if self.gate:
            self.squeeze, self.excite = nn.Conv2d(c, max(1, c // 4), 1), nn.Conv2d(max(1, c // 4), c, 1)
            self.project = nn.Conv2d(c, c, 1)

    def forward(self, x):
        y = self.act(self.norm(self.conv(x)))
        if self.residual:
            y = y + x
        if self.gate:
            s = torch.sigmoid(self.excite(F.relu(self.squeeze(y.mean((2, 3), keepdim=True)))))
            y = self.project(y * s)
        return y


class LinearBlock(nn.Module):
    """ConvNeXt's shape: permute to channels last, linear -> activation -> [layer scale], permute back, [+ x]."""

    def __init__(self, c: int, rng: random.Random):
        super().__init__()
        self.linear = nn.Linear(c, c, bias=rng.random() < 0.7)
        self.act = rng.choice([nn.GELU(approximate="tanh"), nn.ReLU(), nn.Identity(), nn.SiLU()])
        self.scale = nn.Parameter(torch.rand(c) + 0.5) if rng.random() < 0.5 else None
        self.residual = rng.random() < 0.5

    def forward(self, x):
        y = self.act(self.linear(x.permute(0, 2, 3, 1)))
        if self.scale is not None:
            y = y * self.scale
        y = y.permute(0, 3, 1, 2)
        return y + x if self.residual else y


@pytest.mark.parametrize("seed", range(4))
def test_random_models_fused_match_torch(reg, seed):
    rng = random.Random(200 + seed)
    torch.manual_seed(200 + seed)
    fused_layers = 0
    for _ in range(6):
        c = rng.choice([4, 6, 8, 16])
        blocks = [ConvBlock(c, rng) if rng.random() < 0.7 else LinearBlock(c, rng) for _ in range(rng.randint(1, 4))]
        model = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), *blocks)
        with torch.no_grad():  # running statistics that are not the identity, so a fold that drops one shows
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.5, 0.5)
                    m.running_var.uniform_(0.5, 2.0)
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.5, 0.5)
        training = rng.random() < 0.4
        model.train(training)
        x = torch.randn(2, 3, rng.randint(3, 9), rng.randint(3, 9))
        if rng.random() < 0.5:
            model, x = model.to(memory_format=torch.channels_last), tdt._channels_last(x)
        case = dict(training=training, blocks=[repr(b) for b in blocks], shape=list(x.shape))
        reference = copy.deepcopy(model).double()
        fused, report = tdt.fuse(model, reg)
        fused_layers += len(report.fused)
        xs, xr = x.clone().requires_grad_(training), x.double().requires_grad_(training)
        out, ref = fused(xs), reference(xr)
        assert rel_err(out, ref) < 1e-4, (case, str(report))
        if training:
            g = torch.randn(ref.shape, dtype=torch.float64)
            out.backward(g.float())
            ref.backward(g)
            assert rel_err(xs.grad, xr.grad) < 1e-3, case
            theirs = dict(reference.named_parameters())
            compared = 0
            for name, p in fused.named_parameters():
                if name in theirs and p.grad is not None and theirs[name].grad is not None:
                    # a conv bias before a batch norm in training mode (or before a conv that one follows) has a
                    # gradient of zero, a sum of O(1) terms that cancel: float32 leaves ~1e-5 there, so the error is
                    # taken against at least an RMS of 0.05 (the other gradients here are sums of O(1) terms too)
                    ref_grad = theirs[name].grad
                    floor = 0.05 * ref_grad.numel() ** 0.5
                    err = (p.grad.double() - ref_grad).norm().item() / max(ref_grad.norm().item(), floor)
                    assert err < 1e-3, (case, name)
                    compared += 1
            assert compared > 0, case
    assert fused_layers > 0  # the draws hold chains fuse() takes (a model in training mode may hold none)



def test_random_models_fused_and_patched_run_a_batch_of_none(reg):
    """A batch of 0 through fused and patched models (eval) gives torch's empty output: every block kind, the
    squeeze-excitation fold among them (16 x 16 maps: past its pixel threshold)."""
    rng = random.Random(300)
    torch.manual_seed(300)
    folded = 0
    for _ in range(12):
        c = rng.choice([4, 8, 16])
        blocks = [ConvBlock(c, rng) if rng.random() < 0.7 else LinearBlock(c, rng) for _ in range(rng.randint(1, 4))]
        model = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), *blocks).eval()
        x = torch.randn(0, 3, 16, 16)
        if rng.random() < 0.5:
            model, x = model.to(memory_format=torch.channels_last), tdt._channels_last(x)
        with torch.no_grad():
            ref = model(x)
            fused, report = tdt.fuse(model, reg)
            folded += sum(isinstance(m, FusedScaledConv) for m in fused.modules())
            assert fused(x).shape == ref.shape, [repr(b) for b in blocks]
            tdt.patch(model, reg)
            assert model(x).shape == ref.shape, [repr(b) for b in blocks]
    assert folded > 0

# -- call sequences: what the launch caches remember must follow the tensors --------------------------------------
@pytest.mark.parametrize("seed", range(2))
def test_random_call_sequences_follow_mutated_reallocated_and_viewed_tensors(reg, monkeypatch, seed):
    """Calls repeated on a pool of tensors that are changed between them (in place, re-allocated, copied into a
    view of another buffer, made channels-last, requires_grad switched), with the space-to-depth route on so that
    stems run on mapped copies (their filter copy cached per weight version): every output against float64 torch.
    The remembered launches, the fast path's fingerprints and the derived weight copies all key on these tensors."""
    monkeypatch.setattr(tdt, "_SPACE_TO_DEPTH", "on")
    tdt._S2D_ROUTES.clear()
    rng = random.Random(300 + seed)
    torch.manual_seed(300 + seed)
    pool = {"x": torch.randn(2, 8, 7, 7), "w": torch.randn(6, 8, 3, 3), "b": torch.randn(6),
            "stem_x": torch.randn(2, 3, 16, 16), "stem_w": torch.randn(6, 3, 7, 7), "patch_w": torch.randn(6, 3, 4, 4),
            "lin_x": torch.randn(5, 16), "lin_w": torch.randn(12, 16), "lin_b": torch.randn(12)}
    calls = {"conv": ("x", "w", 1, 1), "stem": ("stem_x", "stem_w", 2, 3), "patchify": ("stem_x", "patch_w", 4, 0)}
    for step in range(150):
        action = rng.choice(["conv", "stem", "patchify", "linear", "linear", "mutate", "reallocate", "memory", "view",
                             "grad"])
        if action == "mutate":
            with torch.no_grad():
                pool[rng.choice(list(pool))].mul_(rng.choice([0.5, -1.0, 2.0])).add_(0.1)
        elif action == "reallocate":
            name = rng.choice(list(pool))
            old = pool.pop(name)
            shape, grad = old.shape, old.requires_grad
            del old  # its memory may come back for the new tensor
            pool[name] = torch.randn(shape).requires_grad_(grad)
        elif action == "memory":
            name = rng.choice(["x", "w", "stem_x", "stem_w", "patch_w"])
            fmt = rng.choice([torch.channels_last, torch.contiguous_format])
            pool[name] = pool[name].detach().contiguous(memory_format=fmt).requires_grad_(pool[name].requires_grad)
        elif action == "view":  # the same values in a view of a larger buffer: other pointer, other strides
            name = rng.choice(["x", "stem_x", "lin_x"])
            t = pool[name]
            big = torch.randn(t.shape[0] + 1, *t.shape[1:])
            pool[name] = (big[1:] if rng.random() < 0.5 else big[:-1]).copy_(t.detach()).requires_grad_(t.requires_grad)
        elif action == "grad":
            name = rng.choice(list(pool))
            pool[name] = pool[name].detach().requires_grad_(not pool[name].requires_grad)
        elif action == "linear":
            bias = pool["lin_b"] if rng.random() < 0.6 else None
            activation = rng.choice(["identity", "relu"]) if bias is not None else "identity"
            out = tdt.linear(pool["lin_x"], pool["lin_w"], bias, registry=reg, activation=activation)
            ref = ACTIVATIONS[activation](F.linear(pool["lin_x"].double(), pool["lin_w"].double(),
                                                   None if bias is None else bias.double()))
            assert rel_err(out, ref) < TOL[torch.float32], (step, action)
        else:
            xn, wn, stride, padding = calls[action]
            bias = pool["b"] if rng.random() < 0.5 else None
            activation = rng.choice(["identity", "relu"])
            with torch.no_grad() if rng.random() < 0.3 else torch.enable_grad():
                out = tdt.conv(pool[xn], pool[wn], bias, registry=reg, stride=stride, padding=padding,
                               activation=activation)
            ref = ACTIVATIONS[activation](F.conv2d(pool[xn].double(), pool[wn].double(),
                                                   None if bias is None else bias.double(), stride=stride,
                                                   padding=padding))
            assert rel_err(out, ref) < TOL[torch.float32], (step, action)
            if out.requires_grad:
                out.sum().backward()
