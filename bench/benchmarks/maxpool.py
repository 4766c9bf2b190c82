"""Max pooling through the public API against PyTorch's kernel and torch.compile's, on the generated suite
(bench/suites/maxpool.json, bench/suites/pool_suite.py).

    python3 bench/benchmarks/maxpool.py --bundle DIR [--dtype fp16] [--out DIR] [--budget-s 200]

Headline (per shape, and the geometric mean): back-to-back eager calls as a model makes them, host time included
(tiledispatch.torch.max_pool against F.max_pool1d/2d/3d and a torch.compile'd one compiled for the shape, each
given the same channels-last tensor), as the ratio best peer time / ours. Diagnostic beside it: the same calls in
CUDA graphs (10 per graph), the kernels alone. Every output is checked first against F.max_pool's, element for
element (NaN inputs included). Shapes run in the suite's order of total uses, most used first, until the budget is
spent; the JSON says how many ran.
"""
from __future__ import annotations

import argparse
import json
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
from tiledispatch.ops import maxpool as pool_op  # noqa: E402

POOLS = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
FORMATS = {2: torch.channels_last, 3: torch.channels_last_3d}


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """x with channels-last memory (1D: [N, W, C] memory), as a channels-last model hands it over."""
    if x.dim() - 2 in FORMATS:
        return x.contiguous(memory_format=FORMATS[x.dim() - 2])
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def measure(shape: dict, reg, dtype: str, gen: torch.Generator) -> dict:
    rank = len(shape["in_size"])
    values = torch.randn(shape["n"], shape["c"], *shape["in_size"], generator=gen, device="cuda") * 4
    values.view(-1)[::1009] = float("nan")
    x = channels_last(values.to(TORCH_DTYPE[dtype]))
    geo = (shape["window"], shape["stride"], shape["padding"], shape["dilation"])
    pool = POOLS[rank]
    ceil_mode = shape["ceil_mode"]
    compiled = torch.compile(lambda t: pool(t, *geo, ceil_mode=ceil_mode), dynamic=False)
    variants = {"tiledispatch": lambda: tdt.max_pool(x, *geo, ceil_mode, registry=reg),
                "torch": lambda: pool(x, *geo, ceil_mode=ceil_mode),
                "compile": lambda: compiled(x)}
    with torch.no_grad():
        outs = {name: fn() for name, fn in variants.items()}
        ref = outs["torch"]
        same = {name: bool(torch.equal(torch.isnan(o), torch.isnan(ref)) and torch.equal(o.nan_to_num(0.0),
                                                                                         ref.nan_to_num(0.0)))
                for name, o in outs.items()}
        problem = pool_op.problem_of(shape["n"], shape["c"], tuple(shape["in_size"]), dtype, *geo, ceil_mode)
        row = {"id": shape["id"], "uses": shape["uses"], "kernel": reg.select(problem).name, "equal_to_torch": same,
               "passed": same["tiledispatch"]}
        batch = max(5, min(200, int(2e7 // x.numel())))
        row["eager_us"] = {name: 1e3 * time_batch(fn, batch, 7, warmup=3) for name, fn in variants.items()}
        row["graph_us"] = {name: graph_us(fn) for name, fn in variants.items()}
    row["gb_per_s"] = (x.numel() + ref.numel()) * x.element_size() / (row["graph_us"]["tiledispatch"] * 1e3)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--suite", type=Path, default=ROOT / "bench" / "suites" / "maxpool.json")
    ap.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--out", default="/tmp")
    a = ap.parse_args(argv)
    torch._dynamo.config.cache_size_limit = 1024  # one compiled pooling per shape
    reg = td.load(a.bundle)
    suite = json.loads(a.suite.read_text())
    shapes = sorted(suite["shapes"], key=lambda s: (-sum(s["uses"].values()), s["id"]))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = peer_suite(shapes, lambda shape: measure(shape, reg, a.dtype, gen), a.budget_s)
    results = {"machine": machine(), "dtype": a.dtype, "bundle": str(a.bundle), "suite_shapes": len(shapes),
               "measured_shapes": len(rows),
               "summary": peer_summary(rows),
               "shapes": rows}
    print(json.dumps(results["summary"]))
    write_results(results, a.out, f"maxpool_{a.dtype}")
    return 0 if results["summary"]["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
