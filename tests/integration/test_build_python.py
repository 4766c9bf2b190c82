"""Building from Python (tiledispatch.build) through the command line's build: the same CacheDir both ways, in-memory
declarations and explicit keys, typed errors, the compiler launcher, on-demand (JIT) kernels."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tiledispatch as td
from conftest import REPO, SESSION, copy_repo, scons, summary, wait_for_prebuild
from test_runtime_only import BLOCKER

# this machine's cpu arch (the session's prebuild is for it, and the kernels built here are run); OTHER_ARCH: one
# that the keys built here are not for
ARCH = td.backends.get("cpu").detect_arch()
OTHER_ARCH = "x86v3" if ARCH != "x86v3" else "x86v4"


def declaration(name: str, **fields) -> dict:
    """A one-group cpu fp32 GEMM kernel set in the set schema, as a dict."""
    group = {"backend": "cpu", "arch": ARCH, "op": "gemm", "dtype": "fp32", "layout": "rcr", "pipeline": "packed",
             "tile": [48, 128, 128], "mma": [6, 32, 1], **fields}
    return {"schema": 1, "name": name, "groups": [group]}


class Outcomes:
    """A progress callback that records (done, total, outcome, name)."""

    def __init__(self):
        self.lines = []

    def __call__(self, done, total, outcome, name):
        self.lines.append((done, total, outcome, name))

    def count(self, outcome):
        return sum(1 for line in self.lines if line[2] == outcome)


def check_gemm(reg, activation="identity", layout_b="c", dtype=np.float32):
    """One GEMM on random data against the float64 reference (output poisoned first)."""
    rng = np.random.default_rng(11)
    a = rng.uniform(-1, 1, (37, 29)).astype(dtype)
    b = rng.uniform(-1, 1, (29, 23)).astype(dtype)
    b = np.asfortranarray(b) if layout_b == "c" else b
    out = np.full((37, 23), np.nan, dtype)
    reg.gemm(a, b, out, activation=activation)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    ref = np.maximum(ref, 0) if activation == "relu" else ref
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


def test_python_and_scons_builds_hit_each_others_cache(tmp_path):
    cache = tmp_path / "cache"
    # Python first, an in-memory declaration: compiled, and the bundle computes
    built = Outcomes()
    reg = td.build(declaration("from_python", epilogue={"activation": "relu"}), backend="cpu", arch=ARCH,
                   build_dir=tmp_path / "py", cache_dir=cache, progress=built)
    assert [(o, n) for _, _, o, n in built.lines] == [("compiled", reg.kernels[0].name)]
    assert len(reg) == 1 and "_relu_" in reg.kernels[0].name
    check_gemm(reg, "relu")
    # the declaration lies in the bundle as a set file; the command line builds it from the Python build's cache
    decl = tmp_path / "py" / "from_python" / "from_python.yaml"
    proc = scons(REPO, f"kernels={decl}", "backend=cpu", f"arch={ARCH}", f"build_dir={tmp_path / 'cli'}",
                 f"cache_dir={cache}")
    assert summary(proc) == {"total": 1, "compiled": 0, "cached": 1, "up_to_date": 0, "failed": 0}

    # the command line first (in the session's cache, where it may have run already): Python fetches every kernel
    wait_for_prebuild()
    scons(REPO, "kernels=fp32_rcr_essential", "backend=cpu", f"arch={ARCH}", f"build_dir={tmp_path / 'cli2'}",
          f"cache_dir={SESSION['cache_dir']}")
    fetched = Outcomes()
    reg = td.build("fp32_rcr_essential", backend="cpu", arch=ARCH, build_dir=tmp_path / "py2",
                   cache_dir=SESSION["cache_dir"], progress=fetched)
    assert len(reg) == len(fetched.lines) > 0 and fetched.count("cached") == len(reg), fetched.lines
    check_gemm(reg)
    # and a second build from Python has nothing to do
    again = Outcomes()
    assert len(td.build("fp32_rcr_essential", backend="cpu", arch=ARCH, build_dir=tmp_path / "py2",
                        cache_dir=SESSION["cache_dir"], progress=again)) == len(reg)
    assert again.lines == []


def test_explicit_keys_build_exactly_those_kernels(tmp_path):
    wait_for_prebuild()
    source = td.build("fp32_rcr_essential", backend="cpu", arch=ARCH, build_dir=tmp_path,
                      cache_dir=SESSION["cache_dir"])
    key = source.kernels[0].key
    reg = td.build([key], build_dir=tmp_path, cache_dir=SESSION["cache_dir"])  # backend, arch: the key's
    assert [k.key for k in reg.kernels] == [key]
    with pytest.raises(td.SpecError, match=f"arch={OTHER_ARCH}, but the KernelKeys given are for {ARCH}"):
        td.build([key], arch=OTHER_ARCH, build_dir=tmp_path)


def test_jobs_are_the_command_lines(tmp_path, caplog):
    """jobs=None: the command line's default (the CPU count, capped by free memory, in SConstruct); jobs=N: -jN."""
    wait_for_prebuild()
    caplog.set_level(logging.INFO, logger="tiledispatch.build")
    for jobs, want in ((None, os.cpu_count()), (1, 1)):
        caplog.clear()
        td.build("fp32_rcr_essential", backend="cpu", arch=ARCH, build_dir=tmp_path, cache_dir=SESSION["cache_dir"],
                 jobs=jobs)
        header = [r.getMessage() for r in caplog.records if "job(s)" in r.getMessage()]
        assert header and header[0].endswith(f"; {want} job(s)") or "more memory than is free" in caplog.text, header
        assert any(r.getMessage().startswith("2 kernel(s):") for r in caplog.records), caplog.text
    with pytest.raises(td.InvalidInputError, match="jobs must be a positive integer"):
        td.build("fp32_rcr_essential", backend="cpu", arch=ARCH, build_dir=tmp_path, jobs=0)
    with pytest.raises(td.InvalidInputError, match="plain name under build_dir"):
        td.build(declaration("escape"), backend="cpu", arch=ARCH, build_dir=tmp_path / "b", bundle="../outside")
    assert not (tmp_path / "outside").exists()


