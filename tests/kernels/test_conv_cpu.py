"""cpu grouped-convolution kernels against the float64 reference.

One bundle (built once per session with scons) holds the kernels of conv_fp16_all_essential plus a
test set of small-tile kernels for fp32, fp16 and bf16 in every direction and rank and both pipelines
(packed: implicit GEMM per group; direct: narrow groups, channels of all groups as lanes), so that tiny
problems still span several blocks, partial micro-tiles and several reduction chunks. Every
direction x rank x dtype x {dense, C/G = 4, 16, 64, depthwise} x {stride 1/2 x dilation 1/2, all
with asymmetric padding, plus mixed per-dim geometry} runs on random data with the output poisoned
(NaN) first; the direct kernels run the narrow kinds (C/G and K/G <= 8).
"""
import itertools
import zlib

import numpy as np
import pytest

from conftest import build_cpu_bundle
from tiledispatch import validation
from tiledispatch import backends
from tiledispatch.generator import toolchains
from tiledispatch.errors import InvalidInputError, UnsupportedProblemError
from tiledispatch.ops import conv
from tiledispatch.spec.key import Epilogue

ARCH = backends.get("cpu").detect_arch()
cpu = toolchains.get("cpu")
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")
DTYPES = ("fp32", "fp16", "bf16")
ESSENTIAL = "conv_fp16_all_essential"
TEST_TILE = {"packed": [16, 16, 24], "direct": [8, 32, 8]}  # small blocks, legal on every cpu arch
TEST_MMA = [4, 16, 1]
TEST_SET = f"""\
schema: 1
name: conv_test
description: small-tile cpu conv kernels for the tests
groups:
  - backend: cpu
    op: conv
    direction: [fwd, bwd_data, bwd_weight]
    spatial_dims: [1, 2, 3]
    dtype: [fp32, fp16, bf16]
    layout: nhwgc
    mma: {TEST_MMA}
    configs:
      - {{pipeline: packed, tile: {TEST_TILE['packed']}}}
      - {{pipeline: direct, tile: {TEST_TILE['direct']}}}
"""

# (G, C/G, K/G)
KINDS = {"dense": (1, 12, 20), "g4": (4, 4, 6), "g16": (3, 16, 8), "g64": (2, 64, 20), "depthwise": (10, 1, 1),
         "multiplier": (12, 1, 3), "dense_narrow": (1, 3, 8)}
PACKED_KINDS = ("dense", "g4", "g16", "g64", "depthwise")
DIRECT_KINDS = ("g4", "depthwise", "multiplier", "dense_narrow")  # C/G and K/G <= 8
# (stride, dilation, pad_lo, pad_hi), per dim (cut to the rank); every geometry pads asymmetrically
GEOMETRIES = {
    "s1d1": ((1, 1, 1), (1, 1, 1), (1, 0, 2), (0, 2, 1)),
    "s2d1": ((2, 2, 2), (1, 1, 1), (0, 1, 1), (2, 0, 0)),
    "s1d2": ((1, 1, 1), (2, 2, 2), (2, 1, 0), (1, 0, 3)),
    "s2d2": ((2, 2, 2), (2, 2, 2), (1, 2, 0), (0, 1, 2)),
    "mixed": ((3, 1, 2), (1, 2, 1), (0, 2, 1), (1, 0, 0)),
}
SIZES = {1: (2, (23,), (3,)), 2: (2, (9, 8), (3, 2)), 3: (1, (6, 5, 7), (3, 2, 3))}  # N, spatial, filter


@pytest.fixture(scope="session")
def conv_registry(tmp_path_factory):
    return build_cpu_bundle(tmp_path_factory.mktemp("conv_build"), "conv_test", TEST_SET, ESSENTIAL)


def make_case(rng, direction, rank, kind, geometry, dtype, n_scale=1):
    """Random inputs, the poisoned output and the float64 reference for one problem."""
    n, in_size, filt = SIZES[rank]
    g, cg, kg = KINDS[kind]
    stride, dilation, pad_lo, pad_hi = (v[:rank] for v in GEOMETRIES[geometry])
    p = conv.ConvProblem(direction, n * n_scale, g, g * cg, g * kg, in_size, filt, stride, dilation, pad_lo, pad_hi,
                         dtype, dtype, dtype)
    data, expect = validation.conv_case(p, rng)
    return p, data, expect


