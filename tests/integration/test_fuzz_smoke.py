"""Fuzz smoke: random GEMMs and random grouped convolutions on the cpu backend against a float64 reference
written here with plain numpy (not tiledispatch.reference, so a bug the two shared could not hide).

One bundle is built once per session: the GEMM kernels users get (every preselected cpu GEMM set: every
dtype, layout and epilogue; compiled once per session with the other tests' GEMM bundle) and small-tile conv
kernels of every direction, spatial rank and pipeline (small tiles, so small problems still span several
blocks, partial micro-tiles and several k chunks). Each GEMM case draws a kernel, a shape (1, small primes,
sizes around the tile edges, anything up to a few hundred), batch and broadcast batch, padded leading
dimensions, alpha / beta and the epilogue's inputs; each conv case a direction, rank, dtype, groups (dense,
grouped, depthwise, narrow), stride, dilation and asymmetric padding. Inputs are random and never zero; the
output is poisoned (NaN, or INT32_MIN) before the call. The tolerances are the cpu rules' (`tolerance` in
templates/cpu/__init__.py).

The seed is TD_FUZZ_SEED when set, else random; every failure names it: `TD_FUZZ_SEED=<seed> python3 -m
pytest tests/integration/test_fuzz_smoke.py` replays the run.
"""
from __future__ import annotations

import itertools
import math
import os
import secrets

import ml_dtypes
import numpy as np
import pytest

from conftest import CPU_GEMM_SETS, REPO, build_cpu_bundle
from tiledispatch import backends

SEED = int(os.environ.get("TD_FUZZ_SEED") or secrets.randbits(32))
GEMM_CASES = 500
CONV_CASES = 200
TOLERANCE = backends.get("cpu").tolerance
NUMPY = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16, "int8": np.int8, "int32": np.int32}
# what fp32 accumulation of a few hundred products rounds by, relative to the sum of their magnitudes: about
# 2 ulps (1.2e-7) for random signs; 8x headroom
ACCUMULATION = 1e-6
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")
# The conv kernels: packed for every direction and rank, direct (narrow groups) for every direction at one
# rank each. dtype by rank: 1D / 2D fp16 and bf16, 3D fp32, so that the packed 1D / 2D kernels are
# test_conv_as_gemm's (and every one test_conv_cpu's): compiled once per session.
CONV_DTYPE = {(d, r): ("fp16", "bf16", "fp32")[r - 1] if d != "bwd_data" else ("bf16", "fp16", "fp32")[r - 1]
              for d in DIRECTIONS for r in (1, 2, 3)}
DIRECT_RANK = {"fwd": 2, "bwd_data": 3, "bwd_weight": 1}
CONV_SET = """\
schema: 1
name: fuzz_smoke
description: small-tile cpu conv kernels for the fuzz smoke test
groups:
""" + "".join(f"""\
  - backend: cpu
    op: conv
    direction: {d}
    spatial_dims: {r}
    dtype: {CONV_DTYPE[d, r]}
    layout: nhwgc
    mma: [4, 16, 1]
    configs:
      - {{pipeline: packed, tile: [16, 16, 24]}}
""" + ("      - {pipeline: direct, tile: [8, 32, 8]}\n" if DIRECT_RANK[d] == r else "")
    for d in DIRECTIONS for r in (1, 2, 3))


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return build_cpu_bundle(tmp_path_factory.mktemp("fuzz"), "fuzz_smoke", CONV_SET, *CPU_GEMM_SETS)


def case_rng(kind: str, i: int) -> np.random.Generator:
    """Each case its own stream, so a case replays alone from (seed, kind, index)."""
    return np.random.default_rng([SEED, ("gemm", "conv").index(kind), i])


