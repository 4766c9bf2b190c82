"""The cached fast path of the public calls (Registry.gemm, conv_fwd / conv_bwd_data / conv_bwd_weight): a call
seen before neither selects a kernel nor runs the full operand checks again, swaps only pointers (and alpha /
beta), and stays right; a change of shape, strides, dtype or epilogue is checked and selected again; new
pointers are checked for overlap and writability; the caches are bounded and emptied when the tuning record or
autotune change. cpu backend, numpy arrays."""
import collections
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

import tiledispatch as td
from tiledispatch import plan, reference, selection, tuning, validation
from tiledispatch.ops import conv as conv_op
from tiledispatch.ops import gemm as gemm_op

from conftest import build_cpu_bundle

SET = """\
schema: 1
name: fast_paths
description: small cpu kernels for the fast-path tests (several fp32 rcr GEMMs, so that selection has a choice)
groups:
  - backend: cpu
    op: gemm
    dtype: [fp32, fp16]
    layout: [rcr, rrr]
    tile: [24, 64, 64]
    mma: [4, 16, 1]
    pipeline: packed
  - backend: cpu
    op: gemm
    dtype: fp32
    layout: rcr
    pipeline: packed
    configs:
      - {tile: [96, 256, 256], mma: [8, 32, 1]}
      - {tile: [24, 128, 256], mma: [6, 32, 1]}
  - backend: cpu
    op: gemm
    dtype: fp32
    layout: rcr
    epilogue: {activation: clamp, residuals: 1}
    tile: [24, 64, 64]
    mma: [4, 16, 1]
    pipeline: packed
  - backend: cpu
    op: conv
    direction: [fwd, bwd_data, bwd_weight]
    spatial_dims: [1, 2, 3]
    dtype: [fp32, fp16]
    layout: nhwgc
    tile: [16, 16, 24]
    mma: [4, 16, 1]
    pipeline: packed
"""
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")
WRITTEN = conv_op.WRITES


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    return build_cpu_bundle(tmp_path_factory.mktemp("fast_paths"), "fast_paths", SET)


@pytest.fixture
def counts(monkeypatch):
    """Calls of the full operand checks and of candidate matching (td_can_run over the bundle) and ranking."""
    seen = {"gemm_checks": 0, "conv_checks": 0, "matching": 0, "rank": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(gemm_op, "operands", counting("gemm_checks", gemm_op.operands))
    monkeypatch.setattr(conv_op, "operands", counting("conv_checks", conv_op.operands))
    # matching: every kernel's td_can_run (explain), or the best-ranked ones' until one accepts (the ranking alone)
    monkeypatch.setattr(td.Registry, "_explain", counting("matching", td.Registry._explain))
    monkeypatch.setattr(td.Registry, "_first_that_runs", counting("matching", td.Registry._first_that_runs))
    monkeypatch.setattr(selection, "learned", counting("rank", selection.learned))
    return seen


def rand(rng, shape, dtype="fp32"):
    return validation.random_array(rng, shape, dtype)


def poisoned(shape, dtype=np.float32, order="C"):
    return validation.poison(np.empty(shape, dtype, order=order))


def close(got, want, tol=1e-4):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want), np.abs(got - want).max()


GEO = {"padding": 1}  # 3x3 filters, same-size outputs: every tensor of a direction can stand in for another
GEO_REF = ((1, 1), (1, 1), (1, 1), (1, 1))


def conv_data(rng, dtype="fp32"):
    """x [N, H, W, G, C/G], w [G, K/G, 3, 3, C/G], dy [N, H, W, G, K/G] with C/G = K/G."""
    return rand(rng, (2, 6, 5, 2, 8), dtype), rand(rng, (2, 8, 3, 3, 8), dtype), rand(rng, (2, 6, 5, 2, 8), dtype)


def conv_call(reg, direction, x, w, dy, out, **kw):
    kw = {**GEO, **kw}
    if direction == "fwd":
        return reg.conv_fwd(x, w, out, **kw)
    if direction == "bwd_data":
        return reg.conv_bwd_data(dy, w, out, **kw)
    return reg.conv_bwd_weight(x, dy, out, **kw)


