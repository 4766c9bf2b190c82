"""Fused forward convolution epilogues: Y = act(alpha * conv(X, W) + beta * Y + bias[k] + sum(residuals)).

The cpu kernels (packed and direct) with every activation, bias and residuals run on random data with the output
poisoned first, against the float64 reference; the runtime's checks (bias / residual shape, dtype, the backward
directions refusing an epilogue), the selection matching the epilogue exactly, the fused ABI's tensor count, the
cached fast path with the epilogue's arrays in its fingerprint, and the pointwise route through the GEMM kernels.
"""
import numpy as np
import pytest

from conftest import build_cpu_bundle
from tiledispatch import abi, reference, validation
from tiledispatch.errors import InvalidInputError, UnsupportedProblemError
from tiledispatch.ops import conv
from tiledispatch.spec.key import ACTIVATIONS, Epilogue

ACTS = list(ACTIVATIONS)
TEST_SET = f"""\
schema: 1
name: conv_epilogue_test
description: fused-epilogue cpu conv forward kernels for the tests
groups:
  - backend: cpu
    op: conv
    direction: fwd
    spatial_dims: 2
    dtype: [fp32, fp16]
    layout: nhwgc
    mma: [4, 16, 1]
    pipeline: packed
    tile: [16, 16, 24]
    epilogue: {{activation: {ACTS}, bias: true, residuals: 1}}
  - backend: cpu
    op: conv
    direction: fwd
    spatial_dims: [1, 3]
    dtype: fp32
    layout: nhwgc
    mma: [4, 16, 1]
    pipeline: packed
    tile: [16, 16, 24]
    epilogue: [{{activation: relu}}, {{activation: identity, bias: true, residuals: 2}}]
  - backend: cpu
    op: conv
    direction: fwd
    spatial_dims: 2
    dtype: [fp32, bf16]
    layout: nhwgc
    mma: [4, 16, 1]
    pipeline: direct
    tile: [8, 32, 8]
    epilogue: [{{activation: clamp, bias: true, residuals: 1}}, {{activation: relu}},
               {{activation: silu, bias: true}}]
  - backend: cpu
    op: conv
    direction: fwd
    spatial_dims: 2
    dtype: fp32
    layout: nhwgc
    mma: [4, 16, 1]
    pipeline: packed
    tile: [16, 16, 24]
  - backend: cpu
    op: gemm
    dtype: fp16
    layout: rcr
    pipeline: packed
    tile: [48, 128, 128]
    mma: [6, 32, 1]
    epilogue: {{activation: relu, bias: true, residuals: 1}}
"""
GEO = {"stride": (2, 1), "dilation": (1, 2), "pad_lo": (1, 0), "pad_hi": (0, 2)}
GEO_REF = ((2, 1), (1, 2), (1, 0), (0, 2))
CLAMP = (-0.25, 0.5)


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    return build_cpu_bundle(tmp_path_factory.mktemp("conv_epilogue"), "conv_epilogue_test", TEST_SET)


def case(rng, dtype, g, cg, kg, n=2, in_size=(9, 8), filt=(3, 2), epilogue=Epilogue(), geo=GEO_REF):
    rank = len(in_size)
    p = conv.ConvProblem("fwd", n, g, g * cg, g * kg, in_size, filt, *(v[:rank] for v in geo), dtype, dtype, dtype,
                         epilogue=epilogue)
    data, expect = validation.conv_case(p, rng)
    return p, data, expect


def call(reg, p, data, **kw):
    geo = {"stride": p.stride, "dilation": p.dilation, "pad_lo": p.pad_lo, "pad_hi": p.pad_hi}
    options = dict(geo, bias=data.get("bias"), residuals=data.get("residuals", ()),
                   activation=p.epilogue.activation)
    if p.epilogue.activation == "clamp":
        options["clamp"] = validation.VALIDATION_CLAMP
    options.update(kw)
    return reg.conv_fwd(data["x"], data["w"], data["y"], **options)