def run(registry, direction, data, p, kernel=None, **kw):
    geo = dict(stride=p.stride, dilation=p.dilation, pad_lo=p.pad_lo, pad_hi=p.pad_hi)
    if direction == "fwd":
        return conv.fwd(registry, data["x"], data["w"], data["y"], kernel=kernel, **geo, **kw)
    if direction == "bwd_data":
        return conv.bwd_data(registry, data["y"], data["w"], data["x"], kernel=kernel, **geo, **kw)
    return conv.bwd_weight(registry, data["x"], data["y"], data["w"], kernel=kernel, **geo, **kw)


def test_kernel_for(registry, direction, rank, dtype, pipeline="packed"):
    """The small-tile test kernel of a signature and pipeline."""
    for k in registry.kernels:
        sig, alg = k.key.signature, k.key.algorithm
        if (sig.op, sig.direction, sig.spatial_dims, sig.dtype_a, alg.pipeline) == (
                "conv", direction, rank, dtype, pipeline) and list(alg.tile) == TEST_TILE[pipeline]:
            return k
    raise AssertionError(f"no {pipeline} test kernel for {direction} {rank}D {dtype}")


test_kernel_for.__test__ = False


MATRIX = [(d, r, t, "packed", k) for d, r, t, k in itertools.product(DIRECTIONS, (1, 2, 3), DTYPES, PACKED_KINDS)]
MATRIX += [(d, r, t, "direct", k) for d, r, t, k in itertools.product(DIRECTIONS, (1, 2, 3), DTYPES, DIRECT_KINDS)]


