"""The 3-channel stems (ResNet-50's 7x7 and MobileNetV2's 3x3, stride 2, fp16, batch 32, 224^2, channels-last) on the
GPU, fwd and bwd_weight: cuDNN (benchmark mode) against each kernel of a bundle, C = 3 on the generic implicit GEMM
(cutlass.align 1) and C zero-padded to 8 on the aligned kernels (bwd_weight: dW's first 3 channels kept), with the
copy of X into the zero channels of a kept buffer timed on its own; every time in CUDA graphs (no host work), every output checked against cuDNN's.

    scons kernels=bench/sets/conv_stem_probe.yaml backend=cutlass arch=sm90a bundle=stem_probe
    python3 bench/benchmarks/stem_probe.py --bundle build/stem_probe [--out DIR]    # DIR/stem_probe_<gpu>.json

Why: the generic kernel takes 0.33 ms on ResNet-50's stem where cuDNN takes 0.083 (bench/results/stem_probe_h200),
and its reduction already pads each tap's 3 channels to 8; the aligned kernels would compute the same padded
reduction with 16-byte loads and stores.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _gpu_common as gc  # noqa: E402
import models  # noqa: E402  (bench/benchmarks/models.py: its CUDA-graph runner and timer)
import tiledispatch as td  # noqa: E402
import tiledispatch.torch as tdt  # noqa: E402

TIMER = models.Timer("cuda", rounds=5, target_ms=5)

STEMS = {"resnet50": (64, 7, 3), "mobilenet_v2": (32, 3, 1)}  # K, filter, padding; stride 2, C = 3


def graph_ms(fn, timer: models.Timer = TIMER) -> float:
    """Milliseconds per call, fn captured in a CUDA graph and replayed (models.py's timing: median of rounds)."""
    return timer(models.runner(fn, "cuda", True, warmup=2))["median_ms"]


def time_kernels(kernels, run, new_out, ref, timer: models.Timer = TIMER) -> tuple[dict, object]:
    """({kernel name: {"ms" in a CUDA graph, "rel_err" against ref}}, the fastest one's name or None) for each of
    the kernels that runs the call: run(kernel name, out) launches it into out, new_out() gives a poisoned output;
    a kernel that refuses the call (another direction, epilogue, filter size, alignment) is left out."""
    timed = {}
    for kernel in kernels:
        out = new_out()
        try:
            run(kernel.name, out)
            torch.cuda.synchronize()
        except td.TileDispatchError:
            continue
        timed[kernel.name] = {"ms": graph_ms(lambda k=kernel.name, o=out: run(k, o), timer),
                              "rel_err": models.rel_err(out, ref)}
    return timed, min(timed, key=lambda name: timed[name]["ms"], default=None)


def setup(doc: str, table: str, options: dict = None):
    """A probe's command line (--bundle, --out, and `options`: flag -> add_argument's keywords), cuDNN in benchmark
    mode, the bundle loaded, a seeded CUDA generator and the results dict (machine, versions, an empty `table`)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", str(Path(__file__).resolve().parents[1] / "results")))
    for flag, keywords in (options or {}).items():
        ap.add_argument(flag, **keywords)
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    results = {"machine": gc.machine(), "cudnn": torch.backends.cudnn.version(), "bundle": a.bundle, table: {}}
    return a, td.load(a.bundle), torch.Generator(device="cuda").manual_seed(0), results


def main() -> None:
    a, reg, gen, results = setup(__doc__, "stems")
    for name, (k, f, pad) in STEMS.items():
        x = gc.random_tensor((32, 3, 224, 224), "fp16", gen).contiguous(memory_format=torch.channels_last)
        w = gc.random_tensor((k, 3, f, f), "fp16", gen).contiguous(memory_format=torch.channels_last)
        ref = F.conv2d(x, w, stride=2, padding=pad)
        x8, w8 = tdt._zero_padded_channels(x, 8), tdt._zero_padded_channels(w, 8)
        dy = gc.random_tensor(ref.shape, "fp16", gen).contiguous(memory_format=torch.channels_last)
        ref_dw = torch.nn.grad.conv2d_weight(x, w.shape, dy, stride=2, padding=pad)
        row = {"cudnn_ms": graph_ms(lambda: F.conv2d(x, w, stride=2, padding=pad)),
               "cudnn_bwd_weight_ms": graph_ms(lambda: torch.nn.grad.conv2d_weight(x, w.shape, dy, stride=2,
                                                                                     padding=pad)),
               "pad_copy_ms": graph_ms(lambda: x8[:, :3].copy_(x)), "kernels": {}}
        for kernel in reg.kernels:
            generic = kernel.key.algorithm.extra("cutlass.align", 0) == 1
            direction = kernel.key.signature.direction
            xi, wi = (x, w) if generic else (x8, w8)
            if direction == "fwd":
                expect = ref
                y = gc.poisoned(ref.shape, "fp16").contiguous(memory_format=torch.channels_last)

                def call(xi=xi, wi=wi, y=y, kernel=kernel):
                    reg.conv_fwd(xi, wi, out=y, stride=2, padding=pad, groups=1, kernel=kernel.name)
            else:
                expect = ref_dw
                y = gc.poisoned(wi.shape, "fp16").contiguous(memory_format=torch.channels_last)

                def call(xi=xi, y=y, kernel=kernel):
                    reg.conv_bwd_weight(xi, dy, out=y, stride=2, padding=pad, groups=1, kernel=kernel.name)
            try:
                call()
                torch.cuda.synchronize()
            except td.TileDispatchError as e:
                row["kernels"][kernel.name] = {"error": f"{type(e).__name__}: {e}"[:500]}
                continue
            got = y if direction == "fwd" else y[:, :3]
            err = models.rel_err(got, expect)
            row["kernels"][kernel.name] = {"direction": direction, "channels": 3 if generic else 8,
                                           "ms": graph_ms(call), "rel_err_vs_cudnn": err}
            print(f"{name:13s} {direction:10s} C={3 if generic else 8} {kernel.name[:100]}  "
                  f"{row['kernels'][kernel.name]['ms']:.4f} ms  err {err:.1e}", flush=True)
        print(f"{name:13s} cuDNN fwd {row['cudnn_ms']:.4f} ms, bwd_weight {row['cudnn_bwd_weight_ms']:.4f} ms, "
              f"pad copy {row['pad_copy_ms']:.4f} ms", flush=True)
        results["stems"][name] = row
    gc.write_results(results, a.out, "stem_probe")


if __name__ == "__main__":
    main()
