"""Sweep the run-time raster order / swizzle parameters of sm90a kernels, and break down host time.

    python bench/sweeps/param_sweep.py BUNDLE_DIR [--out DIR]

For each shape and kernel of the bundle: every (raster, swizzle) in PARAMS, timed like bench/benchmarks/gemm.py
but in three interleaved passes (median of the pass medians), so clock drift hits every variant
alike. Writes param_sweep.json: the data behind the kernels' own choice for params 0.
Also times, per call, td_can_run, td_workspace_bytes and td_run at a tiny shape (host costs).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared modules, benchmarks/

from _gpu_common import Launcher, machine, operands, random_tensor
from benchmarks.gemm import Inputs, SHAPES, timed
from tiledispatch import cuda, load

PARAMS = [(0, 0)] + [(r, s) for r in (1, 2) for s in (1, 2, 4, 8)]
EXTRA_SHAPES = [(3072, 3072, 3072), (6144, 6144, 6144), (2048, 8192, 2048), (8192, 2048, 4096), (512, 4096, 4096),
                (64, 8192, 8192), (2048, 2048, 16384), (4096, 1024, 8192)]


def clocks() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return str(e)


def sweep_shape(reg, m, n, k, gen, stream, passes: int = 3) -> dict:
    inp = Inputs(m, n, k, "fp16", gen)
    problem, _ = operands(inp.a[0][None], inp.bt[0].t()[None], inp.d[0][None])
    ops = [operands(inp.a[j][None], inp.bt[j].t()[None], inp.d[j][None])[1] for j in range(inp.sets)]
    variants = []
    for kern in reg.kernels:
        if problem.mismatch(kern.key) is not None:
            continue
        launcher = Launcher(kern)
        for raster, swizzle in PARAMS:
            args = [launcher.args(problem, o, stream, raster=raster, swizzle=swizzle) for o in ops]
            if all(kern.library.can_run(a)[0] == 0 for a in args):
                variants.append((kern.name, raster, swizzle, launcher, args))
    samples = {v[:3]: [] for v in variants}
    for _ in range(passes):
        for name, raster, swizzle, launcher, args in variants:
            samples[(name, raster, swizzle)].append(
                timed(lambda i: launcher.run(args[i % inp.sets]), stream, repeats=7))
    flops = 2.0 * m * n * k
    return {"m": m, "n": n, "k": k, "tflops": {f"{n_}|r{r}s{s}": round(flops / (statistics.median(v) * 1e-3) / 1e12, 2)
                                               for (n_, r, s), v in samples.items()},
            "spread": max(max(v) / min(v) for v in samples.values())}


def host_costs(reg, gen, stream, calls: int = 2000) -> dict:
    a, bt = random_tensor((128, 128), "fp16", gen), random_tensor((128, 128), "fp16", gen)
    d = torch.empty((128, 128), dtype=torch.float16, device="cuda")
    problem, ops = operands(a[None], bt.t()[None], d[None])
    out = {}
    for kern in reg.kernels:
        launcher = Launcher(kern)
        args = launcher.args(problem, ops, stream)
        ref, lib = ctypes.byref(args), kern.library._lib
        buf = ctypes.create_string_buffer(256)
        costs = {}
        for label, fn in (("can_run", lambda: lib.td_can_run(ref, buf, 256)),
                          ("workspace_bytes", lambda: lib.td_workspace_bytes(ref)),
                          ("run", lambda: lib.td_run(ref, buf, 256))):
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            costs[label] = round((time.perf_counter() - t0) / calls * 1e6, 2)
        out[kern.name] = costs
    # what one driver entry-point lookup costs (CUTLASS does one per TMA descriptor without a cache)
    rt = cuda.runtime()
    fn = rt.cudaGetDriverEntryPointByVersion
    fn.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_ulonglong,
                   ctypes.POINTER(ctypes.c_int)]
    p, q = ctypes.c_void_p(), ctypes.c_int()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(b"cuTensorMapEncodeTiled", ctypes.byref(p), 12000, 0, ctypes.byref(q))
    out["cudaGetDriverEntryPointByVersion_us"] = round((time.perf_counter() - t0) / calls * 1e6, 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default="")
    opts = ap.parse_args()
    reg = load(opts.bundle)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(11)
    stream = torch.cuda.current_stream().cuda_stream
    result = {"machine": machine(), "bundle": opts.bundle, "clocks_start": clocks()}
    result["host_costs_us"] = host_costs(reg, gen, stream)
    print(json.dumps(result["host_costs_us"], indent=1), flush=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in opts.shapes.split(",")] if opts.shapes else SHAPES + EXTRA_SHAPES
    rows = []
    for m, n, k in shapes:
        row = sweep_shape(reg, m, n, k, gen, stream)
        rows.append(row)
        t = row["tflops"]
        default_best = max(v for key, v in t.items() if key.endswith("|r0s0"))
        best_key = max(t, key=t.get)
        print(f"{m:>5}x{n:>5}x{k:>5}  best default {default_best:6.1f}  best {t[best_key]:6.1f} "
              f"[{best_key.split('_sm90a_')[1]}]  spread {row['spread']:.2f}", flush=True)
    result["rows"], result["clocks_end"] = rows, clocks()
    Path(opts.out, "param_sweep.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
