"""The sm90 kernels' launch cache on the GPU: the host's cost of a public call whose td_args repeat the last launch's
(the kernel reuses its checked arguments and TMA parameters) against one whose output alternates between two tensors
(every launch builds them again), through the public call and the raw C call (td_run on td_args bound once), and
the results of both ways checked against PyTorch in float64.

    python bench/benchmarks/launch_cache_probe.py BUNDLE --out results.json

For each kernel of the bundle (conv fwd / bwd_data with tma_ws_conv, GEMM sm90; others are skipped) one small
problem, so the call is host-bound: the host time per call is the median over 21 rounds of 200 calls (perf_counter,
no synchronization inside a round), the two ways interleaved by round. The public call's alternating way also pays
the Python fast path's pointer swap; the raw call's difference is the kernel's own.
"""
from __future__ import annotations

import argparse
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
            if sig.direction == "fwd":
                yield (kern, lambda out, x=x, w=w, k=kern: reg.conv_fwd(x, w, out=out, padding=1, groups=1, kernel=k.name),
                       lambda out, x=x, w=w: conv_op.operands("fwd", x, w, out, padding=1, groups=1), outs,
                       F.conv2d(x.double(), w.double(), padding=1))
            else:  # dY is x's shape at stride 1, padding 1
                yield (kern, lambda out, dy=x, w=w, k=kern: reg.conv_bwd_data(dy, w, out=out, padding=1, groups=1, kernel=k.name),
                       lambda out, dy=x, w=w: conv_op.operands("bwd_data", out, w, dy, padding=1, groups=1), outs,
                       torch.nn.grad.conv2d_input(x.shape, w.double(), x.double(), padding=1))


def raw_call(reg, kern, problem_and_operands):
    """The kernel's td_run on td_args bound once (the raw C call)."""
    problem, operands = problem_and_operands
    args = bind(reg, problem, kern, operands)
    status, reason = kern.library.run(args)
    if status:
        raise RuntimeError(f"{kern.name}: td_run status {status}: {reason}")
    return lambda: kern.library.run(args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    reg = td.load(a.bundle)
    gen = torch.Generator(device="cuda" if reg.device == "cuda" else "cpu").manual_seed(7)
    rows = []
    for kern, call, operands, outs, want in cases(reg, gen):
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
        raw = [raw_call(reg, kern, operands(out)) for out in outs]
        timed = {"public": ([lambda: call(outs[0])], [lambda: call(outs[0]), lambda: call(outs[1])]),
                 "raw": ([raw[0]], raw)}
        row = {"kernel": kern.name, "max_rel_error": max(errors), "ok": max(errors) < 2e-3}
        for path, (repeated, alternating) in timed.items():
            same, other = [], []
            for _ in range(ROUNDS):
                same.append(host_us(repeated))
                other.append(host_us(alternating))
            row[f"{path}_host_us_repeated"] = statistics.median(same)
            row[f"{path}_host_us_alternating"] = statistics.median(other)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"machine": machine() if reg.device == "cuda" else None, "bundle": a.bundle, "method": __doc__.split("\n\n")[2].replace("\n", " "),
              "rows": rows}
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
