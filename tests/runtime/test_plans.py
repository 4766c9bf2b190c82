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


# -- conv Plans: every direction and rank -------------------------------------------------------------------------
CONV_SET = """\
schema: 1
name: conv_plans
description: small-tile fp32 cpu conv kernels, every direction and rank
groups:
  - backend: cpu
    op: conv
    direction: [fwd, bwd_data, bwd_weight]
    spatial_dims: [1, 2, 3]
    dtype: fp32
    layout: nhwgc
    tile: [16, 16, 24]
    mma: [4, 16, 1]
    pipeline: packed
"""
SPATIAL = {1: (9,), 2: (7, 6), 3: (5, 6, 4)}


@pytest.fixture(scope="module")
def conv_registry(tmp_path_factory):
    from conftest import build_cpu_bundle

    return build_cpu_bundle(tmp_path_factory.mktemp("conv_plans"), "conv_plans", CONV_SET)


def logical(a, role):
    """The frameworks' form of an explicit-group-axis tensor, as a view of the same memory: x, y [N, C, sp...]
    from [N, sp..., G, C/G]; w [K, C/G, f...] from [G, K/G, f..., C/G]."""
    if role == "w":
        merged = a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])
    else:
        merged = a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1])
    return np.moveaxis(merged, -1, 1)


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_conv_plans_run_every_direction_and_rank(conv_registry, direction, rank):
    """A conv Plan: launched on new random tensors each time (only pointers change), then on the same memory in
    the logical [N, C, spatial...] form (another fingerprint: checked and bound again); written tensor poisoned,
    against the float64 reference."""
    from tiledispatch.ops.conv import WRITES, ConvProblem

    spatial = SPATIAL[rank]
    p = ConvProblem(direction, 2, 2, 8, 12, spatial, (3,) * rank, 2, 1, 1, (0,) * rank, "fp32", "fp32", "fp32")
    plan = conv_registry.plan(p)
    assert plan.kernel.key.signature.direction == direction and plan.kernel.key.signature.spatial_dims == rank
    rng = np.random.default_rng(rank * 10 + len(direction))
    written = WRITES[direction]
    for form in ("explicit", "explicit", "explicit", "logical"):
        data, expect = validation.conv_case(p, rng)
        tensors = data if form == "explicit" else {role: logical(a, role) for role, a in data.items()}
        plan(tensors)
        result = validation.compare(data[written], expect, plan.kernel.key)
        assert result["passed"], (form, result)
    with pytest.raises(td.InvalidInputError, match="the tensors describe"):
        shapes = p.shapes()
        wrong = {role: np.zeros(shapes[role] if role == "w" else (3, *shapes[role][1:]), np.float32)  # N = 3
                 for role in "xwy"}
        plan(wrong)
