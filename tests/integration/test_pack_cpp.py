"""The C++ loader (runtime/cpp): built with g++ (and, slow tier, with CMake + pkg-config), run against a cpu
bundle and a bundle of an extracted pack, compared with the Python runtime on the same inputs; tampered
bundles refused as the Python runtime refuses them."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tiledispatch as td
from conftest import REPO
from tiledispatch import abi, pack
from test_pack import bundles, cache, cli  # noqa: F401

CPP = REPO / "runtime" / "cpp"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("g++") is None
                                or not Path("/usr/include/openssl/evp.h").exists(),
                                reason="needs Linux, g++ and OpenSSL's headers (libssl-dev)")


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cpp") / "tiledispatch_example"
    subprocess.run(["g++", "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{CPP}", f"-I{abi.INCLUDE_DIR}",
                    str(CPP / "tiledispatch_loader.cpp"), str(CPP / "example.cpp"), "-o", str(out), "-lcrypto",
                    "-ldl"], check=True, capture_output=True)
    return out


def run_example(example: Path, bundle_dir: Path, out: Path, m=45, n=38, k=27, kernel=None, trust=None):
    args = [str(example)] + (["--trust", str(trust)] if trust else []) + [str(bundle_dir), str(m), str(n), str(k),
                                                                          str(out)] + ([kernel] if kernel else [])
    return subprocess.run(args, capture_output=True, text=True)


def check_against_python(bundle_dir: Path, out: Path, report: dict, m=45, n=38, k=27) -> None:
    raw = np.fromfile(out, dtype=np.float32)
    a = raw[:m * k].reshape(m, k)
    b_cols = raw[m * k:m * k + k * n].reshape(n, k)  # layout rcr: B column-major, i.e. stored as [N, K]
    d = raw[m * k + k * n:].reshape(m, n)
    ref = a.astype(np.float64) @ b_cols.T.astype(np.float64)
    assert np.linalg.norm(d - ref) / np.linalg.norm(ref) < 1e-5
    py = td.load(bundle_dir).gemm(a, b_cols.T, kernel=report["kernel"])
    np.testing.assert_allclose(d, py, rtol=1e-6, atol=1e-6)  # the same kernel on the same inputs


def test_cpp_loads_selects_and_runs_like_python(example, bundles, tmp_path):  # noqa: F811
    proc = run_example(example, bundles["native"], tmp_path / "out.bin")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["backend"] == "cpu" and report["kernels"] == 2 and report["layout"] == "rcr"
    assert report["opened"] == 1  # first fit opened the first kernel only
    reg = td.load(bundles["native"])
    problem = td.GemmProblem(45, 38, 27, "fp32", "fp32", "fp32", "rcr")
    assert report["kernel"] == reg.select(problem, ranker="first_fit").name
    check_against_python(bundles["native"], tmp_path / "out.bin", report)
    other = sorted(k.name for k in reg.kernels)[-1]
    named = run_example(example, bundles["native"], tmp_path / "named.bin", kernel=other)
    assert named.returncode == 0 and json.loads(named.stdout)["kernel"] == other, named.stderr
    check_against_python(bundles["native"], tmp_path / "named.bin", json.loads(named.stdout))


def extract(tmp_path: Path, packed: Path) -> dict:
    env = {"TD_PACK_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO / "runtime")}
    code, extracted = cli("extract", packed, env=env)
    assert code == 0, extracted
    return extracted


def test_cpp_runs_a_bundle_of_an_extracted_pack(example, bundles, tmp_path):  # noqa: F811
    pack.create([bundles["native"], bundles["sm90a"]], tmp_path / "p.tdpack")
    extracted = extract(tmp_path, tmp_path / "p.tdpack")
    bundle_dir = Path(extracted["bundles"][0]["dir"])
    proc = run_example(example, bundle_dir, tmp_path / "out.bin")  # a bundle directory of the pack
    assert proc.returncode == 0, proc.stderr
    check_against_python(bundle_dir, tmp_path / "out.bin", json.loads(proc.stdout))
    proc = run_example(example, Path(extracted["cache"]), tmp_path / "pack.bin")  # the pack: its cpu bundle
    assert proc.returncode == 0, proc.stderr
    check_against_python(bundle_dir, tmp_path / "pack.bin", json.loads(proc.stdout))
    manifest = bundle_dir / "manifest.json"  # changed after extraction: refused through the pack's digest
    os.chmod(manifest, 0o644)
    manifest.write_text(manifest.read_text().replace('"created"', '"created" ', 1))
    proc = run_example(example, Path(extracted["cache"]), tmp_path / "pack.bin")
    assert proc.returncode == 1 and "changed after extraction" in proc.stderr, proc.stderr


def test_cpp_checks_a_packs_signature(example, bundles, tmp_path):  # noqa: F811
    pytest.importorskip("cryptography")
    from tiledispatch import signing

    private, public, _ = signing.keygen(tmp_path / "key")
    _, other, _ = signing.keygen(tmp_path / "other")
    pack.create([bundles["native"]], tmp_path / "signed.tdpack", sign_key=private)
    # another manifest (the same one, signed or not, is the same cache entry, with the signature it was given)
    pack.create([bundles["native"], bundles["sm80"]], tmp_path / "unsigned.tdpack")
    signed = Path(extract(tmp_path, tmp_path / "signed.tdpack")["cache"])
    unsigned = Path(extract(tmp_path, tmp_path / "unsigned.tdpack")["cache"])
    proc = run_example(example, signed, tmp_path / "out.bin", trust=public)
    assert proc.returncode == 0, proc.stderr
    check_against_python(bundles["native"], tmp_path / "out.bin", json.loads(proc.stdout))
    proc = run_example(example, signed, tmp_path / "out.bin", trust=other)
    assert proc.returncode == 1 and "not a valid signature of tdpack.json by the trusted key" in proc.stderr
    proc = run_example(example, unsigned, tmp_path / "out.bin", trust=public)
    assert proc.returncode == 1 and "the pack is not signed" in proc.stderr, proc.stderr


@pytest.fixture
def bundle_copy(bundles, tmp_path):  # noqa: F811
    dest = tmp_path / "bundle"
    shutil.copytree(bundles["native"], dest)
    return dest


def first_kernel_file(bundle_dir: Path) -> Path:
    return bundle_dir / json.loads((bundle_dir / "manifest.json").read_text())["kernels"][0]["file"]


def test_cpp_refuses_a_changed_library(example, bundle_copy, tmp_path):
    with open(first_kernel_file(bundle_copy), "ab") as f:
        f.write(b"\0")
    proc = run_example(example, bundle_copy, tmp_path / "out.bin")
    assert proc.returncode == 1 and "was changed after the build" in proc.stderr


@pytest.mark.parametrize("keep", [100, 5000, -64])
def test_cpp_refuses_a_truncated_library_before_loading_it(example, bundle_copy, tmp_path, keep):
    """A truncated file whose sha256 was edited into the manifest: the ELF checks refuse it, as Python's do."""
    path = bundle_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    entry = manifest["kernels"][0]
    lib = bundle_copy / entry["file"]
    lib.write_bytes(lib.read_bytes()[:keep])
    entry["sha256"] = hashlib.sha256(lib.read_bytes()).hexdigest()
    path.write_text(json.dumps(manifest))
    proc = run_example(example, bundle_copy, tmp_path / "out.bin", kernel=entry["name"])
    assert proc.returncode == 1 and "not a loadable kernel library" in proc.stderr, proc.stderr
    with pytest.raises(td.BundleError, match="not a loadable kernel library"):
        td.load(bundle_copy)


