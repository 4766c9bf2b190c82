"""What the runtime's ranker would pick from a subset of a pointwise probe's kernels, from the probe's measured times
(no GPU): for each pool of tiles, the geometric mean over the probe's GEMMs of peer time / time of the kernel the
ranker (selection.learned, as Registry.select calls it) puts first among the pool's kernels that ran the GEMM, and
the same for the pool's fastest kernel (its oracle). Used to choose which of a probe set's tiles a kernel set gains
from without building one bundle per choice.

    python3 bench/benchmarks/pointwise_pools.py bench/results/pointwise_h200/pointwise_probe_set_h200.json \
        [--narrow 48] [--pool NAME=TILE,TILE ...]    # TILE: t<m>x<n>x<k> and p (pingpong) or c
                                                     # (cooperative), e.g. t256x64x64c
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from tiledispatch import selection  # noqa: E402
from tiledispatch.ops.gemm import GemmProblem  # noqa: E402
from tiledispatch.spec.key import Epilogue, parse_kernel_name  # noqa: E402

POOLS = {  # the conv set's pointwise tiles before and after bench/results/pointwise_h200, and every probe kernel
    "pingpong 128x64x64, 128x128x64": "t128x64x64p,t128x128x64p",
    "+ cooperative 256x64x64, 256x128x64": "t128x64x64p,t128x128x64p,t256x64x64c,t256x128x64c",
    "every probe kernel": "",
}


def tile_of(name: str) -> str:
    key = parse_kernel_name(name)
    return "t" + "x".join(map(str, key.algorithm.tile)) + ("c" if "cooperative" in key.algorithm.pipeline else "p")


def geomean(values: list) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def pool_quality(gemms: dict, tiles: set) -> tuple[float, float, float]:
    """(ranked geomean, its minimum, oracle geomean) of peer time / ours over the GEMMs a pool's kernel ran."""
    ranked, oracle = [], []
    for shape, row in gemms.items():
        names = [n for n in row["kernels"] if not tiles or tile_of(n) in tiles]
        if not names:
            continue
        m, n, k = map(int, shape.split("x"))
        problem = GemmProblem(m, n, k, "fp16", "fp16", "fp16", "rcr", 1, Epilogue("identity", True, 0))
        kernels = [SimpleNamespace(key=parse_kernel_name(name), name=name) for name in names]
        pick = selection.learned(problem, kernels)[0].name
        ranked.append(row["peer_ms"] / row["kernels"][pick]["ms"])
        oracle.append(row["peer_ms"] / min(row["kernels"][name]["ms"] for name in names))
    return geomean(ranked), min(ranked), geomean(oracle)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a pointwise_probe.py JSON of every kernel (not --selected-only)")
    ap.add_argument("--narrow", type=int, default=None, help="only GEMMs with N or K at most this")
    ap.add_argument("--pool", action="append", default=[], help="NAME=TILE,TILE (default: the pools above)")
    a = ap.parse_args()
    gemms = json.loads(Path(a.results).read_text())["gemms"]
    if a.narrow is not None:
        gemms = {s: row for s, row in gemms.items() if min(map(int, s.split("x")[1:])) <= a.narrow}
    pools = dict(p.split("=", 1) for p in a.pool) if a.pool else POOLS
    print(f"{len(gemms)} GEMMs; peer / ours, geometric mean (peer: the faster of cuDNN and cuBLAS)")
    for name, tiles in pools.items():
        ranked, worst, oracle = pool_quality(gemms, set(filter(None, tiles.split(","))))
        print(f"  {name:40s} ranked {ranked:.3f} (min {worst:.2f})  oracle {oracle:.3f}")


if __name__ == "__main__":
    main()