def check(out, expect, dtype):
    tol = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1e-2}[dtype]
    out64 = np.asarray(out).astype(np.float64)
    assert np.isfinite(out64).all(), "unwritten (NaN) outputs"
    err = np.linalg.norm(out64 - expect) / np.linalg.norm(expect)
    assert err <= tol, err


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("activation", ACTS)
def test_packed_every_activation_with_bias_and_residual(reg, activation, dtype):
    rng = np.random.default_rng(hash((activation, dtype)) % 2**32)
    epi = Epilogue(activation, True, 1)
    for g, cg, kg in ((1, 12, 20), (3, 4, 6)):
        p, data, expect = case(rng, dtype, g, cg, kg, epilogue=epi)
        kernels = reg.candidates(p)
        assert any(k.key.algorithm.pipeline == "packed" for k in kernels)
        for k in kernels:
            assert k.key.signature.epilogue == epi
            data = {**data, "y": validation.poison(data["y"].copy())}
            call(reg, p, data, kernel=k)
            check(data["y"], expect, dtype)


@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize("epi", [Epilogue("relu"), Epilogue("identity", True, 2)])
def test_packed_ranks_activation_only_and_two_residuals(reg, rank, epi):
    rng = np.random.default_rng(rank)
    in_size, filt = ((23,), (3,)) if rank == 1 else ((6, 5, 7), (3, 2, 3))
    geo = ((2, 1, 1), (1, 2, 1), (1, 0, 1), (0, 2, 1))
    geo = tuple(v[:rank] for v in geo)
    p, data, expect = case(rng, "fp32", 2, 8, 6, in_size=in_size, filt=filt, epilogue=epi, geo=geo)
    call(reg, p, data)
    check(data["y"], expect, "fp32")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("epi", [Epilogue("clamp", True, 1), Epilogue("relu"), Epilogue("silu", True)])
def test_direct_depthwise_epilogues(reg, dtype, epi):
    rng = np.random.default_rng(7)
    for g, cg, kg in ((24, 1, 1), (8, 1, 3)):  # depthwise and a channel multiplier: lanes span the groups
        p, data, expect = case(rng, dtype, g, cg, kg, epilogue=epi)
        kern = reg.select(p)
        assert kern.key.algorithm.pipeline == "direct" or reg.explain(p)
        for k in reg.candidates(p):
            data = {**data, "y": validation.poison(data["y"].copy())}
            call(reg, p, data, kernel=k)
            check(data["y"], expect, dtype)


def test_alpha_beta_and_logical_form_with_bias_vector(reg):
    """alpha, beta * old Y and the frameworks' [N, K, H, W] form (channels-last memory) with a [K] bias."""
    rng = np.random.default_rng(3)
    g, cg, kg, n = 1, 12, 20, 2
    x = validation.random_array(rng, (n, 9, 8, g, cg), "fp32")
    w = validation.random_array(rng, (g, kg, 3, 2, cg), "fp32")
    old = validation.random_array(rng, (n, 4, 8, g, kg), "fp32")
    res = validation.random_array(rng, (n, 4, 8, g, kg), "fp32")
    bias = validation.random_array(rng, (kg,), "fp32")
    want = reference.conv_fwd_fused(x, w, *GEO_REF, y=old, bias=bias, residuals=(res,), alpha=0.5, beta=-1.5,
                                    activation="gelu_tanh")

    def logical(a):  # [N, H, W, 1, K] -> [N, K, H, W] view of the same memory
        return a[..., 0, :].transpose(0, 3, 1, 2)

    y = old.copy()
    out = reg.conv_fwd(logical(x), w[0].transpose(0, 3, 1, 2), logical(y), groups=1, bias=bias,
                       residuals=(logical(res),), activation="gelu_tanh", alpha=0.5, beta=-1.5, **GEO)
    assert out.base is not None and np.shares_memory(out, y)
    check(y, want, "fp32")


