"""Where a model's GPU time goes, kernel by kernel: PyTorch eager, torch.compile, the model fused by tiledispatch
and that under torch.compile (models.py's variants). A diagnostic beside models.py's model-level times: it says
which kernels make up a gap.

    python bench/benchmarks/model_kernels.py --bundle BUNDLE [--models convnext_tiny,resnet50] [--variants ...]

Each variant of each inference model (models.py's builds: batch 32, fp16, channels_last, batch norms calibrated)
runs a few times under torch.profiler; every GPU kernel's time is summed per iteration and grouped by kernel name
and by a coarse class of the name (tiledispatch's, triton, gemm, conv, norm, elementwise, ...). The JSON records
per variant the total kernel time per iteration, the kernel count per iteration, the classes and the 25 longest
kernels.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

import models as mb  # noqa: E402  (models.py: the same model builds and machine record)

# the first pattern a kernel's name matches names its class
# (the project's kernels live in namespace tdk or are CUTLASS device kernels, which PyTorch's libraries do not launch;
# the profiler shows some names mangled)
CLASSES = (("tiledispatch", re.compile(r"tdk::|cutlass::device_kernel|^_ZN3tdk|^_ZN7cutlass13device_kernel")),
           ("triton", re.compile(r"^triton_", re.I)),
           ("conv", re.compile(r"conv|fprop|dgrad|wgrad|implicit_gemm|depthwise", re.I)),
           ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|sm80_", re.I)),
           ("norm", re.compile(r"norm", re.I)),
           ("reduce", re.compile(r"reduce|softmax|mean|sum", re.I)),
           ("copy", re.compile(r"copy|transpose|permute|cat", re.I)),
           ("elementwise", re.compile(r"elementwise|vectorized|unrolled", re.I)))


def kernel_class(name: str) -> str:
    return next((cls for cls, pattern in CLASSES if pattern.search(name)), "other")


def kernel_times(step, iters: int) -> dict:
    """name -> (us per iteration, launches per iteration) of every GPU kernel step() runs."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0:
            out[e.key] = (e.self_device_time_total / iters, e.count / iters)
    return out


def summarize(times: dict) -> dict:
    classes = defaultdict(lambda: [0.0, 0.0])
    for name, (us, count) in times.items():
        classes[kernel_class(name)][0] += us
        classes[kernel_class(name)][1] += count
    top = sorted(times.items(), key=lambda kv: -kv[1][0])[:25]
    return {"kernel_us_per_iter": sum(us for us, _ in times.values()),
            "kernels_per_iter": sum(count for _, count in times.values()),
            "classes": {c: {"us": round(us, 1), "kernels": count}
                        for c, (us, count) in sorted(classes.items(), key=lambda kv: -kv[1][0])},
            "top": [{"name": name[:200], "class": kernel_class(name), "us": round(us, 1), "launches": count}
                    for name, (us, count) in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--models", default="resnet50,mobilenet_v2,convnext_tiny")
    ap.add_argument("--variants", default="eager,compile,fused")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None, help="output folder (default: $OUT if set, else bench/results)")
    a = ap.parse_args()
    import torchvision

    import tiledispatch as td
    import tiledispatch.torch as tdt

    torch.backends.cudnn.benchmark = True
    reg = td.load(a.bundle)
    result = {"machine": mb.machine("cuda", reg, a.bundle), "iters": a.iters, "models": {}}
    for case in a.models.split(","):
        torch.manual_seed(0)
        base, shape, training, what = mb.build(case, False, torchvision.models)
        assert not training, "inference models only"
        base = base.cuda().half().to(memory_format=torch.channels_last).eval().requires_grad_(False)
        x = torch.randn(shape, device="cuda").half().contiguous(memory_format=torch.channels_last)
        mb.calibrate_batch_norms(base, x)
        variants = {}
        for variant in a.variants.split(","):
            if variant == "eager":
                model = base
            elif variant == "compile":
                model = torch.compile(copy.deepcopy(base))
            elif variant == "fused":
                model, _ = tdt.fuse(base, reg)
            elif variant == "fused_compile":
                model = torch.compile(tdt.fuse(base, reg)[0])
            else:
                ap.error(f"unknown variant {variant!r} (eager, compile, fused, fused_compile)")
            with torch.no_grad():
                step = lambda: model(x)  # noqa: E731
                for _ in range(3):
                    step()
                variants[variant] = summarize(kernel_times(step, a.iters))
            s = variants[variant]
            print(f"{case:14s} {variant:8s} {s['kernel_us_per_iter']:9.1f} us of kernels, "
                  f"{s['kernels_per_iter']:.0f} kernels: " + ", ".join(f"{c} {v['us']:.0f}"
                                                                       for c, v in s["classes"].items()), flush=True)
        result["models"][case] = {"model": what, "input": list(shape), "variants": variants}
    out = Path(a.out or os.environ.get("OUT") or mb.ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_kernels.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
