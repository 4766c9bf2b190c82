"""cpu grouped-convolution benchmark: every kernel of conv_fp16_all_essential that can run each layer, in
every direction, the kernel the registry selects, and the float64 numpy reference as the baseline a numpy
user has (one batched matmul per filter tap). Layers: ResNet-50 3x3 and 1x1, ResNeXt G = 32, depthwise
3x3 and 7x7, a 3D video layer and a 1D layer, at small batch (a cpu run, not the GPU benchmark).

    python bench/benchmarks/cpu_conv.py [--layers r50_3x3 dw3x3] [--threads 0] [--out bench/results/cpu_conv.json]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(REPO / "bench"))  # the shared modules

import tiledispatch as td  # noqa: E402
from _cpu_common import machine, median_ms, write_report  # noqa: E402
from tiledispatch import reference, validation  # noqa: E402
from tiledispatch.ops import conv  # noqa: E402

SET = "conv_fp16_all_essential"
# name: (N, G, C, K, input size, filter, stride, padding)
LAYERS = {
    "r50_3x3": (2, 1, 64, 64, (56, 56), (3, 3), 1, 1),
    "r50_1x1": (2, 1, 256, 64, (56, 56), (1, 1), 1, 0),
    "resnext_g32": (2, 32, 128, 128, (56, 56), (3, 3), 1, 1),
    "dw3x3": (2, 128, 128, 128, (56, 56), (3, 3), 1, 1),
    "dw7x7": (2, 256, 256, 256, (28, 28), (7, 7), 1, 3),
    "video3d": (1, 1, 64, 64, (8, 28, 28), (3, 3, 3), 1, 1),
    "conv1d": (4, 1, 256, 256, (1024,), (3,), 1, 1),
}
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")






def build(build_dir: Path) -> Path:
    subprocess.run([sys.executable, "-m", "SCons", "-Q", "-C", str(REPO), f"kernels={SET}", "backend=cpu",
                    f"build_dir={build_dir}", "bundle=bench_conv"], check=True, stdout=subprocess.DEVNULL)
    return build_dir / "bench_conv"


def bench_layer(reg, name: str, direction: str, repeat: int, threads: int, baseline: bool) -> dict:
    n, g, c, k, size, filt, stride, pad = LAYERS[name]
    p = conv.ConvProblem(direction, n, g, c, k, size, filt, stride, 1, pad, pad, "fp16", "fp16", "fp16")
    rng = np.random.default_rng(0)
    data = {role: validation.random_array(rng, shape, "fp16") for role, shape in p.shapes().items()}
    geo = dict(stride=p.stride, dilation=p.dilation, pad_lo=p.pad_lo, pad_hi=p.pad_hi)
    call = {"fwd": lambda kern: conv.fwd(reg, data["x"], data["w"], data["y"], kernel=kern, num_threads=threads, **geo),
            "bwd_data": lambda kern: conv.bwd_data(reg, data["y"], data["w"], data["x"], kernel=kern,
                                                   num_threads=threads, **geo),
            "bwd_weight": lambda kern: conv.bwd_weight(reg, data["x"], data["y"], data["w"], kernel=kern,
                                                       num_threads=threads, **geo)}[direction]
    per_kernel = {kern.name: median_ms(lambda kern=kern: call(kern), repeat) for kern in reg.candidates(p)}
    selected = reg.select(p).name
    best = min(per_kernel, key=per_kernel.get)
    gflops = {kname: p.flops() / ms / 1e6 for kname, ms in per_kernel.items()}
    row = {"layer": name, "direction": direction, "problem": p.to_dict(), "flops": p.flops(),
           "kernels_gflops": gflops, "selected": selected, "selected_gflops": gflops[selected],
           "best": best, "best_gflops": gflops[best]}
    if baseline:
        f = {"fwd": lambda: reference.conv_fwd(data["x"], data["w"], *geo.values()),
             "bwd_data": lambda: reference.conv_bwd_data(data["y"], data["w"], p.in_size, *geo.values()),
             "bwd_weight": lambda: reference.conv_bwd_weight(data["x"], data["y"], p.filter_size, *geo.values())}
        row["numpy_reference_gflops"] = p.flops() / median_ms(f[direction], 1, warmup=0) / 1e6
    print(f"{name:12s} {direction:10s} selected {row['selected_gflops']:7.1f} GFLOP/s "
          f"({selected.split('_t')[1].split('_s')[0] if '_t' in selected else selected}), best {row['best_gflops']:7.1f}"
          + (f", numpy fp64 reference {row['numpy_reference_gflops']:6.2f}" if baseline else ""), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--directions", nargs="+", default=list(DIRECTIONS), choices=list(DIRECTIONS))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="cpu threads per call (0: OpenMP's default)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the (slow) numpy reference timing")
    ap.add_argument("--build-dir", type=Path, default=REPO / "build" / "bench")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu_conv.json")
    a = ap.parse_args()
    reg = td.load(build(a.build_dir))
    results = [bench_layer(reg, name, d, a.repeat, a.threads, not a.no_baseline)
               for name in a.layers for d in a.directions]
    report = {"benchmark": "cpu_conv", "date": time.strftime("%Y-%m-%d"), "machine": machine(), "kernel_set": SET,
              "threads": a.threads or "default",
              "method": f"median of {a.repeat} calls after 1 warm-up, host timer; fp16 data, fp32 accumulation",
              "results": results}
    write_report(a.out, report)


if __name__ == "__main__":
    main()
