"""Grouped convolution on the GPU: our cutlass conv kernels against cuDNN (through PyTorch) in the same run.

    python bench/benchmarks/conv.py BUNDLE_DIR [BUNDLE_DIR ...] [--out bench/results/conv_h100] [--quick]

cuDNN: torch conv (fwd) and torch.ops.aten.convolution_backward (bwd_data, bwd_weight) on channels_last
tensors (1D layers as 2D with H = 1, so cuDNN sees NHWC too), torch.backends.cudnn.benchmark = True,
warmed up first. Ours: every kernel of the bundles that can run the problem, through the C ABI with the
arguments built once; the analytic ranker's choice is reported beside the fastest. Timing: CUDA events
around a batch of back-to-back calls (launch latency hidden on both sides), median of repeats; inputs
random, never zeros. Each of our results is checked against cuDNN's (relative L2 error in fp32).
The first bundle is the shipped set (its best kernel and the analytic ranker's choice among it are reported);
further bundles hold variants timed beside it. Writes OUT.json (machine, versions, every timing) and OUT.png
(speed-up over cuDNN per case and direction).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared modules, reports/

from _conv_common import TORCH_DTYPE, ConvLauncher, PointwiseGemmLaunchers, machine
from _gpu_common import time_batch
from reports.conv_report import summarize
from tiledispatch import abi, load
from tiledispatch.ops import conv
from tiledispatch.selection import analytic, learned

# name, N, C, K, G, spatial, filter, stride, pad
CASES = [
    ("resnet50_3x3", 32, 64, 64, 1, (56, 56), (3, 3), 1, 1),
    ("resnet50_1x1", 32, 256, 64, 1, (56, 56), (1, 1), 1, 0),
    ("resnet50_3x3_late", 32, 256, 256, 1, (14, 14), (3, 3), 1, 1),
    ("resnext_g32", 32, 128, 128, 32, (56, 56), (3, 3), 1, 1),
    ("depthwise_3x3", 32, 128, 128, 128, (56, 56), (3, 3), 1, 1),
    ("depthwise_7x7", 32, 128, 128, 128, (56, 56), (7, 7), 1, 3),
    ("video_3d", 8, 64, 64, 1, (16, 56, 56), (3, 3, 3), 1, 1),
    ("conv1d", 16, 512, 512, 1, (2048,), (3,), 1, 1),
    ("conv1d_depthwise", 16, 1024, 1024, 1024, (2048,), (4,), 1, 2),
]
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")
DTYPE = "fp16"


def problem_of(case, direction) -> conv.ConvProblem:
    _, n, c, k, g, sp, f, s, pad = case
    r = len(sp)
    return conv.ConvProblem(direction, n, g, c, k, sp, f, (s,) * r, (1,) * r, (pad,) * r, (pad,) * r, DTYPE, DTYPE, DTYPE)


def min_bytes(p: conv.ConvProblem) -> int:
    """Each operand read or written once."""
    shapes = p.shapes()
    return sum(math.prod(s) for s in shapes.values()) * 2


def tensors(p: conv.ConvProblem, gen):
    """Logical-form channels-last tensors x [N, C, sp...], w [K, C/G, f...], y [N, K, out...] (1D as 2D, H = 1)."""
    td = TORCH_DTYPE[DTYPE]
    rank = p.spatial_dims
    as2d = rank == 1

    def make(lead, chan, sp):
        sp = (1, *sp) if as2d else sp
        t = (torch.rand((lead, *sp, chan), generator=gen, device="cuda") * 2 - 1).to(td)
        return t.permute(0, len(sp) + 1, *range(1, len(sp) + 1))  # channels_last / channels_last_3d memory

    x = make(p.n, p.c, p.in_size)
    w = make(p.k, p.c // p.g, p.filter_size)
    y = make(p.n, p.k, p.out_size)
    return x, w, y


def time_single(fn, repeats: int = 30) -> float:
    """Median milliseconds of single calls, each bracketed by CUDA events on an idle GPU (launch latency and
    host overhead included: the anchors' method)."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def cudnn_call(p: conv.ConvProblem, x, w, y):
    rank = len(x.shape) - 2
    stride, pad, dil = (list(v) for v in (p.stride, p.pad_lo, p.dilation))
    if p.spatial_dims == 1:  # 2D with H = 1
        stride, pad, dil = [1] + stride, [0] + pad, [1] + dil
    fn = {2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}[rank]
    if p.direction == "fwd":
        return lambda: fn(x, w, None, stride, pad, dil, p.g)
    mask = [p.direction == "bwd_data", p.direction == "bwd_weight", False]
    return lambda: torch.ops.aten.convolution_backward(y, x, w, None, stride, pad, dil, False, [0] * rank, p.g, mask)


def cudnn_result(p, x, w, y):
    out = cudnn_call(p, x, w, y)()
    if p.direction == "fwd":
        return out
    return out[0] if p.direction == "bwd_data" else out[1]


def ours_operands(p, x, w, y):
    """Our views of the same tensors: 1D problems drop the H = 1 axis (the memory is the same)."""
    if p.spatial_dims == 1:
        x, w, y = (t.squeeze(2) for t in (x, w, y))
    return x, w, y


def bench_case(case, direction, registries, batch, repeats, gen) -> dict:
    p = problem_of(case, direction)
    x, w, y = tensors(p, gen)
    entry = {"case": case[0], "direction": direction, "problem": str(p), "flops": p.flops(), "bytes": min_bytes(p)}
    # cuDNN
    call = cudnn_call(p, x, w, y)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    entry["cudnn_ms"] = time_batch(call, batch, repeats)
    entry["cudnn_single_ms"] = time_single(call)
    # the memory floor: a device copy moving the problem's minimum bytes (half read, half written), timed the
    # same way; cuDNN / copy is the most any kernel can gain over cuDNN without caching operands across calls
    src = torch.empty(entry["bytes"] // 4, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    entry["copy_ms"] = time_batch(lambda: dst.copy_(src), batch, repeats)
    del src, dst
    ref = cudnn_result(p, x, w, y).float()
    # ours: every kernel that can run it
    ox, ow, oy = ours_operands(p, x, w, y)
    written = {"fwd": oy, "bwd_data": ox, "bwd_weight": ow}[direction]
    ref = ref.reshape(written.shape)
    kernels = [k for reg in registries for k in reg.kernels if p.mismatch(k.key) is None]
    shipped = {k.name for k in registries[0].kernels}  # the first bundle is the set users get; others are variants
    runs, calls = [], {}

    def measure(name, call, shipped_kernel):
        written.fill_(float("nan"))
        call()
        torch.cuda.synchronize()
        err = float((written.float() - ref).norm() / ref.norm())
        runs.append({"kernel": name, "ms": time_batch(call, batch, repeats), "rel_error": err,
                     "shipped": shipped_kernel})
        calls[name] = call

    for kern in kernels:
        launch = ConvLauncher(kern, p, ox, ow, oy)
        status, reason = launch.can_run()
        if status == abi.OK:
            measure(kern.name, launch, kern.name in shipped)
    # a pointwise problem also runs as a GEMM on the bundles' GEMM kernels, which the runtime prefers
    pointwise = PointwiseGemmLaunchers(p, ox, ow, oy, registries)
    for _, kern, args in pointwise.launchers:
        measure(kern.name, pointwise.launch(kern, args), kern.name in shipped)
    entry["ours"] = runs
    if runs:
        best = min(runs, key=lambda r: r["ms"])
        entry["best_single_ms"] = time_single(calls[best["kernel"]])
        entry["speedup_best_single"] = entry["cudnn_single_ms"] / entry["best_single_ms"]
        # the runtime's pick without tuning: a shipped GEMM kernel when the problem lowers to one (learned /
        # analytic GEMM ranking), else the analytic ranking of the conv kernels
        as_gemm = [kern for reg, kern, _ in pointwise.launchers if kern.name in shipped]
        if as_gemm:
            chosen = learned(pointwise.problem, as_gemm)[0].name
        else:
            fits = [k for k in kernels if k.name in calls]
            chosen = analytic(p, [k for k in fits if k.name in shipped] or fits)[0].name
        shipped_runs = [r for r in runs if r["shipped"]]
        if shipped_runs:
            bs = min(shipped_runs, key=lambda r: r["ms"])
            entry.update(best_shipped_kernel=bs["kernel"], best_shipped_ms=bs["ms"],
                         speedup_best_shipped=entry["cudnn_ms"] / bs["ms"])
        sel = next(r for r in runs if r["kernel"] == chosen)
        entry.update(best_kernel=best["kernel"], best_ms=best["ms"], best_rel_error=best["rel_error"],
                     selected_kernel=chosen, selected_ms=sel["ms"], speedup_best=entry["cudnn_ms"] / best["ms"],
                     speedup_selected=entry["cudnn_ms"] / sel["ms"])
    return entry


def short(name: str) -> str:
    """tile, warps, mma, pipeline and extras of a kernel name."""
    tokens = name.split("_")
    return "_".join(t for t in tokens[6:] if t[0] in "twipx" and not t.startswith("x") or t.startswith("x"))


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['case']}\n{r['direction']}" for r in results]
    bars = (("speedup_best_shipped", "ours, fastest shipped kernel"), ("speedup_selected", "ours, analytic selection"),
            ("speedup_best", "ours, fastest incl. variants"))
    fig, ax = plt.subplots(figsize=(max(10, len(results) * 0.6), 5))
    xs = range(len(results))
    for i, (field, label) in enumerate(bars):
        ax.bar([x + (i - 1) * 0.27 for x in xs], [r.get(field, 0) for r in results], 0.27, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=90, fontsize=7)
    ax.set_ylabel("speed-up over cuDNN (x)")
    ax.set_title(f"tiledispatch cutlass conv vs cuDNN, {DTYPE}, {torch.cuda.get_device_name(0)}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--out", default="bench/results/conv")
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    registries = [load(b) for b in args.bundles]
    gen = torch.Generator(device="cuda").manual_seed(1)
    batch, repeats = (5, 7) if args.quick else (10, 15)
    results = []
    t0 = time.time()
    for case in CASES:
        for direction in DIRECTIONS:
            r = bench_case(case, direction, registries, batch, repeats, gen)
            results.append(r)
            tf = lambda ms: r["flops"] / ms / 1e9  # noqa: E731  TFLOP/s
            gb = lambda ms: r["bytes"] / ms / 1e6  # noqa: E731  GB/s
            if "best_ms" in r:
                print(f"{r['case']:18s} {direction:10s} cuDNN {r['cudnn_ms'] * 1e3:8.1f} us {tf(r['cudnn_ms']):6.1f} TF "
                      f"{gb(r['cudnn_ms']):6.0f} GB/s | ours {r['best_ms'] * 1e3:8.1f} us {tf(r['best_ms']):6.1f} TF "
                      f"{gb(r['best_ms']):6.0f} GB/s x{r['speedup_best']:.2f} (shipped x{r.get('speedup_best_shipped', 0):.2f}, "
                      f"selected x{r['speedup_selected']:.2f}, "
                      f"single calls {r['cudnn_single_ms'] * 1e3:.0f}/{r['best_single_ms'] * 1e3:.0f} us x{r['speedup_best_single']:.2f}) "
                      f"err {r['best_rel_error']:.1e} {short(r['best_kernel'])}", flush=True)
            else:
                print(f"{r['case']:18s} {direction:10s} cuDNN {r['cudnn_ms'] * 1e3:8.1f} us | ours: no kernel", flush=True)
    summary = summarize(results)
    print(json.dumps(summary, indent=1))
    out = {"machine": machine(), "dtype": DTYPE, "timing": f"ms / speedup: median of {repeats} batches of {batch} "
           "back-to-back calls, CUDA events; *_single_ms: median of 30 single calls on an idle GPU, CUDA events", "seconds": round(time.time() - t0, 1), "summary": summary, "results": results}
    with open(args.out + ".json", "w") as f:
        json.dump(out, f, indent=1)
    plot(results, args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
