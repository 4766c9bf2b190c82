"""Pointwise (1x1, unit stride, unpadded, dense) fp16 2D convolutions whose output channels are not a multiple of 8
(EfficientNet's squeeze-excitation, ShuffleNetV2's 58 / 116 / 232 channels), with a bias and an activation (a folded
batch norm and the block's activation): every such fwd layer of the real-workload suite (bench/suites/conv.json,
generated from torchvision's models) whose input channels are a multiple of 8, through the public call
tiledispatch.torch.conv. Its route (the output channels zero-padded to a whole 16-byte vector, one fused GEMM) is
timed against the route before it (the low-alignment fallback GEMM, the bias through beta * Y, torch's activation)
and against cuDNN (benchmark mode, channels-last) with PyTorch's activation after it. Every time is a CUDA graph of
the call (no host work); every output is checked against PyTorch's float32 result.

    scons kernels=bench/sets/unaligned_pointwise.yaml backend=cutlass arch=sm90a bundle=unaligned_pointwise
    python3 bench/benchmarks/unaligned_pointwise_probe.py --bundle build/unaligned_pointwise [--activation silu]
        [--out DIR]    # DIR/unaligned_pointwise_<gpu>.json, written after every layer
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
from models import rel_err  # noqa: E402
from stem_probe import graph_ms, setup  # noqa: E402
import tiledispatch.torch as tdt  # noqa: E402

SUITES = Path(__file__).resolve().parents[1] / "suites"
OPTIONS = {"--activation": {"default": "silu", "choices": ("identity", "relu", "silu")}}  # the set's epilogues


def unaligned_layers() -> list[dict]:
    """The suite's pointwise dense 2D fwd layers with K % 8 != 0 and C % 8 == 0."""
    return [ly for ly in json.loads((SUITES / "conv.json").read_text())["layers"]
            if ly["rank"] == 2 and ly["cls"] == "dense" and ly["groups"] == 1 and "fwd" in ly["directions"]
            and ly["filter"] == [1, 1] and ly["stride"] == [1, 1] and ly["pad_lo"] == ly["pad_hi"] == [0, 0]
            and ly["k"] % 8 and not ly["c"] % 8]


def main() -> None:
    a, reg, gen, results = setup(__doc__, "layers", OPTIONS)
    results["activation"] = act_name = a.activation

    def act(v):
        return gc.activation(v, act_name, -math.inf, math.inf)
    handle = tdt.register(reg)
    geo = tdt._geometry((1, 1), (1, 1), (0, 0), (0, 0), 1)
    pads_outputs = tdt._pads_outputs
    for ly in unaligned_layers():
        x = gc.random_tensor((ly["n"], ly["c"], *ly["in_size"]), "fp16", gen).contiguous(
            memory_format=torch.channels_last)
        w = gc.random_tensor((ly["k"], ly["c"], 1, 1), "fp16", gen).contiguous(memory_format=torch.channels_last)
        bias = gc.random_tensor((ly["k"],), "fp16", gen)
        ref = act(F.conv2d(x.float(), w.float(), bias.float()))
        row = {"uses": ly["uses"], "cudnn_ms": graph_ms(lambda: act(F.conv2d(x, w, bias)))}
        for name, pads in (("padded", pads_outputs), ("unpadded", lambda *args: False)):
            tdt._pads_outputs = pads
            tdt._CONV_ROUTES.clear()
            try:
                route = tdt._conv_route(handle, x, w, geo, act_name, True, 0)
                out = tdt.conv(x, w, bias, registry=handle, activation=act_name)
                row[name] = {"route": route, "rel_err": rel_err(out, ref),
                             "ms": graph_ms(lambda: tdt.conv(x, w, bias, registry=handle, activation=act_name))}
            except Exception as e:  # recorded: a layer one route cannot run
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            finally:
                tdt._pads_outputs = pads_outputs
                tdt._CONV_ROUTES.clear()
        results["layers"][ly["id"]] = row
        times = [row[n].get("ms", float("nan")) for n in ("padded", "unpadded")]
        print(f"{ly['id']:45s} cuDNN {row['cudnn_ms'] * 1e3:7.1f} us  padded {times[0] * 1e3:7.1f} "
              f"({row['padded'].get('route')})  unpadded {times[1] * 1e3:7.1f}", flush=True)
        gc.write_results(results, a.out, "unaligned_pointwise")  # after every layer: a run cut short keeps its rows


if __name__ == "__main__":
    main()
