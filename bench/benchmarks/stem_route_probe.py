"""Few-channel strided stems (C = 3, 224^2, batch 32, fp16, channels-last) through tiledispatch.torch.conv under each
space-to-depth route (tdt.set_space_to_depth: auto, on, off), with and without a bias, against cuDNN (benchmark
mode), with what the "auto" route's cost model compares: the kernel the registry selects for the problem as it is
(after its channel padding) and for the mapped one. Every time in CUDA graphs (no host work), every output checked
against cuDNN's.

    python3 bench/benchmarks/stem_route_probe.py --bundle BUNDLE [--out DIR]    # DIR/stem_route_probe_<gpu>.json

Why: ConvNeXt-T's 4x4 stride-4 stem, which has a bias, took 122.5 us where cuDNN took 51.9 in the models benchmark
(bench/results/fusion_committed_set_h200): on a bundle with no conv kernel fusing a bias (the benchmark builds the
identity epilogues of conv_fp16_all_essential), the route's cost model found no kernel for either problem and
refused the mapping.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _gpu_common as gc  # noqa: E402
from models import rel_err  # noqa: E402
from stem_probe import graph_ms, setup  # noqa: E402
import tiledispatch as td  # noqa: E402
import tiledispatch.torch as tdt  # noqa: E402
from tiledispatch import selection  # noqa: E402

# K, filter, stride, padding; C = 3
STEMS = {"convnext_tiny": (96, 4, 4, 0), "vit_b_16": (768, 16, 16, 0), "resnet50": (64, 7, 2, 3),
         "mobilenet_v2": (32, 3, 2, 1)}
ROUTES = ("auto", "on", "off")


def route_terms(handle: int, reg, x: torch.Tensor, k: int, f: int, geo, epilogue) -> dict:
    """The kernel the registry selects (and its estimated cost) for the problem as it is, after the channel padding
    the operators would apply, and for its space-to-depth mapping (the problems the "auto" route compares); or why
    none runs it."""
    plan = tdt._space_to_depth_plan(tuple(x.shape), (f, f), geo, tdt._vector_channels(x))
    terms = {}
    for name, problem in zip(("as_is", "mapped"),
                             tdt._space_to_depth_problems(handle, "fwd", x, k, (f, f), geo, epilogue, plan)):
        try:
            kern = reg.select(problem)
            terms[name] = {"problem": str(problem), "kernel": kern.name,
                           "cost": selection.estimated_cost(problem, kern.key)}
        except td.TileDispatchError as e:
            terms[name] = {"problem": str(problem), "error": f"{type(e).__name__}: {e}"[:300]}
    return terms


def main() -> None:
    a, reg, gen, results = setup(__doc__, "stems")
    handle = tdt.register(reg)
    for (model, (k, f, s, p)), with_bias in ((stem, b) for stem in STEMS.items() for b in (True, False)):
        x = gc.random_tensor((32, 3, 224, 224), "fp16", gen).contiguous(memory_format=torch.channels_last)
        w = (gc.random_tensor((k, 3, f, f), "fp16", gen) * 0.1).contiguous(memory_format=torch.channels_last)
        bias = gc.random_tensor((k,), "fp16", gen) if with_bias else None
        ref = F.conv2d(x.float(), w.float(), None if bias is None else bias.float(), s, p)
        row = {"cudnn_ms": graph_ms(lambda: F.conv2d(x, w, bias, s, p)),
               "cudnn_rel_err": rel_err(F.conv2d(x, w, bias, s, p), ref)}
        geo = tdt._geometry((s, s), (1, 1), (p, p), (p, p), 1)
        row.update(route_terms(handle, reg, x, k, f, geo, tdt.Epilogue("identity", with_bias, 0)))
        for route in ROUTES:
            tdt.set_space_to_depth(route)
            call = lambda: tdt.conv(x, w, bias, registry=handle, stride=s, padding=p)  # noqa: E731
            row[route] = {"ms": graph_ms(call), "rel_err": rel_err(call(), ref)}
        tdt.set_space_to_depth("auto")
        name = f"{model} {f}x{f}/{s} {'bias' if with_bias else 'plain'}"
        results["stems"][name] = row
        print(f"{name:28s} cuDNN {row['cudnn_ms'] * 1e3:6.1f} us  " +
              "  ".join(f"{r} {row[r]['ms'] * 1e3:6.1f}" for r in ROUTES), flush=True)
        gc.write_results(results, a.out, "stem_route_probe")


if __name__ == "__main__":
    main()