# -- the float64 reference -----------------------------------------------------------------------------
def activate(v: np.ndarray, activation: str, lo: float, hi: float) -> np.ndarray:
    if activation == "identity":
        return v
    if activation == "relu":
        return np.where(v > 0, v, 0.0)
    if activation == "gelu_tanh":
        return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v * v * v)))
    if activation == "gelu_erf":
        return v * 0.5 * (1 + np.vectorize(math.erf, otypes=[np.float64])(v / math.sqrt(2)))
    if activation == "silu":
        return v / (1 + np.exp(-v))
    if activation == "sigmoid":
        return 1 / (1 + np.exp(-v))
    if activation == "tanh":
        return np.tanh(v)
    if activation == "clamp":
        return np.minimum(np.maximum(v, lo), hi)
    if activation == "hardswish":
        return v * np.minimum(np.maximum(v + 3, 0.0), 6.0) / 6
    if activation == "hardsigmoid":
        return np.minimum(np.maximum(v + 3, 0.0), 6.0) / 6
    raise AssertionError(activation)


def conv_taps(x_shape, filt, out, stride, dilation, pad_lo):
    """For each filter tap: its index, the input index each output pixel reads per spatial dim (clipped into
    range) and the mask of outputs that read a real (not padding) input pixel."""
    in_sp = x_shape[1:-2]
    for tap in itertools.product(*(range(f) for f in filt)):
        rows, valid = [], []
        for d, t in enumerate(tap):
            i = np.arange(out[d]) * stride[d] + t * dilation[d] - pad_lo[d]
            valid.append((i >= 0) & (i < in_sp[d]))
            rows.append(np.clip(i, 0, in_sp[d] - 1))
        mask = np.ones(out)
        for d, v in enumerate(valid):
            mask = mask * v.reshape([-1 if e == d else 1 for e in range(len(out))])
        yield tap, np.ix_(*rows), mask[None, ..., None, None]


def conv_ref(direction, x, w, y, stride, dilation, pad_lo, pad_hi):
    """The written operand of a convolution in float64: x [N, in..., G, C/G], w [G, K/G, f..., C/G],
    y [N, out..., G, K/G]; the written operand's shape comes from the array passed (its values unused), and
    with it pad_hi (y's spatial sizes)."""
    x, w, y = (np.asarray(a, np.float64) for a in (x, w, y))
    filt, out = w.shape[2:-1], y.shape[1:-2]
    result = np.zeros({"fwd": y, "bwd_data": x, "bwd_weight": w}[direction].shape)
    for tap, index, mask in conv_taps(x.shape, filt, out, stride, dilation, pad_lo):
        wt = w[(slice(None), slice(None), *tap)]                      # [G, K/G, C/G]
        if direction == "fwd":
            result += np.einsum("n...gc,gkc->n...gk", x[(slice(None), *index)] * mask, wt)
        elif direction == "bwd_data":
            np.add.at(result, (slice(None), *index), np.einsum("n...gk,gkc->n...gc", y, wt) * mask)
        else:
            xs = x[(slice(None), *index)] * mask                         # [N, out..., G, C/G]
            result[(slice(None), slice(None), *tap)] = np.einsum(
                "pgk,pgc->gkc", y.reshape(-1, *y.shape[-2:]), xs.reshape(-1, *xs.shape[-2:]))
    return result


# -- comparison ----------------------------------------------------------------------------------------
def check(out, ref: np.ndarray, bound: np.ndarray, dtype_out: str) -> str:
    """'' when out matches ref, else why not. Every element must be within
    tol * |ref| + ACCUMULATION * bound + the output dtype's smallest subnormal,
    tol the rules' tolerance for the output dtype and bound the sum of the magnitudes of the element's terms:
    its rounding to the output dtype stays under tol * |ref| (a few ulps of fp16 / bf16 are within tol) or,
    near zero, under one subnormal step; the fp32 accumulation under ACCUMULATION * bound, even where the
    terms cancel. Per element, so one wrong row or column of a partial tile fails too; ||out - ref|| / ||ref||
    <= tol follows wherever nothing cancels."""
    out = np.asarray(out)
    if dtype_out == "int32" and (out == np.iinfo(np.int32).min).any():
        return "output elements left unwritten (poison INT32_MIN)"
    got = out.astype(np.float64)
    if not np.isfinite(got).all():
        return f"{int((~np.isfinite(got)).sum())} of {got.size} output elements not finite"
    tol = float(TOLERANCE[dtype_out])
    diff = np.abs(got - ref)
    if dtype_out == "int32":
        excess = diff - tol * np.abs(ref)
    else:
        step = float(ml_dtypes.finfo(NUMPY[dtype_out]).smallest_subnormal)
        excess = diff - (tol * np.abs(ref) + ACCUMULATION * bound + step)
    if (excess <= 0).all():
        return ""
    norm = float(np.linalg.norm(ref))
    rel = float(np.linalg.norm(diff)) / norm if norm else float(np.linalg.norm(got))
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(excess)), diff.shape))
    return (f"{int((excess > 0).sum())} of {got.size} elements off; worst {worst}: got {got[worst]:.7g}, want "
            f"{ref[worst]:.7g} (tolerance {tol:g}); rel error {rel:.3g}")


