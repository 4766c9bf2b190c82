"""LayerNorm kernels: every cpu kernel of layernorm_essential against a float64 reference (random rows of different
means and spreads, outputs poisoned first), the registry's and the CLI's checks of hostile inputs, the analytic
ranking of the cutlass kernels, and (slow, with nvcc) the cutlass kernels compiled with their host-side checks run
without a device."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, build_preselected, compile_keys, toolchain_or_reason
from tiledispatch import abi, selection, validation
from tiledispatch.errors import InvalidInputError, UnsupportedProblemError
from tiledispatch.generator import toolchains
from tiledispatch.generator.kernelset import expand_file
from tiledispatch.ops import layernorm as ln_op
from tiledispatch.ops.layernorm import LayerNormProblem
from tiledispatch.reference import layer_norm as reference
from tiledispatch.spec.dtypes import dtype
from tiledispatch.spec.key import Algorithm, Epilogue, KernelKey, Signature

SET = REPO / "preselected" / "layernorm_essential.yaml"


@pytest.fixture(scope="module")
def reg(tmp_path_factory, kernel_cache):
    return build_preselected(tmp_path_factory, kernel_cache, "layernorm_essential")


def case(rng, rows, cols, dtype, how):
    """x, weight, bias, out and the float64 reference for one case: dense, rows with a stride (a wider buffer),
    in place (out is x), without the affine, with a weight only."""
    p = LayerNormProblem(rows, cols, dtype, dtype, dtype)
    data, _ = validation.layernorm_case(p, rng, 1e-5, affine=how not in ("no_affine",))
    x, w, b, out = data["x"], data["weight"], data["bias"], data["out"]
    if how == "weight_only":
        b = None
    if how == "strided":
        wide = validation.poison(np.empty((rows, cols + 5), dtype=x.dtype))
        wide[:, :cols] = x
        x = wide[:, :cols]
        out = validation.poison(np.empty((rows, cols + 3), dtype=x.dtype))[:, :cols]
    expect = reference(x, w, b, 1e-5)
    if how == "in_place":
        out = x
    return x, w, b, out, expect


@pytest.mark.parametrize("how", ["dense", "strided", "in_place", "no_affine", "weight_only"])
def test_every_cpu_kernel_matches_the_float64_reference(reg, how):
    rng = np.random.default_rng(1)
    kernels = [k for k in reg.kernels if k.key.signature.op == "layernorm"]
    assert {k.key.signature.dtype_a for k in kernels} == {"fp16", "bf16", "fp32"}
    for kern in kernels:
        dtype = kern.key.signature.dtype_a
        for rows, cols in ((1, 1), (5, 3), (37, 96), (3, 1000)):
            x, w, b, out, expect = case(rng, rows, cols, dtype, how)
            got = reg.layer_norm(x, w, b, out, kernel=kern)
            assert got is out
            check = validation.compare(out, expect, kern.key)
            assert check["passed"], (kern.name, rows, cols, how, check)


def test_leading_dims_are_rows_and_repeated_calls_reuse_the_launch(reg):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 4, 96)).astype(np.float32) * 3 + 1
    w, b = rng.standard_normal(96).astype(np.float32), rng.standard_normal(96).astype(np.float32)
    out = np.empty_like(x)
    reg.layer_norm(x, w, b, out, eps=1e-6)
    assert np.abs(out - reference(x, w, b, 1e-6)).max() < 1e-5
    hits = reg.cache_info()["launches"]["hits"]
    x2 = x[::-1].copy()
    reg.layer_norm(x2, w, b, out, eps=1e-6)  # the same shapes: the remembered launch on the new pointers
    assert reg.cache_info()["launches"]["hits"] == hits + 1
    assert np.abs(out - reference(x2, w, b, 1e-6)).max() < 1e-5
    reg.layer_norm(x2, w, b, out, eps=1e-3)  # another eps is another call
    assert np.abs(out - reference(x2, w, b, 1e-3)).max() < 1e-5


def test_hostile_inputs_get_clear_errors(reg):
    x = np.ones((4, 8), np.float32)
    x[:, ::2] = 3
    w = np.ones(8, np.float32)
    out = np.empty_like(x)
    buffer = np.arange(40, dtype=np.float32)
    cases = [
        (lambda: reg.layer_norm(x, np.ones(7, np.float32)), InvalidInputError, "weight has shape [7], expected [8]"),
        (lambda: reg.layer_norm(x, w, np.ones(8, np.float16)), InvalidInputError, "weight has dtype fp32 but bias"),
        (lambda: reg.layer_norm(x[:, ::2]), InvalidInputError, "stride 2: it must be 1"),
        (lambda: reg.layer_norm(np.ones((4, 3, 8), np.float32)[:, ::2]), InvalidInputError, "not one run of rows"),
        (lambda: reg.layer_norm(x, out=np.empty((4, 9), np.float32)), InvalidInputError, "out has shape [4, 9]"),
        (lambda: reg.layer_norm(x, eps=-1.0), InvalidInputError, "eps must be >= 0"),
        (lambda: reg.layer_norm(x, eps=float("nan")), InvalidInputError, "eps must be finite"),
        (lambda: reg.layer_norm(x, eps=True), InvalidInputError, "eps must be a real number"),
        (lambda: reg.layer_norm(np.ones((0, 8), np.float32)), InvalidInputError, "every size must be >= 1"),
        (lambda: reg.layer_norm(np.ones(3)), UnsupportedProblemError, "problem has fp64"),
        (lambda: reg.layer_norm(buffer[:32].reshape(4, 8), out=buffer[2:34].reshape(4, 8)), InvalidInputError,
         "out overlaps x"),
        (lambda: reg.layer_norm("x"), InvalidInputError, "expected a numpy array"),
    ]
    read_only = np.empty_like(x)
    read_only.flags.writeable = False
    cases.append((lambda: reg.layer_norm(x, out=read_only), InvalidInputError, "read-only"))
    for call, error, words in cases:
        with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
            call()
    assert np.isfinite(reg.layer_norm(x, w, out=out, eps=0.0)).all()  # eps 0 is torch's and legal


def test_cli_selects_runs_and_validates_layernorm(reg):
    bundle = str(reg.kernels[0].path.parents[1])
    run = subprocess.run([sys.executable, "-m", "tiledispatch", "run", bundle, "layernorm", "--rows", "300",
                          "--cols", "96", "--dtype", "bf16", "--validate"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout)
    assert result["validation"]["passed"] and result["kernel"].startswith("layernorm_bf16")
    bad = subprocess.run([sys.executable, "-m", "tiledispatch", "run", bundle, "layernorm", "--rows", "0", "--cols",
                          "8", "--dtype", "fp32"], capture_output=True, text=True)
    assert bad.returncode == 2 and "layernorm rows must be an integer >= 1" in bad.stdout


def test_the_ranker_takes_the_narrowest_kernel_that_holds_the_row():
    keys = [e.key for e in expand_file(SET, "cutlass", "sm90a") if e.key.signature.dtype_a == "fp16"]

    def fits(key, cols):
        return key.algorithm.pipeline == "rows_loop" or cols <= key.algorithm.tile[1]

    for rows, cols, want in ((100352, 96, ("rows", 128, 8)), (1568, 768, ("rows", 1024, 8)),
                             (4096, 4096, ("rows", 4096, 8)), (7, 1000, ("rows", 1024, 8)),
                             (64, 10000, ("rows_loop", 256, 8))):
        p = LayerNormProblem(rows, cols, "fp16", "fp16", "fp16")
        running = [k for k in keys if fits(k, cols)]
        best = min(running, key=lambda k: (selection.estimated_cost(p, k), k.name))
        assert (best.algorithm.pipeline, best.algorithm.tile[1], best.algorithm.mma[1]) == want, (rows, cols, best.name)


def test_keys_and_rules():
    key = KernelKey(Signature("layernorm", "fp16", "fp16", "fp16", "fp32", "rows"), Algorithm((16, 1, 1), "rows"),
                    "cpu", "x86v3")
    assert key.name.startswith("layernorm_fp16xfp16xfp16xfp32_rows_identity_cpu")
    with pytest.raises(ValueError, match="layernorm keys take no epilogue"):
        Signature("layernorm", "fp16", "fp16", "fp16", "fp32", "rows", epilogue=Epilogue("relu"))
    with pytest.raises(ValueError, match="layout"):
        Signature("layernorm", "fp16", "fp16", "fp16", "fp32", "rcr")


cutlass = toolchains.get("cutlass")
TOOLCHAIN, WHY = toolchain_or_reason(cutlass)


def _cutlass_key(pipeline, tile, mma) -> KernelKey:
    return KernelKey(Signature("layernorm", "fp16", "fp16", "fp16", "fp32", "rows"),
                     Algorithm(tile, pipeline, (4, 1, 1), mma, "data_parallel"), "cutlass", "sm90a")


@pytest.mark.slow
@pytest.mark.skipif(TOOLCHAIN is None, reason=f"cutlass toolchain missing: {WHY}")
def test_cutlass_kernels_compile_and_check_their_arguments_without_a_device(tmp_path):
    held = _cutlass_key("rows", (32, 128, 1), (4, 8, 1))
    loop = _cutlass_key("rows_loop", (4, 32, 1), (32, 1, 1))
    built = compile_keys(cutlass, TOOLCHAIN, (held, loop), tmp_path, timeout=300)
    libs = {key: abi.KernelLibrary(lib) for key, (lib, _) in built.items()}
    for key, lib in libs.items():
        assert KernelKey.from_json(lib.key_json()) == key

    def can_run(key, rows, cols, **changes):
        args = ln_op.make_args(LayerNormProblem(rows, cols, "fp16", "fp16", "fp16"), key)
        for name, value in changes.items():
            slot, field = name.split("_", 1)
            setattr(args.tensors[int(slot[1:])], field, value)
        return libs[key].can_run(args)

    assert can_run(held, 1000, 96)[0] == abi.OK
    status, why = can_run(held, 1000, 136)
    assert status == abi.UNSUPPORTED and "at most 128" in why
    status, why = can_run(held, 1000, 100)
    assert status == abi.UNSUPPORTED and "multiples of the kernel's 8-element accesses" in why
    status, why = can_run(held, 10, 96, t0_data=ln_op.DUMMY_PTR + 2)
    assert status == abi.UNSUPPORTED and "x is not aligned" in why
    assert can_run(loop, 1000, 100001)[0] == abi.OK and can_run(loop, 3, 7, t0_data=ln_op.DUMMY_PTR + 2)[0] == abi.OK
    status, why = can_run(loop, 3, 7, t3_dtype=dtype("fp32").code)
    assert status == abi.INVALID_ARGUMENT and "y has dtype" in why
