"""Depthwise 2D convolutions on the GPU, fwd or bwd_data: every distinct depthwise 2D layer of the real-workload
suite (bench/suites/conv.json, generated from torchvision's models), cuDNN (benchmark mode, channels-last) against
each kernel of a bundle that runs the layer and against what the public call selects (tiledispatch.torch.conv for
fwd, Registry.conv_bwd_data for bwd_data); every time in CUDA graphs (no host work), every output checked against
cuDNN's.

    scons kernels=bench/sets/depthwise_probe.yaml backend=cutlass arch=sm90a bundle=depthwise_probe
    python3 bench/benchmarks/depthwise_probe.py --bundle build/depthwise_probe [--direction bwd_data] [--selected-only]
        [--out DIR]    # DIR/depthwise_probe_<direction>_<gpu>.json, written after every layer

--selected-only times cuDNN and the selected kernel only (a large bundle, e.g. the models benchmark's).
--epilogue clamp (fwd): every call adds a bias and clamps to [0, 6] (a folded batch norm and ReLU6, MobileNetV2's
depthwise layers as tiledispatch.torch.fuse runs them) on the kernels that fuse it; cuDNN's side is its conv followed
by PyTorch's bias add and clamp. --models a,b keeps the layers of those models.
--eager also times cuDNN and the public call eagerly, host time included (median of rounds): the headline, the CUDA
graph times beside it are diagnostics. --without REGEX also runs the public call on the bundle without the kernels
whose names match (the route before them), in graphs and, with --eager, eagerly.

Why: MobileNetV2's depthwise layers on 14 x 14 and 7 x 7 maps took 0.18-0.30x cuDNN's time in the models benchmark
(bench/results/channel_padding_align4_h200), and the essential set's compile-time-filter kernels (32- and 28-wide
tiles of 8 rows; 3x3 and 7x7 only) compute four times the pixels of a 7 x 7 map; 5x5 layers (EfficientNet, MnasNet,
MobileNetV3) had only the run-time-filter kernel.
"""
from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _gpu_common as gc  # noqa: E402
import models  # noqa: E402
from models import rel_err  # noqa: E402
from stem_probe import graph_ms, setup, time_kernels  # noqa: E402
import tiledispatch as td  # noqa: E402
import tiledispatch.torch as tdt  # noqa: E402
from tiledispatch.ops.conv import ConvProblem, Epilogue  # noqa: E402
from tiledispatch.registry import Registry  # noqa: E402

SUITE = Path(__file__).resolve().parents[1] / "suites" / "conv.json"
TIMER = models.Timer("cuda", rounds=3, target_ms=3)  # shorter than stem_probe's: 191 layers x ~10 kernels
EAGER = models.Timer("cuda", rounds=5, target_ms=10)
OPTIONS = {"--direction": {"choices": ("fwd", "bwd_data"), "default": "fwd"},
           "--selected-only": {"action": "store_true", "help": "time cuDNN and the selected kernel only"},
           "--epilogue": {"choices": ("identity", "clamp"), "default": "identity",
                          "help": "fwd: clamp = bias + clamp(0, 6) fused (folded batch norm + ReLU6)"},
           "--models": {"default": "", "help": "comma-separated: only the layers these models use"},
           "--eager": {"action": "store_true", "help": "also time cuDNN and the public call eagerly (host time)"},
           "--without": {"default": "", "help": "also the public call without the kernels matching this regex"}}


def depthwise_layers(direction: str) -> list[dict]:
    layers = json.loads(SUITE.read_text())["layers"]
    return [ly for ly in layers if ly["cls"] == "depthwise" and ly["rank"] == 2 and direction in ly["directions"]
            and ly["pad_hi"] == ly["pad_lo"]]  # PyTorch's convs pad symmetrically