# -- GEMM ----------------------------------------------------------------------------------------------
# the preselected kernels' block and micro-tile sizes per dimension: sizes just around their multiples
EDGES = {"m": (6, 8, 24, 96), "n": (32, 128, 256), "k": (256,)}
LIMIT = {"m": 160, "n": 260, "k": 400}


def size(rng, dim: str) -> int:
    """1 and small primes, a size next to a multiple of a tile edge, or anything up to LIMIT."""
    draw = rng.random()
    if draw < 0.3:
        return int(rng.choice([1, 2, 3, 5, 7, 11, 13, 17, 31, 61]))
    if draw < 0.5:
        return int(rng.choice(EDGES[dim]) * rng.integers(1, 3) + rng.integers(-1, 2))
    return int(rng.integers(1, LIMIT[dim] + 1))


def random_values(rng, shape, dtype: str) -> np.ndarray:
    """Never zero: +-[0.05, 1] for floats, +-[1, 8] for integers."""
    sign = rng.choice([-1, 1], size=shape)
    if dtype in ("int8", "int32"):
        return (rng.integers(1, 9, size=shape) * sign).astype(NUMPY[dtype])
    return (rng.uniform(0.05, 1.0, size=shape) * sign).astype(NUMPY[dtype])


def matrix(rng, batch, rows: int, cols: int, letter: str, dtype: str, fill=None) -> np.ndarray:
    """A [rows, cols] (batch None) or [batch, rows, cols] array, row- (r) or column-major (c), its leading
    dimension padded at random: the kernels take any leading-dimension stride."""
    lead = (batch,) if batch is not None else ()
    inner, outer = (cols, rows) if letter == "r" else (rows, cols)
    pad = int(rng.integers(1, 6)) if rng.random() < 0.25 else 0
    store = random_values(rng, (*lead, outer, inner + pad), dtype)
    a = store[..., :inner]
    a = a if letter == "r" else np.swapaxes(a, -1, -2)
    if fill is not None:
        a[...] = fill
    return a


def poison_value(dtype: str):
    return np.iinfo(np.int32).min if dtype == "int32" else np.nan


