#!/usr/bin/env python3
"""Every shape runs (issue #17) on the GPU: validate the low-alignment and generic kernels against the float64
reference, then time the issue's problems through the public API against PyTorch (cuBLAS; cuDNN with
cudnn.benchmark) in the same process, outputs checked against PyTorch's.

    python3 bench/benchmarks/coverage_gpu.py BUNDLE --json OUT.json [--quick]

Validation: every kernel of the bundles with cutlass.align or a run-time-channel direct kernel, on the problem
classes its td_can_run model admits among a fixed list (odd M / N / K, leading dimension + 1; odd channel counts,
groups, strides, dilation, asymmetric padding, every rank), random data, outputs poisoned, through
reg.gemm / reg.conv_* with kernel= (the public API with the kernel named). A refusal of a class the model admits
is a failure too. Timing: reg.gemm(a, b, out=d) / reg.conv_*(..., out=) with the registry's own choice against
torch.matmul(out=) / F.conv / aten.convolution_backward, median of batched CUDA-event timings.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(REPO / "bench"))

import tiledispatch as td  # noqa: E402
from tiledispatch import backends, validation  # noqa: E402
from tiledispatch.ops import conv  # noqa: E402
from tiledispatch.ops.gemm import GemmProblem  # noqa: E402

import coverage  # noqa: E402
from _gpu_common import time_batch  # noqa: E402

TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8,
         "int32": torch.int32}
NUMPY_VIA = {torch.bfloat16: torch.float32}  # numpy has no bfloat16
DEVICE = "cuda"  # a smoke test of this script's logic sets "cpu" (with a cpu bundle)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return t.to(NUMPY_VIA.get(t.dtype, t.dtype)).numpy()


def fallback(key) -> bool:
    """The kernels this script validates: the low-alignment / generic ones and direct's run-time-channel ones."""
    return key.algorithm.extra("cutlass.align", 0) > 0 or (key.algorithm.pipeline == "direct"
                                                           and key.algorithm.extra("cutlass.cpg", 0) == 0)


# ---- GEMM ------------------------------------------------------------------------------------------------------
def gemm_operand(rows: int, cols: int, letter: str, dt: str, pad: int, gen) -> torch.Tensor:
    """A random [rows, cols] matrix, row-major (r) or column-major (c), its leading dimension `pad` elements longer
    than its contiguous extent (a view into a larger buffer)."""
    outer, inner = (rows, cols) if letter == "r" else (cols, rows)
    if TORCH[dt].is_floating_point:
        base = (torch.rand((outer, inner + pad), generator=gen, device=DEVICE) * 1.9 - 0.95)
        base = base + torch.where(base >= 0, 0.05, -0.05)
    else:
        base = torch.randint(1, 9, (outer, inner + pad), generator=gen, device=DEVICE) * (
            torch.randint(0, 2, (outer, inner + pad), generator=gen, device=DEVICE) * 2 - 1)
    t = base.to(TORCH[dt])[:, :inner]
    return t if letter == "r" else t.t()


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(torch.iinfo(t.dtype).min if not t.dtype.is_floating_point else float("nan"))


VALIDATE_GEMMS = ((1, 1, 1), (3, 7, 65), (65, 129, 256), (777, 65, 7), (64, 64, 64), (7, 777, 3), (129, 50, 1031))


def validate_gemm(reg, kern, gen) -> list[dict]:
    key, out = kern.key, []
    sig = key.signature
    for (m, n, k) in VALIDATE_GEMMS:
        for pad in (0, 1):
            p = GemmProblem(m, n, k, sig.dtype_a, sig.dtype_b, sig.dtype_c, sig.layout)
            if p.mismatch(key) is not None:  # a fused epilogue: not this script's
                continue
            extents = {"a": k if sig.layout[0] == "r" else m, "b": n if sig.layout[1] == "r" else k, "c": n}
            if coverage.model_refusal(p, key, {r: e + pad for r, e in extents.items()}) not in (None, NotImplemented):
                continue
            a = gemm_operand(m, k, sig.layout[0], sig.dtype_a, pad, gen)
            b = gemm_operand(k, n, sig.layout[1], sig.dtype_b, pad, gen)
            d = poisoned_like(gemm_operand(m, n, "r", sig.dtype_c, pad, gen))
            entry = {"kernel": kern.name, "problem": f"{m}x{n}x{k} ld+{pad}"}
            try:
                reg.gemm(a, b, out=d, kernel=kern)
                sync()
                ref = to_numpy(a).astype(np.float64) @ to_numpy(b).astype(np.float64)
                entry.update(validation.compare(to_numpy(d), ref, key))
            except Exception as e:  # noqa: BLE001  (a refusal of an admitted class is a failure)
                entry.update(passed=False, error=f"{type(e).__name__}: {e}")
            out.append(entry)
    return out


# ---- conv ------------------------------------------------------------------------------------------------------
VALIDATE_CONV_CHANNELS = (("C1 K8", 1, 1, 8), ("C3 K16", 1, 3, 16), ("C16 K3", 1, 16, 3), ("C5 K7", 1, 5, 7),
                          ("C65 K33", 1, 65, 33), ("G4 C/G3 K/G3", 4, 12, 12), ("G3 C/G3 K/G5", 3, 9, 15))