def conv_expect(direction, x, w, dy):
    if direction == "fwd":
        return reference.conv_fwd(x, w, *GEO_REF)
    if direction == "bwd_data":
        return reference.conv_bwd_data(dy, w, (6, 5), *GEO_REF)
    return reference.conv_bwd_weight(x, dy, (3, 3), *GEO_REF)


def written_shape(direction, x, w, dy):
    return {"x": x, "w": w, "y": dy}[WRITTEN[direction]].shape


# -- a repeated call neither checks nor selects again, and stays right with new pointers ---------------------------
def test_repeated_gemm_swaps_pointers_without_checks_or_selection(reg, counts):
    reg.clear_caches()
    rng = np.random.default_rng(1)
    for i in range(4):  # new arrays every call: only the pointers change
        a, b = rand(rng, (40, 24)), rand(rng, (56, 24)).T
        out = poisoned((40, 56))
        reg.gemm(a, b, out)
        close(out, reference.gemm(a, b))
        if i == 0:
            first = dict(counts)
            assert first["gemm_checks"] == 1 and first["matching"] == 1 and first["rank"] == 1
    assert counts == first  # calls 2-4: no checks, no matching, no ranking
    assert reg.cache_info()["launches"]["hits"] >= 3


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_repeated_conv_swaps_pointers_without_checks_or_selection(reg, counts, direction):
    reg.clear_caches()
    rng = np.random.default_rng(2)
    for i in range(4):
        x, w, dy = conv_data(rng)
        out = poisoned(written_shape(direction, x, w, dy))
        assert conv_call(reg, direction, x, w, dy, out) is out
        close(out, conv_expect(direction, x, w, dy))
        if i == 0:
            first = dict(counts)
            assert first["conv_checks"] == 1 and first["matching"] == 1 and first["rank"] == 1
    assert counts == first


@pytest.mark.parametrize("direction", ("fwd", "bwd_data"))
def test_pointwise_conv_on_gemm_kernels_is_cached(reg, counts, direction):
    """fp16 1x1 convolutions run on the GEMM kernels (ops/conv_as_gemm.py); their launches are cached too, with
    the conv tensors' pointers mapped to the GEMM's operands."""
    reg.clear_caches()
    rng = np.random.default_rng(3)
    for i in range(3):
        x, w, dy = rand(rng, (2, 4, 5, 1, 16), "fp16"), rand(rng, (1, 24, 1, 1, 16), "fp16"), \
            rand(rng, (2, 4, 5, 1, 24), "fp16")
        geo = ((1, 1), (1, 1), (0, 0), (0, 0))
        if direction == "fwd":
            out = poisoned(dy.shape, np.float16)
            reg.conv_fwd(x, w, out)
            want = reference.conv_fwd(x, w, *geo)
        else:
            out = poisoned(x.shape, np.float16)
            reg.conv_bwd_data(dy, w, out)
            want = reference.conv_bwd_data(dy, w, (4, 5), *geo)
        close(out, want, 3e-3)
        if i == 0:
            first = dict(counts)
            assert first["gemm_checks"] == 1  # the GEMM's operands: the conv ran on a GEMM kernel
    assert counts == first
    (launcher,) = reg._launches.values()
    assert launcher.plan.problem.op == "gemm"



