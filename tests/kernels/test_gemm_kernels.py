"""Every kernel of every preselected cpu GEMM set against the float64 reference, on random data with
the output poisoned first, with M, N, K drawn from {1, 7, 129, 1000}."""
import itertools
import zlib

import numpy as np
import pytest

import tiledispatch as td
from conftest import CPU_GEMM_SETS
from tiledispatch import reference, validation
from tiledispatch.generator import kernelset
from tiledispatch import backends
from tiledispatch.ops.gemm import GemmProblem

ARCH = backends.get("cpu").detect_arch()
KERNELS = sorted({e.key.name: e.key for s in CPU_GEMM_SETS for e in kernelset.load(s, "cpu", ARCH)}.items())
SIZES = (1, 7, 129, 1000)


@pytest.fixture(scope="module")
def registry(gemm_bundle):
    return td.load(gemm_bundle)


def shapes_for(name: str):
    """Six (m, n, k) draws per kernel covering every size in every dimension, plus (1, 1, 1)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    perms = [rng.permutation(SIZES) for _ in range(3)]
    draws = [tuple(int(p[i]) for p in perms) for i in range(len(SIZES))]
    all_shapes = list(itertools.product(SIZES, repeat=3))
    draws += [all_shapes[i] for i in rng.choice(len(all_shapes), size=2, replace=False)]
    return [(1, 1, 1)] + draws


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, _ in KERNELS])
def test_kernel_matches_reference(registry, name):
    key = registry.kernel(name).key
    sig = key.signature
    rng = np.random.default_rng(1)
    integer = sig.dtype_c == "int32"
    for i, (m, n, k) in enumerate(shapes_for(name)):
        batch = 2 if i == 1 else 1
        use_c = i % 2 == 0
        alpha, beta = (1.0, 1.0) if integer else (1.5, -0.5)
        clamp = (-0.5, 0.75)
        p = GemmProblem(m, n, k, sig.dtype_a, sig.dtype_b, sig.dtype_c, sig.layout, batch, sig.epilogue)
        data = validation.gemm_inputs(p, rng, with_c=use_c)
        registry.gemm(data["a"], data["b"], data["out"], c=data["c"], bias=data["bias"], residuals=data["residuals"],
                      alpha=alpha, beta=beta if use_c else 0.0, activation=sig.epilogue.activation, clamp=clamp,
                      kernel=name)
        ref = reference.gemm(data["a"], data["b"], data["c"], data["bias"], data["residuals"], alpha,
                             beta if use_c else 0.0, sig.epilogue.activation, clamp)
        result = validation.compare(data["out"], ref, key)
        assert result["passed"], f"{name} m={m} n={n} k={k} batch={batch}: {result}"


def test_poisoned_output_is_detected(registry):
    """The check itself: an output left unwritten (still NaN) must fail."""
    name, key = KERNELS[0]
    out = validation.poison(np.empty((4, 4), np.float32))
    assert not validation.compare(out, np.ones((4, 4)), key)["passed"]
