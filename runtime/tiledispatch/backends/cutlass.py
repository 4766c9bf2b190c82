"""cutlass backend: CUTLASS 3.x collective-builder GEMMs (sm90a) and 2.x universal GEMMs (sm80); grouped
convolution kernels of the project's own (cutlass_conv.py).

Headers come from the `nvidia-cutlass` wheel (`pip install --no-deps nvidia-cutlass`), whose version
enters every build identity together with nvcc's. Building needs nvcc only, never a GPU.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

from ..spec import rules
from ..spec.dtypes import dtype
from ..spec.key import KernelKey
from . import Toolchain, cutlass_conv, tool_output

SOURCE_SUFFIX = ".cu"
JOB_MEMORY_BYTES = 3_900 * 2**20  # measured nvcc peaks: 3.1-3.8 GB per sm90a instantiation (fused epilogues highest), ~1.2 GB sm80

# our dtype names -> CUTLASS element types (sm80 reads fp32 operands as tf32)
_CTYPE = {
    "fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t", "fp32": "float", "int8": "int8_t",
    "int32": "int32_t", "fp8e4m3": "cutlass::float_e4m3_t", "fp8e5m2": "cutlass::float_e5m2_t",
}
_LAYOUT = {"r": "cutlass::layout::RowMajor", "c": "cutlass::layout::ColumnMajor"}
_SM90_SCHEDULE = {  # pipeline -> (kernel schedule, epilogue schedule)
    "tma_ws_cooperative": ("cutlass::gemm::KernelTmaWarpSpecializedCooperative",
                           "cutlass::epilogue::TmaWarpSpecializedCooperative"),
    "tma_ws_pingpong": ("cutlass::gemm::KernelTmaWarpSpecializedPingpong", "cutlass::epilogue::TmaWarpSpecialized"),
}
_SM90_TILE_SCHEDULER = {"persistent": "cutlass::gemm::PersistentScheduler",
                        "stream_k": "cutlass::gemm::StreamKScheduler"}


def templates(key: KernelKey) -> list[str]:
    if key.signature.op == "conv":
        return cutlass_conv.templates(key)
    main = "gemm_sm90.cu.j2" if key.arch == "sm90a" else "gemm_sm80.cu.j2"
    return [main, "_common.j2", "_epilogue.j2"]


def _sm80_stages(key: KernelKey) -> int:
    """stages 0 (auto): as many as fit in shared memory, 3..4 (more buys nothing on A100)."""
    alg, sig = key.algorithm, key.signature
    if alg.stages:
        return alg.stages
    per_stage = (alg.tile[0] * dtype(sig.dtype_a).itemsize + alg.tile[1] * dtype(sig.dtype_b).itemsize) * alg.tile[2]
    return max(3, min(4, rules.archs("cutlass")["sm80"]["smem_bytes"] // per_stage))


def context(key: KernelKey) -> dict:
    if key.signature.op == "conv":
        return cutlass_conv.context(key)
    sig, alg = key.signature, key.algorithm
    int_out = dtype(sig.dtype_c).kind == "int"
    ctype = {role: _CTYPE[getattr(sig, f"dtype_{role}")] for role in ("a", "b", "c", "acc")}
    if key.arch == "sm80" and sig.dtype_a == "fp32":
        ctype["a"] = ctype["b"] = "cutlass::tfloat32_t"  # same bits as float; the mma reads tf32
    ctx = {
        "ctype": ctype,
        "code": {role: dtype(getattr(sig, f"dtype_{role}")).code for role in ("a", "b", "c")},
        "layout_tag": {role: _LAYOUT[getattr(sig, f"layout_{role}")] for role in ("a", "b", "c")},
        # elements per 16-byte access: TMA and cp.async need 16-byte aligned rows and pointers
        "align": {role: 16 // dtype(getattr(sig, f"dtype_{role}")).itemsize for role in ("a", "b", "c")},
        # the epilogue computes in double for int32 output so results stay exact past 2^24
        "compute": "double" if int_out else "float",
        "int_out": int_out,
        "residuals": list(range(sig.epilogue.residuals)),
    }
    if key.arch == "sm90a":
        kernel_schedule, epilogue_schedule = _SM90_SCHEDULE[alg.pipeline]
        if alg.extra("cutlass.fp8_fast_accum", False):
            kernel_schedule += "FP8FastAccum"
        ctx.update(kernel_schedule=kernel_schedule, epilogue_schedule=epilogue_schedule,
                   tile_scheduler=_SM90_TILE_SCHEDULER[alg.scheduler], **_sm90_default_params(key))
    else:
        ctx.update(stages=_sm80_stages(key),
                   warp_tile=[t // w for t, w in zip(alg.tile, alg.warps)],
                   math_op="cutlass::arch::OpMultiplyAddSaturate" if sig.dtype_a == "int8"
                   else "cutlass::arch::OpMultiplyAdd")
    return ctx


def _sm90_default_params(key: KernelKey) -> dict:
    """The tile order a kernel uses when the caller leaves ABI params 0 / 1 at 0.

    Raster along M when a tile is at least as wide as tall: neighbouring CTAs then share the larger B
    panel (CUTLASS's own heuristic looks at tile counts only). 64-row tiles without a cluster also
    group CTAs in bands of 2 (swizzle). Measured on the H100 (bench/param_sweep.py): +20-55% for the
    64-row pingpong tiles on large and long-K problems, neutral within noise for the large tiles.
    """
    tm, tn, _ = key.algorithm.tile
    small = tm == 64 and key.algorithm.cluster == (1, 1, 1)
    return {"default_raster": "AlongM" if tn >= tm else "Heuristic", "default_swizzle": 2 if small else 1}


# ---- toolchain -------------------------------------------------------------------------------

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


def compile_flags(key: KernelKey, tc: Toolchain) -> list[str]:
    gencode = rules.archs("cutlass")[key.arch]["gencode"]
    return ["-std=c++17", "-O3", "-DNDEBUG", f"-gencode={gencode}", "--expt-relaxed-constexpr",
            "--cudart=static", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", "-shared"]


def compile_command(key: KernelKey, tc: Toolchain, source: str, output: str, include_dirs) -> list[str]:
    incs = [f"-I{d}" for d in include_dirs]
    third_party = [arg for d in tc.include_dirs for arg in ("-isystem", d)]
    return [tc.compiler, *compile_flags(key, tc), *incs, *third_party, source, "-o", output]


# ---- device ----------------------------------------------------------------------------------

def _has_gpu() -> bool:
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def available() -> tuple[bool, str]:
    if _nvcc() is None:
        return False, "nvcc not found on PATH or in $CUDA_HOME/bin"
    if _cutlass_include_dirs() is None:
        return False, "CUTLASS headers missing (pip install --no-deps nvidia-cutlass)"
    if not _has_gpu():
        return False, "no NVIDIA GPU (/dev/nvidia0, nvidia-smi)"
    return True, "nvcc, CUTLASS headers and an NVIDIA GPU found"


@functools.lru_cache(maxsize=None)
def _compute_capability() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _arch_of(cc: str) -> str | None:
    if cc == "9.0":
        return "sm90a"
    if cc.startswith("8."):
        return "sm80"
    return None


def detect_arch() -> str | None:
    """sm90a for compute capability 9.0, sm80 for 8.x, None without a (supported) GPU."""
    cc = _compute_capability()
    return _arch_of(cc) if cc else None


def runnable(arch: str) -> tuple[bool, str]:
    """sm90a code (wgmma, sm_90a SASS) runs on compute capability 9.0 only. sm80 kernels carry sm_80
    SASS plus compute_80 PTX, so they also run (JIT-compiled by the driver) on newer GPUs."""
    cc = _compute_capability()
    if cc is None:
        return False, "no NVIDIA GPU found (nvidia-smi)"
    major, minor = (int(x) for x in cc.split("."))
    if arch == "sm90a":
        return (True, "") if (major, minor) == (9, 0) else (False, f"sm90a kernels need compute capability 9.0, this GPU has {cc}")
    if arch == "sm80":
        return (True, "") if major >= 8 else (False, f"sm80 kernels need compute capability >= 8.0, this GPU has {cc}")
    return False, f"unknown cutlass arch {arch!r}"