def test_illegal_declaration_fails_with_the_rule_named(tmp_path):
    with pytest.raises(td.SpecError, match=r"is illegal: rule cpu\.mma_k"):
        td.build(declaration("bad_mma", mma=[6, 32, 2]), backend="cpu", arch=ARCH, build_dir=tmp_path)
    with pytest.raises(td.SpecError, match="unknown field|tiles"):
        td.build(declaration("bad_field", tiles=[48, 128, 128]), backend="cpu", arch=ARCH, build_dir=tmp_path)
    with pytest.raises(td.SpecError, match="needs a name"):
        td.build({"schema": 1, "groups": []}, backend="cpu", build_dir=tmp_path)
    with pytest.raises(td.SpecError, match="unknown kernel set 'no_such_set'"):
        td.build("no_such_set", backend="cpu", arch=ARCH, build_dir=tmp_path)
    with pytest.raises(td.SpecError, match="KernelKeys"):
        td.build([42], backend="cpu", build_dir=tmp_path)
    assert not list(tmp_path.rglob("*.so")), "an illegal declaration started a build"


def test_failing_kernel_names_itself_and_its_compiler_output(tmp_path):
    root = copy_repo(tmp_path / "repo")
    relu = root / "runtime" / "tiledispatch" / "include" / "activations" / "relu.h"
    relu.write_text(relu.read_text() + "\nthis is not C++;\n")
    program = (
        "import sys, tiledispatch as td\n"
        "sets = [{'schema': 1, 'name': 'broken', 'groups': [{'backend': 'cpu', 'arch': 'x86v4', 'op': 'gemm',\n"
        "  'dtype': 'fp32', 'layout': 'rcr', 'pipeline': 'packed', 'tile': [48, 128, 128], 'mma': [6, 32, 1],\n"
        "  'epilogue': {'activation': 'relu'}}]}]\n"
        "try:\n"
        "    td.build(sets, backend='cpu', arch='x86v4', build_dir=sys.argv[1], cache_dir='none')\n"
        "except td.BuildError as e:\n"
        "    print('FAILURES', sorted(e.failures))\n"
        "    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", program, str(tmp_path / "build")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root / "runtime")}, timeout=600)
    assert "FAILURES ['gemm_fp32xfp32xfp32xfp32_rcr_relu_" in proc.stdout, proc.stdout + proc.stderr
    assert "1 kernel(s) failed to compile" in proc.stdout and "this is not C++" in proc.stdout
    assert "error" in proc.stdout.split("failed to compile", 1)[1]  # the compiler's own words