@pytest.mark.parametrize("ranker", ["auto", "analytic", "first_fit"])
def test_selection_asks_only_the_best_ranked_kernels_and_picks_what_ranking_every_candidate_picks(reg, monkeypatch,
                                                                                                   ranker):
    """select() asks td_can_run of the kernels whose signature matches, best-ranked first, until one accepts: the
    kernel that ranking every candidate (explain: every kernel's td_can_run) puts first, with fewer questions."""
    from tiledispatch import abi
    from tiledispatch.ops.gemm import GemmProblem

    asked = []
    can_run = abi.KernelLibrary.can_run
    monkeypatch.setattr(abi.KernelLibrary, "can_run", lambda lib, args: asked.append(lib) or can_run(lib, args))
    rank = selection.learned if ranker == "auto" else selection.RANKERS[ranker]
    problems = [GemmProblem(m, n, k, "fp32", "fp32", "fp32", "rcr") for m, n, k in
                [(1, 1, 1), (40, 56, 24), (512, 768, 1024), (7, 3000, 33), (300, 5, 4096)]]
    problems += [GemmProblem(64, 64, 64, "fp16", "fp16", "fp16", "rrr"), conv_op.ConvProblem(
        "bwd_data", 2, 1, 8, 16, (9, 9), (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), "fp32", "fp32", "fp32")]
    for problem in problems:
        reg.clear_caches()
        asked.clear()
        chosen = reg.select(problem, ranker)
        lazy = len(asked)
        assert chosen is rank(problem, reg.candidates(problem))[0], problem
        assert lazy < len(asked) - lazy or len(asked) - lazy == 1, (problem, lazy)  # fewer questions than explain

def test_named_kernel_calls_are_cached(reg, counts):
    reg.clear_caches()
    rng = np.random.default_rng(4)
    name = next(k.name for k in reg.kernels if k.key.signature.op == "gemm" and k.key.algorithm.tile[0] == 96)
    x, w, dy = conv_data(rng)
    conv_name = reg.select(conv_op.operands("fwd", x, w, poisoned(dy.shape), **GEO)[0]).name
    before = dict(counts)
    for _ in range(3):
        a, b = rand(rng, (40, 24)), rand(rng, (56, 24)).T
        out = poisoned((40, 56))
        reg.gemm(a, b, out, kernel=name)
        close(out, reference.gemm(a, b))
        y = poisoned(dy.shape)
        reg.conv_fwd(x, w, y, kernel=conv_name, **GEO)
        close(y, conv_expect("fwd", x, w, dy))
        y = poisoned(dy.shape)
        reg.conv_fwd(x, w, y, kernel=reg.kernel(conv_name), **GEO)  # a Kernel object: an entry of its own
        close(y, conv_expect("fwd", x, w, dy))
    assert counts["gemm_checks"] - before["gemm_checks"] == 1
    assert counts["conv_checks"] - before["conv_checks"] == 2
    assert counts["matching"] == before["matching"] and counts["rank"] == before["rank"]  # named: no selection
    a, b, out = rand(rng, (40, 24)), rand(rng, (56, 24)).T, poisoned((40, 56))
    reg.gemm(a, b, out)  # the same tensors without the name: another entry, selected
    assert counts["gemm_checks"] - before["gemm_checks"] == 2


# -- what changes the key: checked and selected again ------------------------------------------------------------
def test_changed_shape_strides_dtype_or_epilogue_is_checked_again(reg, counts):
    reg.clear_caches()
    rng = np.random.default_rng(5)
    a, b = rand(rng, (40, 24)), rand(rng, (56, 24)).T
    reg.gemm(a, b, poisoned((40, 56)))
    calls = [
        ("shape", lambda: (rand(rng, (41, 24)), b, poisoned((41, 56)), {})),
        ("strides", lambda: (a, np.ascontiguousarray(b), poisoned((40, 56)), {})),  # B row-major: layout rrr
        ("dtype", lambda: (a.astype(np.float16), b.astype(np.float16), poisoned((40, 56), np.float16), {})),
        ("epilogue", lambda: (a, b, poisoned((40, 56)),
                              dict(activation="clamp", clamp=(-0.5, 0.5), residuals=(rand(rng, (40, 56)),)))),
        ("output strides", lambda: (a, b, poisoned((40, 56), order="F"), {})),  # column-major D: no kernel
    ]
    for what, make in calls:
        checks, matched = counts["gemm_checks"], counts["matching"]
        a2, b2, out, kw = make()
        try:
            reg.gemm(a2, b2, out, **kw)
        except td.UnsupportedProblemError:
            assert what == "output strides"
        else:
            ref = reference.gemm(a2, b2, residuals=kw.get("residuals", ()), activation=kw.get("activation", "identity"),
                                 clamp=kw.get("clamp", (-np.inf, np.inf)))
            close(out, ref, 3e-3 if what == "dtype" else 1e-4)
        # checked and selected once; where no kernel runs, the ranking's tries and then explain(), for the message
        assert counts["gemm_checks"] == checks + 1, what
        assert counts["matching"] == matched + (2 if what == "output strides" else 1), what

    x, w, dy = conv_data(rng)
    reg.conv_fwd(x, w, poisoned(dy.shape), **GEO)
    for what, kw, out_shape in [("padding", {"padding": 0}, (2, 4, 3, 2, 8)),
                                ("stride", {"padding": 1, "stride": 2}, (2, 3, 3, 2, 8))]:
        checks, matched = counts["conv_checks"], counts["matching"]
        out = poisoned(out_shape)
        reg.conv_fwd(x, w, out, **kw)
        p = kw.get("padding", 0)
        s = kw.get("stride", 1)
        close(out, reference.conv_fwd(x, w, (s, s), (1, 1), (p, p), (p, p)))
        assert counts["conv_checks"] == checks + 1 and counts["matching"] == matched + 1, what


