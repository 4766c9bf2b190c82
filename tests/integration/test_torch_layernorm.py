"""tiledispatch.torch.layer_norm on the cpu backend: F.layer_norm's results for every dtype and layout, torch's own
call where a gradient is recorded or autocast runs, the eager fast path, clear errors, the operator under
torch.compile, and patch() / fuse() routing a model's layer norms (nn.LayerNorm modules, and F.layer_norm in a
module's forward as torchvision's LayerNorm2d calls it). The GPU test needs $TD_TORCH_BUNDLE with
layernorm_essential's cutlass kernels."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tiledispatch as td  # noqa: E402
import tiledispatch.torch as tdt  # noqa: E402
from conftest import build_preselected  # noqa: E402
from tiledispatch.errors import InvalidInputError, UnsupportedProblemError  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def reg(tmp_path_factory, kernel_cache):
    return build_preselected(tmp_path_factory, kernel_cache, "layernorm_essential")


def rows(*shape, dtype=torch.float32, seed=0):
    """Random rows of different means and spreads."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    return (x * (0.5 + 3 * torch.rand(*shape[:-1], 1, generator=g, dtype=torch.float64))
            + 4 * torch.rand(*shape[:-1], 1, generator=g, dtype=torch.float64) - 2).to(dtype)


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm()).item()


class LayerNorm2d(nn.LayerNorm):
    """torchvision's ConvNeXt LayerNorm2d: a LayerNorm over the channels of an NCHW tensor, through a permute."""

    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias,
                            self.eps).permute(0, 3, 1, 2)


