"""Hardening of the build side (issue 15): a fresh machine, hostile kernel sets, a tampered build cache, paths
that escape the build directory, and build errors that must be one clear line (exit 2), never a traceback."""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import copy_repo, summary
from tiledispatch import bundle
from tiledispatch.generator import kernelset
from tiledispatch.errors import SpecError
from tiledispatch.generator import rules
from tiledispatch.spec.key import Algorithm, KernelKey, Signature

# one small kernel: fp32 rcr on the generic arch (any x86-64 runs it)
TINY = """\
schema: 1
name: tiny
groups:
  - backend: cpu
    arch: generic
    op: gemm
    dtype: fp32
    layout: rcr
    pipeline: packed
    tile: [16, 16, 16]
    mma: [4, 4, 1]
"""

# checks a bundle's kernel against numpy in a child process: a kernel that crashes takes only the child down
CHECK_GEMM = """
import sys, numpy as np, tiledispatch as td
reg = td.load(sys.argv[1])
rng = np.random.default_rng(0)
a = rng.uniform(-1, 1, (37, 29)).astype(np.float32)
b = rng.uniform(-1, 1, (23, 29)).astype(np.float32)
d = reg.gemm(a, b.T)
ref = a.astype(np.float64) @ b.T.astype(np.float64)
err = np.linalg.norm(d - ref) / np.linalg.norm(ref)
print("relative error", err)
sys.exit(0 if err < 1e-5 else 3)
"""


def run_scons(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """scons in root with extra environment; stdout and stderr together, as a user sees them."""
    cmd = [sys.executable, "-m", "SCons", "-Q", "-C", str(root), *args]
    full_env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None: unset
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """exit 2, no traceback, and one `tiledispatch: error:` line holding every needle; returns that line."""
    assert proc.returncode == 2, proc.stdout
    assert "Traceback" not in proc.stdout and 'File "' not in proc.stdout, proc.stdout
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("tiledispatch: error:")]
    assert len(errors) == 1, proc.stdout
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def check_bundle_gemm(bundle_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHECK_GEMM, str(bundle_dir)], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = copy_repo(tmp_path_factory.mktemp("hardening") / "repo")
    (root / "kernel_specs" / "tiny.yaml").write_text(TINY)
    return root


@pytest.fixture(scope="module")
def warm(repo, tmp_path_factory) -> dict:
    """One build of the tiny set: its cache (to copy and corrupt) and its build dir."""
    base = tmp_path_factory.mktemp("warm")
    proc = run_scons(repo, "kernels=tiny", "backend=cpu", "arch=generic", f"build_dir={base / 'build'}",
                     f"cache_dir={base / 'cache'}")
    assert proc.returncode == 0, proc.stdout
    assert summary(proc)["compiled"] == 1
    return {"cache": base / "cache", "build": base / "build"}


def build_tiny(repo: Path, build_dir: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = run_scons(repo, "kernels=tiny", "backend=cpu", "arch=generic", f"build_dir={build_dir}",
                     f"cache_dir={cache}", *extra)
    assert proc.returncode == 0, proc.stdout
    return proc


def cache_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file() and p.parent != cache)


# ---- 1. a fresh machine: the default cache under an empty HOME ------------------------------------------

