"""cutlass backend, compile only (no GPU): one sm90a and one sm80 kernel through nvcc, so template
breakage fails CI. Skipped unless nvcc and the nvidia-cutlass headers are present. The two compiles
run side by side (about 2 minutes and 4 GB each); the kernels' host code (argument checks, key
export) is then exercised without a device."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import compile_keys, toolchain_or_reason
from tiledispatch import abi
from tiledispatch.generator import toolchains
from tiledispatch.ops import gemm as gemm_op
from tiledispatch.spec.key import Algorithm, Epilogue, KernelKey, Signature

cutlass = toolchains.get("cutlass")
TOOLCHAIN, WHY = toolchain_or_reason(cutlass)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(TOOLCHAIN is None, reason=f"cutlass toolchain missing: {WHY}")]

# Fused epilogues exercise the most template code: bias, a residual, an activation / clamp.
SM90 = KernelKey(Signature("gemm", "bf16", "bf16", "bf16", "fp32", "rcr", Epilogue("gelu_tanh", True, 1)),
                 Algorithm((64, 128, 64), "tma_ws_pingpong", (4, 1, 1), (64, 128, 16), "persistent", 1, (1, 2, 1), 0),
                 "cutlass", "sm90a")
SM80 = KernelKey(Signature("gemm", "fp16", "fp16", "fp16", "fp32", "rcr", Epilogue("clamp", True, 1)),
                 Algorithm((128, 128, 32), "multistage", (2, 2, 1), (16, 8, 16), "data_parallel", 1, (1, 1, 1), 0),
                 "cutlass", "sm80")


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> dict[str, Path]:
    built = compile_keys(cutlass, TOOLCHAIN, (SM90, SM80), tmp_path_factory.mktemp("cutlass_compile"))
    for key, (_, log) in built.items():
        assert "serialized" not in log, f"ptxas serialized wgmma for {key.arch} (-DNDEBUG missing?):\n{log}"
    return {key.arch: lib for key, (lib, _) in built.items()}


@pytest.mark.parametrize("key", [SM90, SM80], ids=["sm90a", "sm80"])
def test_compiles_and_reports_its_key(libraries, key):
    lib = abi.KernelLibrary(libraries[key.arch])  # loading touches no GPU
    assert lib.abi_version() == abi.ABI_VERSION
    assert KernelKey.from_json(lib.key_json()) == key


@pytest.mark.parametrize("key", [SM90, SM80], ids=["sm90a", "sm80"])
def test_host_checks_without_a_device(libraries, key):
    lib = abi.KernelLibrary(libraries[key.arch])
    dt = key.signature.dtype_a
    ok = gemm_op.GemmProblem(1000, 1000, 1000, dt, dt, dt, "rcr", 1, key.signature.epilogue)
    status, reason = lib.can_run(gemm_op.make_args(ok, key))
    assert status == abi.OK, reason
    odd_k = gemm_op.GemmProblem(1000, 1000, 1001, dt, dt, dt, "rcr", 1, key.signature.epilogue)
    status, reason = lib.can_run(gemm_op.make_args(odd_k, key))
    assert status == abi.UNSUPPORTED and "multiple of 8" in reason, reason
    args = gemm_op.make_args(ok, key)
    args.num_tensors = 3
    status, reason = lib.can_run(args)
    assert status == abi.INVALID_ARGUMENT and "tensors" in reason
    args = gemm_op.make_args(ok, key)
    args.scalars[2], args.scalars[3] = 1.0, -1.0  # a C caller's inverted clamp (Python refuses it earlier)
    status, reason = lib.can_run(args)
    assert (status, "clamp" in reason) == ((abi.INVALID_ARGUMENT, True) if key.signature.epilogue.activation == "clamp"
                                           else (abi.OK, False))
