"""cpu GEMM benchmark: tiledispatch (cpu backend) against numpy in the same run.

fp32 against numpy's BLAS (OpenBLAS) at 256..2048; fp16 and bf16 against numpy fp16 (numpy has no
BLAS path for fp16 and no bf16 matmul, so it is the baseline a numpy user has). Square rcr problems
(A row-major, B column-major, as in x @ w.T). Builds the preselected essential sets first.

    python bench/benchmarks/cpu_gemm.py [--sizes 256 512 1024 2048] [--out bench/results/cpu_gemm.json]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(REPO / "bench"))  # the shared modules

import tiledispatch as td  # noqa: E402
from _cpu_common import machine, median_ms, write_report  # noqa: E402
from tiledispatch import validation  # noqa: E402
from tiledispatch.ops import gemm as gemm_op  # noqa: E402
from tiledispatch.spec.dtypes import numpy_dtype  # noqa: E402

SETS = ("fp32_rcr_essential", "fp16_rcr_essential", "bf16_rcr_essential")
NUMPY_FP16_MAX = 1024  # numpy fp16 matmul runs at ~0.5 GFLOP/s: larger sizes take minutes






def build(build_dir: Path) -> Path:
    subprocess.run([sys.executable, "-m", "SCons", "-Q", "-C", str(REPO), f"kernels={','.join(SETS)}", "backend=cpu",
                    f"build_dir={build_dir}", "bundle=bench"], check=True, stdout=subprocess.DEVNULL)
    return build_dir / "bench"


def bench_dtype(reg, dtype: str, sizes, repeat: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        a = validation.random_array(rng, (n, n), dtype)
        w = validation.random_array(rng, (n, n), dtype)  # B = w.T: column-major, layout rcr
        out = np.empty((n, n), numpy_dtype(dtype))
        flops = 2 * n ** 3
        problem, _ = gemm_op.operands(a, w.T, out)
        selected = reg.select(problem)
        per_kernel = {k.name: median_ms(lambda k=k: reg.gemm(a, w.T, out, kernel=k), repeat) for k in reg.candidates(problem)}
        best = min(per_kernel, key=per_kernel.get)
        row = {"dtype": dtype, "m": n, "n": n, "k": n, "selected": selected.name,
               "selected_gflops": flops / per_kernel[selected.name] / 1e6,
               "best": best, "best_gflops": flops / per_kernel[best] / 1e6}
        if dtype == "fp32":
            row["numpy"] = "fp32 matmul (BLAS)"
            ms = median_ms(lambda: np.matmul(a, w.T), repeat)
        elif n <= NUMPY_FP16_MAX:
            a16, w16 = a.astype(np.float16), w.astype(np.float16)
            row["numpy"] = "fp16 matmul"
            ms = median_ms(lambda: np.matmul(a16, w16.T), 1 if n >= 1024 else repeat, warmup=0 if n >= 1024 else 1)
        else:
            ms = None
        if ms is not None:
            row["numpy_gflops"] = flops / ms / 1e6
            row["ratio_selected_vs_numpy"] = row["selected_gflops"] / row["numpy_gflops"]
        rows.append(row)
        print(f"{dtype:5s} {n:5d}: selected {row['selected_gflops']:7.1f} GFLOP/s, best {row['best_gflops']:7.1f}"
              + (f", numpy {row['numpy_gflops']:7.2f} (ratio {row['ratio_selected_vs_numpy']:.2f})" if ms else ""),
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--build-dir", type=Path, default=REPO / "build" / "bench")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu_gemm.json")
    a = ap.parse_args()
    reg = td.load(build(a.build_dir))
    results = []
    for dtype in ("fp32", "fp16", "bf16"):
        results += bench_dtype(reg, dtype, a.sizes, a.repeat)
    report = {"benchmark": "cpu_gemm", "date": time.strftime("%Y-%m-%d"), "machine": machine(),
              "method": f"median of {a.repeat} calls after 1 warm-up, host timer; square rcr problems",
              "results": results}
    write_report(a.out, report)


if __name__ == "__main__":
    main()
