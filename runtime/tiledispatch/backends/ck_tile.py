"""ck_tile backend: CK Tile GEMM and grouped-convolution sources for AMD gfx90a / gfx942 / gfx950.

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
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..spec import rules
from ..spec.dtypes import dtype
from ..spec.key import KernelKey
from . import Toolchain, tool_output

SOURCE_SUFFIX = ".hip"
JOB_MEMORY_BYTES = 2 * 2**30          # measured: a compile check peaks near 1 GiB; a -O3 build needs more
INCLUDE_DIR = Path(__file__).resolve().parents[1] / "include"   # tiledispatch_abi.h

# ---- symbol map: our names -> CK Tile C++ ------------------------------------------------------------
_CK_TYPE = {
    "fp16": "ck_tile::half_t", "bf16": "ck_tile::bf16_t", "fp32": "float", "int8": "ck_tile::int8_t",
    "int32": "ck_tile::int32_t",
    # CK's fp8_t / bf8_t are OCP on gfx950 and FNUZ before it (rule ck_tile.fp8_encoding keeps them apart)
    "fp8e4m3": "ck_tile::fp8_t", "fp8e5m2": "ck_tile::bf8_t",
}
_LAYOUT = {"r": "ck_tile::tensor_layout::gemm::RowMajor", "c": "ck_tile::tensor_layout::gemm::ColumnMajor"}
_PIPELINE = {  # ours -> (pipeline class, its base class with the tail dispatch)
    "mem": ("GemmPipelineAgBgCrMem", "BaseGemmPipelineAgBgCrMem"),
    "compv3": ("GemmPipelineAgBgCrCompV3", "BaseGemmPipelineAgBgCrCompV3"),
    "compv4": ("GemmPipelineAgBgCrCompV4", "BaseGemmPipelineAgBgCrCompV4"),
}
_DOUBLE_SMEM = {"mem": False, "compv3": False, "compv4": True}   # compv4 ping-pongs two LDS buffers
_SCHEDULER = {"intrawave": "Intrawave", "interwave": "Interwave", "default": "Default"}
# conv tensor layouts per spatial rank: input, weight, output (ck_tile::tensor_layout::convolution)
_CONV_LAYOUTS = {1: ("NWGC", "GKXC", "NWGK"), 2: ("NHWGC", "GKYXC", "NHWGK"), 3: ("NDHWGC", "GKZYXC", "NDHWGK")}
# per direction: which conv tensor is the implicit GEMM's A, B and C (X input, W weight, Y output)
_CONV_ROLES = {"fwd": ("X", "W", "Y"), "bwd_data": ("Y", "W", "X"), "bwd_weight": ("Y", "X", "W")}
_CONV_KERNEL = {"fwd": "GroupedConvolutionForwardKernel", "bwd_data": "GroupedConvolutionBackwardDataKernel",
                "bwd_weight": "GroupedConvolutionBackwardWeightKernel"}
_CONV_HOSTARGS = {"fwd": "GroupedConvFwdHostArgs<>", "bwd_data": "GroupedConvBwdDataHostArgs",
                  "bwd_weight": "GroupedConvBwdWeightHostArgs"}
_CONV_GEMM_TRAITS = {"fwd": "Fwd", "bwd_data": "BwdData", "bwd_weight": "BwdWeight"}
# per direction: the channel count (C or K, per group) each of A / B / C's vector accesses runs along,
# as CK's IsSupportedArgument checks them
_CONV_VECTOR_DIM = {"fwd": ("C", "C", "K"), "bwd_data": ("K", "C", "C"), "bwd_weight": ("K", "C", "C")}


def _extra(key: KernelKey, name: str):
    spec = rules.backend_rules("ck_tile")["extras"][name]
    return key.algorithm.extra(f"ck_tile.{name}", spec["default"])


def templates(key: KernelKey) -> list[str]:
    return [f"{key.signature.op}.hip.j2", "_common.j2", "_pipeline.j2"]


def context(key: KernelKey) -> dict:
    sig, alg = key.signature, key.algorithm
    arch = rules.archs("ck_tile")[key.arch]
    pipeline, base = _PIPELINE[alg.pipeline]
    ctx = {
        "ck_type": {r: _CK_TYPE[getattr(sig, f"dtype_{r}")] for r in ("a", "b", "c", "acc")},
        "dtype_code": {r: dtype(getattr(sig, f"dtype_{r}")).code for r in ("a", "b", "c")},
        "pipeline_class": pipeline, "pipeline_base": base,
        "double_smem": _DOUBLE_SMEM[alg.pipeline],
        "scheduler": _SCHEDULER[alg.scheduler],
        "cshuffle": _extra(key, "epilogue") == "cshuffle",
        "pad": {a: _extra(key, f"pad_{a}") for a in "mnk"},
        "persistent": _extra(key, "persistent"),
        "lds_bytes": arch["lds_bytes"],
        "arch_macro": f"__{key.arch}__",
    }
    if sig.op == "gemm":
        ctx["layout"] = {r: _LAYOUT[getattr(sig, f"layout_{r}")] for r in ("a", "b", "c")}
        ctx["row_major"] = {r: getattr(sig, f"layout_{r}") == "r" for r in ("a", "b", "c")}
    else:
        x, w, y = _CONV_LAYOUTS[sig.spatial_dims]
        dt = {"X": sig.dtype_a, "W": sig.dtype_b, "Y": sig.dtype_c}
        roles = _CONV_ROLES[sig.direction]
        vectors = {}
        for r, role in zip(("a", "b", "c"), roles):
            v = _extra(key, f"vector_{r}")
            vectors[r] = v or 16 // dtype(dt[role]).itemsize
        ctx.update({
            "conv_layout": {"in": x, "wei": w, "out": y},
            "gemm_roles": dict(zip(("a", "b", "c"), roles)),
            "gemm_type": {r: _CK_TYPE[dt[role]] for r, role in zip(("a", "b", "c"), roles)},
            "conv_kernel": _CONV_KERNEL[sig.direction],
            "conv_hostargs": _CONV_HOSTARGS[sig.direction],
            "conv_gemm_traits": _CONV_GEMM_TRAITS[sig.direction],
            "vector": vectors,
            "vector_dim": dict(zip(("a", "b", "c"), _CONV_VECTOR_DIM[sig.direction])),
        })
    return ctx


# ---- real build (ROCm) -------------------------------------------------------------------------------
def _rocm_path() -> Path:
    return Path(os.environ.get("ROCM_PATH", "/opt/rocm"))


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


def compile_flags(key: KernelKey, tc: Toolchain) -> list[str]:
    flags = ["-x", "hip", "-std=c++20", "-O3", "-DNDEBUG", f"--offload-arch={key.arch}", "-fPIC", "-shared",
             "-fvisibility=hidden", "-Wno-unused-result",
             # CK's own build flag: keeps the noalias metadata conversion from slowing compiles down
             "-mllvm", "-enable-noalias-to-md-conversion=0"]
    if Path(tc.compiler).name.startswith("amdclang"):  # hipcc adds these itself
        flags += [f"--rocm-path={_rocm_path()}", "--hip-link"]
    return flags


def compile_command(key: KernelKey, tc: Toolchain, source: str, output: str, include_dirs) -> list[str]:
    incs = [f"-isystem{d}" for d in tc.include_dirs] + [f"-I{d}" for d in include_dirs]
    return [tc.compiler, *compile_flags(key, tc), *incs, source, "-o", output]


def available() -> tuple[bool, str]:
    if _find_hip_compiler() is None:
        return False, f"no hipcc / amdclang++ under ROCM_PATH={_rocm_path()}"
    if _find_ck_include() is None:
        return False, "no CK Tile headers (set CK_TILE_INCLUDE)"
    if not os.path.exists("/dev/kfd"):
        return False, "no AMD GPU (/dev/kfd missing)"
    return True, "ROCm compiler, CK Tile headers and /dev/kfd found"


@functools.lru_cache(maxsize=None)
def detect_arch() -> str | None:
    """The first gfx arch rocminfo lists that this backend knows, or None."""
    rocminfo = shutil.which("rocminfo") or str(_rocm_path() / "bin" / "rocminfo")
    try:
        out = subprocess.run([rocminfo], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    known = rules.archs("ck_tile")
    for line in out.splitlines():
        words = line.replace(":", " ").split()
        for w in words:
            base = w.split(":")[0]
            if base in known:
                return base
    return None


def runnable(arch: str) -> tuple[bool, str]:
    found = detect_arch()
    if found is None:
        return False, "no AMD GPU found (rocminfo lists no gfx9 agent)"
    if found != arch:
        return False, f"this machine's GPU is {found}, kernels are built for {arch}"
    return True, ""


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


def check_command(key: KernelKey, tc: CheckToolchain, source: str, output: str) -> list[str]:
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
