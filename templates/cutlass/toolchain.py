"""The cutlass backend's toolchain: nvcc and the CUTLASS headers of the `nvidia-cutlass` wheel
(`pip install --no-deps nvidia-cutlass`), whose version enters every build identity together with nvcc's. Building
needs nvcc only, never a GPU. The generator's half of the backend (tiledispatch.generator.toolchains)."""
from __future__ import annotations

import functools
import os
import re
import shutil
from importlib import metadata
from pathlib import Path

from tiledispatch import backends
from tiledispatch.generator.toolchains import Toolchain, tool_output

SOURCE_SUFFIX = ".cu"
JOB_MEMORY_BYTES = 3_900 * 2**20  # measured nvcc peaks: 3.1-3.8 GB per sm90a instantiation (fused epilogues highest), ~1.2 GB sm80


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.access(Path(home, "bin", "nvcc"), os.X_OK):
        return str(Path(home, "bin", "nvcc"))
    return None


def _cutlass_include_dirs() -> tuple[str, ...] | None:
    try:
        import cutlass_library  # the nvidia-cutlass wheel; only its headers are used
    except ImportError:
        return None
    src = Path(cutlass_library.__file__).resolve().parent / "source"
    dirs = (src / "include", src / "tools" / "util" / "include")
    return tuple(str(d) for d in dirs) if (dirs[0] / "cutlass" / "cutlass.h").is_file() else None


def _cutlass_version() -> str:
    try:
        return metadata.version("nvidia-cutlass")
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=None)
def toolchain() -> Toolchain:
    nvcc = _nvcc()
    if nvcc is None:
        raise RuntimeError("cutlass backend: nvcc not found on PATH or in $CUDA_HOME/bin")
    incs = _cutlass_include_dirs()
    if incs is None:
        raise RuntimeError("cutlass backend: CUTLASS headers not found; install them with "
                           "`pip install --no-deps nvidia-cutlass`")
    out = tool_output([nvcc, "--version"], "cutlass backend: nvcc does not work")
    release = re.search(r"release [^\n]*", out)
    nvcc_version = release.group(0) if release else out.strip().splitlines()[-1]
    identity = f"nvcc {nvcc_version}; nvidia-cutlass {_cutlass_version()}"
    return Toolchain(compiler=nvcc, identity=identity, include_dirs=incs)


def compile_flags(key, tc: Toolchain) -> list[str]:
    gencode = backends.get("cutlass").archs[key.arch]["gencode"]
    return ["-std=c++17", "-O3", "-DNDEBUG", f"-gencode={gencode}", "--expt-relaxed-constexpr",
            "--cudart=static", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", "-shared"]


def compile_command(key, tc: Toolchain, source: str, output: str, include_dirs) -> list[str]:
    incs = [f"-I{d}" for d in include_dirs]
    third_party = [arg for d in tc.include_dirs for arg in ("-isystem", d)]
    return [tc.compiler, *compile_flags(key, tc), *incs, *third_party, source, "-o", output]


def available() -> tuple[bool, str]:
    """nvcc and the CUTLASS headers (the GPU is the driver's part: drivers.CudaDriver.present)."""
    if _nvcc() is None:
        return False, "nvcc not found on PATH or in $CUDA_HOME/bin"
    if _cutlass_include_dirs() is None:
        return False, "CUTLASS headers missing (pip install --no-deps nvidia-cutlass)"
    return True, "nvcc and CUTLASS headers found"
