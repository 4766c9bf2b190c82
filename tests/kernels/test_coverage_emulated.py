"""The conv families' td_can_run models (refusal(problem, key), bench/benchmarks/coverage.py) against the kernels' own
td_can_run, and the generic implicit GEMM kernel (cutlass.align 1) against the float64 reference, without a GPU:
the kernels rendered, compiled by g++ against tests/kernels/emulate/td_emulate.h and called through the C ABI.
Skipped without g++ or the CUDA headers."""
from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pytest

import conv_emulation as ce
from conftest import REPO
from tiledispatch import abi, backends, validation
from tiledispatch.ops import conv
from tiledispatch.spec.key import Epilogue

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("g++") is None or ce.cuda_include() is None,
                                                     reason="g++ or the CUDA headers (cuda_fp16.h) missing")]

_spec = importlib.util.spec_from_file_location("coverage", REPO / "bench" / "benchmarks" / "coverage.py")
coverage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage)

GENERIC = (("cutlass.align", 1),)


def generic_key(direction, rank, tile=(32, 32, 32), warps=(2, 1, 1)):
    return ce.conv_key(direction, rank, "implicit_gemm", tile, (16, 8, 16), warps, stages=3, extras=GENERIC)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    out, cache = tmp_path_factory.mktemp("coverage_emulated"), {}

    def get(key):
        if key.name not in cache:
            cache[key.name] = ce.build(key, out)
        return cache[key.name]
    return get


def _set_conv_keys(direction):
    """The conv_fp16_all_essential sm90a kernels of one direction that the emulation runs (the project's own CUDA:
    direct, direct_mma, implicit_gemm; tma_ws_conv is CUTLASS's), without a fused epilogue (the same tiles' variants
    with one refuse exactly the same problems; tests/test_cutlass_conv_epilogue_emulated.py runs those)."""
    return [k for k in coverage.set_keys("conv_fp16_all_essential", "cutlass/sm90a")
            if k.signature.op == "conv" and k.signature.direction == direction
            and k.algorithm.pipeline != "tma_ws_conv" and k.signature.epilogue == Epilogue()]


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_models_agree_with_td_can_run(build, direction):
    """Every set kernel of the direction on every conv class of bench/benchmarks/coverage.py: the model admits a class exactly
    when the compiled kernel's td_can_run does."""
    classes = [c for c in coverage.conv_classes(directions=(direction,))]
    disagree = []
    for key in _set_conv_keys(direction):
        lib = build(key)
        model = backends.family_of(key).module.refusal
        for label, p, _ in classes:
            if p.mismatch(key) is not None:
                continue
            status, why = lib.can_run(conv.make_args(p, key))
            said = model(p, key)
            if (status == abi.OK) != (said is None):
                disagree.append(f"{key.name}: {label}: kernel {status} {why!r}, model {said!r}")
    assert not disagree, f"{len(disagree)} disagreements:\n" + "\n".join(disagree[:10])


# (G, C/G, K/G): C or K = 1 and 3, odd per group, a multiple of 8 next to an odd one, depthwise
GENERIC_KINDS = ((1, 3, 5), (1, 1, 17), (1, 17, 1), (2, 9, 3), (3, 1, 1), (1, 24, 16), (1, 8, 13))
SIZES = {1: (2, (23,), (3,)), 2: (2, (9, 10), (3, 2)), 3: (1, (5, 6, 7), (3, 2, 3))}


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_generic_kernel_validates(build, direction, rank):
    key = generic_key(direction, rank)
    lib = build(key)
    rng = np.random.default_rng(17 + rank)
    failures = []
    geometries = {**ce.GEOMETRIES, **(ce.MIXED_GEOMETRIES if rank == 2 else {})}
    for (g, cg, kg), geometry in zip(GENERIC_KINDS * 2, list(geometries) * 4):
        stride, dilation, pad_lo, pad_hi = (v[-rank:] for v in geometries[geometry])
        n, size, filt = SIZES[rank]
        p = conv.ConvProblem(direction, n, g, g * cg, g * kg, size, filt, stride, dilation, pad_lo, pad_hi,
                             "fp16", "fp16", "fp16")
        assert backends.family_of(key).module.refusal(p, key) is None
        data, expect = validation.conv_case(p, rng)
        status, why, out = ce.run(lib, key, p, data)
        result = validation.compare(out, expect, key) if status == abi.OK else {"passed": False, "why": why}
        if not result["passed"]:
            failures.append(f"{p}: {result}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("label,problem", [
    # large enough that most 128-pixel tiles lie inside one stride phase (their other phases' taps skipped)
    ("stem-like bwd_data", conv.ConvProblem("bwd_data", 1, 1, 3, 16, (40, 41), (7, 7), (2, 2), (1, 1), (3, 3), (3, 3),
                                            "fp16", "fp16", "fp16")),
    ("audio-like bwd_data", conv.ConvProblem("bwd_data", 2, 1, 1, 24, (1003,), (10,), (5,), (1,), (0,), (0,),
                                             "fp16", "fp16", "fp16")),
    ("3D mixed strides bwd_data", conv.ConvProblem("bwd_data", 1, 1, 5, 9, (6, 20, 21), (3, 3, 3), (1, 2, 3), (2, 1, 1),
                                                   (1, 1, 0), (2, 0, 1), "fp16", "fp16", "fp16")),
    ("audio-like fwd", conv.ConvProblem("fwd", 2, 1, 1, 24, (203,), (10,), (5,), (1,), (0,), (0,),
                                        "fp16", "fp16", "fp16")),
    # a 3-channel 7x7 stride-2 stem (ResNet's): each tap's channels a partial chunk of 8, padding on every side
    ("stem fwd", conv.ConvProblem("fwd", 1, 1, 3, 16, (40, 41), (7, 7), (2, 2), (1, 1), (3, 3), (3, 3),
                                  "fp16", "fp16", "fp16")),
])
def test_generic_kernel_runs_the_issue_layers(build, label, problem):
    """Small versions of the issue's layers (the real ones are timed on the GPU: bench/benchmarks/coverage_gpu_run.sh), on the
    set's own generic tiles, alpha and beta applied."""
    for key in coverage.set_keys("conv_fp16_all_essential", "cutlass/sm90a"):
        if key.algorithm.extra("cutlass.align", 0) != 1 or problem.mismatch(key) is not None:
            continue
        rng = np.random.default_rng(3)
        data, expect = validation.conv_case(problem, rng)
        written = conv.WRITES[problem.direction]
        old = validation.random_array(rng, data[written].shape, "fp16")
        data[written][...] = old
        status, why, out = ce.run(build(key), key, problem, data, alpha=0.5, beta=-2.0)
        assert status == abi.OK, why
        result = validation.compare(out, 0.5 * expect - 2.0 * old.astype(np.float64), key)
        assert result["passed"], (label, key.name, result)
