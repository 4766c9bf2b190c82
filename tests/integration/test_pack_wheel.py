"""Wheels of packs (wheel.py): a pip-installable wheel that carries a pack and registers it, so that
td.load(NAME) finds it once installed."""
from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile

import pytest

import tiledispatch as td
from tiledispatch import loader, wheel
from test_pack import REPO, bundles, cache, check_gemm, good_pack  # noqa: F401


@pytest.fixture(scope="module")
def built_wheel(good_pack, tmp_path_factory):  # noqa: F811
    return wheel.build(good_pack, tmp_path_factory.mktemp("wheel"), name="demo_kernels")


def test_wheel_contents_and_record(built_wheel):
    assert built_wheel.name.startswith("tiledispatch_pack_demo_kernels-1.0.0-py3-none-")
    with zipfile.ZipFile(built_wheel) as zf:
        names = zf.namelist()
        info = "tiledispatch_pack_demo_kernels-1.0.0.dist-info"
        assert {f"{info}/METADATA", f"{info}/WHEEL", f"{info}/RECORD", f"{info}/entry_points.txt",
                "tiledispatch_pack_demo_kernels/__init__.py", "tiledispatch_pack_demo_kernels/demo_kernels.tdpack"} \
            == set(names)
        assert zf.read(f"{info}/entry_points.txt").decode() == \
            "[tiledispatch.packs]\ndemo_kernels = tiledispatch_pack_demo_kernels:PACK\n"
        for line in zf.read(f"{info}/RECORD").decode().splitlines():
            path, digest, size = line.split(",")
            if path.endswith("RECORD"):
                continue
            data = zf.read(path)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data)


def test_installed_pack_is_found_by_name(built_wheel, tmp_path, cache, monkeypatch):  # noqa: F811
    site = tmp_path / "site"
    with zipfile.ZipFile(built_wheel) as zf:  # what an installer does with a pure wheel: unpack it on the path
        zf.extractall(site)
    monkeypatch.syspath_prepend(str(site))
    assert loader.installed_pack("demo_kernels") == site / "tiledispatch_pack_demo_kernels" / "demo_kernels.tdpack"
    reg = td.load("demo_kernels")
    check_gemm(reg)
    with pytest.raises(td.BundleError, match=r"no installed pack of that name \(installed packs: .*demo_kernels"):
        td.load("demo_kernel")


def test_bad_names_are_refused(good_pack, tmp_path):  # noqa: F811
    with pytest.raises(td.BundleError, match="must start with a letter or digit"):
        wheel.build(good_pack, tmp_path, name="../x")


@pytest.mark.slow
def test_pip_installs_the_wheel_into_a_fresh_venv(built_wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-index", "--no-deps", "-q", str(built_wheel)],
                   check=True, capture_output=True)
    script = (
        "import numpy as np, tiledispatch as td\n"
        "reg = td.load('demo_kernels')\n"
        "rng = np.random.default_rng(3)\n"
        "a = rng.standard_normal((33, 17)).astype(np.float32); w = rng.standard_normal((21, 17)).astype(np.float32)\n"
        "out = np.full((33, 21), np.nan, np.float32)\n"
        "reg.gemm(a, w.T, out)\n"
        "ref = a.astype(np.float64) @ w.T.astype(np.float64)\n"
        "err = np.linalg.norm(out - ref) / np.linalg.norm(ref)\n"
        "assert err < 1e-5, err\n"
        "print(reg.summary)\n"
    )
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "PYTHONPATH": str(REPO / "runtime"),
           "TD_PACK_CACHE": str(tmp_path / "cache"), "TD_TUNING_CACHE": "none", "HOME": str(tmp_path)}
    proc = subprocess.run([str(python), "-c", script], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo_kernels.tdpack: using cpu/" in proc.stdout
