"""LayerNorm through the public API against PyTorch's kernel and torch.compile's, on the generated suite
(bench/suites/layernorm.json, bench/suites/layernorm_suite.py).

    python3 bench/benchmarks/layernorm.py --bundle DIR [--dtype fp16] [--out DIR] [--budget-s 200]

Headline (per shape, and the geometric mean): back-to-back eager calls as a model makes them, host time included
(tiledispatch.torch.layer_norm against F.layer_norm and a torch.compile'd F.layer_norm, each given the same fp16
tensors), as the ratio best peer time / ours. Diagnostic beside it: the same calls replayed in CUDA graphs (10 per
graph), which leaves the kernels alone. Every output is checked first: ours and torch's against a float64
LayerNorm of the same input (relative error on the norm, the backends' validation tolerance), and ours against
torch's (largest difference). Shapes run in the suite's order of total uses, most used first, until the budget
(torch.compile compiles once per shape) is spent; the JSON says how many ran.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from _gpu_common import (TORCH_DTYPE, graph_us, machine, peer_suite, peer_summary, time_batch,  # noqa: E402
                         write_results)

import tiledispatch as td  # noqa: E402
import tiledispatch.torch as tdt  # noqa: E402
from tiledispatch import validation  # noqa: E402

EPS = 1e-6  # ConvNeXt's and ViT's (torchvision); GPT-2 and BERT use 1e-5 and 1e-12, which changes no timing


def inputs(rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator) -> tuple:
    """Rows with different means and spreads (both statistics matter), weight around 1, bias around 0."""
    x = torch.randn(rows, cols, generator=gen, device="cuda") * (0.5 + 3.5 * torch.rand(
        rows, 1, generator=gen, device="cuda")) + 6 * torch.rand(rows, 1, generator=gen, device="cuda") - 3
    w = 1 + 0.5 * torch.randn(cols, generator=gen, device="cuda")
    b = 0.5 * torch.randn(cols, generator=gen, device="cuda")
    return x.to(dtype), w.to(dtype), b.to(dtype)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def measure(shape: dict, reg, dtype: str, gen: torch.Generator) -> dict:
    rows, cols = shape["rows"], shape["cols"]
    x, w, b = inputs(rows, cols, TORCH_DTYPE[dtype], gen)
    # compiled for this shape: Inductor's kernel for rows marked dynamic ran 5-60x slower on the large-row shapes
    # (bench/results/layernorm_h200, dynamic_compile/), so the peer at its best is a static compile
    compiled = torch.compile(lambda t, g, s: F.layer_norm(t, (cols,), g, s, EPS), dynamic=False)
    variants = {"tiledispatch": lambda: tdt.layer_norm(x, (cols,), w, b, EPS, registry=reg),
                "torch": lambda: F.layer_norm(x, (cols,), w, b, EPS),
                "compile": lambda: compiled(x, w, b)}
    with torch.no_grad():
        ref = F.layer_norm(x.double(), (cols,), w.double(), b.double(), EPS)
        outs = {name: fn() for name, fn in variants.items()}
        tolerance = float(validation.tolerance(reg.select(td.LayerNormProblem(rows, cols, dtype, dtype, dtype)).key))
        errors = {name: rel_error(out, ref) for name, out in outs.items()}
        row = {"id": shape["id"], "rows": rows, "cols": cols, "uses": shape["uses"],
               "kernel": reg.select(td.LayerNormProblem(rows, cols, dtype, dtype, dtype)).name,
               "rel_error": errors, "tolerance": tolerance,
               "max_diff_vs_torch": float((outs["tiledispatch"].float() - outs["torch"].float()).abs().max()),
               "passed": errors["tiledispatch"] <= tolerance}
        batch = max(5, min(200, int(2e7 // (rows * cols))))  # about 20 M elements a batch: host-bound calls show
        row["eager_us"] = {name: 1e3 * time_batch(fn, batch, 7, warmup=3) for name, fn in variants.items()}
        row["graph_us"] = {name: graph_us(fn) for name, fn in variants.items()}
    row["gb_per_s"] = 2 * rows * cols * x.element_size() / (row["graph_us"]["tiledispatch"] * 1e3)
    return row


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    rows = results["shapes"]
    fig, ax = plt.subplots(figsize=(max(8, 0.28 * len(rows)), 4.5))
    xs = range(len(rows))
    ax.bar([i - 0.2 for i in xs], [r["eager_ratio"] for r in rows], 0.4, label="eager calls, host included")
    ax.bar([i + 0.2 for i in xs], [r["graph_ratio"] for r in rows], 0.4, label="CUDA graphs (kernels)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), [f"{r['rows']}x{r['cols']}" for r in rows], rotation=90, fontsize=6)
    ax.set_ylabel("best of torch / torch.compile time / ours")
    ax.set_title(f"LayerNorm {results['dtype']}, {results['machine']['gpu']}: geomean eager "
                 f"{results['summary']['eager_geomean']:.2f}x, graphs {results['summary']['graph_geomean']:.2f}x")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--suite", type=Path, default=ROOT / "bench" / "suites" / "layernorm.json")
    ap.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--out", default="/tmp")
    a = ap.parse_args(argv)
    torch._dynamo.config.cache_size_limit = 1024  # one compiled LayerNorm per shape
    reg = td.load(a.bundle)
    suite = json.loads(a.suite.read_text())
    shapes = sorted(suite["shapes"], key=lambda s: (-sum(s["uses"].values()), s["cols"], s["rows"]))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = peer_suite(shapes, lambda shape: measure(shape, reg, a.dtype, gen), a.budget_s)
    results = {"machine": machine(), "dtype": a.dtype, "eps": EPS, "bundle": str(a.bundle),
               "suite": str(a.suite.relative_to(ROOT)) if a.suite.is_relative_to(ROOT) else str(a.suite),
               "suite_shapes": len(shapes), "measured_shapes": len(rows),
               "summary": peer_summary(rows),
               "shapes": rows}
    print(json.dumps(results["summary"]))
    path = write_results(results, a.out, f"layernorm_{a.dtype}")
    plot(results, path.with_suffix(".png"))
    return 0 if results["summary"]["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