def test_cpp_refuses_another_kernels_library(example, bundle_copy, tmp_path):
    path = bundle_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    first, second = manifest["kernels"][0], manifest["kernels"][1]
    shutil.copyfile(bundle_copy / second["file"], bundle_copy / first["file"])
    first["sha256"] = hashlib.sha256((bundle_copy / second["file"]).read_bytes()).hexdigest()
    path.write_text(json.dumps(manifest))
    proc = run_example(example, bundle_copy, tmp_path / "out.bin", kernel=first["name"])
    assert proc.returncode == 1 and "the library reports key" in proc.stderr, proc.stderr


def test_cpp_refuses_links_and_paths_outside_the_bundle(example, bundle_copy, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(bundle_copy / "kernels", outside)
    shutil.rmtree(bundle_copy / "kernels")
    (bundle_copy / "kernels").symlink_to(outside)
    proc = run_example(example, bundle_copy, tmp_path / "out.bin")
    assert proc.returncode == 1 and "symbolic link" in proc.stderr, proc.stderr
    (bundle_copy / "kernels").unlink()
    shutil.copytree(outside, bundle_copy / "kernels")
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    manifest["kernels"][0]["file"] = "../outside/" + Path(manifest["kernels"][0]["file"]).name
    (bundle_copy / "manifest.json").write_text(json.dumps(manifest))
    proc = run_example(example, bundle_copy, tmp_path / "out.bin")
    assert proc.returncode == 1 and "the file must be kernels/" in proc.stderr, proc.stderr


def test_cpp_reports_a_malformed_manifest(example, bundle_copy, tmp_path):
    (bundle_copy / "manifest.json").write_text('{"schema": 1, "backend": "cpu", "arch": ')
    proc = run_example(example, bundle_copy, tmp_path / "out.bin")
    assert proc.returncode == 1 and "not valid JSON" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("pkg-config") is None,
                    reason="needs cmake and pkg-config")
def test_cmake_build_install_and_pkg_config(bundles, tmp_path):  # noqa: F811
    build, prefix = tmp_path / "build", tmp_path / "prefix"
    for cmd in (["cmake", "-S", str(CPP), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_INSTALL_PREFIX={prefix}"], ["cmake", "--build", str(build), "-j", "2"],
                ["cmake", "--install", str(build)]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    env = {**os.environ, "PKG_CONFIG_PATH": str(next(prefix.rglob("pkgconfig")))}
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "tiledispatch_loader"], capture_output=True, text=True,
                           env=env, check=True).stdout.split()
    user = tmp_path / "user"
    subprocess.run(["g++", "-std=c++17", str(CPP / "example.cpp"), "-o", str(user), *flags], check=True,
                   capture_output=True)
    for program in (user, prefix / "bin" / "tiledispatch_example"):
        proc = run_example(program, bundles["native"], tmp_path / "out.bin")
        assert proc.returncode == 0, proc.stderr
        check_against_python(bundles["native"], tmp_path / "out.bin", json.loads(proc.stdout))
