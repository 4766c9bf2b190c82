"""Fused forward conv epilogues of the cutlass kernels on an NVIDIA GPU: every fused kernel of a bundle (tma_ws_conv's
epilogue tree, implicit_gemm's and direct's stores) on random data with random bias and residuals, outputs poisoned,
against the float64 reference; alpha / beta with the epilogue; each epilogue through the runtime's own selection on
torch channels_last tensors (pointwise layers on the fused GEMM kernels). The checks are bench/validation/validate_conv_gpu.py's.

Marked gpu; skipped without torch + CUDA. The bundle comes from $TD_CUTLASS_CONV_BUNDLE (e.g. the conv bundle of
bench/validation/validate_preselected_cutlass.sh, build/gpu/conv90), else the small set below is built here with scons.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

import tiledispatch as td  # noqa: E402
from tiledispatch import backends  # noqa: E402
from tiledispatch.generator import toolchains  # noqa: E402
from tiledispatch.spec.key import Epilogue  # noqa: E402

from conftest import REPO, scons  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "bench" / "validation"))
import validate_conv_gpu as vcg  # noqa: E402

pytestmark = pytest.mark.gpu

FUSED_SET = """schema: 1
name: conv_epilogue_gpu_test
description: fused forward conv epilogues, one kernel per store path
groups:
  - backend: cutlass
    arch: sm90a
    op: conv
    direction: fwd
    spatial_dims: 2
    dtype: fp16
    layout: nhwgc
    scheduler: data_parallel
    configs:
      - {pipeline: tma_ws_conv, tile: [128, 64, 64], mma: [64, 64, 16], warps: [4, 1, 1],
         epilogue: [{activation: relu, bias: true, residuals: 1}, {activation: clamp, bias: true}]}
      - {pipeline: implicit_gemm, tile: [128, 64, 32], warps: [2, 2, 1], mma: [16, 8, 16],
         epilogue: [{activation: gelu_erf, bias: true, residuals: 2}, {activation: silu}]}
      - {pipeline: direct, tile: [28, 64, 8], warps: [16, 1, 1], mma: [7, 4, 1], extras: {cpg: 1, kpg: 1, fx: 3, fy: 3},
         epilogue: {activation: clamp, bias: true, residuals: 1}}
      - {pipeline: direct_mma, tile: [32, 32, 8], warps: [4, 2, 1], mma: [16, 8, 16], extras: {cpg: 4, kpg: 4, fx: 3, fy: 3},
         epilogue: {activation: relu, bias: true}}
  - backend: cutlass
    arch: sm90a
    op: gemm
    dtype: fp16
    layout: rcr
    pipeline: tma_ws_pingpong
    scheduler: persistent
    warps: [4, 1, 1]
    tile: [128, 64, 64]
    mma: [64, 64, 16]
    epilogue: {activation: relu, bias: true, residuals: 1}
"""


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    path = os.environ.get("TD_CUTLASS_CONV_BUNDLE")
    if not path:
        try:
            toolchains.get("cutlass").toolchain()
        except RuntimeError as e:
            pytest.skip(f"no prebuilt bundle ($TD_CUTLASS_CONV_BUNDLE) and no toolchain: {e}")
        build = tmp_path_factory.mktemp("conv_epilogue_gpu")
        spec = build / "set.yaml"
        spec.write_text(FUSED_SET)
        arch = backends.get("cutlass").detect_arch()
        scons(REPO, f"kernels={spec}", "backend=cutlass", f"arch={arch}", f"build_dir={build}",
              f"cache_dir={build / 'cache'}", "bundle=b")
        path = str(build / "b")
    return td.load(Path(path))


def _fused_only(reg):
    """A registry view holding the bundle's fused kernels only (the checks walk reg.kernels)."""
    kernels = [k for k in reg.kernels if k.key.signature.epilogue != Epilogue()]
    if not kernels:
        pytest.skip("the bundle has no fused-epilogue kernels")
    from tiledispatch.registry import Registry

    return Registry(kernels, reg.backend, reg.arch, reg.manifest)


def test_every_fused_kernel_matches_the_reference(registry):
    results = vcg.check_kernels([_fused_only(registry)], {}, np.random.default_rng(21))
    failed = [r for r in results if not r["passed"]]
    assert results and not failed, failed[:10]


def test_fused_epilogues_through_the_runtime(registry):
    results = vcg.check_fused_selection([registry])
    failed = [r for r in results if not r["passed"]]
    assert results and not failed, failed[:10]


def test_tma_ws_conv_refuses_beta_next_to_a_residual(registry):
    kern = next((k for k in registry.kernels if k.key.algorithm.pipeline == "tma_ws_conv"
                 and k.key.signature.epilogue.residuals), None)
    if kern is None:
        pytest.skip("no tma_ws_conv kernel with a residual in the bundle")
    from tiledispatch import abi, validation

    p, host, _ = vcg.make_case(np.random.default_rng(3), "fwd", 2, "dense", "s1d1", "fp16",
                               epilogue=kern.key.signature.epilogue)
    dev = vcg.to_device(host, "fp16", "y")
    launch = vcg.ConvLauncher(kern, p, dev["x"], dev["w"], dev["y"], beta=0.5, bias=dev.get("bias"),
                              residuals=dev["residuals"], clamp=validation.VALIDATION_CLAMP)
    status, reason = launch.can_run()
    assert status == abi.UNSUPPORTED and "beta must be 0" in reason
