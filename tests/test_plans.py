"""The launch fast path: repeated calls reuse a validated plan and only swap the data pointers, and
anything that changes a tensor's shape, strides, dtype or alignment goes through the full checks."""
import numpy as np
import pytest

import tiledispatch as td
from tiledispatch import reference, validation
from tiledispatch.ops.gemm import GemmProblem


@pytest.fixture(scope="module")
def registry(gemm_bundle):
    return td.load(gemm_bundle)


def rand(rng, *shape):
    return validation.random_array(rng, shape, "fp16")


def check(out, a, b, reg, c=None, beta=0.0):
    ref = reference.gemm(a, b, c, beta=beta)
    assert validation.compare(out, ref, reg.kernels[0].key)["passed"]


def test_repeated_calls_swap_pointers_and_stay_right(registry):
    rng = np.random.default_rng(1)
    triples = [(rand(rng, 40, 24), rand(rng, 24, 56), validation.poison(np.empty((40, 56), np.float16)))
               for _ in range(3)]
    registry.clear_caches()
    for _ in range(2):  # a, b, out all change between calls; the second round reuses them again
        for a, b, out in triples:
            out.fill(np.nan)
            registry.gemm(a, b, out)
            check(out, a, b, registry)
    assert registry.cache_info()["launches"]["entries"] == 1  # one prepared launch served every call


def test_changed_alignment_or_layout_is_revalidated(registry):
    rng = np.random.default_rng(2)
    a, b = rand(rng, 40, 24), rand(rng, 24, 56)
    out = np.empty((40, 56), np.float16)
    registry.clear_caches()
    registry.gemm(a, b, out)
    base = np.empty(40 * 24 + 1, np.float16)
    shifted = base[1:].reshape(40, 24)  # same shape and strides, pointer off by 2 bytes
    shifted[...] = a
    out.fill(np.nan)
    registry.gemm(shifted, b, out)
    check(out, a, b, registry)
    b_col = np.asfortranarray(b)  # another layout: a different plan (or a clear refusal), never a wrong one
    out.fill(np.nan)
    try:
        registry.gemm(a, b_col, out)
        check(out, a, b, registry)
    except td.UnsupportedProblemError:
        pass
    assert registry.cache_info()["launches"]["entries"] >= 2


def test_plan_object_swaps_pointers_and_rechecks_shapes(registry):
    rng = np.random.default_rng(3)
    p = GemmProblem(40, 56, 24, "fp16", "fp16", "fp16", "rcr")
    plan = registry.plan(p)
    for _ in range(3):
        t = {"a": rand(rng, 40, 24), "b": np.asfortranarray(rand(rng, 24, 56)),
             "out": validation.poison(np.empty((40, 56), np.float16))}
        plan(t)
        check(t["out"], t["a"], t["b"], registry)
    with pytest.raises(td.InvalidInputError, match="the tensors describe"):
        plan({"a": rand(rng, 41, 24), "b": np.asfortranarray(rand(rng, 24, 56)), "out": np.empty((41, 56), np.float16)})
