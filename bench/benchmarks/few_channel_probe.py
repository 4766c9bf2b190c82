"""Few-channel dense convolutions of the generated conv suite (bench/suites/conv.json: every layer with groups = 1,
C <= 8 < K and a filter larger than 1 x 1 in 1D / 2D: RGB stems, raw-audio front ends), forward with a bias and ReLU,
through the public operator tiledispatch.torch.conv against cuDNN (benchmark mode: conv with the bias, then torch's
ReLU) in the same process. Our side runs twice: on the whole bundle, and on the bundle without direct_mma's
few-channel kernels (the route these layers took before them). Each output is checked against float32.

Headline: eager calls, host time included (median of rounds; ratio = cuDNN's time / ours). Diagnostics beside it:
each call captured in a CUDA graph (no host time), the kernel the registry selects for the layer as it is, and
each plain (no epilogue) few-channel kernel of the bundle on the plain layer through Registry.conv_fwd(kernel=...)
in a CUDA graph (the tiles compared), checked against cuDNN's plain conv.

    python3 bench/benchmarks/few_channel_probe.py --bundle BUNDLE [--out DIR]   # DIR/few_channel_probe_<gpu>.json
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
import models  # noqa: E402  (bench/benchmarks/models.py: its timer and CUDA-graph runner)
from stem_probe import graph_ms, setup, time_kernels  # noqa: E402
import tiledispatch as td  # noqa: E402
import tiledispatch.torch as tdt  # noqa: E402
from tiledispatch.families.cutlass.conv_direct import few_channel  # noqa: E402
from tiledispatch.ops import conv  # noqa: E402
from tiledispatch.registry import Registry  # noqa: E402
from tiledispatch.spec.key import Epilogue  # noqa: E402

SUITE = Path(__file__).resolve().parents[1] / "suites" / "conv.json"
EAGER = models.Timer("cuda", rounds=7, target_ms=20)
EPILOGUE = Epilogue("relu", True, 0)


def few_channel_layers() -> list[dict]:
    """The suite's layers this probe is about, by the rule (not by name): dense, at most 8 input channels, more
    outputs, a filter wider than one tap."""
    layers = json.loads(SUITE.read_text())["layers"]
    return [lay for lay in layers if lay["groups"] == 1 and lay["c"] <= 8 < lay["k"] and lay["rank"] in (1, 2)
            and math.prod(lay["filter"]) > 1 and "fwd" in lay["directions"]]


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """[N, C, *sp] with the channels innermost in memory (1D too)."""
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def selected(reg, lay: dict) -> str:
    problem = conv.ConvProblem("fwd", lay["n"], 1, lay["c"], lay["k"], tuple(lay["in_size"]), tuple(lay["filter"]),
                               tuple(lay["stride"]), tuple(lay["dilation"]), tuple(lay["pad_lo"]),
                               tuple(lay["pad_hi"]), "fp16", "fp16", "fp16", epilogue=EPILOGUE)
    try:
        return reg.select(problem).name
    except td.TileDispatchError as e:
        return f"{type(e).__name__}: {e}"[:200]


def main() -> None:
    a, reg, gen, results = setup(__doc__, "layers")
    without = Registry([k for k in reg.kernels if not few_channel(k.key)], reg.backend, reg.arch, reg.manifest)
    results["few_channel_kernels"] = [k.name for k in reg.kernels if few_channel(k.key)]
    functional = {1: F.conv1d, 2: F.conv2d}
    for lay in few_channel_layers():
        rank, stride, dil = lay["rank"], tuple(lay["stride"]), tuple(lay["dilation"])
        lo, hi = tuple(lay["pad_lo"]), tuple(lay["pad_hi"])
        x = channels_last(gc.random_tensor((lay["n"], lay["c"], *lay["in_size"]), "fp16", gen))
        w = channels_last(gc.random_tensor((lay["k"], lay["c"], *lay["filter"]), "fp16", gen) * 0.2)
        b = gc.random_tensor((lay["k"],), "fp16", gen)
        if lo == hi:
            xp, padding = x, lo
        else:  # torch pads symmetrically: the asymmetric rest by F.pad (last dim first)
            xp, padding = F.pad(x, [p for d in reversed(range(rank)) for p in (lo[d], hi[d])]), 0
        conv_fn = functional[rank]
        ref = F.relu(conv_fn(xp.float(), w.float(), b.float(), stride, padding, dil))
        calls = {"cudnn": lambda: F.relu(conv_fn(xp, w, b, stride, padding, dil))}
        if len(set(stride)) == len(set(dil)) == len(set(lo + hi)) == 1:  # how nn.Conv2d calls it: plain ints
            geometry = {"stride": stride[0], "dilation": dil[0], "padding": lo[0]}
        else:
            geometry = {"stride": stride, "dilation": dil, "pad_lo": lo, "pad_hi": hi}
        for name, r in (("tiledispatch", reg), ("without_few_channel", without)):
            calls[name] = lambda r=r: tdt.conv(x, w, b, registry=r, activation="relu", **geometry)
        row = {"layer": lay["id"], "uses": lay["uses"], "selected": selected(reg, lay),
               "selected_without": selected(without, lay)}
        for name, fn in calls.items():
            try:
                out = fn()
                torch.cuda.synchronize()
            except td.TileDispatchError as e:
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                continue
            row[name] = {"eager_ms": EAGER(fn)["median_ms"], "graph_ms": graph_ms(fn),
                         "rel_err": models.rel_err(out, ref)}
        for name in ("tiledispatch", "without_few_channel"):
            if "eager_ms" in row.get(name, {}) and "eager_ms" in row.get("cudnn", {}):
                row[name]["vs_cudnn_eager"] = row["cudnn"]["eager_ms"] / row[name]["eager_ms"]
                row[name]["vs_cudnn_graph"] = row["cudnn"]["graph_ms"] / row[name]["graph_ms"]
        if rank == 2 and lo == hi:
            plain = F.conv2d(x, w, None, stride, lo, dil)
            row["plain_cudnn_graph_ms"] = graph_ms(lambda: F.conv2d(x, w, None, stride, lo, dil))
            kernels = [k for k in reg.kernels if few_channel(k.key) and k.key.signature.epilogue == Epilogue()]
            row["plain_kernels"], _ = time_kernels(
                kernels, lambda name, out: reg.conv_fwd(x, w, out=out, stride=stride, padding=lo, dilation=dil,
                                                        groups=1, kernel=name),
                lambda: gc.poisoned(plain.shape, "fp16").contiguous(memory_format=torch.channels_last), plain)
        results["layers"][lay["id"]] = row
        print(lay["id"], json.dumps({k: v for k, v in row.items() if k not in ("layer", "uses")})[:600], flush=True)
    for name in ("tiledispatch", "without_few_channel"):
        for mode in ("eager", "graph"):
            ratios = [r[name][f"vs_cudnn_{mode}"] for r in results["layers"].values()
                      if f"vs_cudnn_{mode}" in r.get(name, {})]
            if ratios:
                results[f"{name}_vs_cudnn_{mode}_geomean"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print({k: v for k, v in results.items() if k.endswith("geomean")}, flush=True)
    gc.write_results(results, a.out, "few_channel_probe")


if __name__ == "__main__":
    main()
