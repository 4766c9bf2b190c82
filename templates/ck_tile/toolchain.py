"""The ck_tile backend's toolchain (the generator's half of the backend, tiledispatch.generator.toolchains).

Two ways to compile a rendered source:

* a real build (toolchain / compile_command): hipcc or amdclang++ from $ROCM_PATH, CK Tile headers from
  $CK_TILE_INCLUDE or ROCm's include directory; one .so per kernel with the tiledispatch C ABI.
* a compile check without ROCm (check_toolchain / check_command), after
  shared/reference/cktile_compile_check.md: Debian clang-19 (zig's clang 22 for gfx950) parses the source
  for the key's own arch, instantiates every template, evaluates every static_assert and generates device
  LLVM IR. It is a front-end and IR-generation check, not a build: no machine code, no .so.
  .ci/install_ck_check.sh installs its pieces under ~/.cache/tiledispatch/ck_check (TD_CK_CHECK_DIR).
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tiledispatch.abi import INCLUDE_DIR   # tiledispatch_abi.h
from tiledispatch.drivers import rocm_path
from tiledispatch.generator.toolchains import Toolchain, tool_output

SOURCE_SUFFIX = ".hip"
JOB_MEMORY_BYTES = 2 * 2**30          # measured: a compile check peaks near 1 GiB; a -O3 build needs more


# ---- real build (ROCm) -------------------------------------------------------------------------------
def _rocm_path() -> Path:
    return rocm_path()


def _find_hip_compiler() -> str | None:
    """$HIPCC, else hipcc, else amdclang++ (as a HIP compiler) from $ROCM_PATH."""
    if os.environ.get("HIPCC"):
        return shutil.which(os.environ["HIPCC"])
    rocm = _rocm_path()
    for cand in (rocm / "bin" / "hipcc", rocm / "bin" / "amdclang++", rocm / "llvm" / "bin" / "amdclang++"):
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return None


def _find_ck_include() -> Path | None:
    for cand in (os.environ.get("CK_TILE_INCLUDE"), str(_rocm_path() / "include")):
        if cand and (Path(cand) / "ck_tile" / "core.hpp").is_file():
            return Path(cand)
    return None


@functools.lru_cache(maxsize=None)
def _tree_hash(root: str, sub: str) -> str:
    """Content hash of a header tree: third-party headers enter the build identity by content."""
    h = hashlib.sha256()
    base = Path(root)
    for p in sorted((base / sub).rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(base)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def _first_line(cmd: list[str]) -> str:
    return tool_output(cmd, "ck_tile backend: a tool does not work").splitlines()[0].strip()


def _version_lines(cmd: list[str]) -> str:
    """Every line of `cmd --version` (hipcc prints the HIP version, then the clang version)."""
    out = tool_output(cmd, "ck_tile backend: the HIP compiler does not work")
    return " | ".join(ln.strip() for ln in out.splitlines() if ln.strip())


@functools.lru_cache(maxsize=None)
def toolchain() -> Toolchain:
    cxx = _find_hip_compiler()
    if cxx is None:
        raise RuntimeError(f"ck_tile backend: no HIP compiler (hipcc or amdclang++) under ROCM_PATH={_rocm_path()}; "
                           "set ROCM_PATH or HIPCC (without ROCm, use the compile check: check=1)")
    ck = _find_ck_include()
    if ck is None:
        raise RuntimeError("ck_tile backend: CK Tile headers (ck_tile/core.hpp) not found in $CK_TILE_INCLUDE or "
                           f"{_rocm_path() / 'include'}")
    version_file = _rocm_path() / ".info" / "version"
    rocm_version = version_file.read_text().strip() if version_file.is_file() else "unknown"
    identity = (f"ck_tile build; compiler {cxx}: {_version_lines([cxx, '--version'])}; ROCm {rocm_version}; "
                f"ck_tile headers {ck} sha256:{_tree_hash(str(ck), 'ck_tile')}")
    return Toolchain(compiler=cxx, identity=identity, include_dirs=(str(ck),))


def compile_flags(key, tc: Toolchain) -> list[str]:
    flags = ["-x", "hip", "-std=c++20", "-O3", "-DNDEBUG", f"--offload-arch={key.arch}", "-fPIC", "-shared",
             "-fvisibility=hidden", "-Wno-unused-result",
             # CK's own build flag: keeps the noalias metadata conversion from slowing compiles down
             "-mllvm", "-enable-noalias-to-md-conversion=0"]
    if Path(tc.compiler).name.startswith("amdclang"):  # hipcc adds these itself
        flags += [f"--rocm-path={_rocm_path()}", "--hip-link"]
    return flags


def compile_command(key, tc: Toolchain, source: str, output: str, include_dirs) -> list[str]:
    incs = [f"-isystem{d}" for d in tc.include_dirs] + [f"-I{d}" for d in include_dirs]
    return [tc.compiler, *compile_flags(key, tc), *incs, source, "-o", output]


def available() -> tuple[bool, str]:
    if _find_hip_compiler() is None:
        return False, f"no hipcc / amdclang++ under ROCM_PATH={_rocm_path()}"
    if _find_ck_include() is None:
        return False, "no CK Tile headers (set CK_TILE_INCLUDE)"
    return True, "ROCm compiler and CK Tile headers found"


# ---- compile check (no ROCm) -------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckToolchain(Toolchain):
    """The compile check's pieces: clang-19 (compiler), zig for gfx950, clang-19's resource dir."""
    zig: str = ""
    resource_dir: str = ""


# archs Debian's clang-19 generates code for; the others go to zig's clang 22
_CLANG19_ARCHS = ("gfx90a", "gfx942")


def _check_dir() -> Path:
    return Path(os.environ.get("TD_CK_CHECK_DIR", Path.home() / ".cache" / "tiledispatch" / "ck_check"))


@functools.lru_cache(maxsize=None)
def check_toolchain() -> CheckToolchain:
    """Finds what .ci/install_ck_check.sh installs (or TD_CLANG19, TD_ZIG, TD_CK_TILE_INCLUDE,
    TD_HIP71_INCLUDE); RuntimeError naming the missing piece and the script otherwise."""
    d = _check_dir()
    hint = "run .ci/install_ck_check.sh (or set TD_CLANG19 / TD_ZIG / TD_CK_TILE_INCLUDE / TD_HIP71_INCLUDE)"
    clang = os.environ.get("TD_CLANG19") or shutil.which("clang-19") or "/usr/lib/llvm-19/bin/clang"
    zig = os.environ.get("TD_ZIG") or str(d / "zig" / "zig")
    ck = Path(os.environ.get("TD_CK_TILE_INCLUDE") or d / "ck")
    hip = Path(os.environ.get("TD_HIP71_INCLUDE") or d / "triton_hip")
    missing = [what for what, ok in (
        (f"clang-19 ({clang})", Path(clang).is_file()),
        (f"zig ({zig})", Path(zig).is_file()),
        (f"CK Tile headers ({ck}/ck_tile/core.hpp)", (ck / "ck_tile" / "core.hpp").is_file()),
        (f"HIP 7.1 headers ({hip}/hip/hip_runtime.h)", (hip / "hip" / "hip_runtime.h").is_file()),
        ("Debian HIP headers (/usr/include/hip, libamdhip64-dev)", Path("/usr/include/hip/hip_version.h").is_file()),
    ) if not ok]
    if missing:
        raise RuntimeError("ck_tile compile check: missing " + ", ".join(missing) + "; " + hint)
    resource_dir = tool_output([clang, "-print-resource-dir"], "ck_tile compile check: clang-19 does not work")
    versions = d / "versions.txt"
    identity = "; ".join([
        "ck_tile compile check (front end + LLVM IR, -O0; not a build)",
        _first_line([clang, "--version"]),
        "zig " + _first_line([zig, "version"]) + " / " + _first_line([zig, "clang", "--version"]),
        "wheels " + (versions.read_text().replace("\n", " ").strip() if versions.is_file() else "unrecorded"),
        f"ck_tile headers sha256:{_tree_hash(str(ck), 'ck_tile')}",
        f"HIP headers sha256:{_tree_hash(str(hip), 'hip')}",
    ])
    return CheckToolchain(compiler=clang, identity=identity, include_dirs=(str(ck), str(hip)), zig=zig,
                          resource_dir=resource_dir)


def check_command(key, tc: CheckToolchain, source: str, output: str) -> list[str]:
    """The recipe's command for the key's own arch (device code guarded by arch macros compiles to
    nothing for another arch). The device IR (tens of MB) goes to /dev/null; on success `output`
    becomes a one-line stamp."""
    ck, hip = tc.include_dirs
    front = [tc.compiler] if key.arch in _CLANG19_ARCHS else [tc.zig, "clang"]
    compile_ = [*front, "-target", "x86_64-linux-gnu", "-resource-dir", tc.resource_dir, "--rocm-path=/usr",
                "-isystem", hip, "-x", "hip", "-std=c++20", "-DNDEBUG", "-nogpulib", "--cuda-device-only",
                "-isystem", ck, f"-I{INCLUDE_DIR}", f"--offload-arch={key.arch}",
                "-emit-llvm", "-S", "-O0", "-o", "/dev/null", source]
    stamp = f"ck_tile compile check passed for {key.arch} (front end + device IR, not a build)"
    return ["sh", "-c", f'"$@" && echo "{stamp}" > "$0"', output, *compile_]
