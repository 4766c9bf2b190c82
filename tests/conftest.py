"""Shared fixtures: a copy of the build inputs to edit freely, and a scons runner."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# tests never read or write the user's tuning records (tests of tuning pass their own cache)
os.environ["TD_TUNING_CACHE"] = "none"
BUILD_INPUTS = ("SConstruct", "site_scons", "runtime", "templates", "preselected", "kernel_specs")
# One scons cache for the bundles that fixtures build from the checkout (set by kernel_cache below): a kernel
# that several test bundles hold compiles once per session. Tests of caching pass their own.
SESSION = {}
CPU_GEMM_SETS = ("fp16_rcr_essential", "bf16_rcr_essential", "fp32_rcr_essential", "int8_rcr_essential",
                 "fp16_all_layouts", "fp16_rcr_fused")


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory, request):
    cache = SESSION["cache_dir"] = tmp_path_factory.mktemp("kernel_cache")
    if any("gemm_bundle" in item.fixturenames for item in request.session.items):
        # Compile the preselected GEMM kernels into the cache in the background, at low priority, while the
        # tests before gemm_bundle's first user run: those are mostly serial and leave a core idle.
        SESSION["prebuild"] = subprocess.Popen(
            [sys.executable, "-m", "SCons", "-Q", "-C", str(REPO), f"kernels={','.join(CPU_GEMM_SETS)}",
             "backend=cpu", f"build_dir={tmp_path_factory.mktemp('prebuild')}", f"cache_dir={cache}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
            preexec_fn=lambda: os.nice(10))
    yield cache
    if "prebuild" in SESSION:
        SESSION["prebuild"].kill()
        SESSION["prebuild"].wait()


def wait_for_prebuild() -> None:
    """Let the background compile of the GEMM kernels finish (its errors surface in the build that follows)."""
    prebuild = SESSION.get("prebuild")
    if prebuild is not None:
        prebuild.wait()


def copy_repo(dest: Path) -> Path:
    """The build inputs in dest, so a test can edit templates or sets without touching the checkout."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in BUILD_INPUTS:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True,  # runtime/tiledispatch/families -> templates
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def scons(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run scons in root; the runtime package comes from root (site_init puts it first on sys.path)."""
    cmd = [sys.executable, "-m", "SCons", "-Q", "-C", str(root), *args]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"scons failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def summary(proc: subprocess.CompletedProcess) -> dict:
    """The counts of the final 'N kernel(s): a compiled, b from cache, c up to date, d failed' line."""
    m = re.search(r"(\d+) kernel\(s\): (\d+) (?:compiled|checked), (\d+) from cache, (\d+) up to date, (\d+) failed",
                  proc.stdout)
    assert m, proc.stdout + proc.stderr
    total, compiled, cached, up_to_date, failed = map(int, m.groups())
    return {"total": total, "compiled": compiled, "cached": cached, "up_to_date": up_to_date, "failed": failed}


def toolchain_or_reason(backend):
    """(the backend's toolchain, "") or (None, why it is missing), for skipping compile tests."""
    try:
        return backend.toolchain(), ""
    except RuntimeError as e:
        return None, str(e)


def compile_keys(backend, toolchain, keys, out: Path, timeout: int = 900) -> dict:
    """Render and compile keys in parallel (one compiler process each) into out; {key: (library, log)}.
    A failing compile fails the caller with the compiler's output."""
    from tiledispatch.generator import codegen

    procs = {}
    for key in keys:
        src = out / codegen.source_name(key)
        src.write_text(codegen.render(key))
        lib = out / f"{key.name}.so"
        cmd = backend.compile_command(key, toolchain, str(src), str(lib), [str(d) for d in codegen.include_dirs(key)])
        procs[key] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), lib)
    built = {}
    for key, (proc, lib) in procs.items():
        log, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"compile failed for {key.name}:\n{log[-8000:]}"
        built[key] = (lib, log)
    return built


def compiled_names(proc: subprocess.CompletedProcess) -> set[str]:
    return set(re.findall(r"\] compiled (\S+)", proc.stdout))



def build_cpu_bundle(build: Path, name: str, set_text: str, *more_sets: str):
    """Write set_text as kernel set `name` in build, build it (with more_sets) for the cpu backend into
    build/name, through the session's kernel cache, and load the bundle."""
    import tiledispatch as td
    from tiledispatch import backends

    spec = build / f"{name}.yaml"
    spec.write_text(set_text)
    if set(more_sets) & set(CPU_GEMM_SETS):
        wait_for_prebuild()
    scons(REPO, f"kernels={','.join((*more_sets, str(spec)))}", "backend=cpu", f"arch={backends.get('cpu').detect_arch()}",
          f"build_dir={build}", f"cache_dir={SESSION.get('cache_dir', build / 'cache')}", f"bundle={name}")
    return td.load(build / name)


def build_preselected(tmp_path_factory, kernel_cache, set_name: str):
    """A preselected set built for the cpu backend through the session's kernel cache, loaded."""
    import tiledispatch as td

    build = tmp_path_factory.mktemp(f"{set_name}_build")
    scons(REPO, f"kernels={set_name}", "backend=cpu", f"build_dir={build}", f"cache_dir={kernel_cache}",
          f"bundle={set_name}")
    return td.load(build / set_name)


@pytest.fixture(scope="session")
def gemm_bundle(tmp_path_factory, kernel_cache) -> Path:
    """One cpu bundle holding every kernel of every preselected GEMM set."""
    build = tmp_path_factory.mktemp("gemm_build")
    wait_for_prebuild()
    scons(REPO, f"kernels={','.join(CPU_GEMM_SETS)}", "backend=cpu", f"build_dir={build}",
          f"cache_dir={kernel_cache}", "bundle=all")
    return build / "all"
