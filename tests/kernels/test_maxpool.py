"""Max pooling kernels: every cpu kernel of pool_essential against the float64 reference element for element (1D /
2D / 3D maps with NaNs, strides, padding, dilation, ceil_mode, channels of a wider buffer; outputs poisoned first),
the registry's checks of hostile inputs, the ranking of the cutlass kernels, and (slow, with nvcc) the cutlass
kernels compiled with their host-side checks run without a device."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from conftest import REPO, build_preselected, compile_keys, toolchain_or_reason
from tiledispatch import abi, selection, validation
from tiledispatch.errors import InvalidInputError, UnsupportedProblemError
from tiledispatch.generator import toolchains
from tiledispatch.generator.kernelset import expand_file
from tiledispatch.ops import maxpool as pool_op
from tiledispatch.spec.dtypes import dtype
from tiledispatch.spec.key import Algorithm, KernelKey, Signature

# (n, c, spatial, window, stride, padding, dilation, ceil_mode)
CASES = [(2, 8, (15, 17), 3, 2, 1, 1, False), (1, 3, (7, 9), (3, 2), (2, 1), (1, 0), 1, True),
         (2, 5, (9, 10), 3, 1, 1, 2, False), (3, 16, (13,), 2, 2, 0, 1, True),
         (1, 4, (5, 6, 7), (3, 2, 2), (2, 1, 1), (1, 1, 0), 1, False), (1, 1, (1, 1), 1, 1, 0, 1, False)]


@pytest.fixture(scope="module")
def reg(tmp_path_factory, kernel_cache):
    return build_preselected(tmp_path_factory, kernel_cache, "pool_essential")


@pytest.mark.parametrize("wide", [False, True], ids=["dense", "channels_of_a_wider_buffer"])
def test_every_cpu_kernel_matches_the_reference_exactly(reg, wide):
    rng = np.random.default_rng(3)
    kernels = [k for k in reg.kernels if k.key.signature.op == "maxpool"]
    assert {k.key.signature.dtype_a for k in kernels} == {"fp16", "bf16", "fp32"}
    for kern in kernels:
        for n, c, spatial, window, stride, padding, dilation, ceil_mode in CASES:
            p = pool_op.problem_of(n, c, spatial, kern.key.signature.dtype_a, window, stride, padding, dilation,
                                   ceil_mode)
            data, expect = validation.maxpool_case(p, rng, nan=True)
            x = data["x"]
            if wide:
                buffer = np.zeros((*x.shape[:-1], c + 3), dtype=x.dtype)
                buffer[..., :c] = x
                x = buffer[..., :c]
            out = reg.max_pool(x, window, stride, padding, dilation, ceil_mode=ceil_mode, out=data["out"],
                               kernel=kern)
            assert out is data["out"]
            got = out.astype(np.float64)
            assert np.array_equal(got, expect, equal_nan=True), (kern.name, p)
            assert np.isnan(expect).any() or c == 1, "the case's NaNs should reach some output"


def test_output_size_is_torchs_and_repeated_calls_reuse_the_launch(reg):
    torch = pytest.importorskip("torch")
    for size, window, stride, dilation, padding, ceil_mode in itertools.product((1, 5, 6, 7, 112), (1, 2, 3),
                                                                                (1, 2, 3), (1, 2), (0, 1), (False, True)):
        if 2 * padding > window or size + 2 * padding < dilation * (window - 1) + 1:
            continue
        want = torch.nn.functional.max_pool1d(torch.zeros(1, 1, size), window, stride, padding, dilation,
                                              ceil_mode=ceil_mode).shape[-1]
        assert pool_op.out_size(size, window, stride, dilation, padding, ceil_mode) == want
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 8, 8, 4)).astype(np.float32)
    out = np.empty((2, 4, 4, 4), np.float32)
    reg.max_pool(x, 2, out=out)
    hits = reg.cache_info()["launches"]["hits"]
    x2 = x * -1
    reg.max_pool(x2, 2, out=out)
    assert reg.cache_info()["launches"]["hits"] == hits + 1
    assert np.array_equal(out, x2.reshape(2, 4, 2, 4, 2, 4).max(axis=(2, 4)))


def test_hostile_inputs_get_clear_errors(reg):
    x = np.ones((2, 8, 8, 4), np.float32)
    cases = [
        (lambda: reg.max_pool(x, 3, padding=2), InvalidInputError, "more than half the window"),
        (lambda: reg.max_pool(x[..., ::2], 2), InvalidInputError, "channels (its last dim) have stride 2"),
        (lambda: reg.max_pool(x, 0), InvalidInputError, "window must be an integer >= 1"),
        (lambda: reg.max_pool(x, 9), InvalidInputError, "the output would be empty"),
        (lambda: reg.max_pool(x[0, 0], 2), InvalidInputError, "1 to 3 spatial dims"),
        (lambda: reg.max_pool(x, 2, out=np.empty((2, 3, 3, 4), np.float32)), InvalidInputError, "out has shape"),
        (lambda: reg.max_pool(x, 2, out=np.empty((2, 4, 4, 4), np.float16)), InvalidInputError, "out has dtype fp16"),
        (lambda: reg.max_pool(x, (2, 2, 2)), InvalidInputError, "window must be an integer >= 1 or 2 of them"),
        (lambda: reg.max_pool(x, 2, ceil_mode=1), InvalidInputError, "ceil_mode must be True or False"),
        (lambda: reg.max_pool(x, 2, stride=-1), InvalidInputError, "stride must be an integer >= 1"),
        (lambda: reg.max_pool(x.astype(np.float64), 2), UnsupportedProblemError, "fp64"),
        (lambda: reg.max_pool(np.zeros((2, 0, 8, 4), np.float32), 2), InvalidInputError, "every size must be >= 1"),
        (lambda: reg.max_pool(x, 2, out=x[:, :4, :4]), InvalidInputError, "out overlaps x"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
            call()


def test_the_ranker_takes_the_16_byte_kernel_where_it_runs():
    keys = [e.key for e in expand_file(REPO / "preselected" / "pool_essential.yaml", "cutlass", "sm90a")]
    for dt in ("fp16", "fp32"):
        p = pool_op.problem_of(32, 64, (112, 112), dt, 3, 2, 1)
        mine = [k for k in keys if k.signature.dtype_a == dt]
        best = min(mine, key=lambda k: (selection.estimated_cost(p, k), k.name))
        assert best.algorithm.mma[1] * dtype(dt).itemsize == 16, best.name


cutlass = toolchains.get("cutlass")
TOOLCHAIN, WHY = toolchain_or_reason(cutlass)


@pytest.mark.slow
@pytest.mark.skipif(TOOLCHAIN is None, reason=f"cutlass toolchain missing: {WHY}")
def test_cutlass_kernels_compile_and_check_their_arguments_without_a_device(tmp_path):
    def key(vec):
        return KernelKey(Signature("maxpool", "fp16", "fp16", "fp16", "fp32", "ndhwc"),
                         Algorithm((256, vec, 1), "window", (8, 1, 1), (1, vec, 1), "data_parallel"), "cutlass",
                         "sm90a")

    wide, one = key(8), key(1)
    built = compile_keys(cutlass, TOOLCHAIN, (wide, one), tmp_path, timeout=300)
    libs = {k: abi.KernelLibrary(lib) for k, (lib, _) in built.items()}
    for k, lib in libs.items():
        assert KernelKey.from_json(lib.key_json()) == k
    stem = pool_op.problem_of(32, 64, (112, 112), "fp16", 3, 2, 1)
    odd = pool_op.problem_of(2, 3, (9, 9), "fp16", 2)
    assert libs[wide].can_run(pool_op.make_args(stem, wide))[0] == abi.OK
    status, why = libs[wide].can_run(pool_op.make_args(odd, wide))
    assert status == abi.UNSUPPORTED and "8-channel accesses" in why
    assert libs[one].can_run(pool_op.make_args(odd, one))[0] == abi.OK
    args = pool_op.make_args(stem, one)
    args.params[abi.POOL_WINDOW] = 0
    status, why = libs[one].can_run(args)
    assert status == abi.INVALID_ARGUMENT and "window 0" in why
    args = pool_op.make_args(stem, one)
    args.tensors[1].shape[2] = 60  # more outputs than windows that start inside the input
    status, why = libs[one].can_run(args)
    assert status == abi.INVALID_ARGUMENT and "starts past the input" in why



def test_cli_runs_and_validates_maxpool(reg):
    import json
    import subprocess
    import sys

    bundle = str(reg.kernels[0].path.parents[1])
    run = subprocess.run([sys.executable, "-m", "tiledispatch", "run", bundle, "maxpool", "--n", "2", "--c", "3",
                          "--in", "7", "9", "11", "--window", "2", "--ceil-mode", "--dtype", "bf16", "--validate"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout)
    assert result["validation"]["passed"] and result["problem"]["out_size"] == [4, 5, 6]
    bad = subprocess.run([sys.executable, "-m", "tiledispatch", "run", bundle, "maxpool", "--n", "2", "--c", "3",
                          "--in", "7", "9", "--window", "2", "3", "4", "--dtype", "fp32"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--window takes 1 or 2 values" in bad.stdout
