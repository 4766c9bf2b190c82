"""A Markdown table from bench/benchmarks/conv.py's JSON, for bench/results/conv_h100.md; with several JSONs (runs of the
same suite in separate processes), each row keeps the fastest cuDNN time and the fastest of ours across them.

    python bench/reports/conv_report.py bench/results/conv_run3/conv_h100.json [more runs...]

Why merge: cudnn.benchmark picks cuDNN's algorithm once per process by timing candidates, and the pick moves
between processes (ResNet-50 3x3 bwd_data 27.5 vs 50.2 us in conv_run9), while ours move by 1-2%. Comparing
with cuDNN's best process is the conservative reading.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")
GROUPS = (("dense", lambda case: case.startswith(("resnet", "video", "conv1d")) and "depthwise" not in case),
          ("grouped_depthwise", lambda case: not (case.startswith(("resnet", "video")) or case == "conv1d")))
# (ours' time field, its speed-up field, the summary tag)
SPEEDUPS = (("best_ms", "speedup_best", ""), ("best_shipped_ms", "speedup_best_shipped", "_shipped"),
            ("selected_ms", "speedup_selected", "_selected"), ("best_single_ms", "speedup_best_single", "_single"))


def summarize(results: list[dict]) -> dict:
    """Geomean speed-ups per group (dense, grouped_depthwise), direction and kind (best, shipped, selected, single)."""
    summary = {}
    for label, pick in GROUPS:
        for direction in DIRECTIONS:
            for _, field, tag in SPEEDUPS:
                sp = [r[field] for r in results if pick(r["case"]) and r["direction"] == direction and field in r]
                if sp:
                    summary[f"{label}_{direction}_geomean{tag}"] = math.exp(sum(map(math.log, sp)) / len(sp))
    return summary


def merge(runs: list[dict]) -> dict:
    """Rows matched by (case, direction): the fastest cuDNN and the fastest of each of ours across the runs."""
    merged = []
    for rows in zip(*(run["results"] for run in runs)):
        assert len({(r["case"], r["direction"]) for r in rows}) == 1, "runs of different suites"
        row = dict(min(rows, key=lambda r: r.get("best_ms", math.inf)))
        row["cudnn_ms"] = min(r["cudnn_ms"] for r in rows)
        row["cudnn_single_ms"] = min(r["cudnn_single_ms"] for r in rows)
        if all("copy_ms" in r for r in rows):
            row["copy_ms"] = min(r["copy_ms"] for r in rows)
        for ms, field, _ in SPEEDUPS:
            if all(ms in r for r in rows):
                row[ms] = min(r[ms] for r in rows)
                row[field] = row["cudnn_single_ms" if ms == "best_single_ms" else "cudnn_ms"] / row[ms]
        merged.append(row)
    return {"machine": runs[0]["machine"], "runs": len(runs), "summary": summarize(merged), "results": merged}


def short(kernel: str) -> str:
    """The algorithm part of a conv kernel name: tile, warps, mma, pipeline."""
    parts = kernel.split("_")
    start = next(i for i, p in enumerate(parts) if p.startswith("t") and "x" in p)
    return "_".join(p for p in parts[start:] if not p.startswith(("sdata", "k1", "c1x1", "st0")))


def table(data: dict) -> str:
    # copy us: a device copy of the problem's minimum bytes; x cap = cuDNN / copy, the most a kernel can gain
    out = ["| case | dir | cuDNN us | ours us | TF/s ours | copy us | x cap | x ours (best) | x shipped | x selected "
           "| single cuDNN / ours us | x single | rel. error | best kernel |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in data["results"]:
        tflops = r["flops"] / (r["best_ms"] * 1e-3) / 1e12
        copy = (f"{r['copy_ms'] * 1e3:.1f} | {r['cudnn_ms'] / r['copy_ms']:.2f}" if "copy_ms" in r else "- | -")
        out.append(f"| {r['case']} | {r['direction']} | {r['cudnn_ms'] * 1e3:.1f} | {r['best_ms'] * 1e3:.1f} | {tflops:.1f} | "
                   f"{copy} | "
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
    loaded = [json.loads(Path(path).read_text()) for path in sys.argv[1:]]
    print(table(loaded[0] if len(loaded) == 1 else merge(loaded)))
