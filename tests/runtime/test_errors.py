"""Bad input gets a clear error of its own type; a bad bundle is refused at load."""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import tiledispatch as td
from tiledispatch import abi
from tiledispatch.ops import gemm as gemm_op


@pytest.fixture(scope="module")
def registry(gemm_bundle):
    return td.load(gemm_bundle)


def f16(*shape):
    return np.random.default_rng(0).uniform(-1, 1, shape).astype(np.float16)


def test_wrong_dtype(registry):
    with pytest.raises(td.InvalidInputError, match="A has dtype fp32 but B has fp16"):
        registry.gemm(f16(8, 4).astype(np.float32), f16(5, 4).T)
    with pytest.raises(td.InvalidInputError, match="C has dtype fp32, expected fp16"):
        registry.gemm(f16(8, 4), f16(5, 4).T, c=np.zeros((8, 5), np.float32), beta=1.0)
    with pytest.raises(td.UnsupportedProblemError, match="kernel takes A as .*, problem has fp64"):
        registry.gemm(np.ones((8, 4)), np.ones((4, 5)))
    with pytest.raises(td.InvalidInputError, match="complex128 has no tiledispatch equivalent"):
        registry.gemm(np.ones((8, 4), complex), np.ones((4, 5), complex))


def test_shape_mismatch(registry):
    with pytest.raises(td.InvalidInputError, match="inner dimensions differ"):
        registry.gemm(f16(8, 4), f16(5, 5).T)
    with pytest.raises(td.InvalidInputError, match=r"out has shape \(8, 6\), expected \[8, 5\]"):
        registry.gemm(f16(8, 4), f16(5, 4).T, np.empty((8, 6), np.float16))
    with pytest.raises(td.InvalidInputError, match=r"bias has shape"):
        registry.gemm(f16(8, 4), f16(5, 4).T, bias=f16(6))
    with pytest.raises(td.InvalidInputError, match="beta != 0 needs c"):
        registry.gemm(f16(8, 4), f16(5, 4).T, beta=1.0)


def test_unsupported_layout_and_epilogue(registry):
    b_strided = f16(4, 10)[:, ::2]  # no unit stride at all
    with pytest.raises(td.InvalidInputError, match="no unit stride"):
        registry.gemm(f16(8, 4), b_strided)
    fp32 = np.float32
    a, b = f16(8, 4).astype(fp32), np.asfortranarray(f16(4, 5).astype(fp32)).T.copy().T  # fp32 B column-major
    with pytest.raises(td.UnsupportedProblemError, match="no kernel can run gemm .* epilogue tanh"):
        registry.gemm(a, b, activation="tanh")
    with pytest.raises(td.UnsupportedProblemError, match="takes B column-major, problem has it row-major"):
        registry.gemm(f16(8, 4).astype(fp32), f16(4, 5).astype(fp32))


def test_the_kernel_checks_its_own_arguments(registry):
    """The C side refuses inconsistent arguments even when the Python checks are bypassed."""
    kern = next(k for k in registry.kernels if k.key.signature.layout == "rcr" and k.key.signature.dtype_a == "fp16")
    sig = kern.key.signature
    p = gemm_op.GemmProblem(8, 5, 4, "fp16", "fp16", "fp16", "rcr", 1, sig.epilogue)
    args = gemm_op.make_args(p, kern.key)
    args.tensors[1].dtype = 1  # claim B is fp32
    status, reason = kern.library.can_run(args)
    assert status == abi.INVALID_ARGUMENT and "B has dtype fp32, kernel expects fp16" in reason
    args = gemm_op.make_args(p, kern.key)
    args.tensors[1].stride[1], args.tensors[1].stride[2] = 5, 1  # B row-major
    status, reason = kern.library.run(args)
    assert status == abi.UNSUPPORTED and "needs B column-major" in reason


@pytest.fixture
def bundle_copy(gemm_bundle, tmp_path):
    dest = tmp_path / "bundle"
    shutil.copytree(gemm_bundle, dest)
    return dest


def test_tampered_kernel_is_refused(bundle_copy):
    so = sorted((bundle_copy / "kernels").glob("*.so"))[0]
    with open(so, "ab") as f:
        f.write(b"\0")
    with pytest.raises(td.BundleError, match="was changed after the build"):
        td.load(bundle_copy)


def test_swapped_kernel_is_refused_by_its_embedded_key(bundle_copy):
    manifest_path = bundle_copy / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    first, second = manifest["kernels"][0], manifest["kernels"][1]
    shutil.copyfile(bundle_copy / second["file"], bundle_copy / first["file"])
    first["sha256"] = second["sha256"]  # a consistent manifest, but the file is another kernel
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(td.BundleError, match="the library reports key"):
        td.load(bundle_copy)


def test_missing_manifest_and_missing_file(bundle_copy, tmp_path):
    with pytest.raises(td.BundleError, match="manifest.json is missing"):
        td.load(tmp_path)
    next((bundle_copy / "kernels").glob("*.so")).unlink()
    with pytest.raises(td.BundleError, match="is missing"):
        td.load(bundle_copy)


def cli(*args):
    proc = subprocess.run([sys.executable, "-m", "tiledispatch", *args], capture_output=True, text=True)
    return proc.returncode, json.loads(proc.stdout)


def test_cli_run_validate_select_list_and_errors(gemm_bundle):
    code, out = cli("run", str(gemm_bundle), "gemm", "--m", "1000", "--n", "512", "--k", "256", "--dtype", "fp16",
                    "--layout", "rcr", "--validate")
    assert code == 0 and out["status"] == "success" and out["validation"]["passed"]
    assert out["execution"]["time_ms"] > 0 and out["kernel"].startswith("gemm_fp16")
    code, out = cli("select", str(gemm_bundle), "gemm", "--m", "7", "--n", "64", "--k", "9", "--dtype", "bf16",
                    "--layout", "rcr")
    assert code == 0 and out["selected"] == out["ranked"][0]["kernel"] and "bf16" in out["selected"]
    assert all("bf16" not in name for name in out["rejected"])
    code, out = cli("list", str(gemm_bundle))
    assert code == 0 and len(out["kernels"]) >= 20
    code, out = cli("run", str(gemm_bundle), "gemm", "--m", "4", "--n", "4", "--k", "4")
    assert code == 2 and out["error"] == "InvalidInputError" and "give --dtype" in out["message"]
    code, out = cli("bench", str(gemm_bundle), "gemm", "--m", "64", "--n", "64", "--k", "64", "--dtype", "fp32",
                    "--layout", "rcr", "--repeat", "2")
    assert code == 0 and out["results"] and sum(r["selected"] for r in out["results"]) == 1


def test_run_takes_a_problem_and_a_dict_of_tensors(registry):
    a, w = f16(9, 4), f16(5, 4)
    out = np.full((9, 5), np.nan, np.float16)
    problem = td.GemmProblem(9, 5, 4, "fp16", "fp16", "fp16", "rcr")
    kernel = registry.run(problem, {"a": a, "b": w.T, "out": out})
    assert kernel.key.signature.layout == "rcr"
    np.testing.assert_allclose(out.astype(np.float32), a.astype(np.float32) @ w.T.astype(np.float32), rtol=2e-2, atol=2e-2)
    with pytest.raises(td.InvalidInputError, match="the tensors describe gemm m=9 n=5 k=4 .* but the problem is gemm m=9 n=6"):
        registry.run(td.GemmProblem(9, 6, 4, "fp16", "fp16", "fp16", "rcr"), {"a": a, "b": w.T, "out": out})
