"""Every shape runs (issue #17, DESIGN.md invariant 10), by the family models of td_can_run (bench/benchmarks/coverage.py):
the essential sets admit every GEMM and conv problem class on the cutlass archs, the low-alignment and generic
kernels are the only ones that take the issue's problems, and the ranker places them after every kernel that can
run the same problem. tests/kernels/test_coverage_emulated.py and test_coverage_compile.py check the models against the
kernels' own td_can_run."""
from __future__ import annotations

import importlib.util

import pytest

from conftest import REPO
from tiledispatch import backends, selection
from tiledispatch.ops.conv import ConvProblem
from tiledispatch.ops.gemm import GemmProblem

_spec = importlib.util.spec_from_file_location("coverage", REPO / "bench" / "benchmarks" / "coverage.py")
coverage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage)

# the sets whose dtypes the low-alignment / generic kernels serve (fp8 has no sub-16-byte kernel: a known gap)
COVERED_SETS = ("fp16_rcr_essential", "bf16_rcr_essential", "fp32_rcr_essential", "int8_rcr_essential",
                "fp16_all_layouts", "conv_fp16_fwd_essential", "conv_fp16_bwd_essential", "conv_fp16_all_essential")
ISSUE_GEMMS = ((777, 1234, 4320), (65, 129, 256), (3, 50257, 768))


def low_alignment(key) -> bool:
    return key.algorithm.extra("cutlass.align", 0) > 0


def generic_conv(key) -> bool:
    """implicit_gemm's any-channel-count kernel (its align 4 kernels are ordinary ones with 8-byte chunks)."""
    return key.algorithm.extra("cutlass.align", 0) == 1


@pytest.mark.parametrize("name", COVERED_SETS)
def test_every_class_has_a_kernel_on_the_cutlass_archs(name):
    result = coverage.model_map([name])
    cutlass = {where: r for where, r in result.items() if " cutlass/" in where}
    assert cutlass, f"{name} has no cutlass target"
    for where, r in cutlass.items():
        assert r["relevant"] > 100, where
        assert not r["unmodelled"], f"{where}: kernels without a td_can_run model"
        assert not r["uncovered"], f"{where}: {len(r['uncovered'])} classes without a kernel, e.g. {r['uncovered'][:5]}"


def test_the_map_sees_the_gaps_without_the_new_kernels():
    """The same map without the low-alignment / generic kernels names the issue's problems as uncovered: the models
    refuse what the 16-byte kernels refuse."""
    result = coverage.model_map(["fp16_rcr_essential", "conv_fp16_bwd_essential"], exclude="_xalign")
    gemm = result["fp16_rcr_essential cutlass/sm90a"]["uncovered"]
    for m, n, k in ISSUE_GEMMS:
        assert f"gemm fp16/fp16 rcr {m}x{n}x{k} dense" in gemm
    assert "gemm fp16/fp16 rcr 64x64x64 dense" not in gemm
    conv = result["conv_fp16_bwd_essential cutlass/sm90a"]["uncovered"]
    assert "conv2d bwd_data resnet stem 7x7/2 C3 K64" in conv
    assert "conv1d bwd_data audio front end 10/5 C1 K512" in conv


def _kernels(name, target):
    return coverage.set_keys(name, target)


def _admitting(keys, problem, ld=None):
    return [k for k in keys if problem.mismatch(k) is None and coverage.model_refusal(problem, k, ld) is None]


@pytest.mark.parametrize("arch", ["sm90a", "sm80"])
@pytest.mark.parametrize("mnk", ISSUE_GEMMS)
def test_issue_gemms_run_on_low_alignment_kernels_only(arch, mnk):
    keys = _kernels("fp16_rcr_essential", f"cutlass/{arch}")
    admitting = _admitting(keys, GemmProblem(*mnk, "fp16", "fp16", "fp16", "rcr"))
    assert admitting and all(low_alignment(k) for k in admitting)


@pytest.mark.parametrize("name,dt", [("fp16_rcr_essential", "fp16"), ("bf16_rcr_essential", "bf16"),
                                     ("fp32_rcr_essential", "fp32"), ("int8_rcr_essential", "int8")])