def test_fused_abi_tensor_count(reg):
    rng = np.random.default_rng(4)
    p, data, _ = case(rng, "fp32", 8, 1, 1, epilogue=Epilogue("relu"))  # the direct kernel's depthwise
    kern = reg.select(p)
    ops = conv.operands_for(p, {"x": data["x"], "w": data["w"], "y": data["y"]})
    args = conv.make_args(p, kern.key, ops)
    assert args.num_tensors == 4 and not args.tensors[3].data  # bias slot counted, NULL
    assert kern.library.can_run(args)[0] == abi.OK
    args.num_tensors = 3
    status, why = kern.library.can_run(args)
    assert status == abi.INVALID_ARGUMENT and "expected 4 tensors (X, W, Y, bias, 0 residuals)" in why
    plain = next(k for k in reg.kernels if k.key.signature.op == "conv" and k.key.signature.epilogue == Epilogue())
    p0 = conv.ConvProblem(**{**p.__dict__, "epilogue": Epilogue()})
    args = conv.make_args(p0, plain.key, conv.operands_for(p0, {"x": data["x"], "w": data["w"], "y": data["y"]}))
    assert args.num_tensors == 3  # plain kernels keep the 3-tensor ABI


def test_selection_matches_the_epilogue_exactly(reg):
    rng = np.random.default_rng(5)
    p, data, _ = case(rng, "fp32", 1, 12, 20, epilogue=Epilogue("tanh"))  # tanh only with bias + residual here
    with pytest.raises(UnsupportedProblemError, match="no kernel can run conv2d fwd .* epilogue tanh"):
        call(reg, p, data)
    # the plain kernel of the problem's dtypes refuses it for its epilogue (the message lists the closest eight)
    reasons = {k.name: why for k, why in reg.explain(p) if k.key.signature.epilogue == Epilogue()
               and k.key.signature.spatial_dims == 2 and k.key.signature.dtype_a == "fp32"}
    assert reasons and all(why == "kernel fuses epilogue identity, problem asks for tanh" for why in reasons.values())
    p, data, expect = case(rng, "fp32", 1, 12, 20)
    call(reg, p, data)  # the plain kernel, not a fused one with zero operands
    assert reg.select(p).key.signature.epilogue == Epilogue()
    check(data["y"], expect, "fp32")


def test_bad_epilogue_inputs_are_refused(reg):
    rng = np.random.default_rng(6)
    p, data, _ = case(rng, "fp32", 2, 6, 10, epilogue=Epilogue("relu", True, 1))
    x, w, y = data["x"], data["w"], data["y"]
    res = data["residuals"][0]
    bias = data["bias"]
    with pytest.raises(InvalidInputError, match=r"bias has shape \[19\], expected \[20\]"):
        reg.conv_fwd(x, w, y, bias=np.zeros(19, np.float32), activation="relu", **GEO)
    with pytest.raises(InvalidInputError, match="bias has dtype fp16, expected fp32"):
        reg.conv_fwd(x, w, y, bias=bias.astype(np.float16), activation="relu", **GEO)
    with pytest.raises(InvalidInputError, match="residual 0 has shape"):
        reg.conv_fwd(x, w, y, residuals=(res[:, :-1],), **GEO)
    with pytest.raises(InvalidInputError, match="residual 0 has dtype fp16"):
        reg.conv_fwd(x, w, y, residuals=(res.astype(np.float16),), **GEO)
    with pytest.raises(InvalidInputError, match="unknown activation 'swish'"):
        reg.conv_fwd(x, w, y, activation="swish", **GEO)
    with pytest.raises(InvalidInputError, match="clamp needs low <= high"):
        reg.conv_fwd(x, w, y, bias=bias, residuals=(res,), activation="clamp", clamp=(1.0, 0.0), **GEO)
    with pytest.raises(InvalidInputError, match="clamp bounds are read by activation 'clamp' only"):
        reg.conv_fwd(x, w, y, bias=bias, residuals=(res,), activation="relu", clamp=(0.0, 6.0), **GEO)
    with pytest.raises(InvalidInputError, match="overlaps"):
        reg.conv_fwd(x, w, y, bias=bias, residuals=(y,), activation="relu", **GEO)
    dy = validation.random_array(rng, y.shape, "fp32")
    with pytest.raises(InvalidInputError, match="conv bwd_data takes no fused epilogue"):
        reg.conv_bwd_data(dy, w, x.copy(), bias=bias, **GEO)
    with pytest.raises(InvalidInputError, match="conv bwd_weight takes no fused epilogue"):
        reg.conv_bwd_weight(x, dy, w.copy(), activation="relu", **GEO)


