"""The cpu backend's toolchain: g++ (or $CXX), C++17 with OpenMP. The generator's half of the backend
(tiledispatch.generator.toolchains); the runtime never imports it. No compile-check mode: a real build is cheap."""
from __future__ import annotations

import functools
import os
import shutil

from tiledispatch import backends
from tiledispatch.generator.toolchains import Toolchain, tool_output

SOURCE_SUFFIX = ".cpp"
JOB_MEMORY_BYTES = 400 * 2**20


def _cxx() -> str:
    return os.environ.get("CXX", "g++")


@functools.lru_cache(maxsize=None)
def toolchain() -> Toolchain:
    cxx = _cxx()
    path = shutil.which(cxx)
    if path is None:
        raise RuntimeError(f"cpu backend: C++ compiler {cxx!r} not found (set CXX or install g++)")
    version = tool_output([path, "--version"], f"cpu backend: C++ compiler {cxx!r} does not work (set CXX)")
    return Toolchain(compiler=path, identity=version.splitlines()[0].strip())


def compile_flags(key, tc: Toolchain) -> list[str]:
    march = backends.get("cpu").archs[key.arch]["march"]
    return ["-std=c++17", "-O3", f"-march={march}", "-fopenmp", "-fPIC", "-shared",
            "-fvisibility=hidden", "-fno-math-errno", "-Wall", "-Werror=return-type"]


def compile_command(key, tc: Toolchain, source: str, output: str, include_dirs) -> list[str]:
    incs = [f"-I{d}" for d in include_dirs]
    return [tc.compiler, *compile_flags(key, tc), *incs, source, "-o", output]


def object_command(key, tc: Toolchain, source: str, output: str, include_dirs) -> list[str]:
    """Compile only (the step a compiler launcher such as ccache can cache); link_command makes the library."""
    incs = [f"-I{d}" for d in include_dirs]
    return [tc.compiler, *(f for f in compile_flags(key, tc) if f != "-shared"), *incs, "-c", source, "-o", output]


def link_command(key, tc: Toolchain, obj: str, output: str) -> list[str]:
    return [tc.compiler, *compile_flags(key, tc), obj, "-o", output]


def available() -> tuple[bool, str]:
    if shutil.which(_cxx()) is None:
        return False, f"no C++ compiler ({_cxx()}) on PATH"
    return True, f"{_cxx()} found"