VALIDATE_CONV_SIZES = {1: (61,), 2: (13, 14), 3: (5, 6, 7)}


def validate_conv(reg, kern, gen_np) -> list[dict]:
    key, out = kern.key, []
    classes = coverage.conv_classes(directions=(key.signature.direction,), ranks=(key.signature.spatial_dims,),
                                    channels=VALIDATE_CONV_CHANNELS, sizes=VALIDATE_CONV_SIZES, named=())
    for label, p, _ in classes:
        if p.mismatch(key) is not None or coverage.model_refusal(p, key, None) not in (None, NotImplemented):
            continue
        data, expect = validation.conv_case(p, gen_np)  # explicit group form, numpy
        t = {r: torch.from_numpy(v).to(DEVICE) for r, v in data.items()}
        entry = {"kernel": kern.name, "problem": label}
        geo = dict(stride=p.stride, dilation=p.dilation, pad_lo=p.pad_lo, pad_hi=p.pad_hi)
        try:
            call = {"fwd": lambda: reg.conv_fwd(t["x"], t["w"], out=t["y"], kernel=kern, **geo),
                    "bwd_data": lambda: reg.conv_bwd_data(t["y"], t["w"], out=t["x"], kernel=kern, **geo),
                    "bwd_weight": lambda: reg.conv_bwd_weight(t["x"], t["y"], out=t["w"], kernel=kern, **geo)}
            call[p.direction]()
            sync()
            entry.update(validation.compare(to_numpy(t[conv.WRITES[p.direction]]), expect, key))
        except Exception as e:  # noqa: BLE001
            entry.update(passed=False, error=f"{type(e).__name__}: {e}")
        out.append(entry)
    return out


# ---- timing ----------------------------------------------------------------------------------------------------


TIMED_GEMMS = (("fp16", 777, 1234, 4320), ("fp16", 65, 129, 256), ("fp16", 3, 50257, 768),
               ("bf16", 777, 1234, 4320), ("bf16", 1024, 1024, 1023), ("bf16", 3, 50257, 768),
               ("fp32", 777, 1234, 4320), ("fp32", 1000, 1001, 999))


def time_gemm(reg, dt, m, n, k, gen) -> dict:
    a = gemm_operand(m, k, "r", dt, 0, gen)
    b = gemm_operand(k, n, "c", dt, 0, gen)  # rcr: B column-major, the transpose of an [n, k] row-major array
    ours, theirs = poisoned_like(torch.empty((m, n), dtype=TORCH[dt], device=DEVICE)), torch.empty(
        (m, n), dtype=TORCH[dt], device=DEVICE)
    entry = {"op": "gemm", "dtype": dt, "problem": f"{m}x{n}x{k} rcr", "flops": 2 * m * n * k}
    torch.matmul(a, b, out=theirs)
    reg.gemm(a, b, out=ours)
    sync()
    err = (ours.double() - theirs.double()).norm() / theirs.double().norm()
    entry["rel_error_vs_torch"] = float(err)
    entry["kernel"] = reg.select(GemmProblem(m, n, k, dt, dt, dt, "rcr")).name
    entry["torch_ms"] = time_batch(lambda: torch.matmul(a, b, out=theirs), 20, 15, warmup=3)
    entry["ours_ms"] = time_batch(lambda: reg.gemm(a, b, out=ours), 20, 15, warmup=3)
    entry["speedup"] = entry["torch_ms"] / entry["ours_ms"]
    return entry


# (label, N, G, C, K, size, filter, stride, dilation, padding) with symmetric padding (PyTorch's)
TIMED_CONVS = (
    ("resnet stem 7x7/2 C3 K64", 32, 1, 3, 64, (224, 224), (7, 7), (2, 2), (1, 1), (3, 3)),
    ("audio front end 10/5 C1 K512", 8, 1, 1, 512, (16000,), (10,), (5,), (1,), (0,)),
    ("odd dense 3x3 C65 K65 56x56", 32, 1, 65, 65, (56, 56), (3, 3), (1, 1), (1, 1), (1, 1)),
    ("grouped 3x3 G4 C/G3 K/G3 56x56", 32, 4, 12, 12, (56, 56), (3, 3), (1, 1), (1, 1), (1, 1)),
    ("odd 3D 3x3x3 C5 K7 16x32x32", 4, 1, 5, 7, (16, 32, 32), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1)),
    ("odd strided 3x3/2 dil 2 C33 K17", 16, 1, 33, 17, (64, 64), (3, 3), (2, 2), (2, 2), (2, 2)),
)


def logical(lead: int, chan: int, sp, gen) -> torch.Tensor:
    """[lead, chan, *sp] fp16 with channels-last memory (1D: [lead, chan, W] over [lead, W, chan])."""
    t = (torch.rand((lead, *sp, chan), generator=gen, device=DEVICE) * 2 - 1).to(torch.float16)
    return t.permute(0, len(sp) + 1, *range(1, len(sp) + 1))


