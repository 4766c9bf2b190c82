"""Every shape runs on the cpu backend (issue #17): every problem class of bench/benchmarks/coverage.py that a cpu bundle of
the essential sets is built for runs through the public API (reg.gemm / reg.conv_*, the registry's own choice) and
matches the float64 reference on random data with the output poisoned first. GEMM: odd M / N / K in every dtype
and layout of the sets, dense operands and operands whose leading dimension is one longer than their extent;
conv: channel counts 1 / 3 / odd / 257, odd C/G and K/G, depthwise, strides, dilation, asymmetric padding, every
rank and direction, and small versions of the ResNet stem and a raw-audio front end."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from conftest import REPO, build_cpu_bundle
from tiledispatch import validation
from tiledispatch.ops import conv

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("coverage", REPO / "bench" / "benchmarks" / "coverage.py")
coverage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage)

GEMM_DTYPES = tuple(d for d in coverage.GEMM_DTYPES if not d[0].startswith("fp8"))  # no fp8 cpu kernels
GEMM_SIZES = (1, 3, 7, 65)
CONV_SIZES = {1: (23,), 2: (9, 10), 3: (5, 6, 7)}
CONV_NAMED = (("stem-like 7x7/2 C3 K16", 2, 1, 3, 16, (21, 22), (7, 7), (2, 2), (1, 1), (3, 3), (3, 3)),
              ("audio-like 10/5 C1 K24", 2, 1, 1, 24, (203,), (10,), (5,), (1,), (0,), (0,)))
# one small extra kernel: build_cpu_bundle builds a set of its own next to the essential one
EXTRA_SET = """\
schema: 1
name: coverage_extra
description: one small cpu conv kernel next to conv_fp16_all_essential
groups:
  - {backend: cpu, op: conv, direction: fwd, spatial_dims: 1, dtype: fp32, layout: nhwgc, pipeline: direct,
     tile: [8, 32, 8], mma: [4, 16, 1]}
"""


def strided_operand(rng, rows: int, cols: int, letter: str, dt: str, pad: int) -> np.ndarray:
    """A random [1, rows, cols] array (row- or column-major) whose leading dimension is `pad` elements longer than
    its contiguous extent: a view into a larger buffer."""
    outer, inner = (rows, cols) if letter == "r" else (cols, rows)
    base = validation.random_array(rng, (1, outer, inner + pad), dt)[:, :, :inner]
    return base if letter == "r" else np.swapaxes(base, 1, 2)


def test_every_gemm_class_runs(gemm_bundle):
    import tiledispatch as td

    reg = td.load(gemm_bundle)
    rng = np.random.default_rng(17)
    ran, failures = 0, []
    for label, p, ld in coverage.gemm_classes(GEMM_DTYPES, sizes=GEMM_SIZES):
        if not any(p.mismatch(k.key) is None for k in reg.kernels):
            continue  # no set of the bundle is built for this dtype / layout
        pad = 1 if ld else 0
        a = strided_operand(rng, p.m, p.k, p.layout[0], p.dtype_a, pad)
        b = strided_operand(rng, p.k, p.n, p.layout[1], p.dtype_b, pad)
        d = validation.poison(strided_operand(rng, p.m, p.n, "r", p.dtype_c, pad))
        try:
            reg.gemm(a, b, out=d)
        except Exception as e:  # noqa: BLE001
            failures.append(f"{label}: {type(e).__name__}: {e}")
            continue
        ref = a.astype(np.float64) @ b.astype(np.float64)
        key = reg.select(p).key
        result = validation.compare(d, ref, key)
        if not result["passed"]:
            failures.append(f"{label}: {result}")
        ran += 1
    assert ran > 800, ran
    assert not failures, f"{len(failures)} of {ran + len(failures)} classes failed:\n" + "\n".join(failures[:10])


@pytest.fixture(scope="module")
def conv_registry(tmp_path_factory):
    return build_cpu_bundle(tmp_path_factory.mktemp("coverage_conv"), "coverage_extra", EXTRA_SET,
                            "conv_fp16_all_essential")


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_every_conv_class_runs(conv_registry, direction):
    rng = np.random.default_rng(23)
    ran, failures = 0, []
    for label, p, _ in coverage.conv_classes(directions=(direction,), sizes=CONV_SIZES, named=CONV_NAMED):
        data, expect = validation.conv_case(p, rng)
        geo = dict(stride=p.stride, dilation=p.dilation, pad_lo=p.pad_lo, pad_hi=p.pad_hi)
        try:
            if direction == "fwd":
                conv_registry.conv_fwd(data["x"], data["w"], out=data["y"], **geo)
            elif direction == "bwd_data":
                conv_registry.conv_bwd_data(data["y"], data["w"], out=data["x"], **geo)
            else:
                conv_registry.conv_bwd_weight(data["x"], data["y"], out=data["w"], **geo)
        except Exception as e:  # noqa: BLE001
            failures.append(f"{label}: {type(e).__name__}: {e}")
            continue
        result = validation.compare(data[conv.WRITES[direction]], expect, conv_registry.select(p).key)
        if not result["passed"]:
            failures.append(f"{label}: {result}")
        ran += 1
    assert ran > 150, ran
    assert not failures, f"{len(failures)} of {ran + len(failures)} classes failed:\n" + "\n".join(failures[:10])
