"""Host overhead per GEMM call on the GPU: tiledispatch's paths against a raw C call and torch.mm.

    python bench/host_overhead.py BUNDLE [--out DIR]

At 128^3 fp16 the GPU finishes each call before the host issues the next, so time per call is host
time. Paths: the raw td_run through ctypes with prebuilt arguments; torch.mm; Registry.gemm with an
explicit stream, with the current torch stream (the default), and with kernel selection; a Plan.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

import gemm as gemm_bench  # noqa: E402  (bench/gemm.py)
import tiledispatch as td  # noqa: E402
from _gpu_common import machine, random_tensor  # noqa: E402
from tiledispatch.ops import gemm as gemm_op  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    reg = td.load(a.bundle)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    stream = torch.cuda.current_stream().cuda_stream
    result = gemm_bench.host_overhead(reg, gen, stream)  # raw, torch.mm, gemm with an explicit stream

    a16, bt = random_tensor((128, 128), "fp16", gen), random_tensor((128, 128), "fp16", gen)
    d = torch.empty((128, 128), dtype=torch.float16, device="cuda")
    name = result["kernel"]
    plan = reg.plan(gemm_op.operands(a16, bt.t(), d)[0], kernel=name)
    tensors = {"a": a16, "b": bt.t(), "out": d}
    b_t = bt.t()
    per_call = gemm_bench.per_call_us
    result["tiledispatch_gemm_current_stream_us"] = per_call(lambda: reg.gemm(a16, b_t, out=d, kernel=name))
    result["tiledispatch_gemm_selected_current_stream_us"] = per_call(lambda: reg.gemm(a16, b_t, out=d))
    result["tiledispatch_plan_us"] = per_call(lambda: plan(tensors))
    raw = result["raw_c_call_us"]
    for key in ("tiledispatch_gemm_current_stream_us", "tiledispatch_gemm_selected_current_stream_us",
                "tiledispatch_plan_us"):
        result[key.replace("_us", "_above_raw_us")] = result[key] - raw
    report = {"machine": machine(), "host_overhead": result}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "host_overhead_h100.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