def _ccache_stats(ccache_dir: Path) -> dict:
    out = subprocess.run(["ccache", "--print-stats"], capture_output=True, text=True, check=True,
                         env={**os.environ, "CCACHE_DIR": str(ccache_dir)}).stdout
    return {name: int(value) for name, value in (line.split("\t") for line in out.splitlines() if "\t" in line)
            if value.isdigit()}


def _cache_entries(cache: Path) -> set[str]:
    return {p.name for p in cache.glob("*/*") if p.is_file() and not p.name.endswith(".sha256")}


@pytest.mark.skipif(shutil.which("ccache") is None, reason="ccache is not installed (apt-get install ccache; "
                    ".ci/run installs it)")
def test_launcher_ccache_hits_across_cold_build_dirs_and_stays_out_of_the_identity(tmp_path, monkeypatch):
    monkeypatch.setenv("CCACHE_DIR", str(tmp_path / "ccache"))
    decl = declaration("launched", epilogue={"activation": "silu"})
    first = Outcomes()
    td.build(decl, backend="cpu", arch=ARCH, build_dir=tmp_path / "b1", cache_dir=tmp_path / "c1", launcher="ccache",
             progress=first)
    assert first.count("compiled") == 1
    stats = _ccache_stats(tmp_path / "ccache")
    assert stats["cache_miss"] == 1 and stats.get("direct_cache_hit", 0) + stats.get("preprocessed_cache_hit", 0) == 0

    # a cold build directory and a fresh SCons cache: SCons compiles again, and the compile is a ccache hit
    second = Outcomes()
    td.build(decl, backend="cpu", arch=ARCH, build_dir=tmp_path / "b2", cache_dir=tmp_path / "c2",
             launcher=["ccache"], progress=second)
    assert second.count("compiled") == 1
    stats = _ccache_stats(tmp_path / "ccache")
    assert stats["cache_miss"] == 1 and stats["direct_cache_hit"] + stats.get("preprocessed_cache_hit", 0) == 1

    # the launcher never enters the build identity: the same cache entries without it, and a hit on the
    # launched build's cache from the command line without a launcher
    third = Outcomes()
    td.build(decl, backend="cpu", arch=ARCH, build_dir=tmp_path / "b3", cache_dir=tmp_path / "c3", progress=third)
    assert third.count("compiled") == 1
    assert _cache_entries(tmp_path / "c1") == _cache_entries(tmp_path / "c3") != set()
    proc = scons(REPO, f"kernels={tmp_path / 'b1' / 'launched' / 'launched.yaml'}", "backend=cpu", f"arch={ARCH}",
                 f"build_dir={tmp_path / 'b4'}", f"cache_dir={tmp_path / 'c1'}")
    assert summary(proc)["cached"] == 1


def test_launcher_that_is_not_there_is_refused(tmp_path):
    with pytest.raises(td.BuildError, match="no_such_launcher is not an executable on PATH"):
        td.build(declaration("nolaunch"), backend="cpu", arch=ARCH, build_dir=tmp_path, cache_dir="none",
                 launcher="no_such_launcher --flag")


