"""Time every kernel of a GEMM bundle on many shapes: training and evaluation data for the learned ranker.

    python bench/sweeps/sweep_gemm.py BUNDLE_DIR --dtype fp16 --shapes 240 [--out bench/results/sweep_gemm_h100.json]

Shapes: the benchmark suite of bench/benchmarks/gemm.py (kept for evaluation as unseen shapes) plus `--shapes` random
ones (with --structured: model-like shapes, multiples of 128 with skinny and long-K cases) or ones drawn log-uniformly (M any integer 1..16384; N and K multiples of 8 up to 16384, as TMA needs 16-byte
rows; 40% of them at least 256 in every dimension), capped at about 2.2 TFLOP per call so that no shape dominates the run. Every kernel that can run a
shape is timed as bench/benchmarks/gemm.py times candidates (back-to-back launches between CUDA events, inputs
rotated over >= 3x L2, median of repeats), with the kernel's own raster/swizzle (params 0): exactly what
selection chooses among.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared modules, benchmarks/

from _gpu_common import Launcher, machine, operands  # noqa: E402
from benchmarks.gemm import SHAPES, Inputs, merged_registry, timed  # noqa: E402
from tiledispatch import abi  # noqa: E402

MAX_FLOP = 2.2e12


def random_shapes(count: int, seed: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        low = 8 if rng.random() < 0.4 else 0  # 40% large in every dim, the rest from tiny M / N / K up
        m = max(1, round(2 ** rng.uniform(low, 14)))
        n = 8 * max(1, round(2 ** rng.uniform(max(low, 3), 14) / 8))
        k = 8 * max(1, round(2 ** rng.uniform(max(low, 3), 14) / 8))
        if 2.0 * m * n * k <= MAX_FLOP and (m, n, k) not in out:
            out.append((m, n, k))
    return out


def structured_shapes(count: int, seed: int) -> list[tuple[int, int, int]]:
    """Shapes as models and layers have them: dimensions that are multiples of 64 or 128 (or small
    token counts for M), with skinny and long-K cases well represented."""
    rng = random.Random(seed)
    tokens = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    out = []
    while len(out) < count:
        kind = rng.choice(("square", "skinny_m", "skinny_n", "long_k", "any"))
        big = lambda lo=9: 128 * max(1, round(2 ** rng.uniform(lo, 14) / 128))  # noqa: E731
        if kind == "square":
            m = n = k = big(8)
        elif kind == "skinny_m":
            m, n, k = rng.choice(tokens), big(), big()
        elif kind == "skinny_n":
            m, n, k = big(), rng.choice(tokens[3:]), big()
        elif kind == "long_k":
            m, n, k = big(7), big(7), big(12)
        else:
            m, n, k = big(6), big(6), big(6)
        if 2.0 * m * n * k <= MAX_FLOP and (m, n, k) not in out:
            out.append((m, n, k))
    return out


def sweep_shape(reg, m: int, n: int, k: int, dtype: str, gen, stream: int) -> dict:
    inp = Inputs(m, n, k, dtype, gen)
    problem, _ = operands(inp.a[0][None], inp.bt[0].t()[None], inp.d[0][None])
    ops = [operands(inp.a[j][None], inp.bt[j].t()[None], inp.d[j][None])[1] for j in range(inp.sets)]
    times = {}
    for kern in reg.kernels:
        if problem.mismatch(kern.key) is not None:
            continue
        launcher = Launcher(kern)
        args = [launcher.args(problem, o, stream) for o in ops]
        if any(kern.library.can_run(a)[0] != abi.OK for a in args):
            continue
        times[kern.name] = timed(lambda i, args=args, launcher=launcher: launcher.run(args[i % inp.sets]), stream,
                                 target_ms=1.0, repeats=5)
    return {"m": m, "n": n, "k": k, "dtype": dtype, "times_ms": times}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="+")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--shapes", type=int, default=240, help="random shapes besides the benchmark suite")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--structured", action="store_true", help="model-like shapes instead of log-uniform ones")
    ap.add_argument("--budget-s", type=float, default=400, help="stop adding shapes after this long")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "sweep_gemm_h100.json"))
    a = ap.parse_args()
    reg = merged_registry(a.bundle)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(11)
    stream = torch.cuda.current_stream().cuda_stream
    suite = [(m, n, k, "suite") for m, n, k in SHAPES]
    draw, role = (structured_shapes, "structured") if a.structured else (random_shapes, "random")
    rows, start = [], time.time()
    for i, (m, n, k, role) in enumerate(suite + [(*s, role) for s in draw(a.shapes, a.seed)]):
        if time.time() - start > a.budget_s:
            print(f"time budget reached after {len(rows)} shapes", flush=True)
            break
        row = sweep_shape(reg, m, n, k, a.dtype, gen, stream)
        row["role"] = role
        rows.append(row)
        best = min(row["times_ms"].values()) if row["times_ms"] else float("nan")
        print(f"[{i + 1}] {m}x{n}x{k}: {len(row['times_ms'])} kernels, best {best:.4f} ms", flush=True)
        del row
        torch.cuda.empty_cache()
    report = {"machine": machine(), "dtype": a.dtype, "layout": "rcr", "kernels": [k.name for k in reg.kernels],
              "timing": "per kernel: median of 5 batches of back-to-back launches (about 1 ms each) between CUDA "
                        "events, inputs rotated over >= 3x L2; the kernel's own raster/swizzle",
              "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=0) + "\n")
    print(f"wrote {a.out}: {len(rows)} shapes in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
