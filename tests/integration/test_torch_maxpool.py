"""tiledispatch.torch.max_pool on the cpu backend: F.max_pool1d/2d/3d's results element for element (NaNs, ceil_mode,
padding, dilation; channels-last or not), torch's own call where a gradient is recorded, the eager fast path, clear
errors, the operator under torch.compile, and patch() routing nn.MaxPool layers. The GPU test needs
$TD_TORCH_BUNDLE with pool_essential's cutlass kernels."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tiledispatch as td  # noqa: E402
import tiledispatch.torch as tdt  # noqa: E402
from conftest import build_preselected  # noqa: E402
from tiledispatch.errors import InvalidInputError  # noqa: E402

POOLS = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


@pytest.fixture(scope="module")
def reg(tmp_path_factory, kernel_cache):
    return build_preselected(tmp_path_factory, kernel_cache, "pool_essential")


def maps(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 4
    x.view(-1)[::53] = float("nan")
    return x.to(dtype)


def same(a, b) -> bool:
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_torch_element_for_element(reg, dtype):
    cases = [(maps(2, 8, 17, 19, dtype=dtype).contiguous(memory_format=torch.channels_last), (3, 2, 1), {}),
             (maps(2, 8, 17, 19, dtype=dtype), (3, 2, 1, 1, True), {}),  # not channels-last: copied
             (maps(2, 5, 9, dtype=dtype), (2,), {}),
             (maps(1, 4, 5, 6, 7, dtype=dtype), ((3, 2, 2), 1, (1, 1, 0)), {}),
             (maps(2, 3, 8, 8, dtype=dtype), (2,), {"dilation": 2, "ceil_mode": True}),
             (maps(2, 3, 8, 8, dtype=dtype), (3,), {"stride": [], "padding": 1})]  # stride []: the window, as torch's
    with torch.no_grad():
        for x, args, kwargs in cases:
            got = tdt.max_pool(x, *args, **kwargs, registry=reg)
            want = POOLS[x.dim() - 2](x, *args, **kwargs)
            assert got.shape == want.shape and same(got, want), (x.shape, args, kwargs)
            assert tdt._is_channels_last(got)


def test_gradients_are_torchs_and_repeated_calls_take_the_remembered_launch(reg):
    x = maps(2, 3, 8, 8).nan_to_num(0.0).requires_grad_()
    tdt.max_pool(x, 2, registry=reg).square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    F.max_pool2d(x2, 2).square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    with torch.no_grad():
        x = maps(2, 16, 12, 12).contiguous(memory_format=torch.channels_last)
        tdt.max_pool(x, 3, 2, 1, registry=reg)
        before = reg.cache_info()["launches"]
        for seed in range(3):
            x = maps(2, 16, 12, 12, seed=seed + 1).contiguous(memory_format=torch.channels_last)
            assert same(tdt.max_pool(x, 3, 2, 1, registry=reg), F.max_pool2d(x, 3, 2, 1))
        assert reg.cache_info()["launches"]["misses"] == before["misses"], "a repeated call took the full path"


def test_bad_arguments_get_clear_errors(reg):
    x = maps(1, 2, 4, 4)
    for args, kwargs, words in [((torch.zeros(2, 3), 2), {}, "1 to 3 spatial dims"),
                                ((x, 3), {"padding": 2}, "more than half the window"),
                                ((x, [2, 2, 2]), {}, "max_pool kernel_size must be an int or 2 ints"),
                                ((x, 2), {"ceil_mode": "yes"}, "ceil_mode must be True or False"),
                                ((x, 2), {"stride": 0}, "stride must be an integer >= 1"),
                                (("x", 2), {}, "x must be a tensor")]:
        with torch.no_grad(), pytest.raises(InvalidInputError, match=words.replace("[", r"\[").replace("]", r"\]")):
            tdt.max_pool(*args, **kwargs, registry=reg)


def test_compiled_calls_run_the_operator(reg):
    f = torch.compile(lambda t: tdt.max_pool(t, 3, 2, 1, registry=reg), fullgraph=True)
    x = maps(2, 8, 10, 10).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert same(f(x), F.max_pool2d(x, 3, 2, 1))


def test_patch_routes_max_pool_layers(reg):
    model = nn.Sequential(nn.MaxPool2d(3, 2, 1), nn.MaxPool2d(2, ceil_mode=True), nn.Flatten(2), nn.MaxPool1d(2))
    x = maps(2, 3, 20, 20).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = model(x)
        report = tdt.patch(model, reg, example_inputs=x)
        status = {r.name: (r.kind, r.status) for r in report.layers}
        assert status == {"0": ("MaxPool2d", "tiledispatch"), "1": ("MaxPool2d", "tiledispatch"),
                          "3": ("MaxPool1d", "tiledispatch")}
        assert report.layers[0].kernels["fwd"].startswith("maxpool_fp32")
        assert same(model(x), ref)
        with_indices = nn.MaxPool1d(2, return_indices=True)
        (layer,) = tdt.patch(with_indices, reg).layers
        assert layer.status == "pytorch" and "return_indices" in layer.reason


@pytest.mark.gpu
def test_gpu_max_pool_matches_torch():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    path = os.environ.get("TD_TORCH_BUNDLE")
    if not path:
        pytest.skip("set TD_TORCH_BUNDLE to a cutlass bundle holding pool_essential")
    reg = td.load(path)
    if "maxpool" not in reg.ops:
        pytest.skip("the bundle has no maxpool kernels")
    with torch.no_grad():
        for shape, args in (((32, 64, 112, 112), (3, 2, 1)), ((4, 3, 9, 9), (2,)), ((2, 8, 6, 7, 7), (3, 2, 1))):
            x = maps(*shape, dtype=torch.float16).cuda()
            x = x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x
            assert same(tdt.max_pool(x, *args, registry=reg), POOLS[x.dim() - 2](x, *args))