def gemm_case(rng, kernels):
    """One random problem for one of the bundle's GEMM kernels: (description, call kwargs, reference, bound,
    output dtype)."""
    kernel = kernels[int(rng.integers(len(kernels)))]
    key = kernel.key
    sig, epi = key.signature, key.signature.epilogue
    m, n, k = size(rng, "m"), size(rng, "n"), size(rng, "k")
    batch = None if rng.random() < 0.4 else int(rng.integers(1, 4))
    # batch broadcast: A or B holds one matrix for every batch
    batch_a, batch_b = batch, batch
    if batch is not None and batch > 1 and rng.random() < 0.3:
        if rng.random() < 0.5:
            batch_a = 1
        else:
            batch_b = 1
    integer = sig.dtype_c == "int32"
    a = matrix(rng, batch_a, m, k, sig.layout[0], sig.dtype_a)
    b = matrix(rng, batch_b, k, n, sig.layout[1], sig.dtype_b)
    out = matrix(rng, batch, m, n, sig.layout[2], sig.dtype_c, fill=poison_value(sig.dtype_c))
    if integer:
        alpha, beta = float(rng.choice([1, 2, -1])), float(rng.choice([0, 0, 1, -2]))
    else:
        alpha = 1.0 if rng.random() < 0.3 else float(rng.uniform(-2, 2))
        beta = 0.0 if rng.random() < 0.5 else float(rng.uniform(-1.5, 1.5))
    c = matrix(rng, batch, m, n, "r", sig.dtype_c) if beta else None
    bias = None
    if epi.bias:
        bias = random_values(rng, (n,) if batch is None or rng.random() < 0.5 else (batch, n), sig.dtype_c)
    residuals = tuple(matrix(rng, batch, m, n, "r", sig.dtype_c) for _ in range(epi.residuals))
    lo, hi = sorted(rng.uniform(-1.5, 1.5, size=2))
    clamp = (float(lo), float(hi)) if epi.activation == "clamp" else (-math.inf, math.inf)

    a64, b64, c64, bias64 = (None if v is None else np.asarray(v, np.float64) for v in (a, b, c, bias))
    pre = alpha * np.matmul(a64, b64)
    bound = abs(alpha) * np.matmul(np.abs(a64), np.abs(b64))
    if c is not None:
        pre, bound = pre + beta * c64, bound + abs(beta) * np.abs(c64)
    if bias is not None:
        bias_b = bias64[..., None, :]  # [n] or [batch, n] broadcast over rows
        pre, bound = pre + bias_b, bound + np.abs(bias_b)
    for r in residuals:
        r64 = np.asarray(r, np.float64)
        pre, bound = pre + r64, bound + np.abs(r64)
    ref = activate(pre, epi.activation, *clamp)
    # the drawn kernel by name, or the runtime's selection among the kernels of its signature
    named = kernel.name if rng.random() < 0.5 else None
    what = (f"{named or 'selected for ' + key.name}: m={m} n={n} k={k} batch={batch} (A {batch_a}, B {batch_b}) "
            f"alpha={alpha} beta={beta} bias={None if bias is None else bias.shape} residuals={len(residuals)} "
            f"activation={epi.activation} clamp={clamp} strides A {a.strides} B {b.strides} out {out.strides}")
    call = dict(a=a, b=b, out=out, c=c, bias=bias, residuals=residuals, alpha=alpha, beta=beta,
                activation=epi.activation, clamp=clamp, kernel=named)
    return what, call, ref, bound, sig.dtype_c


def test_random_gemms(registry):
    kernels = [k for k in registry.kernels if k.key.signature.op == "gemm"]
    failures = []
    for i in range(GEMM_CASES):
        what, call, ref, bound, dtype_c = gemm_case(case_rng("gemm", i), kernels)
        try:
            got = registry.gemm(call.pop("a"), call.pop("b"), call.pop("out"), **call)
            why = check(got, ref, bound, dtype_c)
        except Exception as e:  # noqa: BLE001 - every problem drawn here is supported: any exception fails
            why = f"{type(e).__name__}: {e}"
        if why:
            failures.append(f"TD_FUZZ_SEED={SEED} gemm case {i}: {what}: {why}")
    assert not failures, f"{len(failures)} of {GEMM_CASES} random GEMMs failed:\n" + "\n".join(failures[:20])