def test_empty_home_builds_with_the_default_cache(repo, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    proc = run_scons(repo, "kernels=tiny", "backend=cpu", "arch=generic", f"build_dir={tmp_path / 'build'}",
                     env={"HOME": str(home), "XDG_CACHE_HOME": None})
    assert proc.returncode == 0, proc.stdout
    assert summary(proc)["compiled"] == 1
    assert _so_entry(home / ".cache" / "tiledispatch" / "scons")  # the compiled kernel went to the default cache


@pytest.mark.parametrize("where", ["under_a_file", "unwritable"])
def test_an_unusable_cache_dir_is_one_clear_error(repo, tmp_path, where):
    if where == "under_a_file":
        (tmp_path / "afile").write_text("x")
        cache = tmp_path / "afile" / "cache"
    else:
        cache = Path("/proc/self")  # exists; no file can be created in it, even by root
    proc = run_scons(repo, "kernels=tiny", "backend=cpu", "arch=generic", f"build_dir={tmp_path / 'build'}",
                     f"cache_dir={cache}")
    assert_one_line_error(proc, "cache_dir", str(cache), "cache_dir=none")
    assert not (tmp_path / "build").exists()


# ---- 2. the build cache is verified against the hash recorded when an entry was pushed --------------------

def _so_entry(cache: Path) -> Path:
    entries = [p for p in cache_files(cache) if p.read_bytes()[:4] == b"\x7fELF"]
    assert len(entries) == 1, cache_files(cache)
    return entries[0]


def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p: Path):
    data = bytearray(p.read_bytes())
    data[len(data) // 3] ^= 0xFF
    p.write_bytes(bytes(data))


def _drop_record(p: Path):
    records = [q for q in p.parent.iterdir() if q != p]
    assert records, "the cache entry has no hash record next to it"
    for q in records:
        q.unlink()


@pytest.mark.parametrize("corrupt", [pytest.param(_truncate, marks=pytest.mark.slow), _flip,
                                     pytest.param(_drop_record, marks=pytest.mark.slow)],
                         ids=["truncated", "flipped", "no_record"])
def test_a_corrupt_cache_entry_is_reported_and_rebuilt(repo, warm, tmp_path, corrupt):
    cache = tmp_path / "cache"
    shutil.copytree(warm["cache"], cache)
    entry = _so_entry(cache)
    corrupt(entry)
    proc = build_tiny(repo, tmp_path / "build", cache)
    report = [ln for ln in proc.stdout.splitlines() if "cache entry" in ln]
    assert len(report) == 1 and "gemm_fp32" in report[0] and "rebuild" in report[0], proc.stdout
    assert summary(proc)["compiled"] == 1 and summary(proc)["cached"] == 0, proc.stdout
    check = check_bundle_gemm(tmp_path / "build" / "tiny")
    assert check.returncode == 0, check.stdout + check.stderr
    # the rebuilt kernel went back into the cache with a fresh record: the next fresh build takes it
    again = build_tiny(repo, tmp_path / "build2", cache)
    assert summary(again)["cached"] == 1 and "cache entry" not in again.stdout, again.stdout


def test_rendered_sources_are_not_cached_so_an_edit_cannot_reach_a_kernel(repo, warm, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(warm["cache"], cache)
    for p in cache_files(cache):  # whatever text the cache holds (a rendered source), make it compute garbage
        text = p.read_bytes()
        if text[:4] != b"\x7fELF" and b"td_run" in text:
            p.write_bytes(text.replace(b"acc[i][v] += av * bv[v];", b"acc[i][v] -= av * bv[v];"))
    assert not [p for p in cache_files(cache) if b"td_run" in p.read_bytes() and p.read_bytes()[:4] != b"\x7fELF"], \
        "rendered sources are cached"
    build_tiny(repo, tmp_path / "build", cache)
    check = check_bundle_gemm(tmp_path / "build" / "tiny")
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_warm_cache_still_serves_a_fresh_build_dir(repo, warm, tmp_path):
    proc = build_tiny(repo, tmp_path / "build", warm["cache"])
    assert summary(proc)["cached"] == 1 and summary(proc)["compiled"] == 0, proc.stdout
    assert check_bundle_gemm(tmp_path / "build" / "tiny").returncode == 0


# ---- 3. legality rules bound what a key's fields size at run time -----------------------------------------

def cpu_key(tile, mma, op="gemm", pipeline="packed", dtype="fp32", arch="x86v3"):
    if op == "gemm":
        sig = Signature(op="gemm", dtype_a=dtype, dtype_b=dtype, dtype_c=dtype, dtype_acc="fp32", layout="rcr")
    else:
        sig = Signature(op="conv", dtype_a=dtype, dtype_b=dtype, dtype_c=dtype, dtype_acc="fp32", layout="nhwgc",
                        direction="fwd", spatial_dims=2)
    return KernelKey(sig, Algorithm(tile=tuple(tile), mma=tuple(mma), pipeline=pipeline), "cpu", arch)


@pytest.mark.parametrize("tile, mma, rule", [
    ((524288, 524256, 4), (8, 8, 1), "cpu.block_fits"),          # the issue's tile: cb[MC][NC] of 1 TiB, int overflow
    ((2048, 2048, 4), (2048, 2048, 1), "cpu.micro_tile_fits"),   # the issue's mma: 16 MiB of accumulators on the stack
    ((8192, 8192, 8), (8, 8, 1), "cpu.block_fits"),
    ((256, 256, 16), (128, 8, 1), "cpu.micro_tile_fits"),         # 128 row pointers / unrolled rows
    ((64, 4096, 16), (8, 512, 1), "cpu.micro_tile_fits"),
])
@pytest.mark.parametrize("op, pipeline", [("gemm", "packed"), ("conv", "packed"), ("conv", "direct")])
def test_cpu_keys_that_would_crash_are_illegal(tile, mma, rule, op, pipeline):
    violations = rules.check(cpu_key(tile, mma, op=op, pipeline=pipeline))
    hit = [v for v in violations if v.rule == rule]
    assert hit, violations
    assert any(word in hit[0].message for word in ("KiB", "MiB", "at most")), hit[0].message


def test_the_issue_keys_are_refused_from_a_kernel_set(tmp_path):
    for tile, mma in (([524288, 524256, 4], [8, 8, 1]), ([2048, 2048, 4], [2048, 2048, 1])):
        path = tmp_path / "tiny.yaml"
        path.write_text(TINY.replace("tile: [16, 16, 16]", f"tile: {tile}").replace("mma: [4, 4, 1]", f"mma: {mma}"))
        with pytest.raises(SpecError, match=r"tiny.yaml: groups\[0\]: kernel .* is illegal: rule cpu\."):
            kernelset.expand_file(path, "cpu", "generic")


CUTLASS_DIRECT_MMA = """\
schema: 1
name: tiny
groups:
  - backend: cutlass
    arch: sm90a
    op: conv
    direction: bwd_weight
    spatial_dims: 2
    dtype: fp16
    layout: nhwgc
    scheduler: data_parallel
    pipeline: direct_mma
    tile: [28, 32, 8]
    warps: [8, 1, 1]
    mma: [16, 8, 16]
    extras: {cpg: 1, kpg: 1, fx: 3, fy: 3}
"""


@pytest.mark.parametrize("edit", [("tile: [28, 32, 8]", "tile: [28, 4, 8]"), ("cpg: 1, kpg: 1, ", "")])
def test_cutlass_rules_judge_odd_tiles_and_missing_extras_without_crashing(tmp_path, edit):
    assert kernelset.expand_file(write_set(tmp_path, CUTLASS_DIRECT_MMA), "cutlass", "sm90a")
    path = write_set(tmp_path, CUTLASS_DIRECT_MMA.replace(*edit))
    with pytest.raises(SpecError, match=r"tiny.yaml: groups\[0\]: kernel .* is illegal: rule cutlass\."):
        kernelset.expand_file(path, "cutlass", "sm90a")


# ---- 4. bounded expansion and bounded YAML ------------------------------------------------------------------

def write_set(tmp_path: Path, text: str, name: str = "tiny") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_a_huge_set_is_refused_with_its_count_before_expanding(tmp_path):
    # 1,056,000 candidate kernels, as in the issue: refused from the product sizes alone, in well under a second
    tiles = [[16 * (i + 1), 16, 16] for i in range(1100)]
    epi = "{activation: [identity, relu, gelu_tanh, gelu_erf, silu, sigmoid, tanh, clamp], bias: [true, false], " \
          "residuals: [0, 1, 2, 3, 4, 0]}"
    text = TINY.replace("tile: [16, 16, 16]", f"tile: {tiles}").replace("mma: [4, 4, 1]", "mma: [4, 4, 1]\n"
                                                                        f"    epilogue: {epi}")
    path = write_set(tmp_path, text.replace("layout: rcr", "layout: [rcr, rrr, crr, ccr, rcr]")
                     .replace("dtype: fp32", "dtype: [fp32, fp16]"))  # 1100 x 96 x 5 x 2
    start = time.perf_counter()
    with pytest.raises(SpecError, match=r"tiny.yaml: .*1056000 kernel.*10000"):
        kernelset.expand_file(path, "cpu", "generic")
    assert time.perf_counter() - start < 2.0


def test_max_kernels_is_a_parameter_of_load_and_expand(tmp_path):
    path = write_set(tmp_path, TINY.replace("layout: rcr", "layout: [rcr, rrr, crr]"))
    assert len(kernelset.load(str(path), "cpu", "generic", max_kernels=3)) == 3
    with pytest.raises(SpecError, match=r"3 kernel.* max_kernels=2"):
        kernelset.load(str(path), "cpu", "generic", max_kernels=2)
    with pytest.raises(SpecError, match=r"3 kernel.* max_kernels=2"):
        kernelset.expand_file(path, "cpu", "generic", max_kernels=2)
    # the bound covers every set of one build together
    other = write_set(tmp_path, TINY.replace("name: tiny", "name: other").replace("layout: rcr", "layout: [rrr, ccr]"),
                      "other")
    with pytest.raises(SpecError, match=r"5 kernel"):
        kernelset.load([str(path), str(other)], "cpu", "generic", max_kernels=4)


def test_exclude_lists_are_bounded(tmp_path):
    excludes = "exclude:\n" + "".join(f"  - {{tile: [{i}, 16, 16]}}\n" for i in range(1, 1100))
    path = write_set(tmp_path, TINY + excludes)
    with pytest.raises(SpecError, match=r"tiny.yaml: exclude has 1099 entries"):
        kernelset.expand_file(path, "cpu", "generic")
    few = write_set(tmp_path, TINY + "exclude:\n  - {tile: [16, 16, 16], layout: rrr}\n")
    assert len(kernelset.expand_file(few, "cpu", "generic")) == 1


def test_an_alias_bomb_is_refused_quickly(tmp_path):
    lines = ["a0: &a0 [fp32, fp32, fp32, fp32, fp32, fp32, fp32, fp32, fp32, fp32]"]
    for i in range(1, 12):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    bomb = "\n".join(lines) + "\n"
    path = write_set(tmp_path, TINY.replace("schema: 1\n", "schema: 1\n" + bomb).replace("dtype: fp32", "dtype: *a11"))
    start = time.perf_counter()
    with pytest.raises(SpecError, match=r"tiny.yaml: .*(alias|expands)"):
        kernelset.expand_file(path, "cpu", "generic")
    assert time.perf_counter() - start < 2.0


def test_a_recursive_alias_is_refused(tmp_path):
    path = write_set(tmp_path, TINY.replace("dtype: fp32", "dtype: &loop [fp32, *loop]"))
    with pytest.raises(SpecError, match=r"tiny.yaml: .*alias"):
        kernelset.expand_file(path, "cpu", "generic")


def test_deep_nesting_and_huge_files_are_refused(tmp_path):
    deep = write_set(tmp_path, TINY.replace("dtype: fp32", "dtype: " + "[" * 5000 + "fp32" + "]" * 5000))
    with pytest.raises(SpecError, match=r"tiny.yaml: .*nest"):
        kernelset.expand_file(deep, "cpu", "generic")
    big = write_set(tmp_path, TINY + "#" * (4 << 20) + "\n")
    with pytest.raises(SpecError, match=r"tiny.yaml: .*(MiB|bytes)"):
        kernelset.expand_file(big, "cpu", "generic")


def test_a_fifo_is_not_read(tmp_path):
    fifo = tmp_path / "tiny.yaml"
    os.mkfifo(fifo)
    with pytest.raises(SpecError, match="not a regular file"):
        kernelset.expand_file(fifo, "cpu", "generic")


# ---- 5. names and paths stay inside the project and the build dir ---------------------------------------

@pytest.mark.parametrize("name", ["../../../../elsewhere/x", "/etc/passwd", "sub/dir", "..", "", " ", "a b"])
def test_a_set_name_is_a_plain_name(name):
    with pytest.raises(SpecError, match="kernel set"):
        kernelset.find(name)


def test_a_set_name_is_looked_up_only_in_the_project(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "x.yaml").write_text(TINY.replace("name: tiny", "name: x"))
    for d in kernelset.SEARCH_DIRS:  # a name that climbs out of preselected/ or kernel_specs/ to a real file
        with pytest.raises(SpecError, match="plain name"):
            kernelset.find(os.path.relpath(outside / "x", d))
    assert kernelset.find(str(outside / "x.yaml")) == outside / "x.yaml"  # an explicit file is the user's own


@pytest.mark.parametrize("bundle_name", ["<abs>", "../escape", *(pytest.param(name, marks=pytest.mark.slow)
                                                                 for name in ("a/b", "..", "lib"))])
def test_bundle_must_be_a_plain_name(repo, tmp_path, bundle_name):
    bundle_name = bundle_name.replace("<abs>", str(tmp_path / "abs_bundle"))
    proc = run_scons(repo, "kernels=tiny", "backend=cpu", "arch=generic", f"build_dir={tmp_path / 'build'}",
                     f"cache_dir={tmp_path / 'cache'}", f"bundle={bundle_name}")
    assert_one_line_error(proc, "bundle")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing built, inside build_dir or out of it


def test_kernels_name_outside_the_project_is_refused(repo, tmp_path):
    proc = run_scons(repo, "kernels=../../../../elsewhere/x", "backend=cpu", "arch=generic",
                     f"build_dir={tmp_path / 'build'}", f"cache_dir={tmp_path / 'cache'}")
    assert_one_line_error(proc, "../../../../elsewhere/x", "plain name")


def test_a_rebuild_removes_dropped_kernels_and_nothing_else(repo, warm, tmp_path):
    spec = write_set(tmp_path, TINY.replace("layout: rcr", "layout: [rcr, rrr]"))
    args = (f"kernels={spec}", "backend=cpu", "arch=generic", f"build_dir={tmp_path / 'build'}",
            f"cache_dir={warm['cache']}")
    assert run_scons(repo, *args).returncode == 0
    kdir = tmp_path / "build" / "tiny" / "kernels"
    (kdir / "precious.so").write_bytes(b"not the build's")
    spec.write_text(TINY)
    again = run_scons(repo, *args)
    assert again.returncode == 0, again.stdout
    assert sorted(p.name for p in kdir.iterdir()) == sorted(["precious.so", next(
        p.name for p in (tmp_path / "build" / "lib").iterdir() if "_rcr_" in p.name)]), again.stdout


def test_remove_stale_kernels_deletes_only_what_the_old_manifest_listed(tmp_path):
    keys = [e.key for e in kernelset.expand_file(write_set(tmp_path, TINY.replace("layout: rcr", "layout: [rcr, rrr]")),
                                                 "cpu", "generic")]
    bdir = tmp_path / "bundle"
    (bdir / "kernels").mkdir(parents=True)
    for k in keys:
        (bdir / bundle.kernel_file(k)).write_bytes(b"so")
    (bdir / "kernels" / "precious.so").write_bytes(b"mine")
    (tmp_path / "outside.so").write_bytes(b"mine too")
    listed = [{"name": k.name, "file": bundle.kernel_file(k)} for k in keys]
    listed += [{"name": "x", "file": "../outside.so"}, {"name": "y", "file": str(tmp_path / "outside.so")},
               {"name": "z", "file": "kernels/../../outside.so"}]
    (bdir / bundle.MANIFEST).write_text(json.dumps({"schema": 1, "kernels": listed}))
    removed = bundle.remove_stale_kernels(bdir, keys[:1])
    assert removed == [Path(bundle.kernel_file(keys[1])).name]
    assert (bdir / "kernels" / "precious.so").exists() and (tmp_path / "outside.so").exists()
    assert (bdir / bundle.kernel_file(keys[0])).exists()
    # no manifest (or a broken one): nothing is deleted
    (bdir / bundle.MANIFEST).write_text("{broken")
    assert bundle.remove_stale_kernels(bdir, []) == [] and (bdir / bundle.kernel_file(keys[0])).exists()


# ---- 6. build errors are one line and exit 2 -------------------------------------------------------------

def test_a_compiler_that_fails_its_version_check(repo, tmp_path):
    proc = run_scons(repo, "kernels=tiny", "backend=cpu", "arch=generic", f"build_dir={tmp_path / 'build'}",
                     f"cache_dir={tmp_path / 'cache'}", env={"CXX": "false"})
    assert_one_line_error(proc, "--version")


def test_backend_auto_without_any_compiler(repo, tmp_path):
    bindir = tmp_path / "bin"  # PATH with python only: no g++, nvcc or hipcc
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    proc = run_scons(repo, "kernels=tiny", f"build_dir={tmp_path / 'build'}", f"cache_dir={tmp_path / 'cache'}",
                     env={"PATH": str(bindir), "CXX": "no-such-cxx", "CUDA_HOME": str(tmp_path),
                          "ROCM_PATH": str(tmp_path)})
    assert_one_line_error(proc, "no backend is available")


@pytest.mark.parametrize("kernels", ["tiny,,tiny", ",tiny"])
def test_an_empty_set_name(repo, tmp_path, kernels):
    proc = run_scons(repo, f"kernels={kernels}", "backend=cpu", "arch=generic", f"build_dir={tmp_path / 'build'}",
                     f"cache_dir={tmp_path / 'cache'}")
    assert_one_line_error(proc, "empty")


def test_max_kernels_option(repo, tmp_path):
    spec = write_set(tmp_path, TINY.replace("layout: rcr", "layout: [rcr, rrr]"))
    args = (f"kernels={spec}", "backend=cpu", "arch=generic", f"build_dir={tmp_path / 'build'}",
            f"cache_dir={tmp_path / 'cache'}")
    assert_one_line_error(run_scons(repo, *args, "max_kernels=1"), "2 kernel", "max_kernels=1")
    assert_one_line_error(run_scons(repo, *args, "max_kernels=lots"), "max_kernels")


@pytest.mark.parametrize("edit", [
    ("arch: generic", "arch: {generic: 1}"),
    pytest.param(("backend: cpu", "backend: [cpu]"), marks=pytest.mark.slow),
    pytest.param(("layout: rcr", "layout: {r: c}"), marks=pytest.mark.slow),
    pytest.param(("tile: [16, 16, 16]", "tile: {m: 16}"), marks=pytest.mark.slow),
    ("    mma: [4, 4, 1]\n", "    mma: [4, 4, 1]\n    configs: {tile: [16, 16, 16]}\n"),
    pytest.param(("    mma: [4, 4, 1]\n", "    mma: [4, 4, 1]\n    epilogue: [relu]\n"), marks=pytest.mark.slow),
    pytest.param(("    mma: [4, 4, 1]\n", "    mma: [4, 4, 1]\n    extras: [1]\n"), marks=pytest.mark.slow),
    ("groups:\n", "exclude: {dtype: fp32}\ngroups:\n"),
    pytest.param(("groups:\n", "exclude: [{dtypes: fp32}]\ngroups:\n"), marks=pytest.mark.slow),
])
def test_wrong_types_in_a_set_file_are_one_line_errors(repo, tmp_path, edit):
    spec = write_set(tmp_path, TINY.replace(*edit))
    proc = run_scons(repo, f"kernels={spec}", "backend=cpu", "arch=generic", f"build_dir={tmp_path / 'build'}",
                     f"cache_dir={tmp_path / 'cache'}")
    assert_one_line_error(proc, "tiny.yaml")


WRONG_VALUES = [None, True, 0, -3, 2 ** 70, 1.5, "x", "", [], [[]], [1], [None], [[1, 2]], ["a", "b", "c"], {},
                {"a": 1}, {"activation": {"x": 1}}, [{"a": [1]}], {1: 2}, [[1, 2, 3], "x"]]


def _paths(node, prefix=()):
    """Every place in a set's data: the root, each mapping value, each list's first item and every item that is
    a mapping (the scalars after a list's first are the same kind of value)."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            if i == 0 or isinstance(v, dict):
                yield from _paths(v, prefix + (i,))


def _replace(data, path, value):
    out = copy.deepcopy(data)
    if not path:
        return value
    node = out
    for p in path[:-1]:
        node = node[p]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


_DELETE = object()

FUZZ_BASE = {
    "schema": 1, "name": "tiny", "description": "d",
    "groups": [{"backend": "cpu", "arch": ["generic"], "op": "gemm", "dtype": "fp32", "layout": ["rcr"],
                "pipeline": "packed", "tile": [[16, 16, 16]], "mma": [4, 4, 1],
                "epilogue": {"activation": ["relu"], "bias": True, "residuals": 0},
                "configs": [{"tile": [16, 16, 16]}, {"tile": [32, 16, 16], "mma": [[4, 4, 1], [8, 4, 1]]}],
                "extras": {}},
               {"backend": "cpu", "op": "conv", "direction": "fwd", "spatial_dims": 2,
                "dtypes": {"a": "fp32", "b": "fp32", "c": "fp32", "acc": "fp32"},
                "layout": "nhwgc", "pipeline": "direct", "tile": [8, 16, 16], "mma": [4, 16, 1]},
               {"backend": "cutlass", "arch": "sm90a", "op": "conv", "direction": "bwd_weight", "spatial_dims": 2,
                "dtype": "fp16", "layout": "nhwgc", "scheduler": "data_parallel", "pipeline": "direct_mma",
                "tile": [28, 32, 8], "warps": [8, 1, 1], "mma": [16, 8, 16],
                "extras": {"cpg": 1, "kpg": 1, "fx": 3, "fy": 3}}],
    "exclude": [{"layout": "rrr", "tile": [16, 16, 16], "dtypes": {"a": "fp32"}, "epilogue": {"bias": False},
                 "extras": {}}],
}


def test_fuzz_wrong_types_anywhere_are_spec_errors(tmp_path, monkeypatch):
    base = copy.deepcopy(FUZZ_BASE)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(base))
    assert kernelset._read_yaml(path) == base
    # the mutations are YAML-representable values; handing them over without YAML text keeps the loop fast
    mutated = {}
    monkeypatch.setattr(kernelset, "_read_yaml", lambda p: copy.deepcopy(mutated["data"]))
    targets = (("cpu", "generic"), ("cutlass", "sm90a"))
    mutated["data"] = base
    assert all(kernelset.expand_file(path, *t) for t in targets)  # the base is valid
    tried = 0
    for where in list(_paths(base)):
        for value in [*WRONG_VALUES, *([_DELETE] if where else [])]:
            mutated["data"] = _replace(base, where, value)
            # a group's fields matter for its own backend only
            group = base["groups"][where[1]] if where[:1] == ("groups",) and len(where) > 1 else None
            for target in [t for t in targets if group is None or group["backend"] == t[0]]:
                tried += 1
                try:
                    kernelset.expand_file(path, *target)
                    kernelset.targets(path)
                except SpecError as e:
                    assert "tiny.yaml" in str(e) and "\n" not in str(e), (where, value, str(e))
                except Exception as e:  # noqa: BLE001 - the point of the test
                    pytest.fail(f"{target}: {where} = {value!r}: {type(e).__name__}: {e}")
    assert tried > 800


# ---- 7. new-user friction ------------------------------------------------------------------------------------

def test_a_broken_set_file_does_not_break_other_commands(repo, warm, tmp_path):
    root = copy_repo(tmp_path / "repo")
    (root / "kernel_specs" / "tiny.yaml").write_text(TINY)
    (root / "kernel_specs" / "broken.yaml").write_text("groups: [\n  - {backend: cpu\n")
    (root / "kernel_specs" / "listy.yaml").write_text("- just\n- a list\n")
    helped = run_scons(root, "-h")
    assert helped.returncode == 0 and "Traceback" not in helped.stdout, helped.stdout
    assert "broken" in helped.stdout and "kernel_specs/broken.yaml" in helped.stdout, helped.stdout
    built = build_tiny(root, tmp_path / "build", warm["cache"])
    assert summary(built)["failed"] == 0
    refused = run_scons(root, "kernels=broken", "backend=cpu", "arch=generic", f"build_dir={tmp_path / 'b2'}",
                        f"cache_dir={tmp_path / 'cache'}")
    assert_one_line_error(refused, "broken.yaml")


def test_available_sets_lists_a_broken_file_by_name(tmp_path, monkeypatch):
    (tmp_path / "good.yaml").write_text(TINY.replace("name: tiny", "name: good").replace("schema: 1", "schema: 1\n"
                                                                                           "description: fine"))
    (tmp_path / "bad.yaml").write_text("a: [\n")
    (tmp_path / "bomb.yaml").write_text("a: &a [" + "x, " * 10 + "]\nb: [" + "*a, " * 20000 + "]\n")
    monkeypatch.setattr(kernelset, "SEARCH_DIRS", (tmp_path,))
    sets = kernelset.available_sets()
    assert sets["good"] == "fine"
    assert "broken" in sets["bad"] and "bad.yaml" in sets["bad"]
    assert "broken" in sets["bomb"]


def test_clean_says_what_it_did(repo, warm, tmp_path):
    build_tiny(repo, tmp_path / "build", warm["cache"])
    cleaned = run_scons(repo, "-c", "kernels=tiny", "backend=cpu", "arch=generic", f"build_dir={tmp_path / 'build'}",
                        f"cache_dir={warm['cache']}")
    assert cleaned.returncode == 0, cleaned.stdout
    assert "up to date" not in cleaned.stdout and "from cache" not in cleaned.stdout, cleaned.stdout
    assert "removed" in cleaned.stdout, cleaned.stdout
    assert not (tmp_path / "build" / "tiny" / "manifest.json").exists()


def test_configs_replacing_the_tile_list_is_documented():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "configs" in kernelset.__doc__ and "replace" in kernelset.__doc__
    example = readme.split("## Declaring a kernel set", 1)[1].split("```", 2)[1]
    assert "replace" in example