JIT_PROGRAM = """
import json, logging, sys
import numpy as np
import tiledispatch as td

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
bundle, build_dir, cache_dir, ask_by_name = sys.argv[1:5]
rng = np.random.default_rng(5)
a = rng.uniform(-1, 1, (41, 19)).astype(np.float32)
b = np.asfortranarray(rng.uniform(-1, 1, (19, 27)).astype(np.float32))
res = rng.uniform(-1, 1, (41, 27)).astype(np.float32)
out = np.full((41, 27), np.nan, np.float32)
plain = td.load(bundle)
try:
    plain.gemm(a, b, out, residuals=[res])
    print("OFF-BY-DEFAULT: ran")
except td.UnsupportedProblemError:
    print("OFF-BY-DEFAULT: refused")
reg = td.load(bundle, jit={"build_dir": build_dir, "cache_dir": cache_dir})
n = len(reg)
if ask_by_name != "-":
    reg.kernel(ask_by_name)
reg.gemm(a, b, out, residuals=[res])
ref = a.astype(np.float64) @ b.astype(np.float64) + res
print("RESULT", json.dumps({"err": float(np.linalg.norm(out - ref) / np.linalg.norm(ref)), "added": len(reg) - n,
                            "names": [k.name for k in reg.kernels[n:]]}))
"""


def _jit(bundle, build_dir, cache_dir, ask_by_name="-"):
    proc = subprocess.run([sys.executable, "-c", JIT_PROGRAM, str(bundle), str(build_dir), str(cache_dir), ask_by_name],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO / "runtime"), "TD_TUNING_CACHE": "none"})
    assert proc.returncode == 0 and "RESULT" in proc.stdout, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    return proc.stdout, result


def test_jit_builds_a_missing_kernel_once_and_a_fresh_process_fetches_it(tmp_path):
    wait_for_prebuild()
    td.build("fp32_rcr_essential", backend="cpu", arch=ARCH, build_dir=tmp_path / "bundle",
             cache_dir=SESSION["cache_dir"])
    bundle, cache = tmp_path / "bundle" / "fp32_rcr_essential", tmp_path / "jit_cache"
    log, first = _jit(bundle, tmp_path / "jit1", cache)
    assert "OFF-BY-DEFAULT: refused" in log
    assert re.search(r"tiledispatch.jit: no kernel of the bundle runs gemm .* building gemm_fp32\S+ on demand", log)
    assert re.search(r"\[1/1\] compiled +gemm_fp32", log), log
    assert first["added"] == 1 and first["err"] < 1e-5 and "_identityres1_" in first["names"][0], first

    # a fresh process and a cold build directory: the same kernel, from the cache, asked for by its name first
    log, second = _jit(bundle, tmp_path / "jit2", cache, first["names"][0])
    assert "tiledispatch.jit: the bundle has no kernel gemm_fp32" in log, log
    assert re.search(r"\[1/1\] cached +gemm_fp32", log) and "1 kernel(s): 0 compiled, 1 from cache" in log, log
    assert second["names"] == first["names"] and second["err"] < 1e-5


def test_jit_refuses_what_no_legal_kernel_computes(tmp_path):
    wait_for_prebuild()
    td.build("fp32_rcr_essential", backend="cpu", arch=ARCH, build_dir=tmp_path, cache_dir=SESSION["cache_dir"])
    reg = td.load(tmp_path / "fp32_rcr_essential", jit={"build_dir": tmp_path, "cache_dir": "none"})
    problem = td.GemmProblem(m=8, n=8, k=8, dtype_a="fp32", dtype_b="fp32", dtype_c="fp16")  # no such combination
    with pytest.raises(td.UnsupportedProblemError, match="no kernel can run"):
        reg.select(problem)
    with pytest.raises(td.UnsupportedProblemError, match="sm90a kernel"):
        reg.kernel(reg.kernels[0].name.replace(f"cpu_{ARCH}", "cutlass_sm90a"))
    with pytest.raises(td.InvalidInputError, match="unknown no_such_option"):
        td.load(tmp_path / "fp32_rcr_essential", jit={"no_such_option": 1})


