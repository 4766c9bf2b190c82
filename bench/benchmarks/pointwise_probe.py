"""Pointwise (1x1, unit stride, unpadded, dense) fp16 convolutions on the GPU, fwd with a bias (a folded batch
norm), as the GEMMs they run as (ops/conv_as_gemm.py: Y[pixels, K] = X[pixels, C] . W[K, C]^T + b): every GEMM of
bench/suites/pointwise_gemms.json (the pointwise layers of the real-workload suite conv.json, which is generated
from torchvision's models) with C or K at most --narrow (default 48: mobile networks' expansions and projections),
the peer at its best (cuDNN in benchmark mode on the channels-last conv with its bias, and cuBLAS through F.linear
on the same rows; the faster kept) against each GEMM kernel of a bundle that runs the layer and against what
Registry.gemm selects; every time in CUDA graphs (no host work), every output checked against PyTorch's float32
result.

    scons kernels=bench/sets/pointwise_probe.yaml backend=cutlass arch=sm90a bundle=pointwise_probe
    python3 bench/benchmarks/pointwise_probe.py --bundle build/pointwise_probe [--narrow 48] [--selected-only]
        [--out DIR]    # DIR/pointwise_probe_<gpu>.json, written after every layer

Why: MobileNetV2's pointwise layers with 16-32 input channels took about twice cuDNN's time in the models
benchmark (16 -> 96 channels on 112 x 112 maps: 65 us against 31; bench/results/depthwise_h200): GEMMs with
K = 16-32 are memory-bound, and the conv set's pointwise tiles (128 x 64 and 128 x 128, 64 deep) were chosen on
ResNet's wide layers.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _gpu_common as gc  # noqa: E402
import models  # noqa: E402
from models import rel_err  # noqa: E402
from stem_probe import graph_ms, setup, time_kernels  # noqa: E402
import tiledispatch as td  # noqa: E402
from tiledispatch.ops import gemm as gemm_op  # noqa: E402

SUITES = Path(__file__).resolve().parents[1] / "suites"
TIMER = models.Timer("cuda", rounds=3, target_ms=3)
OPTIONS = {"--narrow": {"type": int, "default": 48, "help": "layers with C or K at most this many channels"},
           "--selected-only": {"action": "store_true", "help": "time the peers and the selected kernel only"}}


def pointwise_gemms(narrow: int) -> list[tuple[dict, dict]]:
    """(shape, the first conv layer it stands for) for every GEMM of bench/suites/pointwise_gemms.json (the
    suite's pointwise fwd layers with channel counts multiples of 8) with N or K at most `narrow`."""
    layers = {ly["id"]: ly for ly in json.loads((SUITES / "conv.json").read_text())["layers"]}
    shapes = json.loads((SUITES / "pointwise_gemms.json").read_text())["shapes"]
    return [(s, layers[s["layers"][0]]) for s in shapes if min(s["n"], s["k"]) <= narrow]


def main() -> None:
    a, reg, gen, results = setup(__doc__, "gemms", OPTIONS)
    results["narrow"] = a.narrow
    for info, ly in pointwise_gemms(a.narrow):
        m, n, k = info["m"], info["n"], info["k"]
        # channels-last activations and weights, as the models benchmark runs cuDNN (a weight in NCHW costs
        # cuDNN a layout transform per call)
        layout = {2: torch.channels_last, 3: torch.channels_last_3d}.get(ly["rank"], torch.contiguous_format)
        x = gc.random_tensor((ly["n"], k, *ly["in_size"]), "fp16", gen).contiguous(memory_format=layout)
        w4 = gc.random_tensor((n, k, *[1] * ly["rank"]), "fp16", gen).contiguous(memory_format=layout)
        bias = gc.random_tensor((n,), "fp16", gen)
        conv = getattr(F, f"conv{ly['rank']}d")
        rows = x.movedim(1, -1).contiguous().reshape(m, k)  # a view where x is channels-last
        w = w4.reshape(n, k)
        ref = F.linear(rows.float(), w.float(), bias.float())
        row = {"layers": info["layers"], "uses": info["uses"], "kernels": {},
               "cudnn_ms": graph_ms(lambda: conv(x, w4, bias), TIMER),
               "cublas_ms": graph_ms(lambda: F.linear(rows, w, bias), TIMER)}
        row["peer_ms"] = min(row["cudnn_ms"], row["cublas_ms"])
        out = gc.poisoned((m, n), "fp16")

        def run(kernel, out=out):
            reg.gemm(rows, w.t(), out=out, bias=bias, kernel=kernel)

        try:
            run(None)
            problem, operands = gemm_op.operands(rows, w.t(), out, bias=bias)
            row["selected"] = {"ms": graph_ms(lambda: run(None), TIMER), "rel_err": rel_err(out, ref),
                               "kernel": reg.select(problem, operands=operands).name}
        except td.TileDispatchError as e:
            row["selected"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        row["kernels"], row["best_kernel"] = time_kernels(() if a.selected_only else reg.kernels, run,
                                                          lambda: gc.poisoned((m, n), "fp16"), ref, TIMER)
        results["gemms"][f"{m}x{n}x{k}"] = row
        sel = row["selected"].get("ms", math.nan)
        best = row["kernels"].get(row["best_kernel"], {}).get("ms", math.nan)
        print(f"{m:7d}x{n:4d}x{k:4d}  cuDNN {row['cudnn_ms'] * 1e3:7.1f} us  cuBLAS {row['cublas_ms'] * 1e3:7.1f}  "
              f"selected {sel * 1e3:7.1f}  best {best * 1e3:7.1f} ({(row['best_kernel'] or '-')[:70]})", flush=True)
        gc.write_results(results, a.out, "pointwise_probe")  # after every GEMM: a run cut short keeps its rows


if __name__ == "__main__":
    main()
