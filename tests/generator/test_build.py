"""The SCons build: bundle contents, incremental rebuilds, CacheDir, progress and failure reports."""
import json

import pytest

from conftest import compiled_names, copy_repo, scons, summary

SET_BODY = """\
schema: 1
name: mini
groups:
  - backend: cpu
    arch: x86v4
    op: gemm
    dtype: fp32
    layout: rcr
    pipeline: packed
    tile: [48, 128, 128]
    mma: [6, 32, 1]
    epilogue:
      - {activation: identity}
      - {activation: relu}
      - {activation: silu, bias: true}
"""


@pytest.fixture
def repo(tmp_path):
    root = copy_repo(tmp_path / "repo")
    (root / "kernel_specs" / "mini.yaml").write_text(SET_BODY)
    return root


def build(root, build_dir="build", cache="cache", *extra, check=True):
    return scons(root, "kernels=mini", "backend=cpu", "arch=x86v4", f"build_dir={root / build_dir}",
                 f"cache_dir={root / cache}", *extra, check=check)


def test_build_incremental_and_cached(repo):
    first = build(repo)
    assert summary(first) == {"total": 3, "compiled": 3, "cached": 0, "up_to_date": 0, "failed": 0}
    assert "[3/3] compiled" in first.stdout
    manifest = json.loads((repo / "build" / "mini" / "manifest.json").read_text())
    assert len(manifest["kernels"]) == 3 and manifest["backend"] == "cpu" and manifest["arch"] == "x86v4"
    assert all(len(k["sha256"]) == 64 for k in manifest["kernels"])
    assert "g++" in manifest["toolchain"]["identity"] or "GCC" in manifest["toolchain"]["identity"]

    # the signature records live in the build directory (builds into other directories may run at once)
    assert (repo / "build" / ".sconsign.dblite").is_file() and not (repo / ".sconsign.dblite").exists()

    # a second run rebuilds nothing
    second = build(repo)
    assert summary(second)["compiled"] == 0 and summary(second)["up_to_date"] == 3

    # a code change in one activation rebuilds exactly the kernels that use it
    relu = repo / "runtime" / "tiledispatch" / "include" / "activations" / "relu.h"
    relu.write_text(relu.read_text().replace("v > T(0) ? v : T(0)", "v >= T(0) ? v : T(0)"))
    third = build(repo)
    assert summary(third)["compiled"] == 1
    assert all("_relu_" in n for n in compiled_names(third))

    # editing one config rebuilds only that config
    spec = repo / "kernel_specs" / "mini.yaml"
    spec.write_text(spec.read_text().replace("{activation: silu, bias: true}", "{activation: silu, bias: false}"))
    fourth = build(repo)
    assert summary(fourth)["compiled"] == 1
    assert {n.split("_")[3] for n in compiled_names(fourth)} == {"silu"}
    stale = [p.name for p in (repo / "build" / "mini" / "kernels").iterdir() if "silubias" in p.name]
    assert stale == [], "the bundle kept a kernel that is no longer declared"

    # a fresh build dir with the warm CacheDir compiles nothing
    fresh = build(repo, "other_build")
    s = summary(fresh)
    assert s["compiled"] == 0 and s["cached"] == 3, fresh.stdout
    assert (repo / "other_build" / ".sconsign.dblite").is_file()
    assert summary(build(repo))["up_to_date"] == 3  # the first directory's records are its own still


@pytest.mark.slow
def test_compiler_flags_enter_the_build_identity(repo):
    build(repo)
    rules = repo / "templates" / "cpu" / "toolchain.py"
    rules.write_text(rules.read_text().replace('"-fno-math-errno"', '"-fno-math-errno", "-fno-plt"'))
    again = build(repo)
    assert summary(again)["compiled"] == 3


def test_failing_config_names_itself(repo):
    gemm = repo / "runtime" / "tiledispatch" / "include" / "activations" / "silu.h"
    gemm.write_text("this is not C++\n")
    proc = build(repo, "build", "cache", "-k", check=False)
    assert proc.returncode != 0
    assert "FAILED" in proc.stdout and "_silubias_" in proc.stdout
    assert "declared in kernel_specs/mini.yaml: groups[0]" in proc.stdout
    assert "1 failed" in proc.stdout


def test_spec_errors_stop_the_build_with_a_clear_message(repo):
    spec = repo / "kernel_specs" / "mini.yaml"
    spec.write_text(SET_BODY.replace("mma: [6, 32, 1]", "mma: [5, 32, 1]"))
    proc = scons(repo, "kernels=mini", "backend=cpu", "arch=x86v4", check=False)
    assert proc.returncode == 2
    assert "mini.yaml: groups[0]" in proc.stdout and "rule cpu.mma_divides_tile" in proc.stdout


def test_help_and_missing_kernels(repo):
    helptext = scons(repo, "-h").stdout
    for option in ("kernels:", "backend:", "arch:", "build_dir:", "cache_dir:"):
        assert option in helptext
    proc = scons(repo, "backend=cpu", check=False)
    assert proc.returncode == 2 and "no kernels= given" in proc.stdout
    proc = scons(repo, "kernels=mini", "colour=blue", check=False)
    assert proc.returncode == 2 and "unknown option(s) colour" in proc.stdout
