"""The README's Python examples run as written and give finite, correct results.

Every ```python block of README.md that loads a bundle the cpu backend can build runs as it stands, in a
directory whose build/ holds the bundles it loads (built once, with `scons kernels=<set>` as the README says);
a block that loads only GPU bundles is left out. What each block computes is then checked against numpy in
float64 with the cpu rules' tolerance, and every result must be finite (fp16 has a small range).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import REPO, SESSION, scons
from test_fuzz_smoke import TOLERANCE, conv_ref
from tiledispatch.generator import kernelset

BLOCKS = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M)
LOAD = re.compile(r"""td\.load\(["']build/([\w+]+)["']""")


def cpu_blocks() -> dict[str, str]:
    """{set name: block} for the blocks whose bundles have cpu kernels (one set per block)."""
    found = {}
    for block in BLOCKS:
        names = LOAD.findall(block)
        if names and all(any(t.startswith("cpu/") for t in kernelset.targets(kernelset.find(n))) for n in names):
            assert len(set(names)) == 1, f"one bundle per README example, got {names}:\n{block}"
            found[names[0]] = block
    return found


CPU_BLOCKS = cpu_blocks()


@pytest.fixture(scope="module")
def readme_dir(tmp_path_factory):
    """A working directory whose build/ receives the examples' bundles, each built on first use."""
    return tmp_path_factory.mktemp("readme")


def run_block(name: str, where, monkeypatch) -> dict:
    """Build the block's bundle (as `scons kernels=<name>` does: build/<name>) and run the block there.
    The conv example continues the first one, which imports numpy as np and tiledispatch as td."""
    if not (where / "build" / name / "manifest.json").exists():
        scons(REPO, f"kernels={name}", "backend=cpu", f"build_dir={where / 'build'}",
              f"cache_dir={SESSION.get('cache_dir', where / 'cache')}")
    monkeypatch.chdir(where)
    namespace = {"np": np, "td": __import__("tiledispatch")}
    exec(compile(CPU_BLOCKS[name], f"README.md ({name} example)", "exec"), namespace)
    return namespace


def assert_close(got, want: np.ndarray, what: str, dtype: str = "fp16"):
    got = np.asarray(got).astype(np.float64)
    bad = int((~np.isfinite(got)).sum())
    assert bad == 0, f"{what}: {bad} of {got.size} values are not finite"
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel <= TOLERANCE[dtype], f"{what}: relative error {rel:.3g} > {TOLERANCE[dtype]}"


def test_the_readme_has_cpu_examples():
    assert set(CPU_BLOCKS) == {"fp16_rcr_essential", "conv_fp16_all_essential"}, sorted(CPU_BLOCKS)


def test_gemm_example(readme_dir, monkeypatch):
    ns = run_block("fp16_rcr_essential", readme_dir, monkeypatch)
    x, w, b = (ns[v].astype(np.float64) for v in ("x", "w", "b"))
    assert_close(ns["y"], np.maximum(x @ w.T + b, 0), "y = relu(x @ w.T + b)")
    reg, problem = ns["reg"], ns["problem"]
    assert reg.supports(problem) and reg.select(problem) in reg.candidates(problem)


@pytest.mark.slow  # conv_fp16_all_essential: 27 kernels to build
def test_conv_example(readme_dir, monkeypatch):
    ns = run_block("conv_fp16_all_essential", readme_dir, monkeypatch)
    x, w, y = (ns[v].astype(np.float64) for v in ("x", "w", "y"))
    geo = dict(stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1))
    assert_close(ns["y"], conv_ref("fwd", x, w, y, **geo), "y = conv_fwd(x, w)")
    # the backward examples take the (fp16) y as dY
    assert_close(ns["dx"], conv_ref("bwd_data", x, w, y, **geo), "dx = conv_bwd_data(y, w)")
    assert_close(ns["dw"], conv_ref("bwd_weight", x, w, y, **geo), "dw = conv_bwd_weight(x, y)")
