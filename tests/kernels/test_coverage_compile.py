"""The low-alignment GEMM kernels (cutlass.align) compiled with nvcc, no GPU: the kernel's own td_can_run and its
family's model (refusal(problem, key, ld), bench/benchmarks/coverage.py) agree on every GEMM class, leading dimensions
included; the issue's problems are accepted. One compile (about a minute, 3-4 GB); skipped unless nvcc and the
nvidia-cutlass headers are present."""
from __future__ import annotations

import importlib.util

import pytest

from conftest import REPO, compile_keys, toolchain_or_reason
from tiledispatch import abi, backends
from tiledispatch.generator import toolchains
from tiledispatch.ops import gemm as gemm_op
from tiledispatch.spec.key import Algorithm, Epilogue, KernelKey, Signature

cutlass = toolchains.get("cutlass")
TOOLCHAIN, WHY = toolchain_or_reason(cutlass)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(TOOLCHAIN is None, reason=f"cutlass toolchain missing: {WHY}")]

_spec = importlib.util.spec_from_file_location("coverage", REPO / "bench" / "benchmarks" / "coverage.py")
coverage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage)

# fp16 align 1 on sm90a: the two-stage pipelined main loop, built for the arch whose TMA kernels refuse unaligned rows
KEY = KernelKey(Signature("gemm", "fp16", "fp16", "fp16", "fp32", "rcr", Epilogue()),
                Algorithm((64, 128, 32), "multistage", (2, 2, 1), (16, 8, 16), "data_parallel", 1, (1, 1, 1), 0,
                          (("cutlass.align", 1),)), "cutlass", "sm90a")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    built = compile_keys(cutlass, TOOLCHAIN, (KEY,), tmp_path_factory.mktemp("coverage_compile"))
    return abi.KernelLibrary(built[KEY][0])


def test_reports_its_key(library):
    assert KernelKey.from_json(library.key_json()) == KEY


def test_model_agrees_with_td_can_run(library):
    model = backends.family_of(KEY).module.refusal
    checked, disagree = 0, []
    for label, p, ld in coverage.gemm_classes(dtypes=(("fp16", "fp16", "fp16"),), layouts=("rcr",)):
        args = gemm_op.make_args(p, KEY)
        if ld:
            coverage._apply_ld(args, p, ld)
        status, why = library.can_run(args)
        said = model(p, KEY, ld)
        checked += 1
        if (status == abi.OK) != (said is None):
            disagree.append(f"{label}: kernel {status} {why!r}, model {said!r}")
    assert checked > 400 and not disagree, "\n".join(disagree[:10])


def test_accepts_the_issue_problems_and_refuses_misaligned_pointers(library):
    for m, n, k in ((777, 1234, 4320), (65, 129, 256), (3, 50257, 768)):
        status, why = library.can_run(gemm_op.make_args(gemm_op.GemmProblem(m, n, k, "fp16", "fp16", "fp16"), KEY))
        assert status == abi.OK, why
    args = gemm_op.make_args(gemm_op.GemmProblem(8, 8, 8, "fp16", "fp16", "fp16"), KEY)
    args.tensors[0].data = gemm_op.DUMMY_PTR + 1  # an fp16 access needs 2-byte alignment
    status, why = library.can_run(args)
    assert status == abi.UNSUPPORTED and "2-byte aligned" in why, why
