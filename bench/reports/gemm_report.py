"""Markdown tables from bench/benchmarks/gemm.py's JSON (and bench/benchmarks/host_overhead.py's), for bench/results/*.md.

    python bench/reports/gemm_report.py bench/results/gemm_h100.json [bench/results/host_overhead_h100.json]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

MODES = ("selected", "autotuned", "analytic")


def gemm_tables(data: dict) -> str:
    out = []
    for label, info in data["bundles"].items():
        rows = [r for r in data["rows"] if r["registry"] == label]
        out += [f"### registry {label} ({info['kernels']} kernels)", "",
                "| M x N x K | cuBLAS TFLOP/s | selected (learned) | autotuned | analytic | best (params) "
                "| best / cuBLAS | selected / best | autotuned / best | analytic / best |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            p = r["best_params"]
            out.append(f"| {r['m']} x {r['n']} x {r['k']} | {r['cublas_tflops']:.1f} | {r['selected_tflops']:.1f} | "
                       f"{r['autotuned_tflops']:.1f} | {r['analytic_tflops']:.1f} | {r['best_tflops']:.1f} "
                       f"(r{p['raster']}s{p['swizzle']}) | {r['best_vs_cublas']:.2f} | "
                       + " | ".join(f"{r[f'{m}_vs_best']:.2f}" for m in MODES) + " |")
        s = data["summary"][label]
        out += ["", f"best / cuBLAS geomean {s['best_vs_cublas_geomean']:.3f}, at 8192^3 "
                f"{s['best_vs_cublas_8192']:.3f}; selected / cuBLAS geomean {s['selected_vs_cublas_geomean']:.3f}; "
                "min over shapes of pick / best: " + ", ".join(f"{m} {s[f'{m}_vs_best_min']:.3f}" for m in MODES), ""]
    return "\n".join(out)


def overhead_table(data: dict) -> str:
    out = [f"Host overhead ({data['method']}), {data['shape']} {data['dtype']}:", "",
           "| path | median us | p10 | p90 | above raw C call |", "|---|---:|---:|---:|---:|"]
    for name, r in data["paths"].items():
        above = data["above_raw_us"].get(name)
        out.append(f"| {name} | {r['median_us']:.2f} | {r['p10_us']:.2f} | {r['p90_us']:.2f} | "
                   f"{'' if above is None else f'{above:+.2f}'} |")
    return "\n".join(out)


def main() -> int:
    print(gemm_tables(json.loads(Path(sys.argv[1]).read_text())))
    if len(sys.argv) > 2:
        print(overhead_table(json.loads(Path(sys.argv[2]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