def test_repeated_fused_calls_take_the_fast_path(reg, monkeypatch):
    """The second call with the same tensor layouts skips the checks; new bias / residual pointers are swapped in
    (never the old ones reused), and a changed residual layout takes the full checks again."""
    rng = np.random.default_rng(8)
    epi = Epilogue("relu", True, 1)
    checks = []
    real = conv.operands
    monkeypatch.setattr(conv, "operands", lambda *a, **k: checks.append(1) or real(*a, **k))
    for i in range(3):
        p, data, expect = case(rng, "fp32", 1, 12, 20, epilogue=epi)
        call(reg, p, data)
        check(data["y"], expect, "fp32")
    assert len(checks) == 1
    p, data, expect = case(rng, "fp32", 1, 12, 20, epilogue=epi)
    bigger = np.zeros(data["y"].shape[:-1] + (40,), np.float32)  # a residual with other strides
    bigger[..., :20] = data["residuals"][0]
    data["residuals"] = (bigger[..., :20],)
    call(reg, p, data)
    check(data["y"], expect, "fp32")
    assert len(checks) == 2


def test_pointwise_fused_conv_runs_on_gemm_kernels(reg):
    """A 1x1 fp16 convolution with bias + relu + residual runs on the GEMM kernel with that epilogue."""
    rng = np.random.default_rng(9)
    epi = Epilogue("relu", True, 1)
    p = conv.ConvProblem("fwd", 2, 1, 32, 64, (5, 6), (1, 1), 1, 1, 0, 0, "fp16", "fp16", "fp16", epilogue=epi)
    data, expect = validation.conv_case(p, rng)
    used = []
    real = reg._launch
    reg._launch = lambda problem, *a, **k: used.append(problem.op) or real(problem, *a, **k)
    try:
        for _ in range(2):
            validation.poison(data["y"])
            reg.conv_fwd(data["x"], data["w"], data["y"], bias=data["bias"], residuals=data["residuals"],
                         activation="relu")
            check(data["y"], expect, "fp16")
    finally:
        del reg._launch
    assert used == ["gemm"]  # once: the second call replayed the cached GEMM launch


def test_plan_takes_the_epilogue_operands(reg):
    """A Plan of a fused problem: bias and residuals in its tensors dict, clamp among its scalars; new arrays of the
    same layout swap pointers, and a missing residual is refused by the full checks."""
    rng = np.random.default_rng(10)
    epi = Epilogue("clamp", True, 1)
    p, data, _ = case(rng, "fp32", 1, 12, 20, epilogue=epi)
    plan = reg.plan(p, clamp=(-0.1, 0.2))
    for _ in range(2):
        _, data, _ = case(rng, "fp32", 1, 12, 20, epilogue=epi)
        plan({"x": data["x"], "w": data["w"], "y": data["y"], "bias": data["bias"], "residuals": data["residuals"]})
        want = reference.conv_fwd_fused(data["x"], data["w"], *GEO_REF, bias=data["bias"],
                                        residuals=data["residuals"], activation="clamp", clamp=(-0.1, 0.2))
        check(data["y"], want, "fp32")
    with pytest.raises(InvalidInputError, match="the tensors describe"):
        plan({"x": data["x"], "w": data["w"], "y": data["y"], "bias": data["bias"]})
