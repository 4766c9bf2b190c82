"""cutlass conv kernels, compile only (no GPU): one direct and one implicit-GEMM kernel through nvcc for sm90a
(a few seconds each: no CUTLASS headers involved) and two CUTLASS SM90 convs (tma_ws_conv with one and with two
consumer warpgroups, about a minute and 3.3 GB each), then their host code (key export, argument checks with their
reasons, workspace size) without a device. Skipped unless the cutlass toolchain (nvcc + headers) is present."""
from __future__ import annotations


import pytest

from conftest import compile_keys, toolchain_or_reason
from tiledispatch import abi
from tiledispatch.generator import toolchains
from tiledispatch.ops import conv
from tiledispatch import backends
from tiledispatch.spec.key import Algorithm, Epilogue, KernelKey, Signature

cutlass = toolchains.get("cutlass")
TOOLCHAIN, WHY = toolchain_or_reason(cutlass)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(TOOLCHAIN is None, reason=f"cutlass toolchain missing: {WHY}")]

DIRECT = KernelKey(Signature("conv", "fp16", "fp16", "fp16", "fp32", "nhwgc", Epilogue(), "fwd", 2),
                   Algorithm((16, 64, 8), "direct", (8, 1, 1), (4, 8, 1), "data_parallel", 1, (1, 1, 1), 0,
                             (("cutlass.cpg", 1), ("cutlass.kpg", 1))), "cutlass", "sm90a")
# compile-time 3x3 filter (cutlass.fx / cutlass.fy): the register-window instances of fwd
DIRECT_FX = KernelKey(Signature("conv", "fp16", "fp16", "fp16", "fp32", "nhwgc", Epilogue(), "fwd", 2),
                      Algorithm((32, 64, 8), "direct", (8, 1, 1), (8, 4, 1), "data_parallel", 1, (1, 1, 1), 0,
                                (("cutlass.cpg", 1), ("cutlass.fx", 3), ("cutlass.fy", 3), ("cutlass.kpg", 1))),
                      "cutlass", "sm90a")
IGEMM = KernelKey(Signature("conv", "bf16", "bf16", "bf16", "fp32", "nhwgc", Epilogue(), "bwd_weight", 3),
                  Algorithm((64, 128, 32), "implicit_gemm", (2, 2, 1), (16, 8, 16), "data_parallel", 1, (1, 1, 1), 0),
                  "cutlass", "sm90a")
# one of conv_fp16_bwd_essential's: bwd_weight has the most host code of its own (the split of its pixel sum:
# the cost model, workspace) besides the shared refusals (groups, channels, TMA limits, strides); bwd_data's unit-stride
# refusal is checked on the GPU (bench/validation/validate_conv_gpu.py)
SM90 = KernelKey(Signature("conv", "fp16", "fp16", "fp16", "fp32", "nhwgc", Epilogue(), "bwd_weight", 2),
                 Algorithm((64, 128, 64), "tma_ws_conv", (4, 1, 1), (64, 128, 16), "data_parallel", 1, (1, 1, 1), 0),
                 "cutlass", "sm90a")
# conv_fp16_fwd_essential's 1D kernel: two consumer warpgroups (our kernel body, conv_sm90_consumers.cuh) in a
# cluster of two CTAs
SM90_TWO = KernelKey(Signature("conv", "fp16", "fp16", "fp16", "fp32", "nhwgc", Epilogue(), "fwd", 1),
                     Algorithm((128, 256, 64), "tma_ws_conv", (8, 1, 1), (64, 256, 16), "data_parallel", 1, (1, 2, 1),
                               0), "cutlass", "sm90a")
KEYS = (DIRECT, IGEMM, SM90, DIRECT_FX, SM90_TWO)


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    built = compile_keys(cutlass, TOOLCHAIN, KEYS, tmp_path_factory.mktemp("cutlass_conv_compile"), 600)
    return {key: abi.KernelLibrary(lib) for key, (lib, _) in built.items()}


@pytest.mark.parametrize("key", KEYS, ids=["direct", "implicit_gemm", "tma_ws_conv", "direct_fx", "tma_ws_conv_two"])
def test_compiles_and_reports_its_key(libraries, key):
    lib = libraries[key]
    assert lib.abi_version() == abi.ABI_VERSION
    assert KernelKey.from_json(lib.key_json()) == key


