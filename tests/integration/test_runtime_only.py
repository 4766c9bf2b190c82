"""The runtime needs numpy alone: with jinja2, SCons, PyYAML and the generator package blocked, every runtime module
imports, a cpu bundle loads and computes a GEMM and a convolution correctly, and the CLI lists, selects and runs.
Layers are one-way: the generator may import the runtime, never the reverse."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap

from conftest import REPO, build_cpu_bundle

SET = """\
schema: 1
name: runtime_only
groups:
  - backend: cpu
    op: gemm
    dtype: fp32
    layout: rcr
    pipeline: packed
    tile: [48, 128, 128]
    mma: [6, 32, 1]
  - backend: cpu
    op: conv
    direction: fwd
    spatial_dims: 2
    dtype: fp32
    layout: nhwgc
    pipeline: packed
    tile: [48, 64, 64]
    mma: [6, 16, 1]
"""

# a sys.meta_path finder that refuses the generator's dependencies and the generator itself
BLOCKER = """
import sys

class _Blocked:
    BLOCKED = ("jinja2", "SCons", "yaml", "tiledispatch.generator")

    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in self.BLOCKED):
            raise ImportError(f"blocked for this test: {name}")
        return None

sys.meta_path.insert(0, _Blocked())
"""

PROGRAM = BLOCKER + """
import importlib, json, pkgutil
import numpy as np
import tiledispatch as td
from tiledispatch import cli, reference

skipped = ("tiledispatch.generator", "tiledispatch.torch")  # the generator; torch integration needs torch
for info in pkgutil.walk_packages(td.__path__, "tiledispatch."):
    name = info.name
    if name.startswith(skipped) or name.endswith((".toolchain", ".__main__")):  # toolchains: the generator's;
        continue                                                                  # __main__ runs the CLI
    importlib.import_module(name)

reg = td.load(sys.argv[1])
rng = np.random.default_rng(7)
a = rng.uniform(-1, 1, (70, 45)).astype(np.float32)
b = rng.uniform(-1, 1, (45, 33)).astype(np.float32)
out = np.full((70, 33), np.nan, np.float32)
reg.gemm(a, b.T.copy().T, out)
ref = a.astype(np.float64) @ b.astype(np.float64)
gemm_err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))

x = rng.uniform(-1, 1, (2, 9, 9, 1, 8)).astype(np.float32)      # N, H, W, G, C
w = rng.uniform(-1, 1, (1, 16, 3, 3, 8)).astype(np.float32)     # G, K, R, S, C
y = reg.conv_fwd(x, w, padding=1)
ref = reference.conv_fwd(x, w, (1, 1), (1, 1), (1, 1), (1, 1))
conv_err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
assert not any(m == "tiledispatch.generator" or m.startswith("tiledispatch.generator.") for m in sys.modules)
assert not any(m.split(".")[0] in ("jinja2", "SCons", "yaml") for m in sys.modules)
print(json.dumps({"gemm": gemm_err, "conv": conv_err}))
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "runtime"), "TD_TUNING_CACHE": "none"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)


def test_the_blocker_blocks():
    proc = _run(BLOCKER + "import yaml\n")
    assert proc.returncode != 0 and "blocked for this test: yaml" in proc.stderr


def test_runtime_loads_and_runs_a_cpu_bundle_without_the_generator(tmp_path):
    build_cpu_bundle(tmp_path, "runtime_only", SET)
    proc = _run(PROGRAM, str(tmp_path / "runtime_only"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert errors["gemm"] < 1e-5 and errors["conv"] < 1e-5, errors


def test_cli_runs_without_the_generator(tmp_path):
    build_cpu_bundle(tmp_path, "runtime_only", SET)
    bundle = str(tmp_path / "runtime_only")
    main = BLOCKER + "from tiledispatch.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    listed = _run(main, "list", bundle)
    assert listed.returncode == 0 and "gemm_fp32" in listed.stdout, listed.stdout + listed.stderr
    selected = _run(main, "select", bundle, "gemm", "--m", "64", "--n", "32", "--k", "48", "--dtype", "fp32")
    assert selected.returncode == 0 and "gemm_fp32" in selected.stdout, selected.stdout + selected.stderr
    ran = _run(main, "run", bundle, "gemm", "--m", "64", "--n", "32", "--k", "48", "--dtype", "fp32", "--validate")
    assert ran.returncode == 0 and '"passed": true' in ran.stdout, ran.stdout + ran.stderr


def test_no_runtime_module_imports_the_generator():
    """Static check of the one-way layering: outside tiledispatch/generator and the backends' toolchain modules,
    no module names tiledispatch.generator, jinja2, SCons or yaml in an import."""
    pkg = REPO / "runtime" / "tiledispatch"
    offenders = []
    for path in sorted([*pkg.rglob("*.py"), *(REPO / "templates").rglob("*.py")]):
        rel = path.relative_to(REPO)
        if "generator" in rel.parts or path.name == "toolchain.py" or "families" in rel.parts:
            continue  # (families/ is templates/, walked above)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                names = [base] + [f"{base}.{a.name}" if base else a.name for a in node.names]
                if node.level and any(a.name == "generator" for a in node.names):
                    names.append("tiledispatch.generator")
            for n in names:
                if n.split(".")[0] in ("jinja2", "SCons", "yaml") or "generator" in n.split("."):
                    offenders.append(f"{rel}:{node.lineno} imports {n}")
    assert offenders == [], "\n".join(offenders)
