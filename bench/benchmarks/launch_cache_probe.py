"""The sm90 kernels' launch cache on the GPU: the host's cost of a public call whose td_args repeat the last launch's
(the kernel reuses its checked arguments and TMA parameters) against one whose output alternates between two tensors
(every launch builds them again), through the public call and the raw C call (td_run on td_args bound once), and
the results of both ways checked against PyTorch in float64.

    python bench/benchmarks/launch_cache_probe.py BUNDLE --out results.json

Each GEMM and 2D conv fwd / bwd_data kernel of the bundle runs one small fp16 problem (kernels that refuse it are
skipped). The sm90 GEMM and TMA conv kernels keep a launch cache; the others, such as an implicit-GEMM conv, show a
launch without one. The problem is small so that the call is host-bound: the host time per call is the median over
21 rounds of 200 calls (perf_counter, no synchronization inside a round), the two ways interleaved by round. The
public call's alternating way also pays the Python fast path's pointer swap; the raw call's difference is the
kernel's own.

Beside them, what a launch costs at the least (`floors`, same timing): a ctypes call of the library's td_abi_version
(no arguments), each kernel's td_can_run on the bound td_args (its checks, no CUDA call), the CUDA driver's
cuLaunchKernel of an empty kernel through ctypes (tiledispatch.cuda's delay kernel, 0 ns) and PyTorch's own launch
of an empty kernel (torch.cuda._sleep(0)): where a kernel's raw call lies between them says how much of it is the
kernel library's own work.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared modules

from _gpu_common import machine, random_tensor  # noqa: E402
import tiledispatch as td  # noqa: E402
from tiledispatch import abi, cuda  # noqa: E402
from tiledispatch.errors import UnsupportedProblemError  # noqa: E402
from tiledispatch.ops import conv as conv_op, gemm as gemm_op  # noqa: E402
from tiledispatch.plan import bind  # noqa: E402

ROUNDS, CALLS = 21, 200


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(calls: list) -> float:
    """Host microseconds per call of CALLS calls, taking the functions in turn."""
    sync()
    turns = calls * (CALLS // len(calls))
    start = time.perf_counter()
    for fn in turns:
        fn()
    took = (time.perf_counter() - start) / len(turns) * 1e6
    sync()
    return took


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def cases(reg, gen):
    """(kernel, call(out) through the public API, operands(out) -> (problem, Operands), two outputs, the float64
    result) per kernel the probe covers."""
    for kern in reg.kernels:
        sig = kern.key.signature
        if sig.op == "gemm":
            a, b = random_tensor((256, 512), "fp16", gen), random_tensor((384, 512), "fp16", gen).t()
            outs = [torch.empty(256, 384, dtype=torch.float16, device=gen.device) for _ in range(2)]
            yield (kern, lambda out, a=a, b=b, k=kern: reg.gemm(a, b, out=out, kernel=k.name),
                   lambda out, a=a, b=b: gemm_op.operands(a, b, out), outs, a.double() @ b.double())
        elif sig.op == "conv" and sig.direction in ("fwd", "bwd_data") and sig.spatial_dims == 2:
            x = random_tensor((8, 64, 16, 16), "fp16", gen).to(memory_format=torch.channels_last)
            w = random_tensor((64, 64, 3, 3), "fp16", gen).to(memory_format=torch.channels_last)
            outs = [torch.empty_like(x) for _ in range(2)]
            geo = {"padding": 1, "groups": 1}
            if sig.direction == "fwd":
                yield (kern, lambda out, x=x, w=w, k=kern: reg.conv_fwd(x, w, out=out, kernel=k.name, **geo),
                       lambda out, x=x, w=w: conv_op.operands("fwd", x, w, out, **geo), outs,
                       F.conv2d(x.double(), w.double(), padding=1))
            else:  # dY is x's shape at stride 1, padding 1
                yield (kern, lambda out, dy=x, w=w, k=kern: reg.conv_bwd_data(dy, w, out=out, kernel=k.name, **geo),
                       lambda out, dy=x, w=w: conv_op.operands("bwd_data", out, w, dy, **geo), outs,
                       torch.nn.grad.conv2d_input(x.shape, w.double(), x.double(), padding=1))


def raw_call(reg, kern, problem_and_operands):
    """The kernel's td_run on td_args bound once (the raw C call, as a prepared launch makes it), and its td_can_run
    on the same arguments."""
    problem, operands = problem_and_operands
    args = bind(reg, problem, kern, operands)
    status, reason = kern.library.run(args)
    if status:
        raise RuntimeError(f"{kern.name}: td_run status {status}: {reason}")
    ref, buffer = ctypes.byref(args), ctypes.create_string_buffer(abi.REASON_BYTES)
    can_run = kern.library._lib["td_can_run"]  # without argtypes, as KernelLibrary.launch
    can_run.restype = ctypes.c_int32
    launch = kern.library.launch
    return (lambda: launch(ref, buffer, abi.REASON_BYTES_ARG)), (lambda: can_run(ref, buffer, abi.REASON_BYTES_ARG))


def median_host_us(fn) -> float:
    return statistics.median(host_us([fn]) for _ in range(ROUNDS))


def launch_floors(lib) -> dict:
    """Host microseconds of the cheapest calls around a launch (the module docstring's floors)."""
    floors = {"ctypes_call_us": median_host_us(lib._lib.td_abi_version)}
    if not torch.cuda.is_available():
        return floors
    stream = torch.cuda.current_stream().cuda_stream
    function = cuda._delay_kernel()
    driver = ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_LOCAL)["cuLaunchKernel"]  # no argtypes: as td_run's entry
    ns = ctypes.c_uint64(0)
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(ns), ctypes.c_void_p))
    one, zero, no_extra = ctypes.c_uint(1), ctypes.c_uint(0), ctypes.c_void_p(None)
    on = ctypes.c_void_p(stream)
    floors["driver_launch_us"] = median_host_us(
        lambda: driver(function, one, one, one, one, one, one, zero, on, params, no_extra))
    floors["torch_launch_us"] = median_host_us(lambda: torch.cuda._sleep(0))
    sync()
    return floors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    reg = td.load(a.bundle)
    gen = torch.Generator(device="cuda" if reg.device == "cuda" else "cpu").manual_seed(7)
    rows = []
    for kern, call, operands, outs, want in cases(reg, gen):
        try:
            call(outs[0])
        except UnsupportedProblemError as e:
            print(f"skipped {kern.name}: {str(e).splitlines()[0]}", flush=True)
            continue
        errors = []
        for _ in range(3):  # alternating outputs: each launch's parameters differ from the last one's
            for out in outs:
                out.fill_(float("nan"))
                call(out)
                sync()
                errors.append(rel_error(out, want))
        for out in outs:  # the same output again and again: the launch cache's parameters
            out.fill_(float("nan"))
            for _ in range(3):
                call(out)
            sync()
            errors.append(rel_error(out, want))
        raw, checks = zip(*(raw_call(reg, kern, operands(out)) for out in outs))
        timed = {"public": ([lambda: call(outs[0])], [lambda: call(outs[0]), lambda: call(outs[1])]),
                 "raw": ([raw[0]], list(raw))}
        row = {"kernel": kern.name, "max_rel_error": max(errors), "ok": max(errors) < 2e-3}
        for path, (repeated, alternating) in timed.items():
            same, other = [], []
            for _ in range(ROUNDS):
                same.append(host_us(repeated))
                other.append(host_us(alternating))
            row[f"{path}_host_us_repeated"] = statistics.median(same)
            row[f"{path}_host_us_alternating"] = statistics.median(other)
        row["can_run_host_us"] = median_host_us(checks[0])
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"machine": machine() if reg.device == "cuda" else None, "bundle": a.bundle,
              "method": " ".join(__doc__.split("\n\n")[2:4]).replace("\n", " "),
              "floors": launch_floors(reg.kernels[0].library), "rows": rows}
    print(json.dumps(result["floors"]), flush=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
