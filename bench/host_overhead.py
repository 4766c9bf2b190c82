"""Host overhead per GEMM call on the GPU: tiledispatch's paths against a raw C call and torch.mm.

    python bench/host_overhead.py BUNDLE [--out DIR] [--tag h100]

What is measured is host issue time: the GPU is synchronized, then 200 calls are issued back to back
and the host clock is read when the last call returns (200 launches fit in the launch queue, so no call
waits for the GPU). Rounds interleave the paths in a shuffled order, so drift and noise hit them alike;
the median over rounds is reported. At 128^3 fp16. Paths: the raw td_run through ctypes with prebuilt
arguments (the floor: CUTLASS's own host work and the launch); torch.mm; Registry.gemm with a named
kernel on the current stream (the default), with an explicit stream, and with kernel selection (cached
after the first call); a Plan called with a dict.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gpu_common import Launcher, machine, operands, random_tensor  # noqa: E402  (puts runtime/ on the path)
import tiledispatch as td  # noqa: E402

CALLS, ROUNDS = 200, 41


def issue_us(fn) -> float:
    """Host microseconds per call for one burst of CALLS calls issued after a synchronize."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / CALLS * 1e6


def measure(paths: dict, rounds: int = ROUNDS, seed: int = 3) -> dict:
    for fn in paths.values():  # warm-up: plans, caches, lazy initialization
        for _ in range(50):
            fn()
    samples = {name: [] for name in paths}
    rng = random.Random(seed)
    for _ in range(rounds):
        order = list(paths)
        rng.shuffle(order)
        for name in order:
            samples[name].append(issue_us(paths[name]))
    return {name: {"median_us": statistics.median(v), "p10_us": sorted(v)[len(v) // 10],
                   "p90_us": sorted(v)[(9 * len(v)) // 10]} for name, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--tag", default="h100")
    a = ap.parse_args()
    reg = td.load(a.bundle)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    m = n = k = 128
    a16, bt = random_tensor((m, k), "fp16", gen), random_tensor((n, k), "fp16", gen)
    b = bt.t()
    d = torch.empty((m, n), dtype=torch.float16, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    problem, ops = operands(a16[None], b[None], d[None])
    kern = reg.select(problem)
    launcher = Launcher(kern)
    args = launcher.args(problem, ops, stream)
    plan = reg.plan(problem, kernel=kern.name)
    tensors = {"a": a16, "b": b, "out": d}
    paths = {
        "raw_c_call": lambda: kern.library.run(args),
        "torch_mm": lambda: torch.mm(a16, b, out=d),
        "gemm_named_kernel": lambda: reg.gemm(a16, b, out=d, kernel=kern.name),
        "gemm_explicit_stream": lambda: reg.gemm(a16, b, out=d, kernel=kern.name, stream=stream),
        "gemm_selected": lambda: reg.gemm(a16, b, out=d),
        "plan": lambda: plan(tensors),
    }
    result = measure(paths)
    raw = result["raw_c_call"]["median_us"]
    above = {name: round(r["median_us"] - raw, 3) for name, r in result.items() if name != "raw_c_call"}
    report = {"machine": machine(), "shape": [m, n, k], "dtype": "fp16", "kernel": kern.name,
              "method": f"host issue time: {CALLS} calls after a synchronize, clock read when the last returns; "
                        f"{ROUNDS} rounds, paths interleaved in shuffled order; median (p10, p90) over rounds",
              "paths": result, "above_raw_us": above}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"host_overhead_{a.tag}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"paths": result, "above_raw_us": above}, indent=1))


if __name__ == "__main__":
    main()