def time_conv(reg, case, direction, gen) -> dict:
    label, n, g, c, k, size, f, s, d, pad = case
    rank = len(size)
    p = conv.ConvProblem(direction, n, g, c, k, size, f, s, d, pad, pad, "fp16", "fp16", "fp16")
    x, w, y = logical(n, c, size, gen), logical(k, c // g, f, gen), logical(n, k, p.out_size, gen)
    entry = {"op": "conv", "case": label, "direction": direction, "problem": str(p), "flops": p.flops()}
    # cuDNN: 1D as 2D with H = 1 (NHWC)
    tx, tw, ty = (t.unsqueeze(2) for t in (x, w, y)) if rank == 1 else (x, w, y)
    ts, tp, tdl = (([one] + list(v)) if rank == 1 else list(v) for one, v in ((1, s), (0, pad), (1, d)))
    fn = torch.nn.functional.conv3d if rank == 3 else torch.nn.functional.conv2d
    if direction == "fwd":
        ref_call = lambda: fn(tx, tw, None, ts, tp, tdl, g)  # noqa: E731
    else:
        mask = [direction == "bwd_data", direction == "bwd_weight", False]
        ref_call = lambda: torch.ops.aten.convolution_backward(  # noqa: E731
            ty, tx, tw, None, ts, tp, tdl, False, [0] * len(ts), g, mask)
    ref = ref_call()
    ref = ref if direction == "fwd" else (ref[0] if direction == "bwd_data" else ref[1])
    written = {"fwd": y, "bwd_data": x, "bwd_weight": w}[direction]
    geo = dict(stride=s, dilation=d, padding=pad, groups=g)
    ours_call = {"fwd": lambda: reg.conv_fwd(x, w, out=y, **geo),
                 "bwd_data": lambda: reg.conv_bwd_data(y, w, out=x, **geo),
                 "bwd_weight": lambda: reg.conv_bwd_weight(x, y, out=w, **geo)}[direction]
    written.fill_(float("nan"))
    ours_call()
    sync()
    ref = ref.reshape(written.shape).double()
    entry["rel_error_vs_torch"] = float((written.double() - ref).norm() / ref.norm())
    entry["kernel"] = reg.select(p).name
    entry["cudnn_ms"] = time_batch(ref_call, 20, 15, warmup=3)
    entry["ours_ms"] = time_batch(ours_call, 20, 15, warmup=3)
    entry["speedup"] = entry["cudnn_ms"] / entry["ours_ms"]
    return entry


def run_safely(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  (one case's error must not hide the others')
        return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path, help="a cutlass bundle with the GEMM and conv kernels")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="validation only on the issue's timing cases")
    a = ap.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True  # our fp32 GEMMs run tf32 math; compare like with like
    gen = torch.Generator(device=DEVICE).manual_seed(17)
    gen_np = np.random.default_rng(17)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "validation": [], "timing": []}
    t0 = time.time()
    reg = td.load(a.bundle)
    for kern in reg.kernels:
        if not fallback(kern.key) or a.quick:
            continue
        entries = validate_gemm(reg, kern, gen) if kern.key.signature.op == "gemm" else validate_conv(reg, kern, gen_np)
        result["validation"] += entries
        bad = [e for e in entries if not e.get("passed")]
        print(f"validate {kern.name}: {len(entries) - len(bad)}/{len(entries)} passed"
              + (f"; first failure {bad[0]}" if bad else ""), flush=True)
    failures = [e for e in result["validation"] if not e.get("passed")]
    print(f"validation: {len(result['validation'])} cases, {len(failures)} failures ({time.time() - t0:.0f} s)",
          flush=True)
    for dt, m, n, k in TIMED_GEMMS:
        e = run_safely(time_gemm, reg, dt, m, n, k, gen)
        e.setdefault("problem", f"gemm {dt} {m}x{n}x{k}")
        result["timing"].append(e)
        print(f"gemm {dt:5s} {m}x{n}x{k:<6d} " + (f"torch {e['torch_ms'] * 1e3:9.1f} us  ours {e['ours_ms'] * 1e3:9.1f} us"
              f"  x{e['speedup']:.2f}  err {e['rel_error_vs_torch']:.1e}  {e['kernel']}" if "error" not in e
              else e["error"]), flush=True)
    for case in TIMED_CONVS:
        for direction in ("fwd", "bwd_data", "bwd_weight"):
            e = run_safely(time_conv, reg, case, direction, gen)
            e.setdefault("case", case[0])
            e.setdefault("direction", direction)
            result["timing"].append(e)
            print(f"conv {case[0]:34s} {direction:10s} " + (
                f"cuDNN {e['cudnn_ms'] * 1e3:9.1f} us  ours {e['ours_ms'] * 1e3:9.1f} us  x{e['speedup']:.2f}  "
                f"err {e['rel_error_vs_torch']:.1e}  {e['kernel']}" if "error" not in e else e["error"]), flush=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