class Block(nn.Module):
    """A ConvNeXt-like block: a functional LayerNorm2d, nn.LayerNorm modules (one without the affine)."""

    def __init__(self, c: int = 32):
        super().__init__()
        self.down = LayerNorm2d(c, eps=1e-6)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.fc = nn.Linear(c, c)
        self.plain = nn.LayerNorm(c, elementwise_affine=False)

    def forward(self, x):
        y = self.down(x).permute(0, 2, 3, 1)
        return self.plain(self.fc(self.norm(y)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_torch_for_every_layout(reg, dtype):
    w, b = rows(96, dtype=dtype, seed=1), rows(96, dtype=dtype, seed=2)
    cases = [
        (rows(4, 7, 96, dtype=dtype), (96,), w, b),
        (rows(8, 96, 5, dtype=dtype).transpose(1, 2), (96,), w, b),  # not contiguous: copied
        (rows(2, 8, 4, 5, dtype=dtype).contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1), (8,),
         None, None),  # a channels-last map's pixels as rows, in place
        (rows(3, 5, 6, dtype=dtype), (5, 6), rows(5, 6, dtype=dtype, seed=3), None),  # two normalized dims
        (rows(1, 1, dtype=dtype), 1, None, rows(1, dtype=dtype, seed=4)),  # a row of one: its bias
    ]
    with torch.no_grad():
        for x, shape, weight, bias in cases:
            got = tdt.layer_norm(x, shape, weight, bias, 1e-6, registry=reg)
            ref = F.layer_norm(x.double(), (shape,) if isinstance(shape, int) else shape,
                               None if weight is None else weight.double(), None if bias is None else bias.double(),
                               1e-6)
            assert got.dtype == x.dtype and got.shape == x.shape and got.is_contiguous()
            assert rel_err(got, ref) <= TOL[dtype], (x.shape, shape)


def test_gradients_and_autocast_are_torchs(reg):
    x = rows(6, 32).requires_grad_()
    w = nn.Parameter(rows(32, seed=1))
    y = tdt.layer_norm(x, (32,), w, None, registry=reg)
    y.square().sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.layer_norm(x2, (32,), w2).square().sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(tdt.layer_norm(x, 32, w, registry=reg), F.layer_norm(x, (32,), w))


def test_repeated_calls_take_the_remembered_launch(reg):
    x, w, b = rows(16, 64), rows(64, seed=1), rows(64, seed=2)
    with torch.no_grad():
        tdt.layer_norm(x, (64,), w, b, registry=reg)
        calls = reg.cache_info()["launches"]
        for seed in range(3):
            x = rows(16, 64, seed=10 + seed)
            assert rel_err(tdt.layer_norm(x, (64,), w, b, registry=reg), F.layer_norm(x, (64,), w, b)) < 1e-5
        after = reg.cache_info()["launches"]
    assert after["misses"] == calls["misses"], "a repeated call took the full path"
    with torch.no_grad():  # another eps: not the remembered call
        assert rel_err(tdt.layer_norm(x, (64,), w, b, 0.5, registry=reg), F.layer_norm(x, (64,), w, b, 0.5)) < 1e-5


def test_bad_arguments_get_clear_errors(reg):
    x = rows(4, 8)
    for args, kwargs, error, words in [
        ((x, 7), {}, InvalidInputError, "whose trailing dims are not normalized_shape [7]"),
        ((x, (8,), torch.ones(3)), {}, InvalidInputError, "weight must be a tensor of shape [8], got [3]"),
        ((x, (8,), None, "b"), {}, InvalidInputError, "bias must be a tensor of shape [8], got str"),
        ((x, ()), {}, InvalidInputError, "normalized_shape must be one or more positive ints"),
        ((x, 8.5), {}, InvalidInputError, "normalized_shape must be one or more positive ints"),
        ((x, 8, None, None, "tiny"), {}, InvalidInputError, "eps must be a real number"),
        ((x, 8, None, None, -1.0), {}, InvalidInputError, "eps must be >= 0"),
        (("x", 8), {}, InvalidInputError, "x must be a tensor"),
        ((x.double(), 8), {}, UnsupportedProblemError, "problem has fp64"),
    ]:
        with torch.no_grad(), pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
            tdt.layer_norm(*args, **kwargs, registry=reg)
    assert tdt.layer_norm(torch.empty(0, 8), 8, registry=reg).shape == (0, 8)


def test_compiled_calls_run_the_operator(reg):
    w, b = rows(48, seed=1), rows(48, seed=2)
    f = torch.compile(lambda t: tdt.layer_norm(t, (48,), w, b, 1e-6, registry=reg), fullgraph=True)
    x = rows(10, 48)
    with torch.no_grad():
        assert rel_err(f(x), F.layer_norm(x, (48,), w, b, 1e-6)) < 1e-5


def test_patch_and_fuse_route_the_layer_norms(reg):
    torch.manual_seed(0)
    model = Block().eval()
    x = rows(2, 32, 5, 5)
    with torch.no_grad():
        ref = model(x)
        report = tdt.patch(model, reg, example_inputs=x)
        kinds = {r.name: (r.kind, r.status) for r in report.layers}
        assert kinds["norm"] == ("LayerNorm", "tiledispatch") and kinds["plain"] == ("LayerNorm", "tiledispatch")
        assert kinds["down"] == ("LayerNorm", "pytorch"), "LayerNorm2d overrides forward: patch() leaves it"
        norm = next(r for r in report.layers if r.name == "norm")
        assert norm.kernels["fwd"].startswith("layernorm_fp32") and "forward only" in norm.notes[0]
        assert rel_err(model(x), ref) < 1e-5
        tdt.unpatch(model)
        fused, fuse_report = tdt.fuse(model, reg)
        routed = [f for f in fuse_report.fused if f.kind == "layer_norm"]
        assert [f.name.split(" ")[0] for f in routed] == ["down"]
        hits = reg.cache_info()["launches"]["hits"]
        assert rel_err(fused(x), ref) < 1e-5 and rel_err(fused(x), ref) < 1e-5
        assert reg.cache_info()["launches"]["hits"] > hits
    fused.train()  # a call that records a gradient: torch's layer norm, the gradient flows
    x.requires_grad_()
    fused(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.gpu
def test_gpu_layer_norm_matches_torch():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    path = os.environ.get("TD_TORCH_BUNDLE")
    if not path:
        pytest.skip("set TD_TORCH_BUNDLE to a cutlass bundle holding layernorm_essential")
    reg = td.load(path)
    if "layernorm" not in reg.ops:
        pytest.skip("the bundle has no layernorm kernels")
    with torch.no_grad():
        for n, cols in ((100352, 96), (1568, 768), (64, 5000), (33, 100)):
            x = rows(n, cols, dtype=torch.float16).cuda()
            w, b = rows(cols, dtype=torch.float16, seed=1).cuda(), rows(cols, dtype=torch.float16, seed=2).cuda()
            got = tdt.layer_norm(x, (cols,), w, b, 1e-6, registry=reg)
            assert rel_err(got, F.layer_norm(x.double(), (cols,), w.double(), b.double(), 1e-6)) < 2e-3
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = tdt.layer_norm(x, (cols,), w, b, 1e-6, registry=reg)
            x.copy_(rows(n, cols, dtype=torch.float16, seed=5).cuda())
            graph.replay()
            assert rel_err(captured, F.layer_norm(x.double(), (cols,), w.double(), b.double(), 1e-6)) < 2e-3
