"""Whole models through tiledispatch.torch.patch() and fuse() against PyTorch eager and torch.compile, in one run.

    python bench/benchmarks/models.py --bundle BUNDLE [--quick] [--models resnet50_train,mobilenet_v2,...] [--out DIR]
    python bench/benchmarks/models.py --device cpu --tiny --bundle BUNDLE      # the same code on the cpu backend

Cases: a torchvision ResNet-50 training step (forward + backward, batch 32, 224^2, channels_last), ResNet-50,
MobileNetV2, ConvNeXt-T, EfficientNet-B0, MnasNet 1.0 and MobileNetV3-Large inference (batch 32), and the seven
linear layers of a Llama-3-8B decoder layer (hidden 4096, q 4096, kv 1024, intermediate 14336; no bias) at prefill
(2048 tokens) and decode (batch 1, 8, 32). The
models run in half precision on the GPU (--dtype), float32 on the CPU. Variants, each run eagerly and captured
in a CUDA graph (GPU only; a capture that fails is recorded as such, with its error): PyTorch eager
(cudnn.benchmark), torch.compile (Inductor, default mode), the model patched with tiledispatch (tiledispatch),
the model fused by tiledispatch.torch.fuse (fused: batch norms folded and conv -> bn -> residual -> activation /
linear -> activation chains in single calls for inference; in the training step batch norms stay PyTorch's, so
little fuses), and the fused model under torch.compile (fused_compile: Inductor traces through the tiledispatch
operators and fuses the element-wise layers fuse() leaves, e.g. ConvNeXt's LayerNorm). Every variant's output
(and, for the training step, every parameter's gradient) is compared with eager's as ||x - eager|| / ||eager||,
and with a float64 copy of the model on the same input (out_rel_err_fp64, grad_rel_err_fp64_*; eager's own
included): which variant is nearer the exact result. The output
is within tolerance (out_within_tolerance) when it is within ten times the backend's per-kernel validation
tolerance for the dtype of eager's, or no farther than that beyond eager's own distance from the float64 output (a
deep randomly initialised model in fp16 is itself percents away from it). For inference with batch norms folded,
folded_model_rel_err_fp64 is what the folding alone costs: the float64 model with the folded (rounded) parameters.
The JSON records the machine, versions, the bundle, each variant's time (median of rounds of CUDA-event timing;
eager variants include their host work; speedup_vs_eager_paired: each eagerly called variant against eager in
rounds alternating between them, the median of the per-round ratios, steadier than the ratio of two medians taken
one after the other on a host whose speed drifts), the patch report (kernels per layer; layers left on PyTorch and
why), the fuse report (what was fused into what, what stayed and why), a per-layer comparison of the patched layers
against PyTorch (each captured in a CUDA graph: kernel time without host work), and the host cost per call of the
torch operators. A PNG plots the model times (matplotlib, when installed).

Without torchvision (or with --tiny), small stand-ins with the same layer kinds replace the torchvision models.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "runtime"))

import tiledispatch as td  # noqa: E402
import tiledispatch.torch as tdt  # noqa: E402
from tiledispatch import backends  # noqa: E402

LLAMA = {"hidden": 4096, "q": 4096, "kv": 1024, "intermediate": 14336}
TINY_LLAMA = {"hidden": 64, "q": 64, "kv": 16, "intermediate": 160}
CASES = ("resnet50_train", "resnet50", "mobilenet_v2", "convnext_tiny", "efficientnet_b0", "mnasnet1_0",
         "mobilenet_v3_large", "llama3_8b_prefill2048", "llama3_8b_decode1", "llama3_8b_decode8", "llama3_8b_decode32")
VARIANTS = ("eager", "compile", "tiledispatch", "fused", "fused_compile")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


# -- models ----------------------------------------------------------------------------------------------------
class LlamaLinears(nn.Module):
    """The linear layers of one Llama decoder layer with the glue that feeds them: q/k/v projections of the
    normed input, the output projection (of q standing in for attention's output), the residual, and the SwiGLU
    MLP (gate, up, down)."""

    def __init__(self, d: dict):
        super().__init__()
        h, q, kv, inter = d["hidden"], d["q"], d["kv"], d["intermediate"]
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(h, q, bias=False), nn.Linear(h, kv, bias=False), \
            nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(h, inter, bias=False), nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        h = x + self.o_proj(q) + (k.sum(-1, keepdim=True) + v.sum(-1, keepdim=True)) * 0
        return h + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyBottleneck(nn.Module):
    def __init__(self, c: int, mid: int, groups: int = 1):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
                                  nn.Conv2d(mid, mid, 3, padding=1, groups=groups, bias=False), nn.BatchNorm2d(mid),
                                  nn.ReLU(), nn.Conv2d(mid, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return torch.relu(x + self.body(x))


def tiny_resnet() -> nn.Module:
    """A ResNet-shaped stand-in: 7x7 stride-2 stem on 3 channels, bottlenecks, pooling, a classifier."""
    return nn.Sequential(nn.Conv2d(3, 16, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.MaxPool2d(3, 2, 1), TinyBottleneck(16, 8), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                         TinyBottleneck(32, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def tiny_mobilenet() -> nn.Module:
    """Inverted residuals: pointwise expand, depthwise 3x3, pointwise project (MobileNetV2's layer kinds)."""
    def block(c, e, stride):
        return nn.Sequential(nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e), nn.ReLU6(),
                             nn.Conv2d(e, e, 3, stride=stride, padding=1, groups=e, bias=False), nn.BatchNorm2d(e),
                             nn.ReLU6(), nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c))
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
                         block(16, 64, 1), block(16, 64, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


class TinyConvNeXtBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.pw1, self.pw2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pw2(F.gelu(self.pw1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


def tiny_convnext() -> nn.Module:
    """ConvNeXt's layer kinds: a 4x4 stride-4 stem, depthwise 7x7, Linear layers on channels-last tokens."""
    return nn.Sequential(nn.Conv2d(3, 32, 4, stride=4), TinyConvNeXtBlock(32), nn.Conv2d(32, 64, 2, stride=2),
                         TinyConvNeXtBlock(64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


class TinySqueezeExcite(nn.Module):
    """Squeeze-and-excitation as EfficientNet and MobileNetV3 have it: pooled channels through two 1x1 convs (with
    bias) and a gate, which scales the input per channel."""

    def __init__(self, c: int, squeeze: int, act, gate):
        super().__init__()
        self.pool, self.fc1, self.act = nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, squeeze, 1), act()
        self.fc2, self.gate = nn.Conv2d(squeeze, c, 1), gate()

    def forward(self, x):
        return x * self.gate(self.fc2(self.act(self.fc1(self.pool(x)))))


class TinyMBConv(nn.Module):
    """An inverted residual block of the MobileNetV3 / EfficientNet / MnasNet kind: pointwise expansion, a k x k
    depthwise conv, optional squeeze-and-excitation, pointwise projection, a residual where the shape allows."""

    def __init__(self, c_in: int, c_out: int, expand: int, k: int, stride: int, act, se: Optional[tuple] = None):
        super().__init__()
        e = c_in * expand
        expansion = [nn.Conv2d(c_in, e, 1, bias=False), nn.BatchNorm2d(e), act()] if expand != 1 else []
        self.body = nn.Sequential(*expansion, nn.Conv2d(e, e, k, stride=stride, padding=k // 2, groups=e, bias=False),
                                  nn.BatchNorm2d(e), act())
        self.se = TinySqueezeExcite(e, max(1, c_in // 4), *se) if se is not None else nn.Identity()
        self.project = nn.Sequential(nn.Conv2d(e, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        y = self.project(self.se(self.body(x)))
        return x + y if self.residual else y


def tiny_mbconv_net(act, se: Optional[tuple], kernels: tuple) -> nn.Module:
    """A stem, three inverted residual blocks with the given depthwise kernel sizes (the last two at one width, so
    one has a residual), a 1x1 head and a classifier. se: the squeeze-excitation's (activation, gate), or None."""
    k1, k2, k3 = kernels
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), act(),
                         TinyMBConv(16, 16, 1, k1, 1, act, se), TinyMBConv(16, 24, 4, k2, 2, act, se),
                         TinyMBConv(24, 24, 4, k3, 1, act, se), nn.Conv2d(24, 64, 1, bias=False),
                         nn.BatchNorm2d(64), act(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


TINY_MODELS = {"resnet50": tiny_resnet, "mobilenet_v2": tiny_mobilenet, "convnext_tiny": tiny_convnext,
               # EfficientNet: SiLU, sigmoid-gated squeeze-excitation, 3x3 and 5x5 depthwise
               "efficientnet_b0": lambda: tiny_mbconv_net(nn.SiLU, (nn.SiLU, nn.Sigmoid), (3, 5, 5)),
               # MnasNet: ReLU, no squeeze-excitation, 3x3 and 5x5 depthwise
               "mnasnet1_0": lambda: tiny_mbconv_net(nn.ReLU, None, (3, 5, 3)),
               # MobileNetV3: hard-swish, squeeze-excitation with ReLU and a hard-sigmoid gate
               "mobilenet_v3_large": lambda: tiny_mbconv_net(nn.Hardswish, (nn.ReLU, nn.Hardsigmoid), (3, 5, 3))}


def build(case: str, tiny: bool, vision) -> tuple[nn.Module, tuple, bool, str]:
    """(model, input shape, training, what the model is)."""
    if case.startswith("llama"):
        d = TINY_LLAMA if tiny else LLAMA
        tokens = 16 if (tiny and "prefill" in case) else (2048 if "prefill" in case else int(case.split("decode")[1]))
        what = f"Llama-3-8B decoder-layer linears{' (tiny)' if tiny else ''}"
        return LlamaLinears(d), (tokens, d["hidden"]), False, what
    batch, size = (2, 32) if tiny else (32, 224)
    if vision is not None and not tiny:
        model = getattr(vision, case.replace("_train", ""))()
        what = f"torchvision {case.replace('_train', '')}"
    else:
        model = TINY_MODELS[case.replace("_train", "")]()
        what = f"stand-in for {case} (tiny{'' if vision is not None else ', torchvision not installed'})"
    return model, (batch, 3, size, size), case.endswith("_train"), what


def calibrate_batch_norms(model: nn.Module, x: torch.Tensor) -> bool:
    """Set the batch norms' running statistics from x (two train-mode passes, cumulative averages), as a trained
    model has them: with the initial statistics (mean 0, variance 1) a randomly initialised MobileNetV2's eval-mode
    output vanishes (about 1e-8 in float32, exactly 0 in fp16), and every comparison with it would pass. Whether
    the model has batch norms."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return False
    momenta = [m.momentum for m in norms]
    was_training = model.training
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(x)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    model.train(was_training)
    return True


# -- timing ----------------------------------------------------------------------------------------------------
class Timer:
    """Median over rounds of the mean time per call, each round long enough (target_ms) for the clock."""

    def __init__(self, device: str, rounds: int, target_ms: float, min_iters: int = 2):
        self.device, self.rounds, self.target_ms, self.min_iters = device, rounds, target_ms, min_iters

    def _round(self, fn, iters: int) -> float:
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters

    def __call__(self, fn) -> dict:
        once = self._round(fn, 1)
        iters = max(self.min_iters, min(2000, math.ceil(self.target_ms / max(once, 1e-3))))
        times = sorted(self._round(fn, iters) for _ in range(self.rounds))
        return {"median_ms": statistics.median(times), "p10_ms": times[len(times) // 10],
                "p90_ms": times[(9 * len(times)) // 10], "iters_per_round": iters, "rounds": self.rounds}

    def paired(self, steps: dict, rounds: int) -> dict:
        """Each step's time against the first's, from rounds that time every step once in turn (the order rotating
        from round to round): name -> the median over rounds of first's time / its time. A host's speed drifts
        within a process by more than the gap between two host-bound steps; a ratio within one round sees about
        the same host for both."""
        names = list(steps)
        iters = {n: max(self.min_iters, min(2000, math.ceil(self.target_ms / max(self._round(steps[n], 1), 1e-3))))
                 for n in names}
        times = {n: [] for n in names}
        for r in range(rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                times[n].append(self._round(steps[n], iters[n]))
        first = times[names[0]]
        return {n: statistics.median(f / t for f, t in zip(first, times[n])) for n in names[1:]}


_SIDE = []


def _side_stream():
    """One capture stream for the whole run: tiledispatch keeps plans and workspaces per stream."""
    if not _SIDE:
        _SIDE.append(torch.cuda.Stream())
    return _SIDE[0]


def runner(step, device: str, graph: bool, warmup: int, params=()):
    """A no-argument function running step once: as called, or replaying its CUDA graph (captured on the stream
    it was warmed up on, so that tiledispatch's per-stream plans and workspaces are the captured ones).
    params: the model's parameters, whose gradients a graph must allocate itself (a gradient made on another
    stream before the capture is accumulated into across streams, which the capture refuses)."""
    if not graph:
        for _ in range(warmup):
            step()
        return step
    for p in params:
        p.grad = None
    side = _side_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        step()
    torch.cuda.synchronize()
    return g.replay


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# -- one case --------------------------------------------------------------------------------------------------
def make_step(model, x, gout, training: bool, out_box: list):
    if training:
        def step():
            out = model(x)
            out.backward(gout)
            out_box[:] = [out]
    else:
        def step():
            with torch.no_grad():
                out_box[:] = [model(x)]
    return step


def snapshot(model, out_box, training: bool) -> dict:
    state = {"out": out_box[0].detach().clone()}
    model = getattr(model, "_orig_mod", model)  # a compiled model's parameters under their own names
    if training:
        state["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return state


def zero_grads(model) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


def grad_errors(state: dict, ref: dict, suffix: str = "") -> dict:
    """Every parameter's gradient against ref's: the worst (NaN first: a broken gradient) and the median."""
    if "grads" not in ref:
        return {}
    errs = {n: rel_err(state["grads"][n], g) if n in state["grads"] else float("nan") for n, g in ref["grads"].items()}
    worst = max(errs, key=lambda n: math.inf if math.isnan(errs[n]) else errs[n])
    return {f"grad_rel_err{suffix}_max": errs[worst], f"grad_rel_err{suffix}_worst": worst,
            f"grad_rel_err{suffix}_median": statistics.median(errs.values())}


def compare(state: dict, ref: dict, tolerance: float, exact: Optional[dict], eager: Optional[dict]) -> dict:
    """state against eager's (ref) and against the float64 model's (exact). Within tolerance: near eager's output,
    or no farther from the exact output than eager (eager: its entry; None for eager itself) by more than the
    tolerance: a deep randomly initialised model in fp16 is itself about 2e-2 from its float64 copy (ResNet-50 on
    the H200), and two fp16 computations of it differ by as much."""
    err = rel_err(state["out"], ref["out"])
    result = {"out_rel_err": err, "out_tolerance": tolerance, **grad_errors(state, ref)}
    if exact is not None:
        result["out_rel_err_fp64"] = rel_err(state["out"], exact["out"])
        result.update(grad_errors(state, exact, "_fp64"))
    baseline = (eager or result).get("out_rel_err_fp64")
    result["out_within_tolerance"] = err <= tolerance or (
        baseline is not None and result["out_rel_err_fp64"] <= baseline + tolerance)
    return result


def exact_reference(base: nn.Module, x: torch.Tensor, gout: Optional[torch.Tensor], training: bool) -> dict:
    """A float64 copy's output (and, training, its parameters' gradients for gout) on the same input: which
    variant is nearer the exact result where two fp16 computations differ (no TF32 in float64)."""
    model = copy.deepcopy(base).double()
    if not training:
        with torch.no_grad():
            return {"out": model(x.double())}
    out = model(x.double())
    out.backward(gout.double())
    return {"out": out.detach(), "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def folded_model_error(base: nn.Module, freport, x: torch.Tensor, truth: torch.Tensor) -> Optional[float]:
    """What folding the batch norms costs by itself, no kernel involved: a float64 copy of the model with the
    weights and biases fuse() folded (in the model's dtype) in place of its convs' and identity batch norms, against
    the float64 model. None without a folded batch norm."""
    from tiledispatch.torch_fusion import _fold_bn

    model, originals = copy.deepcopy(base).double(), dict(base.named_modules())
    modules, folded = dict(model.named_modules()), 0
    for layer in freport.fused:
        if "batch norm folded" not in layer.epilogue:
            continue
        at = layer.parts.index(layer.name)  # the conv, after the product a scaled conv takes in (FusedScaledConv)
        conv_name, bn_name = layer.parts[at], layer.parts[at + 1]
        w, b = _fold_bn(originals[conv_name], originals[bn_name])
        conv, bn = modules[conv_name], modules[bn_name]
        with torch.no_grad():
            conv.weight.copy_(w.double())
            conv.bias = nn.Parameter(b.double(), requires_grad=False)
            bn.running_mean.zero_(), bn.running_var.fill_(1 - bn.eps), bn.weight.fill_(1), bn.bias.zero_()
        folded += 1
    if not folded:
        return None
    with torch.no_grad():
        return rel_err(model(x.double()), truth)


def run_case(case: str, a, reg, vision, timer: Timer) -> dict:
    device, dtype = a.device, DTYPES[a.dtype]
    torch.manual_seed(0)
    base, shape, training, what = build(case, a.tiny, vision)
    base = base.to(device=device, dtype=dtype)
    fmt = torch.channels_last if len(shape) == 4 else torch.contiguous_format
    base = base.to(memory_format=fmt)
    base.train(training)
    if not training:
        base.requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(shape, generator=gen, device=device).to(dtype).contiguous(memory_format=fmt)
    result = {"model": what, "input": list(shape), "dtype": a.dtype, "training": training, "variants": {}}
    if not training:  # inference: the batch norms hold statistics, which fuse() folds into the convs
        result["batch_norms_calibrated"] = calibrate_batch_norms(base, x)
    gout = None
    if training:
        with torch.no_grad():
            gout = torch.randn(base(x).shape, generator=gen, device=device).to(dtype)
    exact = exact_reference(base, x, gout, training)

    models = {"eager": base}
    if "compile" in a.variants:
        models["compile"] = torch.compile(copy.deepcopy(base))
    if "tiledispatch" in a.variants:
        patched = copy.deepcopy(base)
        try:
            report = tdt.patch(patched, reg, example_inputs=x)
        except td.TileDispatchError as e:  # a layer the bundle cannot run: the variant records it again below
            result["patch_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            report = tdt.patch(patched, reg)
        result["patch_report"] = report.to_dict()
        result["unsupported_layers"] = [r.to_dict() for r in report.unsupported]
        models["tiledispatch"] = patched
    if "fused" in a.variants or "fused_compile" in a.variants:
        try:
            fused, freport = tdt.fuse(base, reg)  # a copy: base stays the reference
            result["fuse_report"] = freport.to_dict()
            if not training:
                result["folded_model_rel_err_fp64"] = err = folded_model_error(base, freport, x, exact["out"])
                if err is not None:
                    print(f"  {case:26s} the folded parameters alone (float64 model): out err (fp64) {err:.2e}",
                          flush=True)
            if "fused" in a.variants:
                models["fused"] = fused
            if "fused_compile" in a.variants:  # Inductor around the fused calls, for the element-wise layers left
                models["fused_compile"] = torch.compile(fused)
            print(f"  {case:26s} fuse: {len(freport.fused)} fused layer(s), {len(freport.kept)} op(s) kept, "
                  f"{len(freport.untraced)} module(s) not traceable, "
                  f"{len(freport.patch.unsupported)} layer(s) on PyTorch", flush=True)
        except Exception as e:  # recorded; the other variants still run
            for name in {"fused", "fused_compile"}.intersection(a.variants):
                result["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}",
                                            "traceback": traceback.format_exc()[-3000:]}
    tolerance = 10 * backends.get(reg.backend).tolerance[a.dtype]
    ref = None
    for variant, model in models.items():
        for graph in (False, True) if device == "cuda" else (False,):
            name = f"{variant}{'+cuda_graph' if graph else ''}"
            t0 = time.perf_counter()
            if t0 - a.started > a.budget_s:
                result["variants"][name] = {"error": f"skipped: past the time budget of {a.budget_s} s (--budget-s)"}
                print(f"  {case:26s} {name:24s} skipped (time budget)", flush=True)
                continue
            box = []
            try:
                step = make_step(model, x, gout, training, box)
                run = runner(step, device, graph, warmup=a.warmup, params=list(model.parameters()))
                zero_grads(model)
                run()
                state = snapshot(model, box, training)
                if ref is None:
                    ref = state  # eager, as called: the reference of every other variant
                    result["reference_out_norm"] = state["out"].double().norm().item()  # 0: a meaningless check
                entry = {**timer(run), **compare(state, ref, tolerance, exact, result["variants"].get("eager"))}
            except Exception as e:  # recorded and reported; the other variants still run
                entry = {"error": f"{type(e).__name__}: {str(e)[:2000]}", "traceback": traceback.format_exc()[-3000:]}
                if graph:
                    entry["cuda_graph"] = "capture or replay failed (see error)"
            finally:
                # the last output would keep its autograd graph alive into the next variant's capture, whose
                # backward then accumulates into gradients through nodes made on the default stream (which
                # invalidates the capture: cudaErrorStreamCaptureImplicit)
                box.clear()
            entry["wall_s"] = round(time.perf_counter() - t0, 2)
            result["variants"][name] = entry
            print(f"  {case:26s} {name:24s} " + (f"{entry['median_ms']:9.3f} ms  out err {entry['out_rel_err']:.2e}"
                  + (f" (fp64: {entry['out_rel_err_fp64']:.2e})" if "out_rel_err_fp64" in entry else "")
                  + (f"  grad err {entry['grad_rel_err_max']:.2e} (fp64: median {entry['grad_rel_err_fp64_median']:.2e},"
                     f" max {entry['grad_rel_err_fp64_max']:.2e})" if "grad_rel_err_max" in entry else "")
                  if "median_ms" in entry else entry["error"].splitlines()[0][:200]), flush=True)
    eager = result["variants"].get("eager", {}).get("median_ms")
    for name, entry in result["variants"].items():
        base_name = "eager+cuda_graph" if name.endswith("+cuda_graph") else "eager"
        peer = result["variants"].get(base_name, {}).get("median_ms") or eager
        if "median_ms" in entry and peer:
            entry["speedup_vs_eager_same_mode"] = peer / entry["median_ms"]
    called = [v for v in models if "median_ms" in result["variants"].get(v, {})]  # eagerly called, timed above
    if len(called) > 1 and called[0] == "eager":
        box = []
        steps = {v: make_step(models[v], x, gout, training, box) for v in called}
        for name, ratio in timer.paired(steps, rounds=3 * timer.rounds).items():
            result["variants"][name]["speedup_vs_eager_paired"] = ratio
            print(f"  {case:26s} {name:24s} {ratio:9.3f}x eager, rounds alternating with it", flush=True)
        box.clear()
    if "tiledispatch" in models and a.layers and time.perf_counter() - a.started < a.budget_s:
        try:
            result["layers"] = layer_gaps(models["tiledispatch"], base, x, training, device,
                                          Timer(device, rounds=3 if a.quick else 5, target_ms=2 if a.quick else 5))
        except Exception as e:
            result["layers_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    return result


def layer_gaps(model, reference, x, training: bool, device: str, timer: Timer) -> list:
    """Each patched layer on its own input: the bundle against PyTorch's own forward (and backward for a training
    step), captured in CUDA graphs on the GPU so that only kernel time counts. The inputs are recorded from the
    unpatched reference model, so that a layer the bundle cannot run shows up as that layer's error."""
    patched = {n: m for n, m in model.named_modules() if hasattr(m, tdt._PATCH_ATTR)}
    inputs = {}  # layer name -> (its input, whether the model's backward pass asks for the input's gradient)

    def record(name):
        def hook(module, args) -> None:  # a pre-hook returning something would replace the layer's input
            inputs.setdefault(name, (args[0].detach().clone(), args[0].requires_grad))
        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in reference.named_modules() if n in patched]
    try:
        with torch.set_grad_enabled(training):
            reference(x)
    finally:
        for h in hooks:
            h.remove()
    zero_grads(reference)
    rows = []
    for name, (inp, input_grad) in inputs.items():
        module = patched[name]
        row = {"layer": name, "kind": type(module).__name__, "input": list(inp.shape)}
        for variant, forward in (("tiledispatch", module.forward), ("pytorch", type(module).forward.__get__(module))):
            def step(forward=forward):
                if training:  # as in the model: no input gradient for the first layer (it would need bwd_data)
                    xi = inp.detach().requires_grad_(input_grad)
                    y = forward(xi)
                    y.backward(torch.ones_like(y))
                else:
                    with torch.no_grad():
                        forward(inp)
            try:
                row[f"{variant}_ms"] = timer(runner(step, device, device == "cuda", warmup=2))["median_ms"]
            except Exception as e:
                row[f"{variant}_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        if "tiledispatch_ms" in row and "pytorch_ms" in row:
            row["speedup"] = row["pytorch_ms"] / row["tiledispatch_ms"]
        rows.append(row)
    zero_grads(model)
    return sorted(rows, key=lambda r: r.get("speedup", 0))


# -- host overhead -------------------------------------------------------------------------------------------
def host_overhead(reg, device: str, dtype: torch.dtype, rounds: int, calls: int = 200) -> dict:
    """Host time per call (median over rounds of `calls` back-to-back calls, the clock read when the last returns):
    tiledispatch.torch's linear / conv and patched nn.Linear / nn.Conv2d layers (inference: no grad needed) against
    the registry call they wrap and against PyTorch's functions and layers, on small problems whose kernels take
    less time than their host work on the GPU."""
    dev = torch.device(device)
    x, w = torch.randn(64, 256, device=dev).to(dtype), torch.randn(128, 256, device=dev).to(dtype)
    out = torch.empty(64, 128, device=dev, dtype=dtype)
    xc = torch.randn(8, 32, 14, 14, device=dev).to(dtype).contiguous(memory_format=torch.channels_last)
    wc = torch.randn(32, 32, 3, 3, device=dev).to(dtype).contiguous(memory_format=torch.channels_last)
    yc = torch.empty(8, 32, 14, 14, device=dev, dtype=dtype).contiguous(memory_format=torch.channels_last)
    bc = torch.randn(32, device=dev).to(dtype)
    handle = tdt.register(reg)
    # layers without bias whose parameters need no grad (inference), one patched and one plain, same weights
    linears = [nn.Linear(256, 128, bias=False, device=dev, dtype=dtype).requires_grad_(False) for _ in range(2)]
    convs = [nn.Conv2d(32, 32, 3, padding=1, bias=False, device=dev, dtype=dtype).requires_grad_(False)
             for _ in range(2)]
    for lin, conv in zip(linears, convs):
        lin.weight.copy_(w)
        conv.weight = nn.Parameter(wc, requires_grad=False)  # channels-last, used in place
    tdt.patch(linears[0], reg)
    tdt.patch(convs[0], reg)
    paths = {
        "registry.gemm(out=)": lambda: reg.gemm(x, w.t(), out),
        "tiledispatch.torch.linear": lambda: tdt.linear(x, w, registry=handle),
        "patched nn.Linear": lambda: linears[0](x),
        "torch.nn.functional.linear": lambda: F.linear(x, w),
        "torch nn.Linear": lambda: linears[1](x),
        "registry.conv_fwd(out=)": lambda: reg.conv_fwd(xc, wc, yc, padding=1, groups=1),
        "tiledispatch.torch.conv": lambda: tdt.conv(xc, wc, registry=handle, padding=1),
        "patched nn.Conv2d": lambda: convs[0](xc),
        "torch.nn.functional.conv2d": lambda: F.conv2d(xc, wc, padding=1),
        "torch nn.Conv2d": lambda: convs[1](xc),
        # a conv with an epilogue (what tiledispatch.torch.fuse makes of conv -> bn -> relu)
        "tiledispatch.torch.conv(bias, relu)": lambda: tdt.conv(xc, wc, bc, registry=handle, padding=1,
                                                                activation="relu"),
        "torch conv2d + relu": lambda: F.relu(F.conv2d(xc, wc, bc, padding=1)),
    }
    result = {}
    for name, fn in paths.items():
        try:
            for _ in range(20):
                fn()
            samples = []
            for _ in range(rounds):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples.append((time.perf_counter() - t0) / calls * 1e6)
            result[name] = {"median_us": statistics.median(samples), "min_us": min(samples)}
        except Exception as e:
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    if device == "cuda":
        torch.cuda.synchronize()
    result["registration"] = registration_overhead(rounds)
    return result


def registration_overhead(rounds: int) -> dict:
    """A trivial kernel (returns a new empty tensor) registered both ways: torch.library.custom_op against
    Library define + impl + register_fake (what tiledispatch.torch uses), host microseconds per call."""
    lib = torch.library.Library("td_bench_models", "FRAGMENT")
    lib.define("plain(Tensor a, int h) -> Tensor")
    lib.impl("plain", lambda a, h: torch.empty_like(a), "CompositeExplicitAutograd")
    torch.library.register_fake("td_bench_models::plain", lambda a, h: torch.empty_like(a), lib=lib)

    @torch.library.custom_op("td_bench_models::custom", mutates_args=())
    def custom(a: torch.Tensor, h: int) -> torch.Tensor:
        return torch.empty_like(a)

    custom.register_fake(lambda a, h: torch.empty_like(a))
    t = torch.randn(4, 4)
    paths = {"python function": lambda: torch.empty_like(t),
             "Library define + impl": lambda: torch.ops.td_bench_models.plain.default(t, 0),
             "torch.library.custom_op": lambda: torch.ops.td_bench_models.custom.default(t, 0)}
    out = {}
    for name, fn in paths.items():
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(1000):
                fn()
            samples.append((time.perf_counter() - t0) / 1000 * 1e6)
        out[name] = {"median_us": statistics.median(samples), "min_us": min(samples)}
    return out


# -- report ----------------------------------------------------------------------------------------------------
def machine(device: str, reg, bundle: str) -> dict:
    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "tiledispatch": td.__version__, "bundle": str(bundle), "bundle_kernels": len(reg.kernels),
            "backend": reg.backend, "arch": reg.arch}
    try:
        info["commit"] = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                                        text=True).stdout.strip()
    except OSError:
        pass
    try:
        import torchvision
        info["torchvision"] = torchvision.__version__
    except ImportError:
        info["torchvision"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def gpu_tag(name: str) -> str:
    """'h100' for 'NVIDIA H100 80GB HBM3': the model number, else the whole name as a file-name word."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", name)
    return (m.group(1) if m else re.sub(r"\W+", "_", name)).lower()


def finite(obj):
    """obj with NaN and infinities as None: standard JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = list(results["cases"])
    names = sorted({n for c in cases for n in results["cases"][c]["variants"]}, key=lambda n: (
        n.endswith("cuda_graph"), VARIANTS.index(n.split("+")[0])))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cases)), 4.5))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        vals = [results["cases"][c]["variants"].get(name, {}).get("speedup_vs_eager_same_mode", 0) for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], vals, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
    ax.set_xticklabels(cases, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("speedup over PyTorch eager (same mode: eager / CUDA graph)")
    ax.set_title(f"{results['machine'].get('gpu', results['machine'].get('cpu'))}: tiledispatch vs PyTorch")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True, help="a bundle built for this device (cutlass on the GPU)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default=None, choices=tuple(DTYPES), help="default: fp16 on cuda, fp32 on cpu")
    ap.add_argument("--models", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--quick", action="store_true", help="fewer timing rounds and iterations")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and stand-in models (for the CPU)")
    ap.add_argument("--no-layers", dest="layers", action="store_false", help="skip the per-layer comparison")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting new variants after this many seconds (they are recorded as skipped); "
                         "default 230 with --quick, else 420")
    ap.add_argument("--out", default=None, help="output folder (default: $OUT if set, else bench/results)")
    a = ap.parse_args()
    a.dtype = a.dtype or ("fp16" if a.device == "cuda" else "fp32")
    if a.budget_s is None:
        a.budget_s = 230.0 if a.quick else 420.0
    a.variants = [v for v in a.variants.split(",") if v]
    cases = [c for c in a.models.split(",") if c]
    unknown = sorted(set(cases) - set(CASES)) + sorted(set(a.variants) - set(VARIANTS))
    if unknown or "eager" not in a.variants:
        ap.error(f"unknown case(s) or variant(s): {unknown}" if unknown else "the eager variant is the reference")
    if a.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("no CUDA device: use --device cpu with a cpu bundle")
        torch.backends.cudnn.benchmark = True
    a.warmup = 2 if a.quick else 5
    timer = Timer(a.device, rounds=5 if a.quick else 15, target_ms=(5 if a.tiny else 20) if a.quick else 50)
    try:
        import torchvision.models as vision
    except ImportError:
        vision = None
    out_dir = Path(a.out or os.environ.get("OUT") or ROOT / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    reg = td.load(a.bundle)
    results = {"machine": machine(a.device, reg, a.bundle), "settings": {k: v for k, v in vars(a).items()},
               "cases": {}}
    started = a.started = time.perf_counter()
    for case in cases:
        print(f"{case}:", flush=True)
        try:
            results["cases"][case] = run_case(case, a, reg, vision, timer)
        except Exception as e:  # e.g. a model that cannot be built here: recorded, the other cases still run
            results["cases"][case] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:],
                                      "variants": {}}
            print(f"  {case}: {type(e).__name__}: {e}", flush=True)
        if a.device == "cuda":
            torch.cuda.empty_cache()
    results["host_overhead"] = host_overhead(reg, a.device, DTYPES[a.dtype], rounds=9 if a.quick else 41,
                                             calls=20 if a.tiny else 200)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    tag = "cpu_tiny" if a.tiny else ("cpu" if a.device == "cpu" else gpu_tag(results["machine"]["gpu"]))
    path = out_dir / f"models_{tag}.json"
    path.write_text(json.dumps(finite(results), indent=1, default=str, allow_nan=False))
    png = out_dir / f"models_{tag}.png"
    print(f"wrote {path}" + (f" and {png}" if plot(results, png) else " (no matplotlib: no PNG)"))
    summary(results)


def summary(results: dict) -> None:
    print("\ncase                        variant                   ms      x eager(same mode)  (paired)")
    for case, r in results["cases"].items():
        for name, e in r["variants"].items():
            if "median_ms" in e:
                ratio = f"{e.get('speedup_vs_eager_same_mode', 0):5.2f}"
                paired = f"  ({e['speedup_vs_eager_paired']:5.2f})" if "speedup_vs_eager_paired" in e else ""
                print(f"{case:27s} {name:22s} {e['median_ms']:9.3f}   {ratio}{paired}"
                      + ("" if e.get("out_within_tolerance", True) else
                         f"   OUTPUT ERROR {e['out_rel_err']:.2e} > {e['out_tolerance']:.0e} from eager, "
                         f"{e.get('out_rel_err_fp64', math.nan):.2e} from float64"))
            else:
                print(f"{case:27s} {name:22s}   error: {e['error'].splitlines()[0][:100]}")
        for layer in r.get("unsupported_layers", []):
            print(f"    on PyTorch: {layer['name']}: {layer['reason']}")
    for name, v in results["host_overhead"].items():
        if name != "registration":
            print(f"host {name:30s} " + (f"{v['median_us']:7.2f} us" if "median_us" in v else v["error"]))
    for name, v in results["host_overhead"]["registration"].items():
        print(f"registration {name:24s} {v['median_us']:7.2f} us")


if __name__ == "__main__":
    main()