def test_alpha_and_beta_are_swapped_and_checked(reg, counts):
    reg.clear_caches()
    rng = np.random.default_rng(6)
    a, b, c = rand(rng, (40, 24)), rand(rng, (56, 24)).T, rand(rng, (40, 56))
    out = poisoned((40, 56))
    reg.gemm(a, b, out, c=c, beta=0.5)
    checks = counts["gemm_checks"]
    for alpha, beta in ((2.0, 0.5), (-1.5, 0.25), (1, 3)):
        out = poisoned((40, 56))
        reg.gemm(a, b, out, c=c, alpha=alpha, beta=beta)
        close(out, reference.gemm(a, b, c, alpha=alpha, beta=beta))
    assert counts["gemm_checks"] == checks  # swapped in the prepared arguments
    for bad, message in ((dict(alpha=True), "alpha must be a real number"),
                         (dict(alpha=float("nan")), "alpha must be finite"),
                         (dict(beta=float("inf")), "beta must be finite"),
                         (dict(beta="1"), "beta must be a real number")):
        with pytest.raises(td.InvalidInputError, match=message):
            reg.gemm(a, b, out, c=c, **{"alpha": 1.0, "beta": 0.5, **bad})
    out = poisoned((40, 56))
    reg.gemm(a, b, out, c=c, beta=0.5)  # still right after the refusals
    close(out, reference.gemm(a, b, c, beta=0.5))

    x, w, dy = conv_data(rng)
    y = rand(rng, dy.shape)
    old = y.astype(np.float64)
    reg.conv_fwd(x, w, y, alpha=0.5, beta=-1.0, **GEO)
    close(y, 0.5 * conv_expect("fwd", x, w, dy) - old)
    y = rand(rng, dy.shape)
    old = y.astype(np.float64)
    checks = counts["conv_checks"]
    reg.conv_fwd(x, w, y, alpha=2.0, beta=0.25, **GEO)
    close(y, 2.0 * conv_expect("fwd", x, w, dy) + 0.25 * old)
    assert counts["conv_checks"] == checks