def test_host_checks_without_a_device(libraries):
    lib = libraries[DIRECT]
    dw = conv.ConvProblem("fwd", 32, 128, 128, 128, (56, 56), (3, 3), 1, 1, 1, 1, "fp16", "fp16", "fp16")
    assert lib.can_run(conv.make_args(dw, DIRECT)) == (abi.OK, "")
    assert lib.workspace_bytes(conv.make_args(dw, DIRECT)) == 0
    grouped = conv.ConvProblem("fwd", 32, 32, 128, 128, (56, 56), (3, 3), 1, 1, 1, 1, "fp16", "fp16", "fp16")
    status, reason = lib.can_run(conv.make_args(grouped, DIRECT))
    assert status == abi.UNSUPPORTED and "specialized" in reason
    args = conv.make_args(dw, DIRECT)
    args.params[0] = 3
    status, reason = lib.can_run(args)
    assert status == abi.UNSUPPORTED and "2D convolution" in reason

    lib = libraries[DIRECT_FX]
    assert lib.can_run(conv.make_args(dw, DIRECT_FX)) == (abi.OK, "")
    dw5 = conv.ConvProblem("fwd", 32, 128, 128, 128, (56, 56), (5, 5), 1, 1, 2, 2, "fp16", "fp16", "fp16")
    status, reason = lib.can_run(conv.make_args(dw5, DIRECT_FX))
    assert status == abi.UNSUPPORTED and "3 x 3 filter" in reason and "filter is 5 x 5" in reason

    lib = libraries[IGEMM]
    video = conv.ConvProblem("bwd_weight", 8, 1, 64, 64, (16, 56, 56), (3, 3, 3), 1, 1, 1, 1, "bf16", "bf16", "bf16")
    args = conv.make_args(video, IGEMM)
    assert lib.can_run(args) == (abi.OK, "")
    assert lib.workspace_bytes(args) >= 64 * 27 * 64 * 4  # fp32 sums of dW
    status, reason = lib.run(args)  # refused before any launch: no workspace given
    assert status == abi.INVALID_ARGUMENT and "workspace" in reason


def _refusal(lib, problem, key=SM90):
    status, reason = lib.can_run(conv.make_args(problem, key))
    assert status == abi.UNSUPPORTED, reason
    return reason


def test_sm90_host_checks_without_a_device(libraries):
    lib = libraries[SM90]

    def wgrad(n=2, g=1, c=64, k=64, stride=1, pad=1, size=(14, 14), filt=(3, 3)):
        return conv.ConvProblem("bwd_weight", n, g, c, k, size, filt, stride, 1, pad, pad, "fp16", "fp16", "fp16")

    args = conv.make_args(wgrad(), SM90)
    assert lib.can_run(args) == (abi.OK, "")  # our checks and CUTLASS's can_implement, host only
    # the split, decided without a device, is the ranker's (conv_tma_ws.partials_split): S fp32 partials of
    # (K rounded up to 64) x taps x C (tiles: ceil(K / 64) x taps x ceil(C / 128), C padded per tap)
    for problem, slices in ((wgrad(), 4), (wgrad(n=32, size=(56, 56)), 14), (wgrad(n=5, c=512), 2),
                            (wgrad(n=32, c=256, k=64, pad=0, filt=(1, 1)), 20), (wgrad(n=8, c=512, k=512), 1),
                            (wgrad(k=48), 4)):
        taps = 1 if problem.filter_size == (1, 1) else 9
        m, n, red, _ = problem.gemm_shape(SM90)
        tiles = -(-m // 64) * -(-n // 128)
        rows, cols = -(-problem.k // 64) * 64, taps * problem.c
        assert backends.family_of(SM90).module.partials_split(SM90, tiles, -(-red // 64), rows * cols, 2)[0] == slices, problem
        assert lib.workspace_bytes(conv.make_args(problem, SM90)) == -(-slices * rows * cols * 4 // 256) * 256, problem
    assert lib.can_run(conv.make_args(wgrad(n=5, c=512, stride=2), SM90)) == (abi.OK, "")
    assert "groups = 1" in _refusal(lib, wgrad(g=2)) and "direct or implicit_gemm" in _refusal(lib, wgrad(g=2))
    assert "multiples of 8" in _refusal(lib, wgrad(c=12))
    assert "pads at most 256" in _refusal(lib, wgrad(pad=300))
    assert "2D convolution" in _refusal(lib, conv.ConvProblem("bwd_weight", 2, 1, 64, 64, (5, 14, 14), (3, 3, 3), 1, 1,
                                                              1, 1, "fp16", "fp16", "fp16"))
    args = conv.make_args(wgrad(), SM90)
    args.tensors[0].stride[0] += 4  # X's batch stride no longer a multiple of 16 bytes
    status, reason = lib.can_run(args)
    assert status == abi.UNSUPPORTED and "16 bytes" in reason
    args = conv.make_args(wgrad(), SM90)
    args.tensors[2].stride[0] += 8  # dY no longer packed
    status, reason = lib.can_run(args)
    assert status == abi.UNSUPPORTED and "packed" in reason
    status, reason = lib.run(conv.make_args(wgrad(), SM90))  # refused before any launch: no device here
    assert status != abi.OK and reason


def test_sm90_two_consumers_host_checks_without_a_device(libraries):
    lib = libraries[SM90_TWO]
    wide = conv.ConvProblem("fwd", 16, 1, 512, 512, (2048,), (3,), 1, 1, 1, 1, "fp16", "fp16", "fp16")
    args = conv.make_args(wide, SM90_TWO)
    assert lib.can_run(args) == (abi.OK, "")
    assert lib.workspace_bytes(args) == 0
    grouped = conv.ConvProblem("fwd", 16, 2, 512, 512, (2048,), (3,), 1, 1, 1, 1, "fp16", "fp16", "fp16")
    assert "groups = 1" in _refusal(lib, grouped, SM90_TWO)
    status, reason = lib.run(args)  # refused before any launch: no device here
    assert status != abi.OK and reason