def test_build_and_jit_need_the_generator_only_when_used(tmp_path):
    wait_for_prebuild()
    td.build("fp32_rcr_essential", backend="cpu", arch=ARCH, build_dir=tmp_path, cache_dir=SESSION["cache_dir"])
    program = BLOCKER + (
        "import tiledispatch as td\n"
        "td.load(sys.argv[1])\n"
        "try:\n"
        "    td.load(sys.argv[1], jit=True)\n"
        "except td.InvalidInputError as e:\n"
        "    print('JIT', e)\n"
        "try:\n"
        "    td.build\n"
        "except ImportError as e:\n"
        "    print('BUILD', e)\n")
    proc = subprocess.run([sys.executable, "-c", program, str(tmp_path / "fp32_rcr_essential")], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO / "runtime")}, timeout=300)
    assert "JIT jit needs the generator" in proc.stdout and "BUILD blocked for this test" in proc.stdout, \
        proc.stdout + proc.stderr


HUNDRED = declaration("hundred", layout=["rcr", "rrr", "crr", "ccr"],
                      epilogue={"activation": ["identity", "relu", "gelu_tanh", "gelu_erf", "silu", "sigmoid", "tanh",
                                               "clamp"], "residuals": [0, 1, 2]})


@pytest.mark.slow
def test_cached_build_of_a_hundred_kernels_returns_quickly(tmp_path):
    """Target: a cached build of about 100 kernels returns from Python in <= 2 s (measured: README). The bound here
    is loose so that a loaded machine cannot fail it; it still catches a build that recompiles or rescans."""
    cache = tmp_path / "cache"
    td.build(HUNDRED, backend="cpu", arch=ARCH, build_dir=tmp_path / "first", cache_dir=cache)
    start = time.perf_counter()
    reg = td.build(HUNDRED, backend="cpu", arch=ARCH, build_dir=tmp_path / "first", cache_dir=cache)
    up_to_date = time.perf_counter() - start
    fetched = Outcomes()
    start = time.perf_counter()
    td.build(HUNDRED, backend="cpu", arch=ARCH, build_dir=tmp_path / "cold", cache_dir=cache, progress=fetched)
    from_cache = time.perf_counter() - start
    print(f"96 kernels: up to date {up_to_date:.2f} s, cold build dir from the cache {from_cache:.2f} s")
    assert len(reg) == 96 and fetched.count("cached") == 96
    assert up_to_date < 15 and from_cache < 30


@pytest.mark.gpu
def test_build_from_a_process_that_initialised_cuda(tmp_path):
    """The build runs in a spawned process, so a CUDA context in the caller is neither forked nor disturbed."""
    from tiledispatch import cuda

    try:
        devices = cuda.device_count()
    except Exception as e:  # noqa: BLE001 (any reason there is no usable CUDA runtime)
        pytest.skip(f"no CUDA runtime: {e}")
    if devices == 0:
        pytest.skip("no CUDA device")
    host = np.arange(64, dtype=np.float32)
    before = cuda.DeviceArray(host)  # a context and an allocation exist before the build
    wait_for_prebuild()
    reg = td.build("fp32_rcr_essential", backend="cpu", arch=ARCH, build_dir=tmp_path, cache_dir=SESSION["cache_dir"],
                   jobs=2)
    check_gemm(reg)
    assert np.array_equal(before.to_host(), host)


