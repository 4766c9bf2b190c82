"""The kernel families (templates/, the package tiledispatch.families through runtime/tiledispatch/families) are
importable however tiledispatch is installed: a built wheel carries every family module, template and rules file,
and its runtime and generator find them there (the checkout, the SCons build and the editable install import
runtime/ directly: the other tests)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import BUILD_INPUTS, REPO, copy_repo

PROGRAM = """
import json, sys
from pathlib import Path
import tiledispatch
from tiledispatch import backends
from tiledispatch.generator import codegen, deps, rules
from tiledispatch.spec.key import parse_kernel_name

site = Path(sys.argv[1]).resolve()
out = {"package": str(Path(tiledispatch.__file__).resolve()), "families": {}, "rendered": {}}
for name, backend in backends.all_backends().items():
    out["families"][name] = [f.name for f in backend.families]
    assert backend.path.resolve().is_relative_to(site), backend.path
    assert all(p.resolve().is_relative_to(site) for p in rules.rules_files(name))
for name in sys.argv[2:]:
    key = parse_kernel_name(name)
    text = codegen.render(key)
    assert all(p.resolve().is_relative_to(site) for p in deps.render_inputs(key) + deps.compile_inputs(key))
    out["rendered"][name] = key.to_json() in text
    out.setdefault("headers", []).extend(p.name for p in deps.compile_inputs(key) if p.suffix in (".h", ".cuh"))
print(json.dumps(out))
"""


def test_a_built_wheel_carries_the_families(tmp_path):
    if shutil.which("pip") is None and subprocess.run([sys.executable, "-m", "pip", "--version"]).returncode:
        pytest.skip("no pip")
    src = copy_repo(tmp_path / "src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    assert "runtime" in BUILD_INPUTS
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              *map(str, wheels.glob("*.whl"))], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    golden = json.loads((REPO / "tests" / "data" / "expansion_golden.json").read_text())["keys"]
    names = [next(n for n in golden if f"_{b}_" in n) for b in ("cpu", "cutlass")]
    env = dict(os.environ)
    # -S: no site-packages, so neither the editable install nor a checkout can stand in for the wheel; numpy,
    # jinja2 and yaml come from their own directories
    deps_path = [os.path.dirname(os.path.dirname(m.__file__)) for m in (__import__("numpy"), __import__("jinja2"),
                                                                        __import__("yaml"), __import__("ml_dtypes"))]
    env["PYTHONPATH"] = os.pathsep.join([str(site), *dict.fromkeys(deps_path)])
    proc = subprocess.run([sys.executable, "-S", "-c", PROGRAM, str(site), *names], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["package"].startswith(str(site.resolve()))
    assert out["families"]["cpu"] == ["conv_direct", "conv_packed", "gemm", "layernorm", "maxpool"]
    assert set(out["families"]["cutlass"]) == {"conv_direct", "conv_implicit_gemm", "conv_tma_ws", "gemm_sm80",
                                               "gemm_sm90", "layernorm", "maxpool"}
    assert all(out["rendered"].values()) and len(out["rendered"]) == 2
    # the plain C++ headers of the folders and of the ABI came along (a missing one would not be listed)
    assert {"tiledispatch_abi.h", "tiledispatch_kernel.h", "cpu_includes.h", "cpu_common.h"} <= set(out["headers"])