# -- convolution ---------------------------------------------------------------------------------------
def conv_case(rng):
    """One random grouped convolution: (description, direction, arrays, geometry, alpha, beta, reference, bound,
    dtype)."""
    direction = DIRECTIONS[int(rng.integers(3))]
    rank = int(rng.integers(1, 4))
    dtype = CONV_DTYPE[direction, rank]
    kind = rng.choice(["dense", "grouped", "depthwise", "narrow"])
    g = 1 if kind == "dense" else int(rng.integers(2, 7))
    cg, kg = {"dense": (int(rng.integers(1, 20)), int(rng.integers(1, 20))),
              "grouped": (int(rng.integers(1, 12)), int(rng.integers(1, 12))),
              "depthwise": (1, int(rng.choice([1, 1, 2, 3]))),
              "narrow": (int(rng.integers(1, 9)), int(rng.integers(1, 9)))}[kind]
    n = int(rng.integers(1, 4))
    small = {1: 24, 2: 9, 3: 5}[rank]  # keeps a 3D problem as small as a 1D one
    while True:
        filt = tuple(int(rng.choice([1, 1, 2, 3, 3, 5])) if rank < 3 else int(rng.choice([1, 2, 3]))
                     for _ in range(rank))
        stride = tuple(int(rng.choice([1, 1, 2, 3])) for _ in range(rank))
        dilation = tuple(int(rng.choice([1, 1, 2])) for _ in range(rank))
        pad_lo = tuple(int(rng.integers(0, 3)) for _ in range(rank))
        pad_hi = tuple(int(rng.integers(0, 3)) for _ in range(rank))
        in_sp = tuple(int(rng.integers(1, small + 1)) for _ in range(rank))
        spans = [i + lo + hi - d * (f - 1) - 1 for i, lo, hi, d, f in zip(in_sp, pad_lo, pad_hi, dilation, filt)]
        if min(spans) >= 0:
            break
    out_sp = tuple(s // st + 1 for s, st in zip(spans, stride))
    shapes = {"x": (n, *in_sp, g, cg), "w": (g, kg, *filt, cg), "y": (n, *out_sp, g, kg)}
    written = {"fwd": "y", "bwd_data": "x", "bwd_weight": "w"}[direction]
    arrays = {role: random_values(rng, shape, dtype) for role, shape in shapes.items()}
    alpha = 1.0 if rng.random() < 0.4 else float(rng.uniform(-2, 2))
    beta = 0.0 if rng.random() < 0.6 else float(rng.uniform(-1.5, 1.5))
    old = np.asarray(arrays[written], np.float64)
    if not beta:
        arrays[written][...] = np.nan
    geo = dict(stride=stride, dilation=dilation, pad_lo=pad_lo, pad_hi=pad_hi)
    ref = alpha * conv_ref(direction, **arrays, **geo) + beta * old
    absolute = {role: np.abs(np.asarray(a, np.float64)) for role, a in arrays.items()}
    bound = abs(alpha) * conv_ref(direction, **absolute, **geo) + abs(beta) * np.abs(old)
    what = (f"conv {direction} {rank}D {dtype} {kind}: N={n} G={g} C/G={cg} K/G={kg} in={in_sp} filter={filt} "
            f"stride={stride} dilation={dilation} pad_lo={pad_lo} pad_hi={pad_hi} alpha={alpha} beta={beta}")
    return what, direction, arrays, geo, alpha, beta, ref, bound, dtype


def test_random_convolutions(registry):
    from tiledispatch.ops import conv

    entry = {"fwd": lambda a, **kw: conv.fwd(registry, a["x"], a["w"], a["y"], **kw),
             "bwd_data": lambda a, **kw: conv.bwd_data(registry, a["y"], a["w"], a["x"], **kw),
             "bwd_weight": lambda a, **kw: conv.bwd_weight(registry, a["x"], a["y"], a["w"], **kw)}
    failures, pipelines = [], set()
    for i in range(CONV_CASES):
        rng = case_rng("conv", i)
        what, direction, arrays, geo, alpha, beta, ref, bound, dtype = conv_case(rng)
        try:
            problem, _ = conv.operands(direction, arrays["x"], arrays["w"], arrays["y"], **geo)
            fits = registry.candidates(problem)
            # a named kernel of either pipeline that runs the problem, or (None) the runtime's own choice,
            # which may run a pointwise problem on the bundle's GEMM kernels
            kern = [None, *fits][int(rng.integers(len(fits) + 1))]
            pipelines.add(kern.key.algorithm.pipeline if kern else "selected")
            what += f" kernel={kern.name if kern else 'selected'}"
            got = entry[direction](arrays, alpha=alpha, beta=beta, kernel=kern, **geo)
            why = check(got, ref, bound, dtype)
        except Exception as e:  # noqa: BLE001 - every problem drawn here is supported: any exception fails
            why = f"{type(e).__name__}: {e}"
        if why:
            failures.append(f"TD_FUZZ_SEED={SEED} conv case {i}: {what}: {why}")
    assert not failures, f"{len(failures)} of {CONV_CASES} random convolutions failed:\n" + "\n".join(failures[:20])
    assert pipelines == {"packed", "direct", "selected"}, f"TD_FUZZ_SEED={SEED}: only {sorted(pipelines)} ran"


def test_the_check_catches_wrong_results():
    """The comparison itself: an unwritten (NaN / INT32_MIN) output, a wrong element or a missing term fails."""
    rng = np.random.default_rng(0)
    ref = rng.uniform(-1, 1, (7, 5))
    bound = np.abs(ref)
    assert check(ref.astype(np.float32), ref, bound, "fp32") == ""
    nan = ref.astype(np.float32)
    nan[3, 2] = np.nan
    assert "not finite" in check(nan, ref, bound, "fp32")
    wrong = ref.astype(np.float16)
    wrong[6, 4] *= 1.01  # one element off by 5x the fp16 tolerance
    assert "1 of 35 elements off; worst (6, 4)" in check(wrong, ref, bound, "fp16")
    tiny = np.array([7.475783e-06, -3e-07])  # fp16 subnormals: their rounding is absolute, one step 6e-8
    assert check(tiny.astype(np.float16), tiny, np.abs(tiny), "fp16") == ""
    ints = np.full((2, 2), np.iinfo(np.int32).min, np.int32)
    assert "unwritten" in check(ints, np.ones((2, 2)), np.ones((2, 2)), "int32")


def test_the_reference_is_the_definition():
    """conv_ref against the convolution sum written out element by element, on one small 2D grouped case
    with stride, dilation and asymmetric padding, in all three directions (bwd_* as the adjoint of fwd)."""
    rng = np.random.default_rng(1)
    n, g, cg, kg, in_sp, filt = 2, 2, 3, 2, (5, 6), (2, 3)
    stride, dilation, lo, hi = (2, 1), (1, 2), (1, 0), (0, 2)
    out_sp = tuple((i + a + b - d * (f - 1) - 1) // s + 1
                   for i, a, b, d, f, s in zip(in_sp, lo, hi, dilation, filt, stride))
    x = rng.standard_normal((n, *in_sp, g, cg))
    w = rng.standard_normal((g, kg, *filt, cg))
    dy = rng.standard_normal((n, *out_sp, g, kg))
    y = np.zeros((n, *out_sp, g, kg))
    for b, oh, ow, gi, ki, fh, fw, ci in itertools.product(*map(range, (n, *out_sp, g, kg, *filt, cg))):
        ih, iw = oh * stride[0] + fh * dilation[0] - lo[0], ow * stride[1] + fw * dilation[1] - lo[1]
        if 0 <= ih < in_sp[0] and 0 <= iw < in_sp[1]:
            y[b, oh, ow, gi, ki] += x[b, ih, iw, gi, ci] * w[gi, ki, fh, fw, ci]
    geo = dict(stride=stride, dilation=dilation, pad_lo=lo, pad_hi=hi)
    np.testing.assert_allclose(conv_ref("fwd", x, w, y, **geo), y, rtol=1e-12, atol=1e-12)
    # <conv(x, w), dy> = <x, bwd_data(dy, w)> = <w, bwd_weight(x, dy)>
    inner = float(np.sum(y * dy))
    assert math.isclose(float(np.sum(x * conv_ref("bwd_data", x, w, dy, **geo))), inner, rel_tol=1e-10)
    assert math.isclose(float(np.sum(w * conv_ref("bwd_weight", x, w, dy, **geo))), inner, rel_tol=1e-10)