@pytest.mark.slow
@pytest.mark.parametrize("direction,rank,dtype,pipeline,kind", MATRIX)
def test_matches_reference(conv_registry, direction, rank, dtype, pipeline, kind):
    kern = test_kernel_for(conv_registry, direction, rank, dtype, pipeline)
    rng = np.random.default_rng(zlib.crc32(f"{direction}{rank}{dtype}{pipeline}{kind}".encode()))
    failures = []
    for geometry in GEOMETRIES:
        p, data, expect = make_case(rng, direction, rank, kind, geometry, dtype)
        out = run(conv_registry, direction, data, p, kernel=kern)
        result = validation.compare(out, expect, kern.key)
        if not result["passed"]:
            failures.append(f"{p}: {result}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("direction,rank", list(itertools.product(DIRECTIONS, (1, 2, 3))))
@pytest.mark.parametrize("dtype,pipeline", (("fp32", "packed"), ("bf16", "packed"), ("fp16", "direct")))
def test_alpha_beta(conv_registry, direction, rank, dtype, pipeline):
    """out = alpha * conv + beta * out, the old contents read in the output's dtype."""
    kern = test_kernel_for(conv_registry, direction, rank, dtype, pipeline)
    rng = np.random.default_rng(7)
    p, data, expect = make_case(rng, direction, rank, "g4", "s2d2", dtype)
    written = conv.WRITES[direction]
    data[written][...] = validation.random_array(rng, data[written].shape, dtype)
    old = data[written].astype(np.float64)
    out = run(conv_registry, direction, data, p, kernel=kern, alpha=0.75, beta=-1.25)
    assert validation.compare(out, 0.75 * expect - 1.25 * old, kern.key)["passed"]


@pytest.mark.slow
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_essential_kernels(conv_registry, direction):
    """Every kernel of conv_fp16_all_essential, on problems that span several of its (large) blocks."""
    kernels = [k for k in conv_registry.kernels if k.origin.startswith(f"preselected/{ESSENTIAL}")
               and k.key.signature.direction == direction and k.key.signature.epilogue == Epilogue()]
    assert len(kernels) == 9
    rng = np.random.default_rng(11)
    failures = []
    for kern in kernels:
        rank = kern.key.signature.spatial_dims
        kinds = (("g64", "s1d1"), ("depthwise", "s2d2"), ("dense", "mixed"))
        if kern.key.algorithm.pipeline == "direct":
            kinds = (("g4", "s1d1"), ("depthwise", "s2d2"), ("dense_narrow", "mixed"))
        for kind, geometry in kinds:
            p, data, expect = make_case(rng, direction, rank, kind, geometry, "fp16", n_scale=4)
            out = run(conv_registry, direction, data, p, kernel=kern)
            result = validation.compare(out, expect, kern.key)
            if not result["passed"]:
                failures.append(f"{kern.name} {p}: {result}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_essential_fused_kernels(conv_registry):
    """The fused forward epilogues of conv_fp16_all_essential (bias, relu, relu + residual, clamp) with random bias
    and residuals, the output poisoned, against the float64 reference."""
    kernels = [k for k in conv_registry.kernels if k.origin.startswith(f"preselected/{ESSENTIAL}")
               and k.key.signature.epilogue != Epilogue()]
    assert len(kernels) == 7
    rng = np.random.default_rng(12)
    failures = []
    for kern in kernels:
        epi = kern.key.signature.epilogue
        kinds = (("g4", "s1d1"), ("depthwise", "s2d2")) if kern.key.algorithm.pipeline == "direct" else \
            (("dense", "mixed"), ("g16", "s2d1"))
        for kind, geometry in kinds:
            n, in_size, filt = SIZES[2]
            g, cg, kg = KINDS[kind]
            stride, dilation, pad_lo, pad_hi = (v[:2] for v in GEOMETRIES[geometry])
            p = conv.ConvProblem("fwd", 2 * n, g, g * cg, g * kg, in_size, filt, stride, dilation, pad_lo, pad_hi,
                                 "fp16", "fp16", "fp16", epilogue=epi)
            data, expect = validation.conv_case(p, rng)
            clamp = {"clamp": validation.VALIDATION_CLAMP} if epi.activation == "clamp" else {}
            out = run(conv_registry, "fwd", data, p, kernel=kern, bias=data.get("bias"),
                      residuals=data.get("residuals", ()), activation=epi.activation, **clamp)
            result = validation.compare(out, expect, kern.key)
            if not result["passed"]:
                failures.append(f"{kern.name} {p}: {result}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_selection_picks_a_matching_kernel(conv_registry):
    rng = np.random.default_rng(3)
    p, data, expect = make_case(rng, "bwd_weight", 2, "g16", "s2d1", "fp16")
    kern = conv_registry.select(p)
    assert kern.key.signature.direction == "bwd_weight" and kern.key.signature.spatial_dims == 2
    out = run(conv_registry, "bwd_weight", data, p)
    assert validation.compare(out, expect, kern.key)["passed"]


@pytest.mark.slow
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_strided_views(conv_registry, direction):
    """Operands that are slices of larger arrays (non-dense strides, unit channel stride) are used in place."""
    kern = test_kernel_for(conv_registry, direction, 2, "fp32")
    rng = np.random.default_rng(5)
    p, data, expect = make_case(rng, direction, 2, "g4", "s2d1", "fp32")
    views = {}
    for role, a in data.items():
        big = np.full((a.shape[0] + 1, *(s * 2 for s in a.shape[1:-1]), a.shape[-1] + 3), np.nan, a.dtype)
        v = big[(slice(1, None),) + tuple(slice(0, 2 * s, 2) for s in a.shape[1:-1]) + (slice(0, a.shape[-1]),)]
        v[...] = a
        views[role] = v
    out = run(conv_registry, direction, views, p, kernel=kern)
    assert validation.compare(np.ascontiguousarray(out), expect, kern.key)["passed"]


@pytest.mark.slow
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("rank", (1, 2, 3))
def test_logical_channels_last_form(conv_registry, direction, rank):
    """groups=G takes [N, C, spatial...] / [K, C/G, filter...] arrays holding channels-last memory (what torch
    channels_last tensors are) and allocates the output in that form."""
    kern = test_kernel_for(conv_registry, direction, rank, "fp32")
    rng = np.random.default_rng(9)
    p, data, expect = make_case(rng, direction, rank, "g16", "s2d2", "fp32")
    s = p.spatial_dims

    def logical(a, role):  # explicit [.., G, C/G] memory seen as [N, C, sp...] / [K, C/G, f...]
        if role == "w":
            return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]).transpose(0, s + 1, *range(1, s + 1))
        return a.reshape(*a.shape[:-2], -1).transpose(0, s + 1, *range(1, s + 1))

    geo = dict(stride=p.stride, dilation=p.dilation, pad_lo=p.pad_lo, pad_hi=p.pad_hi, groups=p.g)
    x, w, y = (logical(data[r], r) for r in ("x", "w", "y"))
    if direction == "fwd":
        out = conv.fwd(conv_registry, x, w, kernel=kern, **geo)
    elif direction == "bwd_data":
        out = conv.bwd_data(conv_registry, y, w, kernel=kern, in_size=p.in_size, **geo)
    else:
        out = conv.bwd_weight(conv_registry, x, y, kernel=kern, filter_size=p.filter_size, **geo)
    written = conv.WRITES[direction]
    assert out.shape == logical(data[written], written).shape
    explicit = np.ascontiguousarray(np.moveaxis(out, 1, -1)).reshape(expect.shape)
    assert validation.compare(explicit, expect, kern.key)["passed"]


@pytest.mark.slow
@pytest.mark.parametrize("pipeline,kind", (("packed", "dense"), ("direct", "g4")))
def test_bwd_weight_is_independent_of_the_thread_count(conv_registry, pipeline, kind):
    """The split reduction adds its slices in a fixed order: 1 and 3 threads give the same bits."""
    kern = test_kernel_for(conv_registry, "bwd_weight", 2, "fp32", pipeline)
    rng = np.random.default_rng(13)
    p, data, _ = make_case(rng, "bwd_weight", 2, kind, "s1d1", "fp32", n_scale=8)
    one = run(conv_registry, "bwd_weight", data, p, kernel=kern, num_threads=1).copy()
    three = run(conv_registry, "bwd_weight", data, p, kernel=kern, num_threads=3)
    assert np.array_equal(one, three)


@pytest.mark.slow
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_direct_kernels_decline_wide_groups(conv_registry, direction):
    """A direct kernel says why it does not take C/G = 64, K/G = 20 (a packed kernel does)."""
    kern = test_kernel_for(conv_registry, direction, 2, "fp32", "direct")
    p, _, _ = make_case(np.random.default_rng(1), direction, 2, "g64", "s1d1", "fp32")
    status, reason = kern.library.can_run(conv.make_args(p, kern.key))
    expect = "K/G = 20" if direction == "bwd_data" else "C/G = 64"
    assert status == 1 and "direct kernels serve narrow groups" in reason and expect in reason, reason


# -- errors ------------------------------------------------------------------------------------------
def _problem(**changes):
    base = dict(direction="fwd", n=1, g=2, c=8, k=6, in_size=(5, 5), filter_size=(3, 3), stride=(1, 1),
                dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype_x="fp32", dtype_w="fp32", dtype_y="fp32")
    base.update(changes)
    return conv.ConvProblem(**base)


@pytest.mark.parametrize("changes,match", [
    ({"c": 9}, "groups G = 2 do not divide C = 9"),
    ({"k": 5}, "do not divide K = 5"),
    ({"pad_lo": (1, -1)}, "pad_lo must be >= 0"),
    ({"stride": (0, 1)}, "stride must be >= 1"),
    ({"dilation": (1, 1, 1)}, "one per spatial dim"),
    ({"filter_size": (9, 3)}, "smaller than the dilated filter"),
    ({"in_size": (1, 2, 3, 4)}, "1, 2 or 3 spatial sizes"),
    ({"direction": "backward"}, "direction must be one of"),
])
def test_problem_rejects_bad_geometry(changes, match):
    with pytest.raises(InvalidInputError, match=match):
        _problem(**changes)


def test_problem_sizes_and_signature_match():
    p = _problem(stride=(2, 1), pad_lo=(0, 2), pad_hi=(1, 0))
    assert p.out_size == (2, 5)
    assert p.shapes() == {"x": (1, 5, 5, 2, 4), "w": (2, 3, 3, 3, 4), "y": (1, 2, 5, 2, 3)}
    assert p.flops() == 2 * 1 * 10 * 6 * 4 * 9
    assert p.gemm_shape() == (10, 3, 36, 2)
    from tiledispatch.spec.key import Algorithm, KernelKey, Signature

    direct = KernelKey(Signature("conv", "fp32", "fp32", "fp32", "fp32", "nhwgc", direction="fwd", spatial_dims=2),
                       Algorithm((64, 128, 64), "direct", mma=(4, 32, 1)), "cpu", "x86v4")
    assert p.gemm_shape(direct) == (10, 6, 36, 1)  # all groups' channels as one GEMM's columns


@pytest.mark.slow
def test_entry_points_reject_bad_arrays(conv_registry):
    x = np.ones((1, 6, 6, 2, 4), np.float32)
    w = np.ones((2, 3, 3, 3, 4), np.float32)
    with pytest.raises(InvalidInputError, match=r"w has shape \[2, 3, 3, 3, 5\], expected \[2, 3, 3, 3, 4\]"):
        conv.fwd(conv_registry, x, np.ones((2, 3, 3, 3, 5), np.float32))
    with pytest.raises(InvalidInputError, match=r"y has shape \[1, 5, 5, 2, 3\], expected \[1, 4, 4, 2, 3\]"):
        conv.fwd(conv_registry, x, w, np.ones((1, 5, 5, 2, 3), np.float32))
    with pytest.raises(InvalidInputError, match="not divisible by groups = 3"):
        conv.fwd(conv_registry, np.ones((1, 8, 6, 6), np.float32), np.ones((6, 4, 3, 3), np.float32), groups=3)
    with pytest.raises(InvalidInputError, match="pad_lo must be >= 0"):
        conv.fwd(conv_registry, x, w, pad_lo=-1)
    with pytest.raises(InvalidInputError, match="either padding"):
        conv.fwd(conv_registry, x, w, padding=1, pad_hi=0)
    with pytest.raises(InvalidInputError, match="contiguous channels.*channels_last"):
        nchw = np.ones((1, 8, 6, 6), np.float32)  # plain NCHW: channels are not contiguous
        conv.fwd(conv_registry, nchw, np.ones((6, 4, 3, 3), np.float32).transpose(0, 2, 3, 1).copy().transpose(
            0, 3, 1, 2), groups=2)
    with pytest.raises(InvalidInputError, match="needs in_size"):
        conv.bwd_data(conv_registry, np.ones((1, 4, 4, 2, 3), np.float32), w)
    with pytest.raises(InvalidInputError, match="beta != 0"):
        conv.fwd(conv_registry, x, w, beta=1.0)
    with pytest.raises(UnsupportedProblemError, match="kernel takes X as fp32, problem has fp64|no kernel can run"):
        conv.fwd(conv_registry, x.astype(np.float64), w.astype(np.float64))


@pytest.mark.slow
def test_kernel_checks_the_abi_arguments(conv_registry):
    """td_can_run itself rejects what a caller bypassing the Python checks could pass, with a reason."""
    from tiledispatch import abi

    kern = test_kernel_for(conv_registry, "fwd", 2, "fp32")
    p = _problem()
    lib = kern.library

    def reason(mutate):
        args = conv.make_args(p, kern.key)
        mutate(args)
        return lib.can_run(args)

    assert reason(lambda a: None) == (abi.OK, "")

    def set_attr(path, value):
        def mutate(a):
            obj = a
            for part in path[:-1]:
                obj = obj[part] if isinstance(part, int) else getattr(obj, part)
            last = path[-1]
            if isinstance(last, int):
                obj[last] = value
            else:
                setattr(obj, last, value)
        return mutate

    cases = [
        (set_attr(("params", 0), 3), abi.UNSUPPORTED, "2D convolution; params[0]"),
        (set_attr(("params", 7), -1), abi.INVALID_ARGUMENT, "padding -1"),
        (set_attr(("params", 1), 0), abi.INVALID_ARGUMENT, "stride 0"),
        (set_attr(("params", 1), 2), abi.INVALID_ARGUMENT, "Y has size 5, expected"),
        (set_attr(("tensors", 1, "dtype"), 2), abi.INVALID_ARGUMENT, "W has dtype fp16, kernel expects fp32"),
        (set_attr(("tensors", 0, "rank"), 4), abi.INVALID_ARGUMENT, "X has rank 4"),
        (set_attr(("tensors", 1, "shape", 4), 5), abi.INVALID_ARGUMENT, "shapes disagree"),
        (set_attr(("tensors", 0, "stride", 4), 2), abi.UNSUPPORTED, "channel-contiguous"),
        (set_attr(("tensors", 2, "stride", 1), 0), abi.INVALID_ARGUMENT, "overlap"),
        (set_attr(("tensors", 2, "data"), None), abi.INVALID_ARGUMENT, "Y is missing"),
        (set_attr(("num_tensors",), 4), abi.INVALID_ARGUMENT, "expected 3 tensors"),
    ]
    for mutate, status, text in cases:
        got_status, got_reason = reason(mutate)
        assert got_status == status and text in got_reason, (text, got_status, got_reason)


def test_conv_epilogues_are_a_named_rule():
    from tiledispatch.generator import rules
    from tiledispatch.spec.key import Algorithm, Epilogue, KernelKey, Signature

    def key(direction):
        return KernelKey(Signature("conv", "fp16", "fp16", "fp16", "fp32", "nhwgc", Epilogue("relu"), direction, 2),
                         Algorithm((64, 64, 256), "packed", mma=(4, 32, 1)), "cpu", "x86v4")

    assert rules.check(key("fwd")) == []  # fused forward epilogues (tests/test_conv_epilogue.py)
    for direction in ("bwd_data", "bwd_weight"):
        assert [v.rule for v in rules.check(key(direction))] == ["cpu.conv_epilogue"]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_tiling_shapes_the_generated_code(direction):
    from tiledispatch.generator.codegen import render
    from tiledispatch.spec.key import Algorithm, KernelKey, Signature

    key = KernelKey(Signature("conv", "bf16", "bf16", "bf16", "fp32", "nhwgc", direction=direction, spatial_dims=3),
                    Algorithm((96, 48, 200), "packed", mma=(6, 16, 1)), "cpu", "x86v4")
    src = render(key)
    assert "constexpr int MC = 96, NC = 48, KC = 200;" in src
    assert "constexpr int MR = 6, NR = 16;" in src
    assert "constexpr int S = 3;" in src
    assert f"templates/cpu/conv_packed/conv_{direction}.cpp.j2" in src


@pytest.mark.slow
def test_run_takes_a_problem_and_a_dict_of_tensors(conv_registry):
    rng = np.random.default_rng(17)
    p, data, expect = make_case(rng, "bwd_data", 3, "g4", "s2d1", "fp32")
    kern = conv_registry.run(p, data)
    assert kern.key.signature.direction == "bwd_data"
    assert validation.compare(data["x"], expect, kern.key)["passed"]
    geo = dict(direction="bwd_data", n=p.n, g=p.g, c=p.c, k=p.k, in_size=p.in_size, filter_size=p.filter_size,
               stride=p.stride, dilation=p.dilation, pad_lo=p.pad_lo)
    with pytest.raises(InvalidInputError, match=r"y has shape \[1, 3, 3, 3, 4, 6\], expected \[1, 4, 3, 4, 4, 6\]"):
        conv_registry.run(_problem(**geo, pad_hi=tuple(v + 1 for v in p.pad_hi)), data)
    with pytest.raises(InvalidInputError, match="the tensors describe .*fp32/fp32->fp32.* but the problem is .*fp16"):
        conv_registry.run(_problem(**geo, pad_hi=p.pad_hi, dtype_x="fp16", dtype_w="fp16", dtype_y="fp16"), data)
    with pytest.raises(InvalidInputError, match="conv tensors are x, w and y"):
        conv_registry.run(p, {"x": data["x"], "w": data["w"]})


@pytest.mark.slow
@pytest.mark.skipif(ARCH == "generic", reason="the bundle's kernels already use the generic conversions")
@pytest.mark.parametrize("direction,pipeline", (("fwd", "packed"), ("bwd_data", "direct")))
def test_generic_arch_fp16_conversions(tmp_path, direction, pipeline):
    """The bundle is built for this machine's arch (fp16 through F16C on x86v3/x86v4); a generic-arch kernel
    converts fp16 in software: check that path against the reference too."""
    import subprocess

    from tiledispatch.generator import codegen
    from tiledispatch.generator.codegen import render
    from tiledispatch.registry import Kernel, Registry
    from tiledispatch.spec.key import Algorithm, KernelKey, Signature

    key = KernelKey(Signature("conv", "fp16", "fp16", "fp16", "fp32", "nhwgc", direction=direction, spatial_dims=2),
                    Algorithm(tuple(TEST_TILE[pipeline]), pipeline, mma=(4, 4, 1)), "cpu", "generic")
    src, lib = tmp_path / "k.cpp", tmp_path / f"{key.name}.so"
    src.write_text(render(key))
    subprocess.run(cpu.compile_command(key, cpu.toolchain(), str(src), str(lib), [str(d) for d in codegen.include_dirs(key)]),
                   check=True)
    registry = Registry([Kernel(key, lib)], "cpu", "generic")
    p, data, expect = make_case(np.random.default_rng(19), direction, 2, "depthwise", "s2d2", "fp16")
    out = run(registry, direction, data, p)
    assert validation.compare(out, expect, key)["passed"]