def main() -> None:
    a, reg, gen, results = setup(__doc__, "layers", OPTIONS)
    results["direction"], results["epilogue"] = a.direction, a.epilogue
    if a.epilogue != "identity" and a.direction != "fwd":
        raise SystemExit("--epilogue: fused epilogues are forward only")
    wanted = set(filter(None, a.models.split(",")))
    registries = {"selected": reg}
    if a.without:
        dropped = {k.name for k in reg.kernels if re.search(a.without, k.name)}
        registries["selected_without"] = Registry([k for k in reg.kernels if k.name not in dropped], reg.backend,
                                                  reg.arch, reg.manifest)
        results["without"] = {"regex": a.without, "kernels": sorted(dropped)}
    for ly in depthwise_layers(a.direction):
        if wanted and not wanted & set(ly["uses"]):
            continue
        n, c, size, f = ly["n"], ly["c"], tuple(ly["in_size"]), tuple(ly["filter"])
        s, d, pad = tuple(ly["stride"]), tuple(ly["dilation"]), tuple(ly["pad_lo"])
        geometry = {"stride": s, "padding": pad, "dilation": d, "groups": c}
        x = tdt._channels_last(gc.random_tensor((n, c, *size), "fp16", gen))
        w = tdt._channels_last(gc.random_tensor((c, 1, *f), "fp16", gen))
        if a.direction == "fwd":
            bias = gc.random_tensor((c,), "fp16", gen) if a.epilogue == "clamp" else None
            epilogue_args = {"bias": bias, "activation": "clamp", "clamp": (0.0, 6.0)} if bias is not None else {}
            ref = F.conv2d(x.float(), w.float(), bias.float() if bias is not None else None, **geometry)
            if bias is not None:
                ref = ref.clamp(0.0, 6.0)

            def peer():
                y = F.conv2d(x, w, bias, **geometry)
                return y.clamp_(0.0, 6.0) if bias is not None else y

            def selected(reg=reg):
                return tdt.conv(x, w, registry=reg, **epilogue_args, **geometry)

            def run(kernel, out):
                reg.conv_fwd(x, w, out=out, kernel=kernel, **epilogue_args, **geometry)
        else:
            dy = tdt._channels_last(gc.random_tensor(tuple(F.conv2d(x, w, **geometry).shape), "fp16", gen))
            ref = torch.nn.grad.conv2d_input(x.shape, w.float(), dy.float(), **geometry)
            dx = tdt._channels_last(gc.poisoned(tuple(x.shape), "fp16"))

            def peer():
                return torch.nn.grad.conv2d_input(x.shape, w, dy, **geometry)

            def run(kernel, out, reg=reg):
                reg.conv_bwd_data(dy, w, out=out, kernel=kernel, **geometry)

            def selected(reg=reg):
                run(None, dx, reg)
                return dx
        epilogue = Epilogue("clamp", True, 0) if a.epilogue == "clamp" else Epilogue()
        problem = ConvProblem(a.direction, n, c, c, c, size, f, s, d, pad, pad, "fp16", "fp16", "fp16",
                              epilogue=epilogue)
        row = {"uses": ly["uses"], "cudnn_ms": graph_ms(peer, TIMER), "kernels": {}}
        if a.eager:
            row["cudnn_eager_ms"] = EAGER(peer)["median_ms"]
        for name, r in registries.items():
            try:
                y = selected(r)
                # the kernel the call runs: the route tdt.conv took (a fused kernel rated far slower than the plain
                # one is left, and torch adds the bias and clamps)
                fuses = a.epilogue != "identity" and tdt._conv_route(
                    tdt.register(r), x, w, tdt._geometry(s, d, pad, pad, c), "clamp", True, 0) == "conv"
                row[name] = {"ms": graph_ms(lambda: selected(r), TIMER), "rel_err": rel_err(y, ref),
                             "fused_epilogue": fuses,
                             "kernel": r.select(problem if fuses else replace(problem, epilogue=Epilogue())).name}
                if a.eager:
                    row[name]["eager_ms"] = EAGER(lambda: selected(r))["median_ms"]
                    row[name]["vs_cudnn_eager"] = row["cudnn_eager_ms"] / row[name]["eager_ms"]
            except td.TileDispatchError as e:
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        row["kernels"], row["best_kernel"] = time_kernels(
            () if a.selected_only else reg.kernels, run,
            lambda: tdt._channels_last(gc.poisoned(tuple(ref.shape), "fp16")), ref, TIMER)
        results["layers"][ly["id"]] = row
        sel = row["selected"].get("ms", math.nan)
        best = row["kernels"].get(row["best_kernel"], {}).get("ms", math.nan)
        eager = "".join(f"  {name} eager {row[name]['vs_cudnn_eager']:.2f}x cuDNN" for name in registries
                        if "vs_cudnn_eager" in row[name])
        print(f"{ly['id']:52s} cuDNN {row['cudnn_ms'] * 1e3:7.1f} us  selected {sel * 1e3:7.1f}  best "
              f"{best * 1e3:7.1f} ({(row['best_kernel'] or '-')[:60]}){eager}", flush=True)
        # after every layer, so that a run cut short keeps its rows
        suffix = "" if a.epilogue == "identity" else f"_{a.epilogue}"
        for name in registries:
            ratios = [r[name]["vs_cudnn_eager"] for r in results["layers"].values() if "vs_cudnn_eager" in r[name]]
            if ratios:
                results[f"{name}_vs_cudnn_eager_geomean"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        gc.write_results(results, a.out, f"depthwise_probe_{a.direction}{suffix}")


if __name__ == "__main__":
    main()