def test_refused_options_equal_to_accepted_ones_stay_refused(reg):
    """A value the full checks refuse (True, 1.0) that equals one a cached call used (1) never takes its launch."""
    rng = np.random.default_rng(7)
    x, w, dy = conv_data(rng)
    y = poisoned(dy.shape)
    reg.conv_fwd(x, w, y, padding=1, stride=1)
    reg.conv_fwd(x, w, y, padding=1, stride=1)
    for kw, message in (({"stride": True}, "conv stride must be an integer"),
                        ({"stride": 1.0}, "conv stride must be an integer"),
                        ({"stride": (1, True)}, "conv stride must be an integer"),
                        ({"groups": True}, "groups must be an integer"),
                        ({"num_threads": True}, "num_threads must be an integer"),
                        ({"alpha": True}, "alpha must be a real number")):
        with pytest.raises(td.InvalidInputError, match=message):
            reg.conv_fwd(x, w, y, **{"padding": 1, "stride": 1, **kw})
    a, b, out = rand(rng, (40, 24)), rand(rng, (56, 24)).T, poisoned((40, 56))
    reg.gemm(a, b, out, num_threads=1)
    with pytest.raises(td.InvalidInputError, match="num_threads must be an integer"):
        reg.gemm(a, b, out, num_threads=True)
    with pytest.raises(td.InvalidInputError, match="stream must be a raw CUDA/HIP stream handle"):
        reg.gemm(a, b, out, stream=False)


