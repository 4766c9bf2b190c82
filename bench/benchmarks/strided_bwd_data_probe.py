"""Strided bwd_data on the implicit_gemm kernels, each kernel named: time and TFLOP/s on stride-2 layers and on
stride-1 layers of the same GEMM size (and the fwd and bwd_weight of one of them), against cuDNN (benchmark mode),
fp16, channels-last, batch 32. Kernel times through reg.conv_*(kernel=...), the median of 3 batches of 20
back-to-back calls (_gpu_common.time_batch); each kernel's output checked against cuDNN's (relative L2 error, printed
and kept).

    scons kernels=bench/sets/strided_bwd_data_probe.yaml backend=cutlass arch=sm90a bundle=strided_bwd_data_probe
    python3 bench/benchmarks/strided_bwd_data_probe.py build/strided_bwd_data_probe time [OUT_DIR]   # + JSON
    python3 bench/benchmarks/strided_bwd_data_probe.py BUNDLE one LAYER KERNEL_PATTERN   # 5 launches, for ncu

Why: the suite's stride-2 bwd_data layers ran at 0.05-0.1x cuDNN on these kernels; results and ncu readings in
bench/results/strided_bwd_data_h200.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _gpu_common as gc  # noqa: E402
import tiledispatch as td  # noqa: E402
from tiledispatch.ops.conv import ConvProblem  # noqa: E402

# name: (direction, N, C, K, input H = W, filter, stride, padding); each stride-2 layer has a stride-1 twin of the
# same FLOPs (its dY the same size)
LAYERS = {
    "A_s2": ("bwd_data", 32, 64, 256, 120, 3, 2, 1), "A_s1": ("bwd_data", 32, 64, 256, 60, 3, 1, 1),
    "A_fwd": ("fwd", 32, 256, 64, 60, 3, 1, 1),
    "B_s2": ("bwd_data", 32, 1056, 2904, 48, 1, 2, 0), "B_s1": ("bwd_data", 32, 1056, 2904, 24, 1, 1, 0),
    "C_s2": ("bwd_data", 32, 192, 384, 56, 2, 2, 0), "C_s1": ("bwd_data", 32, 192, 384, 28, 2, 1, 0),
    "A_wgrad": ("bwd_weight", 32, 64, 256, 60, 3, 1, 1),
}


def layer(reg, name: str):
    """(problem, run(kernel name), cuDNN's call, the tensor run writes) of a layer, on random channels-last tensors."""
    d, n, c, k, hw, f, s, p = LAYERS[name]
    o = (hw + 2 * p - f) // s + 1

    def channels_last(*shape):
        return torch.randn(*shape, device="cuda").half().to(memory_format=torch.channels_last)

    x, w, y = channels_last(n, c, hw, hw), channels_last(k, c, f, f), channels_last(n, k, o, o)
    prob = ConvProblem(d, n, 1, c, k, (hw, hw), (f, f), (s, s), (1, 1), (p, p), (p, p), "fp16", "fp16", "fp16")
    if d == "bwd_data":
        def run(kern):
            reg.conv_bwd_data(y, w, out=x, stride=s, padding=p, groups=1, kernel=kern)

        def peer():
            return torch.ops.aten.convolution_backward(y, x, w, None, [s, s], [p, p], [1, 1], False, [0, 0], 1,
                                                       [True, False, False])[0]
    elif d == "bwd_weight":
        def run(kern):
            reg.conv_bwd_weight(x, y, out=w, stride=s, padding=p, groups=1, kernel=kern)

        def peer():
            return torch.ops.aten.convolution_backward(y, x, w, None, [s, s], [p, p], [1, 1], False, [0, 0], 1,
                                                       [False, True, False])[1]
    else:
        def run(kern):
            reg.conv_fwd(x, w, out=y, stride=s, padding=p, groups=1, kernel=kern)

        def peer():
            return torch.nn.functional.conv2d(x, w, None, s, p)
    return prob, run, peer, {"bwd_data": x, "bwd_weight": w, "fwd": y}[d]


def ms(fn) -> float:
    return gc.time_batch(fn, batch=20, repeats=3, warmup=1)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def main(argv: list[str]) -> None:
    reg = td.load(argv[0])
    if argv[1] == "one":
        prob, run, _, _ = layer(reg, argv[2])
        kern = next(k.name for k in reg.kernels if argv[3] in k.name and k.key.signature.direction == prob.direction
                    and k.key.signature.spatial_dims == 2)
        for _ in range(5):
            run(kern)
        torch.cuda.synchronize()
        print(argv[2], kern)
        return
    torch.backends.cudnn.benchmark = True
    rows = []
    for name in LAYERS:
        prob, run, peer, written = layer(reg, name)
        flops, want = prob.flops(), peer().clone()
        row = {"layer": name, "problem": str(prob), "cudnn_ms": ms(peer), "kernels": {}}
        line = f"{name:7s} {prob.direction:10s} GFLOP {flops / 1e9:7.1f} cudnn {row['cudnn_ms'] * 1e3:8.1f} us"
        for kern in sorted(k.name for k in reg.kernels if k.key.signature.direction == prob.direction
                           and k.key.signature.spatial_dims == 2):
            written.fill_(float("nan"))  # poisoned: an unwritten output shows as an error
            try:
                run(kern)
            except td.UnsupportedProblemError as e:  # a specialization (channel alignment, ...) refusing the layer
                row["kernels"][kern] = {"refused": str(e)}
                continue
            err = rel_error(written, want)
            t = ms(lambda: run(kern))
            row["kernels"][kern] = {"ms": t, "tflops": flops / t / 1e9, "rel_error_vs_cudnn": err}
            tile = kern.split("_cutlass_sm90a_")[1][:22]
            line += f" | {tile} {t * 1e3:8.1f} us {flops / t / 1e9:6.1f} TF err {err:.0e}"
        print(line, flush=True)
        rows.append(row)
    if len(argv) > 2:
        gc.write_results({"machine": gc.machine(), "layers": rows}, argv[2], "strided_bwd_data_probe")


if __name__ == "__main__":
    main(sys.argv[1:])
