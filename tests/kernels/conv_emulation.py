"""Run cutlass conv kernels on the CPU: a rendered kernel compiled by g++ against tests/kernels/emulate/td_emulate.h
(every GPU thread an OS thread, barriers for __syncthreads / ldmatrix / mma.sync), called through the C ABI
on numpy arrays. It checks the kernels' index arithmetic and host-side checks without a GPU; it says
nothing about speed. Used by tests/kernels/test_cutlass_conv_emulated.py and runnable by hand:

    python tests/kernels/conv_emulation.py            # a wider matrix than CI runs
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "runtime"))

from tiledispatch import abi, validation  # noqa: E402
from tiledispatch.generator import codegen  # noqa: E402
from tiledispatch.ops import conv  # noqa: E402
from tiledispatch.spec.key import Algorithm, Epilogue, KernelKey, Signature  # noqa: E402

_LAUNCH = re.compile(r"([\w:]+)<<<(.*?)>>>\(")


def cuda_include() -> str | None:
    nvcc = shutil.which("nvcc")
    for root in filter(None, (os.environ.get("CUDA_HOME"), nvcc and str(Path(os.path.realpath(nvcc)).parents[1]),
                              "/usr/local/cuda")):
        if Path(root, "include", "cuda_fp16.h").is_file():
            return str(Path(root, "include"))
    return None


def conv_key(direction, rank, pipeline, tile, mma, warps, dtype="fp16", cpg=0, kpg=0, stages=0, fx=0, fy=0,
             extras=(), epilogue=Epilogue()) -> KernelKey:
    extras += (("cutlass.cpg", cpg), ("cutlass.kpg", kpg)) if cpg else ()
    extras += (("cutlass.fx", fx),) if fx else ()
    extras += (("cutlass.fy", fy),) if fy else ()
    return KernelKey(Signature("conv", dtype, dtype, dtype, "fp32", "nhwgc", epilogue, direction, rank),
                     Algorithm(tuple(tile), pipeline, tuple(warps), tuple(mma), "data_parallel", 1, (1, 1, 1), stages,
                               extras), "cutlass", "sm90a")


def build(key: KernelKey, out_dir: Path, smem_limit: int | None = None) -> abi.KernelLibrary:
    """The key's kernel as an emulated (host) shared library; smem_limit overrides the arch's shared memory
    (small values force the kernels' fallbacks: one halo buffer, one halo plane at a time)."""
    src = codegen.render(key)
    src = _LAUNCH.sub(lambda m: f"td_emu::launch({m.group(1)}, {m.group(2)}, ", src)
    suffix = ""
    if smem_limit:
        src, count = re.subn(r"constexpr int SMEM_LIMIT = \d+;", f"constexpr int SMEM_LIMIT = {smem_limit};", src)
        assert count == 1
        suffix = f"_smem{smem_limit}"
    path = out_dir / f"{key.name}{suffix}.cpp"
    path.write_text(src)
    lib = out_dir / f"{key.name}{suffix}.so"
    cmd = ["g++", "-std=c++20", "-O1", "-DTD_EMULATE", "-include", "td_emulate.h", f"-I{HERE / 'emulate'}",
           *(f"-I{d}" for d in codegen.include_dirs(key)), f"-I{cuda_include()}", "-w", "-shared", "-fPIC", "-pthread",
           "-Wl,-Bsymbolic",  # the emulated CUDA API binds here, not to a real libcudart loaded in the process
           str(path), "-o", str(lib)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"g++ failed for {key.name}:\n{proc.stderr[-6000:]}")
    return abi.KernelLibrary(lib)


# (G, C/G, K/G)
KINDS = {"dense": (1, 24, 16), "g4": (4, 4, 4), "g16": (3, 16, 16), "g64": (2, 64, 8), "depthwise": (9, 1, 1),
         "multiplier": (5, 1, 2), "odd": (3, 3, 5), "g2": (12, 2, 2), "g8": (3, 8, 8), "g4x3": (3, 4, 4),
         "g32": (2, 32, 32), "c4": (1, 4, 12),
         # few input channels, many outputs (direct_mma's few-channel form: RGB stems, raw-audio front ends)
         "c3k16": (1, 3, 16), "c3k32": (1, 3, 32), "c3k40": (1, 3, 40), "c1k24": (1, 1, 24), "g2c3k32": (2, 3, 32),
         "c8k16": (1, 8, 16)}
# (stride, dilation, pad_lo, pad_hi) per dim, cut to the rank; every one pads asymmetrically
GEOMETRIES = {
    "s1d1": ((1, 1, 1), (1, 1, 1), (1, 0, 2), (0, 2, 1)),
    "s2d1": ((2, 2, 2), (1, 1, 1), (0, 1, 1), (2, 0, 0)),
    "s1d2": ((1, 1, 1), (2, 2, 2), (2, 1, 0), (1, 0, 3)),
    "s2d2": ((2, 2, 2), (2, 2, 2), (1, 2, 0), (0, 1, 2)),
}
# strides / dilations differing between H and W (2D: the last two entries), for the compile-time filter's
# register window, whose use depends on W's and (bwd_data) H's stride
MIXED_GEOMETRIES = {
    "sh2dw2": ((1, 2, 1), (1, 1, 2), (1, 2, 0), (2, 0, 1)),  # 2D: stride (2, 1), dilation (1, 2)
    "sw2dh2": ((1, 1, 2), (1, 2, 1), (0, 1, 2), (1, 2, 0)),  # 2D: stride (1, 2), dilation (2, 1)
}
SIZES = {1: (2, (23,), (3,)), 2: (2, (9, 10), (3, 2)), 3: (1, (5, 6, 7), (3, 2, 3))}  # N, spatial, filter


def case(rng, direction, rank, kind, geometry, dtype="fp16", sizes=None):
    """sizes: (N, spatial, filter) instead of SIZES[rank] (a compile-time filter needs its own)."""
    n, in_size, filt = sizes or SIZES[rank]
    g, cg, kg = KINDS[kind]
    stride, dilation, pad_lo, pad_hi = (v[-rank:] for v in {**GEOMETRIES, **MIXED_GEOMETRIES}[geometry])
    p = conv.ConvProblem(direction, n, g, g * cg, g * kg, in_size, filt, stride, dilation, pad_lo, pad_hi,
                         dtype, dtype, dtype)
    data, expect = validation.conv_case(p, rng)
    return p, data, expect


def run(lib: abi.KernelLibrary, key: KernelKey, p, data, alpha=1.0, beta=0.0):
    """(status, reason, output array) of one emulated launch on host arrays."""
    _, ops = conv.operands(p.direction, data["x"], data["w"], data["y"], stride=p.stride, dilation=p.dilation,
                           pad_lo=p.pad_lo, pad_hi=p.pad_hi, bias=data.get("bias"),
                           residuals=data.get("residuals", ()), activation=p.epilogue.activation)
    args = conv.make_args(p, key, ops, alpha=alpha, beta=beta, clamp=validation.VALIDATION_CLAMP)
    need = lib.workspace_bytes(args)
    ws = np.full(need // 4 + 4, np.nan, np.float32) if need else None
    if need:
        args.workspace, args.workspace_bytes = ws.ctypes.data, need
    status, reason = lib.run(args)
    return status, reason, data[conv.WRITES[p.direction]]


def check(lib, key, direction, rank, kind, geometry, seed=0, sizes=None):
    rng = np.random.default_rng(seed)
    p, data, expect = case(rng, direction, rank, kind, geometry, key.signature.dtype_a, sizes)
    status, reason, out = run(lib, key, p, data)
    if status != abi.OK:
        return {"passed": False, "status": status, "reason": reason, "problem": str(p)}
    result = validation.compare(out, expect, key)
    result["problem"] = str(p)
    return result


def main():
    import itertools
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="td_emu_"))
    keys = []
    for d, r in itertools.product(("fwd", "bwd_data", "bwd_weight"), (1, 2, 3)):
        tile = {1: (32, 16, 1), 2: (8, 16, 4), 3: (8, 16, 2)}[r]
        mm = 2 if d == "bwd_weight" else 4
        keys.append((conv_key(d, r, "direct", tile, (mm, 4, 1), (2, 1, 1)), ("g4", "depthwise", "multiplier", "odd")))
        keys.append((conv_key(d, r, "direct", tile, (mm, 4, 1), (2, 1, 1), cpg=4, kpg=4), ("g4",)))
        keys.append((conv_key(d, r, "direct", tile, (mm, 8, 1), (2, 1, 1), cpg=1, kpg=1), ("depthwise",)))
        keys.append((conv_key(d, r, "implicit_gemm", (32, 32, 32), (16, 8, 16), (2, 1, 1), stages=3),
                     ("dense", "g16", "g64")))
    failures = 0
    for key, kinds in keys:
        lib = build(key, tmp)
        for kind, geo in itertools.product(kinds, GEOMETRIES):
            d, r = key.signature.direction, key.signature.spatial_dims
            res = check(lib, key, d, r, kind, geo)
            ok = res["passed"]
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {key.name[:60]} {kind} {geo} {res.get('rel_error', res.get('reason'))}",
                  flush=True)
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
