"""Host overhead of every public entry point against the raw C call and torch, per problem.

    python bench/benchmarks/host_overhead.py BUNDLE [BUNDLE ...] [--out DIR] [--tag NAME] [--problems a,b] [--arrays numpy|torch]

What is measured is host issue time: (GPU: after a synchronize) CALLS calls are issued back to back and the
host clock is read when the last call returns; on a GPU the launches queue up, so no call waits for the
kernel. Rounds interleave the paths of a problem in a shuffled order, so drift and noise hit them alike; the
median over rounds is reported, with p10 and p90.

Paths of each problem (those that apply):
  raw_c_call    td_run through the ABI on the prebuilt arguments of the default call's kernel: the floor
                (the kernel library's own host work and the launch)
  default       the public call (reg.gemm / reg.conv_fwd / conv_bwd_data / conv_bwd_weight, out= given),
                kernel selected; a problem seen before, so the cached launch
  named_kernel  the public call with kernel= the selected conv / GEMM kernel's name
  explicit_stream  (GPU GEMM) the public call with stream= the current stream's handle
  plan          reg.plan(problem) called with a dict of the tensors
  first_call    the public call on a problem never seen (every cache of the registry emptied before each
                call): operand checks, candidate matching over the bundle, ranking, preparation
  tdt_linear, tdt_conv   tiledispatch.torch.linear / conv (no grad needed: the eager inference path), on the
                torch tensors (the weight of the GEMM as a Linear's [n, k]; conv forward problems only)
  patched_linear, patched_conv   an nn.Linear / nn.ConvNd (no bias, parameters not requiring grad) routed through
                the bundle by tiledispatch.torch.patch, called on the same input
  tdt_linear_train, tdt_conv_train   a training step's call: the operator with gradients recorded, then
                .backward() of the output (GEMM: the forward and both gradient GEMMs; conv forward problems: the
                forward, bwd_data and bwd_weight), on leaves of the same data; torch_linear_train /
                torch_conv_train: the same with F.linear / F.conv1d/2d/3d. A conv pair is left out, and said so
                under the problem's paths_skipped, where the bundles have no bwd_data or bwd_weight kernel for it
  torch_*       PyTorch on the same tensors: torch.mm(out=) and F.linear; F.conv1d/2d/3d and
                aten.convolution_backward (what autograd runs for the input / weight gradients), with
                torch.backends.cudnn.benchmark on; torch_linear_module / torch_conv_module: the patched
                layer's twin left on PyTorch (what patched_* compare with: both pay nn.Module's call)

On the cpu backend the kernels run on the calling thread (num_threads=1 for ours, torch.set_num_threads(1)
for torch), so the problems are tiny and the time includes the (small) computation: there the numbers say
how much host work each path adds to the raw call, which is what this file is for. The results are written
to DIR/host_overhead_<tag>.json (tag: "h100"-style from the GPU's name; "cpu_diagnostic" on the cpu backend).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

# The cpu kernels' OpenMP pool, read when it starts: one thread, as torch.set_num_threads(1) and num_threads=1 give
# the other paths; the tiledispatch.torch paths cannot pass num_threads (no effect on GPU kernels)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = Path(__file__).resolve().parents[1]  # bench/
sys.path.insert(0, str(HERE.parent / "runtime"))
sys.path.insert(0, str(HERE))

import tiledispatch as td  # noqa: E402
from tiledispatch import abi  # noqa: E402
import tiledispatch.torch as tdt  # noqa: E402
from tiledispatch.ops import conv as conv_op  # noqa: E402
from tiledispatch.ops import gemm as gemm_op  # noqa: E402

ROUNDS = 31
CALLS = {"cuda": 200, "cpu": 100}
FIRST_CALLS = 5  # a first call costs 0.1-3 ms: fewer per burst
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


# -- problems ---------------------------------------------------------------------------------------------------
def gemm_problems(device: str):
    """(name, m, n, k) of the GEMMs: one small (the launch dominates) and one larger on the GPU; tiny on cpu."""
    if device == "cpu":
        return [("gemm_16x16x16", 16, 16, 16)]
    return [("gemm_128x128x128", 128, 128, 128), ("gemm_4096x4096x4096", 4096, 4096, 4096)]


def conv_problems(device: str):
    """(name, direction, N, C, K, G, spatial, filter, stride, padding) of the convolutions: a ResNet 3x3 layer in
    the three directions, a depthwise and a pointwise (on the GEMM kernels where the bundle has them) forward, and
    a 1D and a 3D forward. Tiny on cpu."""
    if device == "cpu":
        base = [("conv2d_3x3", 1, 8, 8, 1, (6, 6), (3, 3), 1, 1)]
        extra = [("conv1d_3", "fwd", 1, 8, 8, 1, (8,), (3,), 1, 1),
                 ("conv3d_3x3x3", "fwd", 1, 8, 8, 1, (4, 4, 4), (3, 3, 3), 1, 1),
                 ("conv2d_depthwise_3x3", "fwd", 1, 8, 8, 8, (6, 6), (3, 3), 1, 1)]
    else:
        base = [("conv2d_3x3_resnet", 32, 64, 64, 1, (56, 56), (3, 3), 1, 1)]
        extra = [("conv2d_depthwise_3x3", "fwd", 32, 96, 96, 96, (56, 56), (3, 3), 1, 1),
                 ("conv2d_1x1_pointwise", "fwd", 32, 256, 64, 1, (56, 56), (1, 1), 1, 0),
                 ("conv1d_3", "fwd", 32, 256, 256, 1, (1024,), (3,), 1, 1),
                 ("conv3d_3x3x3", "fwd", 8, 64, 64, 1, (16, 28, 28), (3, 3, 3), 1, 1)]
    out = []
    for name, n, c, k, g, spatial, filt, stride, padding in base:
        for direction in ("fwd", "bwd_data", "bwd_weight"):
            out.append((f"{name}_{direction}", direction, n, c, k, g, spatial, filt, stride, padding))
    return out + extra


def conv_problem(spec, dtype: str, direction: Optional[str] = None) -> td.ConvProblem:
    """The ConvProblem of a conv_problems() entry, in its own direction or the one given."""
    _, own, n, c, k, g, spatial, filt, stride, padding = spec
    return td.ConvProblem(direction or own, n, g, c, k, spatial, filt, stride, 1, padding, padding, dtype, dtype,
                          dtype)


# -- tensors ----------------------------------------------------------------------------------------------------
class Tensors:
    """Random tensors of one framework and device: torch (cuda or cpu) or numpy; torch twins for the torch paths."""

    def __init__(self, device: str, arrays: str, seed: int = 7):
        self.device, self.arrays = device, arrays
        self.gen = torch.Generator(device="cuda" if device == "cuda" else "cpu")
        self.gen.manual_seed(seed)

    def torch_rand(self, shape, dtype: str) -> torch.Tensor:
        dev = "cuda" if self.device == "cuda" else "cpu"
        return (torch.rand(shape, generator=self.gen, device=dev) * 2 - 1).to(TORCH_DTYPES[dtype])

    def channels_last(self, shape, dtype: str) -> torch.Tensor:
        """[N, C, spatial...] (or [K, C/G, filter...]) with the channels innermost in memory, in every rank (torch's
        channels_last / channels_last_3d for 2D / 3D): the memory of our explicit-group-axis form."""
        t = self.torch_rand((shape[0], *shape[2:], shape[1]), dtype)
        return t.permute(0, len(shape) - 1, *range(1, len(shape) - 1))

    def ours(self, t: torch.Tensor):
        """The array our calls take for a torch tensor (the same memory): numpy on request on the cpu backend."""
        return t.numpy() if self.arrays == "numpy" else t


# -- timing -----------------------------------------------------------------------------------------------------
def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def issue_us(fn, calls: int, device: str, before=None) -> float:
    """Host microseconds per call for one burst of calls issued after a synchronize; before() runs ahead of each
    call outside the clock (first_call empties the caches there)."""
    synchronize(device)
    if before is None:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - t0
    else:
        elapsed = 0.0
        for _ in range(calls):
            before()
            t0 = time.perf_counter()
            fn()
            elapsed += time.perf_counter() - t0
    synchronize(device)
    return elapsed / calls * 1e6


def measure(paths: dict, device: str, rounds: int, seed: int = 3) -> dict:
    """paths: name -> (fn, before or None). Median, p10 and p90 over rounds of host us per call."""
    for fn, before in paths.values():  # warm-up: caches, cudnn.benchmark, lazy initialization
        for _ in range(3 if before else 20):
            if before:
                before()
            fn()
    samples = {name: [] for name in paths}
    rng = random.Random(seed)
    for _ in range(rounds):
        order = list(paths)
        rng.shuffle(order)
        for name in order:
            fn, before = paths[name]
            calls = FIRST_CALLS if before else CALLS[device]
            samples[name].append(issue_us(fn, calls, device, before))
            if before:  # first_call emptied the caches: fill them again outside the clock
                for other, other_before in paths.values():
                    if other_before is None:
                        other()
    return {name: {"median_us": round(statistics.median(v), 3), "p10_us": round(sorted(v)[len(v) // 10], 3),
                   "p90_us": round(sorted(v)[(9 * len(v)) // 10], 3)} for name, v in samples.items()}


def forget(reg):
    """Empty every cache of the registry: the next call is a first call."""
    return reg.clear_caches


def raw_call(reg):
    """td_run on the prebuilt arguments of the launch the last public call cached (the newest entry of the
    registry's launch cache): the floor of that call, with its kernel and its arguments."""
    launcher = reg._launches.values()[-1]
    plan = launcher.plan
    run, ref, reason = plan._run, plan._args_ref, plan._reason
    return (lambda: run(ref, reason, abi.REASON_BYTES_ARG)), plan.kernel.name


# -- one problem each -------------------------------------------------------------------------------------------
def gemm_paths(reg, tensors: Tensors, m: int, n: int, k: int, dtype: str, opts: dict) -> tuple[dict, dict]:
    a_t, bt_t = tensors.torch_rand((m, k), dtype), tensors.torch_rand((n, k), dtype)
    d_t = torch.empty((m, n), dtype=TORCH_DTYPES[dtype], device=a_t.device)
    a, b, d = tensors.ours(a_t), tensors.ours(bt_t).T, tensors.ours(d_t)
    reg.gemm(a, b, out=d, **opts)
    raw, kernel = raw_call(reg)
    problem = gemm_op.operands(a, b, d)[0]
    plan = reg.plan(problem, kernel=kernel, **opts)
    plan_tensors = {"a": a, "b": b, "out": d}
    b_t = bt_t.t()
    linear = torch.nn.Linear(k, n, bias=False, device=a_t.device, dtype=a_t.dtype).requires_grad_(False)
    linear.weight.copy_(bt_t)
    torch_linear_module = copy.deepcopy(linear)  # the same layer left on PyTorch: the module call's own cost
    tdt.patch(linear, reg)
    grad_out = tensors.torch_rand((m, n), dtype)
    ours_a, ours_w, torch_a, torch_w = (t.detach().clone().requires_grad_(True) for t in (a_t, bt_t) * 2)
    paths = {
        "raw_c_call": (raw, None),
        "default": (lambda: reg.gemm(a, b, out=d, **opts), None),
        "named_kernel": (lambda: reg.gemm(a, b, out=d, kernel=kernel, **opts), None),
        "plan": (lambda: plan(plan_tensors), None),
        "first_call": (lambda: reg.gemm(a, b, out=d, **opts), forget(reg)),
        "tdt_linear": (lambda: tdt.linear(a_t, bt_t, registry=reg), None),
        "patched_linear": (lambda: linear(a_t), None),
        "torch_mm_out": (lambda: torch.mm(a_t, b_t, out=d_t), None),
        "torch_linear": (lambda: F.linear(a_t, bt_t), None),
        "torch_linear_module": (lambda: torch_linear_module(a_t), None),
        "tdt_linear_train": (lambda: tdt.linear(ours_a, ours_w, registry=reg).backward(grad_out), None),
        "torch_linear_train": (lambda: F.linear(torch_a, torch_w).backward(grad_out), None),
    }
    if tensors.device == "cuda":
        stream = torch.cuda.current_stream().cuda_stream
        paths["explicit_stream"] = (lambda: reg.gemm(a, b, out=d, kernel=kernel, stream=stream), None)
    return paths, {"problem": str(problem), "kernel": kernel}


def conv_paths(reg, tensors: Tensors, spec, dtype: str, opts: dict) -> tuple[dict, dict]:
    _, direction, n, c, k, g, spatial, filt, stride, padding = spec
    rank = len(spatial)
    out_spatial = tuple((s + 2 * padding - f) // stride + 1 for s, f in zip(spatial, filt))
    x_t = tensors.channels_last((n, c, *spatial), dtype)
    w_t = tensors.channels_last((k, c // g, *filt), dtype)
    dy_t = tensors.channels_last((n, k, *out_spatial), dtype)
    geo = {"stride": stride, "padding": padding, "groups": g}
    x, w, dy = tensors.ours(x_t), tensors.ours(w_t), tensors.ours(dy_t)
    out_t = torch.empty_like({"fwd": dy_t, "bwd_data": x_t, "bwd_weight": w_t}[direction])  # same strides
    out = tensors.ours(out_t)
    if direction == "fwd":
        def call(**kw):
            return reg.conv_fwd(x, w, out, **geo, **kw)
        tensors_of_plan = {"x": x, "w": w, "y": out}
    elif direction == "bwd_data":
        def call(**kw):
            return reg.conv_bwd_data(dy, w, out, **geo, **kw)
        tensors_of_plan = {"x": out, "w": w, "y": dy}
    else:
        def call(**kw):
            return reg.conv_bwd_weight(x, dy, out, **geo, **kw)
        tensors_of_plan = {"x": x, "w": out, "y": dy}
    call(**opts)
    raw, kernel = raw_call(reg)
    problem, _ = conv_op.operands(direction, tensors_of_plan["x"], tensors_of_plan["w"], tensors_of_plan["y"], **geo)
    conv_kernel = reg.select(problem).name  # the default may have run on a GEMM kernel (pointwise)
    plan = reg.plan(problem, kernel=conv_kernel, **opts)
    conv_nd = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[rank]
    ones = [1] * rank
    skipped = {}  # path -> why it is not timed
    paths = {
        "raw_c_call": (raw, None),
        "default": (lambda: call(**opts), None),
        "named_kernel": (lambda: call(kernel=conv_kernel, **opts), None),
        "plan": (lambda: plan(tensors_of_plan), None),
        "first_call": (lambda: call(**opts), forget(reg)),
    }
    if direction == "fwd":
        layer = getattr(torch.nn, f"Conv{rank}d")(c, k, filt, stride=stride, padding=padding, groups=g, bias=False,
                                                 device=x_t.device, dtype=x_t.dtype).requires_grad_(False)
        layer.weight = torch.nn.Parameter(w_t, requires_grad=False)  # w_t's channels-last memory, used in place
        torch_layer = copy.deepcopy(layer)
        tdt.patch(layer, reg)
        paths["tdt_conv"] = (lambda: tdt.conv(x_t, w_t, registry=reg, stride=stride, padding=padding, groups=g), None)
        paths["patched_conv"] = (lambda: layer(x_t), None)
        paths["torch_conv"] = (lambda: conv_nd(x_t, w_t, stride=stride, padding=padding, groups=g), None)
        paths["torch_conv_module"] = (lambda: torch_layer(x_t), None)
        missing = [d for d in ("bwd_data", "bwd_weight") if not reg.supports(conv_problem(spec, dtype, d))]
        if missing:  # the training pair needs both gradient directions
            skipped["tdt_conv_train"] = skipped["torch_conv_train"] = f"no {' or '.join(missing)} kernel for it"
        else:
            ours_x, ours_w, torch_x, torch_w = (t.detach().clone().requires_grad_(True) for t in (x_t, w_t) * 2)
            paths["tdt_conv_train"] = (lambda: tdt.conv(ours_x, ours_w, registry=reg, stride=stride,
                                                        padding=padding, groups=g).backward(dy_t), None)
            paths["torch_conv_train"] = (lambda: conv_nd(torch_x, torch_w, stride=stride, padding=padding,
                                                         groups=g).backward(dy_t), None)
    else:
        mask = [direction == "bwd_data", direction == "bwd_weight", False]
        paths["torch_convolution_backward"] = (lambda: torch.ops.aten.convolution_backward(
            dy_t, x_t, w_t, None, [stride] * rank, [padding] * rank, ones, False, [0] * rank, g, mask), None)
    return paths, {"problem": str(problem), "kernel": kernel, "named_kernel": conv_kernel,
                   **({"paths_skipped": skipped} if skipped else {})}


# -- machine ----------------------------------------------------------------------------------------------------
def machine(device: str) -> dict:
    info = {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
            "tiledispatch": td.__version__, "host_cpu": _cpu_model()}
    try:
        info["commit"] = subprocess.run(["git", "-C", str(HERE), "describe", "--always", "--dirty"], capture_output=True,
                                        text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    if device == "cuda":
        from _gpu_common import machine as gpu_machine

        info.update(gpu_machine())
        info["cudnn_benchmark"] = torch.backends.cudnn.benchmark
    else:
        info["torch_threads"] = torch.get_num_threads()
    return info


def _cpu_model() -> str:
    try:
        return next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    except OSError:
        return platform.processor()


def default_tag(device: str) -> str:
    if device == "cpu":
        return "cpu_diagnostic"
    name = torch.cuda.get_device_name(0).lower()
    found = re.search(r"\b([a-z]\d{2,4}[a-z]?)\b", name)
    return found.group(1) if found else re.sub(r"[^a-z0-9]+", "_", name).strip("_")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="+", help="bundles to load (GEMM and conv kernels may come from different ones)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--tag", default=None, help="result file name tag (default: from the device)")
    ap.add_argument("--dtype", default=None, help="fp16 (GPU default) or fp32 (cpu default)")
    ap.add_argument("--problems", default="", help="comma-separated substrings: only problems whose name has one")
    ap.add_argument("--arrays", choices=("numpy", "torch"), default="numpy",
                    help="cpu backend: numpy arrays (default) or torch CPU tensors for our calls")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    a = ap.parse_args()

    registries = [td.load(b) for b in a.bundles]
    device = registries[0].device
    if any(r.device != device for r in registries):
        raise SystemExit("bundles for different devices")
    dtype = a.dtype or ("fp32" if device == "cpu" else "fp16")
    opts = {"num_threads": 1} if device == "cpu" else {}
    if device == "cuda":
        torch.backends.cudnn.benchmark = True
    else:
        torch.set_num_threads(1)
    tensors = Tensors(device, a.arrays if device == "cpu" else "torch")
    wanted = [s for s in a.problems.split(",") if s]

    def chosen(name):
        return not wanted or any(s in name for s in wanted)

    def registry_for(op: str, problem_of):
        """The first registry with a kernel for the problem (its bundle holds the op and the dtype)."""
        for reg in registries:
            if op in reg.ops:
                try:
                    if reg.supports(problem_of()):
                        return reg
                except td.InvalidInputError:
                    continue
        return None

    results, skipped = {}, {}
    for name, m, n, k in gemm_problems(device):
        if not chosen(name):
            continue
        reg = registry_for("gemm", lambda: td.GemmProblem(m, n, k, dtype, dtype, dtype, "rcr"))
        if reg is None:
            skipped[name] = f"no bundle has a {dtype} rcr GEMM kernel for it"
            continue
        paths, info = gemm_paths(reg, tensors, m, n, k, dtype, opts)
        results[name] = {**info, "paths": measure(paths, device, a.rounds)}
        print(name, json.dumps(_summary(results[name])), flush=True)
    for spec in conv_problems(device):
        name, direction, spatial = spec[0], spec[1], spec[6]
        if not chosen(name):
            continue
        reg = registry_for("conv", lambda: conv_problem(spec, dtype))
        if reg is None:
            skipped[name] = f"no bundle has a {dtype} conv{len(spatial)}d {direction} kernel for it"
            continue
        paths, info = conv_paths(reg, tensors, spec, dtype, opts)
        results[name] = {**info, "paths": measure(paths, device, a.rounds)}
        print(name, json.dumps(_summary(results[name])), flush=True)

    for r in results.values():
        raw = r["paths"]["raw_c_call"]["median_us"]
        r["above_raw_us"] = {p: round(v["median_us"] - raw, 3) for p, v in r["paths"].items() if p != "raw_c_call"}
    report = {
        "machine": machine(device), "device": device, "dtype": dtype, "arrays": tensors.arrays,
        "bundles": [{"path": str(b), "backend": r.backend, "arch": r.arch, "kernels": len(r)}
                    for b, r in zip(a.bundles, registries)],
        "method": (f"host issue time per call: bursts of {CALLS[device]} calls ({FIRST_CALLS} for first_call, caches "
                   f"emptied before each call outside the clock)" + (" after a synchronize" if device == "cuda" else
                   ", kernels single-threaded on tiny problems") +
                   f"; {a.rounds} rounds, paths interleaved in shuffled order; median (p10, p90) over rounds; "
                   f"above_raw_us: median minus raw_c_call's"),
        "problems": results, "skipped": skipped,
    }
    out = Path(a.out) / f"host_overhead_{a.tag or default_tag(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


def _summary(r: dict) -> dict:
    return {p: v["median_us"] for p, v in r["paths"].items()}


if __name__ == "__main__":
    main()
