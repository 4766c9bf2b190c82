"""cpu backend: portable C++17 with OpenMP, built with g++ (or $CXX)."""
from __future__ import annotations

import functools
import os
import shutil

from ..spec import rules
from ..spec.dtypes import dtype
from ..spec.key import KernelKey
from . import Toolchain, tool_output

SOURCE_SUFFIX = ".cpp"
JOB_MEMORY_BYTES = 400 * 2**20

# storage type of each dtype in generated C++ (fp16 / bf16 are raw bits, converted in the kernel)
_CTYPE = {"fp32": "float", "fp16": "uint16_t", "bf16": "uint16_t", "int8": "int8_t", "int32": "int32_t"}


def templates(key: KernelKey) -> list[str]:
    sig = key.signature
    if sig.op == "conv":  # one template per direction and pipeline; identity epilogue only (cpu.conv_epilogue)
        shared = ["_includes.j2", "_common.j2", "_conv_common.j2", "_microkernel.j2"]
        if key.algorithm.pipeline == "direct":
            return [f"conv_{sig.direction}_direct.cpp.j2", *shared, "_conv_direct.j2"]
        return [f"conv_{sig.direction}.cpp.j2", *shared]
    return [f"{sig.op}.cpp.j2", "_includes.j2", "_common.j2", "_microkernel.j2", "_epilogue.j2",
            f"activation/{sig.epilogue.activation}.j2"]


def context(key: KernelKey) -> dict:
    sig = key.signature
    arch = rules.archs("cpu")[key.arch]
    acc = dtype(sig.dtype_acc)
    return {
        "ctype": {role: _CTYPE[getattr(sig, f"dtype_{role}")] for role in ("a", "b", "c", "acc")},
        "code": {role: dtype(getattr(sig, f"dtype_{role}")).code for role in ("a", "b", "c", "acc")},
        # the epilogue computes in double where the output is an integer, so int32 results stay exact
        "ctype_compute": "double" if dtype(sig.dtype_c).kind == "int" else "float",
        "vector_bytes": arch["vector_bytes"],
        "vector_lanes": arch["vector_bytes"] // acc.itemsize,
    }


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


def compile_flags(key: KernelKey, tc: Toolchain) -> list[str]:
    march = rules.archs("cpu")[key.arch]["march"]
    return ["-std=c++17", "-O3", f"-march={march}", "-fopenmp", "-fPIC", "-shared",
            "-fvisibility=hidden", "-fno-math-errno", "-Wall", "-Werror=return-type"]


def compile_command(key: KernelKey, tc: Toolchain, source: str, output: str, include_dirs) -> list[str]:
    incs = [f"-I{d}" for d in include_dirs]
    return [tc.compiler, *compile_flags(key, tc), *incs, source, "-o", output]


def available() -> tuple[bool, str]:
    if shutil.which(_cxx()) is None:
        return False, f"no C++ compiler ({_cxx()}) on PATH"
    return True, f"{_cxx()} found"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# which /proc/cpuinfo flags each arch needs (x86-64 micro-architecture levels, abridged)
_ARCH_FLAGS = {
    "generic": set(),
    "x86v3": {"avx2", "fma", "f16c", "bmi2", "movbe"},
    "x86v4": {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"},
}


def detect_arch() -> str:
    have = _cpu_flags()
    for arch in ("x86v4", "x86v3"):
        if _ARCH_FLAGS[arch] <= have:
            return arch
    return "generic"


def runnable(arch: str) -> tuple[bool, str]:
    missing = _ARCH_FLAGS.get(arch, set()) - _cpu_flags()
    if missing:
        return False, f"this CPU lacks {', '.join(sorted(missing))}, needed by cpu arch {arch}"
    return True, ""