# -- new pointers: overlap and writability checked ---------------------------------------------------------------
def test_gemm_aliasing_and_read_only_outputs_are_refused_on_the_second_call(reg):
    rng = np.random.default_rng(8)
    a, b = rand(rng, (32, 32)), rand(rng, (32, 32)).T
    out = poisoned((32, 32))
    reg.gemm(a, b, out)
    a0 = a.copy()
    with pytest.raises(td.InvalidInputError, match="out overlaps A"):
        reg.gemm(a, b, out=a)
    np.testing.assert_array_equal(a, a0)
    frozen = np.zeros((32, 32), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(td.InvalidInputError, match="out is read-only"):
        reg.gemm(a, b, out=frozen)
    assert not frozen.any()
    reg.gemm(a, b, out)  # the cache still serves good calls
    close(out, reference.gemm(a, b))


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_conv_aliasing_and_read_only_outputs_are_refused_on_the_second_call(reg, direction):
    rng = np.random.default_rng(9)
    x, w, dy = conv_data(rng)
    shape = written_shape(direction, x, w, dy)
    conv_call(reg, direction, x, w, dy, poisoned(shape))
    conv_call(reg, direction, x, w, dy, poisoned(shape))  # cached now
    saved = x.copy(), w.copy(), dy.copy()
    if direction == "fwd":
        alias, overlapped = x, "x"  # y written over x: same shape and strides, so the same fingerprints
    elif direction == "bwd_data":
        alias, overlapped = dy, "y"
    else:
        buf = np.concatenate([x.reshape(-1), np.zeros(w.size, np.float32)])
        x = buf[:x.size].reshape(x.shape)
        alias, overlapped = buf[x.size - 100:x.size - 100 + w.size].reshape(w.shape), "x"
        saved = (x.copy(), *saved[1:])
    with pytest.raises(td.InvalidInputError, match=f"{WRITTEN[direction]} overlaps {overlapped} in memory"):
        conv_call(reg, direction, x, w, dy, alias)
    np.testing.assert_array_equal(x, saved[0])
    np.testing.assert_array_equal(dy, saved[2])
    frozen = np.zeros(shape, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(td.InvalidInputError, match=f"{WRITTEN[direction]} is read-only"):
        conv_call(reg, direction, x, w, dy, frozen)
    assert not frozen.any()
    out = poisoned(shape)
    conv_call(reg, direction, x, w, dy, out)
    close(out, conv_expect(direction, x, w, dy))


# -- bounds and invalidation --------------------------------------------------------------------------------------
def test_caches_are_bounded_and_keep_what_is_used(reg, monkeypatch):
    reg.clear_caches()
    monkeypatch.setattr(reg._launches, "size", 3)
    rng = np.random.default_rng(10)
    b = rand(rng, (56, 24)).T
    arrays = {m: (rand(rng, (m, 24)), poisoned((m, 56))) for m in (8, 9, 10, 11)}
    for m in (8, 9, 10):
        reg.gemm(arrays[m][0], b, arrays[m][1])
    reg.gemm(arrays[8][0], b, arrays[8][1])  # 8 used again: 9 is the oldest entry not used since
    reg.gemm(arrays[11][0], b, arrays[11][1])
    assert len(reg._launches) == 3
    rows = sorted(launcher.plan.problem.m for launcher in reg._launches.values())
    assert rows == [8, 10, 11]
    for m, (a, out) in arrays.items():
        close(out, reference.gemm(a, b))


@pytest.fixture(params=["native", "python"])
def reader(request, monkeypatch) -> str:
    """The torch tests below run twice: with the native fingerprint reader and with the Python one."""
    torch = pytest.importorskip("torch")
    reads = plan._native_prints() if request.param == "native" else plan._torch_prints3
    assert reads is not None, "the native reader was not built: see the warning and its .failed file"
    plan.fingerprint(torch.zeros(1))  # the type met (its printers registered), so that the patch is undone to them
    monkeypatch.setitem(plan._TRIPLE_PRINTERS, torch.Tensor, reads)
    return request.param


def test_three_tensor_fingerprints_tell_apart_what_single_ones_do(reader):
    """plan.prints3, the fast paths' fingerprint of a call's three arrays: torch tensors of one type are read by one
    function (the native reader's bytes, or one flat tuple), anything else by each array's fingerprint(); the forms
    give the same pointers, tell apart the same changes, and never equal each other."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(15)
    a, b, c = (torch.from_numpy(rand(rng, (8, 4))) for _ in range(3))
    ptrs, prints = plan.prints3(a, b, c)
    assert ptrs == tuple(t.data_ptr() for t in (a, b, c))
    if reader == "python":
        assert prints == sum((plan.fingerprint(t)[1] for t in (a, b, c)), ())  # flat: the fingerprints in a row
    else:
        assert type(prints) is bytes
    assert plan.prints3(a.clone(), b, c.clone())[1] == prints  # the same metadata (CPU memory is 64-byte aligned)
    changed = {"stride": a.T.contiguous().T, "shape": a[:4], "dtype": a.double(), "negative bit": torch._neg_view(a),
               "requires grad": a.clone().requires_grad_(True),
               "alignment": torch.from_numpy(rand(rng, (33,)))[1:].view(8, 4)}
    for what, other in changed.items():
        assert plan.prints3(other, b, c)[1] != prints, what
    weight = torch.nn.Parameter(c.clone(), requires_grad=False)  # two types: each array's own fingerprint
    assert plan.prints3(a, b, weight)[1] == tuple(plan.fingerprint(t)[1] for t in (a, b, weight)) != prints
    x, y, z = (rand(rng, (8, 4)) for _ in range(3))
    nptrs, nprints = plan.prints3(x, y, z)
    assert nptrs == tuple(v.ctypes.data for v in (x, y, z))
    assert nprints == tuple(plan.fingerprint(v)[1] for v in (x, y, z))


def test_bounded_cache_evicts_what_was_not_used_since_and_never_what_it_just_put():
    from tiledispatch.plan import BoundedCache

    cache = BoundedCache(3)
    for k in "abc":
        cache.put(k, k.upper())
    assert cache.get("a") == "A" and cache.get("zz") is None
    cache.put("d", "D")  # a was used: b, the oldest not used since, goes
    assert sorted(cache.values()) == ["A", "C", "D"]
    for k in "acd":
        cache.get(k)
    cache.put("e", "E")  # every entry used: one pass clears the marks, the oldest goes, the new entry stays
    assert len(cache) == 3 and "E" in cache.values() and cache.get("e") == "E"
    cache.put("c", "C2")  # put again: replaced, counted once
    assert len(cache) == 3 and cache.get("c") == "C2"
    assert (cache.hits, cache.misses) == (6, 1)


def test_tuning_record_and_autotune_changes_empty_the_caches(reg, counts):
    rng = np.random.default_rng(11)
    a, b = rand(rng, (40, 24)), rand(rng, (56, 24)).T
    p = gemm_op.operands(a, b)[0]
    saved = reg.tuning
    reg.tuning = tuning.TuningCache(None)  # in memory: the test leaves no record behind
    try:
        out = poisoned((40, 56))
        reg.gemm(a, b, out)
        fits = reg.candidates(p)
        assert len(fits) >= 2
        first = reg._launches.values()[0].plan.kernel.name
        assert first == selection.learned(p, fits)[0].name
        last = selection.learned(p, fits)[-1].name
        reg.tuning.put(reg._identity(), tuning.problem_key(p, [k.name for k in fits]),
                       tuning.record(last, {last: {"paced": 1.0}}))
        reg.gemm(a, b, out)  # a record written behind the registry's back: cached until clear_caches()
        assert reg.cache_info()["launches"]["entries"] == 1
        reg.clear_caches()
        assert reg.cache_info()["launches"]["entries"] == 0 and reg.cache_info()["selections"]["entries"] == 0
        out = poisoned((40, 56))
        reg.gemm(a, b, out)
        close(out, reference.gemm(a, b))
        (launcher,) = reg._launches.values()
        assert launcher.plan.kernel.name == last and reg.select(p).name == last

        winner = reg.tune(p, {"a": a, "b": b, "out": poisoned((40, 56))}, top=len(fits))  # records: caches emptied
        assert reg.cache_info()["launches"]["entries"] == 0
        reg.gemm(a, b, out)
        (launcher,) = reg._launches.values()
        assert launcher.plan.kernel.name == winner.name
        reg.autotune = False
        assert reg.cache_info()["launches"]["entries"] == 0
    finally:
        reg.tuning = saved
    assert reg.cache_info()["selections"]["entries"] == 0


def test_select_and_plan_use_the_selection_cache(reg, counts):
    reg.clear_caches()
    p = td.GemmProblem(40, 56, 24, "fp32", "fp32", "fp32", "rcr")
    first = reg.select(p)
    for _ in range(3):
        assert reg.select(p) is first
        assert reg.plan(p).kernel is first
    assert counts["rank"] == 1
    assert reg.select(p, ranker="analytic") is selection.analytic(p, reg.candidates(p))[0]
    with pytest.raises(td.InvalidInputError, match="unknown ranker 'fastest'"):
        reg.select(p, ranker="fastest")


# -- host time ----------------------------------------------------------------------------------------------------
def _median_us(fn, rounds=15, calls=20) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def test_cached_call_is_much_cheaper_than_a_first_call(reg):
    """Medians of interleaved rounds on a tiny problem, single-threaded: a first call (checks, matching,
    ranking) against a cached one. The bound is loose (measured: 25-35x on a shared 2-core machine)."""
    rng = np.random.default_rng(12)
    x, w = rand(rng, (1, 4, 4, 1, 4)), rand(rng, (1, 4, 3, 3, 4))  # tiny: the kernel's own time stays small
    y = poisoned((1, 4, 4, 1, 4))

    def call():
        reg.conv_fwd(x, w, y, num_threads=1, **GEO)

    def first_call():
        reg.clear_caches()
        call()

    call()
    firsts, cached = [], []
    for _ in range(5):
        firsts.append(_median_us(first_call, rounds=3, calls=5))
        cached.append(_median_us(call, rounds=3, calls=50))
    assert statistics.median(firsts) >= 5 * statistics.median(cached), (firsts, cached)


def test_torch_tensors_take_the_fast_path_and_their_states_are_told_apart(reg, counts):
    """torch CPU tensors: cached like numpy arrays; a tensor that looks the same but is not usable (a lazily
    negated view, a meta tensor, requires_grad in grad mode) never takes a launch prepared for a usable one."""
    torch = pytest.importorskip("torch")
    reg.clear_caches()
    rng = np.random.default_rng(13)
    a, bt = torch.from_numpy(rand(rng, (40, 24))), torch.from_numpy(rand(rng, (56, 24)))
    out = torch.full((40, 56), float("nan"))
    reg.gemm(a, bt.T, out)
    checks = counts["gemm_checks"]
    for _ in range(2):
        a2 = torch.from_numpy(rand(rng, (40, 24)))
        out.fill_(float("nan"))
        reg.gemm(a2, bt.T, out)
        close(out.numpy(), reference.gemm(a2.numpy(), bt.numpy().T))
    assert counts["gemm_checks"] == checks
    with pytest.raises(td.InvalidInputError, match="negative or conjugate bit"):
        reg.gemm(torch._neg_view(a), bt.T, out)
    with pytest.raises(td.InvalidInputError, match="meta tensor"):
        reg.gemm(a, bt.T, torch.empty((40, 56), device="meta"))
    with pytest.raises(td.InvalidInputError, match="requires grad"):
        reg.gemm(a.clone().requires_grad_(True), bt.T, out)

    x, w, dy = (torch.from_numpy(t) for t in conv_data(rng))
    y = torch.full(dy.shape, float("nan"))
    reg.conv_fwd(x, w, y, **GEO)
    checks = counts["conv_checks"]
    x2 = torch.from_numpy(rand(rng, tuple(x.shape)))
    reg.conv_fwd(x2, w, y, **GEO)
    close(y.numpy(), conv_expect("fwd", x2.numpy(), w.numpy(), dy.numpy()))
    assert counts["conv_checks"] == checks
    with pytest.raises(td.InvalidInputError, match="negative or conjugate bit"):
        reg.conv_fwd(torch._neg_view(x2), w, y, **GEO)


def profiled(fn) -> tuple[list, collections.Counter]:
    """The Python functions a call enters and the C methods of torch tensors it calls (sys.setprofile: exact and
    deterministic, unlike a wall clock). Attribute reads (shape, dtype, device...) are not seen."""
    frames, methods = [], collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            frames.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")
        elif event == "c_call" and getattr(arg, "__qualname__", "").startswith(("Tensor.", "TensorBase.")):
            methods[arg.__qualname__.split(".", 1)[1]] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return frames, methods


def test_cached_torch_calls_read_each_tensor_once(reg, reader):
    """The host cost of a cached call with torch tensors, counted rather than timed: each tensor's fingerprint
    is one data_ptr(), stride() and is_neg() call in Python (none with the native reader), and the call runs a
    fixed handful of Python functions (the entry point, the fingerprints, the cache lookup and the launch)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(14)
    a, bt = torch.from_numpy(rand(rng, (16, 24))), torch.from_numpy(rand(rng, (32, 24)))
    out = torch.empty((16, 32))
    x, w, dy = (torch.from_numpy(t) for t in conv_data(rng))
    y = torch.empty(dy.shape)
    calls = {"gemm": (lambda: reg.gemm(a, bt.T, out), 8),  # the lambda counted
             "conv_fwd": (lambda: reg.conv_fwd(x, w, y, **GEO), 10)}
    for name, (call, most_frames) in calls.items():
        call()
        call()
        frames, methods = profiled(call)
        assert methods == ({} if reader == "native" else {"data_ptr": 3, "stride": 3, "is_neg": 3}), (name, methods)
        assert len(frames) <= most_frames, (name, frames)
        assert not any(f.startswith(("arrays.py", "gemm.py:operands", "conv.py:operands")) for f in frames), frames


def test_numpy_calls_neither_import_torch_nor_build_the_native_path(reg, tmp_path):
    """The native fast path is for torch tensors: a process that only passes numpy arrays never imports torch
    (seconds of startup) nor compiles anything."""
    script = (
        "import sys, numpy as np, tiledispatch as td\n"
        "from tiledispatch import native\n"
        f"reg = td.load({str(reg.source)!r})\n"
        "rng = np.random.default_rng(3)\n"
        "a, w = rng.random((9, 24), np.float32), rng.random((32, 24), np.float32)\n"
        "out = np.empty((9, 32), np.float32)\n"
        "for _ in range(3):\n"
        "    reg.gemm(a, w.T, out)\n"
        "assert np.allclose(out, a @ w.T, rtol=1e-4), 'wrong result'\n"
        "assert 'torch' not in sys.modules and not native._LOADED, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    env = {**os.environ, "TD_NATIVE_CACHE": str(tmp_path / "native")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "native").exists()