def test_jit_chooses_legal_keys_with_the_problems_signature():
    """The on-demand choice, without building: the problem's signature, algorithms from the preselected sets,
    those declared for the problem's own dtypes preferred, every candidate legal."""
    from tiledispatch.generator import jit, rules

    gemm = td.GemmProblem(m=64, n=64, k=64, dtype_a="bf16", dtype_b="bf16", dtype_c="bf16", layout="c*r",
                          epilogue=td.Epilogue(activation="gelu_erf", bias=True))
    keys = jit.candidate_keys(gemm, "cpu", ARCH, [])
    assert keys and all(gemm.mismatch(k) is None and not rules.check(k) for k in keys)
    assert {k.signature.layout for k in keys} == {"crr", "ccr"}  # '*': both
    bf16_tiles = {e.key.algorithm for e in __import__("tiledispatch.generator.kernelset", fromlist=["load"]).load(
        ["bf16_rcr_essential"], "cpu", ARCH)}
    assert {k.algorithm for k in keys} <= bf16_tiles  # the bf16 set's algorithms, not the fp16 or fp32 ones
    # a kernel the registry holds already and that refused the problem is not chosen again
    assert jit.candidate_keys(gemm, "cpu", ARCH, [], exclude={keys[0]}) == keys[1:]

    for arch in ("sm90a", "sm80"):  # a GPU backend's choice is made the same way (building it needs nvcc)
        fp16 = td.GemmProblem(m=512, n=512, k=512, dtype_a="fp16", dtype_b="fp16", dtype_c="fp16", layout="rrr",
                              epilogue=td.Epilogue(activation="silu", bias=True))
        keys = jit.candidate_keys(fp16, "cutlass", arch, [])
        assert keys and all(fp16.mismatch(k) is None and not rules.check(k) for k in keys), arch

    conv = td.ConvProblem(direction="bwd_data", n=2, g=1, c=16, k=32, in_size=(9, 9), filter_size=(3, 3),
                          stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype_x="fp32",
                          dtype_w="fp32", dtype_y="fp32")
    keys = jit.candidate_keys(conv, "cpu", ARCH, [])
    assert keys and all(conv.mismatch(k) is None and not rules.check(k) for k in keys)
    assert {(k.signature.direction, k.signature.spatial_dims, k.signature.dtype_a) for k in keys} == \
        {("bwd_data", 2, "fp32")}


@pytest.mark.gpu
def test_build_and_jit_on_the_gpu(tmp_path):
    """On a GPU machine, from a process where torch has initialised CUDA: td.build of a one-kernel cutlass set
    declared in memory, then a problem with an epilogue that kernel lacks, built on demand (one nvcc compile
    each; the first is skipped with $TD_CUTLASS_BUNDLE), run and checked against float64."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tiledispatch import backends
    from tiledispatch.generator import toolchains

    try:
        toolchains.get("cutlass").toolchain()
    except RuntimeError as e:
        pytest.skip(f"no cutlass toolchain: {e}")
    arch = backends.get("cutlass").detect_arch()
    a = (torch.rand((300, 256), device="cuda") * 2 - 1).half()  # CUDA is initialised before any build
    b = (torch.rand((256, 192), device="cuda") * 2 - 1).half()  # row-major: rrr, with silu (not in the bundles)
    bundle = os.environ.get("TD_CUTLASS_BUNDLE")
    if not bundle:
        config = ({"pipeline": "tma_ws_pingpong", "scheduler": "persistent", "tile": [64, 128, 64],
                   "warps": [4, 1, 1], "mma": [64, 128, 16]} if arch == "sm90a" else
                  {"pipeline": "multistage", "scheduler": "data_parallel", "tile": [128, 128, 32],
                   "warps": [2, 2, 1], "mma": [16, 8, 16]})
        decl = {"schema": 1, "name": "gpu_one", "groups": [
            {"backend": "cutlass", "arch": arch, "op": "gemm", "dtype": "fp16", "layout": "rcr",
             "epilogue": {"activation": "relu", "bias": True}, **config}]}
        reg = td.build(decl, backend="cutlass", arch=arch, build_dir=tmp_path / "b", cache_dir=tmp_path / "cache")
        bundle = tmp_path / "b" / "gpu_one"
        assert len(reg) == 1
    reg = td.load(bundle, jit={"build_dir": tmp_path / "jit", "cache_dir": tmp_path / "cache"})
    before = len(reg)
    out = torch.full((300, 192), float("nan"), device="cuda", dtype=torch.float16)
    reg.gemm(a, b, out, activation="silu")
    torch.cuda.synchronize()
    ref = torch.nn.functional.silu(a.double() @ b.double())
    assert len(reg) == before + 1 and "_rrr_silu_" in reg.kernels[-1].name
    assert float(torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref)) < 1e-2
