"""Validate every GEMM kernel of one or more cutlass bundles on the GPU against a float64 torch reference.

    python bench/validation/validate_gpu.py BUNDLE_DIR [BUNDLE_DIR ...] [--json out.json]

Per kernel: random inputs (never zeros) in the kernel's layout, output poisoned with NaN (int:
INT_MIN) first, shapes that are not multiples of any tile (also batched, small M, long K), beta = 0
with no C (NULL) and beta != 0 with C, the kernel's bias / residuals / activation with alpha != 1,
and the run-time raster order / swizzle parameters. Pass: every element written and
||out - ref|| / ||ref|| within the rules' tolerance for the output dtype. Also checks that a problem
violating 16-byte alignment is refused as unsupported. Exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared modules

from _gpu_common import Launcher, machine, matching, operands, poisoned, random_tensor, reference
from tiledispatch import abi, backends, load
from tiledispatch.validation import tolerance

# (m, n, k, batch, beta, raster, swizzle): dims are multiples of 16 (16-byte rows for every dtype)
# but of no tile size; the last rows exercise run-time raster order and swizzle.
PROBLEMS = [
    (272, 208, 336, 1, 0.0, 0, 0),
    (1040, 1008, 1024, 1, 0.5, 0, 0),
    (96, 240, 2064, 3, -0.25, 0, 0),
    (16, 512, 512, 1, 0.0, 0, 0),
    (784, 912, 256, 1, 0.0, 1, 2),
    (784, 912, 256, 2, 0.5, 2, 8),
]
ALPHA, LOW, HIGH = 0.75, -0.4, 0.6


def check_kernel(kern, gen, stream) -> list[dict]:
    key = kern.key
    sig = key.signature
    epi = sig.epilogue
    launcher = Launcher(kern)
    tol = tolerance(key)
    results = []
    for m, n, k, batch, beta, raster, swizzle in PROBLEMS:
        if key.algorithm.pipeline == "multistage" and raster == 2:
            raster = 1  # CUTLASS 2.x kernels (sm80, and sm90a's low-alignment ones) raster along M only
        a = random_tensor((batch, m, k), sig.dtype_a, gen, sig.layout_a)
        b = random_tensor((batch, k, n), sig.dtype_b, gen, sig.layout_b)
        c = random_tensor((batch, m, n), sig.dtype_c, gen) if beta else None
        bias = random_tensor((n,), sig.dtype_c, gen) if epi.bias else None
        res = tuple(random_tensor((batch, m, n), sig.dtype_c, gen) for _ in range(epi.residuals))
        d = poisoned((batch, m, n), sig.dtype_c)
        problem, ops = operands(a, b, d, c, bias, res, epi.activation)
        entry = {"kernel": kern.name, "m": m, "n": n, "k": k, "batch": batch, "beta": beta,
                 "raster": raster, "swizzle": swizzle}
        try:
            args = launcher.args(problem, ops, stream, alpha=ALPHA, beta=beta, clamp=(LOW, HIGH),
                                 raster=raster, swizzle=swizzle)
            launcher.run(args)
            torch.cuda.synchronize()
        except Exception as e:  # a refusal or launch failure is a failed check here
            results.append({**entry, "passed": False, "error": str(e)})
            continue
        ref = reference(a, b, c, bias, res, act=epi.activation, alpha=ALPHA, beta=beta, low=LOW, high=HIGH,
                        int_out=sig.dtype_c == "int32")
        out = d.double()
        written = bool(torch.isfinite(out).all()) and not (sig.dtype_c == "int32" and bool((d == -2**31).any()))
        err = float(torch.linalg.norm(out - ref) / torch.linalg.norm(ref)) if written else float("inf")
        results.append({**entry, "rel_error": err, "tolerance": tol, "all_written": written,
                        "passed": written and err <= tol})
    # an N that breaks 16-byte rows of D: refused (TD_UNSUPPORTED, never run) by the kernels that need them, and
    # run correctly by those that store D element by element (cutlass.align), as the family's model says
    m, n, k = 64, 72 + 1, 64
    a = random_tensor((1, m, k), sig.dtype_a, gen, sig.layout_a)
    b = random_tensor((1, k, n), sig.dtype_b, gen, sig.layout_b)
    bias = random_tensor((n,), sig.dtype_c, gen) if epi.bias else None
    res = tuple(random_tensor((1, m, n), sig.dtype_c, gen) for _ in range(epi.residuals))
    d = poisoned((1, m, n), sig.dtype_c)
    problem, ops = operands(a, b, d, None, bias, res, epi.activation)
    args = launcher.args(problem, ops, stream, alpha=ALPHA, clamp=(LOW, HIGH))
    status, reason = kern.library.can_run(args)
    expect_refused = backends.family_of(key).module.refusal(problem, key) is not None
    entry = {"kernel": kern.name, "m": m, "n": n, "k": k, "batch": 1,
             "expect": "unsupported" if expect_refused else "runs", "status": status, "reason": reason}
    if expect_refused or status != abi.OK:
        results.append({**entry, "passed": expect_refused and status == abi.UNSUPPORTED})
        return results
    launcher.run(args)
    torch.cuda.synchronize()
    ref = reference(a, b, None, bias, res, act=epi.activation, alpha=ALPHA, beta=0.0, low=LOW, high=HIGH,
                    int_out=sig.dtype_c == "int32")
    out = d.double()
    written = bool(torch.isfinite(out).all()) and not (sig.dtype_c == "int32" and bool((d == -2**31).any()))
    err = float(torch.linalg.norm(out - ref) / torch.linalg.norm(ref)) if written else float("inf")
    results.append({**entry, "rel_error": err, "tolerance": tol, "all_written": written,
                    "passed": written and err <= tol})
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="a regular expression: validate only the kernels it matches")
    opts = ap.parse_args()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    stream = torch.cuda.current_stream().cuda_stream
    all_results, failed, start = [], [], time.time()
    for path in opts.bundles:
        reg = load(path)
        print(f"{path}: {len(reg.kernels)} kernels ({reg.backend}/{reg.arch})", flush=True)
        for kern in matching(reg.kernels, opts.only):
            if kern.key.signature.op != "gemm":  # convolution kernels have their own checks
                print(f"  skip {kern.name} (not a GEMM)", flush=True)
                continue
            t0 = time.time()
            results = check_kernel(kern, gen, stream)
            all_results += results
            bad = [r for r in results if not r["passed"]]
            worst = max((r.get("rel_error", 0.0) for r in results), default=0.0)
            print(f"  {'ok  ' if not bad else 'FAIL'} {kern.name}  worst rel err {worst:.2e}  ({time.time() - t0:.1f} s)",
                  flush=True)
            for r in bad:
                print(f"       {r}", flush=True)
                failed.append(r)
    summary = {"machine": machine(), "kernels": len({r['kernel'] for r in all_results}), "checks": len(all_results),
               "failed": len(failed), "seconds": round(time.time() - start, 1), "results": all_results}
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(summary, f, indent=1)
    print(f"validated {summary['kernels']} kernels, {summary['checks']} checks, {len(failed)} failed "
          f"in {summary['seconds']} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