@pytest.mark.parametrize("arch", ["sm90a", "sm80"])
def test_low_alignment_kernels_rank_after_the_16_byte_kernels(name, dt, arch):
    """On aligned problems every kernel that runs them with 16-byte accesses ranks before every low-alignment one."""
    keys = _kernels(name, f"cutlass/{arch}")
    out = "int32" if dt == "int8" else dt
    for m, n, k in ((4096, 4096, 4096), (128, 256, 512), (64, 64, 64), (8192, 1024, 64)):
        ranked = selection.analytic(GemmProblem(m, n, k, dt, dt, out, "rcr"),
                                    [_Kern(x) for x in _admitting(keys, GemmProblem(m, n, k, dt, dt, out, "rcr"))])
        flags = [generic_conv(x.key) for x in ranked]
        assert False in flags and flags == sorted(flags), (m, n, k, [x.name for x in ranked])


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_learned_ranker_puts_the_fallbacks_last(dt):
    """The shipped sm90a GEMM model was trained on the TMA kernels only (its applies_to): it orders those, and the
    low-alignment fallbacks follow in analytic order."""
    from tiledispatch import learned

    keys = _kernels(f"{dt}_rcr_essential", "cutlass/sm90a")
    for m, n, k in ((4096, 4096, 4096), (128, 11008, 4096), (777, 1232, 4320)):
        p = GemmProblem(m, n, k, dt, dt, dt, "rcr")
        kernels = [_Kern(x) for x in _admitting(keys, p)]
        ranked = selection.learned(p, kernels)
        flags = [generic_conv(x.key) for x in ranked]
        assert False in flags and True in flags and flags == sorted(flags), [x.name for x in ranked]
        main = [x for x in kernels if not low_alignment(x.key)]
        assert [x.name for x in ranked[:len(main)]] == [x.name for x in learned.rank(p, main)]
    odd = GemmProblem(777, 1234, 4320, dt, dt, dt, "rcr")  # only the fallbacks run it: analytic order
    kernels = [_Kern(x) for x in _admitting(keys, odd)]
    assert [x.name for x in selection.learned(odd, kernels)] == [x.name for x in selection.analytic(odd, kernels)]


def test_wider_accesses_rank_first_among_the_fallbacks():
    keys = [k for k in _kernels("fp16_rcr_essential", "cutlass/sm90a") if low_alignment(k)]
    ranked = selection.analytic(GemmProblem(1000, 1000, 1000, "fp16", "fp16", "fp16", "rcr"), [_Kern(k) for k in keys])
    aligns = [x.key.algorithm.extra("cutlass.align") for x in ranked]
    assert aligns == sorted(aligns, reverse=True)


@pytest.mark.parametrize("label,problem", [
    ("stem bwd_data", ConvProblem("bwd_data", 32, 1, 3, 64, (224, 224), (7, 7), (2, 2), (1, 1), (3, 3), (3, 3),
                                  "fp16", "fp16", "fp16")),
    ("audio bwd_data", ConvProblem("bwd_data", 4, 1, 1, 512, (16000,), (10,), (5,), (1,), (0,), (0,),
                                   "fp16", "fp16", "fp16")),
    ("odd dense 3D fwd", ConvProblem("fwd", 2, 1, 65, 65, (8, 16, 16), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1),
                                     (1, 1, 1), "fp16", "fp16", "fp16")),
])
def test_issue_convs_run_on_the_generic_kernel(label, problem):
    admitting = _admitting(_kernels("conv_fp16_all_essential", "cutlass/sm90a"), problem)
    assert admitting and all(k.algorithm.pipeline == "implicit_gemm" and generic_conv(k) for k in admitting), label


@pytest.mark.parametrize("problem", [
    ConvProblem("fwd", 32, 1, 64, 64, (56, 56), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), "fp16", "fp16", "fp16"),
    ConvProblem("bwd_data", 32, 32, 128, 128, (28, 28), (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), "fp16", "fp16", "fp16"),
    ConvProblem("bwd_weight", 8, 1, 256, 256, (14, 14), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), "fp16", "fp16", "fp16"),
    ConvProblem("fwd", 32, 96, 96, 96, (56, 56), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), "fp16", "fp16", "fp16"),
])
def test_generic_conv_kernel_ranks_last(problem):
    """After every kernel but the other fallback, direct's run-time-channel kernel (cpg 0), which the tile model
    orders against it (CUDA cores against padded tensor-core tiles)."""
    keys = _kernels("conv_fp16_all_essential", "cutlass/sm90a")
    ranked = selection.analytic(problem, [_Kern(k) for k in _admitting(keys, problem)
                                          if not (k.algorithm.pipeline == "direct" and not k.algorithm.extras)])
    flags = [generic_conv(x.key) for x in ranked]
    assert False in flags and flags == sorted(flags), [x.name for x in ranked]


def test_gemm_model_reads_leading_dimensions():
    key = next(k for k in _kernels("fp16_rcr_essential", "cutlass/sm90a") if k.algorithm.extra("cutlass.align") == 8)
    model = backends.family_of(key).module.refusal
    p = GemmProblem(64, 64, 64, "fp16", "fp16", "fp16", "rcr")
    assert model(p, key) is None
    assert "leading stride 65" in model(p, key, {"a": 65})
    assert model(p, key, {"c": 65}) is None  # D element by element
    tma = next(k for k in _kernels("fp16_rcr_essential", "cutlass/sm90a") if not low_alignment(k))
    assert "multiple of 8" in backends.family_of(tma).module.refusal(p, tma, {"c": 65})


class _Kern:
    """What the rankers read of a registry kernel: its key and name."""

    def __init__(self, key):
        self.key, self.name = key, key.name
