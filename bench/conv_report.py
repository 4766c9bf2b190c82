"""A Markdown table from bench/conv.py's JSON, for bench/results/conv_h100.md.

    python bench/conv_report.py bench/results/conv_run3/conv_h100.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def short(kernel: str) -> str:
    """The algorithm part of a conv kernel name: tile, warps, mma, pipeline."""
    parts = kernel.split("_")
    start = next(i for i, p in enumerate(parts) if p.startswith("t") and "x" in p)
    return "_".join(p for p in parts[start:] if not p.startswith(("sdata", "k1", "c1x1", "st0")))


def table(data: dict) -> str:
    out = ["| case | dir | cuDNN us | ours us | TF/s ours | x ours (best) | x shipped | x selected | single cuDNN / ours us "
           "| x single | rel. error | best kernel |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in data["results"]:
        tflops = r["flops"] / (r["best_ms"] * 1e-3) / 1e12
        out.append(f"| {r['case']} | {r['direction']} | {r['cudnn_ms'] * 1e3:.1f} | {r['best_ms'] * 1e3:.1f} | {tflops:.1f} | "
                   f"**{r['speedup_best']:.2f}** | {r['speedup_best_shipped']:.2f} | {r['speedup_selected']:.2f} | "
                   f"{r['cudnn_single_ms'] * 1e3:.0f} / {r['best_single_ms'] * 1e3:.0f} | {r['speedup_best_single']:.2f} | "
                   f"{r['best_rel_error']:.1e} | `{short(r['best_kernel'])}` |")
    s = data["summary"]
    out += ["", "Geomean speed-up vs cuDNN (ours = best of the bundles; shipped = the preselected set; selected = "
            "the ranker's pick in it; single = single calls):", "",
            "| group | direction | ours | shipped | selected | single |", "|---|---|---:|---:|---:|---:|"]
    for group in ("dense", "grouped_depthwise"):
        for d in ("fwd", "bwd_data", "bwd_weight"):
            k = f"{group}_{d}_geomean"
            out.append(f"| {group} | {d} | {s[k]:.2f} | {s[k + '_shipped']:.2f} | {s[k + '_selected']:.2f} | "
                       f"{s[k + '_single']:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table(json.loads(Path(sys.argv[1]).read_text())))
